"""Helpers for the placeholder-cache tests: a 4-agent chain over real GSM8K text."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from sglang_kvshare.segments import build_request, private, shared

GSM8K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k" / "test.jsonl"

AGENTS = {
    "solver": "You are a math solver. Solve the problem step by step and give the final number.",
    "analyst": "You are a mathematical analyst. Check each quantity in the problem and point out what matters.",
    "coder": "You are a programming expert. Describe a short Python program that computes the answer.",
    "judge": "You are the final judge. Read the problem carefully and state the answer in one line.",
}


def gsm8k_path() -> Path:
    for candidate in (GSM8K, Path("/work/shared/data/gsm8k/test.jsonl")):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("GSM8K test set not found next to the repository (../shared/data/gsm8k)")


@lru_cache(maxsize=1)
def questions() -> list[str]:
    with open(gsm8k_path()) as f:
        return [json.loads(line)["question"] for line in f]


def context(start: int, n: int) -> str:
    """``n`` consecutive GSM8K questions as one shared document (real text)."""
    qs = questions()[start:start + n]
    return "\n".join(f"Problem {i + 1}: {q}" for i, q in enumerate(qs))


def system_part(agent: str) -> str:
    return f"<|im_start|>system\n{AGENTS[agent]}<|im_end|>\n<|im_start|>user\nContext:\n"


SUFFIX = "\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n"


def agent_request(tokenizer, agent: str, shared_text: str, slot: str = "query"):
    return build_request(tokenizer, agent, [private(system_part(agent)), shared(shared_text, slot),
                                            private(SUFFIX)])


def warm_request(tokenizer, agent: str):
    """The agent's private prefix alone, so later requests find it in the tree."""
    return build_request(tokenizer, agent, [private(system_part(agent))])


def report(out: dict) -> dict:
    return out["meta_info"]["kvshare"][0]
