"""Adversarial checks against one live kvshare server: ``python -m benchmarks.adversary``.

Each attack is traffic a hostile client (or a careless operator) can send, and each ends in a verdict in
``benchmarks/results/adversary.json``:

* ``long_chats``: automatic-mode chats of 500 to 4,000 messages (longer than the model's context) are answered
  as stock answers them (the same body with ``"kvshare": false``) within 2 s, and a short chat sent meanwhile
  is delayed at most 0.2 s (``adversary_tenants``);
* ``forged_workflow``: under ``--kvshare-reuse-scope salt-required``, a request without ``cache_salt`` naming
  another workflow (annotation ``workflow``, chat ``user``) is served none of its KV and sees none of its
  agents as ``source_agent`` (``adversary_tenants``);
* ``verify_keys``: at verify rate 1, ``n = 1``, ``n = 2``, a stream and a request that asked for logprobs
  answer with the keys and greedy outputs they have at rate 0, the kvshare report included
  (``adversary_guard``, as the next three);
* ``sampling_not_error``: ``logit_bias`` and ``json_schema`` requests served approximated KV are not scored as
  KV error: their top-1 estimate stays that of a plain request on the same KV;
* ``pin_bounds``: pins past the request bound of ``recompute_head`` and malformed settings get a 4xx, a pin
  at the bound a 200, and the pinned agent's requests 200s;
* the name flood: more agent names than every table holds (the guard's display and scope tables, the cache's
  namespaces and slots), under random-hex cache salts and extra keys, the admin routes and ``/metrics`` read
  after it. ``pins_survive_flood``: two agents pinned dense before it (one salted, one of the default
  namespace pinned by name) are still listed and served dense; ``metrics_bounded``: at most the guard's cap of
  per-scope series on ``/metrics``, none labelled with an agent name;
* ``hostile_files``: hostile guard files stop the launch with a message naming the file, a guard file is
  written private and through no planted symlink, and hostile pool files (made from the server's own) stop
  a real launch (``adversary_files``; after the server is down).

Overall: ``no_secret_in_any_answer`` (no salt or extra key of the run in any answer, admin route or metric),
``no_5xx``, ``nothing_lost``. The HTTP side (endpoint with timeouts, tallies) is ``benchmarks.soak``'s.
``--short`` is the form the test suite runs (``tests/test_adversary.py``), against a server it shares.
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.adversary_client import Run, Watch
from benchmarks.adversary_files import hostile_files
from benchmarks.adversary_guard import name_flood, pin_bounds, sampling_not_error, verify_keys
from benchmarks.adversary_tenants import forged_workflow, long_chats
from benchmarks.harness import RESULTS, run_meta, write_json
from benchmarks.soak import Endpoint

POOL_FILE = "pools.pt"
# long_chats: message counts, each chat built longer than twice the context. flood_names: agent names sent; every
# ``served_every``-th is a request the server serves (each of a new cache salt while flood_namespaces last: the
# cache keeps 64 namespaces); the others are refused by SGLang's own validation (a negative max_new_tokens)
# after the guard has read their annotation, a cheap way past the guard's tables. slot_requests: served
# requests with 62 new slot names each, in one namespace (256 kept). pin_flood: names pinned then unpinned (the
# guard's scope table holds 256). pool_files: hostile pool files launched for real (None: all).
FORMS = {"short": {"long_chats": (1000,), "flood_names": 1100, "served_every": 16, "flood_namespaces": 70,
                   "slot_requests": 5, "pin_flood": 300, "pool_files": ("wrong_shapes",)},
         "full": {"long_chats": (500, 1000, 2000, 4000), "flood_names": 2200, "served_every": 1,
                  "flood_namespaces": 600, "slot_requests": 20, "pin_flood": 600, "pool_files": None}}


def launch_args(admin_key: str, pool_file: Path) -> dict:
    """``ServerProcess`` keyword arguments of the adversary's server: fullshared, automatic chat, synchronous
    learning, the guard measuring (rate set at runtime; no guard file, which would restore an evicted pin),
    ``pool_file`` (saved once, as the model identity of the hostile pool files), metrics and an admin key; the
    reuse scope ``salt-required`` where this sglang-kvshare offers it."""
    from sglang_kvshare.config import REUSE_SCOPES

    scope = ("--kvshare-reuse-scope", "salt-required") if "salt-required" in REUSE_SCOPES else ()
    return {"kvshare_args": ("--kvshare-mode", "fullshared", "--kvshare-auto", "true", "--kvshare-learn-async", "false",
                             "--kvshare-verify-rate", "0", "--kvshare-min-reuse-tokens", "0", "--kvshare-pool-file", str(pool_file), *scope),
            "extra_args": ("--enable-metrics", "--admin-api-key", admin_key)}


def save_pool_file(r: Run) -> Optional[Path]:
    """The server's own pool file (kvcmas for a moment, ``POST /kvshare/save``, back to fullshared): the model
    identity the hostile pool files copy, exactly as the server checks it."""
    r.configure(mode="kvcmas")
    try:
        out = r.admin("save", "POST", "/kvshare/save")
    finally:
        r.configure(mode="fullshared")
    saved = (out.body.get("saved") or {}) if out.status == 200 and isinstance(out.body, dict) else {}
    path = Path(saved["path"]) if saved.get("path") else None
    return path if path is not None and path.is_file() else None


def run(url: str, admin_key: str, tokenizer: Any, *, form: str = "short", timeout: float = 120.0) -> dict:
    """Every attack against the running server at ``url`` (launched with ``launch_args``); the results:
    ``verdicts``, the details of each attack and ``saved_pool`` (the server's own pool file, or None)."""
    settings = FORMS[form]
    watch = Watch()
    r = Run(Endpoint(url, admin_key, watch, timeout=timeout), tokenizer)
    t0 = time.monotonic()
    r.admin("reset", "POST", "/kvshare/fidelity/reset")
    saved_pool = save_pool_file(r)
    attacks: dict[str, Any] = {}
    for name, attack in (("verify_keys", lambda: verify_keys(r)), ("sampling_not_error", lambda: sampling_not_error(r)),
                         ("pin_bounds", lambda: pin_bounds(r)), ("name_flood", lambda: name_flood(r, settings)),
                         ("forged_workflow", lambda: forged_workflow(r)),
                         ("long_chats", lambda: long_chats(r, settings["long_chats"]))):
        t = time.monotonic()
        try:
            attacks[name] = attack()
        except Exception as exc:  # noqa: BLE001 - a failed attack is a failed verdict, the others still run
            attacks[name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        attacks[name]["seconds"] = round(time.monotonic() - t, 1)
    for path in ("/kvshare/stats", "/kvshare/fidelity", "/kvshare/pools"):  # once more, after every attack
        r.admin("admin_read", "GET", path)
    r.ep.call("metrics", "GET", "/metrics")
    r.admin("reset", "POST", "/kvshare/fidelity/reset")
    flood = attacks["name_flood"]
    totals = watch.totals()
    verdicts = {name: attacks[name].get("passed") for name in attacks if name != "name_flood"}
    verdicts.update(pins_survive_flood=bool(flood.get("pins_survive_flood")),
                    metrics_bounded=bool(flood.get("metrics_bounded")),
                    no_secret_in_any_answer=not watch.leaks, no_5xx=totals["server_5xx"] == 0,
                    nothing_lost=totals["lost"] == 0)
    return {"form": form, "server_s": round(time.monotonic() - t0, 1),
            "saved_pool": None if saved_pool is None else str(saved_pool), "verdicts": verdicts,
            "passed": all(v is True for v in verdicts.values()), "totals": totals,
            "secrets": {"count": len(watch.secrets), "answers_scanned": watch.scanned, "leaks": watch.leaks},
            "statuses": {k: dict(sorted((str(s), n) for s, n in c.items())) for k, c in watch.statuses.items()},
            "attacks": attacks}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.adversary", description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="the suite's form: one long-chat size, smaller floods, "
                                                         "one hostile pool file launched")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/adversary.json)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from devtools.models import prepare
    from devtools.server_process import ServerProcess

    model_path = str(prepare("smollm2-135m"))
    key = secrets.token_hex(16)
    form = "short" if args.short else "full"
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        with ServerProcess(model_path=model_path, **launch_args(key, folder / POOL_FILE)) as server:
            data = run(server.url, key, AutoTokenizer.from_pretrained(model_path), form=form)
        # The hostile files once the server is down: the pool files' launches run alone.
        files = hostile_files(folder / "hostile", model_path, data["saved_pool"] and Path(data["saved_pool"]),
                              FORMS[form]["pool_files"])
    data["attacks"]["hostile_files"] = files
    data["verdicts"]["hostile_files"] = files["passed"]
    data["passed"] = data["passed"] and files["passed"]
    command = "python -m benchmarks.adversary" + (" --short" if args.short else "")
    data = {"meta": run_meta(command), "command": command, **data}
    out = Path(args.out or RESULTS / "adversary.json")
    write_json(out, data)
    print(json.dumps({"passed": data["passed"], "verdicts": data["verdicts"], "out": str(out)}, indent=1))
    return 0 if data["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
