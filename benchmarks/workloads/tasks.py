"""Evaluation task: GSM8K (exact-match numeric answer).

A ``Task`` knows its samples, its roles, the instructions an agent gets after
the shared query, how to pull the final answer out of the final agent's text
(``extract``) and how to score it (``score``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.workloads.roles import GSM8K_FINAL, GSM8K_ROLES, Role
from devtools.data import gsm8k_path


@dataclass(frozen=True)
class Sample:
    id: str
    query: str  # the shared text every agent sees (slot "query")
    reference: Any  # the gold answer


@dataclass(frozen=True)
class Task:
    name: str
    roles: tuple[Role, ...]
    final: Role
    instruction: str  # what a role agent is asked after the query
    final_instruction: str
    load: Callable[[int, int], list[Sample]]  # (limit, offset) -> samples
    extract: Callable[[str, Sample], str]  # final text -> answer (what agreement compares)
    score: Callable[[str, Sample], bool]  # answer -> correct?


# ------------------------------------------------------------------ GSM8K
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> Optional[str]:
    """``"1,234.50"`` -> ``"1234.5"``; None when ``text`` is not a number."""
    t = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(t)
    except ValueError:
        return None
    return str(int(value)) if value == int(value) else repr(value)


def extract_gsm8k_answer(text: str) -> str:
    """The number after the last 'answer is', else the last number in the text; '' if none."""
    tail = text
    m = list(re.finditer(r"answer is", text, flags=re.IGNORECASE))
    if m:
        tail = text[m[-1].end():]
        nums = _NUMBER.findall(tail)
        if nums:
            return normalize_number(nums[0]) or ""
    nums = _NUMBER.findall(text)
    return (normalize_number(nums[-1]) or "") if nums else ""


def load_gsm8k(limit: int, offset: int = 0, path: Optional[str] = None) -> list[Sample]:
    """``limit`` GSM8K test samples from ``offset``; ``path`` defaults to the repository's ``data/gsm8k``."""
    path = Path(path) if path is not None else gsm8k_path()
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K test set not found at {path}: pass the path of a GSM8K test.jsonl")
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            if len(out) >= limit:
                break
            row = json.loads(line)
            gold = normalize_number(row["answer"].split("####")[-1]) or row["answer"].split("####")[-1].strip()
            out.append(Sample(id=f"gsm8k/{i}", query=row["question"].strip(), reference=gold))
    return out


GSM8K = Task(
    name="gsm8k", roles=GSM8K_ROLES, final=GSM8K_FINAL,
    instruction="Solve the problem.",
    final_instruction="Give the final answer to the question.",
    load=lambda limit, offset=0: load_gsm8k(limit, offset),
    extract=lambda text, sample: extract_gsm8k_answer(text),
    score=lambda answer, sample: answer != "" and answer == sample.reference,
)

TASKS = {"gsm8k": GSM8K}
