"""``python -m benchmarks.chain_ttft``: what reuse costs on a 4-agent chain, against its physical floor.

Every agent reads the same shared context (``--lengths`` tokens of real text)
behind its own system prompt; one 1-token greedy generation per agent; TTFT
is the time to the first streamed chunk. Per arm (one fresh server each,
one at a time) and per repeat (a new content each time):

* ``ttft``: the chain's agents in order (agent 1 prefills densely; agents 2-4
  reuse the context in the kvshare modes);
* ``floor``: each agent's *exact same* request sent again at once: an exact
  radix hit, this engine's own per-request cost, which no reuse can beat;
* ``reuse_over_floor``: ``ttft / floor`` for agents 2-4 (assembly can only add to the floor);
* ``assembly_s``: the server's own assembly time (report), next to the dense
  prefill it replaces (``off``'s TTFT minus its floor, same content).
* ``while_learning``: ``--probe`` dense requests (an agent 1 of a new
  content, nothing to reuse) sent right after the warm chains, while a kvcmas
  learner still has their observations queued (``pending`` says how many);
  every arm runs the same warm chains and probes, so ``while_learning_vs_off``
  compares like with like (the target: at most 1.10x); ``--probe-gap`` spaces
  them (back to back is steady load; a gap is a lull the learner may use).

Arms: ``off``, ``fullshared``, ``kvcmas`` (each with the server's defaults
otherwise: 15 % of each reused segment recomputed inside the one prefill
forward), ``stock`` (``sglang.launch_server`` with SGLang's default cache: is
``off`` free?), and ``ARM@name=value,...`` for other settings
(``fullshared@recompute-ratio=0``, ``kvcmas@learn-yield-s=0``;
``@sparse-extend=false`` stages each head, one extra forward per reused
segment; a setting without a flag goes into a ``--kvshare-config`` file).
``kvcmas`` learns on its background thread (the serving default) from
``--warm`` chains; the measured repeats start once that learning is done
(``wait_learning``, at most 300 s); the probes run before it.
Medians and min-max over ``--repeats``; ratios within one run of this machine.
"""

from __future__ import annotations

import argparse
import sys
import statistics
import time
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks.harness import (RESULTS, machine, mode_args, prefilled_tokens, run_meta, stream_generate, wait_learning,
                                write_json)
from benchmarks.report_sections import render_chain
from benchmarks.texts import context_tokens
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part
from devtools.server_process import ServerProcess, settings_args
from sglang_kvshare.config import FIELD_NAMES, from_text

AGENTS = {
    "planner": "You are the planner. Break the task into steps.",
    "solver": "You are a careful solver. Work through the material and compute the result.",
    "critic": "You are a critic. Find mistakes in the reasoning about the material below and say how to fix them.",
    "judge": "You are the judge. Read everything and give the final answer in one line.",
}
LATER = list(AGENTS)[1:]


def system(agent: str) -> str:
    return f"<|im_start|>system\n{AGENTS[agent]}<|im_end|>\n<|im_start|>user\nMaterial:\n"


SUFFIX = "\nWhat is the key point?<|im_end|>\n<|im_start|>assistant\n"


def request(tok, agent: str, ctx: list[int]):
    return build_request(tok, agent, [private_part(system(agent)), shared_part(ctx, "context"), private_part(SUFFIX)])


def run_chain(url: str, tok, ctx: list[int], *, floor: bool) -> dict:
    """One chain; with ``floor`` every request is sent twice (the second is an exact hit)."""
    rows = {}
    for agent in AGENTS:
        ids, cp = request(tok, agent, ctx)
        timed = stream_generate(url, ids, custom_params=cp, max_new_tokens=1)
        rep, meta = timed.report, timed.meta
        row = {"ttft_s": timed.ttft, "prefill_tokens": prefilled_tokens(meta),
               "shared_tokens_reused": rep.get("shared_tokens_reused", 0),
               "assembly_s": rep.get("assembly_seconds", 0.0), "fallbacks": rep.get("fallbacks", [])}
        if floor:
            again = stream_generate(url, ids, custom_params=cp, max_new_tokens=1)
            row["floor_s"] = again.ttft
            row["floor_prefill_tokens"] = prefilled_tokens(again.meta)
        rows[agent] = row
    return rows


def pending_observations(url: str) -> int | None:
    try:
        return int(requests.get(url + "/kvshare/stats", timeout=30).json().get("pending_observations", 0))
    except (requests.RequestException, ValueError):
        return None  # the stock server has no kvshare endpoints


def probe_dense(url: str, tok, length: int, n: int, gap_s: float = 0.0) -> list[dict]:
    """``n`` dense requests of new contents, ``gap_s`` apart, each with the learner's backlog before it."""
    rows = []
    for i in range(n):
        if i and gap_s > 0:
            time.sleep(gap_s)  # an agent's think time: a lull the learner may use
        pending = pending_observations(url)
        ids, cp = request(tok, list(AGENTS)[0], context_tokens(tok, length, seed=50_000 + 10 * length + i))
        timed = stream_generate(url, ids, custom_params=cp, max_new_tokens=1)
        rows.append({"ttft_s": timed.ttft, "pending_before": pending,
                     "prefill_tokens": prefilled_tokens(timed.meta)})
    return rows


def arm_launch(arm: str, tau: float) -> tuple[str, list[str]]:
    """An arm's mode and extra kvshare launch arguments: ``MODE[@name=value,...]``, each name a setting
    (docs/CONFIGURATION.md, dashes for underscores); one without a flag goes into a ``--kvshare-config`` file."""
    mode, _, flags = arm.partition("@")
    settings: dict = {"tau": tau}
    for flag in filter(None, flags.split(",")):  # ``kvcmas@learn-yield-s=0``: one more setting
        name, sep, value = flag.partition("=")
        key = name.replace("-", "_")
        if not sep or not name:
            raise ValueError(f"arm {arm!r}: flag {flag!r} is not name=value")
        if key not in FIELD_NAMES:
            raise ValueError(f"arm {arm!r}: {name!r} is not a kvshare setting")
        settings[key] = from_text(key, value)
    return mode, settings_args(settings)


def start(model_path: str, arm: str, tau: float) -> ServerProcess:
    if arm == "stock":
        return ServerProcess(model_path=model_path, stock=True).start()
    mode, extra = arm_launch(arm, tau)
    return ServerProcess(model_path=model_path, kvshare_args=mode_args(mode, extra)).start()


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chain_ttft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--arms", nargs="+", default=["stock", "off", "fullshared", "kvcmas", "fullshared@recompute-ratio=0"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warm", type=int, default=3, help="chains kvcmas learns from before the measured ones")
    ap.add_argument("--tau", type=float, default=0.3)
    ap.add_argument("--probe", type=int, default=4,
                    help="dense requests sent right after the warm chains, while kvcmas learns (0: none)")
    ap.add_argument("--probe-gap", type=float, default=0.0, help="seconds between the probes (default back to back)")
    ap.add_argument("--out", default=str(RESULTS / "chain_ttft.json"))
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from devtools.models import prepare

    model_path = str(prepare("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(model_path)
    command = "python -m benchmarks.chain_ttft " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict = {"meta": run_meta(command.strip()), "command": command, "machine": machine(),
                     "model": "SmolLM2-135M-Instruct", "agents": list(AGENTS), "tau": args.tau,
                     "repeats": args.repeats, "probe": args.probe, "probe_gap_s": args.probe_gap,
                     "ttft_definition": "time to the first streamed chunk of a 1-token greedy generation",
                     "floor_definition": "TTFT of the same request sent again at once (an exact radix hit)",
                     "arms": {}}
    bar = tqdm(total=len(args.arms) * len(args.lengths) * args.repeats, desc="chain_ttft")
    for arm in args.arms:
        server = start(model_path, arm, args.tau)
        try:
            for agent in AGENTS:  # warm the system prompts, as a long-running team would have
                stream_generate(server.url, build_request(tok, agent, [private_part(system(agent))])[0],
                                max_new_tokens=1)
            per_len = {}
            for length in args.lengths:
                cell: dict = {}
                warm = []
                if arm.startswith("kvcmas") or args.probe:  # every arm warms alike when it is probed
                    for w in range(args.warm):
                        warm.append(run_chain(server.url, tok, context_tokens(tok, length, seed=1000 + 10 * length + w),
                                              floor=False))
                if args.probe:
                    cell["while_learning"] = probe_dense(server.url, tok, length, args.probe, args.probe_gap)
                if arm.startswith("kvcmas"):
                    wait_learning(server.url)
                reps = []
                for r in range(args.repeats):
                    reps.append(run_chain(server.url, tok, context_tokens(tok, length, seed=length + 7 * r),
                                          floor=True))
                    bar.update()
                # Per content in the order served (warm chains, then the measured ones): the share of agents
                # 2-4's shared tokens reused; a kvcmas server prefills contents densely while its pools learn.
                chain_reuse = [round(sum(c[a]["shared_tokens_reused"] for a in LATER) / (length * len(LATER)), 3)
                               for c in warm + reps]
                per_len[str(length)] = {**cell, "repeats": reps, "chain_reuse": chain_reuse,
                                        "contents_dense": sum(r == 0 for r in chain_reuse)}
            results["arms"][arm] = per_len
            if arm != "stock":  # where the server's time went, and what the learner kept or dropped
                stats = requests.get(server.url + "/kvshare/stats", timeout=30).json()
                results.setdefault("server_counters", {})[arm] = stats.get("counters", {})
        finally:
            server.stop()
        write_json(Path(args.out), results)
    bar.close()
    derive(results, args.lengths)
    write_json(Path(args.out), results)
    print(render_chain(results))
    print(f"wrote {args.out}")
    return 0


def derive(results: dict, lengths) -> None:
    """Per arm and length: medians/spreads of TTFT, floor, ratios; ratios against off (same repeat)."""
    arms = results["arms"]
    for arm, per_len in arms.items():
        for length in map(str, lengths):
            cell = per_len[length]
            reps = cell["repeats"]
            later_ttft = [statistics.mean(rep[a]["ttft_s"] for a in LATER) for rep in reps]
            later_floor = [statistics.mean(rep[a]["floor_s"] for a in LATER) for rep in reps]
            cell["ttft_agents_2_4_s"] = summary(later_ttft)
            cell["floor_agents_2_4_s"] = summary(later_floor)
            cell["reuse_over_floor"] = summary([t / f for t, f in zip(later_ttft, later_floor)])
            cell["agent1_ttft_s"] = summary([rep[list(AGENTS)[0]]["ttft_s"] for rep in reps])
            if cell.get("while_learning"):
                cell["while_learning_ttft_s"] = summary([p["ttft_s"] for p in cell["while_learning"]])
            cell["reuse_ratio"] = statistics.mean(
                sum(rep[a]["shared_tokens_reused"] for a in LATER) / (int(length) * len(LATER)) for rep in reps)
            cell["assembly_s"] = summary([statistics.mean(rep[a]["assembly_s"] for a in LATER) for rep in reps])
            if "off" in arms and length in arms["off"]:
                off = arms["off"][length]["repeats"]
                off_later = [statistics.mean(rep[a]["ttft_s"] for a in LATER) for rep in off]
                dense = [statistics.mean(rep[a]["ttft_s"] - rep[a]["floor_s"] for a in LATER) for rep in off]
                cell["speedup_vs_off_agents_2_4"] = summary([o / t for o, t in zip(off_later, later_ttft)])
                cell["agent1_vs_off"] = summary([rep[list(AGENTS)[0]]["ttft_s"] / o[list(AGENTS)[0]]["ttft_s"]
                                                 for rep, o in zip(reps, off)])
                if cell.get("while_learning") and arms["off"][length].get("while_learning"):
                    cell["while_learning_vs_off"] = summary(
                        [p["ttft_s"] / o["ttft_s"] for p, o in zip(cell["while_learning"],
                                                                 arms["off"][length]["while_learning"])])
                cell["assembly_over_dense_prefill"] = summary(
                    [statistics.mean(rep[a]["assembly_s"] for a in LATER) / max(d, 1e-9)
                     for rep, d in zip(reps, dense)])


if __name__ == "__main__":
    raise SystemExit(main())
