"""The one request builder: pieces -> input_ids + annotation, the same for both client paths."""

from __future__ import annotations

import pytest

from sglang_kvshare.frontend.primitives import Marks, SharedSpan
from sglang_kvshare.frontend.segments import request_from_marks
from sglang_kvshare.protocol import parse_annotation
from sglang_kvshare.frontend.builder import Piece, assemble, build_request, private_part, shared_part


def test_assemble_merges_adjacent_private_pieces_and_drops_empty_ones():
    built = assemble("a", [Piece("private", None, [1, 2]), Piece("shared", "query", []),
                           Piece("private", None, [3]), Piece("shared", "query", [4, 5]),
                           Piece("private", None, []), Piece("shared", "out:b", (6,))], output_slot="out:a")
    assert built.input_ids == [1, 2, 3, 4, 5, 6]
    segs = [(s.kind, s.start, s.end, s.slot) for s in built.annotation.segments]
    assert segs == [("private", 0, 3, None), ("shared", 3, 5, "query"), ("shared", 5, 6, "out:b")]
    assert built.first_private_ids == [1, 2, 3]
    # what the server checks: spans cover the prompt exactly
    parsed = parse_annotation(built.annotation.to_custom_params(), len(built.input_ids))
    assert parsed.agent == "a" and parsed.output_slot == "out:a"


def test_assemble_refuses_what_the_server_would_refuse():
    with pytest.raises(ValueError, match="empty"):
        assemble("a", [Piece("private", None, []), Piece("shared", "q", [])])
    with pytest.raises(ValueError, match="slot"):
        assemble("a", [Piece("shared", None, [1])])
    with pytest.raises(ValueError, match="kind"):
        assemble("a", [Piece("public", None, [1])])
    assert assemble("a", [Piece("shared", "q", [9])]).first_private_ids is None


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def test_both_client_paths_build_the_same_request(tokenizer):
    system = "<|im_start|>system\nYou solve math.<|im_end|>\n<|im_start|>user\n"
    query = "A robe takes 2 bolts of blue fiber and half that much white fiber."
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    ids, custom_params = build_request(tokenizer, "solver", [private_part(system), shared_part(query, "query"),
                                                             private_part(tail)], output_slot="out:solver")
    text = system + query + tail
    marks = Marks("solver", (SharedSpan(len(system), len(system) + len(query), "query"),), ())
    built = request_from_marks(text, marks, lambda t: tokenizer(t, add_special_tokens=False)["input_ids"])
    assert built.input_ids == ids
    assert built.annotation.to_custom_params() == custom_params
