"""Workflow affinity and one admin view in a live server with two DP workers (``--dp-size 2``, the real model).

SGLang's default DP balancing is round robin, so agent B's request lands on
the other worker than agent A's just before it, where A's copy of the shared
text is not: no reuse. Named by its workflow, every request of a workflow
lands on one worker, where B finds A's copy.
"""

from __future__ import annotations

import json

import pytest
import requests

from tests.agent_chain import agent_request, context, report, warm_request

pytestmark = pytest.mark.server

DP2 = ("--dp-size", "2", "--max-total-tokens", "4096", "--enable-metrics")
# Whole segments of any length are reused (the test counts B's reused tokens against the segment's).
KVSHARE = ("--kvshare-mode", "fullshared", "--kvshare-learn-async", "false", "--kvshare-verify-rate", "0",
           "--kvshare-recompute-ratio", "0", "--kvshare-min-reuse-tokens", "0", "--kvshare-admin-open", "true")


@pytest.fixture(scope="module")
def dp_server(model_path):
    """Stopped after this module, not kept for the session: SGLang's DP controller polls its sockets and keeps a
    core busy the whole time, which on 2 cores would slow every later test."""
    from devtools.server_process import ServerProcess

    with ServerProcess(model_path=model_path, kvshare_args=KVSHARE, extra_args=DP2, startup_timeout=600.0) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _in_workflow(custom_params: dict, workflow: str | None) -> dict:
    if workflow is None:
        return custom_params
    ann = json.loads(custom_params["kvshare"])
    ann["workflow"] = workflow
    return {"kvshare": json.dumps(ann)}


def _b_reused(server, tokenizer, text: str, workflow: str | None) -> int:
    """Both agents' prompts warmed, A reads ``text``, then B: the shared tokens B got without prefill."""
    for ids, cp in (warm_request(tokenizer, "solver"), warm_request(tokenizer, "analyst"),
                    agent_request(tokenizer, "solver", text)):
        server.generate(input_ids=ids, custom_params=_in_workflow(cp, workflow), max_new_tokens=1)
    ids, cp = agent_request(tokenizer, "analyst", text)
    out = server.generate(input_ids=ids, custom_params=_in_workflow(cp, workflow), max_new_tokens=1)
    return report(out)["shared_tokens_reused"]


def test_a_workflows_agents_meet_on_one_worker_and_reuse(dp_server, tokenizer):
    texts = [context(60 + 3 * i, 2) for i in range(4)]
    shared = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
    with_key = [_b_reused(dp_server, tokenizer, t, f"team-{i}") for i, t in enumerate(texts[:2])]
    without = [_b_reused(dp_server, tokenizer, t, None) for t in texts[2:]]
    assert with_key == shared[:2]  # every B found A's copy on their worker
    # Round robin: four requests per pair, so A and B always alternate workers: B finds no copy.
    assert sum(without) < sum(shared[2:]) / 2, without


def test_a_rank_the_server_does_not_have_is_a_clear_client_error(dp_server, tokenizer):
    ids, cp = agent_request(tokenizer, "solver", context(80, 1))
    body = {"input_ids": ids, "routed_dp_rank": 5, "sampling_params": {"max_new_tokens": 1, "custom_params": cp}}
    r = requests.post(dp_server.url + "/generate", json=body, timeout=120)
    assert 400 <= r.status_code < 500 and "routed_dp_rank" in r.text
    # The annotation's workflow must be a string: the request is refused, the server keeps serving.
    ann = json.loads(cp["kvshare"])
    ann["workflow"] = 7
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "custom_params": {"kvshare": json.dumps(ann)}}}
    r = requests.post(dp_server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 400 and "workflow" in r.text
    assert dp_server.generate(input_ids=ids, custom_params=cp, max_new_tokens=1)["meta_info"]


def test_the_admin_routes_see_and_reach_both_workers(dp_server, tokenizer):
    url = dp_server.url
    before = requests.get(url + "/kvshare/stats", timeout=120).json()
    assert before["dp_size"] == 2 and [r["dp_rank"] for r in before["ranks"]] == [0, 1]
    for i in range(4):  # no workflow: SGLang's round robin spreads them over both workers
        ids, cp = agent_request(tokenizer, "solver", context(40 + i, 1))
        dp_server.generate(input_ids=ids, custom_params=cp, max_new_tokens=1)
    after = requests.get(url + "/kvshare/stats", timeout=120).json()
    grew = [a["shared_tokens_seen"] - b["shared_tokens_seen"] for a, b in zip(after["ranks"], before["ranks"])]
    assert all(n > 0 for n in grew), grew
    assert after["shared_tokens_seen"] == sum(r["shared_tokens_seen"] for r in after["ranks"])
    # A write reaches every worker, and the merged view shows it once.
    r = requests.post(url + "/kvshare/config", json={"tau": 0.42}, timeout=120)
    assert r.status_code == 200, r.text
    assert [x["dp_rank"] for x in r.json()["ranks"]] == [0, 1] and r.json()["config"]["tau"] == 0.42
    stats = requests.get(url + "/kvshare/stats", timeout=120).json()
    assert stats["config"]["tau"] == 0.42 and "config_differs_on_ranks" not in stats
    pools = requests.get(url + "/kvshare/pools", timeout=120)
    assert pools.status_code == 200 and "pools" in pools.json()
    r = requests.post(url + "/kvshare/pools/no-such-slot/reset", timeout=120)
    assert r.status_code == 404 and [x["status"] for x in r.json()["ranks"]] == [404, 404]
    r = requests.post(url + "/kvshare/config", json={"tau": "high"}, timeout=120)
    assert r.status_code == 422  # refused before any worker sees it
    assert requests.post(url + "/kvshare/reset", timeout=120).status_code == 200
    # Prometheus: the counters add up over both workers; each worker's reuse ratio is its own series.
    text = requests.get(url + "/metrics", timeout=60).text
    ratios = [line for line in text.splitlines() if line.startswith("sglang_kvshare_reuse_ratio{")]
    assert {'dp_rank="0"' in line for line in ratios} == {True, False} and len(ratios) == 2, ratios
    totals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("sglang_kvshare_shared_tokens_total{")]
    assert sum(totals) >= after["shared_tokens_seen"]
