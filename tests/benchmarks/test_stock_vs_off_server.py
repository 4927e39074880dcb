"""``benchmarks.stock_vs_off``'s paired requests on the suite's real ``off`` and stock servers.

Behaviour, not timing: both servers get the same requests, neither answers from
its cache (the comparison would be void), and the batch rounds produce every
output token they ask for. The 2 % verdict itself is tested on fixed ratios in
``test_stock_vs_off.py``.
"""

from __future__ import annotations

import math

import pytest
import requests
from transformers import AutoTokenizer

from benchmarks.stock_vs_off import throughput_round, ttft_pair
from tests.servers import OFF

pytestmark = [pytest.mark.server]


def test_pairs_send_the_same_uncached_requests_to_both_servers(server_pool, model_path):
    servers = {"stock": server_pool("stock", stock=True), "off": server_pool("off", kvshare_args=OFF)}
    for server in servers.values():
        requests.post(server.url + "/flush_cache", timeout=120).raise_for_status()
    urls = {arm: s.url for arm, s in servers.items()}
    tok = AutoTokenizer.from_pretrained(str(model_path))

    pairs = [ttft_pair(urls, tok, 128, i) for i in range(2)]
    assert [p["order"] for p in pairs] == [["stock", "off"], ["off", "stock"]]
    for p in pairs:
        # The whole prompt was prefilled on both sides, so the two TTFTs measure the same work.
        assert p["stock_prefill_tokens"] == p["off_prefill_tokens"] > 128
        assert p["stock"] > 0 and p["off"] > 0 and math.isfinite(p["ratio"]) and p["ratio"] > 0

    row = throughput_round(urls, tok, batch=2, length=64, out_tokens=4, r=1)
    assert row["order"] == ["off", "stock"]
    for arm in ("stock", "off"):
        assert row[arm]["output_tokens"] == 2 * 4  # EOS ignored: every asked-for token comes back
        assert row[arm]["prompt_tokens"] == 2 * 64
    assert row["ratio"] > 0
