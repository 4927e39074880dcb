"""``python -m benchmarks.agent_traffic``: recorded agent teams replayed through the OpenAI chat API, many at once.

Teams (``benchmarks/workloads/agent_teams.py``: group chats, supervisors, retrieval teams of 4-16 agents whose
histories grow) arrive by a seeded Poisson process at each rate of ``--rates`` (teams per minute). Every request
is a plain streamed ``/v1/chat/completions`` call, greedy, its history holding the answers this server gave
earlier in the run. Arms, each with the same server flags: ``stock`` (``sglang.launch_server``), ``off``
(kvshare loaded, ``--kvshare-mode off``, auto annotation on) and ``default`` (the default setting with
``--kvshare-auto true``); each with a pool of ``large`` tokens (the working set fits) and ``half`` of the working
set (``--max-total-tokens``). Per cell: TTFT (first streamed content) of every request but a team's first,
per turn and by the number of source agents a request reused, team latency, output throughput, teams per minute,
reuse and fallbacks by reason (the response's ``kvshare`` report), pool occupancy and evicted tokens over time
(``/metrics``), the guard's top-1 per agent (``/kvshare/fidelity``), answers equal to stock's, 5xx and lost.
``--quick``: 4 teams, 2 rates, about 20 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import shlex
import shutil
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import requests

from benchmarks.harness import RESULTS, percentile, run_meta, write_json
from benchmarks.workloads.agent_teams import load, messages_of

ARMS = {"stock": [], "off": ["--kvshare-mode", "off", "--kvshare-auto", "true"], "default": ["--kvshare-auto", "true"]}
QUICK_TEAMS = ("groupchat-4", "supervisor-4", "retrieval-4", "groupchat-8")
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 8192, "vocab_size": 49152, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
"""Llama-3-8B's shape (the vocabulary is the SmolLM2 tokenizer's): ``--write-model`` with random weights."""


# ------------------------------------------------------------------ the schedule and the pool
def arrivals(n: int, per_minute: float, seed: int) -> list[float]:
    """Seconds from the cell's start at which ``n`` teams arrive: a Poisson process of ``per_minute`` teams."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(per_minute / 60.0)
        out.append(t)
    return out


def working_set(teams: Sequence[dict], max_tokens: int) -> int:
    """Tokens stock SGLang holds at the end of these teams if it evicts nothing: each agent's longest prompt (its
    own system prompt in front) and answer."""
    total = 0
    for team in teams:
        longest: dict = {}
        for r in team["requests"]:
            agent = json.dumps(r["messages"][0])
            longest[agent] = max(longest.get(agent, 0), r["prompt_tokens"] + max_tokens)
        total += sum(longest.values())
    return total


def pool_tokens(pool: str, teams: Sequence[dict], max_tokens: int) -> int:
    """``large``: the working set, at least SGLang's CPU default of 16K; ``half``: half of it, never below the
    longest request."""
    ws = working_set(teams, max_tokens)
    if pool == "large":
        return max(16384, -(-ws // 1024) * 1024)
    return max(ws // 2, max(r["prompt_tokens"] for t in teams for r in t["requests"]) + max_tokens + 64)


# ------------------------------------------------------------------ one request, one cell
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
    if not rep:
        return {}
    sources = {s.get("source_agent") for s in rep.get("segments") or [] if s.get("source_agent")}
    return {"shared": rep.get("shared_tokens", 0), "reused": rep.get("shared_tokens_reused", 0),
            "fallbacks": [f["reason"] for f in rep.get("fallbacks") or []], "sources": len(sources),
            "assembly_s": rep.get("assembly_seconds", 0.0), "aligned": rep.get("tokens_aligned", 0),
            "recomputed": (rep.get("tokens_head_recomputed") or 0) + (rep.get("tokens_sparse_recomputed") or 0)}


def run_cell(url: str, teams: Sequence[dict], per_minute: float, seed: int, max_tokens: int, bar=None) -> dict:
    """Replay ``teams`` arriving at ``per_minute``: every request's row and every team's start and end."""
    times, rows, spans, lock = arrivals(len(teams), per_minute, seed), [], [], threading.Lock()
    start = time.perf_counter()

    def team_run(i: int) -> None:
        time.sleep(max(0.0, times[i] - (time.perf_counter() - start)))
        team, answers, t0 = teams[i], [], time.perf_counter() - start
        for k, req in enumerate(team["requests"]):
            out = chat_stream(url, messages_of(team, k, answers), max_tokens)
            answers.append(out["text"] if out["status"] == 200 else req["answer"])
            row = {"team": team["name"], "agents": team["agents"], "turn": k + 1, **compact_report(out.pop("report")),
                   **out}
            with lock:
                rows.append(row)
            if bar is not None:
                bar.update()
        spans.append([t0, time.perf_counter() - start])

    with ThreadPoolExecutor(max_workers=len(teams)) as pool:
        list(pool.map(team_run, range(len(teams))))
    return {"rows": rows, "spans": spans, "wall_s": time.perf_counter() - start}


# ------------------------------------------------------------------ what a cell says
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
    by_turn, by_sources = defaultdict(list), defaultdict(list)
    for r in later:
        by_turn[r["turn"]].append(r["ttft_s"])
        by_sources[r.get("sources", 0)].append(r)
    cell = {"ttft_p50_s": _p([r["ttft_s"] for r in later], 0.5), "ttft_p99_s": _p([r["ttft_s"] for r in later], 0.99),
            "ttft_p50_s_per_turn": {str(t): _p(v, 0.5) for t, v in sorted(by_turn.items())},
            "team_latency_p50_s": _p([e - s for s, e in spans], 0.5),
            "throughput_tok_s": round(sum(r["output_tokens"] for r in ok) / active, 3) if active else None,
            "teams_per_min": round(60 * len(spans) / active, 3) if active else None,
            "reuse_ratio": round(sum(r.get("reused", 0) for r in rows) / shared, 4) if shared else 0.0,
            "shared_tokens": shared, "fallbacks": dict(Counter(f for r in rows for f in r.get("fallbacks", []))),
            "by_sources": {str(n): {"requests": len(v), "ttft_p50_s": _p([r["ttft_s"] for r in v], 0.5),
                                    **{k: round(sum(r.get(k, 0) for r in v) / len(v), 4)
                                       for k in ("assembly_s", "aligned", "recomputed")}}
                           for n, v in sorted(by_sources.items())},
            "requests": len(rows), "errors_5xx": sum(r["status"] >= 500 for r in rows),
            "lost": sum(r["status"] == 0 for r in rows)}
    if stock_answers:
        pairs = [(r["text"], stock_answers[(r["team"], r["turn"])]) for r in ok if (r["team"], r["turn"]) in stock_answers]
        agree = sum(a == b for a, b in pairs)
        cell["agreement_with_stock"] = {"equal": agree, "n": len(pairs), "ci95": wilson(agree, len(pairs))}
    return cell


def retention(stats: Optional[dict]) -> str:
    """The cache's retention policy as ``/kvshare/stats`` names it; ``lru`` (SGLang's own) when it names none."""
    for where in (stats or {}, (stats or {}).get("config") or {}):
        value = where.get("retention")
        if isinstance(value, dict):
            value = value.get("policy") or value.get("name")
        if isinstance(value, str) and value:
            return value
    return "lru"


# ------------------------------------------------------------------ the server side
class Server:
    """One arm's server and what the benchmark reads from it besides answers (every call with a timeout)."""

    def __init__(self, arm: str, model: str, flags: list[str], key: str):
        from devtools.server_process import ServerProcess

        self.arm, self.key = arm, key
        self.proc = ServerProcess(model_path=model, stock=arm == "stock", kvshare_args=ARMS[arm], extra_args=flags)

    def get(self, path: str) -> Optional[dict]:
        try:
            r = requests.get(self.proc.url + path, headers={"Authorization": f"Bearer {self.key}"}, timeout=30)
            return r.json() if r.ok and path != "/metrics" else ({"text": r.text} if r.ok else None)
        except (requests.RequestException, ValueError):
            return None

    def clear(self) -> None:
        """Between cells: SGLang's cache flushed, kvshare's counters and the guard's estimates zeroed."""
        for path in ("/flush_cache", "/kvshare/reset", "/kvshare/fidelity/reset"):
            try:
                requests.post(self.proc.url + path, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)
            except requests.RequestException:
                pass

    def pool_sample(self) -> dict:
        """Pool occupancy (share of the KV pool in use) and evicted tokens so far, from SGLang's ``/metrics``."""
        text = (self.get("/metrics") or {}).get("text", "")
        got: dict = {}
        for line in text.splitlines():
            for name, key in (("sglang:token_usage", "occupancy"), ("sglang:evicted_tokens_total", "evicted")):
                if line.startswith(name) and not line.startswith(name + "_"):
                    got[key] = got.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return got

    def fidelity(self) -> dict:
        """The guard's measured top-1 per agent (scope) of this cell."""
        snap = self.get("/kvshare/fidelity") or {}
        return {scope: {"samples": v.get("samples"), "top1": v.get("top1")}
                for scope, v in (snap.get("per_scope") or {}).items()}


def sampled(server: Server, fn, every_s: float = 1.0):
    """Run ``fn()`` while sampling the pool every ``every_s``; (its result, [[t, occupancy, evicted], ...])."""
    samples, stop, t0 = [], threading.Event(), time.perf_counter()

    def loop() -> None:
        while not stop.wait(every_s):
            s = server.pool_sample()
            samples.append([round(time.perf_counter() - t0, 1), s.get("occupancy"), s.get("evicted")])

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        return fn(), samples
    finally:
        stop.set()
        thread.join(timeout=10)


# ------------------------------------------------------------------ the model for a GPU's shapes
def write_model(path: Path, tokenizer_from: Path, config: dict = LLAMA_8B) -> Path:
    """A model folder of ``config``'s shape with the tokenizer (and chat template) of ``tokenizer_from``: served
    with ``--load-format dummy`` (random weights; the shapes are what time depends on)."""
    src = tokenizer_from
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (src / name).is_file():
            shutil.copy(src / name, path / name)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# ------------------------------------------------------------------ the run
def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.agent_traffic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="teams " + " ".join(QUICK_TEAMS) + ", rates 4 and 60")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
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
    from devtools.models import prepare
    from devtools.server_process import ServerProcess

    model = Path(args.model) if Path(args.model).is_dir() else prepare(args.model)
    model = str(write_model(args.write_model, model) if args.write_model else model)
    common = ["--enable-metrics", *(["--device", args.device] if args.device else []), *shlex.split(args.server_args)]
    servers = []
    for pool in args.pools:
        flags = common + ["--max-total-tokens", str(pool_tokens(pool, teams, args.max_tokens))]
        for arm in args.arms:
            cmd = ServerProcess(model_path=model, stock=arm == "stock", kvshare_args=ARMS[arm], extra_args=flags,
                                port=0).command()
            servers.append({"arm": arm, "pool": pool, "flags": flags, "command": shlex.join(cmd)})
    return {"model": model, "teams": [t["name"] for t in teams], "rates": args.rates,
            "working_set_tokens": working_set(teams, args.max_tokens), "servers": servers}


def main(argv=None) -> int:
    from tqdm import tqdm

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
    bar = tqdm(total=len(the_plan["servers"]) * len(args.rates) * sum(len(t["requests"]) for t in teams),
               desc="agent_traffic", unit="req")
    for spec in the_plan["servers"]:
        server = Server(spec["arm"], the_plan["model"], spec["flags"] + ["--admin-api-key", key], key)
        with server.proc:
            chat_stream(server.proc.url, [{"role": "user", "content": "Say hello."}], 8)  # first-request costs
            for i, rate in enumerate(args.rates):
                server.clear()
                run, samples = sampled(server, lambda: run_cell(server.proc.url, teams, rate, args.seed + i,
                                                                args.max_tokens, bar))
                stats = server.get("/kvshare/stats")
                where = (spec["arm"], spec["pool"], rate)
                if spec["arm"] == "stock":
                    stock_answers[(spec["pool"], rate)] = {(r["team"], r["turn"]): r["text"] for r in run["rows"]}
                cell = {"arm": spec["arm"], "pool": spec["pool"], "rate": rate, "retention": retention(stats),
                        "max_total_tokens": int(spec["flags"][-1]),
                        **derive(run, None if spec["arm"] == "stock" else stock_answers.get((spec["pool"], rate))),
                        "guard_top1": server.fidelity() if stats else None,
                        "phase_seconds": {k: v for k, v in ((stats or {}).get("counters") or {}).items()
                                          if k.endswith("_seconds")}}
                result["cells"].append(cell)
                result["pool_samples"]["/".join(map(str, where))] = samples
                result["wall_s"] = round(time.perf_counter() - t_start, 1)
                write_json(args.out, result)  # a stopped run keeps its finished cells
    bar.close()
    plot(result, args.out.with_suffix(".png"))
    from benchmarks.report_sections import render_agent_traffic

    print(render_agent_traffic(result))
    print(f"wrote {args.out} in {result['wall_s']} s")
    return 0


def plot(result: dict, path: Path) -> None:
    """TTFT p50 of turns 2.. against the rate per arm and pool; pool occupancy and evicted tokens over time in the
    half pool's highest rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    series = defaultdict(list)
    for c in result["cells"]:
        series[(c["arm"], c["pool"])].append((c["rate"], c["ttft_p50_s"]))
    for (arm, pool), pts in sorted(series.items()):
        axes[0].plot(*zip(*sorted(pts)), marker="o", linestyle="-" if pool == "large" else "--", label=f"{arm} {pool}")
    axes[0].set(xlabel="teams / minute", ylabel="TTFT p50, turns 2.. (s)", xscale="log")
    top = max((c["rate"] for c in result["cells"]), default=0)
    for key, samples in result["pool_samples"].items():
        arm, pool, rate = key.split("/")
        if float(rate) == top and samples:
            t = [s[0] for s in samples]
            axes[1].plot(t, [s[1] or 0 for s in samples], label=f"{arm} {pool}")
            axes[2].plot(t, [s[2] or 0 for s in samples], label=f"{arm} {pool}")
    axes[1].set(xlabel="s", ylabel="KV pool occupancy", title=f"{top:g} teams / minute")
    axes[2].set(xlabel="s", ylabel="evicted tokens (cumulative)", title=f"{top:g} teams / minute")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
