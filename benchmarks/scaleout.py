"""``python -m benchmarks.scaleout``: workflow reuse on two workers, with and without affinity.

The question: when a deployment scales out to two workers, does a multi-agent
workflow keep the reuse it gets on one? Each worker holds its own copies, so
an agent reuses another's shared text only on the worker where it lies. The
same GSM8K ``refer`` workflow (the same samples, greedy) runs on:

* ``one_worker``: one server, ``--dp-size 1`` (the reference);
* ``dp2_affinity`` / ``dp2_none``: one server with ``--dp-size 2``; every
  sample names its workflow (the server routes it to one worker), or none
  (SGLang's round robin);
* ``router_affinity`` / ``router_none``: two servers behind SGLang's router
  (``--policy manual``); every sample names its workflow, and the client
  library sends its routing header, or (``_none``) no header, so the router
  places each request at random while the annotation still arrives.

Every arm starts fresh servers (no copy from an earlier arm), gives each
worker one core (``--dp-size 2`` binds one core per rank; the two servers get
one each), and records the workflow reuse ratio (shared tokens served without
prefill over shared tokens) and how the shared tokens spread over the workers
(each worker's ``/kvshare/stats``). Target: the affinity arms within 0.05 of
``one_worker``'s reuse.

    python -m benchmarks.scaleout --limit 16     # writes benchmarks/results/scaleout.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

import requests

from benchmarks.harness import RESULTS, command_line, machine, run_meta, write_json

ARMS = ("one_worker", "dp2_affinity", "dp2_none", "router_affinity", "router_none")
KVSHARE = ("--kvshare-mode", "fullshared", "--kvshare-verify-rate", "0")
TARGET_GAP = 0.05


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaleout", description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=16, help="GSM8K samples (one workflow each)")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4, help="workflows in flight at once")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool tokens per worker")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default=str(RESULTS / "scaleout.json"))
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


@contextlib.contextmanager
def workers(arm: str, model_path: str, max_total_tokens: int) -> Iterator[tuple[str, list[str]]]:
    """``(url the client talks to, the servers whose stats count)`` for one arm, stopped after it."""
    from devtools.router_process import fleet
    from devtools.server_process import ServerProcess

    pool = ("--max-total-tokens", str(max_total_tokens))
    if arm == "one_worker":
        with ServerProcess(model_path=model_path, kvshare_args=KVSHARE, extra_args=pool, cores="0") as server:
            yield server.url, [server.url]
    elif arm.startswith("dp2"):
        with ServerProcess(model_path=model_path, kvshare_args=KVSHARE, extra_args=(*pool, "--dp-size", "2")) as server:
            yield server.url, [server.url]
    else:
        with fleet(model_path, KVSHARE, pool) as (router, servers):
            yield router.url, [s.url for s in servers]


def spread(stats_urls: list[str]) -> list[dict]:
    """Shared tokens seen and reuse per worker (a DP server lists its ranks; a router's servers one each)."""
    rows = []
    for url in stats_urls:
        stats = requests.get(url + "/kvshare/stats", timeout=60).json()
        for rank in stats.get("ranks") or [{"dp_rank": 0, **stats}]:
            rows.append({"server": url, "dp_rank": rank.get("dp_rank", 0),
                         "shared_tokens_seen": rank.get("shared_tokens_seen", 0),
                         "reuse_ratio": rank.get("reuse_ratio")})
    return rows


def summarize(results: list[dict]) -> dict:
    """One arm's reuse (shared tokens served aligned, corrected or as an estimate hit, over shared tokens, from the
    server reports), accuracy, shared tokens and the mean TTFT of agents 2 on."""
    shared: Counter = Counter()
    for res in results:
        for rec in res["records"]:
            for seg in (rec.get("report") or {}).get("segments", []):
                if seg.get("kind") == "shared":
                    shared[seg.get("resolved_by", "dense")] += seg["tokens"]
    n = sum(shared.values())
    later = [rec["ttft_s"] for res in results for rec in res["records"][1:] if rec["ttft_s"] is not None]
    return {"reuse_ratio": (shared["alignment"] + shared["correction"] + shared["estimate_hit"]) / n if n else None,
            "accuracy": statistics.fmean(1.0 if r["correct"] else 0.0 for r in results) if results else None,
            "shared_tokens": n, "ttft_s_mean_agents_2_on": statistics.fmean(later) if later else None}


def run_arm(arm: str, args, task, samples, model_path: str) -> dict:
    from benchmarks.workloads.workflows import run_workflow
    from sglang_kvshare.frontend.backend import KVShareEndpoint

    class WithoutRoutingHeader(KVShareEndpoint):
        """The client library minus the routing header: the router places each request at random."""

        def _headers(self, workflow=None):
            return super()._headers(None)

    t0 = time.perf_counter()
    with workers(arm, model_path, args.max_total_tokens) as (url, stats_urls):
        backend = (WithoutRoutingHeader if arm == "router_none" else KVShareEndpoint)(url)
        results = run_workflow(backend, task, samples, topology="refer", num_agents=args.agents,
                               max_tokens=args.max_tokens, concurrency=args.concurrency,
                               progress_bar=not args.no_progress, desc=f"scaleout/{arm}",
                               workflow_names=arm != "dp2_none")
        per_worker = spread(stats_urls)
    for res, smp in zip(results, samples):
        res["answer"] = task.extract(res["final"], smp)
        res["correct"] = bool(task.score(res["answer"], smp))
    summary = summarize(results)
    return {"arm": arm, "wall_s": round(time.perf_counter() - t0, 1), "reuse_ratio": summary["reuse_ratio"],
            "accuracy": summary["accuracy"], "shared_tokens": summary["shared_tokens"],
            "ttft_s_mean_agents_2_on": summary["ttft_s_mean_agents_2_on"],
            "workers": per_worker, "answers": [r["final"] for r in results]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from benchmarks.workloads.tasks import TASKS
    from devtools.models import prepare

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; choose from {ARMS}")
    task = TASKS["gsm8k"]
    samples = task.load(args.limit, args.offset)
    model_path = str(prepare(args.model))
    out = {"meta": run_meta(command_line(argv)), "machine": machine(), "task": "gsm8k", "topology": "refer",
           "samples": len(samples), "agents": args.agents, "max_tokens": args.max_tokens,
           "concurrency": args.concurrency, "mode": "fullshared", "target_gap": TARGET_GAP,
           "reuse": "shared tokens aligned, corrected or estimate hits / shared tokens, over every request",
           "arms": {}}
    for arm in arms:
        out["arms"][arm] = run_arm(arm, args, task, samples, model_path)
        reference = out["arms"].get("one_worker", {}).get("reuse_ratio")
        for row in out["arms"].values():
            if reference is not None and row["reuse_ratio"] is not None:
                row["reuse_gap_to_one_worker"] = round(reference - row["reuse_ratio"], 4)
                row["same_answers_as_one_worker"] = (
                    sum(a == b for a, b in zip(row["answers"], out["arms"]["one_worker"]["answers"]))
                    / len(row["answers"]))
        write_json(Path(args.out), out)
        print(f"{arm}: reuse {out['arms'][arm]['reuse_ratio']:.3f}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
