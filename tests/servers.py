"""Launch arguments the server tests share, so that one server serves every test that can.

A server start costs about 40 s of this machine's 2 cores (SGLang's imports in three
processes), more than most server tests themselves. The test pool (``conftest.server_pool``)
keys servers by their arguments, so every test module that asks for the same arguments
gets the same server. Variants that ``POST /kvshare/config`` can set at runtime (mode,
tau, head recompute) reuse the shared server through ``reconfigured`` instead of
starting their own.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import requests

from sglang_kvshare.config import KVShareConfig

OFF = ("--kvshare-mode", "off")
# fullshared with synchronous learning (kvcmas tests switch to it at runtime and need
# their observations learned before the next request) and automatic chat reuse (only
# chat completions without a ``kvshare`` field see it).
# The fidelity guard is off here (its references would add exact rows to the tree between tests); the guard's
# tests turn it on at runtime (POST /kvshare/config verify_rate), which ``restore`` undoes.
# Whole segments of any length are reused (no recompute share, no minimum length), so that a test's short
# segments are reused and the tests of recompute or of the length rule set them (``reconfigured``).
SHARED = ("--kvshare-mode", "fullshared", "--kvshare-auto", "true", "--kvshare-learn-async", "false",
          "--kvshare-verify-rate", "0", "--kvshare-recompute-ratio", "0", "--kvshare-min-reuse-tokens", "0")
# The admin tests need metrics and an admin key; the key guards only writes and the pools
# listing, so the other tests' requests and stats reads are unaffected.
ADMIN_KEY = "kvshare-test-admin-key"
SHARED_EXTRA = ("--enable-metrics", "--admin-api-key", ADMIN_KEY)
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
# Its assembled KV of ``fault:`` slots is noise (``devtools.fault_injection``): the guard's test serves one
# scope bad KV; no other test names such a slot.
SHARED_LAUNCH = {"kvshare_args": SHARED, "extra_args": SHARED_EXTRA, "fault_injection": True}
# The short soak's server (``benchmarks.soak``'s defaults: kvcmas, tau 1, a 3072-token pool). Its
# small KV pool also serves the eviction tests (``small_pool_server``): one server start fewer.
SOAK_KEY = "kvshare-soak-admin-key"
SOAK_HEADERS = {"Authorization": f"Bearer {SOAK_KEY}"}
SOAK_MODE, SOAK_TAU, SOAK_POOL_TOKENS = "kvcmas", 1.0, 3072
ADVERSARY_KEY = "kvshare-adversary-admin-key"
# The plain launch's server: SGLang's own launcher selecting the backend, no kvshare option (the defaults).
PLAIN_LAUNCH = {"stock": True, "extra_args": ("--radix-cache-backend", "kvshare")}
# kvcmas at TP 3 (the real model's 3 KV heads, one per rank). Edge anchors 2: the gate's minimum, so that the third
# content is corrected on every rank (learning is synchronous at TP > 1: the first two teach the pools); whole
# segments of any length are reused (the contents are short). Its start may wait behind the others'.
TP3_LAUNCH = {"kvshare_args": ("--kvshare-mode", "kvcmas", "--kvshare-verify-rate", "0", "--kvshare-admin-open",
                               "true", "--kvshare-edge-anchors", "2", "--kvshare-recompute-ratio", "0",
                               "--kvshare-min-reuse-tokens", "0"),
              "extra_args": ("--tp-size", "3", "--max-total-tokens", "4096"), "startup_timeout": 600.0}
# (module, name, launch): servers one module needs, started in the background once the common ones answer.
DEFERRED_MODULE_SERVERS = (("tests.server.test_plain_launch_server", "plain-backend", PLAIN_LAUNCH),
                           ("tests.server.test_tp_kvcmas_server", "tp3", TP3_LAUNCH))


def soak_pool() -> dict:
    from benchmarks.soak import soak_launch_args

    return soak_launch_args(SOAK_MODE, SOAK_TAU, SOAK_POOL_TOKENS, SOAK_KEY)


def adversary_launch(basetemp: Path) -> dict:
    """The adversary's server (``benchmarks.adversary.launch_args``), its pool file at one path in the session's
    temporary folder, so that the server the suite starts early is the one its test asks for."""
    from benchmarks import adversary

    folder = basetemp / "adversary-server"
    folder.mkdir(exist_ok=True)
    return adversary.launch_args(ADVERSARY_KEY, folder / adversary.POOL_FILE)


def shared_server(server_pool):
    """The one fullshared server most server tests share (see the module docstring)."""
    return server_pool("shared", **SHARED_LAUNCH)


_DEFAULTS = KVShareConfig()
# What every runtime-settable field is restored to after a test changed it (capacity: the
# kvcmas default that ``None`` means; the POST body cannot say ``None``).
_RESTORE = {"mode": "fullshared", "tau": _DEFAULTS.tau, "rank": _DEFAULTS.rank,
            "capacity": _DEFAULTS.replace(mode="kvcmas").effective_capacity, "edge_anchors": _DEFAULTS.edge_anchors,
            "recompute_ratio": 0.0, "min_reuse_tokens": 0,
            "sparse_extend": _DEFAULTS.sparse_extend, "staged": _DEFAULTS.staged, "verify_rate": 0.0,
            "fidelity_target": "", "fidelity_min_samples": _DEFAULTS.fidelity_min_samples,
            "fidelity_band": _DEFAULTS.fidelity_band,
            "verify_burst": _DEFAULTS.verify_burst}


def _post(server, path: str, body: dict | None = None, headers: dict = ADMIN_HEADERS) -> dict:
    resp = requests.post(server.url + path, json=body, timeout=120, headers=headers)
    assert resp.status_code == 200, (path, resp.status_code, resp.text)
    return resp.json() if resp.content else {}


def clean(server, headers: dict = ADMIN_HEADERS) -> None:
    """Empty the anchor pools and SGLang's radix tree: the next test starts cold."""
    _post(server, "/kvshare/reset", headers=headers)
    requests.post(server.url + "/flush_cache", timeout=120, headers=headers).raise_for_status()


def restore(server) -> None:
    """Back to the launch settings of ``SHARED`` with cold caches."""
    _post(server, "/kvshare/config", _RESTORE)
    clean(server)


@contextmanager
def reconfigured(server, **changes: Any) -> Iterator[Any]:
    """The shared server with ``changes`` in force and cold caches; restored afterwards."""
    unknown = set(changes) - set(_RESTORE)
    assert not unknown, f"reconfigured() restores only {sorted(_RESTORE)}, not {sorted(unknown)}"
    if changes:  # none: the launch settings, with cold caches (the route refuses an empty change)
        _post(server, "/kvshare/config", changes)
    clean(server)
    try:
        yield server
    finally:
        restore(server)


@contextmanager
def small_pool_server(server_pool, **changes: Any) -> Iterator[Any]:
    """A fullshared server whose KV pool (3072 tokens) is small enough that the tree evicts, with ``changes``
    (runtime settings) in force.

    It is the soak's server, switched to fullshared with cold caches and switched back (the soak's
    mode and tau, the other changes to what they were, cold caches) afterwards, so the soak still
    starts clean.
    """
    server = server_pool("soak", **soak_pool())
    changes = {"mode": "fullshared", **changes}
    launched = requests.get(server.url + "/kvshare/stats", timeout=120).json()["config"]
    _post(server, "/kvshare/config", changes, SOAK_HEADERS)
    clean(server, SOAK_HEADERS)
    try:
        yield server
    finally:
        back = {**{key: launched[key] for key in changes}, "mode": SOAK_MODE, "tau": SOAK_TAU}
        _post(server, "/kvshare/config", back, SOAK_HEADERS)
        clean(server, SOAK_HEADERS)
