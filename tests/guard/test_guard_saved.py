"""The guard's settings and pins across a restart (``--kvshare-fidelity-file``): the file, and a guard that
reads what another guard wrote (two ``Guard`` objects stand for the server before and after its restart)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_kvshare.config import KVShareConfig
from sglang_kvshare.guard.controller import DENSE
from sglang_kvshare.guard.measure import RequestFidelity
from sglang_kvshare.guard.saved import GuardFile, GuardFileError, SavedScope
from sglang_kvshare.guard.serving import Guard
from sglang_kvshare.server.launcher import parse_kvshare

CONFIG = KVShareConfig(mode="fullshared", fidelity_target="top1>=0.99", fidelity_min_samples=4)


def _request(salt=None):
    return SimpleNamespace(cache_salt=salt, extra_key=None, lora_path=None)


@pytest.fixture(autouse=True)
def _live(monkeypatch):
    """The config in force in this process (what ``pin`` and ``prepare`` read); each test sets it per guard."""
    import sglang_kvshare.config as config_module

    monkeypatch.setattr(config_module, "_live", CONFIG)


def _guard(path, config=CONFIG) -> Guard:
    import sglang_kvshare.config as config_module

    config_module._live = config  # restored by the fixture's monkeypatch
    g = Guard(seed=0)
    g.attach_file(str(path))
    g._refresh(config)
    return g


def _break(g: Guard, scope) -> None:
    """Verified answers far below the target until the scope is dense (what the worker does per reference)."""
    for _ in range(8):
        action = g.controller.observe(scope, g.controller.setting(scope), RequestFidelity(32, 0.2, 1.0))
        if action is not None:
            g._record(action)
    assert g.controller.setting(scope) == DENSE


def test_a_restarted_guard_serves_each_scope_where_the_last_one_left_it(tmp_path):
    path = tmp_path / "guard.json"
    before = _guard(path)
    judge, _ = before._scope(_request("tenant-secret"), "judge")
    _break(before, judge)
    _, display = before._scope(_request(), "worker")
    before.pin(display, "head32")  # served, never verified: an operator can pin it all the same
    assert before.counters["file_writes"] >= 2 and "tenant-secret" not in path.read_text()
    assert before.snapshot()["file"] == str(path) and Guard().snapshot()["file"] is None

    after = _guard(path)
    judge_again, _ = after._scope(_request("tenant-secret"), "judge")
    worker_again, _ = after._scope(_request(), "worker")
    assert after.controller.setting(judge_again) == DENSE and after.controller.probe_setting(judge_again) == 64
    assert after.controller.setting(worker_again) == 32 and after.controller.pinned(worker_again) == 32
    other, _ = after._scope(_request("another-tenant"), "judge")  # the same agent in another namespace: its own
    assert after.controller.setting(other) == 0
    assert after.controller.scopes()[judge_again]["samples"] == 0  # settings come back, evidence does not

    unpinned = after.pin("worker", None)
    assert unpinned["setting"] == "head0" and not unpinned["pinned"]
    assert [s["agent"] for s in json.loads(path.read_text())["scopes"]] == ["judge"]  # head0 unpinned: not kept


def test_another_target_keeps_the_pins_and_drops_what_was_learned(tmp_path):
    path = tmp_path / "guard.json"
    before = _guard(path)
    judge, _ = before._scope(_request(), "judge")
    _break(before, judge)
    _, display = before._scope(_request(), "critic")
    before.pin(display, "dense")

    after = _guard(path, CONFIG.replace(fidelity_target="top1>=0.95"))
    judge_again, _ = after._scope(_request(), "judge")
    critic_again, _ = after._scope(_request(), "critic")
    assert after.controller.setting(judge_again) == 0  # dense meant "below 0.99": unknown against 0.95
    assert after.controller.setting(critic_again) == DENSE  # the operator's pin stays
    saved = json.loads(path.read_text())
    assert saved["target"] == "top1>=0.95" and [s["agent"] for s in saved["scopes"]] == ["critic"]


def test_a_reset_empties_the_file(tmp_path):
    path = tmp_path / "guard.json"
    g = _guard(path)
    scope, _ = g._scope(_request(), "judge")
    _break(g, scope)
    g.reset()
    assert json.loads(path.read_text())["scopes"] == []


def test_the_file_round_trips_and_a_missing_one_starts_empty(tmp_path):
    empty = GuardFile.open(tmp_path / "new.json")
    assert empty.scopes == {} and not (tmp_path / "new.json").exists()
    empty.under("top1>=0.99", (0, 8, 64, DENSE))
    empty.scopes[("", "judge")] = SavedScope(DENSE)
    empty.scopes[(empty.namespace_id(("s", None, "null")), "judge")] = SavedScope(8, pinned=DENSE)
    empty.write()
    back = GuardFile.open(tmp_path / "new.json")
    assert (back.key, back.target, back.settings, back.scopes) == (empty.key, "top1>=0.99", (0, 8, 64, DENSE),
                                                                   empty.scopes)
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("content, message", [
    ("not json", "not a readable guard file"),
    ('{"format": 9}', "not a guard file of format 1"),
    ('{"format": 1, "key": "00", "settings": [], "scopes": []}', "key is too short"),
    ('{"format": 1, "key": "' + "ab" * 16 + '", "settings": ["fast"], "scopes": []}', "neither dense nor headK"),
    ('{"format": 1, "key": "' + "ab" * 16 + '", "settings": [], "scopes": [{"agent": "a"}]}', "malformed"),
])
def test_a_file_that_is_not_a_guard_file_is_refused_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "guard.json"
    path.write_text(content)
    with pytest.raises(GuardFileError, match=message):
        GuardFile.open(path)
    assert path.read_text() == content  # nothing changed


def test_the_launcher_refuses_a_bad_guard_file_before_sglang_starts(tmp_path, capsys):
    bad = tmp_path / "guard.json"
    bad.write_text("[]")
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-fidelity-file", str(bad), "--model-path", "m"])
    assert "not a guard file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-fidelity-file", str(tmp_path / "missing" / "guard.json"), "--model-path", "m"])
    config, _ = parse_kvshare(["--kvshare-fidelity-file", str(tmp_path / "new.json"), "--model-path", "m"])
    assert config.fidelity_file == str(tmp_path / "new.json")


def test_an_agent_is_pinned_before_its_first_request_and_served_under_its_pin(tmp_path):
    g = _guard(tmp_path / "guard.json")
    assert g.pin("judge", "dense")["setting"] == "dense"  # default namespace, never served
    scope, display = g._scope(_request(), "judge")
    assert display == "judge" and g.controller.setting(scope) == DENSE
    salted, salted_display = g._scope(_request("tenant"), "judge")
    assert g.controller.setting(salted) == 0  # another namespace: its own scope, not pinned
    with pytest.raises(KeyError):
        g.pin("critic", None)  # nothing to unpin
    with pytest.raises(KeyError):
        g.pin("critic@0123abcd", "dense")  # another namespace is named only once served
    assert g.pin(salted_display, "head16")["setting"] == "head16"
    with pytest.raises(ValueError, match="headK"):
        g.pin("critic", "fast")
    assert "critic" not in g.snapshot()["per_scope"]  # a refused pin creates nothing
    after = _guard(tmp_path / "guard.json")
    again, _ = after._scope(_request(), "judge")
    assert after.controller.setting(again) == DENSE  # and the pin was saved


def test_a_runtime_change_of_target_keeps_the_pins_of_a_guard_with_a_file(tmp_path):
    g = _guard(tmp_path / "guard.json")
    judge, _ = g._scope(_request(), "judge")
    _break(g, judge)
    g.pin("critic", "head32")
    g._refresh(CONFIG.replace(fidelity_target="kl<=0.01"))  # what POST /kvshare/config does
    judge_now, _ = g._scope(_request(), "judge")
    critic_now, _ = g._scope(_request(), "critic")
    assert g.controller.setting(judge_now) == 0 and g.controller.setting(critic_now) == 32
