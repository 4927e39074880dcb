"""Workload pieces that need no server: GSM8K answers, the HumanEval sandbox, the workflow summary."""

from __future__ import annotations

import time

from benchmarks.workflow import agreement, summarize
from benchmarks.workloads.tasks import (extract_code, extract_gsm8k_answer, humaneval_program, load_gsm8k,
                                        normalize_number, run_sandboxed)


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


def test_run_summary_counts_reuse_fallbacks_and_ttft():
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
