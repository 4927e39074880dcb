"""Helpers for the placeholder-cache tests: a 4-agent chain over real GSM8K text."""

from __future__ import annotations

import json
from functools import lru_cache

from devtools.data import gsm8k_path
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part

AGENTS = {
    "solver": "You are a math solver. Solve the problem step by step and give the final number.",
    "analyst": "You are a mathematical analyst. Check each quantity in the problem and point out what matters.",
    "coder": "You are a programming expert. Describe a short Python program that computes the answer.",
    "judge": "You are the final judge. Read the problem carefully and state the answer in one line.",
}


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


def agent_request(tokenizer, agent: str, shared_text: str, slot: str = "query", head: int = 0):
    """The agent's request reading ``shared_text``; ``head``: the annotation asks for at least that many first rows
    of each reused segment recomputed (what the guard writes into a tightened scope's requests)."""
    ids, cp = build_request(tokenizer, agent, [private_part(system_part(agent)), shared_part(shared_text, slot),
                                               private_part(SUFFIX)])
    if head:
        key, = cp
        cp = {key: json.dumps({**json.loads(cp[key]), "recompute_head": head})}
    return ids, cp


def warm_request(tokenizer, agent: str):
    """The agent's private prefix alone, so later requests find it in the tree."""
    return build_request(tokenizer, agent, [private_part(system_part(agent))])


def report(out: dict) -> dict:
    return out["meta_info"]["kvshare"][0]
