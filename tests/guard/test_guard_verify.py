"""What the guard verifies and how, without a server: which requests a plain dense prefill can judge, what the
client gets back, and a reference that never answers."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

import sglang_kvshare.guard.serving as serving
from sglang_kvshare.config import KVShareConfig
from sglang_kvshare.guard.serving import Guard, Job
from sglang_kvshare.protocol import Annotation, Segment

CONFIG = KVShareConfig(mode="fullshared", verify_rate=1.0, fidelity_target="top1>=0.9", fidelity_min_samples=4)
PROMPT = list(range(100, 140))


@pytest.fixture(autouse=True)
def _live(monkeypatch):
    import sglang_kvshare.config as config_module

    monkeypatch.setattr(config_module, "_live", CONFIG)


def _request(**sampling):
    """An annotated reader request (a private head, a shared document) with ``sampling`` beside its annotation."""
    ann = Annotation(agent="reader", segments=(Segment(kind="private", start=0, end=8),
                                               Segment(kind="shared", start=8, end=len(PROMPT), slot="doc")))
    params = {"max_new_tokens": 8, "custom_params": ann.to_custom_params(), **sampling}
    return SimpleNamespace(input_ids=list(PROMPT), sampling_params=params, return_logprob=False,
                           top_logprobs_num=0, logprob_start_len=-1, cache_salt=None, extra_key=None, lora_path=None)


@pytest.mark.parametrize("sampling", [
    {"logit_bias": {"42": 100.0}}, {"json_schema": '{"type": "object"}'}, {"regex": "[a-z]+"},
    {"ebnf": 'root ::= "a"'}, {"structural_tag": "{}"},
    {"frequency_penalty": 0.5}, {"presence_penalty": -0.2}, {"repetition_penalty": 1.1}, {"min_new_tokens": 4},
    {"temperature": 0.7}, {"temperature": 1.5}, {"temperature": "hot"}])
def test_a_request_whose_logprobs_sglang_changes_is_skipped_and_counted(sampling):
    """Its served logprobs are taken after the bias, grammar, penalty or temperature; a raw prefill's are not, so a
    comparison would count the sampling as KV error (a top-1 miss on an intact scope)."""
    guard = Guard(seed=0)
    obj = _request(**sampling)
    collector = guard.prepare(obj, SimpleNamespace())
    assert collector is not None and not collector.sampled and not obj.return_logprob
    assert guard.counters["skipped_sampling"] == 1 and guard.counters["sampled"] == 0


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.0}, {"temperature": 1.0}, {"top_p": 0.9, "top_k": 5},
                                      {"min_p": 0.1}, {"frequency_penalty": 0.0, "repetition_penalty": 1.0},
                                      {"logit_bias": {}}, {"n": 1}])
def test_a_request_sampled_from_the_models_own_logprobs_is_verified(sampling):
    """Greedy, temperature 1, and top-p/top-k/min-p (SGLang takes the logprobs before those truncate) compare."""
    guard = Guard(seed=0)
    obj = _request(**sampling)
    assert guard.prepare(obj, SimpleNamespace()).sampled and obj.return_logprob and obj.top_logprobs_num > 0
    assert guard.counters["sampled"] == 1 and "skipped_sampling" not in guard.counters


def test_the_servers_preferred_sampling_params_and_a_custom_logit_processor_count():
    guard = Guard(seed=0)
    assert not guard.prepare(_request(), SimpleNamespace(preferred_sampling_params={"temperature": 0.6})).sampled
    overridden = _request(temperature=0)  # the request's own value wins over the server's preference
    assert guard.prepare(overridden, SimpleNamespace(preferred_sampling_params={"temperature": 0.6})).sampled
    custom = _request()
    custom.custom_logit_processor = "{...}"
    assert not guard.prepare(custom, SimpleNamespace()).sampled
    assert guard.counters["skipped_sampling"] == 2


def test_several_answers_to_one_request_are_not_sampled():
    """With ``n > 1`` SGLang answers with a list: no logprobs are asked for, so none can reach the client."""
    guard = Guard(seed=0)
    obj = _request(n=2)
    assert not guard.prepare(obj, SimpleNamespace()).sampled and not obj.return_logprob
    assert guard.counters["skipped_parallel"] == 1


# What SGLang adds to ``meta_info`` for ``return_logprob`` (``TokenizerManager.convert_logprob_style``).
SGLANG_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
                       "input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs",
                       "output_token_ids_logprobs")


def test_everything_sglang_adds_for_logprobs_leaves_the_response_of_a_client_that_did_not_ask():
    guard = Guard(seed=0)
    plain, asked = _request(), _request()
    asked.return_logprob, asked.top_logprobs_num = True, 3
    for obj, kept in ((plain, set()), (asked, set(SGLANG_LOGPROB_KEYS))):
        collector = guard.prepare(obj, SimpleNamespace())
        meta = {key: [] for key in SGLANG_LOGPROB_KEYS}
        meta.update(output_token_logprobs_length=1, output_top_logprobs=[[(-0.1, 7, None)]],
                    finish_reason={"type": "length"}, kvshare=[{"tokens_aligned": 4}])
        collector.observe({"output_ids": [7], "meta_info": meta}, incremental=False)
        assert {k for k in meta if "logprob" in k} == kept, meta
        assert meta["kvshare"][0]["guard"]["verified"]


class Manager:
    """SGLang's TokenizerManager as the guard's worker uses it: the first reference never answers."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.aborted: list[str] = []

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)

    async def generate_request(self, obj, request):
        self.calls.append(obj.rid)
        if len(self.calls) == 1:
            await asyncio.Event().wait()  # a reference SGLang never answers
        rows = [[(math.log(0.9), 7, None), (math.log(0.1), 8, None)]] * 2
        yield {"meta_info": {"input_top_logprobs": [None] + rows, "finish_reason": {"type": "length"}}}


def test_a_reference_that_never_answers_is_named_and_does_not_block_the_next(monkeypatch):
    from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: F401 - a cold import is not the wait timed

    monkeypatch.setattr(serving, "REFERENCE_WAIT_S", 0.2)
    guard = Guard(seed=0)
    guard._refresh(CONFIG)
    manager = Manager()
    served = [[(math.log(0.9), 7, None), (math.log(0.1), 8, None)]] * 2

    async def run():
        for agent in ("stuck", "next"):
            scope = ("ns", agent)
            guard._waiting[scope] = 1
            guard.enqueue(Job(scope, 0, list(PROMPT), [7, 7], served, manager, display=agent))
        await asyncio.wait_for(guard._worker, 5.0)  # far above the deadline: a wait without one fails here

    start = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - start < 5.0
    assert guard.counters["verify_timeouts"] == 1 and guard.counters["verified"] == 1, dict(guard.counters)
    stuck_rid = manager.calls[0]
    assert manager.aborted == [stuck_rid]  # given up in SGLang too
    named = guard.snapshot()["timed_out_references"]
    assert [(t["reference"], t["scope"]) for t in named] == [(stuck_rid, "stuck")]
    assert guard._waiting == {}  # both jobs released their scope
    assert guard.controller.scopes()[("ns", "next")]["samples"] == 1
