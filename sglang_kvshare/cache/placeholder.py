"""Placeholder nodes: what the cache knows about each shared slot.

Per shared slot (``query``, ``out:analyst`` ...) one ``PlaceholderNode`` keeps
the latest **materializations** of each content seen in that slot: where in
the radix tree its KV lives (the token path that leads to it), at which
positions, for which agent, and whether it is exact (dense prefill) or an
estimate. The slot's anchor pool lives in the estimator
(``estimator.pool(slot)``); the node names it and keeps the slot's counters.
Private segments get the same bookkeeping per agent (alignment-only reuse).

::

    KVShareRadixCache
    ├── radix tree (SGLang's TreeNode; KV indices into the KV pool)
    │     root ─ [sys_A | query#1 ] ─ ...          <- exact, dense (agent A)
    │          └ [sys_B | query#1*] ─ ...          <- * assembled: aligned+corrected
    └── PlaceholderRegistry
          ├── slots["query"]: PlaceholderNode
          │     contents[h(query#1)] = [Materialization(agent=A, exact),
          │                             Materialization(agent=B, estimate)]  (latest last)
          │     pool -> estimator.pool("query")   (anchors: base + deltas per edge)
          └── private[(B, h(glue))] = Materialization(agent=B, ...)

A materialization names its KV by the token path from the root, not by pool
indices: the tree may split or evict nodes at any time, and looking the path
up again (``KVShareRadixCache._locate``) either finds the current indices or
proves the copy is gone. The chained source for agent ``j`` on a slot is the
latest materialization of that content (the previous agent's); a dense
fallback appends an exact one, which resets the chain.

No SGLang imports here.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

MAX_CONTENTS_PER_SLOT = 256
MAX_MATERIALIZATIONS_PER_CONTENT = 8
MAX_PRIVATE_ENTRIES = 4096

_seq = itertools.count()


def content_hash(tokens: Sequence[int]) -> str:
    """Stable digest of a segment's token ids (the content's identity)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.hexdigest()


@dataclass(frozen=True)
class Materialization:
    """One copy of a segment's KV inside the tree."""

    agent: str
    path_tokens: tuple[int, ...]  # token ids from the root to the segment's end
    extra_key: Optional[str]
    cache_salt: Optional[str]
    start: int  # the segment's first position in that context
    exact: bool  # dense prefill (True) or aligned/corrected estimate (False)
    seq: int = field(default_factory=lambda: next(_seq))

    @property
    def end(self) -> int:
        return len(self.path_tokens)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class SlotStats:
    """Counters of one slot (what /kvshare/stats reports)."""

    requests: int = 0
    shared_tokens_seen: int = 0
    resolved_hit: int = 0
    resolved_alignment: int = 0
    resolved_correction: int = 0
    prefilled_dense: int = 0
    fallbacks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    gate_entropy_sum: float = 0.0
    gate_decisions: int = 0

    def as_dict(self) -> dict:
        resolved = self.resolved_hit + self.resolved_alignment + self.resolved_correction
        return {
            "requests": self.requests,
            "shared_tokens_seen": self.shared_tokens_seen,
            "resolved_hit": self.resolved_hit,
            "resolved_alignment": self.resolved_alignment,
            "resolved_correction": self.resolved_correction,
            "prefilled_dense": self.prefilled_dense,
            "reuse_ratio": (self.resolved_alignment + self.resolved_correction) / self.shared_tokens_seen
            if self.shared_tokens_seen else 0.0,
            "resolved_ratio": resolved / self.shared_tokens_seen if self.shared_tokens_seen else 0.0,
            "fallbacks": dict(self.fallbacks),
            "mean_gate_entropy": self.gate_entropy_sum / self.gate_decisions if self.gate_decisions else None,
        }


class PlaceholderNode:
    """One shared slot: its contents' materializations and its counters."""

    def __init__(self, slot: str) -> None:
        self.slot = slot
        self.contents: OrderedDict[str, list[Materialization]] = OrderedDict()
        self.stats = SlotStats()

    def latest(self, content: str) -> Optional[Materialization]:
        mats = self.contents.get(content)
        return mats[-1] if mats else None

    def all_for(self, content: str) -> list[Materialization]:
        return list(reversed(self.contents.get(content, [])))

    def record(self, content: str, mat: Materialization) -> None:
        mats = self.contents.setdefault(content, [])
        # The same copy seen again (an exact radix hit) moves to the end.
        mats[:] = [m for m in mats if not (m.path_tokens == mat.path_tokens and m.extra_key == mat.extra_key)]
        mats.append(mat)
        del mats[:-MAX_MATERIALIZATIONS_PER_CONTENT]
        self.contents.move_to_end(content)
        while len(self.contents) > MAX_CONTENTS_PER_SLOT:
            self.contents.popitem(last=False)

    def reset(self) -> None:
        self.contents.clear()
        self.stats = SlotStats()


class PlaceholderRegistry:
    """All slots plus the per-agent private materializations."""

    def __init__(self) -> None:
        self.slots: dict[str, PlaceholderNode] = {}
        self.private: OrderedDict[tuple[str, str], list[Materialization]] = OrderedDict()

    def slot(self, name: str) -> PlaceholderNode:
        node = self.slots.get(name)
        if node is None:
            node = self.slots[name] = PlaceholderNode(name)
        return node

    def private_sources(self, agent: str, content: str) -> list[Materialization]:
        return list(reversed(self.private.get((agent, content), [])))

    def record_private(self, agent: str, content: str, mat: Materialization) -> None:
        mats = self.private.setdefault((agent, content), [])
        mats[:] = [m for m in mats if m.path_tokens != mat.path_tokens]
        mats.append(mat)
        del mats[:-MAX_MATERIALIZATIONS_PER_CONTENT]
        self.private.move_to_end((agent, content))
        while len(self.private) > MAX_PRIVATE_ENTRIES:
            self.private.popitem(last=False)

    def reset(self, slot: Optional[str] = None) -> None:
        if slot is None:
            self.slots.clear()
            self.private.clear()
        elif slot in self.slots:
            self.slots[slot].reset()
