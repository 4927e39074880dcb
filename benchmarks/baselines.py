"""The offline baselines the fidelity benchmarks compare against; the server never runs them.

* ``kvcomm``: KVCOMM's anchors, full dimension, keyed by target only, against a
  context-free reference prefill of each content (the extra prefill that keeps
  it from being served here);
* ``kvcmas_fullrank`` / ``kvcmas_nonchained``: KVCMAS ablations (no low-rank
  truncation; corrections from the first agent's copy instead of the chain);
* ``cacheblend``: the aligned source plus CacheBlend's selective recompute
  (the ``ratio`` of tokens whose K (or V) deviates most at ``check_layer``),
  with the token selection below; the forward that recomputes the
  rows is ``benchmarks.common.partial_recompute``.

They build on the package's ``AnchorEstimator`` and ``FullShared``, so the
baselines and the served modes share one anchor-pool and gate implementation.
``make_estimator`` builds served modes and baselines alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from sglang_kvshare.correction import ESTIMATORS as SERVED
from sglang_kvshare.correction import Estimator, FullShared, RopeSpec, anchor_factory
from sglang_kvshare.correction import make_estimator as served_make_estimator

REFERENCE_AGENT = "ref"  # the "agent" of a context-free reference prefill (KVCOMM)


def _pair(src, dst):
    return (src, dst)


def _by_target(src, dst):
    return (REFERENCE_AGENT, dst)


@dataclass(frozen=True)
class CacheBlendConfig:
    ratio: float = 0.15
    """Fraction of the segment's tokens recomputed through the later layers."""
    check_layer: int = 1
    """Layers ``0 .. check_layer`` are recomputed for every token; the
    deviation at ``check_layer`` picks the tokens recomputed after it."""
    criterion: Literal["k", "v"] = "k"


class CacheBlend(FullShared):
    """Aligned source plus selective recompute; the model forward is the caller's."""

    name = "cacheblend"

    def __init__(self, spec: RopeSpec, config: CacheBlendConfig | None = None) -> None:
        super().__init__(spec)
        self.config = config or CacheBlendConfig()

    def estimate(self, slot, source, dst_agent, dst_pos):
        res = super().estimate(slot, source, dst_agent, dst_pos)
        res.reason = "needs_recompute"
        return res


def _cacheblend(spec: RopeSpec, **cfg) -> CacheBlend:
    return CacheBlend(spec, CacheBlendConfig(**cfg))


ESTIMATORS: dict[str, Callable[..., Estimator]] = {
    **SERVED,
    "kvcomm": anchor_factory("kvcomm", "reference", _by_target, 20, None),
    "kvcmas_fullrank": anchor_factory("kvcmas_fullrank", "previous", _pair, 10, None),
    "kvcmas_nonchained": anchor_factory("kvcmas_nonchained", "first", _pair, 10, 32),
    "cacheblend": _cacheblend,
}


def make_estimator(name: str, spec: RopeSpec, **cfg) -> Estimator:
    """A served mode or a baseline by name; ``cfg`` as the mode's config takes it."""
    return served_make_estimator(name, spec, modes=ESTIMATORS, **cfg)


# ------------------------------------------------------------------ CacheBlend's selection
def token_deviation(recomputed: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """Per-token L2 distance ``[L]`` between two ``[L, kv_heads, head_dim]`` (or ``[L, D]``) tensors."""
    if recomputed.shape != reused.shape:
        raise ValueError(f"shapes differ: {tuple(recomputed.shape)} vs {tuple(reused.shape)}")
    diff = (recomputed.float() - reused.float()).reshape(recomputed.shape[0], -1)
    return diff.norm(dim=1)


def select_tokens(deviation: torch.Tensor, ratio: float = 0.15) -> torch.Tensor:
    """Indices (sorted ascending, LongTensor) of the ``ceil(ratio * L)`` most deviating tokens."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    n = max(1, math.ceil(ratio * deviation.numel()))
    return torch.topk(deviation, n).indices.sort().values

