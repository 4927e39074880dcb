"""Placeholder nodes: what the cache knows about each shared slot, per namespace.

A **namespace** is what SGLang already uses to keep caches apart, the
request's ``extra_key`` (the LoRA id) and ``cache_salt`` (the tenant), plus
the reuse scope (the annotation's ``workflow``, with
``--kvshare-reuse-scope workflow``). Every record here lives inside one
namespace, so nothing computed for one tenant, adapter or workflow is ever
offered to another, and the slot and agent names of one are invisible to the
next.

Per shared slot (``query``, ``out:analyst`` ...) one ``PlaceholderNode`` keeps
the latest **materializations** of each content seen in that slot: the radix
node that ends the copy, its first position, which agent made it, and whether
it is exact (dense prefill on exact KV) or an estimate. Private segments get
the same bookkeeping per agent (alignment-only reuse).

::

    KVShareRadixCache
    ├── radix tree (SGLang's TreeNode; KV indices into the KV pool)
    │     root ─ [sys_A | query#1 ] ─ ...                 <- exact (agent A)
    │          └ [sys_B] ─ est:[query#1*] ─ ...           <- * assembled, in the estimate namespace
    └── PlaceholderRegistry
          └── namespaces[(extra_key, cache_salt)]: Namespace
                ├── slots["query"]: PlaceholderNode
                │     contents[h(query#1)] = [Materialization(A, exact), Materialization(B, estimate)]
                └── private[(id(B), h(glue))] = [Materialization(B, ...)]

A materialization names its KV by the tree node that ends it, not by pool
indices: the tree may split nodes (the node object keeps the tail, so the end
stays put) or evict them (``KVShareRadixCache`` marks evicted nodes dead).
Every table is bounded, sized to the KV pool (``RegistryLimits.for_pool``),
and evicts the least recently recorded entry, one whose copies are all gone
first.

Per shared slot the registry also knows its **readers** (the agents that
recorded a copy there) and, per content, its **holders** (the readers with a
copy): a content some reader does not hold yet is ``pending``, and the
retention policy keeps its latest copy (``cache/retention.py``).

No SGLang imports here.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator, Optional, Sequence

from sglang_kvshare.cache.outcome import SegmentOutcome

Namespace = tuple[Optional[str], Optional[str], Optional[str]]  # (extra_key, cache_salt, reuse scope)

_seq = itertools.count()
DEAD_ATTR = "kvshare_dead"  # set on a tree node SGLang evicted: copies ending there are gone
MAX_READERS = 64  # agents per slot told apart as readers (a bound against floods of agent names)


class ContentHasher:
    """Keyed digests of token ids: a per-process secret, so a digest shown by the admin API
    cannot be used to confirm a guessed prompt."""

    def __init__(self, secret: Optional[bytes] = None) -> None:
        self._secret = secret if secret is not None else os.urandom(16)

    @property
    def secret(self) -> bytes:
        """The key of every digest (saved with the anchor pools, whose slots and edges are digests)."""
        return self._secret

    def adopt(self, secret: bytes) -> None:
        """Digest with ``secret`` from now on: a server that loads saved pools takes their key, so the same agents
        and contents hash to the keys the pools hold. Only before the first request (earlier digests would
        no longer match)."""
        if len(secret) != 16:
            raise ValueError(f"a content hasher secret has 16 bytes, got {len(secret)}")
        self._secret = bytes(secret)

    def __call__(self, tokens: Sequence[int], *extra: Any) -> str:
        h = hashlib.blake2b(digest_size=16, key=self._secret)
        for part in extra:
            h.update(repr(part).encode())
            h.update(b"\x00")
        h.update(len(tokens).to_bytes(8, "little"))
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
        return h.hexdigest()


@dataclass(frozen=True, eq=False)
class Materialization:
    """One copy of a segment's KV inside the tree: rows ``[start, end)`` of the path to ``node``."""

    agent: str  # the agent's identity (hash of namespace, name and private prefix)
    agent_name: str  # what the client called it (shown in its own reports)
    node: Any  # the TreeNode whose path ends at ``end``
    start: int
    end: int
    exact: bool  # computed densely on exact KV (True) or an estimate / computed on top of one
    generation: int  # the cache generation (a reset invalidates every record)
    workflow: Optional[str] = None  # whose it is: a report names its agent only to the same workflow
    seq: int = field(default_factory=lambda: next(_seq))

    @property
    def length(self) -> int:
        return self.end - self.start

    def gone(self, generation: int) -> bool:
        """Its KV was evicted, or a reset made it a record of an older generation."""
        return self.generation != generation or getattr(self.node, DEAD_ATTR, False)


@dataclass
class SlotStats:
    """Counters of one slot (what /kvshare/stats reports)."""

    requests: int = 0
    shared_tokens_seen: int = 0
    resolved_hit: int = 0
    resolved_alignment: int = 0
    resolved_correction: int = 0
    prefilled_dense: int = 0
    head_recomputed: int = 0
    fallbacks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    gate_entropy_sum: float = 0.0
    gate_decisions: int = 0

    def add(self, o: SegmentOutcome, sign: int = 1) -> None:
        """Count one request's outcome of this slot (``sign=-1`` takes a counted outcome back)."""
        self.requests += sign
        self.shared_tokens_seen += sign * o.tokens
        if o.resolved_by in ("hit", "estimate_hit"):
            self.resolved_hit += sign * o.resolved_tokens
        elif o.resolved_by == "alignment":
            self.resolved_alignment += sign * o.resolved_tokens
        elif o.resolved_by == "correction":
            self.resolved_correction += sign * o.resolved_tokens
        self.prefilled_dense += sign * (o.tokens - o.resolved_tokens)
        self.head_recomputed += sign * (o.head_recomputed or 0)
        if o.reason is not None:
            self.fallbacks[o.reason] += sign
            if self.fallbacks[o.reason] <= 0:
                del self.fallbacks[o.reason]
        if o.entropy is not None:
            self.gate_entropy_sum += sign * o.entropy
            self.gate_decisions += sign

    def as_dict(self) -> dict:
        resolved = self.resolved_hit + self.resolved_alignment + self.resolved_correction
        seen = self.shared_tokens_seen
        return {
            "requests": self.requests,
            "shared_tokens_seen": seen,
            "resolved_hit": self.resolved_hit,
            "resolved_alignment": self.resolved_alignment,
            "resolved_correction": self.resolved_correction,
            "prefilled_dense": self.prefilled_dense,
            "head_recomputed": self.head_recomputed,
            "reuse_ratio": (self.resolved_alignment + self.resolved_correction) / seen if seen else 0.0,
            "resolved_ratio": resolved / seen if seen else 0.0,
            "fallbacks": dict(self.fallbacks),
            "mean_gate_entropy": self.gate_entropy_sum / self.gate_decisions if self.gate_decisions else None,
            "gate_decisions": self.gate_decisions,
        }


class Copies(list):
    """One key's materializations (latest last) and, for a shared content, ``holders``: the slot's readers
    that recorded a copy of it."""

    __slots__ = ("holders",)

    def __init__(self) -> None:
        super().__init__()
        self.holders: set[str] = set()

    def latest_node(self, generation: int) -> Optional[Any]:
        """The node of the latest copy still in the tree: the one reuse reads (``resolve.candidates``)."""
        for m in reversed(self):
            if not m.gone(generation):
                return m.node
        return None


# Entries looked at, oldest first, for one whose copies are all gone before a full table drops its oldest.
_DROP_WINDOW = 16


def _remember(table: "OrderedDict[Hashable, Copies]", key: Hashable, mat: Materialization,
              per_key: int, max_keys: int) -> Copies:
    """Append ``mat`` under ``key`` (latest last), dropping a record of the same node; returns the key's copies.

    A full table drops an entry whose copies are all gone (evicted, or of an older generation) if one of the
    oldest ``_DROP_WINDOW`` is, else its oldest: the limits are sized so that the records can describe the
    whole KV pool, so a full table mostly holds entries whose KV is gone.
    """
    mats = table.get(key)
    if mats is None:
        mats = table[key] = Copies()
    mats[:] = [m for m in mats if (m.node is not mat.node or m.end != mat.end) and not m.gone(mat.generation)]
    mats.append(mat)
    del mats[:-per_key]
    table.move_to_end(key)
    while len(table) > max_keys:
        gone = next((k for k, ms in itertools.islice(table.items(), _DROP_WINDOW)
                     if all(m.gone(mat.generation) for m in ms)), None)
        if gone is None:
            table.popitem(last=False)
        else:
            del table[gone]
    return mats


# Fixed floors (what a small pool gets) and hard caps (what any pool gets at most: memory, hostile floods).
_FLOORS = {"max_namespaces": 64, "max_contents": 256, "max_private": 4096}
_CAPS = {"max_namespaces": 4096, "max_contents": 16384, "max_private": 16384}
SHORTEST_RECORD = 32  # tokens: the shortest segment the pool-sized limits count on when every length is reused


@dataclass(frozen=True)
class RegistryLimits:
    """Bounds of the registry; each table evicts its least recently recorded entry when full."""

    max_namespaces: int = 64
    max_slots: int = 256  # per namespace
    max_contents: int = 256  # per slot
    max_copies: int = 16  # materializations kept per content: one per agent of a 16-agent team
    max_private: int = 4096  # (agent, content) entries per namespace

    @classmethod
    def for_pool(cls, pool_tokens: int, shortest: int, *, max_namespaces: Optional[int] = None,
                 max_slots: int = 256) -> "RegistryLimits":
        """Limits under which the records of one slot (and the private copies, and the namespaces) can
        describe a whole KV pool of ``pool_tokens`` cut into segments of ``shortest`` tokens (the shortest
        reusable one; at least ``SHORTEST_RECORD``), between the fixed floors and hard caps.

        Why: a record dropped while its KV is still in the pool is reuse lost (``no_source``) although the
        pool kept the KV; auto mode puts every message of a workflow in one slot. ``max_namespaces``: the
        operator's bound (None: sized like the others).
        """
        describe = -(-max(int(pool_tokens), 1) // max(int(shortest), SHORTEST_RECORD))
        sized = {k: min(max(describe, _FLOORS[k]), _CAPS[k]) for k in _FLOORS}
        if max_namespaces is not None:
            sized["max_namespaces"] = max_namespaces
        return cls(max_slots=max_slots, **sized)


class PlaceholderNode:
    """One shared slot of one namespace: its contents' materializations, its readers and its counters."""

    def __init__(self, slot: str, limits: RegistryLimits) -> None:
        self.slot = slot
        self.limits = limits
        self.contents: OrderedDict[str, Copies] = OrderedDict()
        self.readers: set[str] = set()  # agents that recorded a copy here (at most MAX_READERS)
        self.stats = SlotStats()

    def copies(self, content: str) -> list[Materialization]:
        """Materializations of ``content``, latest first."""
        return list(reversed(self.contents.get(content, ())))

    def record(self, content: str, mat: Materialization) -> Copies:
        """Remember ``mat`` as a copy of ``content``; its agent becomes a reader of the slot and a holder of
        the content. Returns the content's copies (``pending`` reads them)."""
        if len(self.readers) < MAX_READERS:
            self.readers.add(mat.agent)
        copies = _remember(self.contents, content, mat, self.limits.max_copies, self.limits.max_contents)
        if mat.agent in self.readers:
            copies.holders.add(mat.agent)
        return copies

    def pending(self, copies: Copies) -> bool:
        """Whether a reader of this slot has not read the content yet: fewer holders than readers (holders
        are readers), or one holder only (a shared content is there to be read by another agent)."""
        return len(copies.holders) < max(2, len(self.readers))


class NamespaceRecords:
    """Slots and private copies of one (extra_key, cache_salt) namespace."""

    def __init__(self, limits: RegistryLimits) -> None:
        self.limits = limits
        self.slots: OrderedDict[str, PlaceholderNode] = OrderedDict()
        self.private: OrderedDict[tuple[str, str], Copies] = OrderedDict()

    def slot(self, name: str) -> PlaceholderNode:
        node = self.slots.get(name)
        if node is None:
            node = self.slots[name] = PlaceholderNode(name, self.limits)
            while len(self.slots) > self.limits.max_slots:
                self.slots.popitem(last=False)
        self.slots.move_to_end(name)
        return node

    def private_copies(self, agent: str, content: str) -> list[Materialization]:
        return list(reversed(self.private.get((agent, content), ())))

    def record_private(self, agent: str, content: str, mat: Materialization) -> None:
        _remember(self.private, (agent, content), mat, self.limits.max_copies, self.limits.max_private)


class PlaceholderRegistry:
    """Every namespace's records, bounded (``RegistryLimits``)."""

    def __init__(self, limits: Optional[RegistryLimits] = None) -> None:
        self.limits = limits or RegistryLimits()
        self.namespaces: OrderedDict[Namespace, NamespaceRecords] = OrderedDict()
        # NOTE: a record made before a reset by a request still in flight carries an older
        # generation; only copies of the current one are offered as sources.
        self.generation = 0

    def namespace(self, ns: Namespace) -> NamespaceRecords:
        rec = self.namespaces.get(ns)
        if rec is None:
            rec = self.namespaces[ns] = NamespaceRecords(self.limits)
            while len(self.namespaces) > self.limits.max_namespaces:
                self.namespaces.popitem(last=False)
        self.namespaces.move_to_end(ns)
        return rec

    def all_slots(self) -> Iterator[tuple[Namespace, PlaceholderNode]]:
        for ns, rec in self.namespaces.items():
            for node in rec.slots.values():
                yield ns, node

    def usage(self) -> dict[str, int]:
        """Current sizes, keyed like ``RegistryLimits`` (the soak harness checks usage <= limit)."""
        recs = list(self.namespaces.values())
        return {
            "max_namespaces": len(recs),
            "max_slots": max((len(r.slots) for r in recs), default=0),
            "max_contents": max((len(s.contents) for r in recs for s in r.slots.values()), default=0),
            "max_private": max((len(r.private) for r in recs), default=0),
        }

    def reset(self) -> None:
        """Forget every record and start a new generation."""
        self.namespaces.clear()
        self.generation += 1
