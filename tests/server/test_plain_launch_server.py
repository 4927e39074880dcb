"""A plain launch serves the recommended path: ``fullshared`` with the 15 % recompute share, the length rule, and
the guard measuring at its default rate, whichever launcher started it."""

from __future__ import annotations

import math

import pytest
import requests

from sglang_kvshare.config import KVShareConfig
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part
from sglang_kvshare.server.launcher import parse_kvshare
from tests.servers import PLAIN_LAUNCH


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def test_our_launcher_without_kvshare_options_exports_the_recommended_defaults():
    config, rest = parse_kvshare(["--model-path", "m"])
    assert config == KVShareConfig() and rest == ["--model-path", "m"]
    assert (config.mode, config.recompute_ratio, config.min_reuse_tokens) == ("fullshared", 0.15, 256)
    assert config.verify_rate == 0.05


def _agent(tok, agent: str, shared_ids: list[int]):
    return build_request(tok, agent, [private_part(f"<|im_start|>system\nYou are the {agent}.<|im_end|>\n"
                                                   "<|im_start|>user\n"),
                                      shared_part(shared_ids, "doc"),
                                      private_part("<|im_end|>\n<|im_start|>assistant\n")])


@pytest.mark.server
def test_sglang_launch_server_selecting_the_backend_serves_the_defaults(server_pool, tokenizer):
    """``python -m sglang.launch_server --radix-cache-backend kvshare`` and nothing else: the stats say fullshared,
    0.15, 256 and the guard's rate; a 300-token shared segment is reused with its first 15 % recomputed, a 40-token
    one is prefilled (``short_segment``)."""
    server = server_pool("plain-backend", **PLAIN_LAUNCH)
    config = requests.get(server.url + "/kvshare/stats", timeout=30).json()["config"]
    assert (config["mode"], config["recompute_ratio"], config["min_reuse_tokens"], config["verify_rate"]) == (
        "fullshared", 0.15, 256, 0.05)
    words = tokenizer(" ".join(f"item{i} costs {i % 7} coins." for i in range(80)), add_special_tokens=False).input_ids
    assert len(words) >= 440
    for n, reused in ((300, True), (40, False)):
        doc = words[:n] if reused else words[400:400 + n]  # distinct contents
        for agent in ("writer", "reader"):
            ids, cp = _agent(tokenizer, agent + str(n), doc)
            out = requests.post(server.url + "/generate", timeout=300, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "custom_params": cp}}).json()
        rep = out["meta_info"]["kvshare"][0]
        seg = rep["segments"][1]
        if reused:
            assert seg["resolved_by"] == "alignment" and seg["head_recomputed"] == math.ceil(0.15 * n)
        else:
            assert seg["resolved_by"] == "dense" and {"segment": 1, "slot": "doc", "reason": "short_segment"} in \
                rep["fallbacks"]
