"""``python -m benchmarks.demo``: the main job in one command.

Starts a real SGLang server with kvshare on (the shipped SmolLM2-135M on this
machine's CPU unless ``--model-path`` says otherwise) and runs a 4-agent team
on GSM8K questions: a solver answers, an analyst, a programmer and a judge
each read the question (shared slot ``query``) and the previous agent's answer
(shared slot ``out:<agent>``) behind their own system prompts. It prints, per
request, what the server prefilled and what it reused (aligned or corrected)
with the TTFT, then totals, writes them as JSON (with ``benchmarks.harness.run_meta``;
``--out benchmarks/results/demo.json`` is the canonical results file), and stops the server.

It runs the best measured setting (docs/USAGE.md, "Which setting to run"):
``fullshared`` with 15 % of each reused segment recomputed inside the request's
one prefill forward (``--kvshare-recompute-ratio 0.15``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.harness import prefilled_tokens, run_meta, stream_generate, write_json
from devtools.data import gsm8k_path
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part
from devtools.server_process import ServerProcess

ROLES = {
    "solver": "You are a math solver. Solve the problem step by step.",
    "analyst": "You are a mathematical analyst. Check the previous answer against the problem.",
    "programmer": "You are a programming expert. Write one line of Python that computes the answer.",
    "judge": "You are the judge. State the final numeric answer.",
}


def load_questions(n: int) -> list[str]:
    """The first ``n`` GSM8K test questions (``data/gsm8k``; a missing file is an error)."""
    with open(gsm8k_path()) as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f)]


def agent_request(tok, agent: str, question: str, previous: tuple[str, list[int]] | None):
    parts = [private_part(f"<|im_start|>system\n{ROLES[agent]}<|im_end|>\n<|im_start|>user\nProblem: "),
             shared_part(question, "query")]
    if previous is not None:
        prev_agent, prev_ids = previous
        parts += [private_part(f"\nThe {prev_agent} said: "), shared_part(prev_ids, f"out:{prev_agent}")]
    parts.append(private_part("<|im_end|>\n<|im_start|>assistant\n"))
    return build_request(tok, agent, parts, output_slot=f"out:{agent}")


def totals(rows: list[dict], mode: str, recompute_ratio: float) -> dict:
    """The run's totals over its request rows: prompt, prefilled and reused tokens, the reuse ratio over the shared
    tokens, and the mean TTFT of agent 1 and of agents 2-4 (``position`` counts from 1 within a question)."""
    shared = sum(r["shared_tokens"] for r in rows)
    reused = sum(r["tokens_aligned"] + r["tokens_corrected"] for r in rows)
    later = [r["ttft_s"] for r in rows if r["position"] >= 2]
    first = [r["ttft_s"] for r in rows if r["position"] == 1]
    return {"mode": mode, "recompute_ratio": recompute_ratio, "requests": len(rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "prefill_tokens": sum(r["prefill_tokens"] for r in rows), "shared_tokens": shared,
            "reused_tokens": reused, "reuse_ratio": reused / shared if shared else 0.0,
            "ttft_s_mean_agent_1": statistics.fmean(first) if first else None,
            "ttft_s_mean_agents_2_4": statistics.fmean(later) if later else None,
            "note": "ttft_s: first streamed token; latency_s: the whole request (prefill + up to --max-new-tokens "
                    "decode) on this machine"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="local model folder (default: the shipped SmolLM2-135M)")
    parser.add_argument("--kvshare-mode", default="fullshared", choices=("off", "fullshared", "kvcmas"))
    parser.add_argument("--recompute-ratio", type=float, default=0.15,
                        help="share of each reused segment recomputed in the request's context")
    parser.add_argument("--tau", type=float, default=0.3, help="kvcmas's gate threshold")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default="demo_results.json", help="where to write the JSON")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    if args.model_path is None:
        from devtools.models import prepare

        args.model_path = str(prepare("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(args.model_path)
    rows = []
    print(f"starting a server with --kvshare-mode {args.kvshare_mode} ...", flush=True)
    kv_args = ["--kvshare-mode", args.kvshare_mode, "--kvshare-recompute-ratio", str(args.recompute_ratio),
               "--kvshare-tau", str(args.tau), "--kvshare-learn-async", "false"]
    with ServerProcess(model_path=args.model_path, kvshare_args=kv_args) as server:
        print(f"server up at {server.url}, radix cache backend: {server.server_info().get('radix_cache_backend')}")
        print(f"{'q':>2} {'agent':10s} {'prompt':>6} {'prefill':>7} {'aligned':>7} {'corrected':>9} {'recomputed':>10} "
              f"{'ttft s':>6} {'latency s':>9}  fallbacks")
        for qi, question in enumerate(load_questions(args.questions)):
            previous = None
            for position, agent in enumerate(ROLES, start=1):
                ids, cp = agent_request(tok, agent, question, previous)
                out = stream_generate(server.url, ids, custom_params=cp, max_new_tokens=args.max_new_tokens)
                rep = out.report
                row = {"question": qi, "agent": agent, "position": position, "prompt_tokens": out.meta["prompt_tokens"],
                       "prefill_tokens": prefilled_tokens(out.meta),
                       "tokens_aligned": rep.get("tokens_aligned", 0), "tokens_corrected": rep.get("tokens_corrected", 0),
                       "tokens_recomputed": rep.get("tokens_head_recomputed", 0),
                       "shared_tokens": rep.get("shared_tokens", 0), "ttft_s": round(out.ttft, 3),
                       "latency_s": round(out.e2e, 3),
                       "fallbacks": sorted({f["reason"] for f in rep.get("fallbacks", [])}),
                       "answer": tok.decode(out.output_ids)[:80]}
                rows.append(row)
                print(f"{qi:>2} {agent:10s} {row['prompt_tokens']:>6} {row['prefill_tokens']:>7} "
                      f"{row['tokens_aligned']:>7} {row['tokens_corrected']:>9} {row['tokens_recomputed']:>10} "
                      f"{out.ttft:>6.2f} {out.e2e:>9.2f}  {','.join(row['fallbacks'])}")
                previous = (agent, out.output_ids)
    total = totals(rows, args.kvshare_mode, args.recompute_ratio)
    print(json.dumps(total, indent=2))
    settings = {k: getattr(args, k) for k in ("kvshare_mode", "recompute_ratio", "tau", "questions", "max_new_tokens")}
    write_json(Path(args.out), {"meta": run_meta(), "settings": settings, "totals": total, "requests": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
