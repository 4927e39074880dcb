"""End to end: the cache's pool writes (kernels dispatcher) equal the correction library's estimate.

The cache writes a resolved segment with ``kv_writer.write_resolved`` (fused
gather + align + low-rank correction + scatter); the correction library builds
the same estimate with plain torch ops. Both paths must give the same pool rows,
through the torch reference and through the Triton kernel (interpreter on CPU).
"""

from __future__ import annotations

import math

import pytest
import torch

from sglang_kvshare.cache.kv_writer import Correction, write_resolved
from sglang_kvshare.correction import AnchorPool, PoolConfig, RopeSpec, rotate_keys

LAYERS, HEADS, HEAD_DIM, POOL = 2, 3, 64, 256


class FakeKVCache:
    """The two methods of SGLang's MHATokenToKVPool that the cache uses."""

    def __init__(self, gen: torch.Generator) -> None:
        self.start_layer, self.layer_num = 0, LAYERS
        self.k = [torch.randn(POOL, HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
        self.v = [torch.randn(POOL, HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]


def spec() -> RopeSpec:
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    return RopeSpec(inv_freq=inv, rotary_dim=HEAD_DIM, head_dim=HEAD_DIM)


def pool_with_anchors(sp: RopeSpec, gen: torch.Generator, length: int, rank) -> AnchorPool:
    pool = AnchorPool(sp, PoolConfig(tau=1.0, rank=rank, capacity=10, gate_len=16))
    for i, anchor_len in enumerate((length - 2, length - 6, length - 10)):
        src_k = torch.randn(LAYERS, anchor_len, HEADS, HEAD_DIM, generator=gen)
        src_v = torch.randn(LAYERS, anchor_len, HEADS, HEAD_DIM, generator=gen)
        tgt_k = rotate_keys(src_k, 7, sp) + 0.1 * torch.randn(src_k.shape, generator=gen)
        tgt_v = src_v + 0.1 * torch.randn(src_v.shape, generator=gen)
        pool.add_observation(src_k, src_v, 20, tgt_k, tgt_v, 27, ("a", "b"), content_key=i)
    return pool


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("rank", [8, None])
@pytest.mark.parametrize("lo", [0, 4])
def test_cache_pool_write_equals_the_library_estimate(backend, rank, lo):
    gen = torch.Generator().manual_seed(0)
    sp = spec()
    length, src_start, dst_start = 37, 20, 51
    cache = FakeKVCache(gen)
    src_idx = torch.randperm(POOL // 2, generator=gen)[:length]
    dst_idx = POOL // 2 + torch.randperm(POOL // 2, generator=gen)[: length - lo]
    pool = pool_with_anchors(sp, gen, length, rank)
    src_k = torch.stack([cache.k[layer][src_idx] for layer in range(LAYERS)])
    src_v = torch.stack([cache.v[layer][src_idx] for layer in range(LAYERS)])
    est = pool.estimate(src_k, src_v, src_start, dst_start, ("a", "b"))
    assert est.accepted and 0 < est.covered < length  # the shortest-anchor prefix is covered
    by_id = {a.id: a for a in pool.anchors}
    chosen = [by_id[i] for i in est.anchor_ids]
    corr = Correction([a.deltas[("a", "b")][0] for a in chosen], [a.deltas[("a", "b")][1] for a in chosen],
                      est.token_weights_k, est.token_weights_v, est.covered)
    write_resolved(cache, sp, src_idx=src_idx, dst_idx=dst_idx, src_start=src_start, dst_start=dst_start,
                   lo=lo, hi=length, correction=corr, backend=backend)
    got_k = torch.stack([cache.k[layer][dst_idx] for layer in range(LAYERS)])
    got_v = torch.stack([cache.v[layer][dst_idx] for layer in range(LAYERS)])
    torch.testing.assert_close(got_k, est.k[:, lo:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_v, est.v[:, lo:], atol=1e-4, rtol=1e-4)


def test_alignment_only_write_is_an_exact_rotation():
    gen = torch.Generator().manual_seed(1)
    sp = spec()
    cache = FakeKVCache(gen)
    src_idx, dst_idx = torch.arange(0, 10), torch.arange(100, 110)
    write_resolved(cache, sp, src_idx=src_idx, dst_idx=dst_idx, src_start=5, dst_start=5 + 33, lo=0, hi=10)
    for layer in range(LAYERS):
        expected = rotate_keys(cache.k[layer][src_idx][None], 33, sp)[0]
        torch.testing.assert_close(cache.k[layer][dst_idx], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache.v[layer][dst_idx], cache.v[layer][src_idx])
    assert not math.isnan(float(cache.k[0].sum()))
