"""The frontend against real servers: token spans, reuse in a refer workflow, kvshare off, stock SGLang.

Two servers (about 30 s each to start): kvshare ``fullshared`` and stock SGLang.
Stock SGLang is the "kvshare off" case: it accepts the annotation and ignores
it (the launcher's ``--kvshare-mode off`` takes the same RadixCache path and
has its own tests in ``tests/test_placeholder_cache_server.py``).
"""

from __future__ import annotations

import json

import pytest
import requests
import sglang as sgl
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

from benchmarks.workloads.tasks import GSM8K, load_gsm8k
from tests.frontend.workflows import multi_agent, run_workflow
import sglang_kvshare.frontend.backend as backend_module
from sglang_kvshare.frontend import KVShareEndpoint, agent, shared
from tests.servers import shared_server

pytestmark = pytest.mark.server

Q1 = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
Q2 = "How many clips did Natalia sell altogether in April and May?"


def _spy(backend: KVShareEndpoint) -> list[dict]:
    sent = []
    orig = backend._post_streaming

    def spy(data, workflow):
        sent.append(data)
        return orig(data, workflow)

    backend._post_streaming = spy
    return sent


def _server_ids(url: str, text: str) -> list[int]:
    return requests.post(url + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]


@sgl.function
def mixed_program(s, q1, q2):
    s += agent("reader")
    s += sgl.system("You read carefully and answer in one short sentence.")
    s += sgl.user(shared(q1, slot="context"))
    s += sgl.assistant("Understood.")
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += agent(f"asker{i}")
        f += sgl.user(shared(q2, slot="query"))
        f += sgl.assistant(sgl.gen("a", max_tokens=3))
    answers = [f["a"] for f in forks]
    forks.join()
    s += sgl.user(shared(answers[0], slot="out:asker0"))
    s += sgl.assistant(sgl.gen("b", max_tokens=2))


def test_token_spans_match_server_tokenization(server_pool):
    server = shared_server(server_pool)
    backend = KVShareEndpoint(server.url)
    sent = _spy(backend)
    state = mixed_program.run(q1=Q1, q2=Q2, backend=backend, temperature=0)
    assert state.stream_executor.error() is None
    assert len(sent) == 3
    for data in sent[:2]:  # no generated text inside: the whole prompt is the server's own tokenization
        ids = data["input_ids"]
        assert ids == _server_ids(server.url, backend.tokenizer.decode(ids))
        ann = data["sampling_params"]["custom_params"]["kvshare"]
        assert '"slot":"context"' in ann and '"slot":"query"' in ann
    spans = {}
    for data in sent:
        ann = json.loads(data["sampling_params"]["custom_params"]["kvshare"])
        for seg in ann["segments"]:
            if seg["kind"] == "shared":
                spans.setdefault(seg["slot"], []).append(data["input_ids"][seg["start"]:seg["end"]])
    assert spans["context"][0] == _server_ids(server.url, Q1)
    assert all(x == spans["context"][0] for x in spans["context"])  # same ids in every agent and fork
    assert spans["query"] == [_server_ids(server.url, Q2)] * 2
    # the asker's answer is sent as the ids the server generated for it
    meta_a = next(m for m in [state.stream_executor.variables.get("a")] if m is not None)
    assert isinstance(meta_a, list)  # join() gathered the forks' answers
    generated = backend.lookup_output(meta_a[0])
    assert generated is not None and spans["out:asker0"] == [list(generated)]
    assert state.get_meta_info("b")["kvshare"][0]["agent"] == "reader"


def run_refer(server):
    """One GSM8K refer workflow (3 role agents + final) against ``server``; returns its state."""
    sample = load_gsm8k(1, offset=3)[0]
    state = multi_agent.run(query=sample.query, task=GSM8K, topology="refer", num_agents=4, max_tokens=3,
                            backend=KVShareEndpoint(server.url), temperature=0)
    assert state.stream_executor.error() is None
    return state


def test_refer_workflow_reuses_shared_tokens_with_kvshare_on(server_pool):
    state = run_refer(shared_server(server_pool))
    records = state.ret_value["records"]
    assert [r["agent"] for r in records] == ["solver", "analyst", "programmer", "final"]
    assert all(r["report"] is not None and r["ttft_s"] is not None for r in records)
    first = records[0]["report"]
    assert first["segments"][0]["resolved_by"] == "hit"  # the warmed system prompt
    query_reuse = [seg for r in records[1:] for seg in r["report"]["segments"]
                   if seg.get("slot") == "query" and seg["resolved_by"] == "alignment"]
    assert len(query_reuse) == 3  # agents 2..4 re-aligned the solver's copy of the question
    final_slots = [seg.get("slot") for seg in records[-1]["report"]["segments"] if seg["kind"] == "shared"]
    assert final_slots == ["query", "out:solver", "out:analyst", "out:programmer"]
    assert sum(r["report"]["tokens_aligned"] for r in records) >= 3 * query_reuse[0]["tokens"]


def _shared_segments(record: dict) -> list[dict]:
    return [seg for seg in record["report"]["segments"] if seg["kind"] == "shared"]


def test_chain_and_debate_reuse_agent_outputs(server_pool):
    server = shared_server(server_pool)
    warmup, *samples = load_gsm8k(3, offset=5)
    backend = KVShareEndpoint(server.url)
    # The private text between segments ("The math solver said:") has a source only
    # after an agent has prefilled it once; one sample first, then two at a time.
    run_workflow(backend, GSM8K, [warmup], topology="chain", num_agents=3, max_tokens=4, progress_bar=False)
    chain = run_workflow(backend, GSM8K, samples, topology="chain", num_agents=3, max_tokens=4,
                         progress_bar=False, concurrency=2)
    assert [r["id"] for r in chain] == [s.id for s in samples]  # results in sample order
    for res in chain:
        solver, analyst, final = res["records"]
        assert [seg.get("slot") for seg in _shared_segments(analyst)] == ["query", "out:solver"]
        assert [seg.get("slot") for seg in _shared_segments(final)] == ["query", "out:analyst"]
        # the consumer's copy of the producer's answer comes from the producer's KV, not a prefill
        for rec in (analyst, final):
            assert all(seg["resolved_by"] != "dense" for seg in _shared_segments(rec)), rec["report"]
    debate = run_workflow(backend, GSM8K, [warmup, samples[0]], topology="debate", num_agents=3, rounds=2,
                          max_tokens=4, progress_bar=False)[1]
    rounds = [r["round"] for r in debate["records"]]
    assert rounds == [0, 0, 1, 1, -1]
    for rec in debate["records"][2:4]:  # round 1 reads every round-0 answer
        segs = _shared_segments(rec)
        assert [seg.get("slot") for seg in segs] == ["query", "out:solver", "out:analyst"]
        assert all(seg["resolved_by"] != "dense" for seg in segs), rec["report"]


def test_refer_workflow_runs_unchanged_on_stock_sglang(server_pool):
    state = run_refer(server_pool("stock", stock=True))
    records = state.ret_value["records"]
    assert len(records) == 4 and state.ret_value["final"]
    assert all(r["report"] is None and r["ttft_s"] is not None for r in records)  # annotation ignored


@sgl.function
def plain_program(s, q):
    s += sgl.system("You answer in one short sentence.")
    s += sgl.user(q)
    s += sgl.assistant(sgl.gen("a", max_tokens=4))


@sgl.function
def marked_program(s, q):
    s += agent("solo")
    s += sgl.system("You answer in one short sentence.")
    s += sgl.user(shared(q, slot="query"))
    s += sgl.assistant(sgl.gen("a", max_tokens=4))


def test_unmarked_program_is_stock_sglang(server_pool, monkeypatch):
    server = server_pool("stock", stock=True)
    bodies = {"stock": [], "ours": []}

    def spy_on(module, key):
        orig = module.http_request

        def spy(url, json=None, **kw):
            if url.endswith("/generate"):
                bodies[key].append(json)
            return orig(url, json=json, **kw)

        monkeypatch.setattr(module, "http_request", spy)

    import sglang.lang.backend.runtime_endpoint as stock_module

    stock = RuntimeEndpoint(server.url, chat_template_name="chatml")
    ours = KVShareEndpoint(server.url)
    assert ours.chat_template.name == "chatml"
    spy_on(stock_module, "stock")
    ref = plain_program.run(q=Q2, backend=stock, temperature=0)["a"]
    monkeypatch.undo()
    spy_on(backend_module, "ours")
    got = plain_program.run(q=Q2, backend=ours, temperature=0)["a"]
    assert bodies["ours"] == bodies["stock"] and len(bodies["stock"]) == 1
    assert got == ref
    # the marked program runs unchanged on stock SGLang (annotation ignored) with the same greedy output
    assert marked_program.run(q=Q2, backend=ours, temperature=0)["a"] == ref
