"""Turn a correction plan into K/V through the kernels' dispatcher (the one ops layer).

``plan_kernel_args`` gives the keyword arguments of
``kernels.align_correct_scatter_layers`` for rows ``[lo, hi)`` of a segment:
the serving cache writes pool rows with it. ``materialize`` runs the same
dispatcher on temporary pool-shaped buffers and returns the corrected K/V: the
offline harness uses it. Both therefore compute exactly what serving computes
(fused Triton kernel on CUDA, its torch twin on CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_kvshare.kernels import Backend, align_correct_scatter_layers

from .low_rank import Factors, stack_dense, stack_factors
from .plan import CorrectionPlan
from .rope import RopeSpec

__all__ = ["plan_kernel_args", "materialize"]


def _rows(deltas: list[Factors], lo: int, hi: int, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Rows [lo, hi) of every anchor's delta, per layer first: low-rank A/B, or dense when any anchor is full-dim."""
    if all(f.full is None for f in deltas):
        a, b = stack_factors(deltas, lo, hi, dtype)
        return {"A": a.transpose(0, 1), "B": b.transpose(0, 1)}  # [layers, Vn, ...] views
    return {"delta": stack_dense(deltas, lo, hi, dtype or torch.float32).transpose(0, 1)}


def plan_kernel_args(plan: CorrectionPlan | None, lo: int, hi: int,
                     dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Keyword arguments of ``align_correct_scatter_layers`` for segment rows ``[lo, hi)``.

    Pass them together with ``src_idx[lo:hi]`` / ``dst_idx`` (the ``hi - lo``
    rows) and the segment's own ``src_start``/``dst_start`` (unchanged: the
    kernel rotates source rows by ``dst_start - src_start`` and canonical
    delta rows by ``dst_start``, neither depends on ``lo``). Returns
    ``{covered, k_w, v_w}`` plus ``k_A, k_B, v_A, v_B`` (stacked
    ``[layers, Vn, rows, r]`` / ``[layers, Vn, r, D]``, ``dtype`` or as stored)
    or ``k_delta, v_delta`` (``[layers, Vn, rows, D]``, ``dtype`` or fp32, when
    an anchor is stored at full dimension); ``{}`` (alignment only) when
    ``plan`` is None or covers nothing in ``[lo, hi)``. Pure; the tensors are on
    the plan's device.
    """
    if plan is None or plan.covered <= lo or hi <= lo:
        return {}
    c_hi = min(plan.covered, hi)
    args: dict[str, Any] = {"covered": c_hi - lo,
                            "k_w": plan.weights_k[lo:c_hi].to(torch.float32).contiguous(),
                            "v_w": plan.weights_v[lo:c_hi].to(torch.float32).contiguous()}
    for prefix, deltas in (("k_", plan.deltas_k), ("v_", plan.deltas_v)):
        args.update({prefix + name: t for name, t in _rows(deltas, lo, c_hi, dtype).items()})
    return args


def materialize(source_k: torch.Tensor, source_v: torch.Tensor, src_pos: int, dst_pos: int,
                plan: CorrectionPlan | None, spec: RopeSpec, backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The target's K/V for a whole segment: the source re-aligned to ``dst_pos`` plus the plan's correction.

    ``source_k``/``source_v``: ``[num_layers, L, kv_heads, head_dim]``, keys
    post-RoPE at ``src_pos ..``. Returns new tensors of the same shape and
    dtype (keys at ``dst_pos ..``); ``plan=None`` aligns only. Runs the
    dispatcher on the source as a pool (rows ``0 .. L-1``) into fresh buffers.
    """
    if source_k.shape != source_v.shape or source_k.dim() != 4:
        raise ValueError(f"source K and V must both be [layers, L, kv_heads, head_dim], got "
                         f"{tuple(source_k.shape)} and {tuple(source_v.shape)}")
    src_k, src_v = source_k.contiguous(), source_v.contiguous()
    out_k, out_v = torch.empty_like(src_k), torch.empty_like(src_v)
    length = src_k.shape[1]
    idx = torch.arange(length, device=src_k.device)
    align_correct_scatter_layers(
        src_k.unbind(0), src_v.unbind(0), idx, idx, src_start=int(src_pos), dst_start=int(dst_pos),
        inv_freq=spec.inv_freq, rotary_dim=spec.rotary_dim, layout=spec.layout,
        k_dst=out_k.unbind(0), v_dst=out_v.unbind(0), backend=backend, **plan_kernel_args(plan, 0, length))
    return out_k, out_v
