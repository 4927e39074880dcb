"""A set of 24 agent roles of varied wording and length, split into development and held-out halves.

Why: a setting chosen on the roles a benchmark was tuned with may only fit
those roles. The defaults (the recompute share, the minimum reusable segment
length) are chosen on ``DEV`` roles; ``HELDOUT`` roles are used once, to check
the chosen defaults, and never to choose anything. The two halves mix the same
kinds of prompt (one line, a paragraph, a numbered list, a persona, terse
orders), so neither half is easier by form.

A sample draws its agents from one half, seeded by the sample's id
(``draw``), so every run of the same samples meets the same roles, and the
roles of a half rotate over the samples.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

from benchmarks.workloads.roles import Role

Split = Literal["dev", "heldout"]

_FILE = Path(__file__).with_name("role_set.json")  # the prompts as data: {"dev": [...], "heldout": [...]}
SPLITS: dict[str, tuple[Role, ...]] = {split: tuple(Role(**r) for r in roles)
                                       for split, roles in json.loads(_FILE.read_text()).items()}
DEV, HELDOUT = SPLITS["dev"], SPLITS["heldout"]



def draw(split: Split, sample_id: str, n: int) -> tuple[Role, ...]:
    """``n`` distinct roles of ``split`` for the sample ``sample_id`` (seeded by the id)."""
    roles = SPLITS[split]
    if not 1 <= n <= len(roles):
        raise ValueError(f"{n} roles asked of a split of {len(roles)}")
    return tuple(random.Random(f"roles/{split}/{sample_id}").sample(roles, n))
