"""The learner's K/V copies: one gather per layer, float16 while queued on a float32 pool.

Why: at 1K tokens one observation holds 94 MiB of float32 copies, and a
bounded queue of such copies drops a chain's third edge. Each test would fail if the
copies were wrong, not narrowed, learned in float16, or silently learned from
an overflow.
"""

from __future__ import annotations

import threading

import torch

from sglang_kvshare.counters import Counters
from sglang_kvshare.cache.kv_pool_io import ReadWorkspace, learning_copy_dtype, read_pair, read_segment
from sglang_kvshare.learning.learner import Learner, Observation
from sglang_kvshare.correction import RopeSpec, SegmentCache, make_estimator
from sglang_kvshare.correction.anchor_pool import PoolConfig, prepare_observation
from tests.cache.fakes import HEAD_DIM, HEADS, LAYERS, FakeKVCache


def _filled_pool(size: int = 32) -> FakeKVCache:
    kv = FakeKVCache(size)
    g = torch.Generator().manual_seed(0)
    for buf in (*kv.k, *kv.v):
        buf.copy_(torch.randn(buf.shape, generator=g))
    return kv


def test_read_segment_gathers_every_layer_in_the_pool_dtype_or_the_one_asked():
    kv = _filled_pool()
    idx = torch.tensor([5, 1, 9, 2])
    k, v = read_segment(kv, idx)
    assert k.shape == (LAYERS, 4, HEADS, HEAD_DIM) and k.dtype == torch.float32
    for layer in range(LAYERS):
        assert torch.equal(k[layer], kv.k[layer][idx]) and torch.equal(v[layer], kv.v[layer][idx])
    k16, v16 = read_segment(kv, idx, torch.float16)
    assert k16.dtype == v16.dtype == torch.float16
    assert torch.equal(k16, k.half()) and torch.equal(v16, v.half())


def test_reads_through_a_workspace_reuse_its_buffers_and_stay_exact():
    kv = _filled_pool()
    ws = ReadWorkspace(max_rows=6)
    first = torch.tensor([5, 1, 9, 2])
    k, v = read_segment(kv, first, workspace=ws)
    ptr = k.untyped_storage().data_ptr()
    assert torch.equal(k, read_segment(kv, first)[0]) and torch.equal(v, read_segment(kv, first)[1])
    second = torch.tensor([7, 3])  # shorter: a view of the same buffers, overwritten
    k2, v2 = read_segment(kv, second, workspace=ws)
    assert k2.untyped_storage().data_ptr() == ptr and k2.shape == (LAYERS, 2, HEADS, HEAD_DIM)
    for layer in range(LAYERS):
        assert torch.equal(k2[layer], kv.k[layer][second]) and torch.equal(v2[layer], kv.v[layer][second])
    long = torch.arange(10)  # past max_rows: fresh tensors, the workspace untouched
    k3, _ = read_segment(kv, long, workspace=ws)
    assert k3.untyped_storage().data_ptr() != ptr and torch.equal(k3[0], kv.k[0][long])
    assert torch.equal(read_segment(kv, second, workspace=ws)[0], k2)


def test_learning_copies_are_half_the_bytes_of_a_float32_pool_and_as_is_otherwise():
    kv = _filled_pool()
    assert learning_copy_dtype(kv) == torch.float16
    kv.k = [b.bfloat16() for b in kv.k]
    assert learning_copy_dtype(kv) == torch.bfloat16
    kv = _filled_pool()
    full = read_pair(kv, torch.arange(0, 8), torch.arange(8, 16))
    narrow = read_pair(kv, torch.arange(0, 8), torch.arange(8, 16), learning_copy_dtype(kv))
    assert sum(t.nbytes for t in narrow) * 2 == sum(t.nbytes for t in full)


def _structured_pair(seed: int, length: int = 48, dim_heads: int = 2, head_dim: int = 16, scale: float = 0.04):
    """A source and a target whose difference is low-rank and small (4 % of the values), like real deltas."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, length, dim_heads, head_dim)
    src_k, src_v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    low = lambda: (torch.randn(2, length, 3, generator=g) @ torch.randn(2, 3, dim_heads * head_dim, generator=g)  # noqa: E731
                   ).reshape(shape) * scale
    return src_k, src_v, src_k + low(), src_v + low()


def test_float16_copies_change_the_learned_deltas_by_well_under_a_percent():
    spec, config = RopeSpec.default(16), PoolConfig(rank=8)
    src_k, src_v, tgt_k, tgt_v = _structured_pair(1)
    exact = prepare_observation(spec, config, src_k, src_v, 30, tgt_k, tgt_v, 30, ("A", "B"))
    r = lambda t: t.half().float()  # noqa: E731 - what a queued copy goes through
    narrow = prepare_observation(spec, config, r(src_k), r(src_v), 30, r(tgt_k), r(tgt_v), 30, ("A", "B"))
    for name in ("delta_k", "delta_v"):
        want, got = getattr(exact, name).matrix(), getattr(narrow, name).matrix()
        rel = float((got - want).norm() / want.norm())
        assert 0 < rel < 0.01, (name, rel)  # measured 0.3 %


def _learner(estimator) -> tuple[Learner, Counters]:
    counters = Counters()
    return Learner(lambda: estimator, threading.RLock(), counters, max_jobs=4, max_bytes=2**30,
                   asynchronous=False), counters


def _half_cache(seed: int, start: int, agent: str) -> SegmentCache:
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, 6, 2, 8, generator=g).half() for _ in range(2))
    return SegmentCache(k, v, start, agent)


def test_the_worker_learns_in_the_pool_dtype_from_float16_copies():
    estimator = make_estimator("kvcmas", RopeSpec.default(8), tau=1.0)
    learner, counters = _learner(estimator)
    obs = Observation("query", _half_cache(1, 10, "A"), _half_cache(2, 20, "B"), "c1", compute_dtype=torch.float32)
    assert obs.nbytes == 4 * 2 * 6 * 2 * 8 * 2
    learner.submit(obs)
    assert estimator.pool_size("query") == 1 and counters.get("observations") == 1
    anchor = estimator.describe()["query"][0]
    assert anchor["bytes"] > 0
    assert all(t.dtype == torch.float32 for a in estimator._pools["query"].anchors
               for t in (a.base_k.matrix(), a.base_v.matrix()))


def test_an_overflowed_float16_copy_is_dropped_and_counted_not_learned():
    estimator = make_estimator("kvcmas", RopeSpec.default(8), tau=1.0)
    learner, counters = _learner(estimator)
    target = _half_cache(2, 20, "B")
    target.k[0, 0, 0, 0] = float("inf")  # a value past float16's range
    learner.submit(Observation("query", _half_cache(1, 10, "A"), target, "c1", compute_dtype=torch.float32))
    assert estimator.pool_size("query") == 0
    assert counters.get("observations_dropped_overflow") == 1 and counters.get("observations") == 0
