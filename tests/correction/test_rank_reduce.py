"""One gate decision for every tensor-parallel rank: two real processes, each holding one of the two KV heads
and reducing over a gloo group, decide what one process holding both heads decides."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
import torch

from sglang_kvshare.correction import AnchorPool, LocalReducer, PoolConfig, RopeSpec, rotate_keys, run_steps
from sglang_kvshare.correction.apply import materialize


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


def _drifted(rank: int, reducer) -> dict:
    """Rank 1 learned one more anchor than rank 0 (a learning step that failed on rank 0)."""
    from sglang_kvshare.correction import SegmentCache, make_estimator

    spec, obs, (sk, sv) = _observations(rank)
    est = make_estimator("kvcmas", spec, tau=0.9, rank=None, reducer=reducer)
    for i, (k, v, tk, tv, key) in enumerate(obs):
        if rank == 1 or i < 3:
            src, dst = SegmentCache(k, v, 3, "a", exact=True), SegmentCache(tk, tv, 7, "b", exact=True)
            est.commit_observation(run_steps(est.observation_steps("doc", src, dst, key)))
    res = est.estimate("doc", SegmentCache(sk, sv, 3, "a", exact=True), "b", 7)
    return {"reason": res.reason, "pool": est.pool_size("doc")}


# What each rank runs, in this order, in one process group: the drifted pools last (the ranks give up on them).
JOBS = (("decide", None), ("decide", 4), ("drifted", None))


def _rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from sglang_kvshare.correction import GroupReducer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        reducer = GroupReducer(lambda: dist.group.WORLD, 2)
        out = {}
        for job, low_rank in JOBS:
            out[(job, low_rank)] = _drifted(rank, reducer) if job == "drifted" else _decide(rank, reducer, low_rank)
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
