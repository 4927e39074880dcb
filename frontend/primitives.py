"""``shared(...)``, ``agent(...)`` and ``workflow(...)``: marks a plain ``sgl.function`` program can carry.

Both return ordinary SGLang IR, so any backend and SGLang's own interpreter run
the program unchanged (a stock backend simply sees the text). The marks ride on
SGLang's variable scopes: ``SglVarScopeBegin(name)`` stores the current text
offset in ``state.variables[name]``, forks copy the variables together with
the text, and a backend reads them back at ``generate`` time
(``collect_marks``). No SGLang class is patched.

::

    s += workflow("ticket-4711")               # optional: the reuse scope (one team's run)
    s += agent("solver")                       # who speaks from here on
    s += sgl.system("You solve math problems.")
    s += sgl.user(shared(question, slot="query"))
    s += sgl.assistant(sgl.gen("answer", max_new_tokens=128))

Mark names look like ``__kvshare__:<seq>:<what>[:<arg>]``; ``seq`` is a process-
wide counter, so marks sort in program order even across forks.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from sglang.lang.ir import SglConstantText, SglExprList, SglVarScopeBegin

from sglang_kvshare.protocol import MAX_NAME_CHARS

MARK_PREFIX = "__kvshare__:"
_seq = itertools.count()
_seq_lock = threading.Lock()


def _next_seq() -> int:
    with _seq_lock:
        return next(_seq)


def _check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"{what} must be a non-empty string of at most {MAX_NAME_CHARS} characters, got {name!r}")
    return name


class SharedText(SglExprList):
    """Text many agents see, in a named slot (``query``, ``out:solver``).

    Executes as ``[begin mark, SglConstantText(text), end mark]``. ``token_ids``
    (optional) pins the exact ids to send for this text, e.g. a producer's
    generated ids; otherwise the backend looks the text up among outputs it
    generated, then tokenizes it on its own.
    """

    def __init__(self, text: str, slot: str, token_ids: Optional[Sequence[int]] = None) -> None:
        seq = _next_seq()
        self.text = str(text)
        self.slot = _check_name("slot", slot)
        self.token_ids = None if token_ids is None else tuple(int(t) for t in token_ids)
        self.begin_name = f"{MARK_PREFIX}{seq:012d}:shared:{self.slot}"
        self.end_name = f"{MARK_PREFIX}{seq:012d}:end"
        super().__init__([SglVarScopeBegin(self.begin_name), SglConstantText(self.text),
                          SglVarScopeBegin(self.end_name)])
        if self.token_ids is not None:
            _PINNED[self.begin_name] = self.token_ids


class AgentMark(SglVarScopeBegin):
    """Declares the agent a program (or a fork) speaks for from this point on."""

    def __init__(self, name: str) -> None:
        self.agent = _check_name("agent name", name)
        super().__init__(f"{MARK_PREFIX}{_next_seq():012d}:agent:{self.agent}")


class WorkflowMark(SglVarScopeBegin):
    """Names the workflow (reuse scope) a program or fork belongs to from this point on."""

    def __init__(self, name: str) -> None:
        self.workflow = _check_name("workflow name", name)
        super().__init__(f"{MARK_PREFIX}{_next_seq():012d}:workflow:{self.workflow}")


def shared(text: Any, slot: str, token_ids: Optional[Sequence[int]] = None) -> SharedText:
    """Mark ``text`` as shared content of ``slot`` (use as ``s += shared(q, slot="query")``).

    Works inside ``sgl.user(...)``/``sgl.system(...)`` too. Raises ``ValueError``
    for an empty or over-long slot name.
    """
    return SharedText(text, slot, token_ids)


def agent(name: str) -> AgentMark:
    """Declare which agent the program or fork speaks for (``s += agent("solver")``)."""
    return AgentMark(name)


def workflow(name: str) -> WorkflowMark:
    """Name the workflow this program run belongs to (``s += workflow(run_id)``): approximate KV is
    reused only inside one workflow, and its requests stay on one server (behind SGLang's router) or
    one data-parallel worker, where its copies are."""
    return WorkflowMark(name)


# Pinned token ids by mark name (bounded: oldest dropped first).
_PINNED: dict[str, tuple[int, ...]] = {}
_MAX_PINNED = 4096


@dataclass(frozen=True)
class SharedSpan:
    start: int  # character offsets into the executor's text
    end: int
    slot: str
    token_ids: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class GenSpan:
    """Characters produced by a ``gen`` and the token ids the server generated for them."""

    start: int
    end: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Marks:
    agent: Optional[str]
    shared: tuple[SharedSpan, ...]
    gens: tuple[GenSpan, ...]
    workflow: Optional[str] = None

    @property
    def empty(self) -> bool:
        return self.agent is None and not self.shared


GEN_KEY = MARK_PREFIX + "{seq:012d}:gen"


def record_gen(variables: dict, span: GenSpan) -> None:
    """Remember a generation's ids in the executor's variables (forks inherit them)."""
    variables[GEN_KEY.format(seq=_next_seq())] = span


def collect_marks(variables: Mapping[str, Any], text_len: int) -> Marks:
    """Parse the marks out of an executor's variables.

    Only marks whose offsets lie inside ``text_len`` count (a fork sees its
    parent's marks). A shared mark without its end (not executed yet) is
    ignored. Overlapping shared spans keep the first.
    """
    if len(_PINNED) > _MAX_PINNED:
        for key in list(_PINNED)[: len(_PINNED) - _MAX_PINNED]:
            _PINNED.pop(key, None)
    agent_name, workflow_name, begins, ends, gens = None, None, {}, {}, []
    for name in sorted(k for k in variables if isinstance(k, str) and k.startswith(MARK_PREFIX)):
        value = variables[name]
        parts = name[len(MARK_PREFIX):].split(":", 2)
        seq, what = parts[0], parts[1]
        if what == "agent" and isinstance(value, int) and value <= text_len:
            agent_name = parts[2]
        elif what == "workflow" and isinstance(value, int) and value <= text_len:
            workflow_name = parts[2]
        elif what == "shared" and isinstance(value, int):
            begins[seq] = (value, parts[2], _PINNED.get(name))
        elif what == "end" and isinstance(value, int):
            ends[seq] = value
        elif what == "gen" and isinstance(value, GenSpan) and value.end <= text_len:
            gens.append(value)
    spans: list[SharedSpan] = []
    for seq, (start, slot, ids) in sorted(begins.items(), key=lambda kv: (kv[1][0], kv[0])):
        end = ends.get(seq)
        if end is None or end > text_len or end <= start:
            continue
        if spans and start < spans[-1].end:
            continue
        spans.append(SharedSpan(start, end, slot, ids))
    return Marks(agent_name, tuple(spans), tuple(sorted(gens, key=lambda g: g.start)), workflow_name)
