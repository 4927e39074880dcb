"""kvshare on ``/v1/chat/completions``: the request field, and from a rendered chat to an annotation.

**The field** (top level of the request body; with the ``openai`` SDK pass it
through ``extra_body``)::

    {"kvshare": {"agent": "critic",
                 "shared": [{"message": 1, "slot": "query"},
                            {"message": 2, "slot": "out:solver"}],
                 "output_slot": "out:critic"}}

* ``agent``: who speaks (1 to 128 characters), as in the ``/generate`` annotation.
* ``shared``: the messages whose *content* is shared text, by index into the
  request's ``messages`` (0-based, each at most once), each with the slot it
  fills (1 to 128 characters). Every other message, and all template text
  around the contents (role headers, the generation prompt), is private.
* ``output_slot`` (optional): this request's answer becomes shared content of
  that slot; a later request that puts the answer's text back as a message
  marked with the same slot reuses the KV computed while generating it.

The server renders the chat template with each marked content tokenized on its
own (``chat.render``), so a marked content gets the same ids in every agent,
and sends the request as an annotated ``/generate`` would. Template text
between two shared contents (``<|im_end|>\\n<|im_start|>user\\n``) is the same in
every agent, so it is shared too, under the slot ``GLUE_SLOT``, and so is the
generation prompt after a last shared content: otherwise a first-time agent
would stop reusing at the first role header (the cache resolves segments in
order and stops at the first it has no copy of), and the glue after a shared
message would have no copy before a second agent prefilled it.

**Automatic mode** (``--kvshare-auto``, see ``auto_plan``): requests without
the field are annotated by the server: the agent is a digest of the system
messages (and the request's ``user``); every other message's content, and
every answer, is shared under the one slot ``AUTO_SLOT`` (``auto_slot`` says why).

No SGLang imports: the server hooks (``chat.hooks``) call this, tests call it directly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sglang_kvshare.chat.render import RenderedPrompt
from sglang_kvshare.guard.serving import guard
from sglang_kvshare.protocol import MAX_NAME_CHARS, Annotation, AnnotationError, Segment

REQUEST_KEY = "kvshare"
GLUE_SLOT = "chat:glue"
AUTO_SLOT = "auto:message"
PRIVATE_ROLES = frozenset({"system", "developer"})


class SharedMessage(BaseModel):
    """One message whose content is shared text of ``slot``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    message: int = Field(ge=0, description="index into the request's messages (0-based)")
    slot: str = Field(min_length=1, max_length=MAX_NAME_CHARS)


class ChatKVShare(BaseModel):
    """The ``kvshare`` field of a chat completion request (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    shared: tuple[SharedMessage, ...] = ()
    output_slot: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    workflow: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    verify: bool = True
    """False keeps the request out of the fidelity guard's samples (the annotation's ``verify``)."""


def parse_chat_kvshare(raw: Any, num_messages: int, max_segments: int) -> ChatKVShare:
    """Validate the request's ``kvshare`` field; raises ``AnnotationError`` saying what to fix."""
    if not isinstance(raw, Mapping):
        raise AnnotationError(
            'kvshare must be an object like {"agent": "critic", "shared": [{"message": 1, "slot": "query"}]}')
    try:
        spec = ChatKVShare.model_validate(dict(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise AnnotationError(f"malformed kvshare field: {('kvshare.' + loc) if loc else 'kvshare'}: "
                              f"{first.get('msg')}") from None
    seen: set[int] = set()
    for k, item in enumerate(spec.shared):
        if item.message >= num_messages:
            raise AnnotationError(f"kvshare.shared.{k}.message is {item.message} but the request has "
                                  f"{num_messages} messages (indices start at 0)")
        if item.message in seen:
            raise AnnotationError(f"kvshare.shared.{k}.message: message {item.message} is listed twice")
        seen.add(item.message)
    # Each shared message adds at most two segments (its content and the glue after it).
    if 2 * len(spec.shared) + 1 > max_segments:
        raise AnnotationError(f"kvshare.shared lists {len(spec.shared)} messages; at most "
                              f"{(max_segments - 1) // 2} fit in the server's max_segments ({max_segments})")
    return spec


@dataclass
class MessageOutcome:
    """How one message of a chat request was annotated (part of the chat report)."""

    index: int
    role: str
    slot: Optional[str]  # None: private
    tokens: int
    source: str = "content"  # content | output (a remembered answer of an earlier request)
    retokenized_equal: Optional[bool] = None  # for a remembered answer: does its text re-tokenize to its ids?

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class ChatPlan:
    """What the server sends for one chat request: ids, annotation, and the per-message report."""

    input_ids: list[int]
    annotation: Annotation
    same_as_stock: bool  # input_ids equal what SGLang renders without kvshare
    mode: str  # explicit | auto
    messages: list[MessageOutcome] = field(default_factory=list)

    @property
    def first_private_ids(self) -> Optional[list[int]]:
        """Ids of the leading private segment (the agent's prefix), or None when the prompt starts shared."""
        first = self.annotation.segments[0]
        if first.kind != "private" or len(self.annotation.segments) == 1:
            return None
        return self.input_ids[: first.end]

    def report(self) -> dict:
        return {"mode": self.mode, "agent": self.annotation.agent, "same_as_stock": self.same_as_stock,
                "segments": [s.model_dump(exclude_none=True) for s in self.annotation.segments],
                "messages": [m.as_dict() for m in self.messages]}


_Kind = tuple[str, Optional[str], tuple[int, ...], bool]  # kind, slot, ids, reuse: one piece of the prompt


def _kinds(prompt: RenderedPrompt, slots: Mapping[int, str], ids_for: Mapping[int, Sequence[int]],
           share_tail: bool, no_reuse: frozenset[int]) -> list[_Kind]:
    """Each piece of ``prompt`` as ``build_annotation`` shares it (the rules are in its docstring)."""
    kinds: list[_Kind] = []
    for piece, ids in zip(prompt.pieces, prompt.piece_ids):
        if piece.message is not None and piece.message in slots:
            kinds.append(("shared", slots[piece.message], tuple(ids_for.get(piece.message, ids)),
                          piece.message not in no_reuse))
        else:
            kinds.append(("private", None, tuple(ids), True))
    for k in range(1, len(kinds)):
        last = k == len(kinds) - 1
        if (kinds[k][0] == "private" and prompt.pieces[k].message is None and kinds[k - 1][0] == "shared"
                and ((last and share_tail) or (not last and kinds[k + 1][0] == "shared"))):
            kinds[k] = ("shared", GLUE_SLOT, kinds[k][2], True)
    return kinds


def _count_segments(kinds: Sequence[_Kind], output_slot: Optional[str]) -> int:
    """How many segments ``build_annotation`` makes of ``kinds``; 0 when it returns None."""
    count, shared, last = 0, False, None
    for kind, _, ids, _ in kinds:
        if not ids:
            continue
        shared = shared or kind == "shared"
        if kind == "shared" or last != "private":
            count += 1
        last = kind
    return count if shared or output_slot is not None else 0


def build_annotation(prompt: RenderedPrompt, slots: Mapping[int, str], agent: str,
                     output_slot: Optional[str], ids_for: Optional[Mapping[int, Sequence[int]]] = None, *,
                     share_tail: bool = True, workflow: Optional[str] = None, no_reuse: frozenset[int] = frozenset(),
                     ) -> Optional[tuple[list[int], Annotation]]:
    """Ids and annotation for a rendered prompt; None when no content is shared and no output_slot is set.

    ``slots`` maps message index to slot for the shared contents; ``ids_for``
    optionally replaces a content's ids (a remembered answer's generated ids).
    Template text between two shared contents is shared under ``GLUE_SLOT``, and
    so is the text after the last one when it ends the prompt (the generation
    prompt) unless ``share_tail`` is false; adjacent private pieces merge into
    one segment. ``workflow`` is the request's reuse scope; the messages in
    ``no_reuse`` are shared for later requests but prefilled by this one.
    """
    kinds = _kinds(prompt, slots, ids_for or {}, share_tail, no_reuse)
    if output_slot is None and not any(kind == "shared" and ids for kind, _, ids, _ in kinds):
        return None
    input_ids: list[int] = []
    segments: list[Segment] = []
    for kind, slot, ids, reuse in kinds:
        if not ids:
            continue
        start = len(input_ids)
        input_ids.extend(ids)
        if kind == "private" and segments and segments[-1].kind == "private":
            segments[-1] = Segment(kind="private", start=segments[-1].start, end=len(input_ids))
        else:
            segments.append(Segment(kind=kind, start=start, end=len(input_ids), slot=slot, reuse=reuse))
    return input_ids, Annotation(agent=agent, segments=tuple(segments), output_slot=output_slot, workflow=workflow)


def build_capped(prompt: RenderedPrompt, slots: Mapping[int, str], agent: str, output_slot: Optional[str],
                 max_segments: int, *, share_tail: bool = True, workflow: Optional[str] = None,
                 no_reuse: frozenset[int] = frozenset(),
                 ) -> tuple[Optional[tuple[list[int], Annotation]], dict[int, str]]:
    """``build_annotation``, keeping the newest shared messages that fit in ``max_segments`` segments;
    also returns the slots kept.

    Why: a long conversation shares every message, and each adds up to two
    segments (its content and the glue after it); past the limit the oldest
    shared messages become private text of the agent (prefilled, or reused only
    as the agent's own prefix) instead of the request being refused, so a chat
    stock SGLang answers is never rejected for its length. The messages in
    ``no_reuse`` are never dropped; when even dropping every other one does not
    fit, the annotation is returned over the limit (the request's validation refuses it).

    Cost: making an older message private never adds a segment (its
    content and the glue beside it join the private text around them), so the
    number to drop is found by a binary search that counts segments without
    building them: O(pieces x log messages), and the annotation is built once.
    """
    order = [i for i in sorted(slots) if i not in no_reuse]  # the newest stay longest

    def kept(dropped: int) -> dict[int, str]:
        gone = set(order[:dropped])
        return {i: slot for i, slot in slots.items() if i not in gone}

    def fits(dropped: int) -> bool:
        kinds = _kinds(prompt, kept(dropped), {}, share_tail, no_reuse)
        return _count_segments(kinds, output_slot) <= max_segments

    lo, hi = 0, len(order)  # the fewest drops that fit lie in [lo, hi] (hi: drop all, fitting or not)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    keep = kept(lo)
    return build_annotation(prompt, keep, agent, output_slot, share_tail=share_tail, workflow=workflow,
                            no_reuse=no_reuse), keep


def _agent_key() -> bytes:
    """The key of auto agent names: the guard's (``Guard.agent_key``), kept in ``--kvshare-fidelity-file`` so a
    restarted server names the same agents alike and pins on them still apply; without a file, per process."""
    return guard.agent_key


def auto_agent(messages: Sequence[Mapping[str, Any]], user: Optional[str], key: Optional[bytes] = None) -> str:
    """The agent of an unannotated request: a keyed digest of its system messages (role, name, content) and ``user``.

    Why a digest and not a name: in agent frameworks the system prompt *is* the
    agent; two requests with the same one are the same agent, and the digest
    shows no prompt text in reports. Why keyed (a secret of the server,
    ``_agent_key``, like the cache's content digests): an unkeyed digest would let anyone confirm a
    guessed system prompt offline by hashing it.
    """
    identity = [[m.get("role"), m.get("name"), m.get("content")] for m in messages
                if m.get("role") in PRIVATE_ROLES]
    digest = hashlib.blake2b(json.dumps([identity, user], sort_keys=True, default=str).encode(),
                             digest_size=8, key=_agent_key() if key is None else key).hexdigest()
    return f"auto-{digest}"


def auto_candidates(messages: Sequence[Mapping[str, Any]]) -> set[int]:
    """Messages whose content may be shared in automatic mode: every non-system message with text.

    The last one is shared for the requests that come after (the next agent
    reads the same task); this request reuses it only when it is an answer
    the server generated (``chat.hooks._prefilled_last``), else marks it
    ``reuse: false``.
    """
    return {i for i, m in enumerate(messages)
            if m.get("role") not in PRIVATE_ROLES and isinstance(m.get("content"), str) and m.get("content")}


def auto_slot(role: str) -> str:
    """The slot of a message's content in automatic mode: ``AUTO_SLOT`` whatever the role.

    Why one slot: the cache finds a copy by (slot, content ids), so the slot
    must be the same wherever the same text appears, and agent frameworks put
    the same text under different roles (SGLang itself renders a trailing
    assistant message as a user one; supervisors forward answers as user
    messages). A role- or position-derived slot would split identical content.
    The cost: in ``kvcmas`` one anchor pool learns across all message kinds.
    """
    return AUTO_SLOT
