"""The guard's Prometheus series: per-scope estimates with bounded labels, counters that only grow."""

from __future__ import annotations

import prometheus_client

from sglang_kvshare.guard.controller import DENSE, Controller, ladder
from sglang_kvshare.guard.measure import RequestFidelity
from sglang_kvshare.guard.metrics import MAX_SCOPE_LABELS, GuardMetrics
from sglang_kvshare.guard.target import FidelityTarget


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def _export(metrics, controller, counters=None):
    scopes = controller.scopes()
    metrics.update({str(s): v for s, v in scopes.items()}, {str(s): controller.setting(s) for s in scopes},
                   counters or {}, dict(controller.counters), 3)


def test_estimates_settings_and_actions_per_scope():
    registry = prometheus_client.CollectorRegistry()
    metrics = GuardMetrics(registry=registry)
    controller = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=2)
    for top1 in (0.5, 0.4):  # far below the target: straight to dense
        controller.observe("judge", 0, RequestFidelity(top1=top1, kl=0.3, positions=8))
    for top1 in (1.0, 0.98, 0.99):
        controller.observe("worker", 0, RequestFidelity(top1=top1, kl=0.001, positions=8))
    _export(metrics, controller, {"verified": 5})
    assert _value(registry, "sglang_kvshare_guard_setting_head", scope="judge") == DENSE
    assert _value(registry, "sglang_kvshare_guard_setting_head", scope="worker") == 0
    assert abs(_value(registry, "sglang_kvshare_guard_top1", scope="worker", bound="mean") - 0.99) < 1e-9
    low = _value(registry, "sglang_kvshare_guard_top1", scope="worker", bound="low")
    high = _value(registry, "sglang_kvshare_guard_top1", scope="worker", bound="high")
    assert low < 0.99 < high
    # the judge's estimates started afresh at its move: no series until two new samples
    assert _value(registry, "sglang_kvshare_guard_top1", scope="judge", bound="mean") is None
    assert _value(registry, "sglang_kvshare_guard_actions_total", reason="target_missed") == 1
    assert _value(registry, "sglang_kvshare_guard_events_total", event="verified") == 5
    assert _value(registry, "sglang_kvshare_guard_queue_jobs") == 3
    _export(metrics, controller, {"verified": 5})  # nothing new: counters unchanged
    assert _value(registry, "sglang_kvshare_guard_events_total", event="verified") == 5


def test_label_sets_stay_bounded_and_stale_scopes_leave():
    registry = prometheus_client.CollectorRegistry()
    metrics = GuardMetrics(registry=registry)
    controller = Controller(None, ladder(0), min_samples=2)
    for i in range(MAX_SCOPE_LABELS + 10):
        for _ in range(2):
            controller.observe(f"agent-{i}", 0, RequestFidelity(top1=1.0, kl=0.0, positions=4))
        _export(metrics, controller)
    scopes = {s.labels["scope"] for fam in registry.collect() if fam.name == "sglang_kvshare_guard_samples"
              for s in fam.samples}
    assert len(scopes) == MAX_SCOPE_LABELS
    assert "agent-0" not in scopes and f"agent-{MAX_SCOPE_LABELS + 9}" in scopes
    assert _value(registry, "sglang_kvshare_guard_top1", scope="agent-0", bound="mean") is None
