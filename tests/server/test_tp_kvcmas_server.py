"""kvcmas under tensor parallelism in a live server: TP=3, the real model (3 KV heads: one per rank).

Each rank learns the anchors of its own head and the gate reduces the ranks'
distances, so every rank must take every decision alike: the test compares the
ranks' decision counts and digests after corrections, aborted requests and a
runtime mode switch, and checks that no rank hangs.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.agent_chain import agent_request, context, report, warm_request
from tests.servers import TP3_LAUNCH

pytestmark = pytest.mark.server

AGENTS = ("solver", "analyst", "coder")


@pytest.fixture(scope="module")
def tp_server(server_pool):
    """Started in the background early (``tests.servers.TP3_LAUNCH``), stopped after this module: three scheduler
    ranks on two cores slow every other test."""
    server = server_pool("tp3", **TP3_LAUNCH)
    try:
        yield server
    finally:
        server_pool.release("tp3", **TP3_LAUNCH)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _stats(server) -> dict:
    r = requests.get(server.url + "/kvshare/stats", timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _tp_ranks(server) -> list[dict]:
    ranks = _stats(server)["ranks"]
    assert len(ranks) == 1 and len(ranks[0]["tp_ranks"]) == 3, ranks
    return ranks[0]["tp_ranks"]


def _chain(server, tokenizer, text: str) -> list[dict]:
    """The agents read ``text`` one after the other (each behind its own warmed prompt); their reports."""
    out = []
    for agent in AGENTS:
        ids, cp = agent_request(tokenizer, agent, text)
        out.append(report(server.generate(input_ids=ids, custom_params=cp, max_new_tokens=2)))
    return out


def test_every_rank_takes_every_gate_decision_alike(tp_server, tokenizer):
    for agent in AGENTS:
        ids, cp = warm_request(tokenizer, agent)
        tp_server.generate(input_ids=ids, custom_params=cp, max_new_tokens=1)
    reports = [_chain(tp_server, tokenizer, context(200 + 2 * i, 2)) for i in range(3)]
    corrected = sum(r["tokens_corrected"] for chain in reports for r in chain)
    assert corrected > 0, reports[-1]  # the pools learned on every rank and the gate accepted
    ranks = _tp_ranks(tp_server)
    assert {r["tp_rank"] for r in ranks} == {0, 1, 2}
    assert ranks[0]["gate_decisions"] > 0
    assert len({(r["gate_decisions"], r["gate_digest"], r["anchors"]) for r in ranks}) == 1, ranks


def _abort_soon(url: str, rid: str) -> None:
    time.sleep(0.3)
    requests.post(url + "/abort_request", json={"rid": rid}, timeout=60)


def test_aborts_and_a_mode_switch_leave_the_ranks_in_step(tp_server, tokenizer):
    url = tp_server.url
    for i in range(1, 4):  # 1: an abort; 2: fullshared; 3: an abort, then kvcmas again
        text = context(240 + 2 * i, 2)
        if i in (1, 3):  # a long answer, aborted while it runs
            ids, cp = agent_request(tokenizer, "coder", text)
            rid = f"tp-abort-{i}"
            aborter = threading.Thread(target=_abort_soon, args=(url, rid))
            aborter.start()
            tp_server.generate(input_ids=ids, custom_params=cp, max_new_tokens=200, rid=rid)
            aborter.join()
        if i == 2:
            r = requests.post(url + "/kvshare/config", json={"mode": "fullshared"}, timeout=120)
            assert r.status_code == 200, r.text
        if i == 3:
            r = requests.post(url + "/kvshare/config", json={"mode": "kvcmas"}, timeout=120)
            assert r.status_code == 200, r.text
        _chain(tp_server, tokenizer, text)
    ranks = _tp_ranks(tp_server)
    assert len({(r["gate_decisions"], r["gate_digest"], r["anchors"]) for r in ranks}) == 1, ranks
    assert tp_server.generate(input_ids=warm_request(tokenizer, "solver")[0], max_new_tokens=1)["meta_info"]
