"""Build annotated requests from parts, tokenizing segment by segment.

Why: a shared text must become the same token ids in every agent, whatever
precedes it, or the server cannot recognise it. Tokenizing each part on its
own (no special tokens added) guarantees that; the annotation's spans then
follow from the part lengths. Used by the tests and benchmarks that talk to
the server directly; the ``sgl.function`` frontend builds on the same idea.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from sglang_kvshare.protocol import Annotation, Segment

TokenIds = list[int]


@dataclass(frozen=True)
class Part:
    """``private`` text of the agent, or ``shared`` text of a slot (text or token ids)."""

    kind: str
    content: Union[str, Sequence[int]]
    slot: str | None = None


def private(content: Union[str, Sequence[int]]) -> Part:
    return Part("private", content)


def shared(content: Union[str, Sequence[int]], slot: str) -> Part:
    return Part("shared", content, slot)


def encode(tokenizer, content: Union[str, Sequence[int]]) -> TokenIds:
    if isinstance(content, str):
        return list(tokenizer(content, add_special_tokens=False).input_ids)
    return [int(t) for t in content]


def build_request(tokenizer, agent: str, parts: Sequence[Part],
                  output_slot: str | None = None) -> tuple[TokenIds, dict[str, str]]:
    """``(input_ids, custom_params)`` for ``/generate``; empty parts are dropped.

    ``output_slot`` shares the request's generated tokens with later agents."""
    ids: TokenIds = []
    segments = []
    for part in parts:
        piece = encode(tokenizer, part.content)
        if not piece:
            continue
        segments.append(Segment(kind=part.kind, start=len(ids), end=len(ids) + len(piece), slot=part.slot))
        ids.extend(piece)
    return ids, Annotation(agent=agent, segments=tuple(segments), output_slot=output_slot).to_custom_params()
