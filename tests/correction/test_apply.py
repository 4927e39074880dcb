"""Plans through the one ops layer: pool writes (plan_kernel_args) and materialize equal the direct estimate.

The direct estimate is the formula of ALGORITHM.md 3.3 written out with plain
torch ops (what ``AnchorPool.estimate`` built before plans existed):
``K = rot(K_src, dst - src) + rot(sum_v w_v Delta_v, dst)``,
``V = V_src + sum_v w_v Delta_v`` on the covered rows. Serving writes rows of
a segment into SGLang-shaped pools with ``plan_kernel_args``; the harness
calls ``materialize``; both must give it, through the torch path and the
Triton kernel (interpreter on CPU).
"""

from __future__ import annotations

import pytest
import torch

from sglang_kvshare.correction import (AnchorPool, CorrectionPlan, PoolConfig, RopeSpec, factorize, from_canonical,
                                       materialize, plan_kernel_args, rotate_keys)
from sglang_kvshare.kernels import align_correct_scatter_layers, triton_available

LAYERS, HEADS, HEAD_DIM, POOL = 2, 3, 64, 256
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not triton_available(),
                                                                      reason="triton is not installed"))]


def spec() -> RopeSpec:
    return RopeSpec.default(head_dim=HEAD_DIM)


def pool_with_anchors(sp: RopeSpec, gen: torch.Generator, length: int, rank, lengths=(2, 6, 10)) -> AnchorPool:
    """Anchors of lengths ``length - lengths[i]``: the shortest limits nothing, the longest sets ``covered``."""
    pool = AnchorPool(sp, PoolConfig(tau=1.0, rank=rank, capacity=10, gate_len=16))
    for i, cut in enumerate(lengths):
        n = length - cut
        src_k = torch.randn(LAYERS, n, HEADS, HEAD_DIM, generator=gen)
        src_v = torch.randn(LAYERS, n, HEADS, HEAD_DIM, generator=gen)
        tgt_k = rotate_keys(src_k, 7, sp) + 0.1 * torch.randn(src_k.shape, generator=gen)
        tgt_v = src_v + 0.1 * torch.randn(src_v.shape, generator=gen)
        pool.add_observation(src_k, src_v, 20, tgt_k, tgt_v, 27, ("a", "b"), content_key=i)
    return pool


def direct_estimate(sp: RopeSpec, plan: CorrectionPlan, k, v, src_pos: int, dst_pos: int):
    """ALGORITHM.md 3.3 with plain torch ops, every anchor's delta reconstructed densely (float64)."""
    nl, length = k.shape[:2]
    c = plan.covered
    k_hat = rotate_keys(k.double(), dst_pos - src_pos, sp)
    v_hat = v.double().clone()
    for deltas, w, out, is_key in ((plan.deltas_k, plan.weights_k, k_hat, True),
                                   (plan.deltas_v, plan.weights_v, v_hat, False)):
        mix = torch.zeros(nl, c, HEADS * HEAD_DIM, dtype=torch.float64)
        for i, f in enumerate(deltas):
            n = min(f.length, c)
            mix[:, :n] += f.matrix(n, torch.float64) * w[:n, i].double()[None, :, None]
        mix = mix.view(nl, c, HEADS, HEAD_DIM)
        out[:, :c] += from_canonical(mix, dst_pos, sp) if is_key else mix
    return k_hat, v_hat


class FakeKVCache:
    """Per-layer K and V pools shaped like SGLang's MHATokenToKVPool buffers."""

    def __init__(self, gen: torch.Generator) -> None:
        self.k = [torch.randn(POOL, HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
        self.v = [torch.randn(POOL, HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]

    def rows(self, idx):
        return torch.stack([b[idx] for b in self.k]), torch.stack([b[idx] for b in self.v])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [8, None])
def test_materialize_equals_direct_estimate(backend, rank):
    gen = torch.Generator().manual_seed(0)
    sp = spec()
    length, src_pos, dst_pos = 37, 20, 4051
    pool = pool_with_anchors(sp, gen, length, rank)
    k = torch.randn(LAYERS, length, HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(LAYERS, length, HEADS, HEAD_DIM, generator=gen)
    res = pool.estimate(k, v, src_pos, dst_pos, ("a", "b"))
    assert res.accepted and res.covered == length - 2 and res.plan.num_anchors == 3
    assert res.plan.weights_k.shape == (length - 2, 3) and res.plan.weights_k.dtype == torch.float32
    want_k, want_v = direct_estimate(sp, res.plan, k, v, src_pos, dst_pos)
    got_k, got_v = materialize(k, v, src_pos, dst_pos, res.plan, sp, backend=backend)
    assert got_k.dtype == k.dtype and got_k.shape == k.shape
    torch.testing.assert_close(got_k.double(), want_k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_v.double(), want_v, atol=1e-4, rtol=1e-4)
    assert (got_v - v).abs()[:, : res.covered].max() > 1e-2  # the correction did something: the test can fail
    torch.testing.assert_close(got_v[:, res.covered:], v[:, res.covered:])  # past covered: aligned only


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [8, None])
@pytest.mark.parametrize("lo", [0, 4, 36])
def test_pool_writes_of_row_ranges_equal_materialize(backend, rank, lo):
    """What the serving writer does: rows [lo, L) of a segment, source and fresh slots in paged-like pools."""
    gen = torch.Generator().manual_seed(1)
    sp = spec()
    length, src_start, dst_start = 37, 20, 51
    cache = FakeKVCache(gen)
    src_idx = torch.randperm(POOL // 2, generator=gen)[:length]
    dst_idx = POOL // 2 + torch.randperm(POOL // 2, generator=gen)[: length - lo]
    src_k, src_v = cache.rows(src_idx)
    pool = pool_with_anchors(sp, gen, length, rank)
    res = pool.estimate(src_k, src_v, src_start, dst_start, ("a", "b"))
    assert res.accepted and 0 < res.covered < length
    args = plan_kernel_args(res.plan, lo, length, cache.k[0].dtype)
    if lo >= res.covered:
        assert args == {}
    align_correct_scatter_layers(cache.k, cache.v, src_idx[lo:], dst_idx, src_start=src_start, dst_start=dst_start,
                                 inv_freq=sp.inv_freq, rotary_dim=sp.rotary_dim, layout=sp.layout, backend=backend,
                                 **args)
    want_k, want_v = materialize(src_k, src_v, src_start, dst_start, res.plan, sp, backend="torch")
    got_k, got_v = cache.rows(dst_idx)
    torch.testing.assert_close(got_k, want_k[:, lo:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_v, want_v[:, lo:], atol=1e-4, rtol=1e-4)


def test_kernel_args_layout_and_mixed_ranks():
    gen = torch.Generator().manual_seed(2)
    sp = spec()
    d = HEADS * HEAD_DIM
    full = factorize(torch.randn(LAYERS, 12, HEADS, HEAD_DIM, generator=gen), None)
    low8 = factorize(torch.randn(LAYERS, 20, HEADS, HEAD_DIM, generator=gen), 8)
    low4 = factorize(torch.randn(LAYERS, 9, HEADS, HEAD_DIM, generator=gen), 4)
    w = torch.softmax(torch.randn(20, 2, generator=gen), dim=1)
    plan = CorrectionPlan([low8, low4], [low8, low4], w, w, 20)
    args = plan_kernel_args(plan, 5, 15)
    assert args["covered"] == 10 and args["k_w"].shape == (10, 2)
    assert args["k_A"].shape == (LAYERS, 2, 10, 8) and args["k_B"].shape == (LAYERS, 2, 8, d)
    assert torch.all(args["k_A"][:, 1, 4:] == 0) and torch.all(args["k_B"][:, 1, 4:] == 0)  # padded past len/rank
    torch.testing.assert_close(args["k_A"][:, 0] @ args["k_B"][:, 0], low8.matrix(15, start=5))
    mixed = plan_kernel_args(CorrectionPlan([low8, full], [low8, full], w, w, 20), 5, 15)
    assert set(mixed) == {"covered", "k_w", "v_w", "k_delta", "v_delta"}
    assert mixed["k_delta"].shape == (LAYERS, 2, 10, d)
    torch.testing.assert_close(mixed["k_delta"][:, 1, :7], full.matrix(12, start=5))
    assert torch.all(mixed["k_delta"][:, 1, 7:] == 0)
    # The mixed plan, materialized, equals the direct formula too.
    k, v = torch.randn(LAYERS, 24, HEADS, HEAD_DIM, generator=gen), torch.randn(LAYERS, 24, HEADS, HEAD_DIM, generator=gen)
    mplan = CorrectionPlan([low8, full], [low8, full], w, w, 20)
    got = materialize(k, v, 3, 300, mplan, sp)
    want = direct_estimate(sp, mplan, k, v, 3, 300)
    for g, e in zip(got, want):
        torch.testing.assert_close(g.double(), e, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="covered"):
        CorrectionPlan([low8], [low8], w, w, 20)
