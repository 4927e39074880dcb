"""``benchmarks.research.assembly_cost`` at the smallest size: it runs the server's calls and writes every phase."""

from __future__ import annotations

import json

from benchmarks.research import assembly_cost


def test_assembly_cost_smoke_times_every_phase_of_an_accepted_plan(tmp_path):
    out = tmp_path / "assembly_cost.json"
    assert assembly_cost.main(["--lengths", "48", "--anchors", "2", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["length"] == 48 and row["anchors"] == 2
    for phase in assembly_cost.PHASES:
        assert row[phase]["median_s"] > 0, phase
    parts = sum(row[p]["median_s"] for p in ("read", "estimate", "plan_args", "write"))
    assert abs(row["corrected_total_s"] - parts) < 1e-12
