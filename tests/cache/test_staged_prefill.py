"""Staged prefill and head recompute on fake pools (docs/ALGORITHM.md, Staged prefill).

``MiniScheduler`` cuts the prefill where ``kvshare_stage_end`` asks and calls
``kvshare_resume`` between chunks, as the scheduler hooks do in a server.
"""

from __future__ import annotations

import json

import torch

from tests.cache.fakes import LAYERS, FakeReq, MiniScheduler, dense_kv, make_cache
from tests.cache.test_adapter import QUERY, SUFFIX, SYS, annotated, assert_pool_accounted, warm

DOC = list(range(5000, 5040))


def with_doc(agent: str) -> FakeReq:
    """[system | doc (never seen) | query (seen) | suffix]."""
    sys_ids = SYS[agent]
    tokens = sys_ids + DOC + QUERY + SUFFIX
    a, b, c = len(sys_ids), len(sys_ids) + len(DOC), len(sys_ids) + len(DOC) + len(QUERY)
    ann = {"agent": agent, "segments": [
        {"kind": "private", "start": 0, "end": a},
        {"kind": "shared", "start": a, "end": b, "slot": "doc"},
        {"kind": "shared", "start": b, "end": c, "slot": "query"},
        {"kind": "private", "start": c, "end": len(tokens)}]}
    return FakeReq(tokens, custom_params={"kvshare": json.dumps(ann)})


def test_cold_agent_reuses_the_shared_segment_of_its_first_request():
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(annotated("A"))
    b = annotated("B")  # B's system prompt was never seen: no warm-up request
    sched.run(b)
    rep = b.report()
    assert rep["tokens_aligned"] == len(QUERY)
    assert rep["tokens_prefilled"] == len(SYS["B"]) + len(SUFFIX)
    assert b.stages == 1
    assert_pool_accounted(sched.cache)


def test_a_miss_on_one_segment_does_not_make_later_segments_dense():
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(annotated("A"))
    req = with_doc("B")
    sched.run(req)
    segs = req.report()["segments"]
    assert segs[1]["resolved_by"] == "dense" and segs[1]["reason"] == "no_source"
    assert segs[2]["resolved_by"] == "alignment" and segs[2]["resolved_tokens"] == len(QUERY)
    assert_pool_accounted(sched.cache)


def test_staging_off_stops_at_the_first_miss():
    sched = MiniScheduler(make_cache("fullshared", staged=False))
    sched.run(annotated("A"))
    req = with_doc("B")
    sched.run(req)
    assert req.report()["tokens_aligned"] == 0 and req.stages == 0
    # The query was never tried: still a fallback with a reason, not a silent miss.
    assert {"segment": 2, "slot": "query", "reason": "not_reached"} in req.report()["fallbacks"]


def test_head_recompute_prefills_the_first_k_tokens_in_the_request_context():
    k = 8
    sched = MiniScheduler(make_cache("fullshared"))
    a = annotated("A")
    sched.run(a)
    warm(sched, "B")
    b = annotated("B", head=k)
    sched.run(b)
    rep = b.report()
    seg = rep["segments"][1]
    assert seg["resolved_by"] == "alignment" and seg["head_recomputed"] == k
    assert rep["tokens_aligned"] == len(QUERY) - k  # reuse counts only rows not prefilled
    assert rep["tokens_head_recomputed"] == k
    assert sched.cache.kvshare_admin.stats()["slots"]["query"]["head_recomputed"] == k  # /kvshare/stats counts it too
    cache = sched.cache
    start = len(SYS["B"])
    rows = cache.path_device_indices(b.last_node)[start:start + len(QUERY)].tolist()
    kv = cache.token_to_kv_pool_allocator.get_kvcache()
    head_k, _ = dense_kv(b.origin_input_ids, start)  # computed densely behind B's own system prompt
    torch.testing.assert_close(kv.get_key_buffer(0)[rows[0]], head_k[0])
    _, tail_v = dense_kv(a.origin_input_ids, len(SYS["A"]) + k)  # the rest: A's copy, aligned
    for layer in range(LAYERS):
        torch.testing.assert_close(kv.get_value_buffer(layer)[rows[k]], tail_v[layer])
    assert_pool_accounted(cache)


def test_plain_request_after_a_staged_assembly_sees_exact_kv_only():
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(annotated("A"))
    sched.run(annotated("B", head=4))  # cold B: dense system prompt, dense head, aligned rest
    plain = FakeReq(annotated("B").origin_input_ids)
    m = sched.run(plain)
    assert m == len(SYS["B"]) + 4  # exact rows only: B's system prompt and the dense head
    assert sched.cache.counters.get("plain_tokens_from_estimates") == 0
    assert_pool_accounted(sched.cache)


def test_a_short_private_tail_after_a_dense_stretch_is_not_staged():
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(annotated("A"))
    second = annotated("A", query=list(range(7000, 7060)))  # new content, then A's own short suffix
    sched.run(second)
    assert second.stages == 0  # a 3-token tail is not worth a stage (min_stage_tokens)
    assert second.report()["segments"][2]["resolved_by"] == "dense"


def test_a_request_matched_again_after_its_dense_stretch_became_a_hit_still_reuses():
    """Two cold requests of one agent wait together, as under concurrent load.

    The second was planned while the agent's system prompt was unseen (a dense
    stretch, reuse resuming at the shared segment); by the time it is scheduled
    the first has put that prompt in the tree, so its new match ends exactly where
    the stage was to end. It must reuse from there, not prefill the rest densely.
    """
    other = list(range(7000, 7060))
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(annotated("A"))
    sched.run(annotated("A", query=other))
    first, second = annotated("B"), annotated("B", query=other)
    sched.match(second)  # waits: planned with B's system prompt unseen
    assert sched.cache.kvshare_stage_end(second, 0) == len(SYS["B"])
    sched.run(first)
    sched.run(second)  # scheduled now: matched again, B's system prompt is an exact hit
    rep = second.report()
    assert rep["segments"][0]["resolved_by"] == "hit" and "reason" not in rep["segments"][0]
    assert rep["segments"][1]["resolved_by"] == "alignment" and rep["tokens_aligned"] == len(other)
    assert rep["shared_tokens_reused"] == len(other) and rep["fallbacks"] == []
    assert_pool_accounted(sched.cache)


def test_a_shared_segment_shorter_than_the_minimum_is_prefilled_with_its_reason():
    """The length rule: a 60-token query under a 61-token minimum is prefilled densely (``short_segment``), exactly
    as a plain request would be; at a minimum of 60 it is reused."""
    for minimum, reused in ((61, False), (60, True)):
        sched = MiniScheduler(make_cache("fullshared", min_reuse_tokens=minimum))
        sched.run(annotated("A"))
        warm(sched, "B")
        b = annotated("B")
        sched.run(b)
        rep = b.report()
        seg = rep["segments"][1]
        if reused:
            assert seg["resolved_by"] == "alignment" and rep["tokens_aligned"] == len(QUERY)
        else:
            assert seg["resolved_by"] == "dense" and rep["tokens_aligned"] == 0
            assert {"segment": 1, "slot": "query", "reason": "short_segment"} in rep["fallbacks"]
        assert_pool_accounted(sched.cache)


SHORT, LONG = list(range(300, 310)), list(range(400, 460))


def short_then_long(agent: str, short_reuse: bool = True) -> FakeReq:
    """[system | a 10-token shared segment | a 60-token one | suffix]; ``short_reuse`` False marks the short one
    ``reuse: false``."""
    sys_ids = SYS[agent]
    tokens = sys_ids + SHORT + LONG + SUFFIX
    a, b = len(sys_ids), len(sys_ids) + len(SHORT)
    segs = [{"kind": "private", "start": 0, "end": a},
            {"kind": "shared", "start": a, "end": b, "slot": "s", "reuse": short_reuse},
            {"kind": "shared", "start": b, "end": b + len(LONG), "slot": "l"},
            {"kind": "private", "start": b + len(LONG), "end": len(tokens)}]
    return FakeReq(tokens, custom_params={"kvshare": json.dumps({"agent": agent, "segments": segs})})


def test_staged_prefill_passes_over_a_short_segment_to_the_long_one_behind_it():
    """Two shared segments behind a dense stretch: the short one is prefilled (``short_segment``), reuse resumes at
    the long one."""
    sched = MiniScheduler(make_cache("fullshared", min_reuse_tokens=32))
    sched.run(short_then_long("A"))
    b = short_then_long("B")  # cold B: its system prompt is a dense stretch, then the short segment, the long one
    sched.run(b)
    rep = b.report()
    assert rep["segments"][1]["resolved_by"] == "dense" and rep["segments"][2]["resolved_by"] == "alignment"
    assert {"segment": 1, "slot": "s", "reason": "short_segment"} in rep["fallbacks"]
    assert rep["tokens_aligned"] == len(LONG)
    assert_pool_accounted(sched.cache)


def test_a_short_segment_the_client_keeps_dense_is_no_fallback():
    """``reuse: false`` on a segment under the minimum: prefilled as asked, so no ``short_segment`` fallback is
    reported for it (the client's choice, not the server's rule); the long segment behind is still reused."""
    sched = MiniScheduler(make_cache("fullshared", min_reuse_tokens=32))
    sched.run(short_then_long("A", short_reuse=False))
    b = short_then_long("B", short_reuse=False)
    sched.run(b)
    rep = b.report()
    assert rep["segments"][1]["resolved_by"] == "dense" and rep["segments"][1].get("reason") is None
    assert all(f["segment"] != 1 for f in rep["fallbacks"]), rep["fallbacks"]
    assert rep["tokens_aligned"] == len(LONG)
