"""One settings model behind every way a setting arrives: a flag, the ``--kvshare-config`` file, ``POST
/kvshare/config`` (no server: the route runs on a bare FastAPI app with a stand-in scheduler channel)."""

from __future__ import annotations

import os

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sglang_kvshare.admin import routes
from sglang_kvshare.admin.ops import Reply
from sglang_kvshare.config import (FLAG_FIELDS, GROUP_MAIN, MAX_FILE_BYTES, RUNTIME_FIELDS, ConfigError,
                                   KVShareConfig, config_file_text, config_from_file, read_config_file)
from sglang_kvshare.server.launcher import kvshare_parser, parse_kvshare


@pytest.fixture
def post_config(monkeypatch):
    """POST /kvshare/config on a mounted app whose scheduler channel applies the change to a real config."""
    applied = []

    class Channel:
        async def call(self, op, **params):
            applied.append(params)
            return Reply(200, "config applied")

    app = FastAPI()
    routes.mount(app, tokenizer_manager=None, rpc_endpoint="ipc:///nonexistent")
    monkeypatch.setattr(routes, "_channel_or_error", lambda: Channel())
    monkeypatch.setattr(routes, "live_config", lambda: KVShareConfig())
    client = TestClient(app)

    def post(body: dict):
        return client.post("/kvshare/config", json=body), applied

    return post


# (key, the flag's text, the same value as JSON / TOML): out of range, the wrong form, the wrong type, a bad choice
BAD = [("tau", "1.5", 1.5),
       ("capacity", "1", 1),
       ("verify_rate", "-0.1", -0.1),
       ("fidelity_target", "top1>=2", "top1>=2"),
       ("rank", "many", "many"),
       ("mode", "kvcomm", "kvcomm")]


@pytest.mark.parametrize("key, text, value", BAD)
def test_a_bad_value_gets_the_same_message_from_flag_file_and_admin_route(key, text, value, tmp_path, capsys,
                                                                         post_config):
    assert key in FLAG_FIELDS and key in RUNTIME_FIELDS
    response, applied = post_config({key: value})
    assert response.status_code == 422 and applied == []
    message = response.json()["message"]
    assert message.startswith(f"invalid kvshare setting {key}: "), message

    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-" + key.replace("_", "-"), text, "--model-path", "m"])
    assert message in capsys.readouterr().err

    path = tmp_path / "kvshare.toml"
    section = KVShareConfig.__dataclass_fields__[key].metadata["group"]
    literal = f'"{value}"' if isinstance(value, str) else repr(value)
    path.write_text((f"[{section}]\n" if section != GROUP_MAIN else "") + f"{key} = {literal}\n")
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-config", str(path), "--model-path", "m"])
    err = capsys.readouterr().err
    assert message in err and str(path) in err


def test_a_request_field_set_as_a_server_setting_is_refused_with_where_it_belongs(tmp_path, capsys, post_config):
    """``recompute_head`` is an annotation field: the flag, the file and the admin route each say so and name the
    server's setting (``recompute_ratio``), rather than a bare unknown key."""
    response, applied = post_config({"recompute_head": 8})
    assert response.status_code == 422 and applied == []
    assert "annotation field" in response.json()["message"] and "recompute_ratio" in response.json()["message"]
    for argv in (["--kvshare-recompute-head", "8"], ["--kvshare-recompute-head=8"]):
        with pytest.raises(SystemExit):
            parse_kvshare([*argv, "--model-path", "m"])
        err = capsys.readouterr().err
        assert "--kvshare-recompute-head: " in err and "annotation field" in err and "recompute_ratio" in err
    path = tmp_path / "kvshare.toml"
    path.write_text("recompute_head = 8\n")
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-config", str(path), "--model-path", "m"])
    err = capsys.readouterr().err
    assert "annotation field" in err and str(path) in err


@pytest.mark.parametrize("value", ["lru", "W" * 10_000, {"policy": "workflow"}, ["workflow"], 1])
def test_a_bad_retention_order_gets_the_same_message_from_file_and_admin_route(value, tmp_path, capsys,
                                                                              post_config):
    """``retention`` has no flag: a wrong name, an oversized or nested value is refused alike by the live route
    and the config file, and nothing is applied."""
    response, applied = post_config({"retention": value})
    assert response.status_code == 422 and applied == []
    message = response.json()["message"]
    assert message.startswith("invalid kvshare setting retention: "), message
    assert len(message) < 400  # an oversized value is cut in the message, not echoed whole
    path = tmp_path / "kvshare.toml"
    literal = {str: lambda v: f'"{v}"', dict: lambda v: '{ policy = "workflow" }', list: lambda v: '["workflow"]',
               int: repr}[type(value)](value)
    path.write_text(f"[limits]\nretention = {literal}\n")
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-config", str(path), "--model-path", "m"])
    err = capsys.readouterr().err
    assert message in err and str(path) in err


def test_the_admin_route_takes_runtime_settings_only_and_passes_a_valid_change_on(post_config):
    response, applied = post_config({"max_pools": 8})
    assert response.status_code == 422 and "'max_pools' cannot change at runtime" in response.json()["message"]
    response, applied = post_config({"tua": 0.1})
    assert response.status_code == 422 and "'tua' is not a kvshare setting" in response.json()["message"]
    response, applied = post_config({"fidelity_target": "", "tau": 0.2, "rank": None})
    assert response.status_code == 200 and applied == [{"fidelity_target": "", "tau": 0.2}]


def test_the_file_sets_what_has_no_flag_and_a_flag_wins_over_it(tmp_path):
    path = tmp_path / "kvshare.toml"
    path.write_text(config_file_text({"mode": "fullshared", "tau": 0.5, "learn_yield_s": 0, "max_pools": 8,
                                      "verify_burst": False, "staged": False}))
    config, rest = parse_kvshare(["--kvshare-config", str(path), "--kvshare-tau", "0.2", "--model-path", "m"])
    assert rest == ["--model-path", "m"]
    assert (config.mode, config.tau, config.learn_yield_s, config.max_pools, config.verify_burst, config.staged) == \
        ("fullshared", 0.2, 0.0, 8, False, False)
    assert parse_kvshare([f"--kvshare-config={path}"])[0].tau == 0.5


@pytest.mark.parametrize("text, says", [
    ("tua = 0.2\n", "unknown key 'tua' at the top level"),
    ("[kvcmas]\nlearn_yield_s = 1\n", "'learn_yield_s' belongs at [learner], not at [kvcmas]"),
    ("tau = 0.2\n", "'tau' belongs at [kvcmas], not at the top level"),
    ("[limits]\nmax_pools = 8\n[limitz]\nmax_slots = 8\n", "unknown key 'limitz'"),
    ("learner = 3\n", "learner must be a section"),
    ("mode = fullshared\n", "not a TOML file"),
    ("[guard]\nverify_top_k = 50\n", "invalid kvshare setting verify_top_k: Input should be less than or equal to 20"),
    ("[limits]\nmax_pools = true\n", "invalid kvshare setting max_pools: Input should be a valid integer"),
])
def test_the_config_file_is_strict_and_names_the_key(tmp_path, text, says):
    path = tmp_path / "kvshare.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        config_from_file(str(path))
    assert str(caught.value).startswith(f"--kvshare-config {path}: ") and says in str(caught.value)


def test_the_config_file_is_a_small_regular_file_named_directly(tmp_path):
    real = tmp_path / "real.toml"
    real.write_text('mode = "off"\n')
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="symbolic link"):
        read_config_file(str(link))
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * (MAX_FILE_BYTES // 10 + 1))
    with pytest.raises(ConfigError, match="larger than"):
        read_config_file(str(big))
    with pytest.raises(ConfigError, match="not a regular file"):
        read_config_file(str(tmp_path))
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):  # refused at once, not read until a writer comes
        read_config_file(str(fifo))
    with pytest.raises(ConfigError, match="No such file"):
        read_config_file(str(tmp_path / "missing.toml"))
    assert read_config_file(str(real)) == {"mode": "off"}


def test_few_flags_and_a_short_main_group():
    parser = kvshare_parser()
    flags = [a for a in parser._actions if any(s.startswith("--kvshare-") for s in a.option_strings)]
    assert len(flags) <= 25
    main = next(g for g in parser._action_groups if g.title == "kvshare")
    assert len(main._group_actions) <= 8
