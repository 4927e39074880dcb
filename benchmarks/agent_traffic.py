"""``python -m benchmarks.agent_traffic``: recorded agent teams replayed through the OpenAI chat API, many at once.

Teams (``benchmarks/workloads/agent_teams.py``) arrive by a seeded Poisson process at each rate (teams per
minute); every request is a plain streamed greedy ``/v1/chat/completions`` call whose history holds this
server's earlier answers. Arms, the same server flags in each: ``stock`` (``sglang.launch_server``), ``off``
(``--kvshare-mode off``, auto annotation on) and ``default`` (``--kvshare-auto true``; the study arm ``any_length``
adds ``--kvshare-min-reuse-tokens 0``), each with a ``large`` pool
(the working set fits) and ``half`` of the working set; on the half pool the default arm also runs the top rate
under SGLang's eviction order alone (``retention`` ``sglang``, set at runtime). ``--quick``: 3 teams of 4; stock and
the default at rates 4 and 60 on the large pool and at 60 on the half one, ``off`` at 60 on the large pool; under 20
minutes on 2 cores.

Two replays on the large pool are not timed against arrivals (``EXTRAS``): ``idle`` sends the short-message teams one
at a time to stock and the default, after a floor probe (the TTFT of a one-line request, which no reuse removes);
``fidelity`` sends the retrieval teams one at a time to the default with every approximated request verified by the
guard (``verify_rate`` 1, set at runtime), for its top-1 per agent.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import shlex
import statistics
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from pathlib import Path
from typing import Optional, Sequence

import requests

from benchmarks.harness import RESULTS, percentile, run_meta, verifications_settled, write_json
from benchmarks.report_sections import render_agent_traffic
from benchmarks.workloads.agent_teams import load, messages_of

ARMS = {"stock": [], "off": ["--kvshare-mode", "off", "--kvshare-auto", "true"], "default": ["--kvshare-auto", "true"],
        "any_length": ["--kvshare-auto", "true", "--kvshare-min-reuse-tokens", "0"]}
DEFAULT_ARMS = ("stock", "off", "default")  # any_length: what the default's short-segment rule keeps dense, reused
QUICK_TEAMS = ("groupchat-4", "supervisor-4", "retrieval-4")
# The retention order of the extra cell the default arm runs on the half pool at the top rate: SGLang's eviction
# policy alone (set at runtime), against the default's ``workflow`` on the same server.
LRU = "sglang"
# The replays each large-pool server runs after its timed cells (see the module docstring).
EXTRAS = {"stock": ("idle",), "default": ("idle", "fidelity"), "any_length": ("idle",)}
DOCUMENT_KIND = "retrieval"  # the teams whose requests carry >= 1K shared tokens: the guard's fidelity replay


def arrivals(n: int, per_minute: float, seed: int) -> list[float]:
    """Seconds from the cell's start at which ``n`` teams arrive: a Poisson process of ``per_minute`` teams."""
    rng = random.Random(seed)
    return list(accumulate(rng.expovariate(per_minute / 60.0) for _ in range(n)))


def working_set(teams: Sequence[dict], max_tokens: int) -> int:
    """Tokens stock SGLang holds at the end of these teams if it evicts nothing: each agent's longest prompt (its
    own system prompt in front) and answer."""
    longest: dict = defaultdict(int)
    for team in teams:
        for r in team["requests"]:
            agent = (team["name"], json.dumps(r["messages"][0]))
            longest[agent] = max(longest[agent], r["prompt_tokens"] + max_tokens)
    return sum(longest.values())


def pool_tokens(pool: str, teams: Sequence[dict], max_tokens: int) -> int:
    """``large``: the working set, at least SGLang's CPU default of 16K; ``half``: half of it, never below the
    longest request."""
    ws = working_set(teams, max_tokens)
    if pool == "large":
        return max(16384, -(-ws // 1024) * 1024)
    return max(ws // 2, max(r["prompt_tokens"] for t in teams for r in t["requests"]) + max_tokens + 64)


def chat_stream(url: str, messages: list[dict], max_tokens: int, timeout: float = 600.0) -> dict:
    """One streamed greedy chat request as a framework sends it: status (0: no answer), TTFT, seconds, text,
    output tokens, the kvshare report (None from stock)."""
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, ttft, text, usage, report, status = time.perf_counter(), None, [], None, None, 0
    try:
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=timeout) as resp:
            status = resp.status_code
            for line in resp.iter_lines() if resp.ok else ():
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                delta = ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content")
                if delta:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(delta)
                usage = chunk.get("usage") or usage
                report = chunk.get("kvshare") or report
    except (requests.RequestException, ValueError):
        status = 0
    return {"status": status, "ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "text": "".join(text),
            "output_tokens": (usage or {}).get("completion_tokens", len(text)), "report": report}


def compact_report(rep: Optional[dict]) -> dict:
    """What a cell reads of a kvshare report: reuse, fallbacks, source agents, where the time went."""
    rep = rep or {}
    sources = {s.get("source_agent") for s in rep.get("segments") or [] if s.get("source_agent")}
    return {"shared": rep.get("shared_tokens", 0), "reused": rep.get("shared_tokens_reused", 0),
            "fallbacks": [f["reason"] for f in rep.get("fallbacks") or []], "sources": len(sources),
            "assembly_s": rep.get("assembly_seconds", 0.0), "aligned": rep.get("tokens_aligned", 0),
            "recomputed": (rep.get("tokens_head_recomputed") or 0) + (rep.get("tokens_sparse_recomputed") or 0),
            "forwards": rep.get("prefill_forwards"), "agent": rep.get("agent")}


def run_cell(url: str, teams: Sequence[dict], per_minute: float, seed: int, max_tokens: int, bar=None) -> dict:
    """Replay ``teams`` arriving at ``per_minute``: every request's row and every team's start and end.
    ``per_minute`` 0: one team at a time, in order, on an otherwise idle server."""
    times = arrivals(len(teams), per_minute, seed) if per_minute > 0 else [0.0] * len(teams)
    rows, spans, lock, start = [], [], threading.Lock(), time.perf_counter()

    def team_run(i: int) -> None:
        time.sleep(max(0.0, times[i] - (time.perf_counter() - start)))
        team, answers, t0 = teams[i], [], time.perf_counter() - start
        for k, req in enumerate(team["requests"]):
            out = chat_stream(url, messages_of(team, k, answers), max_tokens)
            answers.append(out["text"] if out["status"] == 200 else req["answer"])
            with lock:
                rows.append({"team": team["name"], "turn": k + 1, "speaker": json.dumps(req["messages"][0]),
                             **compact_report(out.pop("report")), **out})
            if bar is not None:
                bar.update()
        spans.append([t0, time.perf_counter() - start])

    with ThreadPoolExecutor(max_workers=max(1, len(teams)) if per_minute > 0 else 1) as pool:
        list(pool.map(team_run, range(len(teams))))
    return {"rows": rows, "spans": spans, "wall_s": time.perf_counter() - start}


def wilson(k: int, n: int, z: float = 1.96) -> Optional[list]:
    """The 95 % Wilson interval of ``k`` successes in ``n``."""
    if not n:
        return None
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return [round(mid - half, 4), round(mid + half, 4)]


def _p(values: Sequence[float], q: float) -> Optional[float]:
    return round(percentile(values, q), 4) if values else None


def derive(run: dict, stock_answers: Optional[dict] = None) -> dict:
    """A cell's figures from its rows: TTFT of turns 2.. (p50, p99; per turn; by source agents), latency,
    throughput, reuse, fallbacks by reason, answer agreement with stock (``{(team, turn): text}``), 5xx, lost."""
    rows = run["rows"]
    ok = [r for r in rows if r["status"] == 200 and r["ttft_s"] is not None]
    later = [r for r in ok if r["turn"] > 1]
    shared = sum(r.get("shared", 0) for r in rows)
    spans = run["spans"]
    active = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    per_team, by_sources = defaultdict(dict), defaultdict(list)
    for r in ok:
        per_team[r["team"]][r["turn"]] = round(r["ttft_s"], 3)
    for r in later:
        by_sources[r.get("sources", 0)].append(r)
    cell = {"ttft_p50_s": _p([r["ttft_s"] for r in later], 0.5), "ttft_p99_s": _p([r["ttft_s"] for r in later], 0.99),
            "ttft_s_per_turn": {team: [t.get(k) for k in range(1, max(t) + 1)] for team, t in per_team.items()},
            "team_latency_p50_s": _p([e - s for s, e in spans], 0.5),
            "throughput_tok_s": round(sum(r["output_tokens"] for r in ok) / active, 3) if active else None,
            "teams_per_min": round(60 * len(spans) / active, 3) if active else None,
            "reuse_ratio": round(sum(r.get("reused", 0) for r in rows) / shared, 4) if shared else 0.0,
            "shared_tokens": shared, "fallbacks": dict(Counter(f for r in rows for f in r.get("fallbacks", []))),
            "reuse_by_team": {team: round(sum(r.get("reused", 0) for r in rows if r["team"] == team) / n, 4)
                              for team in sorted({r["team"] for r in rows})
                              if (n := sum(r.get("shared", 0) for r in rows if r["team"] == team))},
            "by_sources": {str(n): {"requests": len(v), "ttft_p50_s": _p([r["ttft_s"] for r in v], 0.5),
                                    **{k: round(sum(r.get(k, 0) for r in v) / len(v), 4)
                                       for k in ("assembly_s", "aligned", "recomputed")}}
                           for n, v in sorted(by_sources.items())},
            "requests": len(rows), **failures(rows)}
    if stock_answers:
        cell["agreement_with_stock"] = agreement(ok, stock_answers)
    return cell


def failures(rows: Sequence[dict]) -> dict:
    """Requests answered with a 5xx, and requests that got no answer at all (status 0)."""
    return {"errors_5xx": sum(r["status"] >= 500 for r in rows), "lost": sum(r["status"] == 0 for r in rows)}


def reset(url: str, key: str) -> None:
    """Empty the tree, kvshare's records and the guard's estimates: each cell and replay starts from nothing."""
    for path in ("/flush_cache", "/kvshare/reset", "/kvshare/fidelity/reset"):
        call(url, key, "POST", path)


def agreement(rows: Sequence[dict], stock_answers: dict) -> dict:
    """How many of ``rows`` gave stock's answer to the same team and turn, with the 95 % Wilson interval."""
    pairs = [(r["text"], stock_answers[k]) for r in rows if (k := (r["team"], r["turn"])) in stock_answers]
    agree = sum(a == b for a, b in pairs)
    return {"equal": agree, "n": len(pairs), "ci95": wilson(agree, len(pairs))}


def floor_ttft(url: str, n: int = 5) -> Optional[float]:
    """Median TTFT of ``n`` one-line chat requests on an idle server: HTTP, scheduling, one short forward and the
    first decode step, the part of a turn's TTFT that no reuse can remove."""
    got = [r["ttft_s"] for r in (chat_stream(url, [{"role": "user", "content": "Say hello."}], 4) for _ in range(n))
           if r["status"] == 200 and r["ttft_s"] is not None]
    return round(statistics.median(got), 4) if got else None


def derive_idle(run: dict, floor: Optional[float], stock_answers: Optional[dict] = None) -> dict:
    """The idle replay: the floor, TTFT p50 of turns 2.. (all; with and without reused tokens), prefill forwards
    per request, every turn's TTFT (the report pairs them with stock's), and with stock's idle answers
    (``{(team, turn): text}``) the agreement of turns 2.. with them."""
    later = [r for r in run["rows"] if r["status"] == 200 and r["ttft_s"] is not None and r["turn"] > 1]
    reused = [r["ttft_s"] for r in later if r.get("reused", 0) > 0]
    return {"floor_ttft_s": floor, "ttft_p50_s": _p([r["ttft_s"] for r in later], 0.5),
            "reused_ttft_p50_s": _p(reused, 0.5), "dense_ttft_p50_s": _p([r["ttft_s"] for r in later
                                                                          if r.get("reused", 0) == 0], 0.5),
            "requests": len(run["rows"]), "reused_requests": len(reused),
            "prefill_forwards": dict(Counter(str(r["forwards"]) for r in later if r.get("forwards") is not None)),
            "turns": [{"team": r["team"], "turn": r["turn"], "ttft_s": round(r["ttft_s"], 4),
                       "reused": r.get("reused", 0)} for r in sorted(later, key=lambda r: (r["team"], r["turn"]))],
            **failures(run["rows"]),
            **({"agreement_with_stock": agreement(later, stock_answers)} if stock_answers else {})}


def per_agent(rows: Sequence[dict], scopes: dict) -> list[dict]:
    """The guard's estimates per agent, named by team and position (the order in which an agent first speaks in
    its team, from the trace, so a failed request shifts no one), never by the server's agent digest. ``scopes``:
    ``GET /kvshare/fidelity``'s ``per_scope``, found by the agent a response's report names. Auto mode names an
    agent by its system prompt, so the same prompt in two teams is one guard scope: both rows show its estimate,
    and ``reused_requests`` counts the team's own."""
    out = []
    for team in sorted({r["team"] for r in rows}):
        mine = sorted((r for r in rows if r["team"] == team), key=lambda r: r["turn"])
        for position, speaker in enumerate(dict.fromkeys(r["speaker"] for r in mine), 1):
            theirs = [r for r in mine if r["speaker"] == speaker]
            agent = next((r["agent"] for r in theirs if r.get("agent")), None)
            scope = scopes.get(agent) or {}
            out.append({"team": team, "position": position,
                        "reused_requests": sum(1 for r in theirs if r.get("reused", 0) > 0),
                        "samples": scope.get("samples", 0), "top1": scope.get("top1") or {"n": 0, "mean": None}})
    return out


def fidelity_replay(url: str, key: str, teams: Sequence[dict], max_tokens: int, bar=None) -> dict:
    """The retrieval teams one at a time with every approximated request verified (``verify_rate`` 1): the guard's
    top-1 per agent, once every verification has ended (a deadline of 600 s)."""
    set_rate = call(url, key, "POST", "/kvshare/config", {"verify_rate": 1.0})
    run = run_cell(url, teams, 0.0, 0, max_tokens, bar)
    guard = settled_guard(url, key, deadline_s=600.0)
    return {"teams": [t["name"] for t in teams], "verify_rate": 1.0 if set_rate is not None else None,
            "verified": (guard.get("counters") or {}).get("verified", 0),
            "per_agent": per_agent(run["rows"], guard.get("per_scope") or {}), **failures(run["rows"])}


def retention(stats: Optional[dict]) -> str:
    """The cache's retention policy as ``/kvshare/stats`` names it; ``lru`` (SGLang's own) when it names none."""
    for where in (stats or {}, (stats or {}).get("config") or {}):
        value = where.get("retention")
        value = (value.get("policy") or value.get("name")) if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            return value
    return "lru"


def call(url: str, key: str, method: str, path: str, body: Optional[dict] = None):
    """One admin or metrics call with the admin key and a timeout: its JSON, its text, or None (not 2xx, no answer)."""
    try:
        r = requests.request(method, url + path, headers={"Authorization": f"Bearer {key}"}, json=body, timeout=60)
        return None if not r.ok else r.json() if "json" in r.headers.get("content-type", "") else r.text
    except (requests.RequestException, ValueError):
        return None


def settled_guard(url: str, key: str, deadline_s: float = 120.0) -> dict:
    """``GET /kvshare/fidelity`` once every verification the cell queued has ended (two equal settled polls), or at
    the deadline: the guard verifies after a request's answer is sent, so a read at once misses the cell's last."""
    end, last = time.monotonic() + deadline_s, None
    while True:
        snap = call(url, key, "GET", "/kvshare/fidelity") or {}
        if verifications_settled(snap) and last is not None and snap.get("counters") == last.get("counters"):
            return snap
        if time.monotonic() > end:
            return snap
        last = snap
        time.sleep(1.0)


def pool_sample(metrics: str) -> tuple[Optional[float], Optional[float]]:
    """(KV pool occupancy, evicted tokens so far) from SGLang's ``/metrics`` text (summed over its series)."""
    got: dict = {}
    for line in metrics.splitlines():
        for name in ("sglang:token_usage", "sglang:evicted_tokens_total"):
            if line.startswith(name) and line[len(name)] in " {":
                got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return got.get("sglang:token_usage"), got.get("sglang:evicted_tokens_total")


def poll_pool(url: str, key: str, stop: threading.Event, samples: list, every_s: float = 1.0) -> None:
    """Append ``[seconds, occupancy, evicted]`` every ``every_s`` until ``stop``."""
    t0 = time.perf_counter()
    while not stop.wait(every_s):
        text = call(url, key, "GET", "/metrics")
        if isinstance(text, str):
            samples.append([round(time.perf_counter() - t0, 1), *pool_sample(text)])


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.agent_traffic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="teams " + " ".join(QUICK_TEAMS) + ", rates 4 and 60 (the half pool and off: 60)")
    ap.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS),
                    help="any_length: the default with min_reuse_tokens 0, a study arm (default: %(default)s)")
    ap.add_argument("--pools", nargs="+", default=["large", "half"], choices=["large", "half"])
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="teams per minute (default 2 6 20 60)")
    ap.add_argument("--teams", nargs="+", default=None, help="trace team names (default: every team)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m", help="a devtools.models name or a model folder")
    ap.add_argument("--write-model", type=Path, default=None,
                    help="write a Llama-8B-shaped model folder with --model's tokenizer here and serve it "
                         "(add --server-args '--load-format dummy')")
    ap.add_argument("--device", default=None, help="passed to every server as --device")
    ap.add_argument("--server-args", default="", help="more server flags, the same for every arm")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (servers, pools, cells) and start nothing")
    ap.add_argument("--out", type=Path, default=RESULTS / "agent_traffic.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.teams = args.teams or list(QUICK_TEAMS)
    args.rates = args.rates or ([4.0, 60.0] if args.quick else [2.0, 6.0, 20.0, 60.0])
    return args


def plan(args: argparse.Namespace, teams: list[dict]) -> dict:
    """Every server (arm, pool, command) and the cells each runs, without starting anything."""
    from devtools.models import prepare, write_dummy_model
    from devtools.server_process import ServerProcess

    model = Path(args.model) if Path(args.model).is_dir() else prepare(args.model)
    model = str(write_dummy_model(args.write_model, model) if args.write_model else model)
    common = ["--enable-metrics", *(["--device", args.device] if args.device else []), *shlex.split(args.server_args)]
    servers, top = [], max(args.rates)
    for pool in args.pools:
        flags = common + ["--max-total-tokens", str(pool_tokens(pool, teams, args.max_tokens))]
        for arm in sorted(args.arms, key=list(ARMS).index):  # stock first: the others are compared with its answers
            if args.quick and arm == "off" and pool == "half":
                continue  # the quick form: `off` once, beside stock on the large pool at the top rate
            rates = [top] if args.quick and (pool == "half" or arm == "off") else args.rates
            cmd = ServerProcess(model_path=model, stock=arm == "stock", kvshare_args=ARMS[arm], extra_args=flags,
                                port=0).command()
            cells = [[rate, None] for rate in rates]
            if arm == "default" and pool == "half":
                cells.append([top, LRU])
            servers.append({"arm": arm, "pool": pool, "flags": flags, "command": shlex.join(cmd), "cells": cells,
                            "extras": list(EXTRAS.get(arm, ())) if pool == "large" else []})
    return {"model": model, "teams": {t["name"]: t["agents"] for t in teams}, "rates": args.rates,
            "working_set_tokens": working_set(teams, args.max_tokens), "servers": servers}


def main(argv=None) -> int:
    from tqdm import tqdm

    from devtools.server_process import ServerProcess

    args = parse(argv)
    teams = [t for t in load() if args.teams is None or t["name"] in args.teams]
    the_plan = plan(args, teams)
    if args.dry_run:
        print(json.dumps(the_plan, indent=1))
        return 0
    t_start, key = time.perf_counter(), secrets.token_hex(8)
    result = {"meta": run_meta(), "settings": {k: str(v) for k, v in vars(args).items()}, "arms": ARMS,
              "plan": {k: v for k, v in the_plan.items() if k != "servers"}, "cells": [], "pool_samples": {}}
    stock_answers: dict = {}
    idle_answers: dict = {}
    short, docs = ([t for t in teams if (t["kind"] == DOCUMENT_KIND) == want] for want in (False, True))
    per_extra = {"idle": sum(len(t["requests"]) for t in short), "fidelity": sum(len(t["requests"]) for t in docs)}
    bar = tqdm(total=sum(len(spec["cells"]) * sum(len(t["requests"]) for t in teams)
                         + sum(per_extra[x] for x in spec["extras"]) for spec in the_plan["servers"]),
               desc="agent_traffic", unit="req")
    for spec in the_plan["servers"]:
        proc = ServerProcess(model_path=the_plan["model"], stock=spec["arm"] == "stock", kvshare_args=ARMS[spec["arm"]],
                             extra_args=spec["flags"] + ["--admin-api-key", key])
        with proc:
            chat_stream(proc.url, [{"role": "user", "content": "Say hello."}], 8)  # first-request costs
            for rate, order in spec["cells"]:
                reset(proc.url, key)
                if order is not None:
                    call(proc.url, key, "POST", "/kvshare/config", {"retention": order})
                samples, stop = [], threading.Event()
                threading.Thread(target=poll_pool, args=(proc.url, key, stop, samples), daemon=True).start()
                run = run_cell(proc.url, teams, rate, args.seed + args.rates.index(rate), args.max_tokens, bar)
                stop.set()
                guard = settled_guard(proc.url, key) if spec["arm"] != "stock" else {}
                stats = call(proc.url, key, "GET", "/kvshare/stats")
                scopes = guard.get("per_scope") or {}
                answers = stock_answers.setdefault((spec["pool"], rate), {})
                if spec["arm"] == "stock":
                    answers.update({(r["team"], r["turn"]): r["text"] for r in run["rows"]})
                result["cells"].append({
                    "arm": spec["arm"], "pool": spec["pool"], "rate": rate, "retention": retention(stats),
                    "max_total_tokens": int(spec["flags"][-1]),
                    **derive(run, None if spec["arm"] == "stock" else answers),
                    "guard_top1": {s: {"samples": v.get("samples"), "top1": v.get("top1")} for s, v in scopes.items()},
                    "guard_verified": (guard.get("counters") or {}).get("verified", 0),
                    "phase_seconds": {k: v for k, v in ((stats or {}).get("counters") or {}).items()
                                      if k.endswith("_seconds")}})
                cell_key = f"{spec['arm']}/{spec['pool']}/{rate}" + (f"/{order}" if order else "")
                result["pool_samples"][cell_key] = samples
                result["wall_s"] = round(time.perf_counter() - t_start, 1)
                write_json(args.out, result)  # a stopped run keeps its finished cells
            for extra in spec["extras"]:
                reset(proc.url, key)
                if extra == "idle" and short:
                    floor = floor_ttft(proc.url)
                    idle = run_cell(proc.url, short, 0.0, args.seed, args.max_tokens, bar)
                    if spec["arm"] == "stock":
                        idle_answers = {(r["team"], r["turn"]): r["text"] for r in idle["rows"]}
                    result.setdefault("idle", {})[spec["arm"]] = derive_idle(
                        idle, floor, None if spec["arm"] == "stock" else idle_answers)
                elif extra == "fidelity" and docs:
                    result["fidelity"] = fidelity_replay(proc.url, key, docs, args.max_tokens, bar)
                result["wall_s"] = round(time.perf_counter() - t_start, 1)
                write_json(args.out, result)
    bar.close()
    plot(result, args.out.with_suffix(".png"))
    print(render_agent_traffic(result))
    print(f"wrote {args.out} in {result['wall_s']} s")
    return 0


def plot(result: dict, path: Path) -> None:
    """Pool occupancy and evicted tokens over time at the highest rate, per arm and pool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    top = max((c["rate"] for c in result["cells"]), default=0)
    for key, samples in result["pool_samples"].items():
        arm, pool, rate, *order = key.split("/")
        if float(rate) == top and samples:
            t = [s[0] for s in samples]
            for ax, col in zip(axes, (1, 2)):
                ax.plot(t, [s[col] or 0 for s in samples], linestyle="-" if pool == "large" else "--",
                        label=" ".join([arm, pool, *order]))
    axes[0].set(xlabel="s", ylabel="KV pool occupancy", title=f"{top:g} teams / minute")
    axes[1].set(xlabel="s", ylabel="evicted tokens (cumulative)", title=f"{top:g} teams / minute")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
