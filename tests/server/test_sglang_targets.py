"""Every SGLang name kvshare depends on resolves against the installed SGLang, and a mismatch fails by name."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from sglang_kvshare.server import sglang_targets as st
from sglang_kvshare.server.sglang_targets import Hook, IncompatibleSGLangError, Target


@pytest.mark.parametrize("target", st.all_targets(), ids=lambda t: t.path.rsplit(".", 2)[-2] + "." + t.path.rsplit(".", 1)[-1])
def test_target_matches_the_installed_sglang(target):
    assert st.check_target(target) is None


def test_a_renamed_target_fails_by_name():
    renamed = Target("sglang.srt.managers.scheduler.Scheduler.handle_rpc_requests", "a planted typo",
                     params=("self", "recv_req"))
    with pytest.raises(IncompatibleSGLangError, match=r"Scheduler\.handle_rpc_requests is missing") as err:
        st.check_targets([st.SCHEDULER_HOOKS[0].target, renamed])
    assert "get_internal_state" not in str(err.value)  # only the target that differs is named


def test_a_changed_signature_or_field_fails_by_name():
    moved = Target("sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req", "planted",
                   params=("self", "request"))
    problem = st.check_target(moved)
    assert problem is not None and "add_chunked_req takes (self, req)" in problem
    reordered = Target("sglang.srt.managers.schedule_policy._PrefillAdmission", "planted",
                       attrs=("extend_len", "prefix_len"), positional=True)
    assert "builds it positionally" in (st.check_target(reordered) or "")
    assert "has no nope" in (st.check_target(Target("sglang.srt.managers.io_struct.RpcReqInput", "planted",
                                                    attrs=("method", "nope"))) or "")


def _call_shape(hook: Hook) -> int:
    """Positional arguments SGLang's wrapper passes to a hook of this kind."""
    n = len(hook.target.params or ()) + int(hook.target.classmethod)  # a classmethod's hook receives cls too
    return n + 1 if hook.kind in ("around", "after") else n  # the original function / the result first


@pytest.mark.parametrize("hook", st.ALL_HOOKS,
                         ids=lambda h: h.hook.rsplit(":", 1)[-1])
def test_every_hook_function_exists_and_takes_the_call(hook):
    fn = st.resolve_hook(hook)
    inspect.signature(fn).bind(*([None] * _call_shape(hook)))  # raises TypeError if it cannot take the call


def test_install_refuses_a_missing_target_and_registers_nothing(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_kvshare.server import plugin

    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    missing = Hook(Target("sglang.srt.managers.scheduler.Scheduler.no_such_method", "planted", params=("self",)),
                   "before", "sglang_kvshare.server.idle_learning:before_sleep_on_idle", "scheduler")
    with pytest.raises(IncompatibleSGLangError, match="no_such_method"):
        plugin.install([missing])
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before


def test_kvshare_is_requested_by_the_launcher_config_or_the_backend_flag():
    from sglang_kvshare.server.plugin import kvshare_requested

    assert kvshare_requested(["--model-path", "m", "--radix-cache-backend", "kvshare"], {})
    assert kvshare_requested(["--radix-cache-backend=kvshare"], {})
    assert kvshare_requested([], {"SGLANG_KVSHARE_CONFIG": "{}"})
    assert not kvshare_requested(["--model-path", "m"], {})
    assert not kvshare_requested(["--radix-cache-backend", "radix"], {})


_PLAIN_LAUNCH = """
import sys
sys.argv = ["sglang.launch_server", "--model-path", "m", "--port", "1"]
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.mem_cache.registry import registered_radix_cache_backends
load_plugins()
ours = sorted(t for t, hooks in HookRegistry._hooks.items()
              if any(getattr(h, "__module__", "").startswith("sglang_kvshare") for _, h, _ in hooks))
print("backends", "kvshare" in registered_radix_cache_backends())
print("hooks", ours)
print("modules", sorted(m for m in sys.modules if m.startswith("sglang_kvshare.") and m not in
                         ("sglang_kvshare.server.cpu_standins",)))
"""


def test_a_plain_sglang_launch_gets_no_kvshare_hook():
    """SGLang loads every installed plugin in every server; a plain one gets the backend name, nothing else."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "SGLANG_KVSHARE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", _PLAIN_LAUNCH], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["backends"] == "True"  # selectable with --radix-cache-backend kvshare
    assert lines["hooks"] == "[]"
    # Only the plugin's own small modules load: no chat, admin or cache code in a plain server.
    assert set(eval(lines["modules"])) <= {"sglang_kvshare.config", "sglang_kvshare.server",
                                           "sglang_kvshare.server.plugin", "sglang_kvshare.server.sglang_targets",
                                           "sglang_kvshare.guard", "sglang_kvshare.guard.target",
                                           "sglang_kvshare.protocol"}  # the config's bound on a head
