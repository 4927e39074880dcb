"""Which anchors an accepted match activates (ALGORITHM.md 3.1).

The gate's distances, softmax and entropy and the per-token weights are
``sglang_kvshare.kernels`` ops (``gate_sq_distances``, ``gate_from_sq_distances``,
``token_distances``, ``token_weights``); only the activation rule lives here.
"""

from __future__ import annotations

import torch

__all__ = ["top_mass"]


def top_mass(g: torch.Tensor, mass: float = 0.9) -> list[int]:
    """Indices of the fewest anchors whose weights sum to at least ``mass``."""
    order = torch.argsort(g, descending=True)
    cum = torch.cumsum(g[order].double(), dim=0)
    n = int((cum < mass - 1e-12).sum().item()) + 1
    return order[: min(n, g.numel())].tolist()
