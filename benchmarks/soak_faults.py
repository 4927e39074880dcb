"""Malformed and adversarial kvshare annotations for the soak harness, each with its expected status.

Why the project's own parser is the oracle: a fuzzed annotation may come out valid
(a mutated space, a harmless reorder), so the expected answer of every generated
case is computed with ``protocol.parse_annotation`` on the same token count: 400
when it raises, 200 otherwise. The server must agree (any 5xx, or a 2xx for a bad
annotation, is a finding). The fixed catalogue names the faults a server must survive
(wrong types, huge and negative spans, long and unicode names, too many segments);
``mutate`` adds byte-level fuzz of a valid JSON string.

Nothing here talks to a server.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

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
