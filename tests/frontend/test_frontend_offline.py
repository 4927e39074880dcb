"""Client-library pieces that need no server: marks -> segments, generated ids."""

from __future__ import annotations

import pytest

from sglang_kvshare.frontend.primitives import GenSpan, Marks, SharedSpan
from sglang_kvshare.frontend.segments import request_from_marks


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _tok(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def test_shared_text_gets_the_same_ids_behind_any_prefix(tokenizer):
    query = "A robe takes 2 bolts of blue fiber and half that much white fiber."
    built = []
    for system in ("You solve math.", "You are an analyst who checks every step twice."):
        text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{query}<|im_end|>\n<|im_start|>assistant\n"
        start = text.index(query)
        marks = Marks("a", (SharedSpan(start, start + len(query), "query"),), ())
        built.append(request_from_marks(text, marks, _tok(tokenizer)))
        req = built[-1]
        segs = req.annotation.segments
        assert [s.kind for s in segs] == ["private", "shared", "private"]
        assert segs[0].start == 0 and segs[-1].end == len(req.input_ids)
        assert all(a.end == b.start for a, b in zip(segs, segs[1:]))
        assert req.input_ids == _tok(tokenizer)(text)  # message-boundary marks: same as whole-text tokenization
    a, b = (r.input_ids[r.annotation.segments[1].start:r.annotation.segments[1].end] for r in built)
    assert a == b == _tok(tokenizer)(query)


def test_generated_ids_and_pinned_ids_are_kept(tokenizer):
    text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n"
    g0 = text.index("Hi there")
    odd_ids = (12589, 665)  # any ids: the backend must send what the server generated
    marks = Marks("b", (), (GenSpan(g0, g0 + len("Hi there"), odd_ids),))
    req = request_from_marks(text, marks, _tok(tokenizer))
    assert tuple(req.input_ids[len(_tok(tokenizer)(text[:g0])):][:2]) == odd_ids
    marks = Marks("b", (SharedSpan(g0, g0 + 8, "out:x", (7, 8, 9)),), ())
    req = request_from_marks(text, marks, _tok(tokenizer))
    seg = req.annotation.segments[1]
    assert seg.slot == "out:x" and req.input_ids[seg.start:seg.end] == [7, 8, 9]
    req = request_from_marks(text, Marks("b", (SharedSpan(g0, g0 + 8, "out:x"),), ()), _tok(tokenizer),
                             lookup_output=lambda t: (5, 6) if t == "Hi there" else None)
    assert req.input_ids[req.annotation.segments[1].start:req.annotation.segments[1].end] == [5, 6]


def test_generated_ids_drop_the_stop_token(tokenizer):
    from sglang_kvshare.protocol import generated_ids_for_text

    ids = tokenizer("The answer is 18.", add_special_tokens=False)["input_ids"]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generated_ids_for_text(tokenizer, "The answer is 18.", ids + [eos]) == tuple(ids)
    assert generated_ids_for_text(tokenizer, "The answer is 18.", ids) == tuple(ids)
    assert generated_ids_for_text(tokenizer, "something else", ids) is None


def test_a_workflow_mark_names_the_annotation_and_the_routing_header(tokenizer):
    from sglang_kvshare.frontend import agent, shared, workflow
    from sglang_kvshare.frontend.primitives import collect_marks
    from sglang_kvshare.routing import ROUTING_HEADER, routing_headers

    question = "What is 2 + 3?"
    text = f"<|im_start|>user\n{question}<|im_end|>\n"
    start = text.index(question)
    query = shared(question, slot="query")
    # What SGLang's interpreter stores for each mark: the text offset where it was executed.
    variables = {workflow("ticket-4711").name: 0, agent("solver").name: 0,
                 query.begin_name: start, query.end_name: start + len(question)}
    marks = collect_marks(variables, len(text))
    assert marks.workflow == "ticket-4711" and marks.agent == "solver"
    built = request_from_marks(text, marks, _tok(tokenizer))
    assert built.annotation.workflow == "ticket-4711"
    assert routing_headers("ticket-4711") == {ROUTING_HEADER: "ticket-4711"} and routing_headers(None) == {}
    with pytest.raises(ValueError):
        routing_headers("")
    with pytest.raises(ValueError):
        workflow("x" * 1000)
