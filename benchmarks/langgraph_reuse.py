"""``python -m benchmarks.langgraph_reuse``: the LangGraph example against ``off`` and ``--kvshare-auto``.

The question: pointed at a kvshare server with ``--kvshare-auto``, how much of
the text that the unchanged LangGraph team (``examples/langgraph_team.py``,
four agents) sends more than once does the server reuse, and do the answers
stay those of a stock server? It starts one server per mode, one at a time
(``off`` first: stock SGLang behaviour), runs the team on the example's
questions with greedy decoding, and writes per mode the answers, the server's
``/kvshare/stats`` and ``/kvshare/chat`` counters, and:

* ``reuse_ratio_repeated``: message tokens reused by alignment or correction
  (slot ``auto:message``) over the message tokens that were not new to the
  server (every message token in the prompts except the first copy of each
  task; answers count as known, their KV was computed while generating them);
* ``agreement``: per agent, the fraction of questions whose answer equals
  the ``off`` answer exactly, and the same for the last number of the
  reviser's answer (the team's result).

    python -m benchmarks.langgraph_reuse          # writes benchmarks/results/langgraph_reuse.json
"""

from __future__ import annotations

import argparse
import sys
import importlib.util
import json
import re
import time
from pathlib import Path
from typing import Optional

import requests

from benchmarks.harness import RESULTS, run_meta
from devtools.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "off": ("--kvshare-mode", "off"),
    "fullshared_auto": ("--kvshare-mode", "fullshared", "--kvshare-auto", "true"),
    "kvcmas_auto": ("--kvshare-mode", "kvcmas", "--kvshare-auto", "true"),
}


def load_example():
    spec = importlib.util.spec_from_file_location("langgraph_team", ROOT / "examples" / "langgraph_team.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def final_number(text: str) -> Optional[str]:
    """The last number in an answer (the small model rarely keeps to an 'Answer: N' format)."""
    found = re.findall(r"-?[0-9][0-9,]*(?:\.[0-9]+)?", text or "")
    return found[-1].replace(",", "") if found else None


def run_mode(model_path: str, args: tuple[str, ...], team, questions: list[str], max_tokens: int) -> dict:
    with ServerProcess(model_path=model_path, kvshare_args=args) as server:
        t0 = time.perf_counter()
        answers = [team.run_team(q, server.url + "/v1", max_tokens=max_tokens) for q in questions]
        seconds = time.perf_counter() - t0
        stats = requests.get(server.url + "/kvshare/stats", timeout=30).json()
        chat = requests.get(server.url + "/kvshare/chat", timeout=30).json()
    return {"args": list(args), "answers": answers, "seconds": round(seconds, 1), "stats": stats, "chat": chat}


def summarize(results: dict, tokenizer, questions: list[str]) -> dict:
    summary = {}
    first_task_tokens = sum(len(tokenizer(f"Task: {q}", add_special_tokens=False).input_ids) for q in questions)
    base = results["off"]["answers"]
    for mode, res in results.items():
        slot = res["stats"].get("slots", {}).get("auto:message", {})
        seen = slot.get("shared_tokens_seen", 0)
        reused = slot.get("resolved_alignment", 0) + slot.get("resolved_correction", 0)
        agents = list(base[0])
        summary[mode] = {
            "seconds": res["seconds"],
            "message_tokens": seen,
            "message_tokens_reused": reused,
            "reuse_ratio_all": round(reused / seen, 3) if seen else None,
            "reuse_ratio_repeated": round(reused / (seen - first_task_tokens), 3) if seen > first_task_tokens else None,
            "glue": res["stats"].get("slots", {}).get("chat:glue"),
            "answers_retokenized_equal": res["chat"]["outputs"],
            "agreement_text": {a: sum(r[a] == b[a] for r, b in zip(res["answers"], base)) / len(base) for a in agents},
            "agreement_final_number": sum(final_number(r["reviser"]) == final_number(b["reviser"])
                                          for r, b in zip(res["answers"], base)) / len(base),
            "final_numbers": [final_number(r["reviser"]) for r in res["answers"]],
        }
    return summary


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", default=str(RESULTS / "langgraph_reuse.json"))
    parser.add_argument("--modes", default="off,fullshared_auto",
                        help=f"comma-separated, 'off' first; known: {','.join(MODES)}")
    parser.add_argument("--resummarize", action="store_true", help="recompute the summary of --out's runs; no servers")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from devtools.models import prepare

    model_path = str(prepare("smollm2-135m"))
    team = load_example()
    if args.resummarize:
        out = json.loads(Path(args.out).read_text())
        questions, results = out["questions"], out["runs"]
    else:
        questions = team.QUESTIONS[: args.questions]
        results = {}
        for mode in args.modes.split(","):
            mode_args = MODES[mode]
            print(f"[langgraph_reuse] {mode}: {len(questions)} questions x {len(team.AGENTS)} agents", flush=True)
            results[mode] = run_mode(model_path, mode_args, team, questions, args.max_tokens)
        command = "python -m benchmarks.langgraph_reuse " + " ".join(argv if argv is not None else sys.argv[1:])
        out = {"meta": run_meta(command.strip()), "command": command,
               "questions": questions, "max_tokens": args.max_tokens, "runs": results}
    summary = summarize(results, AutoTokenizer.from_pretrained(model_path), questions)
    out["summary"] = summary
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
