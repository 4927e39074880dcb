"""The guard benchmark's pure parts: calibration scoring, the min-samples rule, the best global K, detection
counting, the control twin, and the plot and report section from a results dict (no server)."""

from __future__ import annotations

import math

import pytest

from benchmarks import frontier as fr
from benchmarks import guard as g
from benchmarks import guard_metrics as gm
from benchmarks import report
from benchmarks import runs
from sglang_kvshare.frontend.builder import Piece
from sglang_kvshare.guard.controller import rule
from sglang_kvshare.guard.estimate import Z95


def _rec(scope: str, top1: float, kl: float = 0.0, verified: bool = False, phase: str = "scored") -> dict:
    return {"scope": scope, "top1": top1, "kl": kl, "verified": verified, "phase": phase}


def _est(n: int, mean: float, lo: float, hi: float) -> dict:
    return {"n": n, "mean": mean, "ci95": [lo, hi]}


def test_calibration_judges_each_scope_by_its_mean_over_all_requests_against_the_guard_interval():
    records = [_rec("writer", v) for v in (1.0, 1.0, 0.5, 1.0)] + [_rec("judge", v, verified=True) for v in (0.6, 0.8)]
    per_scope = {"writer": {"setting": "head0", "samples": 3, "top1": _est(3, 0.95, 0.80, 0.90),  # 0.875: inside
                            "kl": _est(3, 0.1, 0.0, 0.2)},
                 "judge": {"setting": "head0", "samples": 2, "top1": _est(2, 0.95, 0.90, 1.0),  # 0.7: outside
                           "kl": _est(2, 0.1, 0.0, None)}}
    out = gm.score_calibration(records, per_scope)
    assert out["within_ci"] == 0.5 and out["scopes_judged"] == 2 and out["scopes"] == 2
    writer, judge = out["per_scope"]["writer"], out["per_scope"]["judge"]
    assert writer["n_all"] == 4 and writer["top1"]["true_mean"] == pytest.approx(0.875)
    assert writer["top1"]["inside"] is True and judge["top1"]["inside"] is False
    assert judge["n_flagged_verified"] == 2 and writer["n_flagged_verified"] == 0
    assert judge["kl"]["inside"] is None  # an unbounded end decides nothing


def test_calibration_leaves_scopes_with_fewer_than_two_verified_requests_unjudged():
    records = [_rec("a", 0.2), _rec("b", 0.9)]
    per_scope = {"a": {"top1": _est(1, 1.0, 0.0, 1.0)}}  # one sample: the whole range
    out = gm.score_calibration(records, per_scope)
    assert out["within_ci"] is None and out["scopes_judged"] == 0
    assert out["per_scope"]["b"]["top1"]["guard_n"] == 0 and out["per_scope"]["b"]["top1"]["inside"] is None


def test_min_samples_resolves_the_scope_closest_to_the_bound_within_budget_floor_and_ceiling():
    warm = {"far": [0.5, 0.6, 0.55], "near": [0.95, 0.97, 0.93, 0.99]}
    mean, sigma = 0.96, 0.0258198889747161
    want = math.ceil((Z95 * sigma / abs(mean - 0.99)) ** 2)  # 3
    out = gm.choose_min_samples(warm, 0.99, budget=100, floor=2, ceiling=50)
    assert out["closest_scope"] == "near" and out["n_resolve"] == want and out["chosen"] == want
    assert gm.choose_min_samples(warm, 0.99, budget=100, floor=5, ceiling=50)["chosen"] == 5
    noisy = {"s": [1.0, 1.0, 1.0, 0.9]}  # 0.015 from the bound with a spread of 0.05: 43 requests to resolve
    assert gm.choose_min_samples(noisy, 0.99, budget=100, ceiling=100)["n_resolve"] == 43
    assert gm.choose_min_samples(noisy, 0.99, budget=12, ceiling=20)["chosen"] == 12  # the warm-up's budget
    assert gm.choose_min_samples(noisy, 0.99, budget=1000, ceiling=20)["chosen"] == 20
    assert gm.choose_min_samples(noisy, 0.99, budget=0, ceiling=20)["chosen"] == gm.MIN_SAMPLES_FLOOR


def test_min_samples_without_two_warm_values_or_at_the_bound_is_conservative():
    assert gm.choose_min_samples({"a": [1.0]}, 0.99, budget=50, ceiling=20)["chosen"] == 20
    on_bound = gm.choose_min_samples({"a": [0.98, 1.0]}, 0.99, budget=50, ceiling=20)
    assert on_bound["n_resolve"] is None and on_bound["chosen"] == 20


def test_the_warm_up_budget_counts_the_burst_a_setting_gets_at_once():
    assert g.controlled_budget(0.1, 30) == 6  # five steps from head 0 to dense, six samples each
    assert g.controlled_budget(0.1, 60) == 12
    assert g.controlled_budget(1.0, 4) == 4  # at rate 1 the rate alone supplies more


def test_best_global_k_is_the_most_reuse_that_meets_the_bound():
    fixed = {0: {"reuse_ratio": 0.94, "teacher_forced_top1": 0.985},
             8: {"reuse_ratio": 0.90, "teacher_forced_top1": 0.991},
             32: {"reuse_ratio": 0.70, "teacher_forced_top1": 0.995},
             64: {"reuse_ratio": 0.90, "teacher_forced_top1": 0.999}}
    assert gm.best_global_k(fixed, 0.99) == {"k": 8, "reuse": 0.90, "top1": 0.991}  # tie on reuse: the smaller K
    assert gm.best_global_k(fixed, 0.999)["k"] == 64
    assert gm.best_global_k(fixed, 0.9999) == {"k": None, "reuse": None, "top1": None}
    assert gm.best_global_k({0: {"reuse_ratio": 0.9, "teacher_forced_top1": None}}, 0.5)["k"] is None


def test_detection_counts_the_samples_at_the_first_dense_poll_and_checks_the_controls():
    polls = [{"v1": {"setting": "head0", "samples": 1}, "v2": {"setting": "head0", "samples": 1},
              "c": {"setting": "head0", "samples": 1}},
             {"v1": {"setting": "dense", "samples": 2}, "v2": {"setting": "head0", "samples": 2},
              "c": {"setting": "head0", "samples": 2}},
             {"v1": {"setting": "dense", "samples": 3}, "v2": {"setting": "dense", "samples": 4},
              "c": {"setting": "head8", "samples": 3}}]
    polls[1]["v2"]["setting"] = "head8"  # v2 first takes a longer head, then goes dense
    out = gm.detection_counts(polls, ["v1", "v2"], ["c"])
    assert out["per_victim"] == {"v1": 2, "v2": 4} and out["detection_samples"] == 4
    assert out["first_action"] == {"v1": 2, "v2": 2} and (out["victims_dense"], out["victims"]) == (2, 2)
    assert out["others_not_dense"] is True and out["per_control"] == {"c": "head8"}  # a longer head still reuses
    missed = gm.detection_counts(polls[:2], ["v1", "v2"], ["c"])
    assert missed["per_victim"]["v2"] is None and missed["detection_samples"] is None
    assert missed["first_action"]["v2"] == 2 and missed["victims_dense"] == 1
    polls[-1]["c"]["setting"] = "dense"
    assert gm.detection_counts(polls, ["v1"], ["c"])["others_not_dense"] is False
    assert gm.detection_counts(polls, ["v1"], [])["others_not_dense"] is None


def test_the_control_twin_renames_agents_and_slots_and_passes_outputs_through():
    def program():
        out = yield fr.Call("solver", 1, (Piece("private", None, [1]), Piece("shared", "query", [2, 3])), 4,
                            output_slot="out:solver")
        yield fr.Call("final", 2, (Piece("shared", "query", [2, 3]), Piece("shared", "out:solver", out)), 4)

    gen = gm.twin_program(program())
    first = next(gen)
    assert first.agent == "solver~control" and first.output_slot == "out:solver~control"
    assert [p.slot for p in first.pieces] == [None, "query~control"] and first.pieces[1].ids == [2, 3]
    second = gen.send([7, 8])
    assert second.agent == "final~control" and second.position == 2
    assert [p.slot for p in second.pieces] == ["query~control", "out:solver~control"]
    assert list(second.pieces[1].ids) == [7, 8]
    with pytest.raises(StopIteration):
        gen.send([9])


def test_small_helpers():
    assert gm.approximated({"tokens_aligned": 3, "tokens_corrected": 2, "tokens_estimate_hit": None}) == 5
    assert gm.approximated(None) == 0
    assert gm.pairs([[[-0.1, 5, "a"], [-2.0, 6, "b"]], None]) == [[(-0.1, 5), (-2.0, 6)], []]
    acts = [{"at": 1.0}, {"at": 2.0}, {"at": 3.0}]
    assert gm.actions_since(acts, 2.0) == [{"at": 2.0}, {"at": 3.0}] and gm.actions_since(acts, 1.0, 2.0) == [{"at": 1.0}]
    assert [list(h) for h in g.halves(5)] == [[0, 1], [2, 3, 4]]
    assert gm.counter_diff({"queued": 3, "verified": 2}, {"queued": 5, "verified": 2, "probes": 1}) == \
        {"probes": 1, "queued": 2}
    assert gm.reuse_ratio([{"shared_tokens": 10, "shared_tokens_reused": 9}, {"shared_tokens": 10}]) == 0.45
    assert gm.reuse_ratio([{}]) is None
    assert [g.overhead_order(i) for i in range(3)] == [("guard", "plain"), ("plain", "guard"), ("guard", "plain")]
    arm = g.GuardedArm("x", "fullshared", 8, verify_rate=0.1, target="top1>=0.99", min_samples=6)
    assert arm.config() == {"mode": "fullshared", "recompute_ratio": 0.0, "min_reuse_tokens": 0, "verify_rate": 0.1,
                            "fidelity_target": "top1>=0.99", "fidelity_min_samples": 6}


def _results() -> dict:
    """A small guard.json as ``benchmarks.guard`` writes it."""
    ttft = {"n": 3, "median": 0.4, "p10": 0.3, "p90": 0.5}
    arms = {f"fullshared_k{k}": {"reuse_ratio": r, "teacher_forced_top1": t, "ttft_agents_2_4_s": ttft}
            for k, r, t in ((0, 0.94, 0.985), (32, 0.7, 0.991))}
    calibration = gm.score_calibration([_rec("a", 0.9), _rec("a", 1.0)], {"a": {"top1": _est(2, 0.95, 0.9, 1.0)}})
    calibration["approximated_requests"] = 2
    verdict = {"n": 4, "median": 1.01, "ci95": [0.99, 1.03], "min": 0.98, "max": 1.05, "tolerance": 0.02,
               "verdict": "unresolved"}
    arms["guarded"] = {"reuse_ratio": 0.8, "teacher_forced_top1": 0.99, "ttft_agents_2_4_s": ttft}
    sizes = {"limit": 2, "warmup": 2, "calibration": 4, "controlled_warmup": 4, "max_tokens": 8}
    task = {"samples": 2, "warmup_samples": 2, "sizes": sizes, "calibration_within_ci": 1.0,
            "calibration": calibration, "min_samples": {"chosen": 5}, "controlled_reuse": 0.8, "controlled_top1": 0.99,
            "controlled": {"ttft_agents_2_4_s": ttft, "actions_in_warmup": [], "actions_in_scored": [{"at": 1}]},
            "best_global_k": 32, "best_global_k_reuse": 0.7, "best_global_k_top1": 0.991, "arms": arms,
            "detection_samples": 5,
            "detection": {"min_samples": 5, "verify_rate": 1.0, "victims": 3, "victims_dense": 3,
                          "others_not_dense": True, "others_kept_reuse": True}}
    return {"meta": {}, "verify_rate": 0.1, "target": "top1>=0.99", "target_bound": 0.99, "heads": [0, 32],
            "complete": True, "tasks": {"retrieval": task},
            "overhead": {"verify_rate": 0.05, "verified_requests": 1, "drain_s": 0.5,
                         "ttft": {"pairs": [{"ratio": 1.0}, {"ratio": 1.02}], "verdict": verdict},
                         "throughput": {"pairs": [{"ratio": 0.99}, {"ratio": 1.0}], "verdict": verdict}},
            "guard_queue": {"peak_jobs": 2, "peak_approx_bytes": 12345, "limits": {"queue_jobs": 16, "scopes": 256}}}


def test_the_report_section_and_the_plot_read_a_results_dict(tmp_path):
    d = _results()
    text = report.render_guard(d)
    assert "| retrieval | 1.00 (1 of 1 scopes judged, 2 requests) | 5 | 0.80 / 0.9900 (1 setting changes)" in text
    assert "| 5 (3 of 3 victim scopes dense; min_samples 5, rate 1) |" in text
    assert "| 0.40 / 0.40 / - s |" in text and "K=32: 0.70 / 0.9910" in text and text.count("| yes |") == 1
    assert "TTFT 1.010 [0.990, 1.030] (4 pairs, unresolved 2%)" in text and "12345 bytes" in text
    assert "retrieval 2 scored from index 0 + 2 warm-up" in text
    assert "Controller:" not in text  # a file that does not record its rule says none
    d["controller"] = rule()
    d["tasks"]["retrieval"]["offset"] = 60
    text = report.render_guard(d)
    assert "Controller: tightens as many steps as the miss asks for" in text and "from index 60 +" in text
    g.plot(d, tmp_path / "guard.png")
    assert (tmp_path / "guard.png").stat().st_size > 0


def _part(command: str, tasks: dict, overhead: bool, revision: str = "a" * 40,
          date: str = "2026-01-02T03:04:05") -> dict:
    """One part of a run measured in pieces: ``_results()``'s description with its own tasks and command."""
    whole = _results()
    part = {k: v for k, v in whole.items() if k not in ("overhead", "guard_queue", "tasks")}
    part.update(command=command, complete=overhead, tasks=tasks, seed=12,
                meta={"command": command, "date": date, "git_revision": revision, "git_dirty": False,
                      "machine": {"cpu_count": 2}})
    if overhead:
        part.update(overhead=whole["overhead"], overhead_ttft_ratio=whole["overhead"]["ttft"]["verdict"],
                    overhead_throughput_ratio=whole["overhead"]["throughput"]["verdict"],
                    guard_queue=whole["guard_queue"], wall_s=100.0)
    return part


RUN = "python -m benchmarks.guard --seed 12 --offset 210"


def test_parts_of_one_run_merge_into_the_whole_run_in_task_order(tmp_path):
    task = _results()["tasks"]["retrieval"]
    stopped = _part(RUN, {"retrieval": task}, overhead=False)
    rest = _part(RUN + " --task gsm8k --out-dir tmp/x", {"gsm8k": task}, overhead=True,
                 date="2026-01-03T00:00:00")
    rest["meta"]["serving_digest"] = stopped["meta"]["serving_digest"] = "d"
    merged = runs.merge_tasks([rest, stopped], "python -m benchmarks.guard --merge b a", g.parse_args, fr.TASKS)
    assert list(merged["tasks"]) == ["retrieval", "gsm8k"] and merged["complete"] is True
    assert merged["meta"]["serving_digest"] == "d"  # the serving code every part measured
    assert merged["commands"] == [rest["command"], stopped["command"]] and len(merged["parts_meta"]) == 2
    assert merged["meta"]["command"] == "python -m benchmarks.guard --merge b a"
    assert merged["meta"]["date"] == "2026-01-03T00:00:00" and merged["meta"]["git_revision"] == "a" * 40
    assert merged["overhead_ttft_ratio"]["median"] == 1.01 and merged["guard_queue"]["parts_recorded"] == 1
    assert merged["wall_s"] is None  # the stopped part did not record its time
    assert merged["seed"] == 12 and merged["target_bound"] == 0.99
    text = report.render_guard(merged)
    assert merged["parts_measured"] == [["gsm8k", "overhead"], ["retrieval"]]
    assert "joined with `--merge`" in text
    assert f"`{rest['command']}` (started " in text and " UTC): gsm8k, overhead" in text
    without = runs.merge_tasks([stopped, _part(RUN + " --task gsm8k --no-overhead", {"gsm8k": task}, False)],
                               "m", g.parse_args, fr.TASKS)
    assert without["complete"] is False and "overhead" not in without and "guard_queue" not in without


@pytest.mark.parametrize("change, reason", [
    (lambda p: p.update(command=RUN.replace("12", "13") + " --task gsm8k"), "not the same run"),
    (lambda p: p.update(command="python -m benchmarks.frontier --task gsm8k"), "not a benchmarks.guard command"),
    (lambda p: p.update(heads=[0, 8]), "differs from"),
    (lambda p: p["meta"].update(git_revision="b" * 40), "different code"),
    (lambda p: p["meta"].update(git_dirty=True), "uncommitted"),
    (lambda p: p.update(tasks={"retrieval": {}}), "measured by more than one part"),
])
def test_parts_that_are_not_one_measurement_are_refused(change, reason):
    task = _results()["tasks"]["retrieval"]
    stopped = _part(RUN, {"retrieval": task}, overhead=True)
    rest = _part(RUN + " --task gsm8k", {"gsm8k": task}, overhead=False)
    change(rest)
    with pytest.raises(runs.MergeError, match=reason):
        runs.merge_tasks([stopped, rest], "m", g.parse_args, fr.TASKS)


def test_merge_writes_the_joined_file_or_refuses_with_nothing_written(tmp_path):
    import json

    task = _results()["tasks"]["retrieval"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_part(RUN, {"retrieval": task}, overhead=False)))
    b.write_text(json.dumps(_part(RUN + " --task gsm8k", {"gsm8k": task}, overhead=True)))
    out = tmp_path / "out"
    assert g.main(["--merge", str(a), str(b), "--out-dir", str(out)]) == 0
    joined = json.loads((out / "guard.json").read_text())
    assert list(joined["tasks"]) == ["retrieval", "gsm8k"] and (out / "guard.png").stat().st_size > 0
    bad = tmp_path / "bad"
    assert g.main(["--merge", str(a), str(a), "--out-dir", str(bad)]) == 2  # the same task twice
    assert g.main(["--merge", str(a), str(tmp_path / "missing.json"), "--out-dir", str(bad)]) == 2
    assert not bad.exists()


def test_a_verification_in_flight_or_timed_out_is_told_apart_from_a_settled_queue():
    """The queue's length drops when a job is taken off it, not when its reference answers: a client that waits
    for the guard must count the jobs' ends, a timed-out reference included."""
    from benchmarks.harness import verifications_settled

    in_flight = {"queue": {"jobs": 0}, "counters": {"queued": 3, "verified": 2}}
    assert not verifications_settled(in_flight)
    assert verifications_settled({"queue": {"jobs": 0}, "counters": {"queued": 3, "verified": 2, "verify_timeouts": 1}})
    assert not verifications_settled({"queue": {"jobs": 1}, "counters": {"queued": 3, "verified": 3}})
    assert not verifications_settled({})
