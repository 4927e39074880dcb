"""The guard's Prometheus series: per-scope estimates on a fixed set of slot labels (bounded in prometheus_client's
multiprocess mode too, where a label set once written stays), no client-chosen string in a label, counters that
only grow."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import prometheus_client

from sglang_kvshare.guard.controller import DENSE, Controller, ladder
from sglang_kvshare.guard.measure import RequestFidelity
from sglang_kvshare.guard.metrics import MAX_SCOPE_LABELS, GuardMetrics
from sglang_kvshare.guard.target import FidelityTarget


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def _export(metrics, controller, counters=None):
    scopes = controller.scopes()
    metrics.update(scopes, {s: controller.setting(s) for s in scopes}, counters or {}, dict(controller.counters), 3)


def test_estimates_settings_and_actions_per_scope_slot():
    registry = prometheus_client.CollectorRegistry()
    metrics = GuardMetrics(registry=registry)
    controller = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=2)
    for top1 in (0.5, 0.4):  # far below the target: straight to dense
        controller.observe("judge", 0, RequestFidelity(top1=top1, kl=0.3, positions=8))
    for top1 in (1.0, 0.98, 0.99):
        controller.observe("worker", 0, RequestFidelity(top1=top1, kl=0.001, positions=8))
    _export(metrics, controller, {"verified": 5})
    judge, worker = str(metrics.slot("judge")), str(metrics.slot("worker"))
    assert judge != worker
    assert _value(registry, "sglang_kvshare_guard_setting_head", slot=judge) == DENSE
    assert _value(registry, "sglang_kvshare_guard_setting_head", slot=worker) == 0
    assert abs(_value(registry, "sglang_kvshare_guard_top1", slot=worker, bound="mean") - 0.99) < 1e-9
    low = _value(registry, "sglang_kvshare_guard_top1", slot=worker, bound="low")
    high = _value(registry, "sglang_kvshare_guard_top1", slot=worker, bound="high")
    assert low < 0.99 < high
    # the judge's estimates started afresh at its move: NaN until two new samples
    assert math.isnan(_value(registry, "sglang_kvshare_guard_top1", slot=judge, bound="mean"))
    assert _value(registry, "sglang_kvshare_guard_actions_total", reason="target_missed") == 1
    assert _value(registry, "sglang_kvshare_guard_events_total", event="verified") == 5
    assert _value(registry, "sglang_kvshare_guard_queue_jobs") == 3
    _export(metrics, controller, {"verified": 5})  # nothing new: counters unchanged
    assert _value(registry, "sglang_kvshare_guard_events_total", event="verified") == 5


def test_slots_stay_bounded_a_scope_keeps_its_slot_and_a_slot_left_empty_reads_nan():
    registry = prometheus_client.CollectorRegistry()
    metrics = GuardMetrics(registry=registry)
    controller = Controller(None, ladder(0), min_samples=2)
    for i in range(MAX_SCOPE_LABELS + 10):
        for _ in range(2):
            controller.observe(f"agent-{i}", 0, RequestFidelity(top1=1.0, kl=0.0, positions=4))
        _export(metrics, controller)
        if i == 5:
            kept = metrics.slot("agent-5")
    assert metrics.slot("agent-0") is None and metrics.slot("agent-5") is None
    assert metrics.slot(f"agent-{MAX_SCOPE_LABELS + 9}") is not None
    slots = {s.labels["slot"] for fam in registry.collect() if fam.name == "sglang_kvshare_guard_samples"
             for s in fam.samples}
    assert slots == {str(i) for i in range(MAX_SCOPE_LABELS)}
    last = f"agent-{MAX_SCOPE_LABELS + 9}"
    slot_of_last = metrics.slot(last)
    metrics.update({last: controller.scopes()[last]}, {last: 0}, {}, {}, 0)  # every other scope has gone
    assert metrics.slot(last) == slot_of_last  # a scope keeps its slot
    assert math.isnan(_value(registry, "sglang_kvshare_guard_samples", slot=str(kept)))
    assert _value(registry, "sglang_kvshare_guard_samples", slot=str(slot_of_last)) == 2


MULTIPROCESS = textwrap.dedent("""
    import sys
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from sglang_kvshare.guard.metrics import GuardMetrics

    metrics = GuardMetrics(registry=CollectorRegistry())  # values go to the multiprocess files
    state = {"setting": "head0", "pinned": False, "samples": 3,
             "top1": {"n": 3, "mean": 0.99, "ci95": [0.98, 1.0]}, "kl": {"n": 3, "mean": 0.01, "ci95": [0.0, 0.02]}}
    for round_ in range(10):  # ten rounds of 32 new scopes
        names = [f"client-agent-{round_}-{i}" for i in range(32)]
        metrics.update({n: state for n in names}, {n: 0 for n in names}, {"verified": 32 * (round_ + 1)}, {}, 0)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=sys.argv[1])
    sys.stdout.write(generate_latest(registry).decode())
""")


def test_series_stay_bounded_in_multiprocess_mode_and_carry_no_client_string(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    text = subprocess.run([sys.executable, "-c", MULTIPROCESS, str(tmp_path)], env=env, capture_output=True,
                          text=True, check=True, timeout=120).stdout
    series = [line for line in text.splitlines() if line.startswith("sglang_kvshare_guard_samples{")]
    assert 0 < len(series) <= MAX_SCOPE_LABELS, series[:5]
    guard_series = [line for line in text.splitlines() if line.startswith("sglang_kvshare_guard_")]
    assert len(guard_series) <= 8 * MAX_SCOPE_LABELS + 2  # top1 and kl x 3 bounds, samples, setting; queue, events
    assert "client-agent" not in text
    assert 'sglang_kvshare_guard_events_total{event="verified"} 320.0' in text
