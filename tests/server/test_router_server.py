"""Workflow affinity across servers: two kvshare servers behind SGLang's router (``--policy manual``).

Each server has its own tree and pools, so agent B reuses agent A's copy of the
shared text only where A left it. The routing header the client library sets
for a named workflow (``X-SMG-Routing-Key``) pins the workflow to one server;
requests without it are spread over both.
"""

from __future__ import annotations

import json

import pytest
import requests

from sglang_kvshare.routing import routing_headers
from tests.agent_chain import agent_request, context, report, warm_request
from tests.servers import clean, shared_server, small_pool_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def fleet(server_pool):
    """The router in front of two kvshare servers the suite runs anyway (no start of their own): the shared
    one and the soak's, both fullshared, reusing whole segments of any length, the guard off; the router is
    stopped after this module and the soak's server set back."""
    from devtools.router_process import RouterProcess

    first = shared_server(server_pool)
    clean(first)
    try:
        with small_pool_server(server_pool, recompute_ratio=0.0, min_reuse_tokens=0, verify_rate=0.0) as second:
            with RouterProcess([first.url, second.url]) as router:
                yield router, [first, second]
    finally:
        clean(first)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _post(router, ids, custom_params, workflow):
    if workflow is not None:  # what the client library sends for a named workflow
        ann = json.loads(custom_params["kvshare"])
        ann["workflow"] = workflow
        custom_params = {"kvshare": json.dumps(ann)}
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0,
                                                  "custom_params": custom_params}}
    # The router drops custom_params: the annotation travels in custom_labels too (the client library sends it
    # for a named workflow; a request without one carries it here so the servers' stats can count it).
    body["custom_labels"] = custom_params
    r = requests.post(router.url + "/generate", json=body, headers=routing_headers(workflow), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _b_reused(router, tokenizer, text: str, workflow) -> int:
    for ids, cp in (warm_request(tokenizer, "solver"), warm_request(tokenizer, "analyst"),
                    agent_request(tokenizer, "solver", text)):
        _post(router, ids, cp, workflow)
    ids, cp = agent_request(tokenizer, "analyst", text)
    return report(_post(router, ids, cp, workflow))["shared_tokens_reused"]


def _seen(servers) -> list[int]:
    return [requests.get(s.url + "/kvshare/stats", timeout=60).json()["shared_tokens_seen"] for s in servers]


def test_a_workflow_pinned_by_the_router_reuses_on_its_server(fleet, tokenizer):
    router, servers = fleet
    texts = [context(120 + 3 * i, 2) for i in range(4)]
    shared = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
    before = _seen(servers)
    reused = [_b_reused(router, tokenizer, t, f"crew-{i}") for i, t in enumerate(texts)]
    assert reused == shared  # every B met A's copy on the server its workflow is pinned to
    grew = [a - b for a, b in zip(_seen(servers), before)]
    assert sum(grew) == 2 * sum(shared)  # A's and B's segments, each seen once by one server


def test_requests_without_a_key_are_spread_over_both_servers(fleet, tokenizer):
    router, servers = fleet
    before = _seen(servers)
    for i in range(10):
        ids, cp = agent_request(tokenizer, "solver", context(140 + i, 1))
        _post(router, ids, cp, None)
    grew = [a - b for a, b in zip(_seen(servers), before)]
    assert all(n > 0 for n in grew), grew
