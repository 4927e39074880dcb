"""The reliability gate and the interpolation weights (ALGORITHM.md 3.2, 3.3).

Pure functions on small tensors; the anchor pool feeds them distances.
"""

from __future__ import annotations

import math

import torch

__all__ = ["gate_weights", "normalized_entropy", "token_weights", "top_mass"]


def gate_weights(distances: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``g_v = softmax_v(-d_v / T)`` over a float ``[V]`` tensor of distances."""
    return torch.softmax(-distances.double() / temperature, dim=0)


def normalized_entropy(g: torch.Tensor) -> float:
    """``-sum g log2 g / log2(V)`` in [0, 1]; 1.0 for a uniform ``g``.

    Undefined for fewer than two anchors (the gate rejects those first).
    """
    n = g.numel()
    if n < 2:
        raise ValueError("normalized entropy needs at least two anchors")
    g = g.double()
    h = -(g * torch.log2(g.clamp_min(1e-300))).sum().item()
    return max(0.0, min(1.0, h / math.log2(n)))


def token_weights(errors: torch.Tensor, valid: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token softmax over anchors.

    Args:
        errors: ``[V, L]`` mean absolute difference between the new source and
            each anchor's base, per token.
        valid: bool ``[V, L]``; False where the anchor does not cover the token.
            Every column must have at least one valid anchor.
    Returns: ``[V, L]`` float32 weights, zero on invalid entries, columns sum to 1.
    """
    logits = (-errors.float() / temperature).masked_fill(~valid, float("-inf"))
    return torch.softmax(logits, dim=0)


def top_mass(g: torch.Tensor, mass: float = 0.9) -> list[int]:
    """Indices of the fewest anchors whose weights sum to at least ``mass``."""
    order = torch.argsort(g, descending=True)
    cum = torch.cumsum(g[order], dim=0)
    n = int((cum < mass - 1e-12).sum().item()) + 1
    return order[: min(n, g.numel())].tolist()
