"""Tenant boundaries on fake pools (no server): what ``--kvshare-reuse-scope`` lets cross, and what reports name.

Each test fails on a cache that serves an unsalted request another request's
KV under ``salt-required``, records an unsalted request's copies for others,
or names in ``source_agent`` an agent of another reuse scope or workflow.
"""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace
from typing import Optional

import pytest

from sglang_kvshare.config import REUSE_SCOPES, KVShareConfig
from tests.cache.fakes import FakeReq, MiniScheduler, make_cache
from tests.cache.test_adapter import QUERY, SUFFIX, SYS, warm


def request(sys_key: str, name: str, salt: Optional[str] = None, workflow: Optional[str] = None) -> FakeReq:
    """Agent ``name`` (system prompt ``SYS[sys_key]``) reading the shared query, in scope (salt, workflow)."""
    sys_ids = SYS[sys_key]
    end = len(sys_ids) + len(QUERY)
    ann = {"agent": name, "segments": [{"kind": "private", "start": 0, "end": len(sys_ids)},
                                       {"kind": "shared", "start": len(sys_ids), "end": end, "slot": "query"},
                                       {"kind": "private", "start": end, "end": end + len(SUFFIX)}]}
    if workflow is not None:
        ann["workflow"] = workflow
    return FakeReq(sys_ids + QUERY + SUFFIX, custom_params={"kvshare": json.dumps(ann)}, cache_salt=salt)


def test_salt_required_serves_an_unsalted_request_nothing_another_computed():
    sched = MiniScheduler(make_cache("fullshared", reuse_scope="salt-required"))
    sched.run(request("A", "reader", workflow="team"))
    warm(sched, "B")
    b = request("B", "copier", workflow="team")  # the same text, the same workflow label, no salt
    m = sched.run(b)
    assert m == len(SYS["B"])  # its own exact prefix only: no row of A's query
    assert b.report() is None  # served as stock serves it: no report (and so no source_agent)
    cache = sched.cache
    assert cache.registry.namespaces == {}  # nothing either request computed is offered to another
    assert cache.counters.get("unsalted_served_plain") == 2
    waiting = request("C", "waiter", workflow="team")
    sched.match(waiting)  # matched again every round while it waits: counted once
    sched.run(waiting)
    assert cache.counters.get("unsalted_served_plain") == 3 and cache.registry.namespaces == {}
    salted = request("C", "tenant-agent", salt="t1", workflow="team")
    warm(sched, "C", cache_salt="t1")
    sched.run(salted)
    seg = salted.report()["segments"][1]
    assert seg["resolved_by"] == "dense" and seg["reason"] == "no_source"  # nor to a salted request


def test_salt_required_shares_inside_one_salt_like_salt():
    sched = MiniScheduler(make_cache("fullshared", reuse_scope="salt-required"))
    sched.run(request("A", "reader", salt="t1", workflow="alice"))
    warm(sched, "B", cache_salt="t1")
    bob = request("B", "copier", salt="t1", workflow="bob")
    sched.run(bob)
    seg = bob.report()["segments"][1]
    assert seg["resolved_by"] == "alignment" and "source_agent" not in seg  # another workflow's agent: unnamed
    warm(sched, "C", cache_salt="t2")
    other = request("C", "reader", salt="t2", workflow="alice")
    sched.run(other)
    assert other.report()["segments"][1]["reason"] == "no_source"  # another salt: nothing crosses


SCOPES = [("t1", "alice"), ("t1", "bob"), ("t2", "alice"), (None, "alice"), (None, None)]


@pytest.mark.parametrize("reuse_scope", REUSE_SCOPES)
def test_source_agent_never_names_an_agent_of_another_scope_or_workflow(reuse_scope):
    """Agents named after their (salt, workflow), three per scope, all reading one text: every name a report
    shows belongs to the reader's own salt and workflow."""
    sched = MiniScheduler(make_cache("fullshared", reuse_scope=reuse_scope))
    shown, reused = [], 0
    for (salt, workflow), sys_key in itertools.product(SCOPES, ("A", "B", "C")):
        warm(sched, sys_key, cache_salt=salt)
        req = request(sys_key, f"{sys_key}|{salt}|{workflow}", salt, workflow)
        sched.run(req)
        report = req.report()
        if report is None:
            assert reuse_scope == "salt-required" and salt is None
            continue
        reused += report["tokens_aligned"]
        shown += [(seg["source_agent"], salt, workflow) for seg in report["segments"] if "source_agent" in seg]
    assert shown  # later agents of a scope are told whose copy they got
    for source, salt, workflow in shown:
        assert source.split("|")[1:] == [str(salt), str(workflow)]
    assert reused > 0


def test_a_chat_request_without_a_salt_is_served_as_stock_under_salt_required(monkeypatch):
    """The chat layer neither looks up another request's answers for it nor remembers its own."""
    from sglang_kvshare.chat import hooks as chat_hooks

    planned = []
    monkeypatch.setattr(chat_hooks, "_auto_plan", lambda *args, **kwargs: planned.append(True))

    def plan(reuse_scope: str, salt: Optional[str]) -> Optional[tuple]:
        """Plan an automatic chat request; the chat layer's namespace for it (None: it shares nothing)."""
        monkeypatch.setattr(chat_hooks, "live_config", lambda: KVShareConfig(mode="fullshared", auto=True,
                                                                             reuse_scope=reuse_scope))
        messages = [{"role": "system", "content": "You grade."}, {"role": "user", "content": "2 + 3?"}]
        request = SimpleNamespace(n=1, messages=messages, user="alice")
        adapted = SimpleNamespace(sampling_params={}, input_ids=[1, 2], cache_salt=salt, extra_key=None,
                                  lora_path=None)
        capture = chat_hooks._Capture(messages=messages, stock_ids=[1, 2])
        serving = SimpleNamespace(tokenizer_manager=SimpleNamespace(tokenizer=None))
        chat_hooks._plan_or_raise(serving, request, adapted, capture, None)
        return chat_hooks._namespace(adapted, "alice")

    assert plan("salt-required", None) is None and planned == []  # served as stock: not annotated
    assert plan("salt-required", "t1")[-1] is None and plan("salt", None)[-1] is None  # scope: the salt
    assert plan("workflow", None)[-1] == "alice"
    assert len(planned) == 3
