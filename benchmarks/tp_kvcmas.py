"""``python -m benchmarks.tp_kvcmas``: kvcmas at tensor-parallel size 3 against size 1, on the same chains.

The question: with each rank learning the anchors of its own KV heads and the
gate reducing over the ranks, does a TP=3 server reuse and correct as a TP=1
server does? Per TP size, one server (kvcmas, learning in the scheduler step
at both sizes so they learn alike):

1. mode ``off`` (switched at runtime): every agent of every chain answers
   greedily (the reference continuation), then its prompt + that continuation
   is teacher-forced densely (the reference distributions);
2. pools and copies reset, mode ``kvcmas``: the agents warm their prompts,
   then every chain runs again, each agent teacher-forced along ``off``'s
   continuation with the shared document annotated: reuse from the reports,
   top-1 and KL against step 1 at the same TP size.

Chains: ``chain_ttft``'s four agents read one context of ``--length`` tokens
of real text in turn, each behind its own system prompt. Targets (the TP=3
ratios to TP=1): reuse >= 0.9x, agent 1's greedy answers identical,
teacher-forced top-1 of agents 2-4 within 0.005, the ranks' gate digests equal,
no request lost. ``--soak N`` then sends N more requests to the TP > 1 server,
with aborts and a mode switch on the way, and checks the ranks again.

    python -m benchmarks.tp_kvcmas --chains 12     # writes benchmarks/results/tp_kvcmas.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import requests

from benchmarks import frontier_metrics as fm
from benchmarks.chain_ttft import AGENTS, SUFFIX, request, system
from benchmarks.harness import RESULTS, command_line, machine, post_generate, run_meta, write_json
from benchmarks.texts import context_tokens
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part

TOP_K = 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp_kvcmas", description=__doc__.split("\n\n")[0])
    p.add_argument("--chains", type=int, default=12)
    p.add_argument("--length", type=int, default=1024, help="shared document tokens (about)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy answer tokens per agent")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    p.add_argument("--soak", type=int, default=0,
                   help="then, at TP > 1, this many more requests over new contexts: every 10th aborted mid-answer, "
                        "the mode switched to fullshared and back on the way; lost requests and the ranks' digests")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default=str(RESULTS / "tp_kvcmas.json"))
    return p.parse_args(argv)


def documents(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` contexts of ``length`` tokens of real text (``chain_ttft``'s), one per chain."""
    return [context_tokens(tokenizer, length, seed) for seed in range(n)]


def _configure(url: str, **changes) -> None:
    r = requests.post(url + "/kvshare/config", json=changes, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"config {changes} failed: {r.text[:300]}")


def _forced(url: str, tokenizer, agent: str, doc: list[int], continuation: list[int]) -> tuple[list, dict]:
    """Top-k distributions along ``continuation`` after the agent's prompt over ``doc`` (the document
    annotated shared, the continuation private), and the report."""
    prompt, _ = request(tokenizer, agent, doc)
    ids, cp = build_request(tokenizer, agent, [private_part(system(agent)), shared_part(doc, "context"),
                                               private_part(SUFFIX), private_part(continuation)])
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": TOP_K,
            "logprob_start_len": len(prompt) - 1,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "custom_params": cp}}
    meta = post_generate(url, body)["meta_info"]
    tops = [fm.top_entries(e) for e in meta["input_top_logprobs"]][1:1 + len(continuation)]
    return tops, (meta.get("kvshare") or [{}])[0]


def soak(url: str, tokenizer, n: int, length: int) -> dict:
    """``n`` requests in chains over new contexts; every 10th is aborted while it answers, and the mode goes to
    fullshared at a third and back to kvcmas at two thirds. Counts what came back; a hang fails the run."""
    import threading
    import time

    agents = list(AGENTS)
    docs = [context_tokens(tokenizer, length, 1000 + k) for k in range(n // len(agents) + 1)]
    counts = {"sent": 0, "ok": 0, "aborted": 0, "failed": 0, "mode_switches": 0}
    for i in range(n):
        if i in (n // 3, 2 * n // 3):
            _configure(url, mode="fullshared" if i == n // 3 else "kvcmas")
            counts["mode_switches"] += 1
        ids, cp = request(tokenizer, agents[i % len(agents)], docs[i // len(agents)])
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "custom_params": cp}}
        aborter = None
        if i % 10 == 5:
            body["rid"], body["sampling_params"]["max_new_tokens"] = f"soak-{i}", 200

            def abort(rid=body["rid"]) -> None:
                time.sleep(0.3)
                requests.post(url + "/abort_request", json={"rid": rid}, timeout=60)

            aborter = threading.Thread(target=abort)
            aborter.start()
        r = requests.post(url + "/generate", json=body, timeout=600)
        if aborter is not None:
            aborter.join()
        counts["sent"] += 1
        finish = (r.json().get("meta_info") or {}).get("finish_reason") or {} if r.ok else {}
        if r.ok and finish.get("type") == "abort":
            counts["aborted"] += 1
        elif r.ok:
            counts["ok"] += 1
        else:
            counts["failed"] += 1
    stats = requests.get(url + "/kvshare/stats", timeout=300).json()
    counts["tp_ranks"] = (stats.get("ranks") or [{}])[0].get("tp_ranks")
    return counts


def run_size(tp: int, model_path: str, tokenizer, docs: list[list[int]], max_tokens: int, soak_requests: int = 0,
             length: int = 1024) -> dict:
    from devtools.server_process import ServerProcess

    kvshare = ("--kvshare-mode", "kvcmas", "--kvshare-learn-async", "false", "--kvshare-verify-rate", "0",
               "--kvshare-admin-open", "true")
    extra = ("--tp-size", str(tp), "--max-total-tokens", "16384")
    requests_sent = 0
    with ServerProcess(model_path=model_path, kvshare_args=kvshare, extra_args=extra, startup_timeout=900) as server:
        url = server.url
        _configure(url, mode="off")
        reference = []  # per chain, per agent: (greedy ids, tops)
        for doc in docs:
            chain = []
            for agent in AGENTS:
                ids, _ = request(tokenizer, agent, doc)
                out = post_generate(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens,
                                                                        "temperature": 0.0}})
                greedy = list(out["output_ids"])
                tops, _ = _forced(url, tokenizer, agent, doc, greedy)
                chain.append((greedy, tops))
                requests_sent += 2
            reference.append(chain)
        # Start the kvcmas phase cold: no copy, no pool, and no prompt of the off phase in SGLang's tree
        # (those would be exact hits, not reuse).
        requests.post(url + "/kvshare/reset", timeout=300)
        _configure(url, mode="kvcmas")
        flushed = requests.post(url + "/flush_cache", timeout=300)
        if flushed.status_code != 200:
            raise RuntimeError(f"flushing the radix cache failed: {flushed.text[:300]}")
        for agent in AGENTS:
            ids, cp = build_request(tokenizer, agent, [private_part(system(agent))])
            post_generate(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "custom_params": cp}})
            requests_sent += 1
        shared = reused = 0
        scores = []
        corrected = 0
        for doc, chain in zip(docs, reference):
            for pos, (agent, (greedy, ref_tops)) in enumerate(zip(AGENTS, chain)):
                tops, rep = _forced(url, tokenizer, agent, doc, greedy)
                requests_sent += 1
                if pos == 0:
                    continue
                for seg in rep.get("segments", []):
                    if seg.get("kind") == "shared":
                        shared += seg["tokens"]
                        if seg.get("resolved_by") in ("alignment", "correction"):
                            reused += seg.get("resolved_tokens", seg["tokens"])
                corrected += rep.get("tokens_corrected", 0)
                scores.append(fm.compare_positions(ref_tops, tops))
        stats = requests.get(url + "/kvshare/stats", timeout=300).json()
        tp_ranks = (stats.get("ranks") or [{}])[0].get("tp_ranks")
        soaked = soak(url, tokenizer, soak_requests, length) if soak_requests and tp > 1 else None
    positions = sum(s["positions"] for s in scores)
    return {
        "tp": tp, "requests": requests_sent,
        "reuse_ratio": reused / shared if shared else None, "tokens_corrected": corrected,
        "top1_agents_2_4": sum(s["top1"] * s["positions"] for s in scores) / positions if positions else None,
        "kl_agents_2_4": statistics.fmean(s["kl"] for s in scores if s["kl"] is not None) if scores else None,
        "agent1_greedy": [chain[0][0] for chain in reference],
        "tp_ranks": tp_ranks,
        "digests_equal": None if not tp_ranks else len({(r["gate_decisions"], r["gate_digest"]) for r in tp_ranks}) == 1,
        "soak": soaked and {**soaked, "digests_equal": len({(r["gate_decisions"], r["gate_digest"], r["anchors"])
                                                             for r in soaked["tp_ranks"]}) == 1},
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from devtools.models import prepare

    model_path = str(prepare(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    docs = documents(tokenizer, args.chains, args.length)
    out = {"meta": run_meta(command_line(argv)), "machine": machine(), "chains": args.chains,
           "length": args.length, "agents": len(AGENTS), "max_tokens": args.max_tokens, "sizes": {}}
    for tp in args.tp:
        out["sizes"][str(tp)] = run_size(tp, model_path, tokenizer, docs, args.max_tokens, args.soak, args.length)
        print(f"tp={tp}: reuse {out['sizes'][str(tp)]['reuse_ratio']}, top1 "
              f"{out['sizes'][str(tp)]['top1_agents_2_4']}", file=sys.stderr)
        write_json(Path(args.out), out)
    sizes = out["sizes"]
    if "1" in sizes and len(sizes) > 1:
        base = sizes["1"]
        for key, row in sizes.items():
            if key == "1":
                continue
            row["vs_tp1"] = {
                "reuse_ratio": (row["reuse_ratio"] / base["reuse_ratio"]
                                if row["reuse_ratio"] is not None and base["reuse_ratio"] else None),
                "top1_difference": (row["top1_agents_2_4"] - base["top1_agents_2_4"]
                                    if row["top1_agents_2_4"] is not None and base["top1_agents_2_4"] is not None
                                    else None),
                "agent1_greedy_identical": row["agent1_greedy"] == base["agent1_greedy"],
            }
        write_json(Path(args.out), out)
    return out


if __name__ == "__main__":
    main()
