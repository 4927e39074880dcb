"""One gate decision for every tensor-parallel rank: two real processes, each holding one of the two KV heads
and reducing over a gloo group, decide what one process holding both heads decides."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import socket
import time

import pytest
import torch

from sglang_kvshare.correction import AnchorPool, LocalReducer, PoolConfig, RopeSpec, rotate_keys
from sglang_kvshare.correction.apply import materialize
from sglang_kvshare.learning.learner import Observation


def _observations(rank: int | None, mixed: bool = False):
    """Four anchors' observations and a noisy copy of the third as the source (``mixed``: head 0 of the
    second anchor and head 1 of the third); both heads (``rank`` None), or the rank's one head."""
    g = torch.Generator().manual_seed(7)
    spec = RopeSpec.default(head_dim=8)

    def seg(scale):
        return torch.randn(2, 12, 2, 8, generator=g) * scale, torch.randn(2, 12, 2, 8, generator=g) * scale

    obs = []
    for key in range(4):
        k, v = seg(10.0)
        dk, dv = seg(0.1)
        obs.append((k, v, rotate_keys(k, 4, spec) + rotate_keys(dk, 7, spec), v + dv, key))
    k, v = obs[2][0].clone(), obs[2][1].clone()
    if mixed:
        k[:, :, 0], v[:, :, 0] = obs[1][0][:, :, 0], obs[1][1][:, :, 0]
    src = (k + 0.3 * torch.randn(k.shape, generator=g), v + 0.3 * torch.randn(v.shape, generator=g))
    heads = slice(None) if rank is None else slice(rank, rank + 1)
    return spec, [(a[:, :, heads], b[:, :, heads], c[:, :, heads], d[:, :, heads], key) for a, b, c, d, key in obs], \
        (src[0][:, :, heads], src[1][:, :, heads])


def _decide(rank: int | None, reducer, low_rank: int | None, mixed: bool = False) -> dict:
    spec, obs, (sk, sv) = _observations(rank, mixed)
    pool = AnchorPool(spec, PoolConfig(tau=0.9, rank=low_rank), reducer)
    for k, v, tk, tv, key in obs:
        pool.add_observation(k, v, 3, tk, tv, 7, "e", key)
    res = pool.estimate(sk, sv, 3, 7, "e")
    out = {"accepted": res.accepted, "entropy": res.entropy, "weights": res.gate_weights.tolist(),
           "activations": [a["activations"] for a in pool.describe()]}
    if res.accepted:
        k_hat, v_hat = materialize(sk, sv, 3, 7, res.plan, spec)
        out["k"], out["v"] = k_hat.tolist(), v_hat.tolist()
    return out


def _estimator(rank: int, reducer, anchors=range(4)):
    """A kvcmas estimator of the rank's head that learned the given anchors of ``_observations`` for slot ``doc``."""
    from sglang_kvshare.correction import make_estimator

    spec, obs, _ = _observations(rank)
    est = make_estimator("kvcmas", spec, tau=0.9, rank=None, reducer=reducer)
    for i in anchors:
        est.observe("doc", *_edge(obs[i]), content_key=obs[i][4])
    return est


def _edge(ob):
    """(source, target) of one observation: agent ``a``'s copy at position 3, agent ``b``'s dense prefill at 7."""
    from sglang_kvshare.correction import SegmentCache

    k, v, tk, tv, _ = ob
    return SegmentCache(k, v, 3, "a", exact=True), SegmentCache(tk, tv, 7, "b", exact=True)


def _source(rank: int):
    from sglang_kvshare.correction import SegmentCache

    _, _, (sk, sv) = _observations(rank)
    return SegmentCache(sk, sv, 3, "a", exact=True)


def _gate(est, slot="doc", source=None, rank=0) -> tuple[str, float]:
    """(reason, seconds) of one gate decision for ``b`` at position 7."""
    t0 = time.monotonic()
    res = est.estimate(slot, source if source is not None else _source(rank), "b", 7)
    return res.reason, time.monotonic() - t0


def _drifted(rank: int, reducer) -> dict:
    """Rank 1 learned one more anchor than rank 0 (a learning step that failed on rank 0)."""
    est = _estimator(rank, reducer, range(4 if rank == 1 else 3))
    reason, _ = _gate(est, rank=rank)
    return {"reason": reason, "pool": est.pool_size("doc")}


def _pools_differ(rank: int, reducer) -> dict:
    """Pools that differ by one anchor (1 against 2: rank 0 alone would say ``too_few_anchors``), and a slot only
    rank 1 holds a pool for."""
    est = _estimator(rank, reducer, range(1 if rank == 0 else 2))
    one = _gate(est, rank=rank)
    est2 = _estimator(rank, reducer, () if rank == 0 else range(2))
    none = _gate(est2, rank=rank)
    return {"one": one[0], "none": none[0], "pools": [est.pool_size("doc"), est2.pool_size("doc")],
            "seconds": max(one[1], none[1])}


def _learn_raises(rank: int, reducer) -> dict:
    """The server's learner, learning in step on both ranks; rank 0's third observation raises there."""
    import threading

    from sglang_kvshare.counters import Counters
    from sglang_kvshare.learning.learner import Learner

    est = _estimator(rank, reducer, ())
    learner = Learner(lambda: est, threading.RLock(), Counters(), max_jobs=8, max_bytes=2**30, asynchronous=False)
    _, obs, _ = _observations(rank)
    failures = 0
    for i in range(3):
        source, target = _edge(obs[i])
        if rank == 0 and i == 2:  # a copy that came out wrong on this rank only
            source = dataclasses.replace(source, k=source.k[:, :5])
        try:
            learner.submit(Observation("doc", source, target, obs[i][4]))
        except ValueError:  # the adapter logs it and goes on
            failures += 1
    reason, seconds = _gate(est, rank=rank)
    return {"failures": failures, "reason": reason, "pool": est.pool_size("doc"), "seconds": seconds}


def _gate_raises(rank: int, reducer) -> dict:
    """Equal pools; the gate raises on rank 0 only, before the ranks agree and while the distances are reduced;
    then a gate without a fault."""
    est = _estimator(rank, reducer)
    src = _source(rank)
    reasons = [_gate(est, source=dataclasses.replace(src, v=src.v[:, :5]) if rank == 0 else src)[0]]
    pool = est._pools["doc"]
    if rank == 0:
        def broken(*_args):
            raise RuntimeError("out of memory")
        pool._key_distances = broken
    reasons.append(_gate(est, source=src)[0])
    pool.__dict__.pop("_key_distances", None)
    res = est.estimate("doc", src, "b", 7)
    reasons.append(res.reason)
    return {"reasons": reasons, "entropy": res.entropy, "activations": [a["activations"] for a in pool.describe()],
            "digest": est.gate_digest}


def _assembly_raises(rank: int, reducer, match: bool = False) -> dict:
    """Two agents read one text through a fullshared cache on each rank; assembling agent B's copy raises on rank 0
    only, then a third agent's request runs with no fault. Per request: the prefix served and the shared
    segment's report."""
    from unittest import mock

    from tests.cache.fakes import MiniScheduler, make_cache
    from tests.cache.test_adapter import annotated, warm

    sched = MiniScheduler(make_cache("fullshared", reducer=reducer))
    out = {"A": sched.run(annotated("A"))}
    if match:  # B's own prefix is in the tree: its shared text is assembled in the match, not a later stage
        warm(sched, "B")
        warm(sched, "C")
    b = annotated("B")

    def broken(*_args, **_kw):
        raise RuntimeError("out of memory")

    with mock.patch("sglang_kvshare.cache.assemble.write_and_insert", side_effect=broken) if rank == 0 \
            else contextlib.nullcontext():
        out["B"] = sched.run(b)
    out["B_shared"] = {k: b.report()["segments"][1].get(k) for k in ("resolved_by", "reason")}
    c = annotated("C")
    out["C"] = sched.run(c)
    out["C_shared"] = c.report()["segments"][1].get("resolved_by")
    return out


def _fresh_reducer():
    """A reducer of its own (its own gloo group), warmed up by one decision both ranks take."""
    import torch.distributed as dist

    from sglang_kvshare.correction import GroupReducer

    reducer = GroupReducer(lambda: dist.group.WORLD, 2, timeout_s=DEADLINE_S)
    est = _estimator(0, reducer, ())
    assert _gate(est)[0] == "too_few_anchors"
    return est


def _mismatched_frames(rank: int, _reducer) -> dict:
    """Ranks out of step whose collectives differ in size: rank 0 agrees on one value while rank 1 agrees on five,
    then rank 0 agrees while rank 1 sums a tensor. Each pair on a reducer of its own (the first breaks it)."""
    import torch.distributed as dist

    from sglang_kvshare.correction import GroupReducer
    from sglang_kvshare.correction.rank_reduce import RanksUnreachable

    out = {}
    for name, mine in (("agree", lambda r: r.agree(11, [-1]) if rank == 0 else r.agree(12, [0, 3, 16, 16, 123])),
                       ("sum", lambda r: r.agree(11, [1]) if rank == 0 else r.sum(torch.ones(3, 5)))):
        reducer = GroupReducer(lambda: dist.group.WORLD, 2, timeout_s=DEADLINE_S)
        reducer.agree(1, [0])  # its own group is made on first use, by both ranks
        t0 = time.monotonic()
        try:
            mine(reducer)
            out[name] = ("returned", time.monotonic() - t0)
        except RanksUnreachable:
            out[name] = ("unreachable", time.monotonic() - t0)
    return out


def _skips_gate(rank: int, _reducer) -> dict:
    """Rank 0 never reaches decision A (it raised before its gate) and goes on to decision B."""
    est = _fresh_reducer()
    out = {}
    if rank == 1:
        out["A"] = _gate(est, slot="A")
    out["B"] = _gate(est, slot="B")
    return out


def _deadline(rank: int, _reducer) -> dict:
    """Rank 0 never reaches decision A and waits elsewhere (SGLang's own collective); then both gate B."""
    import torch.distributed as dist

    est = _fresh_reducer()
    out = {}
    if rank == 1:
        out["A"] = _gate(est, slot="A")
    dist.barrier()
    out["B"] = _gate(est, slot="B")
    return out


DEADLINE_S = 3.0
# The reducer the jobs share waits longer than ``DEADLINE_S``: on a loaded machine a rank may reach a collective
# seconds after its peer, which is not what those jobs test. The jobs that test the deadline use reducers of their
# own with ``DEADLINE_S``, and the shared jobs still assert that they returned within ``DEADLINE_S``.
SHARED_TIMEOUT_S = 60.0
JOBS = (("decide", None), ("decide", 4), ("drifted", None), ("pools_differ", None), ("learn_raises", None),
        ("gate_raises", None), ("assembly_raises", None), ("assembly_raises", "match"), ("mismatched_frames", None), ("skips_gate", None),
        ("deadline", None))
"""What each rank runs, in this order, in one process group; the last two break their reducers for good."""
_RUN = {"drifted": _drifted, "pools_differ": _pools_differ, "learn_raises": _learn_raises, "gate_raises": _gate_raises,
        "assembly_raises": _assembly_raises, "mismatched_frames": _mismatched_frames, "skips_gate": _skips_gate,
        "deadline": _deadline}


def _rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from sglang_kvshare.correction import GroupReducer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        reducer = GroupReducer(lambda: dist.group.WORLD, 2, timeout_s=SHARED_TIMEOUT_S)
        out = {}
        for job, arg in JOBS:
            out[(job, arg)] = (_decide(rank, reducer, arg) if job == "decide"
                               else _RUN[job](rank, reducer, arg) if arg else _RUN[job](rank, reducer))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks() -> dict[tuple, dict[int, dict]]:
    """Every job's result per rank: ``{(job, low_rank): {rank: result}}``.

    Two processes for the whole module, not per test: a spawned rank spends most of its time importing torch.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        by_rank = dict(results.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
    return {job: {rank: by_rank[rank][job] for rank in by_rank} for job in JOBS}


@pytest.mark.parametrize("low_rank", [None, 4])
def test_two_ranks_take_one_decision(two_ranks, low_rank):
    ranks = two_ranks[("decide", low_rank)]
    assert ranks[0]["accepted"] == ranks[1]["accepted"]
    assert ranks[0]["entropy"] == ranks[1]["entropy"] and ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["activations"] == ranks[1]["activations"]
    if low_rank is None:  # full-dimension anchors: exactly what one rank holding both heads decides and serves
        one = _decide(None, LocalReducer(), None)
        assert one["accepted"] and ranks[0]["accepted"]
        assert ranks[0]["entropy"] == pytest.approx(one["entropy"], abs=1e-6)
        assert ranks[0]["weights"] == pytest.approx(one["weights"], abs=1e-6)
        for rank in (0, 1):
            for name in ("k", "v"):
                got = torch.tensor(ranks[rank][name])
                torch.testing.assert_close(got, torch.tensor(one[name])[:, :, rank:rank + 1], atol=1e-4, rtol=1e-4)


def test_without_the_reduce_the_ranks_would_decide_apart():
    """The reason for the reduce: a source whose heads resemble different anchors; each head alone
    activates another anchor."""
    alone = [_decide(rank, LocalReducer(), None, mixed=True) for rank in (0, 1)]
    assert alone[0]["activations"] != alone[1]["activations"], alone


def test_ranks_whose_pools_drifted_apart_all_start_afresh_instead_of_hanging(two_ranks):
    ranks = two_ranks[("drifted", None)]
    assert ranks[0] == ranks[1] == {"reason": "ranks_disagree", "pool": 0}


def test_pools_one_anchor_apart_take_one_decision_at_once(two_ranks):
    """1 against 2 anchors, and no pool against 2: no rank returns before the others, none waits a deadline."""
    ranks = two_ranks[("pools_differ", None)]
    for rank in (0, 1):
        assert (ranks[rank]["one"], ranks[rank]["none"], ranks[rank]["pools"]) == ("ranks_disagree", "ranks_disagree",
                                                                                   [0, 0]), ranks
        assert ranks[rank]["seconds"] < DEADLINE_S


def test_a_rank_that_raises_in_learning_does_not_split_the_ranks(two_ranks):
    ranks = two_ranks[("learn_raises", None)]
    assert [ranks[r]["failures"] for r in (0, 1)] == [1, 0]
    assert ranks[0]["reason"] == ranks[1]["reason"] == "ranks_disagree" and ranks[0]["pool"] == ranks[1]["pool"] == 0
    assert max(ranks[r]["seconds"] for r in (0, 1)) < DEADLINE_S


def test_a_rank_that_raises_in_the_gate_does_not_split_the_ranks(two_ranks):
    """Raised before the ranks agree, or while they reduce: every rank falls back; the next gate is in step."""
    ranks = two_ranks[("gate_raises", None)]
    assert ranks[0]["reasons"] == ranks[1]["reasons"] == ["gate_failed", "gate_failed", "accepted"]
    assert ranks[0]["entropy"] == ranks[1]["entropy"] and ranks[0]["activations"] == ranks[1]["activations"]
    assert ranks[0]["digest"] == ranks[1]["digest"]


@pytest.mark.parametrize("where", [None, "match"])
def test_a_rank_whose_assembly_raises_sends_every_rank_to_the_same_prefix(two_ranks, where):
    """Any mode, in a later stage or in the match itself: the rank that raised and the rank that assembled both
    prefill B's shared text from the same row, so their forwards have one length; the next request reuses again
    on both (the ranks stayed in step)."""
    ranks = two_ranks[("assembly_raises", where)]
    assert ranks[0]["B"] == ranks[1]["B"] and ranks[0]["C"] == ranks[1]["C"]
    assert ranks[0]["B_shared"] == {"resolved_by": "dense", "reason": "internal_error"}
    assert ranks[1]["B_shared"] == {"resolved_by": "dense", "reason": "ranks_disagree"}
    assert ranks[0]["C_shared"] == ranks[1]["C_shared"] == "alignment"


def test_collectives_of_different_sizes_end_out_of_step_on_every_rank_without_aborting(two_ranks):
    """Gloo aborts a process whose buffer's length differs from its peer's: the fixed-size frame sent first makes
    both ranks see the mismatch and raise, at once."""
    ranks = two_ranks[("mismatched_frames", None)]
    for rank in (0, 1):
        for name in ("agree", "sum"):
            outcome, seconds = ranks[rank][name]
            assert outcome == "unreachable" and seconds < DEADLINE_S, (rank, name, ranks)


def test_a_rank_that_skips_a_gate_sends_every_rank_dense_at_once(two_ranks):
    """Rank 0's decision B meets rank 1's decision A: both see it and stop correcting, with no wait."""
    ranks = two_ranks[("skips_gate", None)]
    decided = [ranks[1]["A"], ranks[0]["B"], ranks[1]["B"]]
    assert [reason for reason, _ in decided] == ["ranks_out_of_step"] * 3
    assert max(seconds for _, seconds in decided) < DEADLINE_S


def test_a_rank_left_alone_in_a_gate_goes_dense_at_its_deadline_and_so_do_the_others(two_ranks):
    ranks = two_ranks[("deadline", None)]
    reason, seconds = ranks[1]["A"]
    assert reason == "ranks_out_of_step" and seconds < DEADLINE_S + 10
    for rank in (0, 1):
        assert ranks[rank]["B"][0] == "ranks_out_of_step" and ranks[rank]["B"][1] < DEADLINE_S
