"""From a program's text and marks to ``input_ids`` plus a kvshare annotation.

The text is cut at every mark boundary and each piece is tokenized on its
own, so a shared text yields the same ids in every agent whatever precedes
it (the server keys shared content by its token ids). Pieces produced by a
``gen`` reuse the ids the server generated. Private pieces between two shared
spans form one private segment. No HTTP, no SGLang server imports: unit
testable with any tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from sglang_kvshare.frontend.primitives import Marks
from sglang_kvshare.protocol import Annotation, Segment

DEFAULT_AGENT = "agent"

Tokenize = Callable[[str], list[int]]
LookupOutput = Callable[[str], Optional[Sequence[int]]]


@dataclass(frozen=True)
class BuiltRequest:
    input_ids: list[int]
    annotation: Annotation

    @property
    def first_private_ids(self) -> Optional[list[int]]:
        """Ids of the leading private segment (what to warm), or None if the prompt starts shared."""
        first = self.annotation.segments[0]
        return self.input_ids[: first.end] if first.kind == "private" else None


def build_request(text: str, marks: Marks, tokenize: Tokenize, *,
                  prefix_ids: Sequence[int] = (), lookup_output: Optional[LookupOutput] = None) -> BuiltRequest:
    """Token ids and annotation for ``text`` (an executor's full prompt).

    ``tokenize`` maps text to ids without special tokens; ``prefix_ids`` are the
    ids the tokenizer puts before a prompt (a BOS), ``lookup_output`` returns
    the generated ids of a text this backend produced earlier (or None).
    Raises ``ValueError`` if the prompt is empty.
    """
    pieces: list[tuple[str, Optional[str], list[int]]] = []  # (kind, slot, ids)
    if prefix_ids:
        pieces.append(("private", None, list(prefix_ids)))

    def add_private(lo: int, hi: int) -> None:
        pos = lo
        for g in marks.gens:  # reuse generated ids inside private text
            if g.start < pos or g.end > hi or g.start >= g.end:
                continue
            if g.start > pos:
                pieces.append(("private", None, tokenize(text[pos:g.start])))
            pieces.append(("private", None, list(g.token_ids)))
            pos = g.end
        if hi > pos:
            pieces.append(("private", None, tokenize(text[pos:hi])))

    pos = 0
    for span in marks.shared:
        add_private(pos, span.start)
        piece = text[span.start:span.end]
        ids = span.token_ids
        if ids is None and lookup_output is not None:
            ids = lookup_output(piece)
        if ids is None:
            ids = next((g.token_ids for g in marks.gens if (g.start, g.end) == (span.start, span.end)), None)
        pieces.append(("shared", span.slot, list(ids) if ids is not None else tokenize(piece)))
        pos = span.end
    add_private(pos, len(text))

    input_ids: list[int] = []
    segments: list[Segment] = []
    for kind, slot, ids in pieces:
        if not ids:
            continue
        start = len(input_ids)
        input_ids.extend(ids)
        if kind == "private" and segments and segments[-1].kind == "private":
            segments[-1] = Segment(kind="private", start=segments[-1].start, end=len(input_ids))
        else:
            segments.append(Segment(kind=kind, start=start, end=len(input_ids), slot=slot))
    if not input_ids:
        raise ValueError("the program's prompt is empty; add text before sgl.gen")
    # A declared agent's answer is shared under ``out:<agent>``: a later agent that
    # passes the same output ids reuses the producer's KV instead of prefilling it.
    output_slot = f"out:{marks.agent}" if marks.agent else None
    return BuiltRequest(input_ids, Annotation(agent=marks.agent or DEFAULT_AGENT, segments=tuple(segments),
                                              output_slot=output_slot))
