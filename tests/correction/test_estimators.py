"""The served modes behind one interface, and the real model."""

from __future__ import annotations

import pytest
import torch

from sglang_kvshare.correction import ESTIMATORS, RopeSpec, SegmentCache, make_estimator, materialize, rotate_keys


def test_registry_and_source_policies():
    spec = RopeSpec.default(head_dim=8)
    policies = {name: make_estimator(name, spec).source_policy for name in ESTIMATORS}
    assert policies == {"fullshared": "first", "kvcmas": "previous"}  # the served modes only
    assert make_estimator("kvcmas", spec).config.rank == 32
    with pytest.raises(ValueError, match="unknown estimator"):
        make_estimator("nope", spec)


def test_fullshared_is_alignment_only(gen):
    spec = RopeSpec.default(head_dim=8)
    k, v = torch.randn(3, 5, 2, 8, generator=gen), torch.randn(3, 5, 2, 8, generator=gen)
    est = make_estimator("fullshared", spec)
    res = est.estimate("q", SegmentCache(k, v, 10, "a"), "b", 3)
    assert res.accepted and res.plan is None and not est.learns
    assert est.prepare_observation("q", SegmentCache(k, v, 10, "a"), SegmentCache(k, v, 3, "b")) is None
    k_hat, v_hat = materialize(k, v, 10, 3, res.plan, spec)
    torch.testing.assert_close(k_hat, rotate_keys(k, -7, spec))
    torch.testing.assert_close(v_hat, v)


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
    k_hat, v_hat = materialize(ka, va, 13, 31, res.plan, spec)
    torch.testing.assert_close(k_hat, kb, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_hat, vb, atol=1e-4, rtol=1e-4)


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


def _obs(gen, agent_src="a", agent_dst="b", length=10, nl=2):
    k, v = torch.randn(nl, length, 2, 8, generator=gen), torch.randn(nl, length, 2, 8, generator=gen)
    return SegmentCache(k, v, 3, agent_src), SegmentCache(k + 0.1, v + 0.1, 9, agent_dst)


def test_prepare_is_pure_and_commit_attaches(gen):
    spec = RopeSpec.default(head_dim=8)
    est = make_estimator("kvcmas", spec, tau=1.0, rank=4)
    src, tgt = _obs(gen)
    prep = est.prepare_observation(("ns", "q"), src, tgt, content_key="c0")
    assert est.describe() == {} and est.memory_bytes() == 0 and est.pool_size(("ns", "q")) == 0  # nothing touched
    assert prep.slot == ("ns", "q") and prep.edge == ("a", "b") and prep.length == 10
    anchor_id = est.commit_observation(prep)
    assert anchor_id is not None and est.pool_size(("ns", "q")) == 1
    # The same content on another edge attaches to the same anchor (one base, two deltas).
    est.commit_observation(est.prepare_observation(("ns", "q"), src, SegmentCache(tgt.k, tgt.v, 9, "c"), "c0"))
    (anchor,) = est.describe()[("ns", "q")]
    assert anchor["id"] == anchor_id and len(anchor["edges"]) == 2
    assert est.memory_bytes() == anchor["bytes"]
    # A content the pool holds needs no base again: only the deltas are factorized.
    assert est.has_content(("ns", "q"), "c0") and not est.has_content(("ns", "q"), "c9")
    lean = est.prepare_observation(("ns", "q"), src, SegmentCache(tgt.k, tgt.v, 9, "d"), "c0", with_base=False)
    assert lean.base_k is None and est.commit_observation(lean) == anchor_id
    assert len(est.describe()[("ns", "q")][0]["edges"]) == 3
    orphan = est.prepare_observation(("ns", "q"), src, tgt, "gone", with_base=False)
    assert est.commit_observation(orphan) is None and not est.has_content(("ns", "q"), "gone")  # dropped, not invented
    # observe == prepare + commit; the estimate of an unknown slot creates no pool.
    est.observe(("ns", "q"), *_obs(gen), content_key="c1")
    assert est.pool_size(("ns", "q")) == 2
    assert est.estimate("never-seen", src, "b", 9).reason == "too_few_anchors" and "never-seen" not in est.describe()
    res = est.estimate(("ns", "q"), src, "b", 9)
    assert res.accepted and res.pool_anchors == 2 and res.plan.num_anchors == 2
    with pytest.raises(ValueError, match="dense"):
        est.prepare_observation(("ns", "q"), src, SegmentCache(tgt.k, tgt.v, 9, "b", exact=False))
    est.reset(("ns", "q"))
    assert est.pool_size(("ns", "q")) == 0 and est.memory_bytes() == 0


def test_max_slots_drops_least_recently_used_pool(gen):
    spec = RopeSpec.default(head_dim=8)
    est = make_estimator("kvcmas", spec, tau=1.0, rank=4, max_slots=2)
    for slot in ("s1", "s2"):
        est.observe(slot, *_obs(gen), content_key=0)
        est.observe(slot, *_obs(gen), content_key=1)
    src, _ = _obs(gen)
    assert est.estimate("s1", src, "b", 9).accepted  # s1 is now the most recently used
    est.observe("s3", *_obs(gen), content_key=0)
    assert set(est.describe()) == {"s1", "s3"} and est.evictions["slots"] == 1
    est.configure(max_slots=1)  # tightening evicts at once
    assert set(est.describe()) == {"s3"}
    with pytest.raises(ValueError, match="max_slots"):
        est.configure(max_slots=0)
    with pytest.raises(ValueError, match="unknown setting"):
        est.configure(tua=0.3)


def test_budget_evicts_oldest_least_activated_of_lru_pool_never_refuses(gen):
    spec = RopeSpec.default(head_dim=8)
    est = make_estimator("kvcmas", spec, tau=1.0, rank=4)
    for slot in ("old", "new"):
        for key in range(3):
            est.observe(slot, *_obs(gen), content_key=key)
    per_anchor = est.describe()["old"][0]["bytes"]
    assert all(a["bytes"] == per_anchor for anchors in est.describe().values() for a in anchors)
    src, _ = _obs(gen)
    assert est.estimate("old", src, "b", 9).accepted  # activates some of old's anchors; old becomes MRU
    activated = [a["activations"] > 0 for a in est.describe()["old"]]
    assert any(activated)
    est.configure(budget_bytes=5 * per_anchor)  # one anchor must go: from "new" (now least recently used)
    assert [len(v) for v in est.describe().values()] == [2, 3] and est.evictions["anchors_budget"] == 1
    assert [a["content_key"] for a in est.describe()["new"]] == ["1", "2"]  # its oldest (no activations)
    # Learning goes on under the budget: each commit evicts instead of refusing.
    for key in range(3, 7):
        assert est.commit_observation(est.prepare_observation("new", *_obs(gen), content_key=key)) is not None
        assert est.memory_bytes() <= 5 * per_anchor
    assert est.pool_size("new") >= 1 and est.evictions["anchors_budget"] == 5
    # A budget below one anchor keeps nothing, and says so.
    est.configure(budget_bytes=per_anchor // 2)
    assert est.memory_bytes() == 0
    assert est.commit_observation(est.prepare_observation("x", *_obs(gen), content_key=0)) is None
