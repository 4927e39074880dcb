"""Writes resolved segments into SGLang's KV pool through the kernels dispatcher.

Why: the dispatcher (``sglang_kvshare.kernels``) is the only way the cache
reaches the correction math, so a CUDA server runs the fused Triton kernel
(gather source rows, rotate keys, add the token-weighted low-rank deltas,
scatter into fresh slots) and a CPU server its torch reference, with the same
result. Alignment-only segments never leave the pool: rows go from source
slots to destination slots in one pass per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from sglang_kvshare.cache.kv_pool_io import pool_layers
from sglang_kvshare.kernels import align_correct_scatter_layers


@dataclass
class Correction:
    """What an accepted gate decision adds: per-anchor deltas and per-token weights."""

    deltas_k: list  # Factors per chosen anchor (canonical-frame keys)
    deltas_v: list
    weights_k: torch.Tensor  # [Vn, covered]
    weights_v: torch.Tensor
    covered: int


def _stack_terms(deltas: list, covered: int, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Rows [lo, hi) of every anchor's delta, zero-padded past its own length."""
    ranks = {f.rank for f in deltas}
    if len(ranks) == 1 and None not in ranks:
        a = torch.stack([F.pad(f.a, (0, 0, 0, max(covered - f.a.shape[1], 0)))[:, lo:hi] for f in deltas], dim=1)
        b = torch.stack([f.b for f in deltas], dim=1)
        return {"A": a, "B": b}
    # Mixed or full ranks: hand the reconstructed matrices to the dense path.
    mats = [F.pad(f.matrix(min(f.length, covered)), (0, 0, 0, max(covered - f.length, 0)))[:, lo:hi]
            for f in deltas]
    return {"delta": torch.stack(mats, dim=1)}


def write_resolved(kvcache, spec, *, src_idx: torch.Tensor, dst_idx: torch.Tensor, src_start: int,
                   dst_start: int, lo: int, hi: int, correction: Optional[Correction] = None,
                   backend: str = "auto") -> None:
    """Write rows ``[lo, hi)`` of a segment (source at ``src_start``, target at ``dst_start``).

    ``src_idx`` holds the source's pool slots for the whole segment; ``dst_idx``
    the ``hi - lo`` fresh slots. Keys are re-rotated; with ``correction`` the
    weighted deltas are added on the rows the anchors cover.
    """
    layers = pool_layers(kvcache)
    k_bufs = [kvcache.get_key_buffer(layer) for layer in layers]
    v_bufs = [kvcache.get_value_buffer(layer) for layer in layers]
    # NOTE: rows [lo, hi) keep the segment's starts: the kernel rotates source rows by
    # dst_start - src_start and canonical delta rows by dst_start, neither depends on lo.
    kwargs: dict[str, Any] = dict(src_start=src_start, dst_start=dst_start, inv_freq=spec.inv_freq,
                                  rotary_dim=spec.rotary_dim, layout=spec.layout)
    if correction is not None and correction.covered > lo:
        c_hi = min(correction.covered, hi)
        k_terms = _stack_terms(correction.deltas_k, correction.covered, lo, c_hi)
        v_terms = _stack_terms(correction.deltas_v, correction.covered, lo, c_hi)
        kwargs.update(covered=c_hi - lo,
                      k_w=correction.weights_k[:, lo:c_hi].T.contiguous().float(),
                      v_w=correction.weights_v[:, lo:c_hi].T.contiguous().float())
        for prefix, terms in (("k_", k_terms), ("v_", v_terms)):
            for name, tensor in terms.items():
                kwargs[prefix + name] = list(tensor.to(k_bufs[0].dtype if name != "delta" else torch.float32))
    align_correct_scatter_layers(k_bufs, v_bufs, src_idx[lo:hi].to(torch.int64), dst_idx.to(torch.int64),
                                 backend=backend, **kwargs)
