"""``python -m benchmarks.demo``: the main job in one command.

Starts a real SGLang server (the shipped SmolLM2-135M on this machine's CPU
unless ``--model-path`` says otherwise) and runs a 4-agent team on GSM8K
questions: a solver, an analyst, a programmer and a judge each read the
reference sheet retrieved for the question (about ``--sheet-tokens`` tokens of
worked problems and notes, one per question, the same for the whole team:
shared slot ``sheet``), the question
(slot ``query``) and the previous agent's answer (slot ``out:<agent>``),
behind their own system prompts. It runs the team twice, each time on a fresh
server with the same flags: ``off`` (stock SGLang's radix cache) and the
kvshare defaults (a plain launch: no kvshare option). It prints, per request,
what the server prefilled and what it reused, with the TTFT; then per arm the
totals, the speedup of agents 2-4's TTFT against ``off``, and how often the
judge's final number equals ``off``'s. It writes them as JSON (with
``benchmarks.harness.run_meta``; ``--out benchmarks/results/demo.json`` is the
canonical results file).

Under the defaults the sheet is reused; the question and the answers, shorter
than the minimum reusable segment, are prefilled (``short_segment``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import requests

from benchmarks.harness import prefilled_tokens, run_meta, stream_generate, write_json
from benchmarks.texts import context_tokens
from devtools.data import gsm8k_path
from devtools.server_process import ServerProcess
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part

ROLES = {
    "solver": "You are a math solver. Solve the problem step by step.",
    "analyst": "You are a mathematical analyst. Check the previous answer against the problem.",
    "programmer": "You are a programming expert. Write one line of Python that computes the answer.",
    "judge": "You are the judge. State the final numeric answer.",
}
ARMS = {"off": ["--kvshare-mode", "off"], "kvshare": []}  # kvshare: the defaults of a plain launch
SHEET_SEED = 7  # question i's reference sheet is text SHEET_SEED + i (benchmarks.texts), the same in both arms


def load_questions(n: int) -> list[str]:
    """The first ``n`` GSM8K test questions (``data/gsm8k``; a missing file is an error)."""
    with open(gsm8k_path()) as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f)]


def agent_request(tok, agent: str, sheet: list[int], question: str, previous: tuple[str, list[int]] | None):
    parts = [private_part(f"<|im_start|>system\n{ROLES[agent]}<|im_end|>\n<|im_start|>user\nReference sheet:\n"),
             shared_part(sheet, "sheet"), private_part("\n\nProblem: "), shared_part(question, "query")]
    if previous is not None:
        prev_agent, prev_ids = previous
        parts += [private_part(f"\nThe {prev_agent} said: "), shared_part(prev_ids, f"out:{prev_agent}")]
    parts.append(private_part("<|im_end|>\n<|im_start|>assistant\n"))
    return build_request(tok, agent, parts, output_slot=f"out:{agent}")


def last_number(text: str) -> str:
    nums = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return nums[-1] if nums else ""


def totals(rows: list[dict]) -> dict:
    """One arm's totals over its request rows: prompt, prefilled and reused tokens, the reuse ratio over the shared
    tokens, and the mean TTFT of agent 1 and of agents 2-4 (``position`` counts from 1 within a question)."""
    shared = sum(r["shared_tokens"] for r in rows)
    reused = sum(r["tokens_aligned"] + r["tokens_corrected"] for r in rows)
    later = [r["ttft_s"] for r in rows if r["position"] >= 2]
    first = [r["ttft_s"] for r in rows if r["position"] == 1]
    reasons: dict[str, int] = {}
    for r in rows:
        for reason in r["fallbacks"]:
            reasons[reason] = reasons.get(reason, 0) + 1
    return {"requests": len(rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "prefill_tokens": sum(r["prefill_tokens"] for r in rows), "shared_tokens": shared,
            "reused_tokens": reused, "reuse_ratio": reused / shared if shared else 0.0,
            "fallback_requests_by_reason": reasons,
            "ttft_s_mean_agent_1": statistics.fmean(first) if first else None,
            "ttft_s_mean_agents_2_4": statistics.fmean(later) if later else None}


def run_team(server: ServerProcess, tok, sheets: list[list[int]], questions: list[str], max_new_tokens: int) -> list[dict]:
    rows = []
    print(f"{'q':>2} {'agent':10s} {'prompt':>6} {'prefill':>7} {'reused':>6} {'recomputed':>10} {'ttft s':>6}  fallbacks")
    for qi, (question, sheet) in enumerate(zip(questions, sheets)):
        previous = None
        for position, agent in enumerate(ROLES, start=1):
            ids, cp = agent_request(tok, agent, sheet, question, previous)
            out = stream_generate(server.url, ids, custom_params=cp, max_new_tokens=max_new_tokens)
            rep = out.report
            row = {"question": qi, "agent": agent, "position": position, "prompt_tokens": out.meta["prompt_tokens"],
                   "prefill_tokens": prefilled_tokens(out.meta),
                   "tokens_aligned": rep.get("tokens_aligned", 0), "tokens_corrected": rep.get("tokens_corrected", 0),
                   "tokens_recomputed": rep.get("tokens_head_recomputed", 0),
                   "shared_tokens": rep.get("shared_tokens", 0), "ttft_s": round(out.ttft, 3),
                   "latency_s": round(out.e2e, 3), "fallbacks": sorted({f["reason"] for f in rep.get("fallbacks", [])}),
                   "answer": tok.decode(out.output_ids)}
            rows.append(row)
            print(f"{qi:>2} {agent:10s} {row['prompt_tokens']:>6} {row['prefill_tokens']:>7} "
                  f"{row['tokens_aligned'] + row['tokens_corrected']:>6} {row['tokens_recomputed']:>10} "
                  f"{out.ttft:>6.2f}  {','.join(row['fallbacks'])}")
            previous = (agent, out.output_ids)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="local model folder (default: the shipped SmolLM2-135M)")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--sheet-tokens", type=int, default=1024, help="length of the shared reference sheet")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default="demo_results.json", help="where to write the JSON")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    if args.model_path is None:
        from devtools.models import prepare

        args.model_path = str(prepare("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(args.model_path)
    questions = load_questions(args.questions)
    sheets = [context_tokens(tok, args.sheet_tokens, seed=SHEET_SEED + i) for i in range(len(questions))]
    arms: dict[str, dict] = {}
    for arm, kv_args in ARMS.items():
        print(f"\n== {arm}: starting a server ({' '.join(kv_args) or 'no kvshare option: the defaults'}) ...",
              flush=True)
        with ServerProcess(model_path=args.model_path, kvshare_args=kv_args) as server:
            config = requests.get(server.url + "/kvshare/stats", timeout=30).json().get("config", {})
            rows = run_team(server, tok, sheets, questions, args.max_new_tokens)
        arms[arm] = {"config": {k: config.get(k) for k in ("mode", "recompute_ratio", "min_reuse_tokens")},
                     "totals": totals(rows), "requests": rows}
    off, kv = arms["off"], arms["kvshare"]
    judged = [(a["answer"], b["answer"]) for a, b in zip(off["requests"], kv["requests"]) if a["agent"] == "judge"]
    summary = {"ttft_speedup_agents_2_4": off["totals"]["ttft_s_mean_agents_2_4"] / kv["totals"]["ttft_s_mean_agents_2_4"],
               "judge_final_number_equal_to_off": sum(last_number(a) == last_number(b) for a, b in judged),
               "judged_questions": len(judged)}
    print(json.dumps({arm: a["totals"] for arm, a in arms.items()} | summary, indent=2))
    settings = {k: getattr(args, k) for k in ("questions", "sheet_tokens", "max_new_tokens")}
    write_json(Path(args.out), {"meta": run_meta(), "settings": settings, "arms": arms, "summary": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
