"""benchmarks.kernels runs on CPU and writes one JSON row per op and shape."""

from __future__ import annotations

import json

import pytest

REQUIRED = {"kernel", "device", "seconds", "bytes_moved", "gbps", "ratio_to_prefill"}


def test_benchmark_smoke(tmp_path):
    bench = pytest.importorskip("benchmarks.kernels")
    out = tmp_path / "k.json"
    bench.main(["--lengths", "16", "--repeats", "1", "--prefill-repeats", "1", "--anchors", "2", "--rank", "8",
                "--random-weights", "--device", "cpu", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["fused_path"] == "torch-reference" and "not a Triton kernel" in data["meta"]["note"]
    kernels = {row["kernel"] for row in data["rows"]}
    assert {"align_correct", "align_only", "align_correct_torch_unfused", "gate_sq_distances",
            "token_distances"} <= kernels
    for row in data["rows"]:
        assert REQUIRED <= row.keys() and row["seconds"] > 0 and row["ratio_to_prefill"] > 0
