"""What the admin API sees of the cache: set-up of the estimator, stats, pools, configure, reset.

A mixin of ``KVShareRadixCache`` (it reads the cache's registry, estimator,
learner and counters) so the adapter keeps only the tree hooks. Every
method here runs on the scheduler thread between batches (the admin channel
calls them there) and takes the estimator lock only around estimator calls.

Slots of the default namespace show under their own names; slots of other
namespaces (a LoRA id or a cache salt) show as ``slot@<keyed hash>``, so an
operator can tell them apart without the admin API revealing the salt.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Hashable, Optional

from sglang_kvshare.config import KVShareConfig

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = (None, None)


class CacheAdmin:
    """Admin-facing half of ``KVShareRadixCache`` (see the module docstring)."""

    # ------------------------------------------------------------ set-up
    def _init_correction(self) -> None:
        from sglang_kvshare.correction import RopeSpec, UnsupportedAttentionError

        model_config = self.model_config
        hf_config = getattr(model_config, "hf_config", None) if model_config is not None else None
        try:
            if hf_config is None:
                raise UnsupportedAttentionError("the model config is not available to the cache")
            self.spec = RopeSpec.from_hf_config(getattr(hf_config, "text_config", None) or hf_config)
        except UnsupportedAttentionError as exc:
            self.unsupported_reason = str(exc)
            logger.warning("sglang-kvshare: %s; kvshare is disabled, serving like stock SGLang", exc)
            return
        self.estimator = self._make_estimator()

    def _make_estimator(self):
        from sglang_kvshare.correction import make_estimator

        cfg: KVShareConfig = self.kvshare_config
        if cfg.mode == "fullshared":
            return make_estimator("fullshared", self.spec)
        return make_estimator(cfg.mode, self.spec, tau=cfg.tau, capacity=cfg.effective_capacity,
                              rank=cfg.effective_rank, window=cfg.evict_window,
                              gate_len=cfg.gate_max_tokens or None, min_anchor_len=cfg.min_anchor_len or None,
                              max_slots=cfg.max_pools, budget_bytes=int(cfg.pool_budget_mb * 2**20),
                              step_layers=cfg.learn_step_layers or None,
                              svd_method="gram")  # serving: exact and the cheapest on the learning thread

    # ------------------------------------------------------------ naming
    def _display(self, namespace, slot: str) -> str:
        if tuple(namespace) == DEFAULT_NAMESPACE:
            return slot
        return f"{slot}@{self.hasher((), 'namespace', tuple(namespace))[:8]}"

    def _describe_pools(self) -> dict[str, list[dict]]:
        with self._estimator_lock:
            described = self.estimator.describe() if self.estimator is not None else {}
        return {self._display(*key) if isinstance(key, tuple) and len(key) == 2 else str(key): anchors
                for key, anchors in described.items()}

    # ------------------------------------------------------------ reads
    def kvshare_stats(self) -> dict:
        """Totals, per-slot counters, limits and usage (plain Python types)."""
        pools = self._describe_pools()
        slots = {}
        for ns, node in self.registry.all_slots():
            name = self._display(ns, node.slot)
            info = node.stats.as_dict()
            anchors = pools.get(name, [])
            info["anchors"] = len(anchors)
            info["anchor_bytes"] = int(sum(a.get("bytes", 0) for a in anchors))
            slots[name] = info
        seen = sum(s["shared_tokens_seen"] for s in slots.values())
        reused = sum(s["resolved_alignment"] + s["resolved_correction"] for s in slots.values())
        with self._estimator_lock:
            memory = self.estimator.memory_bytes() if self.estimator is not None else 0
        allocator = self.token_to_kv_pool_allocator
        cfg = self.kvshare_config
        limits = {**dataclasses.asdict(self.registry.limits),
                  "learn_queue_jobs": cfg.learn_queue_max, "learn_queue_bytes": int(cfg.learn_queue_mb * 2**20),
                  "anchor_bytes": int(cfg.pool_budget_mb * 2**20), "pools": cfg.max_pools}
        usage = {**self.registry.usage(), "learn_queue_jobs": self.learner.pending(),
                 "learn_queue_bytes": self.learner.queued_bytes(), "anchor_bytes": int(memory),
                 "pools": len(pools)}
        return {
            "mode": cfg.mode,
            "config": dataclasses.asdict(cfg),
            "kv_pool_tokens": {"available": int(allocator.available_size()), "evictable": int(self.evictable_size()),
                               "protected": int(self.protected_size()), "total": int(allocator.size)},
            "unsupported_reason": self.unsupported_reason,
            "shared_tokens_seen": seen,
            "reuse_ratio": reused / seen if seen else 0.0,
            "anchor_bytes": int(memory),
            "pending_observations": self.learner.pending(),
            "limits": limits,
            "usage": usage,
            "counters": self.counters.snapshot(),
            "slots": slots,
        }

    def kvshare_pools(self, slot: Optional[str] = None) -> dict:
        """Per slot, each anchor: id, length, age, activations, edges, rank, bytes.

        Raises ``KeyError`` for a slot the cache does not know.
        """
        pools = self._describe_pools()
        known = set(pools) | {self._display(ns, node.slot) for ns, node in self.registry.all_slots()}
        if slot is not None:
            if slot not in known:
                raise KeyError(slot)
            return {slot: pools.get(slot, [])}
        return {name: pools.get(name, []) for name in sorted(known)}

    # ------------------------------------------------------------ writes
    def kvshare_configure(self, *, tau: Optional[float] = None, capacity: Optional[int] = None,
                          rank: Optional[int] = None, mode: Optional[str] = None,
                          recompute_head: Optional[int] = None, staged: Optional[bool] = None) -> KVShareConfig:
        """Apply a validated change atomically (all or nothing); returns the new config.

        ``recompute_head`` and ``staged`` apply to requests admitted from now on.
        ``mode`` may switch among ``off``, ``fullshared`` and ``kvcmas`` at runtime,
        under the same checks as the launch (page size 1; kvcmas needs TP 1);
        switching between fullshared and kvcmas starts with empty pools.
        Raises ``ValueError`` with what to change.
        """
        from sglang_kvshare.cache.factory import check_mode

        changes = {k: v for k, v in dict(tau=tau, capacity=capacity, rank=rank, mode=mode,
                                         recompute_head=recompute_head, staged=staged).items() if v is not None}
        if changes.get("mode") == "kvcomm":
            raise ValueError("mode kvcomm is not served (it needs reference prefills); use fullshared or kvcmas")
        new = self.kvshare_config.replace(**changes)  # validates; raises ValueError
        check_mode(new.mode, page_size=self.page_size, tp_size=self.tp_size)
        with self._estimator_lock:
            rebuild = new.mode != self.kvshare_config.mode and new.mode != "off"
            self.kvshare_config = new
            if new.mode != "off" and self.spec is None and self.unsupported_reason is None:
                self._init_correction()
            elif rebuild and self.spec is not None:
                self.estimator = self._make_estimator()
                self.learner.reset()
            elif self.estimator is not None and new.mode == "kvcmas":
                self.estimator.configure(tau=new.tau, capacity=new.effective_capacity, rank=new.effective_rank)
        return new

    def kvshare_reset(self, slot: Optional[str] = None) -> None:
        """Empty the anchor pools and copy records of one slot (every namespace) or all.

        Observations still queued are dropped too (for one slot: all of them), so
        nothing learned before the reset refills the pools after it.
        """
        with self._estimator_lock:
            self.learner.reset()
            if self.estimator is not None:
                if slot is None:
                    self.estimator.reset()
                else:
                    for key in self._pool_keys(slot):
                        self.estimator.reset(key)
            if slot is None:
                self.registry.reset()
            else:
                for ns, node in list(self.registry.all_slots()):
                    if self._display(ns, node.slot) == slot:
                        self.registry.namespace(ns).slots.pop(node.slot, None)

    def _pool_keys(self, display: str) -> list[Hashable]:
        with self._estimator_lock:
            keys = list(self.estimator.describe()) if self.estimator is not None else []
        return [k for k in keys if isinstance(k, tuple) and len(k) == 2 and self._display(*k) == display]
