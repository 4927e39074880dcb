"""The sparse extend in a live server (torch_native, the real model): one forward, the staged head's KV."""

from __future__ import annotations

import math

import pytest
import requests

from tests.agent_chain import agent_request, context, report, warm_request
from tests.servers import reconfigured, shared_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _second_agent(server, tokenizer, text: str, head: int = 0) -> dict:
    """Agent A reads ``text`` (dense), then agent B reads it behind its own prompt (reused); B's output.

    B's system prompt is in the tree first (an exact hit), so no stage is needed for it.
    """
    ids, cp = agent_request(tokenizer, "solver", text)
    server.generate(input_ids=ids, custom_params=cp, max_new_tokens=1)
    ids, cp = warm_request(tokenizer, "analyst")
    server.generate(input_ids=ids, custom_params=cp, max_new_tokens=1)
    ids, cp = agent_request(tokenizer, "analyst", text, head=head)
    return server.generate(input_ids=ids, custom_params=cp, max_new_tokens=6, return_logprob=True,
                           top_logprobs_num=5)


def _counters(server) -> dict:
    return requests.get(server.url + "/kvshare/stats", timeout=60).json()["counters"]


def _first_logprobs(out: dict) -> dict[int, float]:
    return {tok: lp for lp, tok, _ in out["meta_info"]["output_top_logprobs"][0]}


def _query_len(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_a_sparse_head_takes_one_forward_and_gives_the_staged_heads_output(server_pool, tokenizer):
    text = context(24, 3)
    with reconfigured(shared_server(server_pool), sparse_extend=False) as server:
        staged = _second_agent(server, tokenizer, text, head=8)
    with reconfigured(shared_server(server_pool)) as server:
        before = _counters(server)
        sparse = _second_agent(server, tokenizer, text, head=8)
        after = _counters(server)
    # Per phase in the stats (the server is shared: counted as differences).
    assert after.get("sparse_forwards", 0) - before.get("sparse_forwards", 0) == 1
    assert after.get("sparse_rows_recomputed", 0) - before.get("sparse_rows_recomputed", 0) == 8
    assert after["sparse_fold_seconds"] >= before.get("sparse_fold_seconds", 0)
    rs, rp = report(staged), report(sparse)
    assert rs["recompute"] == "staged" and rs["prefill_forwards"] == 2 and rs["tokens_sparse_recomputed"] == 0
    assert rp["recompute"] == "sparse" and rp["prefill_forwards"] == 1 and rp["tokens_sparse_recomputed"] == 8
    assert "sparse_fallback" not in rp
    for r in (rs, rp):  # the same rows reused, the same head recomputed
        seg = r["segments"][1]
        assert seg["resolved_by"] == "alignment" and seg["head_recomputed"] == 8
        assert r["tokens_aligned"] == _query_len(tokenizer, text) - 8
    for out in (staged, sparse):  # SGLang's cached_tokens keeps its meaning: exact hits only
        assert out["meta_info"]["cached_tokens"] == report(out)["tokens_exact_hit"]
    assert sparse["output_ids"] == staged["output_ids"]
    a, b = _first_logprobs(staged), _first_logprobs(sparse)
    assert a.keys() == b.keys() and all(math.isclose(a[t], b[t], abs_tol=2e-3) for t in a)


def test_recomputing_every_row_in_the_sparse_extend_gives_the_dense_prefill(server_pool, tokenizer):
    """A ratio of 1 recomputes the whole segment in the one forward: the KV, and the answer, of a plain request."""
    text = context(27, 2)
    with reconfigured(shared_server(server_pool), recompute_ratio=1.0) as server:
        out = _second_agent(server, tokenizer, text)
        ids, _cp = agent_request(tokenizer, "analyst", text)
        plain = server.generate(input_ids=ids, max_new_tokens=6, return_logprob=True, top_logprobs_num=5)
    rep = report(out)
    n = _query_len(tokenizer, text)
    assert rep["prefill_forwards"] == 1 and rep["tokens_sparse_recomputed"] == n
    assert rep["tokens_aligned"] == 0 and rep["segments"][1]["head_recomputed"] == n
    assert out["output_ids"] == plain["output_ids"]
    a, b = _first_logprobs(plain), _first_logprobs(out)
    assert a.keys() == b.keys() and all(math.isclose(a[t], b[t], abs_tol=1e-3) for t in a)


def test_a_recompute_ratio_sizes_the_head_by_the_segment(server_pool, tokenizer):
    text = context(30, 2)
    with reconfigured(shared_server(server_pool), recompute_ratio=0.15) as server:
        rep = report(_second_agent(server, tokenizer, text, head=4))
    n = _query_len(tokenizer, text)
    rows = max(4, math.ceil(round(0.15 * n, 6)))
    assert rep["segments"][1]["head_recomputed"] == rows and rep["tokens_sparse_recomputed"] == rows
    assert rep["tokens_aligned"] == n - rows and rep["prefill_forwards"] == 1


def test_input_logprobs_of_a_sparse_forward_are_those_of_the_requests_own_tokens(server_pool, tokenizer):
    """Teacher forcing (the frontier's and the guard's measure) reads input log-probabilities: the folded rows in
    front of the extend must not shift them."""
    text = context(33, 2)

    def forced(server) -> list:
        for ids, cp in (agent_request(tokenizer, "solver", text), warm_request(tokenizer, "analyst")):
            server.generate(input_ids=ids, custom_params=cp, max_new_tokens=1)  # A's copy, B's prompt in place
        ids, cp = agent_request(tokenizer, "analyst", text, head=8)
        body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": len(ids) - 6,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "custom_params": cp}}
        resp = requests.post(server.url + "/generate", json=body, timeout=300)
        resp.raise_for_status()
        out = resp.json()
        assert report(out)["segments"][1]["head_recomputed"] == 8
        return [[(t, round(lp, 3)) for lp, t, _ in pos] for pos in out["meta_info"]["input_top_logprobs"][1:]]

    with reconfigured(shared_server(server_pool), sparse_extend=False) as server:
        staged = forced(server)
    with reconfigured(shared_server(server_pool)) as server:
        sparse = forced(server)
    assert len(sparse) == 5 and sparse == staged


def test_a_corrected_segment_recomputes_its_head_in_one_forward(server_pool, tokenizer):
    """kvcmas with ``--kvshare-recompute-ratio``: once the pool corrects the segment, the ratio's first rows are
    recomputed in the request's one forward; the answer's first distribution stays close to the dense
    request's."""
    # Distinct first words: contents sharing their first tokens would also share estimate rows in the tree.
    texts = [f"{word}: {context(40 + i, 2)}" for i, word in enumerate(("Alpha", "Bravo", "Charlie", "Delta"))]
    with reconfigured(shared_server(server_pool), mode="kvcmas", tau=1.0, edge_anchors=2,
                      recompute_ratio=0.25) as server:
        for text in texts[:3]:  # the A -> B edge learned from B's dense prefills (learning is synchronous here)
            _second_agent(server, tokenizer, text)
        out = _second_agent(server, tokenizer, texts[3])
        ids, _cp = agent_request(tokenizer, "analyst", texts[3])
        plain = server.generate(input_ids=ids, max_new_tokens=6, return_logprob=True, top_logprobs_num=5)
    rep = report(out)
    seg, n = rep["segments"][1], _query_len(tokenizer, texts[3])
    rows = math.ceil(round(0.25 * n, 6))
    assert seg["resolved_by"] == "correction", rep
    assert seg["head_recomputed"] == rows
    assert rep["tokens_sparse_recomputed"] == rows and rep["tokens_corrected"] == n - rows, rep
    assert rep["prefill_forwards"] == 1
    a, b = _first_logprobs(plain), _first_logprobs(out)
    assert max(a, key=a.get) == max(b, key=b.get)
    common = set(a) & set(b)
    assert sum(math.exp(a[t]) * (a[t] - b[t]) for t in common) < 0.1
