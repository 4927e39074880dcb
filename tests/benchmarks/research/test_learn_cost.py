"""``benchmarks.research.learn_cost`` at the smallest size: it runs, writes its JSON, and the exact methods are optimal."""

from __future__ import annotations

import json

from benchmarks.research import learn_cost


def test_learn_cost_smoke_writes_rows_and_exact_methods_match_svd(tmp_path):
    out = tmp_path / "learn_cost.json"
    assert learn_cost.main(["--lengths", "80", "--repeats", "1", "--methods", "svd", "gram", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"svd", "gram"} and data["shapes"]["rank"] == 32
    assert rows["svd"]["residual_over_svd"] == 1.0
    assert abs(rows["gram"]["residual_over_svd"] - 1.0) < 1e-3
    assert rows["gram"]["with_base"]["median_s"] > 0 and rows["gram"]["deltas_only"]["median_s"] > 0
