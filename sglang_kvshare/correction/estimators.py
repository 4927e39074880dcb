"""The served estimation modes behind one interface (ALGORITHM.md section 3, 4).

Every mode answers the same question: given a source cache of a shared slot
and the target agent with its start position, what K/V should the target use,
or should it prefill densely. They differ in which source they want
(``source_policy``) and how they key and store anchors:

==============  ==============  ============  =====================
name            source_policy   edge key      stored anchors
==============  ==============  ============  =====================
``fullshared``  first           -             none (alignment only)
``kvcmas``      previous        (src, dst)    rank 32, V=10
==============  ==============  ============  =====================

``source_policy``: ``previous`` = the cache already materialized for the
previous agent on the edge (estimate or dense; chaining), ``first`` = the
first agent's dense cache of the content, ``reference`` = a context-free
prefill of the content alone (KVCOMM's extra prefill). The offline baselines
(KVCOMM, the KVCMAS ablations, CacheBlend) build on ``AnchorEstimator`` and
``FullShared`` in ``benchmarks/baselines.py``; the server never runs them.

Usage::

    est = make_estimator("kvcmas", spec, tau=0.3)
    res = est.estimate("query", src, dst_agent="critic", dst_pos=212)
    if res.accepted:                   # plan=None: alignment only
        k, v = materialize(src.k, src.v, src.start_pos, 212, res.plan, spec)
    else:                              # prefill densely, then teach the pool
        prep = est.prepare_observation("query", src, dense_target, content_key=h)  # no lock needed
        est.commit_observation(prep)                                             # under the caller's lock

Slots and agents are opaque hashables (the cache passes tuples for
namespaces and hashed agent identities). State is bounded: at most
``max_slots`` pools (least recently used dropped first) and ``budget_bytes``
of anchors over all pools (a commit beyond it evicts the least recently used
pool's oldest-least-activated anchor, never refuses to learn).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Hashable, Iterator, Literal

import torch

from .anchor_pool import AnchorPool, PoolConfig, PreparedObservation, observation_steps, run_steps
from .plan import EstimateResult
from .rank_reduce import LocalReducer, RanksUnreachable, Reducer, decision_digest
from .rope import RopeSpec

__all__ = ["SegmentCache", "Estimator", "AnchorEstimator", "FullShared", "make_estimator", "anchor_factory",
           "ESTIMATORS", "DEFAULT_MAX_SLOTS", "DEFAULT_BUDGET_BYTES"]

DEFAULT_MAX_SLOTS = 4096
DEFAULT_BUDGET_BYTES = 512 * 2**20

SourcePolicy = Literal["previous", "first", "reference"]


@dataclass
class SegmentCache:
    """One slot's cache as some agent holds it.

    Attributes:
        k, v: ``[num_layers, L, kv_heads, head_dim]``; keys post-RoPE at
            positions ``start_pos .. start_pos + L - 1``.
        start_pos: the segment's first position in that agent's context.
        agent: the agent whose context produced it.
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
    """A mode: the narrow interface the cache and the harness use; pools stay inside.

    Contract: ``estimate`` decides and returns a plan (mutates activation
    counters only); ``prepare_observation`` is pure (no estimator state: run it
    without any lock); ``commit_observation``, ``reset``, ``configure`` mutate
    and are cheap. Not thread-safe: the caller serializes everything but
    ``prepare_observation``.
    """

    name: str
    source_policy: SourcePolicy
    learns: bool = False
    """True when observations change later estimates (anchor modes)."""

    def __init__(self, spec: RopeSpec) -> None:
        self.spec = spec

    @abstractmethod
    def estimate(self, slot: Hashable, source: SegmentCache, dst_agent: Hashable, dst_pos: int) -> EstimateResult:
        """Decide for ``dst_agent`` at ``dst_pos``; when accepted, ``plan`` says what to add (None: align only)."""

    def has_content(self, slot: Hashable, content_key: Hashable | None) -> bool:
        """True when ``slot``'s pool holds an anchor of ``content_key`` (cheap; call under the caller's lock)."""
        return False

    def has_observation(self, slot: Hashable, content_key: Hashable | None, src_agent: Hashable,
                        dst_agent: Hashable) -> bool:
        """True when learning ``content_key`` again on ``src_agent -> dst_agent`` would add nothing.

        Cheap, under the caller's lock. Pool-less modes learn nothing, so always True there.
        """
        return not self.learns

    def prepare_observation(self, slot: Hashable, source: SegmentCache, target: SegmentCache,
                            content_key: Hashable | None = None, with_base: bool = True,
                            between: Callable[[], None] | None = None) -> PreparedObservation | None:
        """The heavy half of learning from a dense prefill ``target``; None when the mode learns nothing.

        ``with_base=False`` (pass ``not has_content(slot, content_key)``, read under the lock) skips
        factorizing a base the pool already holds: half the SVDs for a content seen on another edge.
        ``between``: called between factorizations.
        """
        return run_steps(self.observation_steps(slot, source, target, content_key, with_base), between)

    def observation_steps(self, slot: Hashable, source: SegmentCache, target: SegmentCache,
                          content_key: Hashable | None = None,
                          with_base: bool = True) -> Iterator[None]:
        """``prepare_observation`` as steps: an iterator that stops between factorizations.

        Its ``StopIteration.value`` is what ``prepare_observation`` returns. The
        server's learner resumes each step on a fresh thread (see
        ``anchor_pool.observation_steps``). A mode that learns nothing has no step.
        """
        return iter(())

    def commit_observation(self, prepared: PreparedObservation | None) -> int | None:
        """Attach a prepared observation; returns the anchor id, None when nothing was kept."""
        return None

    def observe(self, slot: Hashable, source: SegmentCache, target: SegmentCache,
                content_key: Hashable | None = None) -> int | None:
        """``has_content`` + ``prepare_observation`` + ``commit_observation`` in one call (offline use)."""
        return self.commit_observation(self.prepare_observation(
            slot, source, target, content_key, with_base=not self.has_content(slot, content_key)))

    def pool_size(self, slot: Hashable) -> int:
        """Anchors held for ``slot`` (0 for unknown slots and pool-less modes)."""
        return 0

    def memory_bytes(self) -> int:
        return 0

    def full_dim_bytes(self) -> int:
        return 0

    def describe(self) -> dict[Hashable, list[dict]]:
        """Per slot, one dict per anchor (see ``AnchorPool.describe``)."""
        return {}

    def configure(self, **changes: Any) -> None:
        """Change settings at runtime (ignored where meaningless)."""

    def reset(self, slot: Hashable | None = None) -> None:
        """Forget what was learned, for one slot or (None) all."""


class FullShared(Estimator):
    """Alignment only: the source's K rotated to the target positions, V as is (``plan=None``)."""

    name = "fullshared"
    source_policy: SourcePolicy = "first"

    def estimate(self, slot, source, dst_agent, dst_pos):
        return EstimateResult(True, "aligned", covered=source.length)


_POOL_FIELDS = {f.name for f in fields(PoolConfig)}


class AnchorEstimator(Estimator):
    """KVCOMM / KVCMAS and their ablations: one ``AnchorPool`` per slot, bounded in slots and bytes."""

    learns = True

    def __init__(self, spec: RopeSpec, name: str, source_policy: SourcePolicy,
                 edge_fn: Callable[[Hashable, Hashable], Hashable], config: PoolConfig,
                 max_slots: int = DEFAULT_MAX_SLOTS, budget_bytes: int | None = DEFAULT_BUDGET_BYTES,
                 reducer: Reducer | None = None) -> None:
        """``max_slots``: pools kept; committing to a new slot beyond it drops the least recently
        used pool (estimate and commit count as use). ``budget_bytes``: anchor bytes over all
        pools (None: unbounded); a commit beyond it evicts, from the least recently used pool
        that holds anchors, its oldest-least-activated anchor, until the total fits.
        ``reducer``: the tensor-parallel ranks' gate decisions are taken once (``rank_reduce``);
        ``gate_decisions`` and ``gate_digest`` let the ranks be compared."""
        super().__init__(spec)
        self.reducer: Reducer = reducer or LocalReducer()
        self.gate_decisions = 0
        self.gate_digest = 0
        self.name = name
        self.source_policy = source_policy
        self._edge_fn = edge_fn
        self.config = config
        self.max_slots = 1
        self.budget_bytes: int | None = None
        self._pools: OrderedDict[Hashable, AnchorPool] = OrderedDict()  # least recently used first
        self.evictions = {"slots": 0, "anchors_budget": 0, "ranks_disagree": 0}
        self.changes = 0  # commits and resets: a saver compares it with the count at its last save
        self.configure(max_slots=max_slots, budget_bytes=budget_bytes)

    def edge(self, src_agent: Hashable, dst_agent: Hashable) -> Hashable:
        """The key deltas are stored under for ``src_agent -> dst_agent``."""
        return self._edge_fn(src_agent, dst_agent)

    def estimate(self, slot, source, dst_agent, dst_pos):
        pool = self._pools.get(slot)
        if pool is not None:
            self._pools.move_to_end(slot)
        # NOTE: a slot without a pool gates on an empty one, not kept (unknown slots cost nothing): under tensor
        # parallelism another rank may hold a pool for it, and every rank takes part in every decision.
        gate = pool if pool is not None else AnchorPool(self.spec, self.config, self.reducer)
        try:
            result = gate.estimate(source.k, source.v, source.start_pos, dst_pos, self.edge(source.agent, dst_agent),
                                   key=slot)
        except RanksUnreachable:
            # The ranks can no longer decide together (logged once by the reducer): dense, on every rank.
            return EstimateResult(False, "ranks_out_of_step", compare_len=source.length)
        if result.reason == "ranks_disagree":
            # Every rank sees it at once: their pools of this slot drifted apart (a learning step failed on one).
            # They drop them together and learn the slot afresh.
            self._pools.pop(slot, None)
            self.changes += 1
            self.evictions["ranks_disagree"] += 1
        self.gate_decisions += 1
        self.gate_digest = decision_digest(self.gate_digest, slot, result.reason, list(result.anchor_ids or ()),
                                           result.entropy)
        return result

    def has_content(self, slot, content_key):
        pool = self._pools.get(slot)
        return pool is not None and pool.has_content(content_key)

    def has_observation(self, slot, content_key, src_agent, dst_agent):
        pool = self._pools.get(slot)
        return pool is not None and content_key is not None and pool.has_delta(content_key,
                                                                               self.edge(src_agent, dst_agent))

    def observation_steps(self, slot, source, target, content_key=None, with_base=True):
        if not target.exact:
            raise ValueError("anchors come only from dense prefills; target.exact is False")
        return self._steps(slot, source, target, content_key, with_base)

    def _steps(self, slot, source, target, content_key, with_base):
        prepared = yield from observation_steps(self.spec, self.config, source.k, source.v, source.start_pos,
                                                target.k, target.v, target.start_pos,
                                                self.edge(source.agent, target.agent), content_key, with_base)
        return replace(prepared, slot=slot)

    def commit_observation(self, prepared):
        if prepared is None:
            return None
        pool = self._pools.get(prepared.slot)
        if pool is None and prepared.base_k is None:
            return None  # prepared without a base for an anchor that is gone: nothing to attach to
        if pool is None:
            while len(self._pools) >= self.max_slots:
                self._pools.popitem(last=False)
                self.evictions["slots"] += 1
            pool = self._pools[prepared.slot] = AnchorPool(self.spec, self.config, self.reducer)
        self._pools.move_to_end(prepared.slot)
        anchor_id = pool.commit(prepared)
        self.changes += 1
        self._fit_budget()
        return anchor_id if anchor_id is not None and any(a.id == anchor_id for a in pool.anchors) else None

    def pool_size(self, slot):
        pool = self._pools.get(slot)
        return 0 if pool is None else len(pool)

    def pools(self) -> list[tuple[Hashable, AnchorPool]]:
        """``(slot, pool)`` pairs, least recently used first (what ``pool_file`` saves, in the order it reloads)."""
        return list(self._pools.items())

    def restore_activations(self, slot: Hashable, anchor_id: int, activations: int) -> bool:
        """Set a reloaded anchor's activation count (eviction reads it); False when the anchor is not held."""
        pool = self._pools.get(slot)
        return pool is not None and pool.set_activations(anchor_id, activations)

    def memory_bytes(self):
        return sum(p.memory_bytes() for p in self._pools.values())

    def full_dim_bytes(self):
        return sum(p.full_dim_bytes() for p in self._pools.values())

    def describe(self):
        return {slot: p.describe() for slot, p in self._pools.items()}

    def configure(self, **changes: Any) -> None:
        """Change ``PoolConfig`` fields (tau, capacity, rank, window, gate_len, ...) for every pool,
        and the bounds ``max_slots`` / ``budget_bytes``; tightened bounds evict at once.
        ``rank=None`` means full dimension (existing anchors keep theirs). Unknown names raise."""
        unknown = set(changes) - _POOL_FIELDS - {"max_slots", "budget_bytes"}
        if unknown:
            raise ValueError(f"unknown setting(s) {sorted(unknown)}; choose from "
                             f"{sorted(_POOL_FIELDS | {'max_slots', 'budget_bytes'})}")
        if "max_slots" in changes:
            if changes["max_slots"] < 1:
                raise ValueError(f"max_slots must be >= 1, got {changes['max_slots']}")
            self.max_slots = int(changes["max_slots"])
        if "budget_bytes" in changes:
            if changes["budget_bytes"] is not None and changes["budget_bytes"] <= 0:
                raise ValueError(f"budget_bytes must be positive or None, got {changes['budget_bytes']}")
            self.budget_bytes = changes["budget_bytes"]
        self.changes += 1  # a tighter bound may evict
        pool_changes = {k: v for k, v in changes.items() if k in _POOL_FIELDS}
        if pool_changes:
            self.config = replace(self.config, **pool_changes)
            for p in self._pools.values():
                p.reconfigure(self.config)
        while len(self._pools) > self.max_slots:
            self._pools.popitem(last=False)
            self.evictions["slots"] += 1
        self._fit_budget()

    def reset(self, slot=None):
        self.changes += 1
        if slot is None:
            self._pools.clear()
        else:
            self._pools.pop(slot, None)

    def _fit_budget(self) -> None:
        """Evict anchors, least recently used pool first, until the total fits ``budget_bytes``."""
        if self.budget_bytes is None:
            return
        total = self.memory_bytes()
        for pool in list(self._pools.values()):
            while total > self.budget_bytes and len(pool):
                total -= pool.evict_one()
                self.evictions["anchors_budget"] += 1
            if total <= self.budget_bytes:
                return


def _pair(src, dst):
    return (src, dst)


_BOUNDS = ("max_slots", "budget_bytes", "reducer")


def anchor_factory(name: str, policy: SourcePolicy, edge_fn: Callable[[Hashable, Hashable], Hashable],
                   capacity: int, rank: int | None) -> Callable[..., AnchorEstimator]:
    """A builder of ``AnchorEstimator`` modes: ``make(spec, **cfg)`` with these defaults."""
    def make(spec: RopeSpec, **cfg) -> AnchorEstimator:
        cfg.setdefault("capacity", capacity)
        cfg.setdefault("rank", rank)
        bounds = {k: cfg.pop(k) for k in _BOUNDS if k in cfg}
        return AnchorEstimator(spec, name, policy, edge_fn, PoolConfig(**cfg), **bounds)
    return make


def _fullshared(spec: RopeSpec, **_cfg) -> FullShared:
    return FullShared(spec)


ESTIMATORS: dict[str, Callable[..., Estimator]] = {
    "fullshared": _fullshared,
    "kvcmas": anchor_factory("kvcmas", "previous", _pair, 10, 32),
}


def make_estimator(name: str, spec: RopeSpec, *, modes: dict[str, Callable[..., Estimator]] | None = None,
                   **cfg) -> Estimator:
    """Build a mode by name from ``modes`` (default: the served ones, ``ESTIMATORS``); ``cfg`` are
    ``PoolConfig`` fields plus ``max_slots``/``budget_bytes``. Raises ``ValueError`` for an unknown name."""
    modes = ESTIMATORS if modes is None else modes
    try:
        factory = modes[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; choose one of {sorted(modes)}") from None
    return factory(spec, **cfg)
