"""``python -m benchmarks.soak``: start the server (and the ``off`` reference), warm it, run the clients until
the deadline, check the server idle and flushed, replay plain requests on ``off``, write the verdicts."""

from __future__ import annotations

import argparse
import json
import random
import secrets
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from benchmarks.harness import RESULTS, write_json
from benchmarks.soak import admin, chat, generate
from benchmarks.soak.checks import Monitor, check_bounds, flush, pool_ok, retractions, scan_log, summarize, wait_idle
from benchmarks.soak.client import (EARLY, NEAR_TIE, PLAIN_TOKENS, REQUEST_TIMEOUT_S, SALTS, TEAM, TRAFFIC, Client,
                                    Endpoint, Outcome, Recorder, Shared, output_tokens, system_part)
from devtools.server_process import ServerProcess
from sglang_kvshare.frontend.builder import build_request, private_part

OPS = {**generate.OPS, **chat.OPS, **admin.OPS}


def warm_up(s: Shared, rounds: int) -> None:
    """Every agent's private prefix under every salt, then ``rounds`` team rounds, so that
    sources exist and kvcmas pools hold anchors before the clients start."""
    for salt in (None, *SALTS):
        for agent in TEAM:
            ids, cp = build_request(s.tokenizer, agent, [private_part(system_part(agent))])
            s.endpoint.generate("warmup", ids, custom_params=cp, salt=salt, max_new_tokens=1)
    for _ in range(rounds):
        text = s.fresh_text()
        for agent in TEAM:
            ids, cp = s.request(agent, text)
            s.endpoint.generate("warmup", ids, custom_params=cp, max_new_tokens=1)


def soak_launch_args(mode: str, tau: float, max_total_tokens: int, admin_key: str) -> dict:
    """``ServerProcess`` keyword arguments of the soak's server (``kvshare_args``, ``extra_args``)."""
    # NOTE: edge anchors 2 (the gate's minimum), so that corrections start within the soak's minutes.
    return {"kvshare_args": ("--kvshare-mode", mode, "--kvshare-tau", str(tau), "--kvshare-auto", "true",
                             "--kvshare-edge-anchors", "2", "--kvshare-min-reuse-tokens", "0"),
            "extra_args": ("--max-total-tokens", str(max_total_tokens), "--admin-api-key", admin_key,
                           "--enable-metrics")}


def run_soak(args, tokenizer, model_path: str, texts: list[str], launched: Optional[ServerProcess] = None,
             admin_key: Optional[str] = None) -> dict:
    """Soak a fresh server: one started here, or ``launched`` (started by the caller with
    ``soak_launch_args(args.mode, args.tau, args.max_total_tokens, admin_key)``, and either never
    used or set back to those settings with its pools reset and its cache flushed)."""
    rec = Recorder()
    key = admin_key or secrets.token_hex(16)
    launch = soak_launch_args(args.mode, args.tau, args.max_total_tokens, key)
    if launched is not None and (tuple(launched.kvshare_args), tuple(launched.extra_args)) != (
            launch["kvshare_args"], launch["extra_args"]):
        raise ValueError(f"the launched server's arguments {launched.kvshare_args} {launched.extra_args} "
                         f"are not the soak's {launch}")
    with (nullcontext(launched) if launched is not None else ServerProcess(model_path=model_path, **launch)) as server:
        ep = Endpoint(server.url, key, rec)
        log_start = len(server.log_text())  # a launched server may have served others before
        s = Shared(tokenizer, texts, ep, args.mode, args.tau, args.slot_names, deadline=0.0, started=time.monotonic(),
                   burst_size=args.retract_burst)
        warm_up(s, args.warm_rounds)
        start_stats = wait_idle(ep, 120) or ep.stats() or {}
        warmup_s = round(time.monotonic() - s.started, 1)
        s.started = time.monotonic()
        s.deadline = s.started + args.minutes * 60
        kinds = [k for k in TRAFFIC if k not in EARLY]
        random.Random(args.seed).shuffle(kinds)
        kinds = [*EARLY, *kinds]  # the probes early, even in the shortest run
        clients = [Client(i, s, OPS, args.seed, kinds[i::args.clients] if args.clients > 1 else kinds)
                   for i in range(args.clients)]
        if args.clients > 1:
            clients[1 % args.clients].tour.insert(0, "salt_probe")
        monitor = s.monitor = Monitor(ep)
        monitor.observe_metrics(ep.call("metrics", "GET", "/metrics"))  # the retraction counter before the load
        monitor.thread.start()
        threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
        for t in threads:
            t.start()
        total = int(args.minutes * 60)
        with tqdm(total=total, desc=f"soak {args.mode} x{args.clients}", unit="s", mininterval=2) as bar:
            while any(t.is_alive() for t in threads) and time.monotonic() < s.deadline + REQUEST_TIMEOUT_S + 30:
                time.sleep(5.0)
                bar.n = min(total, int(time.monotonic() - s.started))
                tot = rec.totals()
                bar.set_postfix(req=tot["requests"], c4xx=tot["client_4xx"], c5xx=tot["server_5xx"],
                                lost=tot["lost"], refresh=False)
                bar.refresh()
        stuck, load_s = sum(t.is_alive() for t in threads), round(time.monotonic() - s.started, 1)
        monitor.stop.set()
        monitor.thread.join(10)

        # Idle, flushed: the allocator must be back where it started.
        before_flush = wait_idle(ep, 180) or {}
        monitor.observe(Outcome(200, before_flush) if before_flush else Outcome(0))
        flush_status = flush(ep)
        time.sleep(1.0)
        end_stats = ep.stats() or {}
        monitor.observe(Outcome(200, end_stats) if end_stats else Outcome(0))
        monitor.observe_chat(ep.call("chat_stats", "GET", "/kvshare/chat"))
        monitor.observe_metrics(ep.call("metrics", "GET", "/metrics"))
        alive = server.proc.poll() is None
        health = ep.call("health", "GET", "/health_generate", record=False).status if alive else 0
        log, log_path = server.log_text(), str(server.log_path)

    start_pool, end_pool = start_stats.get("kv_pool_tokens"), end_stats.get("kv_pool_tokens")
    both = bool(start_pool and end_pool)
    return dict(
        warmup_s=warmup_s, load_s=load_s, clients_stuck_at_end=stuck, rec=rec, monitor=monitor, alive=alive,
        health=health, flush_status=flush_status, server_log=scan_log(log), server_log_path=log_path,
        retraction_log=retractions(log[log_start:]),
        start={k: start_stats.get(k) for k in ("kv_pool_tokens", "limits", "usage")},
        end={"kv_pool_tokens": end_pool, "limits": end_stats.get("limits"), "usage": end_stats.get("usage"),
             "counters": end_stats.get("counters"), "before_flush_kv_pool_tokens": before_flush.get("kv_pool_tokens")},
        allocator={"start_ok": bool(start_pool) and pool_ok(start_pool), "end_ok": bool(end_pool) and pool_ok(end_pool),
                   "free_plus_evictable_same_as_start": both and (start_pool["available"] + start_pool["evictable"]
                                                                  == end_pool["available"] + end_pool["evictable"]),
                   "total_same": both and start_pool["total"] == end_pool["total"]},
        bounds=check_bounds(end_stats) if end_stats else {"checked": False, "missing": ["stats"], "over": {}},
        slot_names=len(rec.slot_names), clients=clients)

def pick_replay(plain: list[dict], n: int, seed: int) -> list[dict]:
    """Up to ``n`` plain requests: leak probes first, then those served most from cache."""
    order = {"leak_probe": 0, "leak_probe_off": 0, "plain_after_estimate": 1, "after_rid_reuse": 2, "plain": 3}
    rng = random.Random(seed)
    pool = list(plain)
    rng.shuffle(pool)
    pool.sort(key=lambda p: (order.get(p["tag"], 3), -p["cached_tokens"]))
    return pool[:n]


def compare(sample: dict, off_body: dict) -> dict:
    """Greedy tokens of the soak run vs the ``off`` replay; the top-2 gap where they first differ."""
    got, ref = sample["output_ids"], output_tokens(off_body)
    row = {"tag": sample["tag"], "prompt_tokens": len(sample["input_ids"]), "cached_tokens": sample["cached_tokens"],
           "salt": sample["salt"], "same": got == ref}
    if got == ref:
        return row
    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    tops = off_body.get("meta_info", {}).get("output_top_logprobs") or []
    vals = sorted((float(t[0]) for t in (tops[first] if first < len(tops) else None) or [] if t[0] is not None),
                  reverse=True)
    gap = vals[0] - vals[1] if len(vals) >= 2 else None
    row.update(first_diff=first, off_top2_gap=gap, near_tie=gap is not None and gap < NEAR_TIE,
               soak_tokens=got[:first + 3], off_tokens=ref[:first + 3])
    return row


def reference_server(model_path: str, max_total_tokens: int) -> ServerProcess:
    """The ``off`` server the plain requests are replayed on (not started)."""
    return ServerProcess(model_path=model_path, kvshare_args=["--kvshare-mode", "off"],
                         extra_args=["--max-total-tokens", str(max_total_tokens)])


def replay(url: str, samples: list[dict]) -> list[dict]:
    """Each sample alone on the ``off`` server's cold cache (flushed: no prefix of another replay), compared."""
    ep, rows = Endpoint(url, None, Recorder()), []
    for sample in tqdm(samples, desc="replay in mode off", unit="req"):
        flush(ep, attempts=3)
        out = ep.generate("replay", sample["input_ids"], salt=sample["salt"], max_new_tokens=PLAIN_TOKENS,
                          logprobs=True)
        rows.append(compare(sample, out.body) if out.status == 200 else
                    {"tag": sample["tag"], "error": out.status, "same": None})
    return rows


def stock_statuses(url: str, rows: list[dict]) -> None:
    """Hostile automatic chats the soak server refused: the status stock SGLang (mode ``off``) gives the
    same body, in ``row["stock_status"]``. The ``off`` reference has no automatic mode: it is stock here."""
    ep = Endpoint(url, None, Recorder())
    for row in rows:
        body = {k: v for k, v in row["body"].items() if k != "kvshare"}
        row["stock_status"] = ep.chat("stock", body).status


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 clients x 1.25 min, 8 replays: < 5 minutes here")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--replay", type=int, default=40, help="plain requests replayed against mode off")
    ap.add_argument("--max-total-tokens", type=int, default=3072, help="KV pool of the soak server (small: evicts)")
    ap.add_argument("--slot-names", type=int, default=10000, help="distinct slot names to send over the run")
    ap.add_argument("--retract-burst", type=int, default=32,
                    help="concurrent decodes per retraction burst (0: no bursts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.set_defaults(mode="kvcmas", tau=1.0, warm_rounds=3)  # tau 1 accepts every correction; team rounds first
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/soak[_quick].json)")
    ap.add_argument("--reference-url", default=None,
                    help="replay on this running mode-off server (flushed before each replay) instead of "
                         "starting one; it must serve the same model")
    args = ap.parse_args(argv)
    args.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    if args.quick:
        args.clients, args.minutes, args.replay, args.slot_names = 2, 1.25, 8, 1500
    if args.clients < 1 or args.minutes <= 0 or args.replay < 0 or args.retract_burst < 0:
        ap.error("--clients must be >= 1, --minutes > 0, --replay >= 0 and --retract-burst >= 0")
    return args


def main(argv=None, *, launched: Optional[ServerProcess] = None, admin_key: Optional[str] = None) -> int:
    """``launched``/``admin_key``: soak a server the caller started (see ``run_soak``; the test
    suite takes it from its server pool)."""
    args = parse_args(argv)
    out = Path(args.out or RESULTS / ("soak_quick.json" if args.quick else "soak.json"))
    from transformers import AutoTokenizer

    from benchmarks.texts import gsm8k_questions
    from devtools.models import prepare

    model_path = str(prepare("smollm2-135m"))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    qs = gsm8k_questions()
    texts = ["\n".join(f"Problem {j + 1}: {q}" for j, q in enumerate(qs[i:i + 2])) for i in range(0, 1200, 2)]
    t0 = time.monotonic()
    # NOTE: the off reference starts now, beside the soak's own server (a start is mostly
    # single-threaded imports), and idles (--sleep-on-idle) until the replay: about half a
    # server start saved. Launched from this thread, which outlives it (see ServerProcess.launch).
    url = args.reference_url
    reference = None if url else reference_server(model_path, args.max_total_tokens)
    if reference is not None and args.replay > 0:
        reference.launch()
    try:
        res = run_soak(args, tokenizer, model_path, texts, launched, admin_key)
        samples, rows = pick_replay(res["rec"].plain, args.replay, args.seed), []
        refused = [h for h in res["rec"].hostile if h.get("body") is not None]
        if samples or refused:
            if reference is not None:
                if args.replay == 0:
                    reference.launch()
                reference.wait_ready()
                url = reference.url
            rows = replay(url, samples)
            stock_statuses(url, refused)
    finally:
        if reference is not None:
            reference.stop()
    data = summarize(args, res, rows, time.monotonic() - t0)
    write_json(out, data)
    print(json.dumps({"passed": data["passed"], "verdicts": data["verdicts"], "totals": data["totals"],
                      "faults_injected_total": data["faults_injected_total"], "out": str(out)}, indent=1))
    return 0 if data["passed"] else 1
