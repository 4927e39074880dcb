"""Admin traffic of the soak: resets, config writes, mode switches and calls without the key, and reset probes
(an estimate hit before ``POST /kvshare/reset`` or a config write, none after)."""

from __future__ import annotations

import time

from benchmarks.soak.client import SUFFIX, Client, estimated_tokens, system_part
from sglang_kvshare.frontend.builder import build_request, private_part


ADMIN_CALLS = ("mode_off_and_back", "reset", "no_key", "tau", "reset_slot", "pools", "mode_switch", "bad_config")

def admin_op(c: Client) -> None:
    """The admin calls in turn (shared counter), so even a short run makes each of them."""
    choice = ADMIN_CALLS[c.s.turn("admin") % len(ADMIN_CALLS)]
    c.s.rec.fault(f"admin_{choice}")
    with c.s.admin_lock:
        if choice in ("reset", "reset_slot") and c.s.monitor is not None:
            # A reset may zero the counters: read them first, so no count is lost.
            c.s.monitor.observe(c.s.endpoint.call("stats", "GET", "/kvshare/stats"))
        if choice == "reset":
            c.admin("/kvshare/reset")
        elif choice == "reset_slot":
            known = c.rng.random() < 0.5
            c.admin("/kvshare/pools/query/reset" if known else
                    f"/kvshare/pools/never-{c.rng.getrandbits(32):x}/reset",
                    expect=200 if known else 404)
        elif choice == "tau":
            c.admin("/kvshare/config", {"tau": c.rng.choice([0.3, 0.7, c.s.tau])})
            time.sleep(1.0)
            c.admin("/kvshare/config", {"tau": c.s.tau})
        elif choice in ("mode_off_and_back", "mode_switch"):
            other = "fullshared" if c.s.mode == "kvcmas" else "kvcmas"
            c.admin("/kvshare/config", {"mode": "off" if choice == "mode_off_and_back" else other})
            time.sleep(c.rng.uniform(0.5, 3.0))
            c.admin("/kvshare/config", {"mode": c.s.mode, "tau": c.s.tau})
        elif choice == "bad_config":
            c.admin("/kvshare/config", c.rng.choice([{"tau": 2}, {"mode": "kvcomm"}, {}]), expect=422)
        elif choice == "no_key":
            if c.s.endpoint.admin_key:
                c.admin("/kvshare/reset", key=False, expect=401)
                out = c.s.endpoint.call("admin", "GET", "/kvshare/pools")
                if out.status != 401:
                    c.s.rec.find("pools_need_admin_key", {"status": out.status})
        else:
            out = c.s.endpoint.call("admin", "GET", "/kvshare/pools", admin=True)
            if out.status != 200:
                c.s.rec.find("admin_answers", {"path": "/kvshare/pools", "status": out.status})


def reset_probe(c: Client) -> None:
    """An assembled prompt repeated (its estimate is hit), then ``POST /kvshare/reset`` or a
    ``/kvshare/config`` write (in turn), then repeated again: that repeat must hit no estimate."""
    variant = ("reset", "config")[c.s.turn("reset_probe") % 2]
    text = c.s.probe_text()
    suffix = SUFFIX.replace("briefly", f"briefly (case {c.rng.getrandbits(32):x})")
    ep = c.s.endpoint
    with c.s.admin_lock:
        if c.s.monitor is not None:  # a reset may zero the counters: read them first
            c.s.monitor.observe(ep.call("stats", "GET", "/kvshare/stats"))
        switched = c.s.mode != "fullshared"
        if switched:  # fullshared aligns whenever a source exists: the analyst is assembled
            c.admin("/kvshare/config", {"mode": "fullshared"})
        head, cp = build_request(c.s.tokenizer, "analyst", [private_part(system_part("analyst"))])
        ep.generate("reset_probe", head, custom_params=cp, max_new_tokens=1)
        c.annotated("reset_probe", "solver", text, None, suffix=suffix)
        _, first = c.annotated("reset_probe", "analyst", text, None, suffix=suffix)
        _, before = c.annotated("reset_probe", "analyst", text, None, suffix=suffix)
        if variant == "reset":
            c.admin("/kvshare/reset")
            _, after = c.annotated("reset_probe", "analyst", text, None, suffix=suffix)
            if switched:
                c.admin("/kvshare/config", {"mode": c.s.mode, "tau": c.s.tau})
        else:
            c.admin("/kvshare/config", {"mode": c.s.mode, "tau": c.s.tau})
            _, after = c.annotated("reset_probe", "analyst", text, None, suffix=suffix)
    hit_before = int(before.report.get("tokens_estimate_hit") or 0) if before.status == 200 else 0
    hit_after = int(after.report.get("tokens_estimate_hit") or 0) if after.status == 200 else None
    keys = ("tokens_exact_hit", "tokens_estimate_hit", "tokens_aligned", "tokens_corrected", "tokens_prefilled")
    probe = {"variant": variant, "assembled_tokens": estimated_tokens(first.report) if first.status == 200 else 0,
             "estimate_hit_before": hit_before, "armed": hit_before > 0, "estimate_hit_after": hit_after,
             "after_report": {k: after.report.get(k) for k in keys} if after.status == 200 else None}
    c.s.rec.keep("reset_probes", probe)
    if hit_before > 0 and hit_after:
        c.s.rec.find("no_estimates_after_reset", probe)


OPS = {"admin": admin_op, "reset_probe": reset_probe}
