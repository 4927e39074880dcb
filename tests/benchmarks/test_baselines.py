"""The offline baselines: registry, KVCOMM's target-keyed deltas, CacheBlend's selection, anchor memory."""

from __future__ import annotations

import pytest
import torch

from benchmarks.baselines import ESTIMATORS, make_estimator, select_tokens, token_deviation
from sglang_kvshare.correction import RopeSpec, SegmentCache


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def test_registry_holds_the_served_modes_and_the_baselines():
    spec = RopeSpec.default(head_dim=8)
    policies = {name: make_estimator(name, spec).source_policy for name in ESTIMATORS}
    assert policies == {"fullshared": "first", "kvcomm": "reference", "kvcmas": "previous",
                        "kvcmas_fullrank": "previous", "kvcmas_nonchained": "first", "cacheblend": "first"}
    assert make_estimator("kvcomm", spec).config.capacity == 20
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
    assert est.pool_size("q") == 1 and est.config.tau == 0.0


def test_cacheblend_selects_most_deviating_tokens(gen):
    reused = torch.randn(20, 2, 8, generator=gen)
    fresh = reused.clone()
    fresh[[3, 11, 17]] += torch.tensor([5.0, 9.0, 7.0])[:, None, None]
    dev = token_deviation(fresh, reused)
    idx = select_tokens(dev, 0.15)
    assert idx.tolist() == [3, 11, 17]
    assert select_tokens(dev, 0.01).tolist() == [11]


def test_kvcmas_anchor_memory_4x_below_kvcomm_for_2k_segments(gen):
    """Equal V, 2048-token segment, D = 3 x 64 (SmolLM2), 4 consuming agents."""
    spec = RopeSpec.default(head_dim=64)
    nl, length = 1, 2048  # bytes scale linearly in layers and anchors; one of each keeps the test fast
    k, v = torch.randn(nl, length, 3, 64, generator=gen), torch.randn(nl, length, 3, 64, generator=gen)
    comm = make_estimator("kvcomm", spec, capacity=1)
    mas = make_estimator("kvcmas", spec, capacity=1, svd_method="randomized")
    agents = ["a0", "a1", "a2", "a3", "a4"]
    for content in range(1):
        ref = SegmentCache(k, v, 0, "ref")
        for prev, agent in zip(agents, agents[1:]):
            tgt = SegmentCache(k, v, 0, agent)
            comm.observe("q", ref, tgt, content_key=content)
            mas.observe("q", SegmentCache(k, v, 0, prev), tgt, content_key=content)
    ratio = comm.memory_bytes() / mas.memory_bytes()
    assert comm.memory_bytes() == (2 + 2 * 4) * nl * length * 192 * 4 + length * 8  # + the gate's Gram summary
    assert mas.memory_bytes() == (2 + 2 * 4) * nl * 32 * (length + 192) * 4 + length * 8
    assert ratio >= 4.0, ratio
