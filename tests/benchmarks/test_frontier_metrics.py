"""The frontier's pure parts: retrieval samples and scoring, top-k KL, random-mix selection, summaries."""

from __future__ import annotations

import math

import pytest

from benchmarks import frontier as fr
from benchmarks import frontier_metrics as fm
from benchmarks import runs
from benchmarks.workloads import retrieval as rt
from sglang_kvshare.frontend.builder import Piece, assemble


# ------------------------------------------------------------------ retrieval workload
def test_retrieval_samples_are_deterministic_distinct_and_answerable():
    a, b = rt.load(5, 0, seed=3), rt.load(5, 0, seed=3)
    assert a == b
    assert rt.load(5, 0, seed=4) != a
    for smp in a:
        keys = [f.key for f in smp.facts]
        assert len(set(keys)) == rt.FACTS
        assert len({f.value for f in smp.facts}) == rt.FACTS
        assert len({lk.key for lk in smp.lookups}) == rt.AGENTS
        for lk in smp.lookups:  # every asked key is stated in the document with its value
            assert f"The code of {lk.key} is {lk.value}." in smp.document


def test_retrieval_extract_and_score():
    lk = rt.Lookup("Falcon", "4821")
    assert rt.score(rt.extract_value(" 4821."), lk)
    assert rt.score(rt.extract_value(" 4,821"), lk)
    assert not rt.score(rt.extract_value(" 4812."), lk)
    assert rt.extract_value(" unknown") == ""
    assert not rt.score("", lk)


def test_retrieval_program_shares_the_document_under_one_slot():
    smp = rt.make_sample(0)
    enc = lambda text: [ord(c) for c in text]  # noqa: E731 -- any tokenizer will do for the layout
    calls = list(fr.retrieval_program(smp, enc, 8))
    assert [c.position for c in calls] == [1, 2, 3, 4]
    docs = [[p for p in c.pieces if p.kind == "shared"] for c in calls]
    assert all(len(d) == 1 and d[0].slot == "doc" and d[0].ids == docs[0][0].ids for d in docs)
    assert len({c.agent for c in calls}) == 4


def test_refer_program_passes_role_outputs_to_the_final_agent():
    from benchmarks.workloads.tasks import GSM8K, Sample

    enc = lambda text: [ord(c) for c in text]  # noqa: E731
    prog = fr.refer_program(GSM8K, Sample("s", "What is 2+2?", "4"), enc, 16)
    call = next(prog)
    outs = []
    while True:
        outs.append([100 + call.position, 7])
        try:
            call = prog.send(outs[-1])
        except StopIteration:
            break
        if call.agent == "final":
            break
    shared = [(p.slot, list(p.ids)) for p in call.pieces if p.kind == "shared"]
    assert shared[0][0] == "query"
    assert shared[1:] == [(f"out:{r.name}", o) for r, o in zip(GSM8K.roles, outs)]


# ------------------------------------------------------------------ teacher-forced metrics
def test_kl_topk_is_zero_for_equal_and_matches_the_closed_form():
    p = {1: math.log(0.7), 2: math.log(0.2), 3: math.log(0.1)}
    assert fm.kl_topk(p, dict(p)) == pytest.approx(0.0, abs=1e-12)
    q = {1: math.log(0.5), 2: math.log(0.3), 3: math.log(0.2)}
    want = sum(pp * math.log(pp / qq) for pp, qq in ((0.7, 0.5), (0.2, 0.3), (0.1, 0.2)))
    assert fm.kl_topk(p, q) == pytest.approx(want, rel=1e-9)


def test_kl_topk_renormalizes_and_floors_missing_tokens():
    # P's support is {1, 2}; Q lacks token 2, so it gets Q's smallest logprob (0.1).
    p = {1: math.log(0.6), 2: math.log(0.3)}
    q = {1: math.log(0.8), 5: math.log(0.1)}
    p1, p2 = 0.6 / 0.9, 0.3 / 0.9
    q1, q2 = 0.8 / 0.9, 0.1 / 0.9
    assert fm.kl_topk(p, q) == pytest.approx(p1 * math.log(p1 / q1) + p2 * math.log(p2 / q2), rel=1e-9)
    with pytest.raises(ValueError):
        fm.kl_topk({}, q)


def test_compare_positions_counts_top1_and_rejects_mismatched_lengths():
    ref = [{1: -0.1, 2: -2.0}, {3: -0.5, 4: -0.9}]
    arm = [{1: -0.2, 2: -1.5}, {3: -1.0, 4: -0.4}]
    row = fm.compare_positions(ref, arm)
    assert row["positions"] == 2 and row["top1"] == 0.5 and row["kl"] > 0
    with pytest.raises(ValueError):
        fm.compare_positions(ref, arm[:1])
    pooled = fm.pooled([row, {"positions": 0, "top1": None, "kl": None}, {"positions": 2, "top1": 1.0, "kl": 0.0}])
    assert pooled["positions"] == 4 and pooled["top1"] == pytest.approx(0.75)


def test_top_entries_reads_sglang_triples():
    assert fm.top_entries([[-0.5, 12, "a"], [-1.5, 7, "b"]]) == {12: -0.5, 7: -1.5}
    assert fm.top_entries(None) == {}


def test_argmax_breaks_ties_by_token_id():
    assert fm.argmax({9: -1.0, 3: -1.0, 5: -2.0}) == 3


# ------------------------------------------------------------------ random mix
def test_random_mix_is_nested_deterministic_and_near_its_share():
    keys = [("s", i, "doc") for i in range(2000)]
    sets = {p: {k for k in keys if fm.dense_in_mix(p, 0, *k)} for p in (0.0, 0.25, 0.5, 0.75, 1.0)}
    assert sets[0.0] == set() and sets[1.0] == set(keys)
    assert sets[0.25] <= sets[0.5] <= sets[0.75]
    for p in (0.25, 0.5, 0.75):
        assert abs(len(sets[p]) / len(keys) - p) < 0.04
    assert sets[0.5] == {k for k in keys if fm.dense_in_mix(0.5, 0, *k)}
    assert sets[0.5] != {k for k in keys if fm.dense_in_mix(0.5, 1, *k)}
    with pytest.raises(ValueError):
        fm.dense_in_mix(1.5, 0, "x")


def test_mixed_renames_only_consumer_shared_pieces_and_keeps_ids():
    call = fr.Call("clerk", 2, (Piece("private", None, [1, 2]), Piece("shared", "doc", [3, 4, 5]),
                                Piece("private", None, [6])), 8)
    full = fr.Arm("mix_p1", "fullshared", 0, 1.0)
    renamed = fr.mixed(call, full, "s0", 0)
    assert renamed[1].slot != "doc" and renamed[1].slot.startswith("doc#mix-dense:")
    assert [p.ids for p in renamed] == [p.ids for p in call.pieces]
    assert fr.mixed(call, fr.Arm("mix_p0", "fullshared", 0, 0.0), "s0", 0) == call.pieces
    producer = fr.Call("archivist", 1, call.pieces, 8)
    assert fr.mixed(producer, full, "s0", 0) == call.pieces
    # The renamed request is still a valid annotation of the same ids.
    built = assemble("clerk", renamed)
    assert built.input_ids == [1, 2, 3, 4, 5, 6]
    # The request a mix arm sends: the coin's segment is also marked reuse: false (no estimate may start in
    # it), every other segment as the call has it.
    sent = fr.build(call, full, "s0", 0, (Piece("private", None, [7]),))
    assert sent.input_ids == [1, 2, 3, 4, 5, 6, 7]
    assert [s.reuse for s in sent.annotation.segments] == [True, False, True]
    assert sent.annotation.segments[1].slot == renamed[1].slot
    kept = fr.build(call, fr.Arm("fullshared_k0", "fullshared", 0), "s0", 0)
    assert kept.annotation == assemble("clerk", call.pieces).annotation


def test_interpolate_and_line_gaps():
    assert fm.interpolate([(0.0, 1.0), (1.0, 0.0)], 0.25) == pytest.approx(0.75)
    assert fm.interpolate([(0.0, 1.0), (0.5, 0.9), (1.0, 0.0)], 0.75) == pytest.approx(0.45)
    assert fm.interpolate([(0.2, 1.0), (0.8, 0.0)], 0.9) is None

    def arm(mode, k, p, reuse, agree, top1):
        return {"mode": mode, "recompute_head": k, "random_mix_p": p, "reuse_ratio": reuse,
                "agreement_final": agree, "teacher_forced_top1": top1}

    arms = {"off": arm("off", 0, None, 0.0, 1.0, 1.0), "fullshared_k0": arm("fullshared", 0, None, 0.8, 0.2, 0.9),
            "mix_p0.5": arm("fullshared", 0, 0.5, 0.4, 0.6, 0.95), "kvcmas_k8": arm("kvcmas", 8, None, 0.6, 0.7, 0.97)}
    fm.add_line_gaps(arms)
    assert arms["kvcmas_k8"]["random_mix_agreement_at_same_reuse"] == pytest.approx(0.4)
    assert arms["kvcmas_k8"]["above_random_mix"] == pytest.approx(0.3)
    assert arms["off"]["above_random_mix"] == pytest.approx(0.0)


def test_the_line_gap_interval_covers_the_gap_and_separates_a_clear_winner():
    n = 60
    off = [1.0] * n
    full = [1.0 if i % 5 == 0 else 0.0 for i in range(n)]  # 0.2 at reuse 0.8
    mix = [1.0 if i % 5 < 3 else 0.0 for i in range(n)]  # 0.6 at reuse 0.4
    good = [1.0 if i % 10 else 0.0 for i in range(n)]  # 0.9 at reuse 0.6: the line gives 0.4
    same = [1.0 if i % 5 < 2 else 0.0 for i in range(n)]  # 0.4 at reuse 0.6: on the line
    agree = {"off": off, "fullshared_k0": full, "mix_p0.5": mix, "good": good, "same": same}
    reuse = {"off": 0.0, "fullshared_k0": 0.8, "mix_p0.5": 0.4, "good": 0.6, "same": 0.6}
    ci = fm.line_gap_intervals(agree, reuse, ["off", "fullshared_k0", "mix_p0.5"], reps=500)
    assert ci["good"][0] > 0.3 and ci["good"][0] < 0.5 < ci["good"][1]
    assert ci["same"][0] < 0 < ci["same"][1]
    assert ci["off"] == [0.0, 0.0]
    with pytest.raises(ValueError):
        fm.line_gap_intervals({"off": off, "x": off[:-1]}, {"off": 0.0, "x": 0.5}, ["off"])
    # Through add_line_gaps, from the per-item answers of the arms' summaries.
    def arm(mode, k, p, r, ind):
        return {"mode": mode, "recompute_head": k, "random_mix_p": p, "reuse_ratio": r,
                "agreement_final": sum(ind) / n, "teacher_forced_top1": None,
                "per_item": [{"id": str(i), "answer": "a" if x else f"b{i}", "correct": False} for i, x in enumerate(ind)]}
    arms = {"off": arm("off", 0, None, 0.0, off), "fullshared_k0": arm("fullshared", 0, None, 0.8, full),
            "mix_p0.5": arm("fullshared", 0, 0.5, 0.4, mix), "kvcmas_k8": arm("kvcmas", 8, None, 0.6, good)}
    fm.add_line_gaps(arms)
    lo, hi = arms["kvcmas_k8"]["above_random_mix_ci95"]
    assert lo < arms["kvcmas_k8"]["above_random_mix"] < hi and lo > 0.3


def merge(parts: list, remeasured=()) -> dict:
    return runs.merge_arms(parts, remeasured, fr.planned_arms)


def test_runs_of_the_same_samples_merge_and_runs_with_another_reference_do_not():
    def arm(mode, k, p, r, answers):
        return {"mode": mode, "recompute_head": k, "random_mix_p": p, "reuse_ratio": r,
                "agreement_final": sum(a == "x" for a in answers) / len(answers), "teacher_forced_top1": 1.0,
                "teacher_forced_positions": 10, "per_item": [{"id": str(i), "answer": a, "correct": False}
                                                            for i, a in enumerate(answers)]}

    head = {"task": "gsm8k", "samples": 4, "seed": 0, "max_tokens": 8, "complete": True}
    off = arm("off", 0, None, 0.0, ["x"] * 4)
    one = {**head, "command": "a", "arms": {"off": off, "fullshared_k0": arm("fullshared", 0, None, 0.8, ["x", "y", "y", "y"]),
                                          "mix_p0.5": arm("fullshared", 0, 0.5, 0.4, ["x", "x", "y", "y"])}}
    two = {**head, "command": "b", "arms": {"off": {**arm("off", 0, None, 0.0, ["x"] * 4),
                                                    "ttft_agents_2_4_s": {"median": 1.5}},
                                          "kvcmas_k32": arm("kvcmas", 32, None, 0.6, ["x", "x", "x", "y"])}}
    merged = merge([one, two])
    assert list(merged["arms"]) == ["off", "fullshared_k0", "mix_p0.5", "kvcmas_k32"]
    assert merged["commands"] == ["a", "b"] and "command" not in merged
    assert merged["arms"]["kvcmas_k32"]["above_random_mix"] == pytest.approx(0.75 - 0.375)
    assert merged["arms"]["kvcmas_k32"]["above_random_mix_ci95"] is not None
    # Each arm keeps its own run's off TTFT (seconds move between runs); the first run's off has none here.
    assert merged["arms"]["kvcmas_k32"]["off_ttft_agents_2_4_median_same_run"] == 1.5
    assert "off_ttft_agents_2_4_median_same_run" not in merged["arms"]["fullshared_k0"]
    other_ref = {**two, "arms": {**two["arms"], "off": arm("off", 0, None, 0.0, ["x", "x", "x", "z"])}}
    with pytest.raises(ValueError, match="off answered differently"):
        merge([one, other_ref])
    with pytest.raises(ValueError, match="samples"):
        merge([one, {**two, "samples": 5}])
    # A part stopped before its last arm is whole once another part ran that arm, and not before.
    assert merged["complete"] is True
    stopped = {**one, "complete": False, "command": "python -m benchmarks.frontier --arms off,fullshared_k0,mix_p0.5,kvcmas_k32"}
    assert merge([stopped, two])["complete"] is True
    assert merge([{**stopped, "command": stopped["command"] + ",fullshared_k32"}, two])["complete"] is False
    assert merge([{**stopped, "command": "python -m benchmarks.frontier"}, two])["complete"] is False
    assert fr.planned_arms("python -m benchmarks.frontier --arms=off,kvcmas_k8") == {"off", "kvcmas_k8"}
    # A merge merges again: its parts' commands and dates come along, in order.
    three = {**head, "command": "c", "meta": {"date": "3"}, "arms": {"off": off, "fullshared_r0.2": arm(
        "fullshared", 0, None, 0.8, ["x", "x", "x", "x"])}}
    again = merge([{**merged, "parts_meta": [{"date": "1"}, {"date": "2"}]}, three])
    assert again["commands"] == ["a", "b", "c"] and [m["date"] for m in again["parts_meta"]] == ["1", "2", "3"]
    assert again["arms"]["kvcmas_k32"]["off_ttft_agents_2_4_median_same_run"] == 1.5  # carried by the merge
    assert list(again["arms"])[-1] == "fullshared_r0.2" and again["complete"] is True
    # An arm measured again in a later part (after a fix) replaces the first measurement when named so, and
    # the merge says which; off, every part's reference, cannot be replaced, nor an arm no part has.
    fixed = {**head, "command": "d", "arms": {"off": off, "mix_p0.5": arm("fullshared", 0, 0.5, 0.45, ["x", "x", "x", "y"])}}
    assert merge([merged, fixed])["arms"]["mix_p0.5"]["reuse_ratio"] == 0.4
    line_before = merged["arms"]["kvcmas_k32"]["random_mix_agreement_at_same_reuse"]
    redone = merge([merged, fixed], remeasured=["mix_p0.5"])
    assert redone["arms"]["mix_p0.5"]["reuse_ratio"] == 0.45 and redone["remeasured"] == ["mix_p0.5"]
    assert list(redone["arms"]) == list(merged["arms"])  # the arm keeps its place
    assert redone["arms"]["kvcmas_k32"]["random_mix_agreement_at_same_reuse"] != line_before  # the line moved
    for bad in (["off"], ["kvcmas_k99"]):
        with pytest.raises(ValueError, match="remeasured"):
            merge([merged, fixed], remeasured=bad)


def test_runs_of_other_seeds_pool_every_item_and_position_and_keep_ttft_per_run():
    def arm(mode, ratio, shared, reused, top1, positions, answers, correct, ttft):
        n = len(answers)
        return {"arm": f"{mode}_r{ratio}" if ratio else mode, "mode": mode, "recompute_head": 0,
                "random_mix_p": None, "policy": "head" if ratio else None, "recompute_ratio": ratio,
                "forwards_per_request": 1.0, "shared_tokens": shared, "shared_tokens_reused": reused,
                "tokens_head_recomputed": 0, "teacher_forced_top1": top1, "teacher_forced_kl": 1.0 - top1,
                "teacher_forced_positions": positions, "scored_items": n, "run_s": 1.0, "identical_text": 0.5,
                "fallback_reasons": {"no_source": 1}, "accuracy_vs_off_paired": {"mean": 0.0},
                "ttft_agents_2_4_s": {"n": n, "median": ttft, "p10": ttft, "p90": ttft},
                "per_item": [{"id": str(i), "answer": a, "correct": c} for i, (a, c) in enumerate(zip(answers, correct))]}

    def run(seed, arm_answers, arm_correct, top1, positions):
        return {"task": "retrieval", "samples": 2, "scored_items": 4, "seed": seed, "max_tokens": 8, "top_k": 20,
                "concurrency": 4, "complete": True, "command": f"run {seed}", "meta": {"date": str(seed)},
                "arms": {"off": arm("off", None, 100, 0, 1.0, positions, ["a"] * 4, [True, True, False, False], 1.0),
                         "fullshared_r0.15": arm("fullshared", 0.15, 100, 80, top1, positions, arm_answers,
                                                 arm_correct, 0.5 + seed)}}

    one = run(1, ["a", "a", "a", "b"], [True, True, False, False], 0.98, 10)
    two = run(9, ["a", "b", "b", "b"], [True, False, False, False], 0.90, 30)
    pooled = runs.pool_arms([one, two])
    a = pooled["arms"]["fullshared_r0.15"]
    assert pooled["seed"] == [1, 9] and pooled["pooled"] is True and pooled["scored_items"] == 8
    assert pooled["commands"] == ["run 1", "run 9"]
    assert a["agreement_final"] == pytest.approx(4 / 8)  # each run's arm against its own run's off
    assert a["teacher_forced_top1"] == pytest.approx((0.98 * 10 + 0.90 * 30) / 40)  # weighted by positions
    assert a["reuse_ratio"] == pytest.approx(160 / 200) and pooled["arms"]["off"]["reuse_ratio"] == 0.0
    assert a["accuracy"] == pytest.approx(3 / 8)
    assert a["accuracy_vs_off_paired"]["mean"] == pytest.approx(-1 / 8) and a["accuracy_vs_off_paired"]["n"] == 8
    assert a["fallback_reasons"] == {"no_source": 2}
    assert a["ttft_agents_2_4_s"] is None and [t["median"] for t in a["ttft_agents_2_4_s_per_run"]] == [1.5, 9.5]
    assert [label for label, _, _ in fr.ttft_bars(pooled)][-2:] == ["fullshared_r0.15 (seed 1)",
                                                                   "fullshared_r0.15 (seed 9)"]
    with pytest.raises(ValueError, match="share a seed"):
        runs.pool_arms([one, one])
    with pytest.raises(ValueError, match="itself pooled"):
        runs.pool_arms([pooled, run(5, ["a"] * 4, [True] * 4, 1.0, 10)])
    with pytest.raises(ValueError, match="arms"):
        runs.pool_arms([one, {**two, "arms": {"off": two["arms"]["off"]}}])
    with pytest.raises(ValueError, match="max_tokens"):
        runs.pool_arms([one, {**two, "max_tokens": 16}])


# ------------------------------------------------------------------ summaries
def test_paired_bootstrap_interval_covers_the_mean_and_detects_a_shift():
    ref = [1.0] * 150 + [0.0] * 150
    same = fm.paired_bootstrap(ref, ref)
    assert same["mean"] == 0.0 and same["ci95"] == [0.0, 0.0]
    worse = [0.0 if i % 5 == 0 and r == 1.0 else r for i, r in enumerate(ref)]  # 30 right answers lost
    res = fm.paired_bootstrap(worse, ref)
    assert res["mean"] == pytest.approx(-0.1)
    assert res["ci95"][0] < -0.1 < res["ci95"][1] < 0
    assert res["discordant"] == {"arm_only_right": 0, "ref_only_right": 30}
    with pytest.raises(ValueError):
        fm.paired_bootstrap(ref, ref[:-1])


def test_summarize_arm_fields_from_synthetic_runs():
    smp = rt.make_sample(0)

    def rows(values, reused):
        return [{"agent": r.name, "position": i + 1, "output_ids": [ord(c) for c in f" {v}."], "ttft_s": 0.1 * (i + 1),
                 "report": {"shared_tokens": 100, "shared_tokens_reused": reused if i else 0,
                            "tokens_head_recomputed": 8 if i and reused else 0, "prefill_forwards": 1 + (i == 3)}}
                for i, (r, v) in enumerate(zip(rt.ROLES, values))]

    gold = [lk.value for lk in smp.lookups]
    off_raw = [rows(gold, 0)]
    arm_raw = [rows(gold[:3] + ["0000"], 92)]
    tops = {(0, i): {"tops": [{1: -0.1, 2: -2.5}], "report": {}} for i in (1, 2, 3)}
    off = {"arm": fr.Arm("off", "off"), "raw": off_raw, "tf": tops, "run_s": 1.0, "wall_s": 2.0}
    run = {"arm": fr.Arm("kvcmas_k8", "kvcmas", 8), "raw": arm_raw, "tf": tops, "run_s": 1.0, "wall_s": 2.0}
    spec = fr.task_spec("retrieval", 0)
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    s = fr.summarize_arm(run, off, spec, [smp], decode)
    for key in ("mode", "recompute_head", "reuse_ratio", "agreement_final", "identical_text", "teacher_forced_top1",
                "teacher_forced_kl", "accuracy", "ttft_agents_2_4_s"):
        assert key in s
    assert s["mode"] == "kvcmas" and s["recompute_head"] == 8
    assert s["reuse_ratio"] == pytest.approx(0.92)
    assert s["reuse_ratio_all_requests"] == pytest.approx(3 * 92 / 400)
    assert s["tokens_head_recomputed"] == 24
    assert s["policy"] == "head" and s["recompute_ratio"] == 0.0
    assert s["forwards_per_request"] == pytest.approx(4 / 3)  # consumers only: 1, 1 and a staged 2
    assert s["scored_items"] == 3
    assert s["agreement_final"] == pytest.approx(2 / 3)
    assert s["accuracy"] == pytest.approx(2 / 3)
    assert s["accuracy_vs_off_paired"]["mean"] == pytest.approx(-1 / 3)
    assert s["teacher_forced_top1"] == 1.0 and s["teacher_forced_kl"] == pytest.approx(0.0)
    assert s["ttft_agents_2_4_s"]["median"] == pytest.approx(0.3)
    assert sorted(s["teacher_forced_per_agent"]) == sorted(r.name for r in rt.ROLES[1:4])
    assert s["reuse_per_agent"][rt.ROLES[0].name]["ratio"] is None  # the producer is no consumer
    assert all(s["reuse_per_agent"][r.name] == {"ratio": pytest.approx(0.92), "shared": 100, "reused": 92}
               for r in rt.ROLES[1:4])
    assert all(a["answers"] == 1 and a["per_answer"] == [[0, 1.0, 0.0, 1]]
               for a in s["teacher_forced_per_agent"].values())


def test_teacher_forced_values_pool_per_agent_and_keep_each_answer():
    rows = [{"positions": 4, "top1": 1.0, "kl": 0.0}, {"positions": 2, "top1": 0.5, "kl": 0.3},
            {"positions": 10, "top1": 0.9, "kl": 0.01}, {"positions": 0, "top1": None, "kl": None}]
    out = fr.per_agent([("judge", 3), ("judge", 1), ("worker", 0), ("worker", 1)], rows)
    assert list(out) == ["judge", "worker"]
    assert out["judge"]["top1"] == pytest.approx(5 / 6) and out["judge"]["positions"] == 6
    assert out["judge"]["kl"] == pytest.approx(0.1)
    assert out["judge"]["per_answer"] == [[1, 0.5, 0.3, 2], [3, 1.0, 0.0, 4]]  # in sample order
    assert out["worker"]["answers"] == 2 and out["worker"]["per_answer"] == [[0, 0.9, 0.01, 10]]  # empty: no value


def test_ratio_arms_recompute_a_share_and_stay_off_the_random_mix_line():
    arms = {a.name: a for a in fr.default_arms([0], [], ratios=[0.15])}
    r = arms["fullshared_r0.15"]
    assert r.policy == "head" and "--kvshare-recompute-ratio" in r.server_args() and "kvcmas_r0.15" in arms
    assert arms["fullshared_k0"].policy == "none"
    summary = {"mode": "fullshared", "recompute_head": 0, "random_mix_p": None, "recompute_ratio": 0.15}
    assert not fm.on_mix_line("fullshared_r0.15", summary)
    assert fm.on_mix_line("fullshared_k0", {**summary, "recompute_ratio": 0.0})


def test_an_arm_name_the_run_does_not_have_is_refused_not_dropped():
    args = fr.parse_args(["--task", "retrieval", "--heads", "0", "--arms", "off,fullshared_k0,kvcmas"])
    with pytest.raises(SystemExit, match="kvcmas"):
        fr.selected_arms(args)
    args = fr.parse_args(["--task", "retrieval", "--heads", "0", "--arms", "off,fullshared_k0"])
    assert [a.name for a in fr.selected_arms(args)] == ["off", "fullshared_k0"]


def test_warmup_samples_exist_and_are_never_scored_ones():
    # GSM8K keeps the warm-up its committed runs used (questions 550-557 for 50 scored).
    gsm = fr.task_spec("gsm8k", 0)
    assert [s.id for s in fr.load_warmup(gsm, 50, 8)] == [f"gsm8k/{i}" for i in range(550, 558)]
    # Too few samples past the scored ones for the gap: the set's last ones, never a scored one.
    scored = {s.id for s in gsm.load(1300, 0)}
    warm = fr.load_warmup(gsm, 1300, 8)
    assert [s.id for s in warm] == [f"gsm8k/{i}" for i in range(1311, 1319)] and not scored & {s.id for s in warm}
    with pytest.raises(ValueError, match="only 4 samples after the 1315 scored"):
        fr.load_warmup(gsm, 1315, 8)
    assert fr.load_warmup(gsm, 50, 0) == []
    ret = fr.task_spec("retrieval", 0)
    assert [s.id for s in fr.load_warmup(ret, 100, 2)] == [s.id for s in rt.load(2, 100_000, 0)]


def test_teacher_forced_line_intervals_resample_samples_jointly():
    from benchmarks.frontier_metrics import tf_line_gap_intervals

    # off: exact; fullshared K=0: 10 of 100 positions wrong, KL 0.01 a position; the arm at half reuse: 2 wrong
    # (above the line's 5 at that reuse), KL 0.002 (below the line's 0.005).
    per = {"off": [[10, 10.0, 0.0]] * 10, "fullshared_k0": [[10, 9.0, 0.1]] * 10,
           "arm": [[10, 9.0, 0.02]] * 2 + [[10, 10.0, 0.02]] * 8}
    ci = tf_line_gap_intervals(per, {"off": 0.0, "fullshared_k0": 1.0, "arm": 0.5}, ["off", "fullshared_k0"])
    lo, hi = ci["arm"]["top1_above"]
    assert -1e-9 <= lo <= 0.03 <= hi <= 0.05 + 1e-9  # 0.98 against the line's 0.95; the 2 bad samples resampled
    assert abs(ci["arm"]["kl_below"][0] - 0.003) < 1e-9 and abs(ci["arm"]["kl_below"][1] - 0.003) < 1e-9
    assert ci["off"]["top1_above"] == [0.0, 0.0]
    with pytest.raises(ValueError):
        tf_line_gap_intervals({"a": [[1, 1.0, 0.0]], "b": []}, {"a": 0.0, "b": 1.0}, ["a", "b"])
