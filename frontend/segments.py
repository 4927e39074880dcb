"""From a program's text and marks to the pieces of one request.

The text is cut at every mark boundary and each piece is tokenized on its
own, so a shared text yields the same ids in every agent whatever precedes
it (the server keys shared content by its token ids). Pieces produced by a
``gen`` reuse the ids the server generated. The pieces then go through the
one request builder, ``sglang_kvshare.frontend.builder.assemble`` (which also merges
private pieces between two shared spans into one private segment). No HTTP,
no SGLang server imports: unit testable with any tokenizer.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from sglang_kvshare.frontend.primitives import Marks
from sglang_kvshare.frontend.builder import BuiltRequest, Piece, assemble

DEFAULT_AGENT = "agent"

Tokenize = Callable[[str], list[int]]
LookupOutput = Callable[[str], Optional[Sequence[int]]]


def request_from_marks(text: str, marks: Marks, tokenize: Tokenize, *,
                       prefix_ids: Sequence[int] = (), lookup_output: Optional[LookupOutput] = None) -> BuiltRequest:
    """Token ids and annotation for ``text`` (an executor's full prompt).

    ``tokenize`` maps text to ids without special tokens; ``prefix_ids`` are the
    ids the tokenizer puts before a prompt (a BOS), ``lookup_output`` returns
    the generated ids of a text this backend produced earlier (or None).
    Raises ``ValueError`` if the prompt is empty.
    """
    pieces: list[Piece] = []
    if prefix_ids:
        pieces.append(Piece("private", None, list(prefix_ids)))

    def add_private(lo: int, hi: int) -> None:
        pos = lo
        for g in marks.gens:  # reuse generated ids inside private text
            if g.start < pos or g.end > hi or g.start >= g.end:
                continue
            if g.start > pos:
                pieces.append(Piece("private", None, tokenize(text[pos:g.start])))
            pieces.append(Piece("private", None, list(g.token_ids)))
            pos = g.end
        if hi > pos:
            pieces.append(Piece("private", None, tokenize(text[pos:hi])))

    pos = 0
    for span in marks.shared:
        add_private(pos, span.start)
        piece = text[span.start:span.end]
        ids = span.token_ids
        if ids is None and lookup_output is not None:
            ids = lookup_output(piece)
        if ids is None:
            ids = next((g.token_ids for g in marks.gens if (g.start, g.end) == (span.start, span.end)), None)
        pieces.append(Piece("shared", span.slot, list(ids) if ids is not None else tokenize(piece)))
        pos = span.end
    add_private(pos, len(text))

    if not any(p.ids for p in pieces):
        raise ValueError("the program's prompt is empty; add text before sgl.gen")
    # A declared agent's answer is shared under ``out:<agent>``: a later agent that
    # passes the same output ids reuses the producer's KV instead of prefilling it.
    output_slot = f"out:{marks.agent}" if marks.agent else None
    built = assemble(marks.agent or DEFAULT_AGENT, pieces, output_slot)
    if marks.workflow is not None:
        built = BuiltRequest(built.input_ids, built.annotation.model_copy(update={"workflow": marks.workflow}))
    return built
