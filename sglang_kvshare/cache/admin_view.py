"""What the admin API sees of the cache: stats, pools, configure, reset.

An object the cache owns (``KVShareRadixCache.kvshare_admin``), given what it
reads (``CacheParts``): the tree's pool sizes, the config and estimator in
force, the copy registry, the learner and the counters. Every method runs on the scheduler
thread between batches (the admin channel calls them there) and takes the
estimator lock only around estimator calls.

Slots of the default namespace show under their own names; slots of other
namespaces (a LoRA id or a cache salt) show as ``slot@<keyed hash>``, so an
operator can tell them apart without the admin API revealing the salt.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Optional

from sglang_kvshare.cache.parts import CacheParts
from sglang_kvshare.config import RUNTIME_FIELDS, KVShareConfig

DEFAULT_NAMESPACE = (None, None, None)


class AdminView:
    """The admin-facing side of one cache (see the module docstring)."""

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts

    @property
    def config(self) -> KVShareConfig:
        return self.parts.state.config

    # ------------------------------------------------------------ naming
    def _display(self, namespace, slot: str) -> str:
        if tuple(namespace) == DEFAULT_NAMESPACE:
            return slot
        return f"{slot}@{self.parts.hasher((), 'namespace', tuple(namespace))[:8]}"

    def _describe_pools(self) -> dict[str, list[dict]]:
        with self.parts.state.lock:
            described = self.parts.state.estimator.describe() if self.parts.state.estimator is not None else {}
        return {self._display(*key) if isinstance(key, tuple) and len(key) == 2 else str(key): anchors
                for key, anchors in described.items()}

    # ------------------------------------------------------------ reads
    def stats(self) -> dict:
        """Totals, per-slot counters, limits and usage (plain Python types)."""
        pools = self._describe_pools()
        slots = {}
        for ns, node in self.parts.registry.all_slots():
            name = self._display(ns, node.slot)
            info = node.stats.as_dict()
            anchors = pools.get(name, [])
            info["anchors"] = len(anchors)
            info["anchor_bytes"] = int(sum(a.get("bytes", 0) for a in anchors))
            slots[name] = info
        seen = sum(s["shared_tokens_seen"] for s in slots.values())
        reused = sum(s["resolved_alignment"] + s["resolved_correction"] for s in slots.values())
        with self.parts.state.lock:
            memory = self.parts.state.estimator.memory_bytes() if self.parts.state.estimator is not None else 0
        tree = self.parts.tree
        allocator = tree.token_to_kv_pool_allocator
        cfg = self.parts.state.config
        workspace_max = self.parts.reads.max_nbytes(allocator.get_kvcache())
        limits = {**dataclasses.asdict(self.parts.registry.limits),
                  "learn_queue_jobs": cfg.learn_queue_max, "learn_queue_bytes": int(cfg.learn_queue_mb * 2**20),
                  "anchor_bytes": int(cfg.pool_budget_mb * 2**20), "pools": cfg.max_pools,
                  "read_workspace_bytes": workspace_max}
        usage = {**self.parts.registry.usage(), "learn_queue_jobs": self.parts.learner.pending(),
                 "learn_queue_bytes": self.parts.learner.queued_bytes(), "anchor_bytes": int(memory),
                 "pools": len(pools), "read_workspace_bytes": self.parts.reads.nbytes()}
        # NOTE: everything kvshare allocates lives beside SGLang's KV pool, outside --mem-fraction-static;
        # this is the most it can hold (docs/OPERATIONS.md: how to size the static fraction on a GPU).
        memory_bound = limits["learn_queue_bytes"] + limits["anchor_bytes"] + workspace_max
        return {
            "mode": cfg.mode,
            "retention": self.parts.retention.name,  # the eviction order in force (cache/retention.py)
            "config": dataclasses.asdict(cfg),
            "kv_pool_tokens": {"available": int(allocator.available_size()), "evictable": int(tree.evictable_size()),
                               "protected": int(tree.protected_size()), "total": int(allocator.size)},
            "unsupported_reason": self.parts.state.unsupported_reason,
            "shared_tokens_seen": seen,
            "reuse_ratio": reused / seen if seen else 0.0,
            "anchor_bytes": int(memory),
            "memory_bound_bytes": int(memory_bound),
            "pending_observations": self.parts.learner.pending(),
            "limits": limits,
            "usage": usage,
            "counters": self.parts.counters.snapshot(),
            "slots": slots,
        }

    def gate_summary(self) -> dict:
        """How many gate decisions this rank took and a digest of them (``correction.rank_reduce``):
        under tensor parallelism every rank's must be equal; an operator (and the TP test) compares them."""
        estimator = self.parts.state.estimator
        with self.parts.state.lock:
            anchors = sum(len(a) for a in estimator.describe().values()) if estimator is not None else 0
            return {"gate_decisions": int(getattr(estimator, "gate_decisions", 0)),
                    "gate_digest": int(getattr(estimator, "gate_digest", 0)), "anchors": anchors,
                    "anchor_bytes": int(estimator.memory_bytes()) if estimator is not None else 0}

    def pools(self, slot: Optional[str] = None) -> dict:
        """Per slot, each anchor: id, length, age, activations, edges, rank, bytes.

        Raises ``KeyError`` for a slot the cache does not know.
        """
        pools = self._describe_pools()
        known = set(pools) | {self._display(ns, node.slot) for ns, node in self.parts.registry.all_slots()}
        if slot is not None:
            if slot not in known:
                raise KeyError(slot)
            return {slot: pools.get(slot, [])}
        return {name: pools.get(name, []) for name in sorted(known)}

    # ------------------------------------------------------------ writes
    def save_pools(self) -> dict:
        """Write the anchor pools to ``--kvshare-pool-file`` (``cache.pool_persistence``); returns the path,
        slots, anchors and bytes written. Raises ``NoPools`` when there is no file or no pool to save, and
        ``OSError`` when the file cannot be written."""
        from sglang_kvshare.cache.pool_persistence import NoPools

        saver = self.parts.pool_saver
        if saver is None:
            raise NoPools("this server has no pool file: start it with --kvshare-pool-file PATH "
                          "(and --kvshare-mode kvcmas)")
        return saver.save(self.parts.state, self.parts.hasher)

    def configure(self, **changes: Any) -> KVShareConfig:
        """Apply a validated change atomically (all or nothing); returns the new config.

        The names are ``RUNTIME_FIELDS``; None keeps a value, and an empty string
        clears an optional text setting (``fidelity_target``).
        ``recompute_ratio``, ``min_reuse_tokens`` and ``staged`` apply to requests admitted from now on.
        ``mode`` may switch among ``off``, ``fullshared`` and ``kvcmas`` at runtime,
        under the same checks as the launch (page size 1; kvcmas needs TP 1);
        switching between fullshared and kvcmas starts with empty pools.
        Raises ``ValueError`` with what to change.
        """
        unknown = sorted(set(changes) - set(RUNTIME_FIELDS))
        if unknown:
            raise ValueError(f"not settable at runtime: {unknown}; settable: {list(RUNTIME_FIELDS)}")
        changes = {k: (None if v == "" else v) for k, v in changes.items() if v is not None}
        new = self.parts.state.config.replace(**changes)  # validates; raises ValueError
        with self.parts.state.lock:
            if self.parts.state.apply(new):
                self.parts.learner.reset()  # observations of the old estimator must not fill the new one
        return new

    def reset(self, slot: Optional[str] = None) -> None:
        """Empty the anchor pools and copy records of one slot (every namespace) or all.

        Observations still queued are dropped too (for one slot: all of them), so
        nothing learned before the reset refills the pools after it.
        """
        self.parts.state.new_epoch()  # estimates assembled from what is forgotten are not matched again
        with self.parts.state.lock:
            self.parts.learner.reset()
            estimator = self.parts.state.estimator
            if estimator is not None:
                if slot is None:
                    estimator.reset()
                else:
                    for key in self._pool_keys(slot):
                        estimator.reset(key)
            if slot is None:
                self.parts.registry.reset()
            else:
                for ns, node in list(self.parts.registry.all_slots()):
                    if self._display(ns, node.slot) == slot:
                        self.parts.registry.namespace(ns).slots.pop(node.slot, None)

    def _pool_keys(self, display: str) -> list[Hashable]:
        with self.parts.state.lock:
            keys = list(self.parts.state.estimator.describe()) if self.parts.state.estimator is not None else []
        return [k for k in keys if isinstance(k, tuple) and len(k) == 2 and self._display(*k) == display]
