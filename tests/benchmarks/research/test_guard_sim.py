"""The offline replay of the guard's controller on a run's per-answer values (``benchmarks.research.guard_sim``)."""

from __future__ import annotations

import random

import pytest

from benchmarks.research import guard_sim as gs
from sglang_kvshare.guard.controller import DENSE, Controller, ladder
from sglang_kvshare.guard.target import FidelityTarget

HEADS = (0, 8, 16, 32, 64)
REUSE = {0: 0.95, 8: 0.9, 16: 0.8, 32: 0.6, 64: 0.2}


def _task(top1_by_agent: dict, samples: int = 40) -> dict:
    """A guard.json task whose fixed arms give each agent's answers: top-1 per head, 20 positions each."""
    arms = {}
    for k in HEADS:
        per_agent = {agent: {"per_answer": [[s, by_head[k], 0.001, 20] for s in range(samples)]}
                     for agent, by_head in top1_by_agent.items()}
        reuse = {agent: {"ratio": REUSE[k], "shared": 100 * samples, "reused": 0} for agent in top1_by_agent}
        reuse["producer"] = {"ratio": None, "shared": 0, "reused": 0}
        arms[f"fullshared_k{k}"] = {"teacher_forced_per_agent": per_agent, "reuse_per_agent": reuse}
    arms["off"] = {}
    return {"arms": arms}


GOOD = dict.fromkeys(HEADS, 1.0)
BAD = {0: 0.9, 8: 0.95, 16: 0.97, 32: 0.995, 64: 1.0}


def test_answers_are_read_per_consumer_agent_and_head():
    agents = gs.task_answers(_task({"worker": GOOD, "judge": BAD}))
    assert sorted(agents) == ["judge", "worker"]  # the producer reuses nothing: left out
    assert agents["judge"].answers[32][3] == (0.995, 0.001, 20) and agents["judge"].reuse[64] == 0.2
    assert agents["judge"].shared == 100
    with pytest.raises(ValueError, match="per agent"):
        gs.task_answers({"arms": {"fullshared_k0": {"teacher_forced_top1": 1.0}}})


def test_the_controller_moves_only_the_agent_that_misses_and_the_replay_scores_like_the_benchmark():
    agents = gs.task_answers(_task({"worker": GOOD, "judge": BAD}))
    target = FidelityTarget.parse("top1>=0.99")
    rep = gs.replicate(agents, lambda: Controller(target, ladder(0), min_samples=5), random.Random(1), rate=0.1,
                       warmup=60, scored=10, concurrency=4, bound=0.99)
    assert rep["settings_at_end"]["worker"] == 0 and rep["settings_at_end"]["judge"] in (32, 64, DENSE)
    assert rep["fixed"][0]["top1"] == pytest.approx(0.95) and rep["fixed"][32]["top1"] == pytest.approx(0.9975)
    assert rep["fixed"][16]["top1"] == pytest.approx(0.985) and rep["best_k"] == 32  # the most reuse meeting 0.99
    assert rep["meets"] is True
    assert rep["guarded"]["reuse"] > rep["fixed"][64]["reuse"]  # the worker kept head 0's reuse


def test_a_task_where_no_head_meets_the_bound_has_no_best_head_and_the_summary_counts_shares():
    agents = {"judge": {k: 0.98 for k in HEADS}}
    out = gs.simulate(_task(agents), "top1>=0.99", rate=0.1, min_samples=5, warmup=40, scored=10, replicates=5)
    assert out["replicates"] == 5 and out["best_k"] == {"None": 5}
    assert 0.0 <= out["p_both"] <= out["p_reuse_at_least_best"] == 1.0  # no head meets it: any reuse is at least 0
    assert out["guarded_top1"]["p10"] <= out["guarded_top1"]["median"] <= out["guarded_top1"]["p90"]


def test_the_command_reads_a_run_file_and_refuses_one_without_answers_per_agent(tmp_path, capsys):
    import json

    task = {**_task({"worker": GOOD, "judge": BAD}), "samples": 10, "sizes": {"controlled_warmup": 20},
            "min_samples": {"chosen": 5}}
    good = tmp_path / "guard.json"
    good.write_text(json.dumps({"target": "top1>=0.99", "verify_rate": 0.1, "tasks": {"gsm8k": task}}))
    assert gs.main([str(good), "--replicates", "3", "--band", "0", "0.6"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["gsm8k"]) == ["band=0", "band=0.6"]
    for replay in out["gsm8k"].values():
        assert replay["replicates"] == 3 and set(replay["best_k"]) <= {"32", "64"}
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"task": "gsm8k", "arms": {"fullshared_k0": {"teacher_forced_top1": 0.98}}}))
    assert gs.main([str(old)]) == 2
