"""Real text for benchmark contexts: GSM8K problems (data/gsm8k, MIT) and
Python standard-library docstrings, cut to a token budget. Seeded, so every
mode sees the same contents."""

from __future__ import annotations

import inspect
import json
import random
from functools import lru_cache

from devtools.data import gsm8k_path

STDLIB_MODULES = ("json", "collections", "itertools", "functools", "pathlib", "argparse", "re", "heapq",
                  "bisect", "textwrap", "string", "statistics", "fractions", "decimal", "csv", "shutil")


@lru_cache(maxsize=1)
def gsm8k_questions() -> list[str]:
    with open(gsm8k_path()) as f:
        return [json.loads(line)["question"] for line in f]


@lru_cache(maxsize=1)
def stdlib_paragraphs() -> list[str]:
    import importlib

    paras = []
    for name in STDLIB_MODULES:
        mod = importlib.import_module(name)
        for _, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200 and getattr(obj, "__module__", name) == name:
                paras.append(doc)
    return paras


def context_tokens(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """About ``n_tokens`` token ids of real text (GSM8K problems, then docs), seed-chosen."""
    rng = random.Random(seed)
    pool = gsm8k_questions() if seed % 2 == 0 else stdlib_paragraphs()
    ids: list[int] = []
    while len(ids) < n_tokens:
        text = pool[rng.randrange(len(pool))]
        ids.extend(tokenizer("\n" + text, add_special_tokens=False).input_ids)
    return ids[:n_tokens]
