"""The soak's checks: the ``Monitor`` that polls stats, chat memory and ``/metrics`` during the run, the
server-state readers (bounds, allocator, log), and the verdicts and JSON summary at the end."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from typing import Any, Optional

from benchmarks.harness import machine, run_meta
from benchmarks.soak.client import NEAR_TIE, Endpoint, Outcome, Recorder
from benchmarks.soak.faults import foreign_sources

RETRACT_LOG = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")
RETRACTED_METRIC = "sglang:num_retracted_requests_total"
METRICS_PREFIX = "sglang_kvshare_"
ESTIMATE_TAGS = ("leak_probe", "leak_probe_off", "plain_after_estimate")  # plain prompts assembled before


class Monitor:
    """Polls ``/kvshare/stats`` every ``period`` s (answers, bounds, the plain-estimate counter), the chat
    layer's answer memory (``GET /kvshare/chat``) every ``chat_every`` polls and ``/metrics`` every
    ``metrics_every`` polls."""

    def __init__(self, endpoint: Endpoint, period: float = 2.0, chat_every: int = 3, metrics_every: int = 5) -> None:
        self.endpoint, self.period, self.chat_every, self.metrics_every = endpoint, period, chat_every, metrics_every
        self.stop = threading.Event()
        self.polls = 0
        self.over_limit: dict[str, dict] = {}
        self.limit_keys: Optional[set] = None
        self.plain_from_estimates: list[int] = []
        self.workspace_polls = 0  # stats polls whose limits and usage both had read_workspace_bytes
        self.over_memory_bound: list[dict] = []
        self.chat_polls = 0
        self.chat_outputs_max_bytes = 0
        self.chat_over: list[dict] = []
        self.metrics_polls = 0
        self.metrics_ok = 0
        self.metrics_bad: list[dict] = []
        self.metrics_kvshare_lines = 0
        self.retracted_metric: list[float] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        n = 0
        while not self.stop.wait(self.period):
            n += 1
            self.observe(self.endpoint.call("stats", "GET", "/kvshare/stats"))
            if n % self.chat_every == 0:
                self.observe_chat(self.endpoint.call("chat_stats", "GET", "/kvshare/chat"))
            if n % self.metrics_every == 0:
                self.observe_metrics(self.endpoint.call("metrics", "GET", "/metrics"))

    def observe(self, out: Outcome) -> None:
        """Record one stats answer (called from the poll thread and before admin resets)."""
        self.polls += 1
        if out.status != 200 or not isinstance(out.body, dict):
            return
        stats = out.body
        bounds = check_bounds(stats)
        if bounds["checked"]:
            self.limit_keys = set(bounds["keys"])
            for key, row in bounds["over"].items():
                self.over_limit.setdefault(key, row)
            if "read_workspace_bytes" in bounds["keys"]:
                self.workspace_polls += 1
            bound, usage = stats.get("memory_bound_bytes"), stats["usage"]
            held = sum(int(usage.get(k) or 0) for k in ("anchor_bytes", "learn_queue_bytes", "read_workspace_bytes"))
            if isinstance(bound, (int, float)) and held > bound and len(self.over_memory_bound) < 10:
                self.over_memory_bound.append({"held_bytes": held, "memory_bound_bytes": bound})
        counter = (stats.get("counters") or {}).get("plain_tokens_from_estimates")
        if counter is not None:
            self.plain_from_estimates.append(int(counter))

    def observe_chat(self, out: Outcome) -> None:
        """The chat answer memory is bounded in bytes (and answers): ``outputs.bytes <= outputs.max_bytes``."""
        outputs = out.body.get("outputs") if out.status == 200 and isinstance(out.body, dict) else None
        if not isinstance(outputs, dict) or "bytes" not in outputs:
            return
        self.chat_polls += 1
        self.chat_outputs_max_bytes = max(self.chat_outputs_max_bytes, int(outputs["bytes"]))
        over = outputs["bytes"] > outputs.get("max_bytes", float("inf")) or \
            outputs.get("size", 0) > outputs.get("capacity", float("inf"))
        if over and len(self.chat_over) < 10:
            self.chat_over.append({k: outputs.get(k) for k in ("bytes", "max_bytes", "size", "capacity")})

    def observe_metrics(self, out: Outcome) -> None:
        """``/metrics`` answers 200 and carries ``sglang_kvshare_*`` lines; SGLang's retraction counter."""
        self.metrics_polls += 1
        text = out.body if isinstance(out.body, str) else ""
        lines = text.splitlines()
        kvshare = sum(ln.startswith(METRICS_PREFIX) for ln in lines)
        if out.status == 200 and kvshare:
            self.metrics_ok += 1
            self.metrics_kvshare_lines = kvshare
        elif len(self.metrics_bad) < 10:
            self.metrics_bad.append({"status": out.status, "kvshare_lines": kvshare, "head": text[:200]})
        if out.status == 200:  # the counter appears once SGLang first retracts: absent is 0
            self.retracted_metric.append(sum(float(ln.rsplit(" ", 1)[-1]) for ln in lines
                                             if ln.startswith(RETRACTED_METRIC)))


def check_bounds(stats: dict) -> dict:
    """Every key present in both ``stats["limits"]`` and ``stats["usage"]`` must have usage <= limit."""
    limits, usage = stats.get("limits"), stats.get("usage")
    if not isinstance(limits, dict) or not isinstance(usage, dict):
        return {"checked": False, "missing": [k for k in ("limits", "usage") if not isinstance(stats.get(k), dict)],
                "keys": [], "over": {}}
    keys = sorted(set(limits) & set(usage))
    over = {}
    for k in keys:
        try:
            if limits[k] is not None and float(usage[k]) > float(limits[k]):
                over[k] = {"usage": usage[k], "limit": limits[k]}
        except (TypeError, ValueError):
            over[k] = {"usage": usage[k], "limit": limits[k], "error": "not a number"}
    return {"checked": True, "missing": [], "keys": keys, "over": over}


def pool_ok(pool: dict) -> bool:
    return pool["protected"] == 0 and pool["available"] + pool["evictable"] == pool["total"]


def wait_idle(endpoint: Endpoint, timeout: float = 120.0) -> Optional[dict]:
    """Stats once no request holds KV and the learning queue is empty (or at the timeout)."""
    deadline = time.monotonic() + timeout
    stats = None
    while time.monotonic() < deadline:
        stats = endpoint.stats()
        if stats and stats["kv_pool_tokens"]["protected"] == 0 and not stats.get("pending_observations"):
            return stats
        time.sleep(1.0)
    return stats


def flush(endpoint: Endpoint, attempts: int = 20) -> int:
    """SGLang's ``/flush_cache`` (refused while requests run, so retried); its last status."""
    status = 0
    for _ in range(attempts):
        out = endpoint.call("flush", "POST", "/flush_cache", admin=True)
        status = out.status
        if status == 200:
            return status
        time.sleep(1.0)
    return status


def retractions(text: str) -> dict:
    """SGLang's decode retractions in a server log: ``KV cache pool is full. Retract requests.``"""
    counts = [int(m.group(1)) for m in RETRACT_LOG.finditer(text)]
    return {"events": len(counts), "requests_retracted": sum(counts),
            "lines": [ln.strip()[-160:] for ln in text.splitlines() if "Retract requests" in ln][:10]}


def scan_log(text: str) -> dict:
    after = text.split("fired up")[-1]
    needles = ("Traceback", "memory leak detected", "use-after-free", "double free", "Exception in thread",
               "Segmentation fault")
    found = {n: after.count(n) for n in needles if n in after}
    lines = [ln for ln in after.splitlines() if any(n in ln for n in needles)]
    return {"found": found, "lines": lines[:20]}


def verdicts(res: dict, replay_rows: list[dict]) -> dict:
    """Each check: True, False, or "not checked" (the server cannot answer it yet: a missing field)."""
    rec: Recorder = res["rec"]
    mon: Monitor = res["monitor"]
    tot, m, bounds, found = rec.totals(), rec.malformed, res["bounds"], rec.finding_counts
    c = verdict_counts(res)
    real = [r for r in replay_rows if r.get("same") is False and not r.get("near_tie")]

    def unless(missing: Any, ok: bool) -> Any:
        return "not checked" if missing else ok

    return {
        "no_crash": res["alive"] and res["health"] == 200 and not res["server_log"]["found"],
        "no_5xx": tot["server_5xx"] == 0,
        "nothing_lost": tot["lost"] == 0 and res["clients_stuck_at_end"] == 0 and found["nothing_lost"] == 0,
        "malformed_get_4xx": m["sent"] > 0 and m["got_4xx"] == m["sent"],
        "valid_requests_served": found["valid_requests_served"] == 0,
        "allocator_restored": res["allocator"]["end_ok"] and res["allocator"]["free_plus_evictable_same_as_start"],
        "kvshare_within_bounds": unless(not bounds["checked"] and mon.limit_keys is None,
                                        not bounds["over"] and not mon.over_limit),
        "zero_cross_salt_reuse": bool(rec.salt_probes) and not any(p["aligned"] or p["corrected"]
                                                                   for p in rec.salt_probes),
        "plain_exact_structural": unless(not mon.plain_from_estimates, max(mon.plain_from_estimates or [0]) == 0),
        "plain_exact_by_output": bool(replay_rows) and not real and all(r.get("same") is not None
                                                                        for r in replay_rows),
        "harness_ok": found["harness_errors"] == 0,
        "zero_cross_scope_reuse": unless(not rec.scope_probes, c["zero_cross_scope_reuse"]["reused_tokens"] == 0
                                         and c["zero_cross_scope_reuse"]["found_a_foreign_copy"] == 0),
        "zero_foreign_agent_names": unless(not rec.chat_reports, c["zero_foreign_agent_names"]["foreign"] == 0
                                           and c["zero_foreign_agent_names"]["unknown"] == 0),
        "chat_hostile_answered": unless(not rec.hostile, c["chat_hostile_answered"]["not_ok"] == 0),
        "chat_reports_carried": unless(not rec.chat_reports, found["chat_reports_carried"] == 0),
        "memory_within_bounds": memory_verdict(mon),
        "no_estimates_after_reset": unless(not c["no_estimates_after_reset"]["armed"],
                                           c["no_estimates_after_reset"]["hit_after_reset"] == 0),
        "metrics_served": unless(not mon.metrics_polls, mon.metrics_ok == mon.metrics_polls),
    }


def memory_verdict(mon: Monitor) -> Any:
    """Stats usage <= limits at every poll, the read workspace among them; what kvshare holds <=
    ``memory_bound_bytes``; the chat answer memory within its byte (and answer) bound."""
    if not mon.workspace_polls and not mon.chat_polls:
        return "not checked"
    return (not (mon.over_limit or mon.over_memory_bound or mon.chat_over)
            and mon.workspace_polls > 0 and mon.chat_polls > 0)


def hostile_ok(row: dict) -> bool:
    """A hostile chat: no 5xx; answered (a 200 without an error chunk) when stock answers it, or a 4xx
    whose message names the fix; a 4xx on one stock SGLang answers the same way is fine too."""
    status = row["status"]
    if status == 200:
        return not row["refuse"] and not row["stream_errors"]
    if not 400 <= status < 500:
        return False  # no answer, a 5xx, or another status
    if row["fix"] is None:
        return row.get("stock_status") == status
    return str(row["fix"]).lower() in row["message"].lower()


def verdict_counts(res: dict) -> dict:
    """Per new verdict, the counts behind it (also written to the JSON)."""
    rec: Recorder = res["rec"]
    mon: Monitor = res["monitor"]
    probes, resets, hostile, tot = rec.scope_probes, rec.reset_probes, rec.hostile, rec.totals()
    agents = foreign_sources(rec.chat_reports)
    chat_status = sum((rec.statuses.get(label, Counter()) for label in ("chat", "chat_hostile", "scope_probe",
                                                                          "retract_burst")), Counter())
    return {
        "zero_cross_scope_reuse": {
            "probes": len(probes), "by_variant": dict(Counter(p["variant"] for p in probes)),
            "explicit": sum(p["explicit"] for p in probes),
            "control_found_a_copy": sum(p["control_found_a_copy"] for p in probes),
            "reached_the_shared_text": sum(p["reached"] for p in probes),
            "sensitive": sum(p["control_found_a_copy"] and p["reached"] for p in probes),
            "reused_tokens": sum(p["reused_tokens"] for p in probes),
            "found_a_foreign_copy": sum(bool(p["found"]) for p in probes),
            "generate_salt_probes": len(rec.salt_probes), "examples": probes[:6]},
        "zero_foreign_agent_names": {k: agents[k] for k in ("reports", "scopes", "named_sources", "foreign", "unknown",
                                                            "examples")},
        "chat_hostile_answered": {
            "sent": len(hostile), "kinds": len({h["kind"] for h in hostile}),
            "ok_200": sum(h["status"] == 200 and hostile_ok(h) for h in hostile),
            "refused_4xx_naming_the_fix": sum(h["status"] != 200 and hostile_ok(h) for h in hostile),
            "server_5xx": sum(h["status"] >= 500 for h in hostile), "lost": sum(not h["status"] for h in hostile),
            "not_ok": sum(not hostile_ok(h) for h in hostile),
            "by_kind": {k: dict(Counter(str(h["status"]) for h in hostile if h["kind"] == k))
                        for k in sorted({h["kind"] for h in hostile})},
            "failures": [{k: v for k, v in h.items() if k != "body"} for h in hostile if not hostile_ok(h)][:10]},
        "chat_reports_carried": {
            "chat_requests": dict(rec.chat), "reports": len(rec.chat_reports),
            "findings": rec.finding_counts["chat_reports_carried"]},
        "memory_within_bounds": {
            "stats_polls": mon.polls, "polls_with_read_workspace": mon.workspace_polls,
            "over_limit": mon.over_limit, "over_memory_bound": mon.over_memory_bound,
            "chat_polls": mon.chat_polls, "chat_outputs_max_bytes_seen": mon.chat_outputs_max_bytes,
            "chat_over": mon.chat_over},
        "no_estimates_after_reset": {
            "probes": len(resets), "armed": sum(p["armed"] for p in resets),
            "by_variant": dict(Counter(p["variant"] for p in resets)),
            "hit_after_reset": sum(bool(p["armed"] and p["estimate_hit_after"]) for p in resets),
            "examples": resets[:6]},
        "metrics_served": {"polls": mon.metrics_polls, "ok": mon.metrics_ok,
                           "kvshare_lines": mon.metrics_kvshare_lines, "bad": mon.metrics_bad},
        "no_5xx": {"server_5xx": tot["server_5xx"], "chat_requests": sum(chat_status.values()),
                   "chat_server_5xx": sum(v for k, v in chat_status.items() if k >= 500)},
        "nothing_lost": {"lost": tot["lost"], "chat_lost": chat_status.get(0, 0),
                         "clients_stuck_at_end": res["clients_stuck_at_end"],
                         "incomplete": rec.finding_counts["nothing_lost"]},
    }


def summarize(args, res: dict, replay_rows: list[dict], wall: float) -> dict:
    rec: Recorder = res["rec"]
    mon: Monitor = res["monitor"]
    v = verdicts(res, replay_rows)
    passed = all(x is True or x == "not checked" for x in v.values())
    command = "python -m benchmarks.soak " + " ".join(args.argv)
    return {
        "meta": run_meta(command.strip()),
        "command": command,
        "machine": machine(),
        "settings": {k: getattr(args, k) for k in ("mode", "tau", "clients", "minutes", "replay", "max_total_tokens",
                                                   "slot_names", "seed", "warm_rounds", "retract_burst")},
        "passed": passed,
        "verdicts": v,
        "not_checked": [k for k, x in v.items() if x == "not checked"],
        "wall_s": round(wall, 1), "warmup_s": res["warmup_s"], "load_s": res["load_s"],
        "totals": rec.totals(),
        "operations_by_kind": dict(rec.sent),
        "requests_by_label": {k: dict(sorted((str(s), n) for s, n in c.items())) for k, c in rec.statuses.items()},
        "faults_injected": dict(sorted(rec.faults.items())),
        "faults_injected_total": sum(rec.faults.values()),
        "malformed": rec.malformed,
        "distinct_slot_names": res["slot_names"],
        "admin_calls": dict(rec.admin),
        "annotated_tokens": dict(rec.reuse),
        "annotated_fallbacks": dict(rec.fallbacks),
        "salt_probes": {"n": len(rec.salt_probes), "with_reuse": sum(bool(p["aligned"] or p["corrected"])
                                                                    for p in rec.salt_probes),
                        "examples": rec.salt_probes[:10]},
        "plain_requests": {"n": len(rec.plain), "by_tag": dict(Counter(p["tag"] for p in rec.plain)),
                           "with_cached_tokens": sum(p["cached_tokens"] > 0 for p in rec.plain)},
        "plain_tokens_from_estimates": {
            "readings": len(mon.plain_from_estimates),
            "max": max(mon.plain_from_estimates) if mon.plain_from_estimates else None,
            "note": None if mon.plain_from_estimates else "the counter never appeared in /kvshare/stats: either the "
                    "server lacks it or it exists only once non-zero; the output replay still checks plain requests"},
        "replay": {"n": len(replay_rows), "same": sum(r.get("same") is True for r in replay_rows),
                   "after_estimates": sum(r.get("tag") in ESTIMATE_TAGS for r in replay_rows),
                   "real_divergences": [r for r in replay_rows if r.get("same") is False and not r.get("near_tie")],
                   "near_tie_divergences": [r for r in replay_rows if r.get("same") is False and r.get("near_tie")],
                   "errors": [r for r in replay_rows if r.get("same") is None],
                   "near_tie_gap": NEAR_TIE},
        "allocator": {**res["allocator"], "start": res["start"]["kv_pool_tokens"],
                      "before_flush": res["end"]["before_flush_kv_pool_tokens"], "end": res["end"]["kv_pool_tokens"],
                      "flush_status": res["flush_status"]},
        "bounds": {"end": res["bounds"], "over_during_run": mon.over_limit, "stats_polls": mon.polls,
                   "limits": res["end"]["limits"], "usage": res["end"]["usage"]},
        "server": {"alive_at_end": res["alive"], "health_generate": res["health"], "log": res["server_log"]},
        "findings": {k: {"count": rec.finding_counts[k], "examples": ex} for k, ex in rec.findings.items()},
        "end_counters": res["end"]["counters"],
        "verdict_counts": verdict_counts(res),
        "chat": {"requests_by_variant": dict(rec.chat), "reports": len(rec.chat_reports),
                 "reports_by_scope": dict(Counter(r["scope"] for r in rec.chat_reports)),
                 "hostile_sent": len(rec.hostile), "scope_probes": len(rec.scope_probes),
                 "reset_probes": len(rec.reset_probes)},
        "retraction": {**res["retraction_log"], "bursts": rec.bursts,
                       "metric_delta": (mon.retracted_metric[-1] - mon.retracted_metric[0]
                                        if len(mon.retracted_metric) >= 2 else None),
                       "note": "counted, not required: whether SGLang retracts depends on timing here"},
    }
