"""Anchor pool: exactness with exact deltas, chaining, gate, eviction, coverage, memory."""

from __future__ import annotations

import pytest
import torch

from sglang_kvshare.correction import (AnchorPool, PoolConfig, RopeSpec, SegmentCache, factor_nbytes,
                                       make_estimator, materialize, rotate_keys)


@pytest.fixture(scope="module")
def llama_world(tiny_llama, kv_of):
    """Three agents (prefixes of 5, 9 and 14 tokens) and two contents of 12 tokens."""
    g = torch.Generator().manual_seed(7)
    prefixes = {a: torch.randint(0, 128, (n,), generator=g) for a, n in (("a", 5), ("b", 9), ("c", 14))}
    contents = [torch.randint(0, 128, (12,), generator=g) for _ in range(2)]
    spec = RopeSpec.from_hf_config(tiny_llama.config)

    def seg(agent, content):
        pre = prefixes[agent]
        k, v = kv_of(tiny_llama, torch.cat([pre, content]))
        return SegmentCache(k[:, len(pre):], v[:, len(pre):], len(pre), agent)

    return spec, seg, contents


def _close(a, b):
    torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def _kv(spec, res, k, v, src_pos, dst_pos):
    """The estimate's K/V through the ops layer (what serving writes)."""
    assert res.accepted
    return materialize(k, v, src_pos, dst_pos, res.plan, spec)


@pytest.mark.parametrize("rank", [None, 12])  # 12 = min(L, D): factors exact
def test_exact_deltas_reproduce_exact_target(llama_world, rank):
    spec, seg, (content, _) = llama_world
    src, dst = seg("a", content), seg("c", content)
    assert (src.v - dst.v).abs().max() > 1e-3  # contexts matter: the test can fail
    pool = AnchorPool(spec, PoolConfig(tau=1.0, rank=rank))
    for key in ("x", "y"):  # two copies of the same observation: any weights mix equal deltas
        pool.add_observation(src.k, src.v, src.start_pos, dst.k, dst.v, dst.start_pos, ("a", "c"), key)
    res = pool.estimate(src.k, src.v, src.start_pos, dst.start_pos, ("a", "c"))
    assert res.accepted and res.covered == 12 and res.pool_anchors == 2
    k, v = _kv(spec, res, src.k, src.v, src.start_pos, dst.start_pos)
    _close(k, dst.k)
    _close(v, dst.v)
    # The estimate does not depend on absolute positions: move both ends by +100.
    moved_k = rotate_keys(src.k, 100, spec)
    moved = pool.estimate(moved_k, src.v, src.start_pos + 100, dst.start_pos + 100, ("a", "c"))
    _close(_kv(spec, moved, moved_k, src.v, src.start_pos + 100, dst.start_pos + 100)[0], rotate_keys(dst.k, 100, spec))


def test_chaining_over_three_agents_is_exact(llama_world):
    spec, seg, (content, _) = llama_world
    ca, cb, cc = seg("a", content), seg("b", content), seg("c", content)
    est = make_estimator("kvcmas", spec, tau=1.0, rank=None)
    for key in ("x", "y"):
        est.observe("q", ca, cb, content_key=key)
        est.observe("q", cb, cc, content_key=key)
    hop1 = est.estimate("q", ca, "b", cb.start_pos)
    hat_b = SegmentCache(*_kv(spec, hop1, ca.k, ca.v, ca.start_pos, cb.start_pos), cb.start_pos, "b", exact=False)
    hop2 = est.estimate("q", hat_b, "c", cc.start_pos)
    k, v = _kv(spec, hop2, hat_b.k, hat_b.v, cb.start_pos, cc.start_pos)
    _close(k, cc.k)
    _close(v, cc.v)
    with pytest.raises(ValueError, match="dense"):
        est.observe("q", ca, hat_b)


def test_identical_anchors_have_max_entropy_and_reject(llama_world):
    spec, seg, (content, _) = llama_world
    src, dst = seg("a", content), seg("b", content)
    pool = AnchorPool(spec, PoolConfig(tau=0.99, rank=None))
    assert pool.estimate(src.k, src.v, 5, 9, ("a", "b")).reason == "too_few_anchors"
    for key in range(3):
        pool.add_observation(src.k, src.v, 5, dst.k, dst.v, 9, ("a", "b"), key)
    res = pool.estimate(src.k, src.v, 5, 9, ("a", "b"))
    assert res.entropy == pytest.approx(1.0)
    assert not res.accepted and res.reason == "gate_rejected" and res.plan is None
    assert pool.estimate(src.k, src.v, 5, 9, ("a", "c")).reason == "no_edge"
    assert all(a["activations"] == 0 for a in pool.describe())


def _rand_seg(g, length=10, nl=2, scale=10.0):
    return torch.randn(nl, length, 2, 8, generator=g) * scale, torch.randn(nl, length, 2, 8, generator=g) * scale


def test_near_identical_anchor_is_accepted_and_returns_its_delta(gen):
    spec = RopeSpec.default(head_dim=8)
    pool = AnchorPool(spec, PoolConfig(tau=0.3, rank=None))
    deltas = []
    for key in range(4):
        k, v = _rand_seg(gen)
        dk, dv = _rand_seg(gen, scale=0.1)
        pool.add_observation(k, v, 3, rotate_keys(k, 4, spec) + rotate_keys(dk, 7, spec), v + dv, 7, "e", key)
        deltas.append((k, v, dk, dv))
    k, v, dk, dv = deltas[2]
    noisy_k, noisy_v = k + 1e-3 * torch.randn(k.shape, generator=gen), v + 1e-3 * torch.randn(v.shape, generator=gen)
    res = pool.estimate(noisy_k, noisy_v, 3, 7, "e")
    assert res.accepted and res.entropy < 0.01
    assert res.gate_weights.argmax().item() == 2
    k_hat, v_hat = _kv(spec, res, noisy_k, noisy_v, 3, 7)
    torch.testing.assert_close(k_hat, rotate_keys(noisy_k, 4, spec) + rotate_keys(dk, 7, spec), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_hat, noisy_v + dv, atol=1e-4, rtol=1e-4)
    assert [a["activations"] for a in pool.describe()] == [0, 0, 1, 0]


def test_eviction_drops_least_activated_among_window_oldest(gen):
    spec = RopeSpec.default(head_dim=8)
    pool = AnchorPool(spec, PoolConfig(capacity=3, window=2, tau=0.5, rank=None))
    segs = {}

    def add(name):
        segs[name] = _rand_seg(gen)
        k, v = segs[name]
        pool.add_observation(k, v, 0, k, v, 0, "e", name)

    def activate(name):
        k, v = segs[name]
        assert pool.estimate(k, v, 0, 0, "e").accepted

    def keys():
        return [a["content_key"] for a in pool.describe()]

    for n in ("A0", "A1", "A2"):
        add(n)
    activate("A0")
    add("A3")  # window [A0, A1]: A1 has no activation
    assert keys() == ["A0", "A2", "A3"]
    add("A4")  # window [A0, A2]: A2
    assert keys() == ["A0", "A3", "A4"]
    activate("A3")
    activate("A3")
    add("A5")  # window [A0 (1), A3 (2)]: A0
    assert keys() == ["A3", "A4", "A5"]
    add("A6")  # window [A3 (2), A4 (0)]: A4
    assert keys() == ["A3", "A5", "A6"]
    pool.set_capacity(1)  # shrinking evicts by the same rule: A5 then A6 (ties -> oldest)
    assert keys() == ["A3"]


def test_longer_segment_is_corrected_only_on_covered_prefix(gen):
    spec = RopeSpec.default(head_dim=8)
    pool = AnchorPool(spec, PoolConfig(tau=1.0, rank=None, gate_len=8))
    for key, length in (("s", 8), ("l", 10)):
        k, v = _rand_seg(gen, length)
        pool.add_observation(k, v, 0, k + 1.0, v + 1.0, 0, "e", key)
    short = _rand_seg(gen, 7)
    pool_short_gate = AnchorPool(spec, PoolConfig(tau=1.0, rank=None))  # gate_len None: k = S
    assert pool_short_gate.estimate(*short, 0, 0, "e").reason == "too_few_anchors"
    k, v = _rand_seg(gen, 16)
    res = pool.estimate(k, v, 2, 5, "e")
    assert res.accepted and res.covered == 10
    k_hat, v_hat = _kv(spec, res, k, v, 2, 5)
    aligned = rotate_keys(k, 3, spec)
    torch.testing.assert_close(k_hat[:, 10:], aligned[:, 10:])  # untouched, never extrapolated
    torch.testing.assert_close(v_hat[:, 10:], v[:, 10:])
    torch.testing.assert_close(v_hat[:, :10], v[:, :10] + 1.0)  # every delta is +1
    w = res.plan.weights_v  # [covered, Vn]
    assert w.shape == (10, 2) and torch.all(w[8:, 0] == 0) and torch.all(w[8:, 1] == 1)


def test_min_anchor_len_lets_shorter_anchors_correct_their_common_prefix(gen):
    """Default: anchors shorter than the comparison length are ineligible; with ``min_anchor_len`` they
    compare on the common prefix, correct the rows they cover and leave the rest aligned."""
    spec = RopeSpec.default(head_dim=8)
    obs = [(key, *_rand_seg(gen, length)) for key, length in (("a", 6), ("b", 9))]
    k, v = _rand_seg(gen, 16)
    strict = AnchorPool(spec, PoolConfig(tau=1.0, rank=None))
    loose = AnchorPool(spec, PoolConfig(tau=1.0, rank=None, min_anchor_len=4))
    for pool in (strict, loose):
        for key, ak, av in obs:
            pool.add_observation(ak, av, 0, ak + 1.0, av + 1.0, 0, "e", key)
    assert strict.estimate(k, v, 2, 5, "e").reason == "too_few_anchors"
    res = loose.estimate(k, v, 2, 5, "e")
    assert res.accepted and res.compare_len == 6 and res.covered == 9
    k_hat, v_hat = _kv(spec, res, k, v, 2, 5)
    torch.testing.assert_close(v_hat[:, :9], v[:, :9] + 1.0)  # every delta is +1
    torch.testing.assert_close(v_hat[:, 9:], v[:, 9:])  # past every anchor: aligned only
    torch.testing.assert_close(k_hat[:, 9:], rotate_keys(k, 3, spec)[:, 9:])
    too_short = AnchorPool(spec, PoolConfig(tau=1.0, rank=None, min_anchor_len=7))
    for key, ak, av in obs:
        too_short.add_observation(ak, av, 0, ak, av, 0, "e", key)
    assert too_short.estimate(k, v, 2, 5, "e").reason == "too_few_anchors"  # the 6-token anchor is below 7
    with pytest.raises(ValueError, match="min_anchor_len"):
        PoolConfig(min_anchor_len=0)


def test_memory_report_and_runtime_config(gen):
    spec = RopeSpec.default(head_dim=8)
    pool = AnchorPool(spec, PoolConfig(rank=4, tau=0.3))
    k, v = _rand_seg(gen, 20)
    pool.add_observation(k, v, 0, k, v, 0, ("a", "b"), "x")
    pool.add_observation(k, v, 0, k, v, 0, ("b", "c"), "x")  # same content: one base, two deltas
    one = factor_nbytes(2, 20, 16, 4, 4)
    gram = 20 * 8  # the gate's cached Gram summary: one float64 per row
    assert pool.memory_bytes() == 6 * one + gram and pool.full_dim_bytes() == 6 * 2 * 20 * 16 * 4
    assert pool.memory_bytes() == sum(a["bytes"] for a in pool.describe())
    assert pool.describe()[0]["edges"] == ["('a', 'b')", "('b', 'c')"]
    pool.set_rank(None)
    pool.add_observation(k, v, 0, k, v, 0, ("a", "b"), "y")
    assert [a["rank"] for a in pool.describe()] == [4, None]
    pool.set_tau(0.0)
    assert pool.config.tau == 0.0
    pool.reset()
    assert len(pool) == 0 and pool.memory_bytes() == 0


@pytest.mark.parametrize("method", ["gram", "svd"])
def test_learning_steps_of_a_few_layers_give_the_same_factors_in_more_steps(gen, method):
    """``step_layers``: each factorization in layer groups, one step each; the factors are the stack's own."""
    from sglang_kvshare.correction import observation_steps

    spec = RopeSpec.default(8)
    layers, length = 5, 24
    src_k, src_v, dst_k, dst_v = (torch.randn(layers, length, 2, 8, generator=gen) for _ in range(4))

    def run(step_layers):
        cfg = PoolConfig(rank=4, svd_method=method, step_layers=step_layers)
        steps = observation_steps(spec, cfg, src_k, src_v, 3, dst_k, dst_v, 11, edge="e", content_key="c")
        pauses = 0
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value, pauses
            pauses += 1

    whole, whole_pauses = run(None)
    grouped, grouped_pauses = run(2)  # groups of 2, 2 and 1 layers
    assert whole_pauses == 3 and grouped_pauses == 3 + 4 * 2  # two more pauses in each of 4 factorizations
    for name in ("base_k", "base_v", "delta_k", "delta_v"):
        a, b = getattr(whole, name), getattr(grouped, name)
        assert b.a.shape == a.a.shape and b.b.shape == a.b.shape
        torch.testing.assert_close(b.a @ b.b, a.a @ a.b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grouped.base_v_gram, whole.base_v_gram)
    with pytest.raises(ValueError, match="step_layers"):
        PoolConfig(step_layers=0)


def test_the_gate_waits_for_min_edge_anchors_contents_holding_the_edge(gen):
    spec = RopeSpec.default(head_dim=8)
    pool = AnchorPool(spec, PoolConfig(tau=1.0, rank=None, min_edge_anchors=3))
    segs = [_rand_seg(gen) for _ in range(3)]
    for key, (k, v) in enumerate(segs[:2]):
        pool.add_observation(k, v, 3, k, v, 3, "e", key)
    pool.add_observation(*segs[2], 3, *segs[2], 3, "other edge", 2)
    res = pool.estimate(*segs[0], 3, 3, "e")
    assert not res.accepted and res.reason == "no_edge" and res.edge_anchors == 2  # three anchors, two hold "e"
    pool.add_observation(*segs[2], 3, *segs[2], 3, "e", 2)
    assert pool.estimate(*segs[0], 3, 3, "e").accepted
    with pytest.raises(ValueError, match="min_edge_anchors"):
        PoolConfig(min_edge_anchors=1)
