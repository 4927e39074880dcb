"""What an estimator decides for one edge: the result, and the correction plan when accepted.

Why a plan instead of K/V: the estimator chooses anchors and per-token weights
(small), and one ops layer (``sglang_kvshare.kernels``: the fused Triton kernel
on CUDA, its torch twin elsewhere) turns the plan into K/V, for the serving
cache's pool writes (``apply.plan_kernel_args``) and for the offline harness
(``apply.materialize``) alike. Nothing builds corrected K/V twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .low_rank import Factors

__all__ = ["CorrectionPlan", "EstimateResult"]


@dataclass
class CorrectionPlan:
    """What an accepted estimate adds to the re-aligned source, per chosen anchor, for one edge.

    Row ``t < covered`` of the target is
    ``Align(source)[t] + sum_v weights[t, v] * delta_v[t]`` (keys: the delta is
    in the canonical frame and rotated to the target's positions), separately
    for K and V; rows ``[covered, L)`` are the aligned source only.

    The factors are the anchors' own stored tensors (shared, never mutated):
    a plan stays valid after its anchors are evicted.
    """

    deltas_k: list[Factors]
    """Canonical-frame key deltas, one per chosen anchor (lengths may differ; zero past each)."""
    deltas_v: list[Factors]
    weights_k: torch.Tensor
    """``[covered, Vn]`` fp32; row t sums to 1 over the anchors covering t, 0 on the others."""
    weights_v: torch.Tensor
    covered: int
    """Rows ``[0, covered)`` get the correction; the rest is aligned only."""

    def __post_init__(self) -> None:
        vn = len(self.deltas_k)
        if vn == 0 or len(self.deltas_v) != vn:
            raise ValueError(f"a plan needs the same number (>= 1) of key and value deltas, got "
                             f"{len(self.deltas_k)} and {len(self.deltas_v)}")
        for name, w in (("weights_k", self.weights_k), ("weights_v", self.weights_v)):
            if w.shape != (self.covered, vn):
                raise ValueError(f"{name} must be [covered={self.covered}, Vn={vn}], got {tuple(w.shape)}")

    @property
    def num_anchors(self) -> int:
        return len(self.deltas_k)


MIN_GATE_ANCHORS = 2  # a gate weighs anchors against each other: it needs two that hold the edge


@dataclass
class EstimateResult:
    """What an estimator decided for one edge.

    ``reason``: ``accepted`` (anchor correction), ``aligned`` (fullshared:
    alignment only), ``needs_recompute`` (cacheblend: aligned, the caller
    recomputes some tokens), or a rejection: ``too_few_anchors``, ``no_edge``,
    ``gate_rejected``. ``plan`` is set only for ``accepted``; an accepted result
    with ``plan=None`` means alignment only.
    """

    accepted: bool
    reason: str
    entropy: float | None = None
    covered: int = 0
    compare_len: int = 0
    pool_anchors: int = 0
    """Anchors in the slot's pool when deciding (0 for modes without pools)."""
    edge_anchors: int = 0
    """Of those, anchors long enough that hold a delta for this edge: the gate needs ``MIN_GATE_ANCHORS``."""
    anchor_ids: list[int] = field(default_factory=list)
    """Ids of the anchors the gate compared (the plan's anchors, in order, when accepted)."""
    gate_weights: torch.Tensor | None = None  # [V] fp32
    plan: CorrectionPlan | None = None
