"""The attacks of one client on the others: automatic-mode chats longer than the context (``long_chats``: answered
as stock answers them, without holding up a short chat sent meanwhile) and forged workflow labels
(``forged_workflow``: without a cache salt, naming another workflow reaches none of its KV under
``--kvshare-reuse-scope salt-required``)."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Optional

from benchmarks.adversary_client import Run, approximated
from benchmarks.soak import Outcome
from benchmarks.soak.faults import cross_scope_signs

LONG_CHAT_S, SHORT_DELAY_S = 2.0, 0.2  # the bounds
CONTEXT_TOKENS = 8192  # SmolLM2's context: every long chat is built past twice this
SHORT_AFTER_S = 0.02  # the short chat leaves this long after the long one: while the server reads and plans it


def forged_workflow(r: Run) -> dict:
    """A producer of workflow W without a salt, then a thief naming W without a salt (annotation ``workflow``,
    then chat ``user``); a control pair under one salt shows the probe can see reuse."""
    config = (r.ep.stats() or {}).get("config") or {}
    wf = f"wf-{r.tag}"
    rows = {}
    text = r.doc()
    r.generate("forged", f"producer-{r.tag}", text, workflow=wf, warm_head=True)
    thief = r.generate("forged", f"thief-{r.tag}", text, workflow=wf, warm_head=True)
    rows["generate"] = _probe_row(thief, f"producer-{r.tag}")
    user = f"user-{r.tag}"
    doc = r.doc()
    sent = []
    for role in ("planner", "checker"):
        body = {"model": "default", "max_tokens": 2, "temperature": 0.0, "user": user,
                "messages": [{"role": "system", "content": f"You are the {role} of team {r.tag}."},
                             {"role": "user", "content": f"Context:\n{doc}"},
                             {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Answer."}]}
        sent.append(r.ep.chat("forged", body))
    producer_agent = (sent[0].body or {}).get("kvshare", {}).get("agent") if sent[0].status == 200 else None
    report = (sent[1].body or {}).get("kvshare") if sent[1].status == 200 else None
    rows["chat_user"] = _probe_row(Outcome(sent[1].status, {"meta_info": {"kvshare": [report or {}]}}), producer_agent)
    salt = r.watch.secret("salt")
    ctext = r.doc()
    r.generate("forged", f"cproducer-{r.tag}", ctext, workflow=wf, salt=salt, warm_head=True)
    control = r.generate("forged", f"cthief-{r.tag}", ctext, workflow=wf, salt=salt, warm_head=True)
    control_reused = approximated(control)
    scope = config.get("reuse_scope")
    passed = scope == "salt-required" and control_reused > 0 and all(
        v["status"] == 200 and not v["reused_tokens"] and not v["found"] and not v["named_producer"]
        for v in rows.values())
    return {"passed": passed, "reuse_scope": scope, "control_approximated_tokens": control_reused, "probes": rows}


def _probe_row(out: Outcome, producer: Optional[str]) -> dict:
    signs = cross_scope_signs(out.report if out.status == 200 else None)
    sources = [s.get("source_agent") for s in (out.report.get("segments") or []) if s.get("source_agent")] \
        if out.status == 200 else []
    return {"status": out.status, "approximated_tokens": approximated(out), "reused_tokens": signs["reused_tokens"],
            "found": signs["found"][:3], "named_producer": producer is not None and producer in sources}


def long_chats(r: Run, sizes: tuple[int, ...]) -> dict:
    """Per size: the chat opted out (stock), then automatic with a short chat sent ``SHORT_AFTER_S`` into it."""
    salt = r.watch.secret("salt")
    short = {"model": "default", "max_tokens": 1, "temperature": 0.0, "cache_salt": salt,
             "messages": [{"role": "system", "content": "You answer in one word."},
                          {"role": "user", "content": "Say hi."}]}
    alone = [r.ep.chat("short_chat", short).seconds for _ in range(4)][1:]
    rows = {}
    for n in sizes:
        words = max(0, -(-2 * CONTEXT_TOKENS // n) - 6)
        messages = [{"role": "system", "content": "You summarize long chats."}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " + "note " * words}
            for i in range(n - (n % 2 == 0))]
        body = {"model": "default", "max_tokens": 1, "temperature": 0.0, "cache_salt": salt, "messages": messages}
        stock = r.ep.chat("long_chat_stock", {**body, "kvshare": False})
        got: list[Outcome] = []
        t = threading.Thread(target=lambda: got.append(r.ep.chat("long_chat_auto", body)), daemon=True)
        t.start()
        time.sleep(SHORT_AFTER_S)
        during = r.ep.chat("short_chat", short)
        t.join(r.ep.timeout + 5)
        auto = got[0] if got else Outcome(0, None, r.ep.timeout, "no answer")
        delay = during.seconds - statistics.median(alone)
        rows[n] = {"messages": len(messages), "stock_status": stock.status, "auto_status": auto.status,
                   "stock_s": round(stock.seconds, 3), "auto_s": round(auto.seconds, 3),
                   "short_alone_s": round(statistics.median(alone), 3), "short_during_s": round(during.seconds, 3),
                   "short_delay_s": round(delay, 3),
                   "ok": auto.status == stock.status and auto.seconds <= stock.seconds + LONG_CHAT_S
                   and during.status == 200 and delay <= SHORT_DELAY_S}
    return {"passed": all(v["ok"] for v in rows.values()), "bounds_s": {"answer": LONG_CHAT_S,
                                                                       "short_delay": SHORT_DELAY_S}, "sizes": rows}
