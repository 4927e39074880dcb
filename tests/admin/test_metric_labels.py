"""The per-slot series of /metrics (served without a key) carry bounded ids, never the slot names clients chose,
and stay bounded in prometheus_client's multiprocess mode, where a series once written is never removed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_slot_series_stay_bounded_and_carry_no_client_name_in_multiprocess_mode(tmp_path):
    script = textwrap.dedent("""
        import re
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        from sglang_kvshare.admin.metrics import MAX_SLOT_LABELS, KVShareMetrics

        metrics = KVShareMetrics(registry=CollectorRegistry())
        for round_ in range(10):  # each round, 40 new slot names replace the last round's
            slots = {f"tenant-doc-{round_}-{i}": {"requests": 1, "shared_tokens_seen": 8, "resolved_alignment": 8,
                                                  "fallbacks": {"no_source": 1}, "anchors": 1}
                     for i in range(40)}
            metrics.update({"slots": slots, "counters": {}})
            assert all(re.fullmatch(r"s\\d+", s["metric_label"]) for s in slots.values())
        merged = CollectorRegistry()
        MultiProcessCollector(merged)
        text = generate_latest(merged).decode()
        assert "tenant-doc" not in text
        labels = {m for line in text.splitlines() if line.startswith("sglang_kvshare_requests_total{")
                  for m in re.findall(r'slot="([^"]+)"', line)}
        print(len(labels), MAX_SLOT_LABELS)
    """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seen, bound = map(int, out.stdout.split())
    assert 0 < seen <= bound
