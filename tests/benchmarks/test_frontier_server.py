"""``python -m benchmarks.frontier`` end to end on real servers, at the smallest size (one arm pair).

The arms run on the suite's shared servers (``off`` and the fullshared one,
reconfigured and emptied for the arm) instead of the benchmark's fresh server
per arm: two server starts fewer; what differs, the launch, is tested elsewhere.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import requests

from benchmarks import frontier
from tests.servers import OFF, reconfigured, shared_server

pytestmark = [
    pytest.mark.server,
]


def test_frontier_retrieval_off_and_fullshared(tmp_path, server_pool):
    @contextmanager
    def pooled(arm: frontier.Arm, _model_path: str):
        if arm.mode == "off":
            server = server_pool("off", kvshare_args=OFF)
            requests.post(server.url + "/flush_cache", timeout=120).raise_for_status()
            yield server.url
            return
        with reconfigured(shared_server(server_pool), mode=arm.mode,
                          recompute_ratio=arm.recompute_ratio, min_reuse_tokens=arm.min_reuse) as server:
            yield server.url

    frontier.main(["--task", "retrieval", "--limit", "2", "--warmup", "0", "--heads", "0", "--mix",
                   "--arms", "off,fullshared_k0", "--concurrency", "2", "--out-dir", str(tmp_path),
                   "--no-progress"], arm_server=pooled)
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
