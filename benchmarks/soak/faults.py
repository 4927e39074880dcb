"""Malformed and adversarial kvshare requests for the soak harness, and the soak's pure checks on answers.

Why the project's own parser is the oracle: a fuzzed annotation may come out valid
(a mutated space, a harmless reorder), so the expected answer of every generated
case is computed with ``protocol.parse_annotation`` on the same token count: 400
when it raises, 200 otherwise. The server must agree (any 5xx, or a 2xx for a bad
annotation, is a finding). The fixed catalogue names the faults a server must survive
(wrong types, huge and negative spans, long and unicode names, too many segments);
``mutate`` adds byte-level fuzz of a valid JSON string.

The chat side: ``chat_hostile`` builds hostile ``/v1/chat/completions`` bodies
(the chat layer's own sentinel text, list-valued content, tool calls, ``n > 1``,
logprobs, explicit fields that must be refused with a message naming the fix);
``parse_stream`` reads a streamed answer; ``cross_scope_signs`` and
``foreign_sources`` read reports for KV or agent names that crossed a reuse scope.

Nothing here talks to a server.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from sglang_kvshare.chat.annotation import GLUE_SLOT  # template text between shared contents, in every scope
from sglang_kvshare.protocol import (CUSTOM_PARAMS_KEY, DEFAULT_MAX_SEGMENTS, MAX_NAME_CHARS, AnnotationError,
                                     parse_annotation)

UNICODE_BITS = ("слот", "名前", "🙂", "عربى", "e\u0301", "\u200b", "Ω≈ç√", "../", "%2F", "\\", "\"'", "\u0000")


@dataclass(frozen=True)
class Case:
    """One annotation to send: ``raw`` is the value of ``custom_params["kvshare"]``."""

    kind: str
    raw: Any

    def custom_params(self) -> dict:
        return {CUSTOM_PARAMS_KEY: self.raw}


def expected_status(raw: Any, num_tokens: int, max_segments: int = DEFAULT_MAX_SEGMENTS) -> int:
    """400 when the server must reject ``raw`` for a prompt of ``num_tokens`` tokens, else 200."""
    try:
        parse_annotation({CUSTOM_PARAMS_KEY: raw}, num_tokens, max_segments)
    except AnnotationError:
        return 400
    return 200


def adversarial_name(rng: random.Random, length: int | None = None) -> str:
    """A valid but hostile name: unicode, control characters, path pieces; at most 128 characters."""
    length = length or rng.choice([1, 7, 40, MAX_NAME_CHARS])
    out = ""
    while len(out) < length:
        out += rng.choice(UNICODE_BITS) if rng.random() < 0.5 else chr(rng.randrange(0x21, 0x7e))
    return out[:length]


def three_part(agent: str, n: int, cut1: int, cut2: int, slot: str = "query") -> dict:
    """A valid private/shared/private annotation of an ``n``-token prompt."""
    return {"agent": agent, "segments": [{"kind": "private", "start": 0, "end": cut1},
                                         {"kind": "shared", "start": cut1, "end": cut2, "slot": slot},
                                         {"kind": "private", "start": cut2, "end": n}]}


def _edit(base: dict, fn: Callable[[dict], None]) -> dict:
    data = json.loads(json.dumps(base))
    fn(data)
    return data


def catalogue(n: int, max_segments: int = DEFAULT_MAX_SEGMENTS) -> list[Case]:
    """The named faults for an ``n``-token prompt (``n >= max_segments + 2``); all must get a 400."""
    assert n >= max_segments + 2, "the catalogue needs a prompt longer than the segment limit"
    c1, c2 = n // 4, n // 2
    good = three_part("solver", n, c1, c2)
    seg = lambda i: (lambda d: d["segments"][i])  # noqa: E731
    long = "x" * (MAX_NAME_CHARS + 1)
    cases = {
        "not_json": "{not json",
        "truncated_json": json.dumps(good)[:-7],
        "json_array": "[1, 2, 3]",
        "json_null": "null",
        "json_number": 5,
        "agent_wrong_type": _edit(good, lambda d: d.update(agent=123)),
        "segments_wrong_type": _edit(good, lambda d: d.update(segments="all of them")),
        "start_wrong_type": _edit(good, lambda d: seg(1)(d).update(start="x")),
        "end_float": _edit(good, lambda d: seg(2)(d).update(end=n + 0.5)),
        "negative_start": _edit(good, lambda d: seg(0)(d).update(start=-5)),
        "negative_end": _edit(good, lambda d: seg(0)(d).update(end=-1)),
        "huge_end": _edit(good, lambda d: seg(2)(d).update(end=10**12)),
        "huge_int_end": _edit(good, lambda d: seg(2)(d).update(end=2**80)),
        "reversed_span": _edit(good, lambda d: seg(1)(d).update(start=c2, end=c1)),
        "overlap": _edit(good, lambda d: seg(1)(d).update(start=c1 - 1)),
        "gap": _edit(good, lambda d: seg(1)(d).update(start=c1 + 1)),
        "short_cover": _edit(good, lambda d: seg(2)(d).update(end=n - 1)),
        "over_cover": _edit(good, lambda d: seg(2)(d).update(end=n + 1)),
        "unknown_kind": _edit(good, lambda d: seg(1)(d).update(kind="public")),
        "shared_without_slot": _edit(good, lambda d: seg(1)(d).pop("slot")),
        "private_with_slot": _edit(good, lambda d: seg(0)(d).update(slot="mine")),
        "extra_field": _edit(good, lambda d: d.update(colour="blue")),
        "empty_agent": _edit(good, lambda d: d.update(agent="")),
        "missing_agent": _edit(good, lambda d: d.pop("agent")),
        "agent_129_chars": _edit(good, lambda d: d.update(agent=long)),
        "slot_129_chars": _edit(good, lambda d: seg(1)(d).update(slot=long)),
        "unicode_agent_129_chars": _edit(good, lambda d: d.update(agent="名" * (MAX_NAME_CHARS + 1))),
        "empty_slot": _edit(good, lambda d: seg(1)(d).update(slot="")),
        "output_slot_wrong_type": _edit(good, lambda d: d.update(output_slot=["out"])),
        "no_segments": _edit(good, lambda d: d.update(segments=[])),
        "too_many_segments": {"agent": "a", "segments": [
            {"kind": "private", "start": i, "end": i + 1} for i in range(max_segments)]
            + [{"kind": "private", "start": max_segments, "end": n}]},
    }
    return [Case(kind, raw if isinstance(raw, (str, int)) else json.dumps(raw)) for kind, raw in cases.items()]


def mutate(text: str, rng: random.Random, edits: int = 3) -> str:
    """Byte-level fuzz of a JSON string: delete, duplicate, swap or replace characters."""
    chars = list(text)
    for _ in range(edits):
        if not chars:
            break
        i = rng.randrange(len(chars))
        op = rng.randrange(4)
        if op == 0:
            del chars[i]
        elif op == 1:
            chars.insert(i, chars[i])
        elif op == 2:
            j = rng.randrange(len(chars))
            chars[i], chars[j] = chars[j], chars[i]
        else:
            chars[i] = rng.choice('{}[]:,"-0123456789eE.ntfalsu \\')
    return "".join(chars)


def fuzzed(n: int, rng: random.Random) -> Case:
    """A mutated valid annotation; its expected status comes from ``expected_status``."""
    c1 = rng.randrange(1, n - 1)
    c2 = rng.randrange(c1 + 1, n)
    base = json.dumps(three_part(adversarial_name(rng), n, c1, c2, adversarial_name(rng)), ensure_ascii=False)
    return Case("fuzzed_json", mutate(base, rng, edits=rng.choice([1, 2, 4, 8])))


def many_slots(agent: str, private_len: int, n: int, names: list[str]) -> dict:
    """A valid annotation: ``[0, private_len)`` private, then one shared segment per name over the rest."""
    segments = [{"kind": "private", "start": 0, "end": private_len}]
    span = (n - private_len) // len(names)
    assert span >= 1, "too many names for the prompt"
    start = private_len
    for i, name in enumerate(names):
        end = n if i == len(names) - 1 else start + span
        segments.append({"kind": "shared", "start": start, "end": end, "slot": name})
        start = end
    return {"agent": agent, "segments": segments}


# ------------------------------------------------------------ hostile chat requests
SENTINEL = "\ue000kvshare-999\ue001"  # the shape of the chat layer's own cut markers
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]


# The hostile chats a short run sends first (one of each family), then the rest of the catalogue.
HOSTILE_FIRST = ("sentinel_in_user", "list_content", "tool_messages", "n_2", "logprobs_top", "explicit_n_2",
                 "explicit_index_out_of_range", "logprobs_stream")


@dataclass(frozen=True)
class ChatCase:
    """One hostile ``/v1/chat/completions`` body (without ``model``; the soak adds it and ``max_tokens``).

    ``fix`` None: the request must be answered as stock SGLang answers it (a 200 here).
    Otherwise the server may refuse it, with a 4xx whose message contains ``fix``
    (the field and what to change); ``refuse``: it must refuse (a 200 is wrong).
    """

    kind: str
    body: dict
    fix: Any = None
    refuse: bool = False

    @property
    def auto(self) -> bool:
        """No ``kvshare`` field (or ``null``): the automatic mode decides."""
        return self.body.get("kvshare") is None


def chat_hostile(system: str, doc: str, rng: random.Random) -> list[ChatCase]:
    """Hostile chats around one document: content the chat layer must not choke on, and explicit
    fields it must refuse with a message that names the fix."""
    sysm = {"role": "system", "content": system}
    base = [sysm, {"role": "user", "content": doc}, {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "Answer briefly."}]
    tool_chat = [sysm, {"role": "user", "content": doc},
                 {"role": "assistant", "content": None, "tool_calls": [{
                     "id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": json.dumps({"a": 48, "b": 24})}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "72"}]
    many = [sysm] + [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Note {i}: {doc[:30]}"}
                     for i in range(69)]
    field = {"agent": "hostile", "shared": [{"message": 1, "slot": "query"}]}
    cases = [
        ChatCase("sentinel_in_user", {"messages": [sysm, {"role": "user", "content": f"{doc} {SENTINEL} {doc[:40]}"},
                                                   *base[2:]]}),
        ChatCase("sentinel_only_message", {"messages": [sysm, {"role": "user", "content": SENTINEL}, *base[1:]]}),
        ChatCase("sentinel_in_system", {"messages": [{"role": "system", "content": f"{system}{SENTINEL}"},
                                                     *base[1:]]}),
        ChatCase("list_content", {"messages": [sysm, {"role": "user", "content": [{"type": "text", "text": doc}]},
                                               *base[2:]]}),
        ChatCase("list_content_parts", {"messages": [sysm, {"role": "user", "content": [
            {"type": "text", "text": doc[:50]}, {"type": "text", "text": doc[50:]}]}, *base[2:]]}),
        ChatCase("tool_messages", {"messages": tool_chat, "tools": TOOLS}),
        ChatCase("tool_choice_none", {"messages": base, "tools": TOOLS, "tool_choice": "none"}),
        ChatCase("n_2", {"messages": base, "n": 2, "temperature": 0.8, "seed": rng.randrange(1000)}),
        ChatCase("logprobs_top", {"messages": base, "logprobs": True, "top_logprobs": 5}),
        ChatCase("logprobs_stream", {"messages": base, "logprobs": True, "top_logprobs": 2, "stream": True}),
        ChatCase("leading_whitespace", {"messages": [sysm, {"role": "user", "content": "\n\n  " + doc}, *base[2:]]}),
        ChatCase("empty_message", {"messages": [sysm, {"role": "user", "content": ""}, *base[1:]]}),
        ChatCase("unicode_name", {"messages": [sysm, {"role": "user", "name": "名前🙂../%2F", "content": doc},
                                               *base[2:]]}),
        ChatCase("continue_final_message", {"messages": base[:3], "continue_final_message": True,
                                            "add_generation_prompt": False}),
        ChatCase("70_messages", {"messages": many}),
        ChatCase("kvshare_null", {"messages": base, "kvshare": None}),
        # Explicit fields the server must refuse, saying what to fix.
        ChatCase("explicit_n_2", {"messages": base, "n": 2, "temperature": 0.8, "kvshare": field},
                 fix="one request per choice", refuse=True),
        ChatCase("explicit_n_2_stream", {"messages": base, "n": 2, "temperature": 0.8, "stream": True,
                                         "kvshare": field}, fix="one request per choice", refuse=True),
        ChatCase("explicit_index_out_of_range", {"messages": base, "kvshare": {
            "agent": "hostile", "shared": [{"message": 9, "slot": "query"}]}}, fix="indices start at 0", refuse=True),
        ChatCase("explicit_listed_twice", {"messages": base, "kvshare": {
            "agent": "hostile", "shared": [{"message": 1, "slot": "q"}, {"message": 1, "slot": "q"}]}},
            fix="listed twice", refuse=True),
        ChatCase("explicit_unknown_key", {"messages": base, "kvshare": {**field, "colour": "blue"}},
                 fix="kvshare.colour", refuse=True),
        ChatCase("explicit_not_an_object", {"messages": base, "kvshare": "yes please"}, fix="must be an object",
                 refuse=True),
        ChatCase("explicit_too_many_shared", {"messages": many, "kvshare": {
            "agent": "hostile", "shared": [{"message": i, "slot": "q"} for i in range(1, 69)]}},
            fix="max_segments", refuse=True),
        ChatCase("explicit_empty_message", {"messages": [sysm, {"role": "user", "content": ""}, *base[1:]],
                                            "kvshare": field}, fix="non-empty text", refuse=True),
        ChatCase("explicit_sentinel_agent", {"messages": base, "kvshare": {**field, "agent": SENTINEL}},
                 fix="kvshare"),
        ChatCase("explicit_list_content", {"messages": [sysm, {"role": "user", "content": [
            {"type": "text", "text": doc}]}, *base[2:]], "kvshare": field}, fix="text"),
        ChatCase("explicit_tool_message", {"messages": tool_chat, "tools": TOOLS, "kvshare": {
            "agent": "hostile", "shared": [{"message": 3, "slot": "tool"}]}}, fix="kvshare"),
    ]
    first = {kind: i for i, kind in enumerate(HOSTILE_FIRST)}
    return sorted(cases, key=lambda c: first.get(c.kind, len(first)))  # stable: the rest in catalogue order


# ------------------------------------------------------------ reading chat answers and reports
REUSED_BY = ("alignment", "correction", "estimate_hit")  # approximate KV (an exact "hit" is not)
NOT_FOUND = (None, "no_source", "not_reached")  # a segment's reason when no copy was even considered


def parse_stream(lines: Iterable[bytes]) -> dict:
    """A streamed chat answer (server-sent ``data:`` lines): chunks, error chunks, finish reasons, the
    ``kvshare`` report and whether it rode on the chunk with the finish reason, usage, text, ``[DONE]``."""
    out = {"stream": True, "chunks": 0, "errors": [], "finish_reasons": [], "kvshare": None,
           "report_on_final_chunk": False, "reports": 0, "usage": None, "text": "", "done": False}
    text = []
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            out["done"] = True
            continue
        out["chunks"] += 1
        try:
            obj = json.loads(data)
        except ValueError:
            obj = data[:200].decode("utf-8", "replace")
        if not isinstance(obj, dict):
            out["errors"].append(str(obj)[:200])
            continue
        if "error" in obj or obj.get("object") == "error":
            out["errors"].append(str(obj.get("error") or obj.get("message"))[:200])
        finishing = False
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            text.append(str((choice.get("delta") or {}).get("content") or ""))
            if choice.get("finish_reason"):
                out["finish_reasons"].append(choice["finish_reason"])
                finishing = True
        if "kvshare" in obj:
            out["reports"] += 1
            out["kvshare"] = obj["kvshare"]
            out["report_on_final_chunk"] = finishing
        if obj.get("usage"):
            out["usage"] = obj["usage"]
    out["text"] = "".join(text)
    return out


def cross_scope_signs(report: Optional[dict]) -> dict:
    """What a report says about content only another scope has sent (every non-glue shared segment of
    a probe's last request): approximate tokens served from it, segments that found a copy of it at all
    (a source agent, or a reason other than "no copy"), and segments the cache reached."""
    reused, found, reached, considered = 0, [], 0, 0
    for i, seg in enumerate((report or {}).get("segments") or []):
        if seg.get("kind") != "shared" or seg.get("slot") == GLUE_SLOT:
            continue
        considered += 1
        if seg.get("resolved_by") in REUSED_BY:
            reused += int(seg.get("resolved_tokens") or seg.get("tokens") or 0)
        if (seg.get("source_agent") or seg.get("reason") not in NOT_FOUND
                or seg.get("resolved_by") not in (None, "dense")):
            found.append({"segment": i, "slot": seg.get("slot"), "resolved_by": seg.get("resolved_by"),
                          "reason": seg.get("reason"), "source_agent": seg.get("source_agent")})
        if seg.get("reason") != "not_reached":
            reached += 1
    return {"segments": considered, "reused_tokens": reused, "found": found, "reached": reached}


def source_found(report: Optional[dict]) -> bool:
    """A probe's control: some non-glue shared segment of this report found a copy (reused or not)."""
    return bool(cross_scope_signs(report)["found"])


def foreign_sources(reports: list[dict]) -> dict:
    """``reports``: ``{"scope", "agent", "sources"}`` per report (``sources``: its segments'
    ``source_agent`` values). A source agent is fine when an agent of the same scope has that name;
    ``foreign`` when only other scopes' agents have it, ``unknown`` when no recorded request has it."""
    by_scope: dict[str, set] = {}
    for r in reports:
        if r.get("agent"):
            by_scope.setdefault(r["scope"], set()).add(r["agent"])
    named = foreign = unknown = 0
    examples: list[dict] = []
    for r in reports:
        for src in r.get("sources") or []:
            named += 1
            if src in by_scope.get(r["scope"], ()):
                continue
            owners = sorted(s for s, agents in by_scope.items() if src in agents)
            if owners:
                foreign += 1
            else:
                unknown += 1
            if len(examples) < 20:
                examples.append({"scope": r["scope"], "agent": r.get("agent"), "source_agent": src,
                                 "source_scopes": owners, "label": r.get("label")})
    return {"reports": len(reports), "scopes": len(by_scope), "named_sources": named, "foreign": foreign,
            "unknown": unknown, "examples": examples}
