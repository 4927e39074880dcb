"""The launcher's argument handling, CPU defaults and config hand-off (no server)."""

from __future__ import annotations

import pytest

from sglang_kvshare.config import ENV_VAR, KVShareConfig
from sglang_kvshare.server.launcher import (cpu_thread_env, main, parallel_ranks, parse_kvshare, split_argv,
                                           with_defaults)


def test_split_argv_separates_kvshare_options_with_values():
    ours, theirs = split_argv(["--model-path", "m", "--kvshare-mode", "fullshared", "--port", "1",
                               "--kvshare-tau=0.2"])
    assert ours == ["--kvshare-mode", "fullshared", "--kvshare-tau=0.2"]
    assert theirs == ["--model-path", "m", "--port", "1"]


def test_parse_kvshare_builds_a_validated_config():
    config, rest = parse_kvshare(["--kvshare-mode", "kvcmas", "--kvshare-rank", "0", "--model-path", "m"])
    assert config.mode == "kvcmas" and rest == ["--model-path", "m"]
    assert config.effective_rank is None and config.effective_capacity == 10


def test_bad_kvshare_value_is_a_clear_cli_error():
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-tau", "3"])
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-mode", "magic"])
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-mode", "kvcomm"])  # an offline baseline, never served
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-edge-anchors", "1"])
    config, _ = parse_kvshare(["--kvshare-edge-anchors", "12", "--kvshare-capacity", "6"])
    assert config.edge_anchors == 12 and config.effective_edge_anchors == 6  # an edge holds at most the pool
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-pool-file", " "])
    assert parse_kvshare(["--kvshare-pool-file", "pools/team.pt"])[0].pool_file == "pools/team.pt"
    with pytest.raises(SystemExit):
        parse_kvshare(["--kvshare-pool-save-interval-s", "-1"])


@pytest.mark.parametrize("flag, value, says", [("--kvshare-verify-rate", "1.5", "verify_rate"),
                                               ("--kvshare-fidelity-target", "top1>0.99", "top1>=")])
def test_bad_guard_flags_are_clear_cli_errors(capsys, flag, value, says):
    with pytest.raises(SystemExit):
        parse_kvshare([flag, value])
    assert says in capsys.readouterr().err


def test_the_launcher_serves_the_kvshare_backend_only():
    with pytest.raises(SystemExit, match="kvshare backend only"):
        main(["--model-path", "m", "--radix-cache-backend", "radix"])


def test_cpu_defaults_fill_in_but_never_override_user_flags():
    argv = with_defaults(["--model-path", "m", "--dtype", "bfloat16"], cpu=True)
    assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
    assert argv[argv.index("--radix-cache-backend") + 1] == "kvshare"
    assert "--sleep-on-idle" in argv  # an idle CPU server must not take a core from a busy one
    assert "--attention-backend" not in with_defaults(["--model-path", "m"], cpu=False)


def test_each_cpu_rank_gets_its_own_bind_group(monkeypatch):
    """SGLang's CPU path refuses to start a DP or TP rank without a bind group of its own."""
    assert parallel_ranks(["--model-path", "m"]) == 1
    assert parallel_ranks(["--dp-size", "2", "--tp", "3"]) == 6 and parallel_ranks(["--dp=2"]) == 2
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert cpu_thread_env()["SGLANG_CPU_OMP_THREADS_BIND"] == "0-7"
    env = cpu_thread_env(2)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0-3|4-7" and env["OMP_NUM_THREADS"] == "4"
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert cpu_thread_env(3)["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1|0"  # fewer cores than ranks: shared


def test_config_round_trips_through_the_environment(monkeypatch):
    config = KVShareConfig(mode="fullshared", tau=0.1, capacity=4)
    monkeypatch.setenv(ENV_VAR, config.to_json())
    assert KVShareConfig.from_env() == config
    monkeypatch.delenv(ENV_VAR)
    # Selecting the backend (sglang.launch_server --radix-cache-backend kvshare) asks for kvshare: the defaults.
    assert KVShareConfig.from_env() == KVShareConfig()


def test_help_lists_kvshare_options_next_to_sglang_options(capsys):
    # In-process: a subprocess would import SGLang again (about 20 s here); every server
    # the suite starts runs ``python -m sglang_kvshare.launch_server`` itself.
    main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--kvshare-mode", "--kvshare-tau", "--model-path", "--radix-cache-backend"):
        assert flag in out
    # The few options users set come first, the components' flags after them, SGLang's own last.
    assert out.index("--kvshare-mode {") < out.index("--kvshare-config FILE") < out.index("kvshare guard:")
    assert out.index("kvshare guard:") < out.index("kvshare kvcmas:") < out.index("SGLang's options")
    assert "--kvshare-learn-yield-s" not in out and "kvshare limits:" not in out  # in the config file only
