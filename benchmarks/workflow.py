"""Run a multi-agent workflow benchmark: accuracy, agreement with ``off``, reuse, TTFT.

    python -m benchmarks.workflow --task gsm8k --topology refer --agents 4 \\
        --limit 50 --mode kvcmas --compare off      # writes benchmarks/results/workflow_gsm8k.json

``--mode`` takes a comma-separated list (``off,fullshared,kvcmas``): the modes
run one after the other on the same samples, each on its own server, and
every mode is compared with ``--compare``. The JSON is rewritten after each
mode, so an interrupted run keeps what finished.

Starts a server per mode (``ServerProcess``; one at a time, always stopped)
or attaches to ``--url`` (then ``--mode`` only labels the run and
``--compare`` is refused). Prints a summary and writes JSON with the command,
machine and model. Numbers:

* ``accuracy``: GSM8K exact match of the extracted number; HumanEval pass@1
  of the final agent's code, run in a sandboxed subprocess.
* ``agreement``: per sample, the compared run gives the same extracted answer
  (GSM8K) or the same pass/fail (HumanEval); ``identical_final`` compares text.
* ``reuse_ratio``: shared (PH) tokens served by re-alignment or correction /
  all shared tokens in annotated requests (server reports); exact radix hits
  are counted separately (``shared_exact_hit_ratio``).
* ``dense_fallback_rate``: shared segments the server tried to reuse (not an
  exact hit) that were prefilled densely, with the reasons.
* ``ttft``: client-side, from the streamed response: time from sending the
  request to the first chunk with an output token (includes queueing and
  HTTP; the server reports no per-request first-token time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional

from benchmarks.harness import RESULTS, run_meta

MODES = ("off", "fullshared", "kvcmas", "stock")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.workflow", description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=("gsm8k",), default="gsm8k")
    p.add_argument("--topology", choices=("chain", "refer", "debate"), default="refer")
    p.add_argument("--agents", type=int, default=4, help="role agents + the final agent (2..4)")
    p.add_argument("--rounds", type=int, default=2, help="debate rounds")
    p.add_argument("--limit", type=int, default=50, help="number of samples")
    p.add_argument("--offset", type=int, default=0, help="first sample index")
    p.add_argument("--mode", default="kvcmas",
                   help=f"server kvshare mode(s), comma-separated, from {', '.join(MODES)} (stock: plain SGLang)")
    p.add_argument("--compare", choices=MODES + ("none",), default="none",
                   help="also run this mode on the same samples and report agreement")
    p.add_argument("--url", default=None, help="attach to a running server instead of starting one")
    p.add_argument("--max-tokens", type=int, default=128, help="max new tokens per agent")
    p.add_argument("--sequential", action="store_true", help="run agents of one round one by one")
    p.add_argument("--concurrency", type=int, default=1,
                   help="samples in flight at once (the server batches their decode; TTFT then includes queueing)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra launcher argument for started servers (repeat), e.g. --server-arg=--kvshare-tau=0.3")
    p.add_argument("--model", default="smollm2-135m", help="model name for devtools.models.prepare")
    p.add_argument("--model-path", default=None, help="local model folder (overrides --model)")
    p.add_argument("--out", default=None,
                   help="write the JSON here (default benchmarks/results/workflow_<task>.json, the task's canonical "
                        "file; with --url none unless given: a run on an attached server is not a canonical result)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


# ------------------------------------------------------------------ metrics
def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(results: list[dict]) -> dict:
    """Aggregate one run's per-sample results (``run_workflow`` output plus ``correct``)."""
    shared = Counter()  # tokens by resolved_by, shared segments only
    totals = Counter()
    attempts, dense, reasons, reported = 0, 0, Counter(), 0
    ttft_by_agent, ttft_by_pos = defaultdict(list), defaultdict(list)
    for res in results:
        for pos, rec in enumerate(res["records"]):
            ttft_by_agent[rec["agent"]].append(rec["ttft_s"])
            ttft_by_pos[pos + 1].append(rec["ttft_s"])
            rep = rec.get("report")
            if not rep:
                continue
            reported += 1
            for key in ("tokens_exact_hit", "tokens_estimate_hit", "tokens_aligned", "tokens_corrected",
                        "tokens_prefilled"):
                totals[key] += rep.get(key, 0)
            for seg in rep.get("segments", []):
                if seg.get("kind") != "shared":
                    continue
                shared[seg.get("resolved_by", "dense")] += seg["tokens"]
                shared["all"] += seg["tokens"]
                if seg.get("resolved_by") not in ("hit", "estimate_hit"):
                    attempts += 1
                    if seg.get("resolved_by") == "dense":
                        dense += 1
                        reasons[seg.get("reason") or "after_unresolved_segment"] += 1
    n_shared = shared["all"]
    prompt_total = sum(totals.values())
    later = [t for pos, ts in ttft_by_pos.items() if pos >= 2 for t in ts]
    return {
        "samples": len(results),
        "accuracy": _mean([1.0 if r["correct"] else 0.0 for r in results]),
        "requests_with_report": reported,
        "shared_tokens": n_shared,
        "reuse_ratio": ((shared["alignment"] + shared["correction"] + shared["estimate_hit"]) / n_shared
                        if n_shared else None),
        "shared_aligned_ratio": shared["alignment"] / n_shared if n_shared else None,
        "shared_corrected_ratio": shared["correction"] / n_shared if n_shared else None,
        "shared_exact_hit_ratio": shared["hit"] / n_shared if n_shared else None,
        "prompt_reuse_ratio": ((totals["tokens_exact_hit"] + totals["tokens_estimate_hit"] + totals["tokens_aligned"]
                                + totals["tokens_corrected"]) / prompt_total) if prompt_total else None,
        "dense_fallback_rate": dense / attempts if attempts else None,
        "shared_segments_attempted": attempts,
        "fallback_reasons": dict(reasons),
        "ttft_s_by_agent": {a: {"mean": _mean(ts), "p50": _pct(ts, 0.5), "n": len(ts)} for a, ts in ttft_by_agent.items()},
        "ttft_s_by_position": {str(p): {"mean": _mean(ts), "p50": _pct(ts, 0.5)} for p, ts in sorted(ttft_by_pos.items())},
        "ttft_s_mean_agents_2_on": _mean(later),
        "ttft_s_mean_agent_1": _mean(ttft_by_pos.get(1, [])),
        "e2e_s_mean": _mean([r["seconds"] for r in results]),
        "e2e_s_p50": _pct([r["seconds"] for r in results], 0.5),
        "e2e_s_p90": _pct([r["seconds"] for r in results], 0.9),
    }


def agreement(task_name: str, a: list[dict], b: list[dict]) -> dict:
    """How often run ``a`` agrees with run ``b`` on the same samples."""
    same_answer = [(x["correct"] == y["correct"]) if task_name == "humaneval" else (x["answer"] == y["answer"])
                   for x, y in zip(a, b)]
    return {
        "final_answer_agreement": _mean([1.0 if s else 0.0 for s in same_answer]),
        "identical_final_text": _mean([1.0 if x["final"] == y["final"] else 0.0 for x, y in zip(a, b)]),
        "samples": len(same_answer),
        "compares": "pass/fail" if task_name == "humaneval" else "extracted number",
    }


# ------------------------------------------------------------------ running
_ACTIVE_SERVERS: list = []  # the server this process started, stopped on SIGTERM


def _on_sigterm(*_) -> None:
    # NOTE: stop the server directly and leave at once: program threads may be
    # blocked in HTTP reads, which would keep a SystemExit from unwinding.
    for server in list(_ACTIVE_SERVERS):
        server.stop()
    os._exit(143)


def run_mode(mode: str, args, samples, task, model_path: str, url: Optional[str] = None) -> dict:
    from benchmarks.workloads.workflows import run_workflow
    from sglang_kvshare.frontend.backend import KVShareEndpoint
    from devtools.server_process import ServerProcess

    def go(base_url: str) -> list[dict]:
        backend = KVShareEndpoint(base_url)
        return run_workflow(backend, task, samples, topology=args.topology, num_agents=args.agents,
                            rounds=args.rounds, max_tokens=args.max_tokens, parallel=not args.sequential,
                            progress_bar=not args.no_progress, desc=f"{task.name}/{args.topology}/{mode}",
                            concurrency=args.concurrency)

    t0 = time.perf_counter()
    if url:
        results = go(url)
    else:
        kv_args = [] if mode == "stock" else ["--kvshare-mode", mode, *args.server_arg]
        with ServerProcess(model_path=model_path, kvshare_args=kv_args, stock=mode == "stock") as server:
            _ACTIVE_SERVERS.append(server)
            try:
                results = go(server.url)
            finally:
                _ACTIVE_SERVERS.remove(server)
    wall = time.perf_counter() - t0
    for res, smp in zip(results, samples):
        res["answer"] = task.extract(res["final"], smp)
        res["correct"] = bool(task.score(res["answer"], smp))
    return {"mode": mode, "wall_s": wall, "summary": summarize(results), "results": results}


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 -- informational only
        pass
    try:
        import sglang

        info["sglang"] = sglang.__version__
    except Exception:  # noqa: BLE001
        pass
    return info


def _short(run: dict) -> dict:
    return {"mode": run["mode"], "wall_s": round(run["wall_s"], 1), **run["summary"]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    from benchmarks.workloads.tasks import TASKS

    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {MODES}")
    if args.compare != "none" and args.compare not in modes:
        modes.append(args.compare)
    if args.url and len(modes) > 1:
        raise SystemExit("--url attaches to one server: give one --mode and no --compare, or drop --url")
    task = TASKS[args.task]
    samples = task.load(args.limit, args.offset)
    if args.model_path:
        model_path = args.model_path
    elif args.url:
        model_path = None
    else:
        from devtools.models import prepare

        model_path = str(prepare(args.model))
    argv_used = sys.argv[1:] if argv is None else argv
    out_path = args.out or (None if args.url else str(RESULTS / f"workflow_{args.task}.json"))
    command = "python -m benchmarks.workflow " + " ".join(shlex.quote(a) for a in argv_used)
    out = {
        "meta": run_meta(command.strip()),
        "command": command,
        "machine": machine(),
        "model": model_path or args.url,
        "task": args.task, "topology": args.topology, "agents": args.agents,
        "rounds": args.rounds if args.topology == "debate" else None,
        "samples": len(samples), "offset": args.offset, "max_tokens": args.max_tokens,
        "parallel_agents": not args.sequential,
        "concurrency": args.concurrency,
        "ttft_method": "client-side streaming: request sent -> first chunk carrying an output token",
        "runs": {},
    }
    runs = {}
    for mode in modes:
        run = run_mode(mode, args, samples, task, model_path, args.url)
        runs[mode] = run
        out["runs"][mode] = _short(run)
        if args.compare != "none" and args.compare in runs:
            out[f"agreement_with_{args.compare}"] = {
                m: agreement(args.task, r["results"], runs[args.compare]["results"])
                for m, r in runs.items() if m != args.compare}
        out["per_sample"] = {m: [_sample_row(res) for res in r["results"]] for m, r in runs.items()}
        if out_path:
            Path(out_path).parent.mkdir(parents=True, exist_ok=True)
            Path(out_path).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps({k: out[k] for k in out if k != "per_sample"}, indent=2, default=str))
    if out_path:
        print(f"wrote {out_path}", file=sys.stderr)
    return out


def _sample_row(res: dict) -> dict:
    keys = ("agent", "tokens_exact_hit", "tokens_aligned", "tokens_corrected", "tokens_prefilled")
    row = {k: v for k, v in res.items() if k != "records"}
    row["ttft_s"] = [rec["ttft_s"] for rec in res["records"]]
    row["reports"] = [rec["report"] and {**{k: rec["report"].get(k) for k in keys},
                                         "shared": [_segment_brief(seg) for seg in rec["report"].get("segments", [])
                                                    if seg.get("kind") == "shared"]}
                      for rec in res["records"]]
    return row


def _segment_brief(seg: dict) -> str:
    """``slot:how[:reason]`` per shared segment: enough to see where reuse stopped."""
    reason = f":{seg['reason']}" if seg.get("reason") else ""
    return f"{seg.get('slot')}:{seg.get('resolved_by')}{reason}"


if __name__ == "__main__":
    main()
