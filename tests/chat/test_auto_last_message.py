"""Automatic mode's last message: prefilled unless it is an answer this server generated (no server).

In a group chat the message just sent is usually the previous agent's answer, whose KV sits in the pool:
it is planned like any shared message, and the real cache (``tests.cache.fakes``) then applies its rules.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_kvshare.chat import hooks as chat_hooks
from sglang_kvshare.chat.annotation import AUTO_SLOT
from sglang_kvshare.chat.outputs import OutputMemory
from sglang_kvshare.config import KVShareConfig
from tests.cache.fakes import FakeReq, MiniScheduler, make_cache
from tests.chat.test_render import _fns, _ids, _stock, tokenizer  # noqa: F401 - the tokenizer fixture

TASK = "Task: a farmer has 17 sheep. He buys 5 more and then sells 8. How many sheep does he have now?"
ANSWER = ("He starts with 17 sheep. Buying 5 more gives 17 + 5 = 22 sheep. Selling 8 leaves 22 - 8 = 14 sheep. "
          "So the farmer has 14 sheep now, and the checker may confirm each of the two steps above.")


@pytest.fixture()
def memory(monkeypatch):
    memory = OutputMemory()
    monkeypatch.setattr(chat_hooks, "outputs", memory)
    monkeypatch.setattr(chat_hooks, "live_config", lambda: KVShareConfig(mode="fullshared", auto=True))
    return memory


def _chat(system: str, last: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": TASK},
            {"role": "user", "content": last}]


def _plan(tokenizer, messages, namespace, user=None):
    render, tokenize = _fns(tokenizer)
    return chat_hooks._auto_plan(messages, render, tokenize, _stock(tokenizer, messages), namespace, user)


def _last_content(plan):
    """The last message's content segment (the generation prompt after it is private)."""
    *_, content, tail = plan.annotation.segments
    assert tail.kind == "private"
    return content


def _namespace(salt, user):
    return chat_hooks._namespace(SimpleNamespace(cache_salt=salt, extra_key=None, lora_path=None), user)


def test_a_generated_answer_as_last_message_is_reused_under_its_output_slot(tokenizer, memory):
    ns = _namespace("team-a", "alice")
    memory.remember(ns, ANSWER, _ids(tokenizer, ANSWER), "out:solver")  # the slot the answer was shared under
    plan = _plan(tokenizer, _chat("You check answers.", ANSWER), ns, "alice")
    seg = _last_content(plan)
    assert seg.kind == "shared" and seg.reuse and seg.slot == "out:solver"
    assert plan.input_ids[seg.start:seg.end] == _ids(tokenizer, ANSWER)
    assert plan.same_as_stock and plan.input_ids == _stock(tokenizer, _chat("You check answers.", ANSWER))
    last = plan.messages[-1]
    assert (last.index, last.source, last.retokenized_equal, last.slot) == (2, "output", True, "out:solver")


@pytest.mark.parametrize("case", ["user-written", "other salt", "other user", "other ids"])
def test_a_last_message_nobody_generated_here_is_prefilled(tokenizer, memory, case):
    """Text a user wrote, a forged copy of an answer from another namespace or reuse scope, and an answer whose
    text does not re-tokenize to its generated ids (automatic mode never substitutes ids) stay ``reuse: false``."""
    ns = _namespace("team-a", "alice")
    generated = _ids(tokenizer, ANSWER)
    if case == "other ids":
        generated = _ids(tokenizer, ANSWER[:5]) + _ids(tokenizer, ANSWER[5:])
        assert generated != _ids(tokenizer, ANSWER)
    memory.remember(ns, ANSWER, generated, AUTO_SLOT)
    last, request_ns, user = ANSWER, ns, "alice"
    if case == "user-written":
        last = ANSWER.replace("14 sheep now", "14 sheep, I think")
    elif case == "other salt":
        request_ns = _namespace("team-b", "alice")
    elif case == "other user":
        request_ns, user = _namespace("team-a", "bob"), "bob"
    plan = _plan(tokenizer, _chat("You check answers.", last), request_ns, user)
    seg = _last_content(plan)
    assert seg.kind == "shared" and not seg.reuse and seg.slot == AUTO_SLOT  # offered to later requests
    assert plan.messages[-1].source == ("output" if case == "other ids" else "content")


@pytest.mark.parametrize("min_reuse, resolved, reason", [
    (None, "dense", "short_segment"),  # the default minimum (256 tokens): the answer is shorter
    (0, "alignment", None),
])
def test_the_cache_reuses_a_generated_last_message_or_keeps_it_dense_by_the_length_rule(
        tokenizer, memory, min_reuse, resolved, reason):
    """The plans, fed to the real cache: the solver's request prefills the answer as its last message (it came as
    text), the checker's reuses it, unless the answer is shorter than ``min_reuse_tokens``."""
    config = {} if min_reuse is None else {"min_reuse_tokens": min_reuse}
    assert KVShareConfig(**config).min_reuse_tokens > len(_ids(tokenizer, ANSWER)) or min_reuse == 0
    sched = MiniScheduler(make_cache("fullshared", **{"min_reuse_tokens": KVShareConfig().min_reuse_tokens,
                                                      **config}))
    ns = _namespace(None, None)

    def run(system):
        plan = _plan(tokenizer, _chat(system, ANSWER), ns)
        req = FakeReq(plan.input_ids, custom_params=plan.annotation.to_custom_params())
        sched.run(req)
        return plan, req.report()

    first, report = run("You write reports.")
    assert not _last_content(first).reuse and report["segments"][-2]["resolved_by"] == "dense"
    memory.remember(ns, ANSWER, _ids(tokenizer, ANSWER), AUTO_SLOT)  # as if the server had generated it
    second, report = run("You check answers.")
    assert _last_content(second).reuse
    seg = report["segments"][-2]
    assert seg["resolved_by"] == resolved and seg.get("reason") == reason, report["segments"]
    fallbacks = [f for f in report["fallbacks"] if f["segment"] == len(report["segments"]) - 2]
    assert [f["reason"] for f in fallbacks] == ([reason] if reason else [])
