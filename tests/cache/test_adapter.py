"""The kvshare cache on fake pools: assembly, estimate isolation, namespaces, locking, eviction, accounting.

No server: ``tests/cache/fakes.py`` drives requests through the cache the way
SGLang's scheduler does. Each test asserts behaviour that a wrong cache would
break (a leak of an estimate, a slot freed twice, a row lost).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_kvshare.cache import resolve, tree_paths
from sglang_kvshare.cache.plan import plan_of
from tests.cache.fakes import LAYERS, FakeReq, MiniScheduler, dense_kv, make_cache

SYS = {"A": list(range(10, 30)), "B": list(range(40, 53)), "C": list(range(60, 77))}
QUERY = list(range(200, 260))
SUFFIX = [5, 6, 7]


def annotated(agent: str, query=QUERY, *, salt=None, extra_key=None, output_slot=None, reuse: bool = True,
              slot: str = "query", head: int = 0) -> FakeReq:
    sys_ids = SYS[agent]
    tokens = sys_ids + list(query) + SUFFIX
    shared = {"kind": "shared", "start": len(sys_ids), "end": len(sys_ids) + len(query), "slot": slot}
    if not reuse:
        shared["reuse"] = False
    segs = [{"kind": "private", "start": 0, "end": len(sys_ids)}, shared,
            {"kind": "private", "start": len(sys_ids) + len(query), "end": len(tokens)}]
    ann = {"agent": agent, "segments": segs}
    if output_slot:
        ann["output_slot"] = output_slot
    if head:
        ann["recompute_head"] = head
    return FakeReq(tokens, custom_params={"kvshare": json.dumps(ann)}, cache_salt=salt, extra_key=extra_key)


def warm(sched: MiniScheduler, agent: str, **kw) -> None:
    sys_ids = SYS[agent]
    ann = {"agent": agent, "segments": [{"kind": "private", "start": 0, "end": len(sys_ids)}]}
    sched.run(FakeReq(sys_ids + [1], custom_params=None, **kw))  # the private prefix, plain
    del ann


def assert_pool_accounted(cache) -> None:
    allocator = cache.token_to_kv_pool_allocator
    assert cache.protected_size() == 0
    assert allocator.available_size() + cache.evictable_size() == allocator.size


@pytest.fixture
def sched():
    return MiniScheduler(make_cache("fullshared"))


def test_shared_segment_is_aligned_from_another_agent(sched):
    sched.run(annotated("A"))
    warm(sched, "B")
    req = annotated("B")
    m = sched.run(req)
    rep = req.report()
    assert rep["tokens_aligned"] == len(QUERY)
    assert m == len(SYS["B"]) + len(QUERY)
    assert rep["segments"][1]["resolved_by"] == "alignment"
    assert_pool_accounted(sched.cache)


def test_aligned_rows_are_the_source_values(sched):
    a = annotated("A")
    sched.run(a)
    warm(sched, "B")
    b = annotated("B")
    sched.match(b)
    cache = sched.cache
    start = len(SYS["B"])
    rows = cache.path_device_indices(b.last_node)[start:start + len(QUERY)]
    kv = cache.token_to_kv_pool_allocator.get_kvcache()
    # Values are not rotated: the aligned copy carries agent A's dense values.
    for j, slot in enumerate(rows.tolist()):
        _, v = dense_kv(a.origin_input_ids, len(SYS["A"]) + j)
        for layer in range(LAYERS):
            torch.testing.assert_close(kv.get_value_buffer(layer)[slot], v[layer])


def test_plain_request_never_matches_an_estimate(sched):
    sched.run(annotated("A"))
    warm(sched, "B")
    sched.run(annotated("B"))  # assembled: B's query rows are estimates
    plain = FakeReq(annotated("B").origin_input_ids)
    m = sched.run(plain)
    assert m == len(SYS["B"])  # only B's exact system prompt, never the estimated query
    again = FakeReq(annotated("B").origin_input_ids)
    assert sched.run(again) == len(again.origin_input_ids) - 1  # its own exact copy is now a full hit
    assert sched.cache.counters.get("plain_tokens_from_estimates") == 0
    assert_pool_accounted(sched.cache)


def test_mode_off_after_assembly_serves_exact_only(sched):
    sched.run(annotated("A"))
    warm(sched, "B")
    sched.run(annotated("B"))
    sched.cache.kvshare_admin.configure(mode="off")
    req = annotated("B")  # annotated, but the server is off now
    assert sched.run(req) == len(SYS["B"])
    assert req.report() is None


def test_estimates_are_reused_by_an_identical_annotated_request(sched):
    sched.run(annotated("A"))
    warm(sched, "B")
    sched.run(annotated("B"))
    again = annotated("B")
    m = sched.run(again)
    assert m == len(again.origin_input_ids) - 1
    # The query's KV was assembled the first time: served again, but reported as an estimate hit.
    rep = again.report()
    # Token counts: everything past B's exact system prompt, up to the last prompt token, is the earlier
    # request's estimate (the query and the suffix rows it computed on top of it).
    assert rep["tokens_exact_hit"] == len(SYS["B"]) and rep["tokens_estimate_hit"] == m - len(SYS["B"])
    assert rep["shared_tokens_reused"] == len(QUERY)
    assert_pool_accounted(sched.cache)


def test_a_segment_marked_reuse_false_never_starts_on_an_earlier_requests_estimate(sched):
    """The guard's dense setting marks every shared segment so: its request must get exact KV only, even when
    an earlier request with the same tokens left its assembly in the tree."""
    sched.run(annotated("A"))
    warm(sched, "B")
    sched.run(annotated("B"))  # assembled: B's query rows and what follows are estimates
    dense = annotated("B", reuse=False)
    m = sched.run(dense)
    rep = dense.report()
    assert m == len(SYS["B"]) and rep["tokens_exact_hit"] == len(SYS["B"])
    assert rep["tokens_estimate_hit"] == 0 and rep["shared_tokens_reused"] == 0
    assert plan_of(dense) is None or plan_of(dense).state.est_start is None
    assert_pool_accounted(sched.cache)


def test_a_new_content_sharing_only_leading_tokens_starts_on_an_estimate_only_where_it_reuses(sched):
    """Contents with a common header: a new one in a slot with no copy may take the header's estimate when its
    segment is reusable (reported as an estimate hit), and is prefilled from its first row when marked
    ``reuse: false``."""
    sched.run(annotated("A"))
    warm(sched, "B")
    sched.run(annotated("B"))  # assembled: estimates under B's system prompt, starting with QUERY's header
    reusing = annotated("B", query=QUERY[:8] + list(range(300, 352)), slot="fresh")
    sched.run(reusing)
    assert reusing.report()["tokens_estimate_hit"] == 8
    exact = annotated("B", query=QUERY[:8] + list(range(400, 452)), slot="fresh2", reuse=False)
    assert sched.run(exact) == len(SYS["B"])
    assert exact.report()["tokens_estimate_hit"] == 0
    assert_pool_accounted(sched.cache)


def test_output_computed_on_an_estimate_is_not_a_source_of_exact_kv(sched):
    sched.run(annotated("A"))
    warm(sched, "B")
    b = annotated("B", output_slot="out:B")
    sched.run(b, new_tokens=6)
    records = sched.cache.registry.namespace((None, None, None))
    out = [m for mats in records.slot("out:B").contents.values() for m in mats]
    assert out and not any(m.exact for m in out)
    query_copies = [m for mats in records.slot("query").contents.values() for m in mats]
    assert {m.exact for m in query_copies if m.agent_name == "B"} == {False}
    assert {m.exact for m in query_copies if m.agent_name == "A"} == {True}


def test_salts_do_not_share(sched):
    sched.run(annotated("A", salt="tenantA"))
    warm(sched, "B", cache_salt="tenantB")
    b = annotated("B", salt="tenantB")
    sched.run(b)
    rep = b.report()
    assert rep["tokens_aligned"] == 0 and rep["segments"][1]["reason"] == "no_source"
    same = annotated("B", salt="tenantA")
    warm(sched, "B", cache_salt="tenantA")
    sched.run(same)
    assert same.report()["tokens_aligned"] == len(QUERY)


def test_lora_namespaces_do_not_share(sched):
    sched.run(annotated("A", extra_key="lora-1"))
    warm(sched, "B", extra_key="lora-2")
    b = annotated("B", extra_key="lora-2")
    sched.run(b)
    assert b.report()["tokens_aligned"] == 0


def test_plan_lives_on_the_request_and_a_reused_rid_starts_clean(sched):
    sched.run(annotated("A"))
    old = annotated("B")
    sched.match(old)  # matched while waiting, then aborted: never released
    new = annotated("C")
    new.rid = old.rid
    warm(sched, "C")
    sched.run(new)
    rep = new.report()
    assert rep["agent"] == "C" and rep["tokens_aligned"] == len(QUERY)
    assert sched.cache.path_device_indices(new.last_node) is not None


def test_evicted_source_is_reported_and_no_slot_leaks():
    sched = MiniScheduler(make_cache("fullshared", pool_tokens=400))
    sched.run(annotated("A"))
    sched.cache.evict(EvictParams(num_tokens=10_000))
    warm(sched, "B")
    b = annotated("B")
    sched.run(b)
    assert b.report()["segments"][1]["reason"] == "source_evicted"
    assert_pool_accounted(sched.cache)


def test_many_requests_under_eviction_pressure_keep_the_pool_accounted():
    sched = MiniScheduler(make_cache("fullshared", pool_tokens=300))
    for i in range(12):
        query = list(range(300 + 7 * i, 360 + 7 * i))
        for agent in ("A", "B", "C"):
            sched.run(annotated(agent, query=query), new_tokens=3)
    assert_pool_accounted(sched.cache)
    # Every recorded copy either resolves to live rows or is known to be gone.
    for _, node in sched.cache.registry.all_slots():
        for mats in node.contents.values():
            for mat in mats:
                rows = tree_paths.rows(mat.node, mat.start, mat.end)
                assert rows is None or len(rows) == mat.length


def test_write_failure_frees_the_fresh_slots(monkeypatch, sched):
    from sglang_kvshare.cache import assemble

    sched.run(annotated("A"))
    warm(sched, "B")
    before = sched.cache.token_to_kv_pool_allocator.available_size()

    def boom(*a, **k):
        raise RuntimeError("write failed")

    monkeypatch.setattr(assemble, "write_resolved", boom)
    b = annotated("B")
    m = sched.match(b)
    assert m == len(SYS["B"])  # fell back to the exact prefix
    assert sched.cache.token_to_kv_pool_allocator.available_size() == before
    assert sched.cache.counters.get("internal_errors") == 1


def _queries(n: int, length: int = 60) -> list[list[int]]:
    return [list(range(1000 + 97 * i, 1000 + 97 * i + length)) for i in range(n)]


def _a_then_b(sched: MiniScheduler, contents: int) -> list[dict]:
    """Agents A and B warmed, then per content A reads it and B reads it after; B's shared segment reports."""
    for agent in ("A", "B"):
        warm(sched, agent)
    reports = []
    for query in _queries(contents):
        sched.run(annotated("A", query=query))
        b = annotated("B", query=query)
        sched.run(b)
        reports.append(b.report()["segments"][1])
    return reports


def test_kvcmas_learns_from_dense_prefills_then_corrects():
    sched = MiniScheduler(make_cache("kvcmas", tau=1.0))
    reports = _a_then_b(sched, 4)
    assert reports[0]["reason"] == "too_few_anchors"  # the pool starts empty: dense, then learned
    assert sched.cache.estimator.pool_size(((None, None, None), "query")) >= 2
    assert reports[-1]["resolved_by"] == "correction", reports
    assert sched.cache.counters.get("observations") >= 2
    assert_pool_accounted(sched.cache)


@pytest.mark.parametrize("min_anchor_len, expected", [(16, "correction"), (0, "too_few_anchors")])
def test_anchors_shorter_than_the_segment_help_on_their_common_prefix(min_anchor_len, expected):
    """Pools learned on shorter contents (questions of varying length) must not stay useless.
    By default (16) the gate compares on the anchors' common prefix; 0 restores the papers' rule."""
    sched = MiniScheduler(make_cache("kvcmas", tau=1.0, min_anchor_len=min_anchor_len))
    for agent in ("A", "B"):
        warm(sched, agent)
    for query in _queries(3, length=40):
        sched.run(annotated("A", query=query))
        sched.run(annotated("B", query=query))
    longer = _queries(4, length=60)[-1]
    sched.run(annotated("A", query=longer))
    b = annotated("B", query=longer)
    sched.run(b)
    seg = b.report()["segments"][1]
    assert seg.get("resolved_by") == expected or seg.get("reason") == expected, seg
    assert_pool_accounted(sched.cache)


def learned_kvcmas(contents: int = 3, **config) -> MiniScheduler:
    """A kvcmas cache (tau 1) whose pool learned the A -> B edge from ``contents`` dense chains."""
    sched = MiniScheduler(make_cache("kvcmas", **{"tau": 1.0, **config}))
    for agent in ("A", "B"):
        warm(sched, agent)
    for query in _queries(contents):
        sched.run(annotated("A", query=query))
        sched.run(annotated("B", query=query))
    return sched


def test_kvcmas_corrected_rows_differ_from_plain_alignment():
    sched = learned_kvcmas()
    query = _queries(4)[-1]
    a = annotated("A", query=query)
    sched.run(a)
    b = annotated("B", query=query)
    sched.match(b)
    assert b.report()["segments"][1]["resolved_by"] == "correction"
    start = len(SYS["B"])
    rows = sched.cache.path_device_indices(b.last_node)[start:start + len(query)]
    kv = sched.cache.token_to_kv_pool_allocator.get_kvcache()
    _, v_src = dense_kv(a.origin_input_ids, len(SYS["A"]))
    assert not torch.allclose(kv.get_value_buffer(0)[int(rows[0])], v_src[0])  # the correction was added


def _owed_b(sched: MiniScheduler, query: list[int]) -> tuple[dict, list[int]]:
    """A reads ``query``, then B is matched behind its own prompt; B's segment report and owed rows (relative)."""
    sched.run(annotated("A", query=query))
    b = annotated("B", query=query)
    sched.match(b)
    start = len(SYS["B"])
    return b.report()["segments"][1], [p - start for p in plan_of(b).state.sparse_rows]


def test_the_head_rows_are_owed_by_the_next_forward_and_staged_heads_owe_none():
    """With the sparse extend, the ratio's rows of a corrected segment are its first ones, owed to the request's
    next forward; without it the head is a dense stage, and nothing is owed."""
    sched = learned_kvcmas(sparse_unsupported=None, recompute_ratio=0.25)
    query = _queries(4)[-1]
    seg, owed = _owed_b(sched, query)
    n = math.ceil(0.25 * len(query))
    assert seg["resolved_by"] == "correction" and seg["head_recomputed"] == n
    assert seg["resolved_tokens"] == len(query) - n and owed == list(range(n))
    staged = learned_kvcmas(recompute_ratio=0.25)
    seg, owed = _owed_b(staged, _queries(4)[-1])
    assert owed == []


def test_reset_drops_queued_observations_and_pools():
    sched = learned_kvcmas()
    sched.cache.kvshare_admin.reset()
    assert sched.cache.estimator.pool_size(((None, None, None), "query")) == 0
    assert sched.cache.kvshare_admin.stats()["slots"] == {}
    assert sched.cache.learner.generation == 1


def test_agent_identity_binds_the_private_prefix():
    cache = make_cache("kvcmas")
    sched = MiniScheduler(cache)
    real = annotated("B")
    sched.match(real)
    impostor_tokens = SYS["C"] + QUERY + SUFFIX  # claims the name "B" with another system prompt
    ann = json.loads(annotated("B").custom_params["kvshare"])
    ann["segments"][0]["end"] = len(SYS["C"])
    ann["segments"][1].update(start=len(SYS["C"]), end=len(SYS["C"]) + len(QUERY))
    ann["segments"][2].update(start=len(SYS["C"]) + len(QUERY), end=len(impostor_tokens))
    impostor = FakeReq(impostor_tokens, custom_params={"kvshare": json.dumps(ann)})
    sched.match(impostor)
    assert real.kvshare_plan.agent_id != impostor.kvshare_plan.agent_id


def test_limits_and_usage_are_reported_and_bounded():
    sched = MiniScheduler(make_cache("fullshared", max_slots=4))
    for i in range(10):
        tokens = SYS["A"] + QUERY
        ann = {"agent": "A", "segments": [{"kind": "private", "start": 0, "end": len(SYS["A"])},
                                          {"kind": "shared", "start": len(SYS["A"]), "end": len(tokens),
                                           "slot": f"junk{i}"}]}
        sched.run(FakeReq(tokens, custom_params={"kvshare": json.dumps(ann)}))
    stats = sched.cache.kvshare_admin.stats()
    assert stats["usage"]["max_slots"] <= stats["limits"]["max_slots"] == 4
    for key, used in stats["usage"].items():
        if key in stats["limits"]:
            assert used <= stats["limits"][key], key


def test_runtime_switch_to_a_mode_keeps_the_launch_checks():
    cache = make_cache("off")
    cache.state.page_size = 16  # the launch fact a mode switch is checked against
    with pytest.raises(ValueError, match="page-size 1"):
        cache.kvshare_admin.configure(mode="fullshared")
    assert cache.kvshare_config.mode == "off"


def test_the_plain_estimate_counter_is_reported_from_the_start():
    assert make_cache("fullshared").kvshare_admin.stats()["counters"]["plain_tokens_from_estimates"] == 0


def test_the_private_suffix_is_never_taken_from_another_context(sched):
    """B's own suffix from a request with another query is not aligned behind this query."""
    other = list(range(300, 340))
    sched.run(annotated("A", other))
    warm(sched, "B")
    sched.run(annotated("B", other))  # B's suffix now has a copy, behind ``other``
    sched.run(annotated("A"))
    req = annotated("B")
    sched.run(req)
    segs = req.report()["segments"]
    assert segs[1]["resolved_by"] == "alignment"
    assert segs[2]["resolved_by"] == "dense" and "reason" not in segs[2]
    assert req.report()["tokens_aligned"] == len(QUERY)
    assert_pool_accounted(sched.cache)


def test_a_prefill_counts_as_in_flight_from_match_until_its_prompt_is_in(sched, monkeypatch):
    """The learner waits while ``activity`` says busy (learner.py); decode steps must not hold it off."""
    open_during = []
    prefill = sched._prefill

    def spy(req, lo, hi):
        open_during.append(sched.cache.activity.open_count())
        prefill(req, lo, hi)

    monkeypatch.setattr(sched, "_prefill", spy)
    sched.run(annotated("A"), new_tokens=3)
    assert open_during[0] == 1  # the prompt's prefill
    assert open_during[-1] == 0  # a decode step: the prefill is over
    assert sched.cache.activity.open_count() == 0
    released = FakeReq(list(range(300, 340)))
    sched.match(released)  # matched, then released without a checkpoint (an abort)
    assert sched.cache.activity.open_count() == 1
    sched.cache.on_release(released, checkpointed=False)
    assert sched.cache.activity.open_count() == 0


@pytest.mark.parametrize("cold_pool_align", [True, False])
def test_a_cold_pool_aligns_once_the_observations_it_needs_are_queued(cold_pool_align):
    """With edge_anchors 2 (the gate's minimum): while two observations of the edge wait to be learned, a third
    reader is aligned (fullshared with the head) instead of prefilled again, and says why in its report."""
    sched = MiniScheduler(make_cache("kvcmas", tau=1.0, learn_async=True, cold_pool_align=cold_pool_align))
    sched.cache.learner._ensure_worker = lambda: None  # learning lags: nothing is learned during the test
    segments = _a_then_b(sched, 3)
    assert [s["reason"] for s in segments[:2]] == ["too_few_anchors"] * 2  # the observations the gate needs
    assert sched.cache.learner.pending() == (2 if cold_pool_align else 3)  # an aligned reader adds none
    if cold_pool_align:
        assert segments[2]["resolved_by"] == "alignment" and segments[2]["gate_fallback"] == "too_few_anchors"
        assert sched.cache.counters.get("cold_pool_aligned") == 1
    else:
        assert segments[2]["resolved_by"] == "dense" and segments[2]["reason"] == "too_few_anchors"
        assert sched.cache.counters.get("cold_pool_aligned") == 0


def test_while_an_edge_learns_half_the_contents_teach_and_the_rest_are_aligned():
    """edge_anchors 4: the first two contents are prefilled (nothing to gate on), then a content is prefilled
    only when its checksum says it teaches, the others aligned, until four observations are queued; from
    then on every reader is aligned until they are learned."""
    from sglang_kvshare.cache.resolve import teaches

    sched = MiniScheduler(make_cache("kvcmas", tau=1.0, learn_async=True, edge_anchors=4))
    sched.cache.learner._ensure_worker = lambda: None  # learning lags: nothing is learned during the test
    queries = _queries(14)
    segments = _a_then_b(sched, len(queries))
    dense = [s["resolved_by"] == "dense" for s in segments]
    expected, queued = [], 0
    for q in queries:
        learn = queued < 2 or (queued < 4 and teaches(q))
        expected.append(learn)
        queued += learn
    assert dense == expected
    assert sum(dense) == 4 and not all(dense[:4]), "the checksum must skip some contents for this test to mean much"
    assert all(s["gate_fallback"] == "too_few_anchors" for s, d in zip(segments, dense) if not d)
    assert sched.cache.learner.pending() == 4


def test_an_edge_is_corrected_only_once_it_holds_edge_anchors_contents():
    sched = MiniScheduler(make_cache("kvcmas", tau=1.0, edge_anchors=3))  # learns synchronously
    segments = _a_then_b(sched, 12)
    first = next(i for i, s in enumerate(segments) if s["resolved_by"] == "correction")
    assert sum(s["resolved_by"] == "dense" for s in segments[:first]) == 3  # three contents taught the edge
    assert all(s["resolved_by"] == "alignment" for s in segments[:first] if s["resolved_by"] != "dense")
    assert all(s["resolved_by"] == "correction" for s in segments[first:])
    assert segments[first]["pool_anchors"] == 3


def test_edge_anchors_change_at_runtime_capped_at_the_capacity():
    cache = make_cache("kvcmas")
    cache.kvshare_admin.configure(edge_anchors=5)
    assert cache.estimator.config.min_edge_anchors == 5
    cache.kvshare_admin.configure(capacity=4)
    assert cache.estimator.config.min_edge_anchors == 4  # an edge holds at most the pool's anchors
    with pytest.raises(ValueError, match="edge_anchors"):
        cache.kvshare_admin.configure(edge_anchors=1)
    assert cache.kvshare_config.edge_anchors == 5
