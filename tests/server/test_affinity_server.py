"""Workflow affinity in a live server with two DP workers (``--dp-size 2``, the real model).

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

DP2 = ("--dp-size", "2", "--max-total-tokens", "4096")
KVSHARE = ("--kvshare-mode", "fullshared", "--kvshare-learn-async", "false", "--kvshare-verify-rate", "0")


@pytest.fixture(scope="module")
def dp_server(model_path):
    """Stopped after this module, not kept for the session: SGLang's DP controller polls its sockets and keeps a
    core busy the whole time, which on 2 cores would slow every later test."""
    from devtools.server_process import ServerProcess

    with ServerProcess(model_path=model_path, kvshare_args=KVSHARE, extra_args=DP2) as server:
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
    texts = [context(60 + 3 * i, 2) for i in range(6)]
    shared = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
    with_key = [_b_reused(dp_server, tokenizer, t, f"team-{i}") for i, t in enumerate(texts[:3])]
    without = [_b_reused(dp_server, tokenizer, t, None) for t in texts[3:]]
    assert with_key == shared[:3]  # every B found A's copy on their worker
    # Round robin: four requests per pair, so A and B always alternate workers: B finds no copy.
    assert sum(without) < sum(shared[3:]) / 2, without


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
