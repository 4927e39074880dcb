"""The anchor pool of one slot (ALGORITHM.md 3.1 - 3.3).

An anchor is one dense observation of the slot's content: a **base** (the
source cache the correction starts from, keys in the canonical frame, values
as is) and, per edge seen on that content, the exact correction
``Delta = C_target - Align(C_source)`` (keys canonical). Bases and deltas are
stored as rank-``r`` factors (``rank=None``: full dimension).

For a new source cache the pool gates on values (normalized entropy of
``softmax(-d/T)`` against ``tau``), then weighs the stored deltas per token
(separately for K and V) and returns a ``CorrectionPlan``: the chosen anchors'
deltas, the weights and the covered prefix (the longest prefix the eligible
anchors cover; never extrapolated). ``apply`` turns a plan into K/V.

Learning is split so that the heavy part needs no lock: ``prepare_observation``
(pure: canonical frames, deltas, SVD factors, the gate summary) and
``AnchorPool.commit`` (attach, evicting as needed; cheap).

The math lives in ``sglang_kvshare.kernels`` (gate distances, token distances,
weights); the gate reads each anchor's cached Gram summary instead of
reconstructing its base. Edges are opaque hashable keys; the estimator decides
what they are. Shapes: every cache is ``[num_layers, L, kv_heads, head_dim]``;
keys post-RoPE at their absolute positions. Not thread-safe: the caller
serializes ``estimate``/``commit``/``evict_one``.
"""

from __future__ import annotations

import itertools
import logging
import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generator, Hashable, Iterator, Literal

import torch

from sglang_kvshare.kernels import (gate_from_sq_distances, gate_sq_distances_dense, token_distances,
                                    token_distances_dense, token_gate_distances, token_weights)

from .gate import top_mass
from .low_rank import Factors, factor_nbytes, factorize, stack_factors, stack_layer_groups
from .plan import MIN_GATE_ANCHORS, CorrectionPlan, EstimateResult
from .rank_reduce import LocalReducer, Reducer, decision_key
from .rope import RopeSpec, to_canonical

__all__ = ["Anchor", "AnchorPool", "PoolConfig", "PreparedObservation", "prepare_observation", "observation_steps",
           "advance", "run_steps", "Edge"]

Edge = Hashable

logger = logging.getLogger(__name__)

# What a rank's own pool says about a gate (``AnchorPool._local_state``), agreed by the ranks before any distance.
_WEIGH, _NO_EDGE, _TOO_FEW, _FAILED = 0, 1, 2, 3
_COLD = {_NO_EDGE: "no_edge", _TOO_FEW: "too_few_anchors"}


@dataclass(frozen=True)
class PoolConfig:
    """Settings of one slot's pool. Changing ``rank`` affects new anchors only."""

    capacity: int = 10
    """Anchors kept (KVCMAS 10, KVCOMM 20); the oldest-least-activated go first."""
    window: int = 5
    """Eviction looks at this many oldest anchors and drops the least activated."""
    tau: float = 0.3
    """Accept a correction when the gate's normalized entropy is <= tau."""
    rank: int | None = 32
    """Rank of stored bases and deltas; None stores full-dimension matrices."""
    temperature: float = 1.0
    """Softmax temperature T of the gate and of the token weights."""
    gate_len: int | None = None
    """Comparison length cap k of the gate (None: the full source length)."""
    activation_mass: float = 0.9
    """An accepted match activates the anchors holding this much gate weight."""
    svd_method: Literal["svd", "randomized", "gram"] = "svd"
    """Truncated SVD flavour used for new anchors."""
    min_anchor_len: int | None = None
    """None: an anchor is eligible only if it covers the whole comparison length (``min(L, gate_len)``).
    An int n: anchors of at least ``min(n, comparison length)`` tokens are eligible; the gate compares
    on the common prefix of the eligible anchors and rows past every anchor stay aligned only."""
    min_edge_anchors: int = MIN_GATE_ANCHORS
    """Anchors holding the edge that the gate needs before it weighs them (at least ``MIN_GATE_ANCHORS``).
    The papers gate at two; the server waits for more because row-wise weights over few anchors give the rows
    of a new content other contents' deltas (``KVShareConfig.edge_anchors``)."""
    step_layers: int | None = None
    """Layers per learning step: ``observation_steps`` factorizes this many layers at a time and yields
    between them (None: every layer in one step). The factors are the same; the server's learner runs one
    step at a time on the idle scheduler, so a request that arrives meanwhile waits for a shorter step."""

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.window < 1:
            raise ValueError("capacity and window must be >= 1")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must lie in [0, 1], got {self.tau}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")
        if self.gate_len is not None and self.gate_len < 1:
            raise ValueError(f"gate_len must be >= 1 or None (whole segment), got {self.gate_len}")
        if self.step_layers is not None and self.step_layers < 1:
            raise ValueError(f"step_layers must be >= 1 or None (all layers in one step), got {self.step_layers}")
        if self.min_edge_anchors < MIN_GATE_ANCHORS:
            raise ValueError(f"min_edge_anchors must be >= {MIN_GATE_ANCHORS}, got {self.min_edge_anchors}")
        if self.min_anchor_len is not None and self.min_anchor_len < 1:
            raise ValueError(f"min_anchor_len must be >= 1 or None (anchors cover the comparison), "
                             f"got {self.min_anchor_len}")


@dataclass(frozen=True)
class PreparedObservation:
    """One dense observation, factorized and ready to attach (``AnchorPool.commit``).

    Built by ``prepare_observation`` without touching any pool. The base is
    None when the caller knew the pool already holds the content (then only
    the deltas were factorized). ``slot`` is filled in by the estimator.
    """

    edge: Edge
    content_key: Hashable | None
    length: int
    delta_k: Factors  # canonical frame
    delta_v: Factors
    base_k: Factors | None = None  # canonical-frame keys of the source
    base_v: Factors | None = None
    base_v_gram: torch.Tensor | None = None  # float64 [L]: cumulative sum_layers ||base_v row||^2 (the gate's Gram term)
    slot: Hashable | None = None


def prepare_observation(spec: RopeSpec, config: PoolConfig, source_k: torch.Tensor, source_v: torch.Tensor,
                        src_pos: int, target_k: torch.Tensor, target_v: torch.Tensor, dst_pos: int, edge: Edge,
                        content_key: Hashable | None = None, with_base: bool = True,
                        between: Callable[[], None] | None = None) -> PreparedObservation:
    """Factorize the exact correction of a dense prefill (the heavy, lock-free half of learning).

    ``target_*`` must come from a real (dense) prefill of the target; the
    source may be an estimate (a chain's previous hop) or dense. Pure: reads
    only its arguments. ``with_base=False`` skips the base's two SVDs when the
    pool already holds ``content_key`` (the commit then attaches the deltas to
    that anchor, or drops them if it was evicted meanwhile). ``between`` is
    called between two factorizations. The server's learner drives
    ``observation_steps`` itself instead (see there).
    """
    return run_steps(observation_steps(spec, config, source_k, source_v, src_pos, target_k, target_v, dst_pos, edge,
                                       content_key, with_base), between)


def observation_steps(spec: RopeSpec, config: PoolConfig, source_k: torch.Tensor, source_v: torch.Tensor,
                      src_pos: int, target_k: torch.Tensor, target_v: torch.Tensor, dst_pos: int, edge: Edge,
                      content_key: Hashable | None = None,
                      with_base: bool = True) -> Generator[None, None, PreparedObservation]:
    """``prepare_observation`` as a generator: it yields between factorizations and returns the result.

    Why a generator: the server's learner resumes each step on a fresh thread
    and waits for a lull in serving between steps on a thread that runs no
    torch op. A thread that has run torch's OpenMP ops slows the scheduler's
    forward for as long as it lives, even asleep (docs/research/PROFILE.md, finding 1b),
    so the pause must not happen inside a step's thread. Arguments are checked
    at the first ``next``.
    """
    if source_k.shape != target_k.shape or source_v.shape != target_v.shape:
        raise ValueError(f"source {tuple(source_k.shape)} and target {tuple(target_k.shape)} "
                         "caches of one segment must have the same shape")
    if not with_base and content_key is None:
        raise ValueError("with_base=False needs the content_key of an anchor the pool holds")
    src_c = to_canonical(source_k, src_pos, spec)
    base = {}
    # NOTE: the order base K, base V, delta K, delta V is kept because randomized SVD draws
    # from torch's RNG: a seeded offline run gets the same factors as before plans existed.
    if with_base:
        base_k = yield from _factorize_steps(src_c, config)
        yield
        base_v = yield from _factorize_steps(source_v, config)
        base = dict(base_k=base_k, base_v=base_v, base_v_gram=base_v.row_sq_norms().cumsum(0))
        yield
    delta_k = yield from _factorize_steps(to_canonical(target_k, dst_pos, spec) - src_c, config)
    del src_c
    yield
    delta_v = yield from _factorize_steps(target_v - source_v, config)
    return PreparedObservation(edge=edge, content_key=content_key, length=int(source_k.shape[1]), delta_k=delta_k,
                               delta_v=delta_v, **base)


def _factorize_steps(x: torch.Tensor, config: PoolConfig) -> Generator[None, None, Factors]:
    """``factorize(x)`` over ``config.step_layers`` layers at a time, yielding between the groups.

    Every layer's truncation is independent of the others, so the stacked
    groups are the factors of the whole (the same rank in every group).
    """
    nl = x.shape[0]
    step = config.step_layers or nl
    if step >= nl:
        return factorize(x, config.rank, config.svd_method)
    parts = []
    for lo in range(0, nl, step):
        if lo:
            yield
        parts.append(factorize(x[lo:lo + step], config.rank, config.svd_method))
    return stack_layer_groups(parts)


def advance(steps: Iterator[None]) -> tuple[bool, Any]:
    """One step of a step iterator: ``(False, None)`` when it paused, ``(True, result)`` when it ended."""
    try:
        next(steps)
    except StopIteration as end:
        return True, end.value
    return False, None


def run_steps(steps: Iterator[None], between: Callable[[], None] | None = None) -> Any:
    """Run a step iterator to its end, calling ``between`` between two steps; returns its result."""
    done, result = advance(steps)
    while not done:
        if between is not None:
            between()
        done, result = advance(steps)
    return result


@dataclass
class Anchor:
    """One dense observation of the slot's content. Mutated only by its pool."""

    id: int
    created: int
    content_key: Hashable | None
    base_k: Factors  # canonical-frame keys of the source
    base_v: Factors
    base_v_gram: torch.Tensor  # float64 [L], see PreparedObservation
    deltas: dict[Edge, tuple[Factors, Factors]] = field(default_factory=dict)
    activations: int = 0

    @property
    def length(self) -> int:
        return self.base_k.length

    def nbytes(self) -> int:
        """Bytes held: factors plus the gate summary."""
        return self.base_k.nbytes() + self.base_v.nbytes() + self.base_v_gram.numel() * 8 + sum(
            dk.nbytes() + dv.nbytes() for dk, dv in self.deltas.values())

    def full_dim_nbytes(self, itemsize: int) -> int:
        """Bytes the same anchor would take stored at full dimension."""
        nl, d = self.base_k.num_layers, self.base_k.head_shape[0] * self.base_k.head_shape[1]
        return (2 + 2 * len(self.deltas)) * factor_nbytes(nl, self.length, d, None, itemsize)


def _by_storage(factors: list[Factors], low: Callable[[list[int]], Any], full: Callable[[list[int]], Any],
                dim: int | tuple[int, ...]) -> Any:
    """Run ``low`` on the indices of the low-rank stacks and ``full`` on the full-dim ones; merge along ``dim``.

    Pools hold one kind unless the rank was changed at runtime, so the common
    case is a single call. ``low``/``full`` return a tensor, or a tuple of
    tensors merged each along its entry of ``dim``.
    """
    full_idx = [i for i, f in enumerate(factors) if f.full is not None]
    low_idx = [i for i, f in enumerate(factors) if f.full is None]
    if not full_idx:
        return low(low_idx)
    if not low_idx:
        return full(full_idx)
    lo, fu = low(low_idx), full(full_idx)

    def merge(a: torch.Tensor, b: torch.Tensor, d: int) -> torch.Tensor:
        order = torch.tensor(low_idx + full_idx).argsort().to(a.device)
        return torch.cat([a, b], dim=d).index_select(d, order)

    if isinstance(lo, tuple):
        return tuple(merge(a, b, d) for a, b, d in zip(lo, fu, dim))
    return merge(lo, fu, dim)


class AnchorPool:
    """Anchors of one slot, with gate, plan, activation and eviction."""

    def __init__(self, spec: RopeSpec, config: PoolConfig | None = None, reducer: Reducer | None = None) -> None:
        """``reducer``: how this rank's distances become the decision of every tensor-parallel rank
        (``rank_reduce``; default one rank, nothing reduced)."""
        self.spec = spec
        self.config = config or PoolConfig()
        self.reducer: Reducer = reducer or LocalReducer()
        self._anchors: list[Anchor] = []
        self._ids = itertools.count()
        self._tick = 0  # observations committed; an anchor's age counts them
        self._bytes = 0

    # ---------------------------------------------------------------- public
    def __len__(self) -> int:
        return len(self._anchors)

    @property
    def anchors(self) -> list[Anchor]:
        """Anchors oldest first (read-only view; do not mutate)."""
        return list(self._anchors)

    def estimate(self, source_k: torch.Tensor, source_v: torch.Tensor, src_pos: int, dst_pos: int,
                 edge: Edge, key: Hashable = None) -> EstimateResult:
        """Gate, and when accepted return the correction plan and count activations.

        Args:
            source_k, source_v: the source cache ``[num_layers, S, kv_heads,
                head_dim]``, keys post-RoPE at positions ``src_pos ..``.
            dst_pos: where the segment starts in the target's context (the
                plan does not depend on it; ``apply`` uses it).
            edge: the key the deltas were recorded under.
            key: names the decision alike on every tensor-parallel rank (the estimator passes the slot).
        Mutates: activation counters of the anchors holding the top
            ``activation_mass`` of the gate weight (accepted only).

        Every tensor-parallel rank takes the same decision: the ranks first agree what each would do
        with its own pool (``Reducer.agree``), then reduce the distances, each reduce carrying whether
        the rank's share failed. No rank leaves a collective to the others. Ways out taken by every rank
        together: ``gate_failed`` (the gate raised on some rank, logged there; pools kept) and
        ``ranks_disagree`` (the ranks' pools of this slot differ; the estimator drops them).
        ``RanksUnreachable`` from the reducer (a missed deadline) passes through.
        """
        cfg = self.config
        size = len(self._anchors)
        try:
            status, eligible, k_len, covered, digest = self._local_state(source_k, source_v, edge)
        except Exception:  # noqa: BLE001 - the ranks fall back together (below)
            logger.exception("sglang-kvshare: the gate failed on this rank; every rank prefills densely")
            status, eligible, k_len, covered, digest = _FAILED, [], 0, 0, 0
        lo, hi = self.reducer.agree(decision_key(key, src_pos, dst_pos), [status, len(eligible), k_len, covered,
                                                                          digest])
        if hi[0] == _FAILED or lo != hi:
            reason = "gate_failed" if hi[0] == _FAILED else "ranks_disagree"
            return EstimateResult(False, reason, compare_len=hi[2], pool_anchors=size, edge_anchors=len(eligible))
        if status != _WEIGH:
            return EstimateResult(False, _COLD[status], compare_len=k_len, pool_anchors=size,
                                  edge_anchors=len(eligible))
        failed = EstimateResult(False, "gate_failed", compare_len=k_len, pool_anchors=size, edge_anchors=len(eligible))
        work = torch.float64 if source_v.dtype == torch.float64 else torch.float32
        nl, n = source_v.shape[0], len(eligible)

        def values() -> list[torch.Tensor]:
            # The gate (first k_len rows) and the value token distances (all covered rows) in one op.
            dist_v, d2 = self._value_distances(eligible, source_v[:, :covered].reshape(nl, covered, -1).to(work),
                                               k_len)
            return [d2, dist_v]

        # Every rank gates on the distances over all heads (squared distances add up, token distances are means).
        reduced = self._together(values, [(n,), (covered, n)])
        if reduced is None:
            return failed
        d2, dist_v = reduced[0], reduced[1] / self.reducer.size
        g, h = gate_from_sq_distances(d2, cfg.temperature)
        ids = [a.id for a in eligible]
        if h > cfg.tau:
            return EstimateResult(False, "gate_rejected", h, compare_len=k_len, pool_anchors=size, anchor_ids=ids,
                                  gate_weights=g)
        bases_k = [a.base_k for a in eligible]
        local: dict[str, Any] = {}

        def keys() -> list[torch.Tensor]:
            local["weights_v"] = self._weights(dist_v, [a.base_v for a in eligible], covered)
            src_kc = to_canonical(source_k[:, :covered], src_pos, self.spec).reshape(nl, covered, -1).to(work)
            return [self._key_distances(src_kc, bases_k)]

        reduced = self._together(keys, [(covered, n)])
        if reduced is None:
            return failed

        def plan() -> list[torch.Tensor]:
            local["plan"] = CorrectionPlan(deltas_k=[a.deltas[edge][0] for a in eligible],
                                           deltas_v=[a.deltas[edge][1] for a in eligible],
                                           weights_k=self._weights(reduced[0] / self.reducer.size, bases_k, covered),
                                           weights_v=local["weights_v"], covered=covered)
            local["active"] = top_mass(g, cfg.activation_mass)
            return []

        if self._together(plan, []) is None:  # the last local step: every rank serves the plan, or none does
            return failed
        for i in local["active"]:
            eligible[i].activations += 1
        return EstimateResult(True, "accepted", h, covered=covered, compare_len=k_len, pool_anchors=size,
                              anchor_ids=ids, gate_weights=g, plan=local["plan"])

    def has_content(self, content_key: Hashable | None) -> bool:
        """True when an anchor of ``content_key`` is held (its base need not be prepared again)."""
        return self._find(content_key) is not None

    def has_delta(self, content_key: Hashable | None, edge: Edge) -> bool:
        """True when the anchor of ``content_key`` already holds a delta for ``edge``.

        Why: a new observation of the same content on the same edge would only
        replace that delta; the learner skips it (the pool has converged there).
        """
        anchor = self._find(content_key)
        return anchor is not None and edge in anchor.deltas

    def commit(self, prepared: PreparedObservation) -> int | None:
        """Attach a prepared observation; returns the anchor id, or None when it was dropped.

        With a ``content_key`` already in the pool the edge is attached to that
        anchor (its base is kept); otherwise a new anchor is made, evicting
        first when the pool is full; a prepared observation without a base
        whose anchor is gone is dropped. Raises ValueError when the content was
        seen with another length (a content-key collision).
        """
        anchor = self._find(prepared.content_key)
        if anchor is None and prepared.base_k is None:
            return None
        if anchor is None:
            while len(self._anchors) >= self.config.capacity:
                self.evict_one()
            anchor = Anchor(id=next(self._ids), created=self._tick, content_key=prepared.content_key,
                            base_k=prepared.base_k, base_v=prepared.base_v, base_v_gram=prepared.base_v_gram)
            self._anchors.append(anchor)
            before = 0
        elif anchor.length != prepared.length:
            raise ValueError(f"content_key {prepared.content_key!r} was seen with length {anchor.length}, "
                             f"now {prepared.length}")
        else:
            before = anchor.nbytes()
        anchor.deltas[prepared.edge] = (prepared.delta_k, prepared.delta_v)
        self._bytes += anchor.nbytes() - before
        self._tick += 1
        return anchor.id

    def add_observation(self, source_k: torch.Tensor, source_v: torch.Tensor, src_pos: int,
                        target_k: torch.Tensor, target_v: torch.Tensor, dst_pos: int, edge: Edge,
                        content_key: Hashable | None = None) -> int:
        """``commit(prepare_observation(...))`` in one call (offline use); returns the anchor id."""
        return self.commit(prepare_observation(self.spec, self.config, source_k, source_v, src_pos, target_k, target_v,
                                               dst_pos, edge, content_key, with_base=not self.has_content(content_key)))

    def set_activations(self, anchor_id: int, activations: int) -> bool:
        """Set an anchor's activation count (a pool reloaded from disk keeps what eviction reads); False when
        no anchor has that id."""
        anchor = next((a for a in self._anchors if a.id == anchor_id), None)
        if anchor is None:
            return False
        anchor.activations = int(activations)
        return True

    def evict_one(self) -> int:
        """Drop the least-activated of the ``window`` oldest anchors (ties: the oldest); returns bytes freed."""
        if not self._anchors:
            return 0
        # NOTE: anchors are kept oldest first, so the window is a prefix.
        victim = min(self._anchors[: self.config.window], key=lambda a: (a.activations, a.created))
        self._anchors.remove(victim)
        freed = victim.nbytes()
        self._bytes -= freed
        return freed

    def describe(self) -> list[dict]:
        """One dict per anchor, oldest first: id, length, age, activations, edges, rank, bytes."""
        return [dict(id=a.id, length=a.length, age=self._tick - a.created, activations=a.activations,
                     edges=[str(e) for e in a.deltas], rank=a.base_k.rank, bytes=a.nbytes(),
                     content_key=None if a.content_key is None else str(a.content_key))
                for a in self._anchors]

    def memory_bytes(self) -> int:
        """Exact bytes of all stored factors and summaries (kept as a running total: O(1))."""
        return self._bytes

    def full_dim_bytes(self) -> int:
        """Bytes the same anchors would take at full dimension (for the report)."""
        return sum(a.full_dim_nbytes(a.base_k.full.element_size() if a.base_k.full is not None
                                     else a.base_k.a.element_size()) for a in self._anchors)

    def reconfigure(self, config: PoolConfig) -> None:
        """New settings (rank: new anchors only); evicts by the usual rule until the pool fits its capacity."""
        self.config = config
        while len(self._anchors) > config.capacity:
            self.evict_one()

    def set_tau(self, tau: float) -> None:
        self.reconfigure(replace(self.config, tau=tau))

    def set_rank(self, rank: int | None) -> None:
        """Rank for anchors added from now on; existing anchors keep theirs."""
        self.reconfigure(replace(self.config, rank=rank))

    def set_capacity(self, capacity: int) -> None:
        """New capacity; evicts by the usual rule until the pool fits."""
        self.reconfigure(replace(self.config, capacity=capacity))

    def reset(self) -> None:
        """Drop every anchor (config kept)."""
        self._anchors.clear()
        self._bytes = 0

    # ------------------------------------------------------------- internals
    def _local_state(self, source_k: torch.Tensor, source_v: torch.Tensor,
                     edge: Edge) -> tuple[int, list[Anchor], int, int, int]:
        """What this rank's pool would do: (status, eligible anchors, comparison length, covered rows, digest).

        The digest covers what every later decision and eviction of this pool reads (ids, lengths, ages,
        activations, edge counts, whether each holds ``edge``): equal on the ranks exactly when their pools
        of this slot are. Edges and content keys are per-rank digests, so only counts and this edge's
        presence enter it.
        """
        cfg = self.config
        s = source_k.shape[1]
        if s == 0 or source_v.shape != source_k.shape or source_k.dim() != 4:
            raise ValueError(f"the source must be a non-empty [layers, S, kv_heads, head_dim] K and V of one shape, "
                             f"got {tuple(source_k.shape)} and {tuple(source_v.shape)}")
        record = ";".join(f"{a.id},{a.length},{a.created},{a.activations},{len(a.deltas)},{int(edge in a.deltas)}"
                          for a in self._anchors)
        digest = zlib.crc32(record.encode())
        k_len = s if cfg.gate_len is None else min(s, cfg.gate_len)
        need = k_len if cfg.min_anchor_len is None else min(k_len, cfg.min_anchor_len)
        long_enough = [a for a in self._anchors if a.length >= need]
        eligible = [a for a in long_enough if edge in a.deltas]
        if len(eligible) < cfg.min_edge_anchors:
            return (_NO_EDGE if len(long_enough) >= cfg.min_edge_anchors else _TOO_FEW), eligible, k_len, 0, digest
        k_len = min(k_len, min(a.length for a in eligible))  # the common prefix (unchanged by default)
        return _WEIGH, eligible, k_len, min(s, max(a.length for a in eligible)), digest

    def _together(self, compute: Callable[[], list[torch.Tensor]],
                  shapes: list[tuple[int, ...]]) -> list[torch.Tensor] | None:
        """``compute()``'s tensors summed over the ranks, or None on every rank when it raised on any.

        ``shapes``: those of the tensors, agreed by the ranks beforehand; a rank whose ``compute`` raised
        sends zeros of them. One reduce carries the tensors and the failure flag.
        """
        try:
            parts = compute()
            if [tuple(p.shape) for p in parts] != [tuple(sh) for sh in shapes]:
                raise RuntimeError(f"gate tensors {[tuple(p.shape) for p in parts]}, agreed {shapes}")
        except Exception:  # noqa: BLE001 - the ranks fall back together
            logger.exception("sglang-kvshare: the gate failed on this rank; every rank prefills densely")
            parts = None
        if self.reducer.size == 1:
            return parts
        chunks = ([torch.zeros(math.prod(sh), dtype=torch.float64) for sh in shapes] if parts is None
                  else [p.detach().to("cpu", torch.float64).reshape(-1) for p in parts])
        flat = self.reducer.sum(torch.cat(chunks + [torch.tensor([float(parts is None)], dtype=torch.float64)]),
                                shape_agreed=True)
        if flat[-1] > 0:
            return None
        out, at = [], 0
        for p in parts:
            out.append(flat[at:at + p.numel()].reshape(p.shape).to(device=p.device, dtype=p.dtype))
            at += p.numel()
        return out

    def _find(self, content_key: Hashable | None) -> Anchor | None:
        if content_key is None:
            return None
        return next((a for a in self._anchors if a.content_key == content_key), None)

    @staticmethod
    def _value_distances(anchors: list[Anchor], x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token distances fp32 [covered, V] of x's rows, the gate's sum_layers ||x[:k] - base_v[:k]||^2 fp32 [V]).

        x [layers, covered, D]. Low-rank bases: ``token_gate_distances`` (on a GPU the
        gate uses the cached Gram term, no base is reconstructed); full-dimension
        bases: direct differences.
        """
        covered = x.shape[1]

        def low(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = stack_factors([anchors[i].base_v for i in idx], 0, covered)
            return token_gate_distances(x, a, b, k, torch.stack([anchors[i].base_v_gram[k - 1] for i in idx]))

        def full(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            dense = [anchors[i].base_v.full for i in idx]
            return token_distances_dense(x, dense), gate_sq_distances_dense(x[:, :k], dense)

        return _by_storage([a.base_v for a in anchors], low, full, dim=(1, 0))

    @staticmethod
    def _key_distances(x: torch.Tensor, bases: list[Factors]) -> torch.Tensor:
        """Token distances fp32 [covered, V] of canonical-frame keys x [layers, covered, D] to the key bases."""
        covered = x.shape[1]

        def low(idx: list[int]) -> torch.Tensor:
            return token_distances(x, *stack_factors([bases[i] for i in idx], 0, covered))

        return _by_storage(bases, low, lambda idx: token_distances_dense(x, [bases[i].full for i in idx]), dim=1)

    def _weights(self, dist: torch.Tensor, bases: list[Factors], covered: int) -> torch.Tensor:
        """``w[t, v] = softmax_v(-dist[t, v] / T)`` over the anchors covering t; fp32 [covered, V]."""
        lengths = torch.tensor([min(b.length, covered) for b in bases], device=dist.device)
        return token_weights(dist, self.config.temperature, lengths)
