"""The modes behind one interface, CacheBlend's selection, and the real model."""

from __future__ import annotations

import pytest
import torch

from sglang_kvshare.correction import (ESTIMATORS, RopeSpec, SegmentCache, make_estimator, merge_rows,
                                       rotate_keys, select_tokens, token_deviation)


def test_registry_and_source_policies():
    spec = RopeSpec.default(head_dim=8)
    policies = {name: make_estimator(name, spec).source_policy for name in ESTIMATORS}
    assert policies == {"fullshared": "first", "kvcomm": "reference", "kvcmas": "previous",
                        "kvcmas_fullrank": "previous", "kvcmas_nonchained": "first", "cacheblend": "first"}
    assert make_estimator("kvcomm", spec).config.capacity == 20
    assert make_estimator("kvcmas", spec).config.rank == 32
    assert make_estimator("kvcmas_fullrank", spec).config.rank is None
    with pytest.raises(ValueError, match="unknown estimator"):
        make_estimator("nope", spec)


def test_kvcomm_keys_deltas_by_target_only(gen):
    spec = RopeSpec.default(head_dim=8)
    est = make_estimator("kvcomm", spec, tau=1.0)
    for key in range(2):
        k, v = torch.randn(2, 6, 1, 8, generator=gen), torch.randn(2, 6, 1, 8, generator=gen)
        est.observe("q", SegmentCache(k, v, 0, "ref"), SegmentCache(k, v + 1, 4, "b"), content_key=key)
    assert est.estimate("q", SegmentCache(k, v, 0, "whoever"), "b", 4).accepted
    assert est.estimate("q", SegmentCache(k, v, 0, "ref"), "c", 4).reason == "no_edge"
    est.configure(tau=0.0, capacity=1)
    assert len(est.pool("q")) == 1 and est.pool("q").config.tau == 0.0


def test_fullshared_is_alignment_only(gen):
    spec = RopeSpec.default(head_dim=8)
    k, v = torch.randn(3, 5, 2, 8, generator=gen), torch.randn(3, 5, 2, 8, generator=gen)
    res = make_estimator("fullshared", spec).estimate("q", SegmentCache(k, v, 10, "a"), "b", 3)
    torch.testing.assert_close(res.k, rotate_keys(k, -7, spec))
    torch.testing.assert_close(res.v, v)


def test_cacheblend_selects_most_deviating_tokens(gen):
    reused = torch.randn(20, 2, 8, generator=gen)
    fresh = reused.clone()
    fresh[[3, 11, 17]] += torch.tensor([5.0, 9.0, 7.0])[:, None, None]
    dev = token_deviation(fresh, reused)
    idx = select_tokens(dev, 0.15)
    assert idx.tolist() == [3, 11, 17]
    torch.testing.assert_close(merge_rows(reused, fresh[idx], idx), fresh)
    assert select_tokens(dev, 0.01).tolist() == [11]


@pytest.mark.model
def test_real_model_alignment_and_exact_reconstruction(real_model, kv_of):
    """SmolLM2: layer-0 alignment is exact, and exact deltas rebuild all 30 layers."""
    cache_of = kv_of
    spec = RopeSpec.from_hf_config(real_model.config)
    g = torch.Generator().manual_seed(3)
    content = torch.randint(100, 40000, (40,), generator=g)
    pre_a, pre_b = torch.randint(100, 40000, (13,), generator=g), torch.randint(100, 40000, (31,), generator=g)
    ka, va = cache_of(real_model, torch.cat([pre_a, content]))
    kb, vb = cache_of(real_model, torch.cat([pre_b, content]))
    ka, va, kb, vb = ka[:, 13:], va[:, 13:], kb[:, 31:], vb[:, 31:]
    torch.testing.assert_close(rotate_keys(ka[0], 18, spec), kb[0], atol=1e-4, rtol=1e-4)
    assert (rotate_keys(ka[5], 18, spec) - kb[5]).abs().max() > 1e-2  # deeper layers see the context
    est = make_estimator("kvcmas", spec, tau=1.0, rank=None)
    for key in range(2):
        est.observe("q", SegmentCache(ka, va, 13, "a"), SegmentCache(kb, vb, 31, "b"), content_key=key)
    res = est.estimate("q", SegmentCache(ka, va, 13, "a"), "b", 31)
    torch.testing.assert_close(res.k, kb, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(res.v, vb, atol=1e-4, rtol=1e-4)


def test_cacheblend_partial_forward_is_exact_at_full_ratio(tiny_llama):
    """The harness's partial-recompute forward: ratio 1 rebuilds the dense cache
    from a wrong reused cache; ratio < 1 recomputes layers <= check for all tokens."""
    common = pytest.importorskip("benchmarks.common")
    g = torch.Generator().manual_seed(5)
    pre, seg = torch.randint(0, 128, (9,), generator=g).tolist(), torch.randint(0, 128, (20,), generator=g).tolist()
    prefix, _ = common.prefill(tiny_llama, pre)
    dense, _ = common.prefill(tiny_llama, seg, prefix)
    wrong = common.KV(dense.k + torch.randn(dense.k.shape, generator=g), dense.v + 1.0)
    full, idx = common.partial_recompute(tiny_llama, prefix, seg, wrong, check_layer=1, ratio=1.0)
    torch.testing.assert_close(full.k, dense.k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(full.v, dense.v, atol=1e-4, rtol=1e-4)
    part, idx = common.partial_recompute(tiny_llama, prefix, seg, wrong, check_layer=1, ratio=0.15)
    assert len(idx) == 3
    torch.testing.assert_close(part.k[:2], dense.k[:2], atol=1e-4, rtol=1e-4)  # layers 0..check exact
    rest = torch.ones(20, dtype=torch.bool)
    rest[idx] = False
    torch.testing.assert_close(part.v[2:, rest], wrong.v[2:, rest])  # untouched rows keep the reused cache
