"""The anchor pool of one slot (ALGORITHM.md 3.1 - 3.3).

An anchor is one dense observation of the slot's content: a **base** (the
source cache the correction starts from, keys in the canonical frame, values
as is) and, per edge seen on that content, the exact correction
``Delta = C_target - Align(C_source)`` (keys canonical). Bases and deltas are
stored as rank-``r`` factors (``rank=None``: full dimension).

For a new source cache the pool gates on values (normalized entropy of
``softmax(-d/T)`` against ``tau``), then interpolates the stored deltas with
per-token weights (separately for K and V) and returns the target estimate

    K_hat = rotate(K_src, dst_pos - src_pos) + rotate(Delta_hat_k, dst_pos)
    V_hat = V_src + Delta_hat_v

on the longest prefix the eligible anchors cover (never extrapolated).

Edges are opaque hashable keys; the estimator decides what they are
(``(source_agent, target_agent)`` for KVCMAS, ``("ref", target)`` for KVCOMM).

Shapes: every cache is ``[num_layers, L, kv_heads, head_dim]``; keys post-RoPE
at their absolute positions. Not thread-safe: the caller serializes access.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Hashable, Literal

import torch

from .gate import gate_weights, normalized_entropy, token_weights, top_mass
from .low_rank import Factors, factor_nbytes, factorize
from .rope import RopeSpec, from_canonical, rotate_keys, to_canonical

__all__ = ["Anchor", "AnchorPool", "EstimateResult", "PoolConfig", "Edge"]

Edge = Hashable


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
    svd_method: Literal["svd", "randomized"] = "svd"
    """Truncated SVD flavour used for new anchors."""

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.window < 1:
            raise ValueError("capacity and window must be >= 1")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must lie in [0, 1], got {self.tau}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")


@dataclass
class Anchor:
    """One dense observation of the slot's content. Mutated only by its pool."""

    id: int
    created: int
    content_key: Hashable | None
    base_k: Factors  # canonical-frame keys of the source
    base_v: Factors
    deltas: dict[Edge, tuple[Factors, Factors]] = field(default_factory=dict)
    activations: int = 0

    @property
    def length(self) -> int:
        return self.base_k.length

    def nbytes(self) -> int:
        return self.base_k.nbytes() + self.base_v.nbytes() + sum(
            dk.nbytes() + dv.nbytes() for dk, dv in self.deltas.values())

    def full_dim_nbytes(self, itemsize: int) -> int:
        """Bytes the same anchor would take stored at full dimension."""
        nl, d = self.base_k.num_layers, self.base_k.head_shape[0] * self.base_k.head_shape[1]
        return (2 + 2 * len(self.deltas)) * factor_nbytes(nl, self.length, d, None, itemsize)


@dataclass
class EstimateResult:
    """What the pool decided for one edge, and the estimate when accepted.

    ``reason`` is one of ``accepted``, ``gate_rejected``, ``too_few_anchors``,
    ``no_edge``. ``k``/``v`` are ``[num_layers, S, kv_heads, head_dim]`` at the
    target positions (None when rejected or when only deciding); rows past
    ``covered`` are the aligned source, uncorrected.
    """

    accepted: bool
    reason: str
    entropy: float | None = None
    covered: int = 0
    compare_len: int = 0
    anchor_ids: list[int] = field(default_factory=list)
    gate_weights: torch.Tensor | None = None  # [V] float64
    token_weights_k: torch.Tensor | None = None  # [V, covered]
    token_weights_v: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None


class AnchorPool:
    """Anchors of one slot, with gate, estimate, activation and eviction."""

    def __init__(self, spec: RopeSpec, config: PoolConfig | None = None) -> None:
        self.spec = spec
        self.config = config or PoolConfig()
        self._anchors: list[Anchor] = []
        self._ids = itertools.count()
        self._tick = 0  # observations made; an anchor's age counts them

    # ---------------------------------------------------------------- public
    def __len__(self) -> int:
        return len(self._anchors)

    @property
    def anchors(self) -> list[Anchor]:
        """Anchors oldest first (read-only view; do not mutate)."""
        return list(self._anchors)

    def decide(self, source_k: torch.Tensor, source_v: torch.Tensor, src_pos: int, dst_pos: int,
               edge: Edge) -> EstimateResult:
        """Run the gate only; no estimate is built and nothing is mutated."""
        return self._run(source_k, source_v, src_pos, dst_pos, edge, build=False)

    def estimate(self, source_k: torch.Tensor, source_v: torch.Tensor, src_pos: int, dst_pos: int,
                 edge: Edge) -> EstimateResult:
        """Gate, and when accepted build the target's K/V and count activations.

        Args:
            source_k, source_v: the source cache ``[num_layers, S, kv_heads,
                head_dim]``, keys post-RoPE at positions ``src_pos ..``.
            dst_pos: where the segment starts in the target's context.
            edge: the key the deltas were recorded under.
        Mutates: activation counters of the anchors holding the top
            ``activation_mass`` of the gate weight (accepted only).
        """
        return self._run(source_k, source_v, src_pos, dst_pos, edge, build=True)

    def add_observation(self, source_k: torch.Tensor, source_v: torch.Tensor, src_pos: int,
                        target_k: torch.Tensor, target_v: torch.Tensor, dst_pos: int, edge: Edge,
                        content_key: Hashable | None = None) -> int:
        """Record the exact correction of a dense prefill; returns the anchor id.

        ``target_*`` must come from a real (dense) prefill of the target; the
        source may be an estimate (a chain's previous hop) or dense. With a
        ``content_key`` already in the pool the edge is attached to that anchor
        (its base is kept); otherwise a new anchor is made, evicting first when
        the pool is full.
        """
        if source_k.shape != target_k.shape or source_v.shape != target_v.shape:
            raise ValueError(f"source {tuple(source_k.shape)} and target {tuple(target_k.shape)} "
                             "caches of one segment must have the same shape")
        src_c = to_canonical(source_k, src_pos, self.spec)
        dk = to_canonical(target_k, dst_pos, self.spec) - src_c
        dv = target_v - source_v
        cfg = self.config
        anchor = self._find(content_key)
        if anchor is None:
            while len(self._anchors) >= cfg.capacity:
                self._evict_one()
            anchor = Anchor(
                id=next(self._ids), created=self._tick, content_key=content_key,
                base_k=factorize(src_c, cfg.rank, cfg.svd_method),
                base_v=factorize(source_v, cfg.rank, cfg.svd_method))
            self._anchors.append(anchor)
        elif anchor.length != source_k.shape[1]:
            raise ValueError(f"content_key {content_key!r} was seen with length {anchor.length}, "
                             f"now {source_k.shape[1]}")
        anchor.deltas[edge] = (factorize(dk, cfg.rank, cfg.svd_method), factorize(dv, cfg.rank, cfg.svd_method))
        self._tick += 1
        return anchor.id

    def describe(self) -> list[dict]:
        """One dict per anchor, oldest first: id, length, age, activations, edges, rank, bytes."""
        return [dict(id=a.id, length=a.length, age=self._tick - a.created, activations=a.activations,
                     edges=[str(e) for e in a.deltas], rank=a.base_k.rank, bytes=a.nbytes(),
                     content_key=None if a.content_key is None else str(a.content_key))
                for a in self._anchors]

    def memory_bytes(self) -> int:
        """Exact bytes of all stored factors."""
        return sum(a.nbytes() for a in self._anchors)

    def full_dim_bytes(self) -> int:
        """Bytes the same anchors would take at full dimension (for the report)."""
        return sum(a.full_dim_nbytes(a.base_k.full.element_size() if a.base_k.full is not None
                                     else a.base_k.a.element_size()) for a in self._anchors)

    def set_tau(self, tau: float) -> None:
        self.config = replace(self.config, tau=tau)

    def set_rank(self, rank: int | None) -> None:
        """Rank for anchors added from now on; existing anchors keep theirs."""
        self.config = replace(self.config, rank=rank)

    def set_capacity(self, capacity: int) -> None:
        """New capacity; evicts by the usual rule until the pool fits."""
        self.config = replace(self.config, capacity=capacity)
        while len(self._anchors) > capacity:
            self._evict_one()

    def reset(self) -> None:
        """Drop every anchor (config kept)."""
        self._anchors.clear()

    # ------------------------------------------------------------- internals
    def _find(self, content_key: Hashable | None) -> Anchor | None:
        if content_key is None:
            return None
        return next((a for a in self._anchors if a.content_key == content_key), None)

    def _evict_one(self) -> Anchor:
        # NOTE: anchors are kept oldest first, so the window is a prefix.
        window = self._anchors[: self.config.window]
        victim = min(window, key=lambda a: (a.activations, a.created))
        self._anchors.remove(victim)
        return victim

    def _run(self, source_k, source_v, src_pos, dst_pos, edge, build: bool) -> EstimateResult:
        cfg = self.config
        s = source_k.shape[1]
        k_len = s if cfg.gate_len is None else min(s, cfg.gate_len)
        long_enough = [a for a in self._anchors if a.length >= k_len]
        eligible = [a for a in long_enough if edge in a.deltas]
        if len(eligible) < 2:
            reason = "no_edge" if len(long_enough) >= 2 else "too_few_anchors"
            return EstimateResult(False, reason, compare_len=k_len)
        work = torch.float32 if source_v.dtype in (torch.float16, torch.bfloat16) else source_v.dtype
        src_v = source_v.to(work)
        nl = source_v.shape[0]
        v_flat = src_v[:, :k_len].reshape(nl, k_len, -1)
        d = torch.stack([(v_flat - a.base_v.matrix(k_len, work)).pow(2).sum().sqrt() for a in eligible])
        g = gate_weights(d, cfg.temperature)
        h = normalized_entropy(g)
        ids = [a.id for a in eligible]
        if h > cfg.tau:
            return EstimateResult(False, "gate_rejected", h, compare_len=k_len, anchor_ids=ids, gate_weights=g)
        covered = min(s, max(a.length for a in eligible))
        result = EstimateResult(True, "accepted", h, covered=covered, compare_len=k_len, anchor_ids=ids,
                                gate_weights=g)
        if not build:
            return result
        for i in top_mass(g, cfg.activation_mass):
            eligible[i].activations += 1
        src_kc = to_canonical(source_k, src_pos, self.spec).to(work)
        wk = self._token_weights(src_kc, [a.base_k for a in eligible], covered, work)
        wv = self._token_weights(src_v, [a.base_v for a in eligible], covered, work)
        dk_hat = self._mix([a.deltas[edge][0] for a in eligible], wk, covered, work)
        dv_hat = self._mix([a.deltas[edge][1] for a in eligible], wv, covered, work)
        k_hat = rotate_keys(source_k, dst_pos - src_pos, self.spec).to(work)
        k_hat[:, :covered] += from_canonical(dk_hat.view(nl, covered, *source_k.shape[2:]), dst_pos, self.spec)
        v_hat = src_v.clone()
        v_hat[:, :covered] += dv_hat.view(nl, covered, *source_v.shape[2:])
        result.k, result.v = k_hat.to(source_k.dtype), v_hat.to(source_v.dtype)
        result.token_weights_k, result.token_weights_v = wk, wv
        return result

    def _token_weights(self, src: torch.Tensor, bases: list[Factors], covered: int, work) -> torch.Tensor:
        """``w_v(t) = softmax_v(-mean|src[t] - base_v[t]| / T)`` over anchors covering t."""
        nl = src.shape[0]
        flat = src[:, :covered].reshape(nl, covered, -1)
        err = torch.zeros(len(bases), covered, dtype=torch.float32, device=src.device)
        valid = torch.zeros(len(bases), covered, dtype=torch.bool, device=src.device)
        for i, base in enumerate(bases):
            n = min(base.length, covered)
            err[i, :n] = (flat[:, :n] - base.matrix(n, work)).abs().mean(dim=(0, 2)).float()
            valid[i, :n] = True
        return token_weights(err, valid, self.config.temperature)

    @staticmethod
    def _mix(deltas: list[Factors], w: torch.Tensor, covered: int, work) -> torch.Tensor:
        """``sum_v w_v(t) * Delta_v[t]`` as ``[num_layers, covered, D]``."""
        out = None
        for i, delta in enumerate(deltas):
            n = min(delta.length, covered)
            part = delta.matrix(n, work) * w[i, :n].to(work)[None, :, None]
            if out is None:
                out = torch.zeros(part.shape[0], covered, part.shape[2], dtype=work, device=part.device)
            out[:, :n] += part
        return out
