"""The guard's settings and pins across a restart (``--kvshare-fidelity-file``): the file, and a guard that
reads what another guard wrote (two ``Guard`` objects stand for the server before and after its restart)."""

from __future__ import annotations

import json
import os
import stat
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
    assert after.controller.setting(judge_again) == DENSE and after.controller.probe_setting(judge_again) == after.controller.settings[-2]
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


KEY = "ab" * 16


def _file(settings='["head0", "dense"]', row='{"namespace": "", "agent": "judge", "setting": "dense"}', **top) -> str:
    extra = "".join(f', "{k}": {v}' for k, v in top.items())
    return f'{{"format": 1, "key": "{KEY}", "target": null, "settings": {settings}, "scopes": [{row}]{extra}}}'


@pytest.mark.parametrize("content, message", [
    ("not json", "not a readable guard file"),
    ("[]", "not a guard file of format 1"),
    ('{"format": 9}', "not a guard file of format 1"),
    ('{"format": true, "key": "' + KEY + '", "settings": [], "scopes": []}', "not a guard file of format 1"),
    ('{"format": 1.0, "key": "' + KEY + '", "settings": [], "scopes": []}', "not a guard file of format 1"),
    ('{"format": 1, "key": "00", "settings": [], "scopes": []}', "key: String should match"),
    (_file(settings='["fast"]'), "use dense or headK"),
    (_file(settings='["head70000"]'), "at most 65536"),
    (_file(row='{"namespace": "", "agent": "judge", "setting": "head0", "pinned": "head70000"}'), "at most 65536"),
    (_file(row='{"namespace": "", "agent": "judge", "setting": "head0", "pinned": "head' + "9" * 5000 + '"}'),
     "use dense or headK"),
    (_file(row='{"namespace": "", "agent": "judge", "setting": "head0", "pinned": 8}'), "use dense or headK"),
    (_file(row='{"namespace": "", "agent": true, "setting": "dense"}'), "agent: Input should be a valid string"),
    (_file(row='{"namespace": "", "agent": "' + "a" * 129 + '", "setting": "dense"}'), "agent: String should have"),
    (_file(row='{"namespace": "salt", "agent": "judge", "setting": "dense"}'), "namespace: String should match"),
    (_file(row='{"agent": "a"}'), "malformed"),
    (_file(format=2), "not a guard file of format 1"),
    (_file(extra='"x"'), "extra: Extra inputs are not permitted"),
    (_file(target='"' + "t" * 65 + '"'), "target: String should have at most 64"),
    (_file(row=",".join(['{"namespace": "", "agent": "a", "setting": "dense"}'] * 4097)), "scopes: List should have"),
    (_file(extra="[" * 100_000 + "]" * 100_000), "not a readable guard file"),  # no RecursionError
    (_file(extra='"' + "x" * (5 << 20) + '"'), "larger than"),
])
def test_a_file_that_is_not_a_guard_file_is_refused_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "guard.json"
    path.write_text(content)
    with pytest.raises(GuardFileError, match=message) as refused:
        GuardFile.open(path)
    assert path.read_text() == content  # nothing changed
    assert KEY not in str(refused.value)  # the message says what is wrong, never the content (it holds the key)


def test_a_good_file_with_a_pin_at_the_bound_is_read(tmp_path):
    path = tmp_path / "guard.json"
    path.write_text(_file(row='{"namespace": "", "agent": "judge", "setting": "head8", "pinned": "head65536"}'))
    assert GuardFile.open(path).scopes == {("", "judge"): SavedScope(8, pinned=65536)}


def test_a_symbolic_link_or_a_special_file_is_not_read(tmp_path):
    secret = tmp_path / "elsewhere.json"
    secret.write_text(_file())
    link = tmp_path / "guard.json"
    link.symlink_to(secret)
    with pytest.raises(GuardFileError, match="symbolic link"):
        GuardFile.open(link)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(GuardFileError, match="not a regular file"):  # and no wait for a writer
        GuardFile.open(fifo)


def test_a_write_follows_no_planted_link_and_leaves_a_private_file(tmp_path):
    path = tmp_path / "guard.json"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / ".guard.json.tmp").symlink_to(victim)  # at the name the old writer used
    g = GuardFile.open(path)
    (tmp_path / "guard.json").symlink_to(victim)  # and at the file's own name
    g.scopes[("", "judge")] = SavedScope(DENSE, pinned=DENSE)
    g.write()
    assert victim.read_text() == "keep me" and not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the namespace key
    assert GuardFile.open(path).scopes == g.scopes
    assert sorted(p.name for p in tmp_path.iterdir()) == [".guard.json.tmp", "guard.json", "victim.txt"]


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


def test_a_pin_past_the_request_bound_is_refused_and_one_at_it_keeps_requests_valid(tmp_path):
    from sglang_kvshare.protocol import CUSTOM_PARAMS_KEY, Annotation, Segment, parse_annotation

    g = _guard(tmp_path / "guard.json")
    for bad in ("head70000", "head65537", "head" + "9" * 5000, "head³", "head-1", "head 8"):
        with pytest.raises(ValueError, match="dense or headK|at most 65536"):
            g.pin("judge", bad)
    assert "judge" not in g.snapshot()["per_scope"]  # a refused pin creates nothing
    assert g.pin("judge", "head65536")["setting"] == "head65536"
    ann = Annotation(agent="judge", segments=(Segment(kind="private", start=0, end=2),
                                              Segment(kind="shared", start=2, end=4, slot="q")))
    custom = ann.to_custom_params()
    obj = SimpleNamespace(cache_salt=None, extra_key=None, lora_path=None, input_ids=[1, 2, 3, 4],
                          sampling_params={"custom_params": custom, "max_new_tokens": 1}, return_logprob=False)
    g.prepare(obj, None)
    served = parse_annotation(custom, 4)  # what request validation does after the guard: no 400
    assert served.recompute_head == 65536 and CUSTOM_PARAMS_KEY in custom


def test_the_launcher_refuses_a_guard_file_with_a_pin_past_the_bound(tmp_path, capsys):
    bad = tmp_path / "guard.json"
    bad.write_text(_file(row='{"namespace": "", "agent": "judge", "setting": "head0", "pinned": "head70000"}'))
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-fidelity-file", str(bad), "--model-path", "m"])
    assert "at most 65536" in capsys.readouterr().err


def test_a_guard_file_keeps_auto_agent_and_namespace_names_across_restarts(tmp_path, monkeypatch):
    from sglang_kvshare.chat import annotation

    path = tmp_path / "guard.json"
    first = _guard(path)
    assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600  # created at launch: its key is fixed
    second = _guard(path)  # the server after a restart
    messages = [{"role": "system", "content": "You judge."}, {"role": "user", "content": "Is 2+2=4?"}]
    names = []
    for g in (first, second):
        monkeypatch.setattr(annotation, "guard", g)  # the guard the HTTP process attached the file to
        names.append(annotation.auto_agent(messages, None))
    assert names[0] == names[1] == annotation.auto_agent(messages, None, key=first.agent_key)
    assert first._scope(_request("tenant"), "judge")[1] == second._scope(_request("tenant"), "judge")[1]
    assert first.pin(names[0], "dense")["pinned"]
    restarted = _guard(path)
    again, _ = restarted._scope(_request(), annotation.auto_agent(messages, None, key=restarted.agent_key))
    assert restarted.controller.setting(again) == DENSE  # the pin on the auto agent applies after the restart

    other = _guard(tmp_path / "other.json")  # another server's file: other names
    assert annotation.auto_agent(messages, None, key=other.agent_key) != names[0]
    memory_only = [Guard(), Guard()]  # without a file: a key per process, as before
    assert memory_only[0].agent_key != memory_only[1].agent_key
    saved = path.read_text()
    for g in (first, second):
        shown = json.dumps([g.snapshot(), g.summary()])
        assert g.agent_key.hex() not in shown and json.loads(saved)["key"] not in shown
        assert g.agent_key.hex() not in saved


def test_servers_creating_one_file_together_share_its_key(tmp_path):
    path = tmp_path / "guard.json"
    late = GuardFile.open(path)  # opened before the other one created the file
    first = GuardFile.create(path)
    assert GuardFile.create(path).key == first.key != late.key
    with pytest.raises(FileExistsError):
        late.write(exclusive=True)
    assert GuardFile.open(path).key == first.key and not list(tmp_path.glob(".*.tmp"))
