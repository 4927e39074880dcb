"""Reuse scope, estimate invalidation, reserved tree keys and retraction, on fake pools (no server).

Each test fails on a cache that lets approximate KV cross a workflow, serves an
estimate made under old settings, lets a client's extra_key reach the estimate
namespace, or counts a retracted request twice.
"""

from __future__ import annotations

import json

import pytest

from tests.cache.fakes import FakeReq, MiniScheduler, make_cache
from tests.cache.test_adapter import QUERY, SYS, annotated, warm


def scoped(agent: str, workflow=None, **kw) -> FakeReq:
    req = annotated(agent, **kw)
    ann = json.loads(req.custom_params["kvshare"])
    if workflow is not None:
        ann["workflow"] = workflow
    return FakeReq(req.origin_input_ids, custom_params={"kvshare": json.dumps(ann)}, cache_salt=req.cache_salt,
                   extra_key=req.extra_key)


def test_approximate_reuse_stays_inside_a_workflow():
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(scoped("A", "alice"))
    warm(sched, "B")
    bob = scoped("B", "bob")
    sched.run(bob)
    assert bob.report()["tokens_aligned"] == 0  # bob is never served KV computed behind alice's prompt
    assert bob.report()["segments"][1]["reason"] == "no_source"
    warm(sched, "C")
    alice_again = scoped("C", "alice")
    sched.run(alice_again)
    seg = alice_again.report()["segments"][1]
    assert seg["resolved_by"] == "alignment" and seg["source_agent"] == "A"  # a second agent of alice reuses


def test_a_wider_scope_shares_but_never_names_another_workflows_agent():
    sched = MiniScheduler(make_cache("fullshared", reuse_scope="salt"))
    sched.run(scoped("A", "alice"))
    warm(sched, "B")
    bob = scoped("B", "bob")
    sched.run(bob)
    seg = bob.report()["segments"][1]
    assert seg["resolved_by"] == "alignment" and "source_agent" not in seg


def test_estimates_of_an_identical_request_are_not_reused_after_a_config_change_or_reset():
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(annotated("A"))
    warm(sched, "B")
    sched.run(annotated("B"))
    again = annotated("B")
    sched.run(again)
    assert again.report()["tokens_estimate_hit"] >= len(QUERY)  # the estimate of the first B request
    sched.cache.kvshare_admin.configure(recompute_ratio=0.1)
    after_change = annotated("B")
    sched.run(after_change)
    rep = after_change.report()
    assert rep["tokens_estimate_hit"] == 0  # assembled again under the new settings
    assert rep["segments"][1]["head_recomputed"] == 6  # 0.1 of the 60-token query
    sched.cache.kvshare_admin.reset()
    after_reset = annotated("B")
    sched.run(after_reset)
    assert after_reset.report()["tokens_estimate_hit"] == 0
    assert after_reset.report()["tokens_aligned"] == 0  # the records are gone too: prefilled


def test_a_client_extra_key_never_reaches_the_estimate_namespace():
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(annotated("A"))
    warm(sched, "B")
    b = annotated("B")
    sched.run(b)
    est_key = b.kvshare_plan.tree_ns.est_extra_key
    plain = FakeReq(list(b.origin_input_ids), extra_key=est_key)  # a plain request naming the estimate key
    assert sched.match(plain) == 0  # nothing matched: the key was escaped, not the estimates
    assert plain.extra_key.startswith("client:")
    assert sched.cache.counters.get("plain_tokens_from_estimates") == 0


def _a_read_and_b_warm() -> MiniScheduler:
    """A fullshared cache where agent A read the query and agent B's private prefix is warm."""
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(annotated("A"))
    warm(sched, "B")
    return sched


def test_the_plan_is_frozen_and_its_state_holds_what_changes():
    """What planning decided cannot be changed by a later step; what a match changes lives in the state."""
    import dataclasses

    from sglang_kvshare.cache.plan import RequestState

    sched = _a_read_and_b_warm()
    b = annotated("B")
    sched.match(b)
    plan = b.kvshare_plan
    for field, value in (("tokens", ()), ("annotation", None), ("state", RequestState([])), ("est_start", 0)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, field, value)
    assert plan.state.est_start == len(SYS["B"]) and plan.state.outcomes[1].resolved_by == "alignment"
    assert isinstance(plan.hashes, tuple)


def test_the_steps_are_handed_sglangs_tree_never_the_adapter():
    """The pipeline, its steps and the admin view reach SGLang's tree through ``SGLangTree`` (RadixCache's own
    methods): the adapter's overrides and attributes are out of their reach."""
    from sglang_kvshare.cache.adapter import KVShareRadixCache

    cache = make_cache("fullshared")
    holders = (cache.pipeline, cache.pipeline.parts, cache.pipeline.resolver, cache.pipeline.recorder.parts,
               cache.kvshare_admin.parts)
    for holder in holders:
        for value in vars(holder).values():
            assert not isinstance(value, KVShareRadixCache), (holder, value)
    tree = cache.pipeline.tree
    assert not hasattr(tree, "kvshare_resume") and not hasattr(tree, "pipeline")
    assert tree.root_node is cache.root_node and tree.token_to_kv_pool_allocator is cache.token_to_kv_pool_allocator


def test_a_retracted_request_is_planned_afresh_and_counted_once():
    sched = _a_read_and_b_warm()
    cache = sched.cache
    b = annotated("B")
    sched.match(b)  # admitted: planned, assembled, its prompt prefilled and counted ...
    plan = b.kvshare_plan
    plan.state.counted = True
    cache.recorder.count(plan)
    cache.on_release(b, checkpointed=False)  # ... then retracted in decode: its KV freed, not finished
    assert plan.state.released
    before = cache.kvshare_admin.stats()["slots"]["query"]["requests"]
    sched.run(b)  # matched again from scratch, as SGLang re-queues a retracted request
    assert b.kvshare_plan is not plan and b.report()["shared_tokens_reused"] == len(QUERY)
    assert cache.kvshare_admin.stats()["slots"]["query"]["requests"] == before  # the old count taken back
    assert cache.counters.get("plans_after_retraction") == 1


def test_an_admin_change_is_rejected_without_state_change_when_invalid():
    cache = make_cache("fullshared")
    epoch = cache.state.epoch
    try:
        cache.kvshare_admin.configure(tau=3.0)
    except ValueError:
        pass
    assert cache.state.epoch == epoch and cache.kvshare_config.tau != 3.0
    assert SYS  # the shared fixtures stay importable from test_adapter


def test_a_segment_marked_reuse_false_is_prefilled_here_and_offered_to_later_requests():
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(annotated("A"))
    warm(sched, "B")
    req = annotated("B")
    ann = json.loads(req.custom_params["kvshare"])
    ann["segments"][1]["reuse"] = False  # e.g. the message a user just typed
    mine = FakeReq(req.origin_input_ids, custom_params={"kvshare": json.dumps(ann)})
    sched.run(mine)
    seg = mine.report()["segments"][1]
    assert seg["resolved_by"] == "dense" and "reason" not in seg  # by design, not a fallback
    warm(sched, "C")
    later = annotated("C")
    sched.run(later)
    assert later.report()["segments"][1]["source_agent"] == "B"  # B's copy serves the next agent


def test_memory_budgets_shrink_to_what_the_device_has_free():
    from sglang_kvshare.cache.checks import fit_memory_budget
    from sglang_kvshare.config import KVShareConfig

    config = KVShareConfig(pool_budget_mb=512.0, learn_queue_mb=1024.0)
    assert fit_memory_budget(config, free_bytes=64 * 2**30) is config  # plenty free: unchanged
    fitted = fit_memory_budget(config, free_bytes=1 * 2**30)  # 1 GiB free: at most half of it
    assert fitted.pool_budget_mb + fitted.learn_queue_mb <= 512.0 + 1e-6
    assert fitted.pool_budget_mb / fitted.learn_queue_mb == config.pool_budget_mb / config.learn_queue_mb


def test_tensor_parallelism_learns_in_step_on_every_rank():
    from sglang_kvshare.cache.checks import check_mode, tensor_parallel_config
    from sglang_kvshare.config import KVShareConfig

    launched = KVShareConfig(mode="kvcmas", learn_slot_interval_s=2.0, pool_file="p.pt", pool_save_interval_s=60)
    assert launched.learn_async
    assert tensor_parallel_config(launched, 1) is launched
    tp = tensor_parallel_config(launched, 3)
    assert not tp.learn_async and tp.learn_slot_interval_s == 0 and tp.mode == "kvcmas"
    assert tp.pool_save_interval_s == 0 and tp.pool_file == "p.pt"  # every rank saves at once, on POST only
    assert tensor_parallel_config(tp, 3) is tp
    check_mode("kvcmas", page_size=1)  # no TP refusal left: the gate reduces over the ranks


def test_the_test_fault_hook_perturbs_only_its_slot_and_a_request_may_ask_for_a_longer_head(monkeypatch):
    from devtools import fault_injection
    from tests.cache.fakes import LAYERS

    sched = _a_read_and_b_warm()
    cache = sched.cache
    clean = annotated("B")
    sched.run(clean)
    assert cache.counters.get("fault_perturbed_tokens") == 0
    fault_injection.install(monkeypatch, which=lambda slot: slot == "query")
    warm(sched, "C")
    bad = annotated("C")
    sched.run(bad)
    assert cache.counters.get("fault_perturbed_tokens") == len(QUERY)
    monkeypatch.undo()
    req = annotated("B")
    ann = json.loads(req.custom_params["kvshare"])
    ann["recompute_head"] = 6  # the guard asks for more fidelity for this request only
    asked = FakeReq(req.origin_input_ids, custom_params={"kvshare": json.dumps(ann)})
    sched.run(asked)
    seg = asked.report()["segments"][1]
    assert seg["head_recomputed"] == 6 and seg["resolved_tokens"] == len(QUERY) - 6
    assert LAYERS


def with_head(req: FakeReq, head: int) -> FakeReq:
    """``req`` asking for a recomputed head of ``head`` rows (as the guard's tighter setting does)."""
    ann = json.loads(req.custom_params["kvshare"])
    ann["recompute_head"] = head
    return FakeReq(req.origin_input_ids, custom_params={"kvshare": json.dumps(ann)}, cache_salt=req.cache_salt,
                   extra_key=req.extra_key)


@pytest.mark.parametrize("sparse", [False, True], ids=["staged", "sparse"])
def test_a_longer_head_is_never_served_the_estimates_a_shorter_one_left(sparse):
    sched = MiniScheduler(make_cache("fullshared", sparse_unsupported=None if sparse else "not_checked"))
    sched.run(annotated("A"))
    warm(sched, "B")
    sched.run(annotated("B"))  # head 0: B's query rows are assembled estimates
    tight = with_head(annotated("B"), 16)
    sched.run(tight)
    rep = tight.report()
    seg = rep["segments"][1]
    assert rep["tokens_estimate_hit"] == 0  # not the 62 rows the head-0 request left
    assert seg["resolved_by"] == "alignment" and seg["head_recomputed"] == 16
    assert seg["resolved_tokens"] == len(QUERY) - 16  # the setting governs every row: 16 recomputed here
    again = with_head(annotated("B"), 16)
    sched.run(again)
    assert again.report()["tokens_estimate_hit"] > 0  # estimates made under the same setting still serve
