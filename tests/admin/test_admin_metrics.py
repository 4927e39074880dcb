"""The kvshare counters on SGLang's /metrics (server started with --enable-metrics)."""

from __future__ import annotations

import re
import time

import pytest

from tests.admin.conftest import shared_text

pytestmark = pytest.mark.server


def samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in Prometheus text format."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def scrape(admin, name: str, want, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until ``want(samples)`` holds (the scheduler refreshes at most once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        found = samples(admin.get("/metrics").text, name)
        if want(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_metrics_expose_the_kvshare_counters(admin):
    admin.configure(mode="fullshared")
    admin.share(shared_text(6), slot="metrics")
    scrape(admin, "sglang_kvshare_requests_total", lambda s: True)
    label = admin.stats()["slots"]["metrics"]["metric_label"]
    assert re.fullmatch(r"s\d+", label), label  # a bounded id, never the name a client chose
    mine = f'slot="{label}"'
    base = samples(admin.get("/metrics").text, "sglang_kvshare_resolved_tokens_total")
    aligned_before = sum(v for k, v in base.items() if 'by="alignment"' in k and mine in k)

    segment = admin.share(shared_text(7), slot="metrics")["segments"][1]
    assert segment["resolved_by"] == "alignment", segment

    reused = segment["resolved_tokens"]  # the rows reused (a recomputed head is prefilled)
    resolved = scrape(admin, "sglang_kvshare_resolved_tokens_total",
                      lambda s: sum(v for k, v in s.items() if 'by="alignment"' in k and mine in k)
                      >= aligned_before + reused)
    aligned = sum(v for k, v in resolved.items() if 'by="alignment"' in k and mine in k)
    assert reused > 0 and aligned == aligned_before + reused, resolved
    assert 'slot="metrics"' not in admin.get("/metrics").text

    text = admin.get("/metrics").text
    requests_total = samples(text, "sglang_kvshare_requests_total")
    assert any(mine in k and v >= 2 for k, v in requests_total.items()), requests_total
    assert samples(text, "sglang_kvshare_shared_tokens_total")
    assert samples(text, "sglang_kvshare_events_total")
    for gauge in ("sglang_kvshare_reuse_ratio", "sglang_kvshare_tau", "sglang_kvshare_pool_bytes"):
        assert samples(text, gauge), gauge
    modes = samples(text, "sglang_kvshare_mode")
    assert any('mode="fullshared"' in k and v == 1 for k, v in modes.items()), modes


def test_metrics_follow_a_config_change(admin):
    admin.configure(mode="fullshared", tau=0.42)
    tau = scrape(admin, "sglang_kvshare_tau", lambda s: 0.42 in s.values())
    assert 0.42 in tau.values(), tau
    admin.configure(tau=0.3)
