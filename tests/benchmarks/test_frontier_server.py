"""``python -m benchmarks.frontier`` end to end on real servers, at the smallest size (one arm pair)."""

from __future__ import annotations

import json

import pytest

from benchmarks import frontier

pytestmark = [
    pytest.mark.server,
]


def test_frontier_retrieval_off_and_fullshared(tmp_path):
    frontier.main(["--task", "retrieval", "--limit", "2", "--warmup", "0", "--heads", "0", "--mix",
                   "--arms", "off,fullshared_k0", "--concurrency", "2", "--out-dir", str(tmp_path),
                   "--no-progress"])
    out = json.loads((tmp_path / "frontier_retrieval.json").read_text())
    assert out["complete"] and (tmp_path / "frontier_retrieval.png").stat().st_size > 0
    off, full = out["arms"]["off"], out["arms"]["fullshared_k0"]
    assert off["scored_items"] == full["scored_items"] == 6  # 2 samples x 3 consumer lookups
    # The reference is consistent with itself: off's teacher-forced argmax is its own greedy token.
    assert off["teacher_forced_top1_vs_off_greedy_tokens"] >= 0.95
    assert off["agreement_final"] == 1.0 and off["teacher_forced_kl"] == pytest.approx(0.0, abs=1e-9)
    assert off["reuse_ratio"] == 0.0
    # fullshared reuses the document for every consumer and is compared on the same positions.
    assert full["reuse_ratio"] > 0.8
    assert full["teacher_forced_positions"] == off["teacher_forced_positions"] > 0
    assert full["teacher_forced_reuse_ratio"] > 0.8
    assert full["teacher_forced_kl"] >= 0.0 and 0.0 <= full["teacher_forced_top1"] <= 1.0
    assert full["accuracy_vs_off_paired"]["n"] == 6
