"""CacheBlend-style selective recompute: the token selection and the merge.

Reuse the aligned source cache; recompute layers ``0 .. check_layer`` for all
tokens of the segment; at ``check_layer`` compare the recomputed K (or V) with
the reused one, pick the ``ratio`` of tokens that deviate most, and recompute
only those tokens through the later layers, writing their fresh K/V over the
reused rows. The model forward that produces the recomputed rows belongs to
the caller (it needs the engine's attention); these helpers are the math.
"""

from __future__ import annotations

import math

import torch

__all__ = ["token_deviation", "select_tokens", "merge_rows"]


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


def merge_rows(reused: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Copy of ``reused`` ``[L, ...]`` with rows ``idx`` replaced by ``rows`` ``[len(idx), ...]``."""
    out = reused.clone()
    out[idx] = rows.to(out.dtype)
    return out
