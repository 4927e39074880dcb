"""The estimation modes behind one interface (ALGORITHM.md section 3, 4).

Every mode answers the same question: given a source cache of a shared slot
and the target agent with its start position, what K/V should the target use,
or should it prefill densely. They differ in which source they want
(``source_policy``) and how they key and store anchors:

=====================  ==============  ============  ====================
name                   source_policy   edge key      stored anchors
=====================  ==============  ============  ====================
``fullshared``         first           -             none (alignment only)
``kvcomm``             reference       ("ref", dst)  full dim, V=20
``kvcmas``             previous        (src, dst)    rank 32, V=10
``kvcmas_fullrank``    previous        (src, dst)    full dim, V=10
``kvcmas_nonchained``  first           (src, dst)    rank 32, V=10
``cacheblend``         first           -             none; recompute 15 %
=====================  ==============  ============  ====================

``source_policy``: ``previous`` = the cache already materialized for the
previous agent on the edge (estimate or dense; chaining), ``first`` = the
first agent's dense cache of the content, ``reference`` = a context-free
prefill of the content alone (KVCOMM's extra prefill).

Usage::

    est = make_estimator("kvcmas", spec, tau=0.3)
    res = est.estimate("query", src, dst_agent="critic", dst_pos=212)
    if not res.accepted:               # prefill densely, then teach the pool
        est.observe("query", src, dense_target, content_key=h)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Literal

import torch

from .anchor_pool import AnchorPool, EstimateResult, PoolConfig
from .rope import RopeSpec, rotate_keys

__all__ = ["SegmentCache", "Estimator", "AnchorEstimator", "FullShared", "CacheBlend",
           "make_estimator", "ESTIMATORS", "REFERENCE_AGENT"]

SourcePolicy = Literal["previous", "first", "reference"]
REFERENCE_AGENT = "ref"


@dataclass
class SegmentCache:
    """One slot's cache as some agent holds it.

    Attributes:
        k, v: ``[num_layers, L, kv_heads, head_dim]``; keys post-RoPE at
            positions ``start_pos .. start_pos + L - 1``.
        start_pos: the segment's first position in that agent's context.
        agent: the agent whose context produced it (``"ref"``: no context).
        exact: True for a dense prefill, False for an estimate.
    """

    k: torch.Tensor
    v: torch.Tensor
    start_pos: int
    agent: Hashable
    exact: bool = True

    @property
    def length(self) -> int:
        return int(self.k.shape[1])


class Estimator(ABC):
    """A mode. Subclasses keep whatever per-slot state they need."""

    name: str
    source_policy: SourcePolicy

    def __init__(self, spec: RopeSpec) -> None:
        self.spec = spec

    @abstractmethod
    def estimate(self, slot: str, source: SegmentCache, dst_agent: Hashable, dst_pos: int) -> EstimateResult:
        """Decide and, when accepted, return K/V for ``dst_agent`` at ``dst_pos``."""

    def observe(self, slot: str, source: SegmentCache, target: SegmentCache,
                content_key: Hashable | None = None) -> None:
        """Learn from a dense prefill ``target`` of the slot (no-op by default)."""

    def memory_bytes(self) -> int:
        return 0

    def full_dim_bytes(self) -> int:
        return 0

    def describe(self) -> dict[str, list[dict]]:
        return {}

    def configure(self, **changes) -> None:
        """Change tau / capacity / rank at runtime (ignored where meaningless)."""

    def reset(self) -> None:
        pass


class FullShared(Estimator):
    """Alignment only: the source's K rotated to the target positions, V as is."""

    name = "fullshared"
    source_policy: SourcePolicy = "first"

    def estimate(self, slot, source, dst_agent, dst_pos):
        k = rotate_keys(source.k, dst_pos - source.start_pos, self.spec)
        return EstimateResult(True, "aligned", covered=source.length, k=k, v=source.v.clone())


@dataclass(frozen=True)
class CacheBlendConfig:
    ratio: float = 0.15
    """Fraction of the segment's tokens recomputed through the later layers."""
    check_layer: int = 1
    """Layers ``0 .. check_layer`` are recomputed for every token; the
    deviation at ``check_layer`` picks the tokens recomputed after it."""
    criterion: Literal["k", "v"] = "k"


class CacheBlend(FullShared):
    """Aligned source plus selective recompute; the model forward is the caller's
    (see ``cacheblend.py`` for the token selection and the merge)."""

    name = "cacheblend"

    def __init__(self, spec: RopeSpec, config: CacheBlendConfig | None = None) -> None:
        super().__init__(spec)
        self.config = config or CacheBlendConfig()

    def estimate(self, slot, source, dst_agent, dst_pos):
        res = super().estimate(slot, source, dst_agent, dst_pos)
        res.reason = "needs_recompute"
        return res


class AnchorEstimator(Estimator):
    """KVCOMM / KVCMAS and their ablations: one ``AnchorPool`` per slot."""

    def __init__(self, spec: RopeSpec, name: str, source_policy: SourcePolicy,
                 edge_fn: Callable[[Hashable, Hashable], Hashable], config: PoolConfig) -> None:
        super().__init__(spec)
        self.name = name
        self.source_policy = source_policy
        self._edge_fn = edge_fn
        self.config = config
        self.pools: dict[str, AnchorPool] = {}

    def pool(self, slot: str) -> AnchorPool:
        if slot not in self.pools:
            self.pools[slot] = AnchorPool(self.spec, self.config)
        return self.pools[slot]

    def edge(self, src_agent: Hashable, dst_agent: Hashable) -> Hashable:
        return self._edge_fn(src_agent, dst_agent)

    def estimate(self, slot, source, dst_agent, dst_pos):
        return self.pool(slot).estimate(source.k, source.v, source.start_pos, dst_pos,
                                        self.edge(source.agent, dst_agent))

    def observe(self, slot, source, target, content_key=None):
        if not target.exact:
            raise ValueError("anchors come only from dense prefills; target.exact is False")
        self.pool(slot).add_observation(source.k, source.v, source.start_pos, target.k, target.v,
                                        target.start_pos, self.edge(source.agent, target.agent), content_key)

    def memory_bytes(self):
        return sum(p.memory_bytes() for p in self.pools.values())

    def full_dim_bytes(self):
        return sum(p.full_dim_bytes() for p in self.pools.values())

    def describe(self):
        return {slot: p.describe() for slot, p in self.pools.items()}

    def configure(self, tau: float | None = None, capacity: int | None = None, rank: int | None | str = "keep",
                  **_ignored) -> None:
        if tau is not None:
            self.config = replace(self.config, tau=tau)
        if capacity is not None:
            self.config = replace(self.config, capacity=capacity)
        if rank != "keep":
            self.config = replace(self.config, rank=rank)
        for p in self.pools.values():
            if tau is not None:
                p.set_tau(tau)
            if capacity is not None:
                p.set_capacity(capacity)
            if rank != "keep":
                p.set_rank(rank)

    def reset(self):
        for p in self.pools.values():
            p.reset()


def _pair(src, dst):
    return (src, dst)


def _by_target(src, dst):
    return (REFERENCE_AGENT, dst)


def _anchor_factory(name, policy, edge_fn, capacity, rank):
    def make(spec: RopeSpec, **cfg) -> AnchorEstimator:
        cfg.setdefault("capacity", capacity)
        cfg.setdefault("rank", rank)
        return AnchorEstimator(spec, name, policy, edge_fn, PoolConfig(**cfg))
    return make


def _cacheblend(spec: RopeSpec, **cfg) -> CacheBlend:
    return CacheBlend(spec, CacheBlendConfig(**cfg))


def _fullshared(spec: RopeSpec, **_cfg) -> FullShared:
    return FullShared(spec)


ESTIMATORS: dict[str, Callable[..., Estimator]] = {
    "fullshared": _fullshared,
    "kvcomm": _anchor_factory("kvcomm", "reference", _by_target, 20, None),
    "kvcmas": _anchor_factory("kvcmas", "previous", _pair, 10, 32),
    "kvcmas_fullrank": _anchor_factory("kvcmas_fullrank", "previous", _pair, 10, None),
    "kvcmas_nonchained": _anchor_factory("kvcmas_nonchained", "first", _pair, 10, 32),
    "cacheblend": _cacheblend,
}


def make_estimator(name: str, spec: RopeSpec, **cfg) -> Estimator:
    """Build a mode by name; ``cfg`` are ``PoolConfig`` (or ``CacheBlendConfig``) fields."""
    try:
        factory = ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; choose one of {sorted(ESTIMATORS)}") from None
    return factory(spec, **cfg)
