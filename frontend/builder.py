"""The one request builder: ordered pieces of token ids -> ``input_ids`` plus an annotation.

Why one core: both client paths (``build_request`` below, for code that talks
to ``/generate`` directly, and the ``sgl.function`` frontend, which cuts a
program's text at its ``shared`` marks) must produce the same annotation for
the same pieces, so they share ``assemble``: empty pieces are dropped and
adjacent private pieces become one private segment.

Why tokenize piece by piece: a shared text must become the same token ids in
every agent, whatever precedes it, or the server cannot recognise it.
Tokenizing each part on its own (no special tokens added) guarantees that; the
annotation's spans then follow from the piece lengths.

Names: ``private_part`` / ``shared_part`` build the ``Part`` list of
``build_request``. (``sglang_kvshare.frontend.shared`` is something else: a
mark inside an ``sgl.function`` program.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

from sglang_kvshare.protocol import Annotation, Segment

TokenIds = list[int]
SEGMENT_KINDS = ("private", "shared")


class Piece(NamedTuple):
    """One run of token ids: ``kind`` is ``private`` or ``shared``; ``slot`` names a shared one."""

    kind: str
    slot: Optional[str]
    ids: Sequence[int]


class BuiltRequest(NamedTuple):
    """``(input_ids, annotation)`` of one request."""

    input_ids: TokenIds
    annotation: Annotation

    @property
    def first_private_ids(self) -> Optional[TokenIds]:
        """Ids of the leading private segment (what to warm), or None if the prompt starts shared."""
        first = self.annotation.segments[0]
        return self.input_ids[: first.end] if first.kind == "private" else None


def assemble(agent: str, pieces: Sequence[Piece], output_slot: Optional[str] = None) -> BuiltRequest:
    """Concatenate ``pieces`` in order into ``input_ids`` and the segments that cover them.

    Empty pieces are dropped; adjacent private pieces merge into one private
    segment (the server sees one run of the agent's own text). ``output_slot``
    shares the request's generated tokens with later agents. Raises
    ``ValueError`` for an unknown kind, a shared piece without a slot, or when
    no piece has any ids (an empty prompt).
    """
    input_ids: TokenIds = []
    segments: list[Segment] = []
    for kind, slot, ids in pieces:
        if kind not in SEGMENT_KINDS:
            raise ValueError(f"unknown segment kind {kind!r}; use one of {SEGMENT_KINDS}")
        if kind == "shared" and not slot:
            raise ValueError("a shared piece needs a slot name (e.g. 'query' or 'out:<agent>')")
        if not ids:
            continue
        start = len(input_ids)
        input_ids.extend(int(t) for t in ids)
        if kind == "private" and segments and segments[-1].kind == "private":
            segments[-1] = Segment(kind="private", start=segments[-1].start, end=len(input_ids))
        else:
            segments.append(Segment(kind=kind, start=start, end=len(input_ids),
                                    slot=slot if kind == "shared" else None))
    if not input_ids:
        raise ValueError("the request's prompt is empty: every piece has zero tokens")
    return BuiltRequest(input_ids, Annotation(agent=agent, segments=tuple(segments), output_slot=output_slot))


@dataclass(frozen=True)
class Part:
    """A piece before tokenization: the agent's ``private`` text, or ``shared`` text of a slot (text or ids)."""

    kind: str
    content: Union[str, Sequence[int]]
    slot: Optional[str] = None


def private_part(content: Union[str, Sequence[int]]) -> Part:
    """Text (or ids) that belongs to the agent: its system prompt, glue, instructions."""
    return Part("private", content)


def shared_part(content: Union[str, Sequence[int]], slot: str) -> Part:
    """Text (or ids) many agents read under ``slot`` (e.g. ``query``, ``out:solver``)."""
    return Part("shared", content, slot)


def encode(tokenizer, content: Union[str, Sequence[int]]) -> TokenIds:
    """Ids of ``content`` without special tokens added; ids pass through unchanged."""
    if isinstance(content, str):
        return list(tokenizer(content, add_special_tokens=False).input_ids)
    return [int(t) for t in content]


def build_request(tokenizer, agent: str, parts: Sequence[Part],
                  output_slot: Optional[str] = None) -> tuple[TokenIds, dict[str, str]]:
    """``(input_ids, custom_params)`` for ``/generate``, each part tokenized on its own.

    ``output_slot`` shares the request's generated tokens with later agents."""
    built = assemble(agent, [Piece(p.kind, p.slot, encode(tokenizer, p.content)) for p in parts], output_slot)
    return built.input_ids, built.annotation.to_custom_params()
