"""Frontend pieces that need no server: marks -> segments, answer extraction, the HumanEval sandbox."""

from __future__ import annotations

import time

import pytest

from sglang_kvshare.frontend.primitives import GenSpan, Marks, SharedSpan
from sglang_kvshare.frontend.segments import build_request
from sglang_kvshare.frontend.tasks import (extract_code, extract_gsm8k_answer, humaneval_program, load_gsm8k,
                                           normalize_number, run_sandboxed)


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
        built.append(build_request(text, marks, _tok(tokenizer)))
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
    req = build_request(text, marks, _tok(tokenizer))
    assert tuple(req.input_ids[len(_tok(tokenizer)(text[:g0])):][:2]) == odd_ids
    marks = Marks("b", (SharedSpan(g0, g0 + 8, "out:x", (7, 8, 9)),), ())
    req = build_request(text, marks, _tok(tokenizer))
    seg = req.annotation.segments[1]
    assert seg.slot == "out:x" and req.input_ids[seg.start:seg.end] == [7, 8, 9]
    req = build_request(text, Marks("b", (SharedSpan(g0, g0 + 8, "out:x"),), ()), _tok(tokenizer),
                        lookup_output=lambda t: (5, 6) if t == "Hi there" else None)
    assert req.input_ids[req.annotation.segments[1].start:req.annotation.segments[1].end] == [5, 6]


def test_gsm8k_answers():
    assert extract_gsm8k_answer("so 3 + 4 = 7. The answer is 1,234.") == "1234"
    assert extract_gsm8k_answer("We get $18 in total") == "18"
    assert extract_gsm8k_answer("no number") == ""
    assert normalize_number("2.50") == "2.5"
    samples = load_gsm8k(2)
    assert samples[0].reference == "18" and samples[1].reference == "3"


def test_humaneval_sandbox_times_out_a_looping_solution():
    problem = {"prompt": "def f(x):\n    \"\"\"Return x + 1.\"\"\"\n", "entry_point": "f",
               "test": "def check(candidate):\n    assert candidate(1) == 2\n"}
    good = extract_code("```python\ndef f(x):\n    return x + 1\n```", problem)
    assert run_sandboxed(humaneval_program(good, problem), timeout=20).status == "passed"
    wrong = extract_code("    return x\n", problem)
    assert run_sandboxed(humaneval_program(wrong, problem), timeout=20).status == "failed"
    loop = extract_code("```python\ndef f(x):\n    while True:\n        pass\n```", problem)
    t0 = time.monotonic()
    res = run_sandboxed(humaneval_program(loop, problem), timeout=2)
    assert res.status == "timeout" and not res.passed
    assert time.monotonic() - t0 < 10


def test_generated_ids_drop_the_stop_token(tokenizer):
    from sglang_kvshare.frontend.backend import generated_ids_for_text

    ids = tokenizer("The answer is 18.", add_special_tokens=False)["input_ids"]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generated_ids_for_text(tokenizer, "The answer is 18.", ids + [eos]) == tuple(ids)
    assert generated_ids_for_text(tokenizer, "The answer is 18.", ids) == tuple(ids)
    assert generated_ids_for_text(tokenizer, "something else", ids) is None


def test_run_summary_counts_reuse_fallbacks_and_ttft():
    from sglang_kvshare.frontend.run import agreement, summarize

    def rec(agent, ttft, segs):
        rep = {"tokens_exact_hit": 0, "tokens_aligned": 0, "tokens_corrected": 0, "tokens_prefilled": 0,
               "segments": [dict(kind="shared", slot="query", tokens=n, resolved_by=how) for how, n in segs]}
        for how, n in segs:
            key = {"hit": "tokens_exact_hit", "alignment": "tokens_aligned", "correction": "tokens_corrected",
                   "dense": "tokens_prefilled"}[how]
            rep[key] += n
        return {"agent": agent, "ttft_s": ttft, "report": rep}

    results = [{"records": [rec("a", 2.0, [("dense", 10)]), rec("b", 1.0, [("alignment", 10)]),
                            rec("c", 0.5, [("correction", 10)]), rec("d", 1.5, [("dense", 10)])],
                "correct": True, "seconds": 5.0, "answer": "3", "final": "x"}]
    s = summarize(results)
    assert s["reuse_ratio"] == 0.5 and s["shared_corrected_ratio"] == 0.25
    assert s["dense_fallback_rate"] == 0.5 and s["shared_segments_attempted"] == 4
    assert s["ttft_s_mean_agent_1"] == 2.0 and s["ttft_s_mean_agents_2_on"] == 1.0
    other = [{**results[0], "answer": "4", "final": "y"}]
    assert agreement("gsm8k", results, other)["final_answer_agreement"] == 0.0
    assert agreement("humaneval", results, other)["final_answer_agreement"] == 1.0
