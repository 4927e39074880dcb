"""The guard's scopes as a request meets them: a reuse scope plus an agent, named without any secret whatever the
tables hold, pins that no flood of agents evicts (server-free: a ``Guard`` and the requests ``prepare`` sees)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import prometheus_client
import pytest

from sglang_kvshare.config import KVShareConfig
from sglang_kvshare.guard.controller import DENSE
from sglang_kvshare.guard.measure import RequestFidelity
from sglang_kvshare.guard.metrics import GuardMetrics
from sglang_kvshare.guard.serving import Guard
from sglang_kvshare.protocol import Annotation, Segment
from tests.guard.test_guard_saved import _break

CONFIG = KVShareConfig(mode="fullshared", fidelity_target="top1>=0.99", fidelity_min_samples=2, verify_rate=0.0)
SALT, EXTRA = "tenant-secret-salt-7f3a", "extra-secret-key-91c2"


@pytest.fixture(autouse=True)
def _live(monkeypatch):
    import sglang_kvshare.config as config_module

    monkeypatch.setattr(config_module, "_live", CONFIG)


def _configure(monkeypatch, **changes):
    import sglang_kvshare.config as config_module

    monkeypatch.setattr(config_module, "_live", CONFIG.replace(**changes))


def _request(agent, workflow=None, salt=None, extra_key=None):
    """An annotated /generate request as the guard's ``prepare`` sees it."""
    ann = Annotation(agent=agent, workflow=workflow, segments=(Segment(kind="shared", start=0, end=8, slot="doc"),
                                                               Segment(kind="private", start=8, end=12)))
    return SimpleNamespace(input_ids=list(range(100, 112)), cache_salt=salt, extra_key=extra_key, lora_path=None,
                           sampling_params={"max_new_tokens": 4, "custom_params": ann.to_custom_params()})


def _served(g, agent, **kw):
    """The collector of one request: its scope, display name and the setting it is served under."""
    return g.prepare(_request(agent, **kw), manager=None)


def test_the_same_agent_of_two_workflows_is_two_scopes(monkeypatch):
    g = Guard(seed=0)
    w1 = _served(g, "judge", workflow="w1")
    _break(g, w1.scope)
    w2 = _served(g, "judge", workflow="w2")
    assert w2.scope != w1.scope and w2.setting == 0  # w1's evidence does not push w2's judge dense
    assert _served(g, "judge", workflow="w1").setting == DENSE
    assert w1.display != w2.display and "w1" not in w1.display
    _configure(monkeypatch, reuse_scope="salt")  # one reuse scope across workflows: one guard scope
    assert _served(g, "judge", workflow="w1").scope == _served(g, "judge", workflow="w2").scope


def test_a_pin_by_agent_name_holds_in_every_workflow_without_its_own():
    g = Guard(seed=0)
    g._refresh(CONFIG)
    g.pin("judge", "dense")  # before any request
    assert _served(g, "judge", workflow="w1").setting == DENSE and _served(g, "judge").setting == DENSE
    w2 = _served(g, "judge", workflow="w2")
    g.pin(w2.display, "head16")
    assert _served(g, "judge", workflow="w2").setting == 16 and _served(g, "judge", workflow="w3").setting == DENSE
    assert _served(g, "judge", workflow="w1", salt="t").setting == 0  # another namespace: not under the pin


def test_a_saved_pin_by_agent_name_holds_in_its_workflows_after_a_restart(tmp_path):
    before = Guard(seed=0)
    before.attach_file(str(tmp_path / "guard.json"))
    before._refresh(CONFIG)
    before.pin("judge", "dense")
    after = Guard(seed=1)
    after.attach_file(str(tmp_path / "guard.json"))
    after._refresh(CONFIG)
    assert _served(after, "judge", workflow="w1").setting == DENSE  # its parent was never served since


def test_a_pinned_scope_is_never_evicted_and_a_pin_past_the_bound_is_refused():
    g = Guard(seed=0)
    g._refresh(CONFIG)
    judge = _served(g, "judge", salt=SALT)
    g.pin(judge.display, "dense")
    for i in range(g.controller.max_scopes + 10):  # new agents, each verified once: the table turns over
        agent = _served(g, f"agent-{i}")
        g.controller.observe(agent.scope, agent.setting, RequestFidelity(8, 1.0, 0.0))
    assert g.controller.counters["scopes_dropped"] >= 10
    assert _served(g, "judge", salt=SALT).setting == DENSE
    for i in range(g.controller.max_pins - 1):
        g.pin(f"pinned-{i}", "head32")
    with pytest.raises(ValueError, match="pinned, the most the guard holds"):
        g.pin("one-too-many", "dense")
    assert g.summary()["usage"]["pins"] == g.summary()["limits"]["pins"]
    g.pin("pinned-0", None)
    assert g.pin("one-too-many", "dense")["setting"] == "dense"


def test_an_unsalted_request_under_salt_required_holds_no_scope(monkeypatch):
    _configure(monkeypatch, reuse_scope="salt-required", verify_rate=1.0)
    g = Guard(seed=0)
    assert _served(g, "judge") is None and g.summary()["usage"]["scopes"] == 0
    assert _served(g, "judge", salt=SALT) is not None


def test_an_agent_name_cannot_forge_another_namespaces_display_name():
    g = Guard(seed=0)
    g._refresh(CONFIG)
    judge = _served(g, "judge", salt=SALT)
    forged = _served(g, judge.display)  # a default-namespace client names its agent after the salted judge
    assert forged.display != judge.display
    g.pin(judge.display, "dense")
    assert _served(g, "judge", salt=SALT).setting == DENSE and _served(g, judge.display).setting == 0


def test_no_salt_or_extra_key_in_any_output_whatever_the_tables_hold(tmp_path):
    g = Guard(seed=0)
    g.attach_file(str(tmp_path / "guard.json"))
    registry = prometheus_client.CollectorRegistry()
    g._metrics = GuardMetrics(registry=registry)
    g._refresh(CONFIG)
    judge = _served(g, "judge", salt=SALT, extra_key=EXTRA)
    for i in range(1100):  # agent names past every table of display names
        _served(g, f"flood-{i}", salt=f"flood-salt-{i}")
    _break(g, judge.scope)  # actions recorded after the flood
    g.controller.observe(judge.scope, 64, RequestFidelity(8, 1.0, 0.0))
    g._export()
    outputs = [json.dumps(g.snapshot()), json.dumps(g.summary()),
               prometheus_client.generate_latest(registry).decode()]
    key = g._file.key.hex()
    for text in outputs:
        assert SALT not in text and EXTRA not in text and key not in text
    assert judge.display in g.snapshot()["per_scope"]
    assert all(a["scope"] == judge.display for a in g.snapshot()["recent_actions"])
    assert g.pin(judge.display, "head16")["setting"] == "head16"  # still found by the name shown
