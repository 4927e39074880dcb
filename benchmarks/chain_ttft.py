"""``python -m benchmarks.chain_ttft``: TTFT and prefill tokens per agent on a 4-agent chain.

Every agent reads the same shared context (``--lengths`` tokens of real text)
behind its own system prompt. For each mode (one server each, started fresh)
the chain runs on held-out content; ``kvcmas`` first warms its pools on
``--warm`` other contents. TTFT is the time to the first streamed chunk of a
1-token generation; ``prefill_tokens`` is what the scheduler computed
(``prompt_tokens - cached_tokens``). Ratios are from one run on this machine.
"""

from __future__ import annotations

import argparse
import time

from tqdm import tqdm

from benchmarks.harness import RESULTS, machine, start_server, stream_generate, write_json
from benchmarks.texts import context_tokens
from sglang_kvshare.segments import build_request, private_part, shared_part

AGENTS = {
    "planner": "You are the planner. Break the task into steps.",
    "solver": "You are a careful solver. Work through the material and compute the result.",
    "critic": "You are a critic. Find mistakes in the reasoning about the material below and say how to fix them.",
    "judge": "You are the judge. Read everything and give the final answer in one line.",
}


def system(agent: str) -> str:
    return f"<|im_start|>system\n{AGENTS[agent]}<|im_end|>\n<|im_start|>user\nMaterial:\n"


SUFFIX = "\nWhat is the key point?<|im_end|>\n<|im_start|>assistant\n"


def run_chain(server, tok, ctx: list[int]) -> dict:
    rows = {}
    for agent in AGENTS:
        ids, cp = build_request(tok, agent, [private_part(system(agent)), shared_part(ctx, "context"),
                                             private_part(SUFFIX)])
        timed = stream_generate(server.url, ids, custom_params=cp, max_new_tokens=1)
        meta, rep = timed.meta, timed.report
        rows[agent] = {"ttft_s": timed.ttft, "prompt_tokens": meta["prompt_tokens"],
                       "prefill_tokens": meta["prompt_tokens"] - meta["cached_tokens"],
                       "tokens_aligned": rep.get("tokens_aligned", 0),
                       "tokens_corrected": rep.get("tokens_corrected", 0),
                       "shared_tokens_reused": rep.get("shared_tokens_reused", 0),
                       "fallbacks": rep.get("fallbacks", [])}
    return rows


def warm_agents(server, tok) -> None:
    for agent in AGENTS:
        ids, cp = build_request(tok, agent, [private_part(system(agent))])
        stream_generate(server.url, ids, custom_params=cp, max_new_tokens=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chain_ttft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--modes", nargs="+", default=["off", "fullshared", "kvcmas"])
    ap.add_argument("--warm", type=int, default=2, help="contents kvcmas learns from before the measured one")
    ap.add_argument("--tau", type=float, default=0.3)
    ap.add_argument("--out", default=str(RESULTS / "chain_ttft.json"))
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from sglang_kvshare.models import prepare

    model_path = str(prepare("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(model_path)
    results: dict = {"command": "python -m benchmarks.chain_ttft " + " ".join(argv or []), "machine": machine(),
                     "model": "SmolLM2-135M-Instruct", "agents": list(AGENTS), "tau": args.tau,
                     "ttft_definition": "time to the first streamed chunk of a 1-token greedy generation",
                     "modes": {}}
    bar = tqdm(total=len(args.modes) * len(args.lengths), desc="chain_ttft")
    for mode in args.modes:
        server = start_server(model_path, mode, kvshare_extra=["--kvshare-tau", str(args.tau),
                                                               "--kvshare-learn-async", "false"])
        try:
            warm_agents(server, tok)
            per_len = {}
            for length in args.lengths:
                if mode == "kvcmas":
                    for w in range(args.warm):
                        run_chain(server, tok, context_tokens(tok, length, seed=1000 + 10 * length + w))
                t0 = time.perf_counter()
                rows = run_chain(server, tok, context_tokens(tok, length, seed=length))
                shared_tokens = length * (len(AGENTS) - 1)
                reused = sum(r["shared_tokens_reused"] for r in list(rows.values())[1:])
                per_len[str(length)] = {
                    "ttft_s": {a: r["ttft_s"] for a, r in rows.items()},
                    "prefill_tokens": {a: r["prefill_tokens"] for a, r in rows.items()},
                    "reuse_ratio": reused / shared_tokens,
                    "fallbacks": {a: r["fallbacks"] for a, r in rows.items()},
                    "wall_s": time.perf_counter() - t0,
                }
                bar.update()
            results["modes"][mode] = per_len
        finally:
            server.stop()
    bar.close()
    if "off" in results["modes"]:
        for mode, per_len in results["modes"].items():
            for length, row in per_len.items():
                base = results["modes"]["off"][length]
                later = list(AGENTS)[1:]
                row["ttft_ratio_vs_off_agents_2_4"] = (
                    sum(base["ttft_s"][a] for a in later) / max(sum(row["ttft_s"][a] for a in later), 1e-9))
                row["prefill_tokens_saved_vs_off"] = (
                    sum(base["prefill_tokens"].values()) - sum(row["prefill_tokens"].values()))
    write_json(__import__("pathlib").Path(args.out), results)
    for mode, per_len in results["modes"].items():
        for length, row in per_len.items():
            ttft = " ".join(f"{a}={t:.2f}s" for a, t in row["ttft_s"].items())
            print(f"{mode:10s} L={length:5s} reuse={row['reuse_ratio']:.2f} prefill={sum(row['prefill_tokens'].values())}"
                  f" TTFT {ttft} x{row.get('ttft_ratio_vs_off_agents_2_4', float('nan')):.2f} vs off (agents 2-4)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
