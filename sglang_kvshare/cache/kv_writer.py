"""Writes resolved segments into SGLang's KV pool through the kernels dispatcher.

Why: the dispatcher (``sglang_kvshare.kernels``) is the only way the cache
reaches the correction math, so a CUDA server runs the fused Triton kernel
(gather source rows, rotate keys, add the token-weighted low-rank deltas,
scatter into fresh slots) and a CPU server its torch twin, with the same
result. The correction plan comes from the estimator as it is
(``correction.plan_kernel_args`` turns it into kernel arguments; no
transposes or copies here). Alignment-only segments never leave the pool:
rows go from source slots to destination slots in one pass per layer.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sglang_kvshare.cache.kv_pool_io import pool_layers
from sglang_kvshare.correction import CorrectionPlan, plan_kernel_args
from sglang_kvshare.kernels import align_correct_scatter_layers


def write_resolved(kvcache, spec, *, src_idx: torch.Tensor, dst_idx: torch.Tensor, src_start: int,
                   dst_start: int, lo: int, hi: int, correction: Optional[CorrectionPlan] = None,
                   backend: str = "auto") -> None:
    """Write rows ``[lo, hi)`` of a segment (source at ``src_start``, target at ``dst_start``).

    ``src_idx`` holds the source's pool slots for the whole segment; ``dst_idx``
    the ``hi - lo`` fresh slots. Keys are re-rotated; with ``correction`` the
    weighted deltas are added on the rows the anchors cover. Mutates the pool
    rows ``dst_idx`` of every layer.
    """
    layers = pool_layers(kvcache)
    k_bufs = [kvcache.get_key_buffer(layer) for layer in layers]
    v_bufs = [kvcache.get_value_buffer(layer) for layer in layers]
    # NOTE: rows [lo, hi) keep the segment's starts: the kernel rotates source rows by
    # dst_start - src_start and canonical delta rows by dst_start, neither depends on lo.
    kwargs: dict[str, Any] = dict(src_start=src_start, dst_start=dst_start, inv_freq=spec.inv_freq,
                                  rotary_dim=spec.rotary_dim, layout=spec.layout,
                                  **plan_kernel_args(correction, lo, hi, k_bufs[0].dtype))
    align_correct_scatter_layers(k_bufs, v_bufs, src_idx[lo:hi].to(torch.int64), dst_idx.to(torch.int64),
                                 backend=backend, **kwargs)
