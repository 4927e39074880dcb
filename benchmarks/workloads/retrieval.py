"""Multi-agent key/value retrieval: the workload where SmolLM2-135M is competent and scoring is exact.

Why: on GSM8K and HumanEval a 135M model is mostly wrong, and greedy text is a
cliff metric, so "agreement with off" mixes reuse error with near-ties. A
lookup of a code in a short document is something the model does (about two
in three lookups right, densely), scored by exact match of a 4-digit value.

One sample is a synthetic document of ``FACTS`` facts ("The code of Falcon is
4821."), seeded and deterministic, shared by every agent (slot ``doc``). Each
of the ``AGENTS`` agents has its own role (system prompt) and asks for a
different key of the document: one lookup per request. The first agent
prefills the document densely (the producer); the others (consumers) are
where reuse happens. The answer starts with "The code of <key> is" in the
prompt, so the model's first tokens are the value.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from benchmarks.workloads.roles import Role

FACTS = 12
KEYS = (
    "Falcon", "Otter", "Maple", "Cobalt", "Harbor", "Juniper", "Lantern", "Meadow", "Nimbus", "Orchid",
    "Pepper", "Quartz", "Raven", "Saffron", "Tundra", "Velvet", "Willow", "Zephyr", "Amber", "Birch",
    "Canyon", "Dune", "Ember", "Fjord", "Glacier", "Hazel", "Iris", "Jasper", "Kestrel", "Lotus",
)

ROLES = (
    Role("archivist", "The archivist",
         "You are an archivist. You read records carefully and report exactly what they say."),
    Role("clerk", "The clerk",
         "You are a clerk at a registry office. Answer questions about the registry in one short sentence."),
    Role("auditor", "The auditor",
         "You are an auditor. Check the ledger below and state the requested value precisely."),
    Role("operator", "The operator",
         "You are a radio operator. Look up the requested code in the list and read it back."),
)
AGENTS = len(ROLES)
# Keys of longer documents (past len(KEYS) facts): two words, so a 1K-token document still has distinct keys.
PAIRED_KEYS = tuple(f"{a} {b}" for a in KEYS for b in KEYS if a != b)


@dataclass(frozen=True)
class Lookup:
    key: str
    value: str


@dataclass(frozen=True)
class RetrievalSample:
    """One document and the lookup each agent does (``lookups[i]`` belongs to ``ROLES[i]``)."""

    id: str
    facts: tuple[Lookup, ...]
    lookups: tuple[Lookup, ...]

    @property
    def document(self) -> str:
        return "Records:\n" + "\n".join(f"The code of {f.key} is {f.value}." for f in self.facts)


def make_sample(index: int, seed: int = 0, facts: int = FACTS, agents: int = AGENTS) -> RetrievalSample:
    """Sample ``index`` of the seeded stream: ``facts`` distinct keys with distinct 4-digit codes.

    The agents ask for distinct keys drawn from the whole document (any
    position), so the lookups test the document's reused KV everywhere.
    """
    if not 1 <= agents <= min(facts, len(ROLES)):
        raise ValueError(f"agents must be in [1, {min(facts, len(ROLES))}], got {agents}")
    if facts > len(PAIRED_KEYS):
        raise ValueError(f"at most {len(PAIRED_KEYS)} facts (distinct keys), got {facts}")
    rng = random.Random(f"retrieval/{seed}/{index}" + (f"/{facts}" if facts > len(KEYS) else ""))
    keys = rng.sample(KEYS if facts <= len(KEYS) else PAIRED_KEYS, facts)
    values = rng.sample(range(1000, 10000), facts)
    table = tuple(Lookup(k, str(v)) for k, v in zip(keys, values))
    asked = tuple(table[i] for i in rng.sample(range(facts), agents))
    return RetrievalSample(id=f"retrieval/{seed}/{index}", facts=table, lookups=asked)


def load(limit: int, offset: int = 0, seed: int = 0, facts: int = FACTS) -> list[RetrievalSample]:
    """Samples ``offset .. offset + limit``; ``facts`` sets the document's length (about 10 tokens a fact)."""
    return [make_sample(i, seed, facts) for i in range(offset, offset + limit)]


def question(key: str) -> str:
    return f"\n\nQuestion: What is the code of {key}? Answer with the number only."


def answer_prefix(key: str) -> str:
    """What the assistant turn starts with (part of the prompt), so the value comes first."""
    return f"The code of {key} is"


_VALUE = re.compile(r"\d{3,}")


def extract_value(text: str) -> str:
    """The first run of 3+ digits in the answer; '' if none."""
    m = _VALUE.search(text.replace(",", ""))
    return m.group(0) if m else ""


def score(answer: str, lookup: Lookup) -> bool:
    return answer == lookup.value
