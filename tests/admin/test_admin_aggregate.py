"""Several data-parallel ranks seen as one server, without a server: the fan-out's wire format, the
scheduler hook that runs it, and how stats, pools and write replies merge."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from sglang_kvshare.admin import aggregate, ops, scheduler_hooks
from sglang_kvshare.config import KVShareConfig
from tests.admin.test_admin_ops import FakeCache


def _slot(seen: int, aligned: int, corrected: int = 0, hit: int = 0, entropy=None, decisions: int = 0) -> dict:
    return {"requests": 2, "shared_tokens_seen": seen, "resolved_hit": hit, "resolved_alignment": aligned,
            "resolved_correction": corrected, "prefilled_dense": seen - aligned - corrected - hit,
            "head_recomputed": 0, "reuse_ratio": (aligned + corrected) / seen, "resolved_ratio": 0.0,
            "fallbacks": {"no_copy": 1}, "mean_gate_entropy": entropy, "gate_decisions": decisions}


def _snap(rank: int, slots: dict, *, tau: float = 0.3, anchor_bytes: int = 100) -> dict:
    config = dataclasses.asdict(KVShareConfig(mode="kvcmas", tau=tau))
    seen = sum(s["shared_tokens_seen"] for s in slots.values())
    reused = sum(s["resolved_alignment"] + s["resolved_correction"] for s in slots.values())
    return {"dp_rank": rank, "config": config, "stats": {
        "mode": "kvcmas", "config": config, "unsupported_reason": None, "shared_tokens_seen": seen,
        "reuse_ratio": reused / seen, "anchor_bytes": anchor_bytes, "pending_observations": rank,
        "kv_pool_tokens": {"available": 10, "total": 20}, "limits": {"anchor_bytes": 1000},
        "counters": {"annotated_requests": 3 + rank}, "slots": slots}}


def test_counts_add_up_and_ratios_come_from_the_summed_counts():
    a = _snap(0, {"doc": _slot(100, 90, entropy=0.2, decisions=1)})
    b = _snap(1, {"doc": _slot(300, 0, corrected=30, entropy=0.6, decisions=3), "q": _slot(50, 50)})
    merged = aggregate.merge_stats([b, a])
    stats = merged["stats"]
    assert merged["dp_size"] == 2 and [r["dp_rank"] for r in merged["ranks"]] == [0, 1]
    assert stats["shared_tokens_seen"] == 450 and stats["reuse_ratio"] == pytest.approx(170 / 450)
    doc = stats["slots"]["doc"]
    assert doc["shared_tokens_seen"] == 400 and doc["reuse_ratio"] == pytest.approx(120 / 400)
    assert doc["mean_gate_entropy"] == pytest.approx((0.2 + 3 * 0.6) / 4)  # weighted by decisions
    assert doc["fallbacks"] == {"no_copy": 2} and doc["requests"] == 4
    assert stats["slots"]["q"]["reuse_ratio"] == 1.0  # a slot only one rank saw
    assert stats["anchor_bytes"] == 200 and stats["limits"]["anchor_bytes"] == 2000
    assert stats["counters"]["annotated_requests"] == 7 and stats["kv_pool_tokens"]["total"] == 40
    assert stats["mode"] == "kvcmas" and stats["config"]["tau"] == 0.3  # settings once, not summed
    assert "config_differs_on_ranks" not in stats
    assert merged["ranks"][1]["reuse_ratio"] == pytest.approx(80 / 350)  # each rank's own figure kept


def test_a_rank_with_other_settings_is_named():
    merged = aggregate.merge_stats([_snap(0, {"doc": _slot(10, 5)}), _snap(1, {"doc": _slot(10, 5)}, tau=0.9)])
    assert merged["stats"]["config_differs_on_ranks"] == [1]


def test_one_rank_comes_back_as_it_is():
    snap = _snap(0, {"doc": _slot(10, 5)})
    merged = aggregate.merge_stats([snap])
    assert merged["stats"] is snap["stats"] and merged["dp_size"] == 1


def _reply(rank: int, status: int = 200, result: dict | None = None, message: str = "ok") -> dict:
    return {"status": status, "message": message, "result": result or {}, "rid": "x", "dp_rank": rank}


def test_a_write_is_done_only_when_every_rank_answered_it():
    done = aggregate.merge_replies("configure", [_reply(0, result={"config": {"tau": 0.5}}), _reply(1)], 2)
    assert done.ok and done.result["config"] == {"tau": 0.5} and len(done.result["ranks"]) == 2
    missing = aggregate.merge_replies("reset", [_reply(1)], 2)
    assert missing.status == 502 and "[0]" in missing.message and "[1]" in missing.message


def test_a_failure_on_one_rank_names_it_and_where_it_applied():
    reply = aggregate.merge_replies("configure", [_reply(0), _reply(1, 500, message="boom")], 2)
    assert reply.status == 500 and "rank(s) [1]" in reply.message and "applied on rank(s) [0]" in reply.message


def test_a_slot_one_rank_never_saw_is_no_failure_but_unknown_everywhere_is_a_404():
    pools = aggregate.merge_replies("pools", [
        _reply(0, result={"pools": {"doc": [{"id": 1}]}}), _reply(1, 404, message="unknown slot 'doc'")], 2)
    assert pools.ok and pools.result["pools"] == {"doc": [{"id": 1, "dp_rank": 0}]}
    nowhere = aggregate.merge_replies("reset", [_reply(0, 404, message="unknown slot"), _reply(1, 404)], 2)
    assert nowhere.status == 404


def test_pools_of_all_ranks_are_tagged_by_rank():
    merged = aggregate.merge_pools([_reply(1, result={"pools": {"doc": [{"id": 7}], "q": []}}),
                                    _reply(0, result={"pools": {"doc": [{"id": 3}]}})])
    assert merged == {"doc": [{"id": 3, "dp_rank": 0}, {"id": 7, "dp_rank": 1}], "q": []}


def test_the_fanout_rid_round_trips_and_other_rids_are_not_ours():
    rid = ops.fanout_rid("configure", {"tau": 0.5, "mode": "fullshared"}, "abc")
    assert ops.parse_fanout_rid(rid) == ("configure", {"tau": 0.5, "mode": "fullshared"}, "abc")
    for other in (None, "", "req-1", ops.FANOUT_PREFIX + "{not json", 7):
        assert ops.parse_fanout_rid(other) is None


def _controller(rank):
    scheduler = SimpleNamespace(tree_cache=FakeCache(), dp_rank=rank, metrics_reporter=None)
    return SimpleNamespace(scheduler=scheduler)


def test_the_read_hook_runs_a_fanned_out_write_and_tags_the_reply_with_its_rank():
    controller = _controller(1)
    result = SimpleNamespace(internal_state={})
    req = SimpleNamespace(rid=ops.fanout_rid("configure", {"tau": 0.25}, "call-1"))
    scheduler_hooks.after_get_internal_state(result, controller, req)
    reply = result.internal_state[ops.REPLY_KEY]
    assert reply["status"] == 200 and reply["rid"] == "call-1" and reply["dp_rank"] == 1
    assert controller.scheduler.tree_cache.kvshare_admin.config.tau == 0.25
    assert result.internal_state[ops.STATE_KEY]["dp_rank"] == 1


def test_a_plain_read_runs_no_op():
    controller = _controller(None)
    result = SimpleNamespace(internal_state={})
    scheduler_hooks.after_get_internal_state(result, controller, SimpleNamespace(rid=None))
    assert ops.REPLY_KEY not in result.internal_state
    assert result.internal_state[ops.STATE_KEY]["dp_rank"] == 0
