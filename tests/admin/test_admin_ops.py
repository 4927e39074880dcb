"""The admin contract without a server: ops.execute on a stand-in admin view, the metrics' counter logic."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_kvshare.admin import ops
from sglang_kvshare.config import KVShareConfig


class FakeView:
    """The admin view of ``KVShareRadixCache`` (``cache/admin_view.py``) with the same contracts."""

    def __init__(self) -> None:
        self.config = KVShareConfig(mode="kvcmas")
        self.anchors = {"query": [{"id": 0, "bytes": 10}], "out:a": []}
        self.resets: list = []

    def stats(self) -> dict:
        return {"mode": self.config.mode, "slots": {}}

    def pools(self, slot=None) -> dict:
        if slot is not None:
            if slot not in self.anchors:
                raise KeyError(slot)
            return {slot: self.anchors[slot]}
        return dict(self.anchors)

    def configure(self, **settings) -> KVShareConfig:
        changes = {k: v for k, v in settings.items() if v is not None}
        self.config = self.config.replace(**changes)
        return self.config

    def reset(self, slot=None) -> None:
        self.resets.append(slot)
        for name in ([slot] if slot else list(self.anchors)):
            self.anchors[name] = []


class FakeCache:
    def __init__(self) -> None:
        self.kvshare_admin = FakeView()


def test_configure_returns_the_new_config():
    cache = FakeView()
    reply = ops.execute(cache, "configure", tau=0.1, capacity=4)
    assert reply.status == 200
    assert reply.result["config"] == dataclasses.asdict(cache.config)
    assert reply.result["config"]["tau"] == 0.1 and reply.result["config"]["capacity"] == 4


def test_an_invalid_configure_is_a_422_and_changes_nothing():
    cache = FakeView()
    before = cache.config
    reply = ops.execute(cache, "configure", tau=0.2, capacity=1)
    assert reply.status == 422 and "capacity" in reply.message
    assert cache.config == before


def test_reset_of_an_unknown_slot_is_a_404_and_resets_nothing():
    cache = FakeView()
    reply = ops.execute(cache, "reset", slot="nope")
    assert reply.status == 404 and "nope" in reply.message
    assert cache.resets == []


def test_reset_one_slot_and_all():
    cache = FakeView()
    assert ops.execute(cache, "reset", slot="query").result["pools"]["query"] == []
    assert ops.execute(cache, "reset").ok
    assert cache.resets == ["query", None]


def test_unknown_op_and_missing_cache():
    assert ops.execute(FakeView(), "explode").status == 400
    assert ops.execute(None, "reset").status == 503
    assert ops.admin_view(FakeCache()) is not None and ops.admin_view(object()) is None


def test_reply_round_trips_through_json():
    reply = ops.Reply(422, "tau must lie in [0, 1]", {"x": [1, 2]}, rid="r1")
    assert ops.Reply.from_json(reply.to_json()) == reply


def test_snapshot_is_plain_json_types_and_holds_no_pools():
    # The snapshot also reaches /get_server_info (public with only --admin-api-key): no pools in it.
    snap = ops.snapshot(FakeView())
    assert set(snap) == {"config", "stats"}


def test_pools_op_reads_one_slot_or_all_and_changes_nothing():
    cache = FakeView()
    assert ops.execute(cache, "pools").result["pools"] == {"query": [{"id": 0, "bytes": 10}], "out:a": []}
    assert ops.execute(cache, "pools", slot="query").result["pools"] == {"query": [{"id": 0, "bytes": 10}]}
    missing = ops.execute(cache, "pools", slot="nope")
    assert missing.status == 404 and "nope" in missing.message
    assert cache.resets == []


def _value(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_metrics_count_increases_and_survive_a_reset():
    prometheus_client = pytest.importorskip("prometheus_client")
    from sglang_kvshare.admin.metrics import KVShareMetrics

    registry = prometheus_client.CollectorRegistry()
    metrics = KVShareMetrics(registry=registry, dp_rank=1)

    def stats(requests: int, aligned: int, anchors: int) -> dict:
        slot = {"requests": requests, "shared_tokens_seen": 100 * requests, "resolved_alignment": aligned,
                "fallbacks": {"no_source": 1}, "anchors": anchors, "anchor_bytes": 64 * anchors,
                "mean_gate_entropy": 0.25}
        return {"slots": {"query": slot}, "counters": {"annotated_requests": requests, "assembly_seconds": 0.5},
                "reuse_ratio": 0.5, "anchor_bytes": 64 * anchors}

    metrics.update(stats(2, 80, 3), KVShareConfig(mode="kvcmas", tau=0.3))
    metrics.update(stats(5, 200, 4))
    # The slot's series carry a bounded id (the stats name it), never the name a client chose.
    assert registry.get_sample_value("sglang_kvshare_requests_total", {"slot": "query", "dp_rank": "1"}) is None
    assert _value(registry, "sglang_kvshare_requests_total", slot="s0", dp_rank="1") == 5
    assert _value(registry, "sglang_kvshare_resolved_tokens_total", slot="s0", by="alignment", dp_rank="1") == 200
    assert _value(registry, "sglang_kvshare_anchors", slot="s0", dp_rank="1") == 4
    assert _value(registry, "sglang_kvshare_mode", mode="kvcmas") == 1
    assert _value(registry, "sglang_kvshare_capacity") == 10
    assert _value(registry, "sglang_kvshare_seconds_total", phase="assembly") == 0.5
    # Ratios do not add up over data-parallel ranks: each rank's series carries its number.
    assert _value(registry, "sglang_kvshare_reuse_ratio", dp_rank="1") == 0.5
    assert _value(registry, "sglang_kvshare_mean_gate_entropy", slot="s0", dp_rank="1") == 0.25
    # After a reset the cache counts from zero again; the Prometheus counter keeps growing.
    metrics.update(stats(1, 40, 0))
    assert _value(registry, "sglang_kvshare_requests_total", slot="s0", dp_rank="1") == 6
    assert _value(registry, "sglang_kvshare_anchors", slot="s0", dp_rank="1") == 0
    # A full reset drops the slot; counts after it are all new, even past the old total.
    metrics.update({"slots": {}, "counters": {}})
    assert _value(registry, "sglang_kvshare_anchors", slot="s0", dp_rank="1") == 0
    metrics.update(stats(7, 0, 1))
    assert _value(registry, "sglang_kvshare_requests_total", slot="s0", dp_rank="1") == 13


def test_metrics_tables_hold_only_the_slots_the_stats_hold():
    """10 000 slot names over time: the exporter's tables stay bounded, the counts stay right."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from sglang_kvshare.admin.metrics import MAX_SLOT_LABELS, OTHER_SLOT, KVShareMetrics

    registry = prometheus_client.CollectorRegistry()
    metrics = KVShareMetrics(registry=registry)
    for round_ in range(100):  # the registry keeps 100 slots at a time; older ones were evicted
        slots = {f"s{round_}-{i}": {"requests": 1, "shared_tokens_seen": 10, "fallbacks": {"no_source": 1}}
                 for i in range(100)}
        metrics.update({"slots": slots, "counters": {}})
        assert len(metrics._slot_labels) <= MAX_SLOT_LABELS
        assert len(metrics._last) <= 100 * 8  # this round's slots only (a few series each)
    samples = [s for metric in registry.collect() if metric.name == "sglang_kvshare_requests"
               for s in metric.samples if s.name == "sglang_kvshare_requests_total"]
    assert sum(s.value for s in samples) == 100 * 100  # every request counted once, across labels
    assert any(s.labels["slot"] == OTHER_SLOT for s in samples)


def test_configure_sets_head_recompute_and_staging():
    cache = FakeView()
    reply = ops.execute(cache, "configure", recompute_ratio=0.3, staged=False)
    assert reply.status == 200
    assert cache.config.recompute_ratio == 0.3 and cache.config.staged is False
    assert ops.execute(cache, "configure", recompute_ratio=-1).status == 422


def test_config_body_accepts_head_recompute_and_rejects_bad_values():
    import pytest

    from sglang_kvshare.config import ConfigError, runtime_update

    assert runtime_update(KVShareConfig(), {"min_reuse_tokens": 16, "tau": None}).min_reuse_tokens == 16
    for bad in ({"min_reuse_tokens": -1}, {"min_reuse_tokens": "8"}, {"recompute_head": 8}, {"staged": "yes"}, {"max_pools": 2}, {},
                {"tua": 0.1}):
        with pytest.raises(ConfigError):
            runtime_update(KVShareConfig(), bad)


@pytest.mark.parametrize("field, value", [("fault_perturb_slot", "query"), ("recompute_policy", "query")])
def test_no_fault_injection_and_no_row_policy_are_settings(field, value):
    """Fault injection is a test-only hook (``devtools.fault_injection``) and the head is the one row policy
    served: neither is a launch option nor a runtime setting."""
    from sglang_kvshare.config import ConfigError, runtime_update
    from sglang_kvshare.server.launcher import parse_kvshare

    with pytest.raises(ConfigError, match=field):
        runtime_update(KVShareConfig(), {field: value})
    assert ops.execute(FakeView(), "configure", **{field: value}).status == 422
    with pytest.raises(SystemExit):
        parse_kvshare([f"--kvshare-{field.replace('_', '-')}", value])
