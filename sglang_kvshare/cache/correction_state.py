"""The config in force and the estimator it built, shared by the request path and the admin view.

Why one object: the mode, tau or head K can change at runtime
(``POST /kvshare/config``) while the scheduler serves, and the resolver, the
recorder, the learner and the admin view must all see the same config and
the same estimator. They hold this object, not the cache. The estimator lock
guards every estimator call; the learner's SVDs run outside it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_kvshare.cache.checks import check_mode
from sglang_kvshare.config import KVShareConfig

logger = logging.getLogger(__name__)


@dataclass
class CorrectionState:
    """Config, RoPE spec and estimator of one cache; ``page_size`` is the launch fact a runtime mode
    switch is checked against again; ``reducer`` takes kvcmas's gate decisions once for every
    tensor-parallel rank (``correction.rank_reduce``; None: one rank)."""

    config: KVShareConfig
    model_config: Optional[Any]
    page_size: int = 1
    reducer: Optional[Any] = None
    spec: Any = field(default=None, init=False)  # correction.RopeSpec, read from the model
    estimator: Any = field(default=None, init=False)
    unsupported_reason: Optional[str] = field(default=None, init=False)
    lock: threading.RLock = field(default_factory=threading.RLock, init=False)
    # Names the estimates valid under the settings in force (part of their tree key): a reset or a
    # config change starts a new epoch, so a repeated prompt is assembled again or prefilled, never
    # served an estimate made under the old settings.
    epoch: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.config.mode != "off":
            self._init_correction()

    @property
    def ready(self) -> bool:
        """A mode other than ``off`` is in force and the model supports it."""
        return self.config.mode != "off" and self.estimator is not None

    def _init_correction(self) -> None:
        """Read the RoPE spec from the model; an unsupported model disables kvshare (logged, never wrong KV)."""
        from sglang_kvshare.correction import RopeSpec, UnsupportedAttentionError

        hf_config = getattr(self.model_config, "hf_config", None) if self.model_config is not None else None
        try:
            if hf_config is None:
                raise UnsupportedAttentionError("the model config is not available to the cache")
            self.spec = RopeSpec.from_hf_config(getattr(hf_config, "text_config", None) or hf_config)
        except UnsupportedAttentionError as exc:
            self.unsupported_reason = str(exc)
            logger.warning("sglang-kvshare: %s; kvshare is disabled, serving like stock SGLang", exc)
            return
        self.estimator = self._make_estimator()

    def _make_estimator(self) -> Any:
        from sglang_kvshare.correction import make_estimator

        cfg = self.config
        if cfg.mode == "fullshared":
            return make_estimator("fullshared", self.spec)
        return make_estimator(cfg.mode, self.spec, tau=cfg.tau, capacity=cfg.effective_capacity,
                              rank=cfg.effective_rank, window=cfg.evict_window,
                              gate_len=cfg.gate_max_tokens or None, min_anchor_len=cfg.min_anchor_len or None,
                              min_edge_anchors=cfg.effective_edge_anchors,
                              max_slots=cfg.max_pools, budget_bytes=int(cfg.pool_budget_mb * 2**20),
                              step_layers=cfg.learn_step_layers or None, reducer=self.reducer,
                              svd_method="gram")  # serving: exact and the cheapest on the learning thread

    def new_epoch(self) -> None:
        """Invalidate every estimate in the tree (they stay until evicted, unreachable)."""
        self.epoch += 1

    def apply(self, new: KVShareConfig) -> bool:
        """Put ``new`` in force (checked like a launch); returns True when the estimator was rebuilt
        (a mode switch between fullshared and kvcmas: the pools start empty).

        Raises ``UnsupportedSetupError`` (a ``ValueError``) when the launch facts forbid the mode.
        """
        check_mode(new.mode, page_size=self.page_size)
        with self.lock:
            rebuild = new.mode != self.config.mode and new.mode != "off"
            self.config = new
            self.new_epoch()
            if new.mode != "off" and self.spec is None and self.unsupported_reason is None:
                self._init_correction()
                return True
            if rebuild and self.spec is not None:
                self.estimator = self._make_estimator()
                return True
            if self.estimator is not None and new.mode == "kvcmas":
                self.estimator.configure(tau=new.tau, capacity=new.effective_capacity, rank=new.effective_rank,
                                         min_edge_anchors=new.effective_edge_anchors)
            return False
