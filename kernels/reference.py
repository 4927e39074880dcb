"""Pure-torch references of the kernels, with the launchers' signatures; the CPU path.

Every function here computes in float64 and rounds once on output, so it is the
accuracy yardstick the Triton kernels are tested against (they accumulate in
fp32; see the tolerance table in tests/kernels). Torch only: no Triton, no
SGLang, no other sglang_kvshare module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rope import Layout, check_rotary
from .rope import rotate as rotate_keys

__all__ = [
    "AlignArgs",
    "check_align_args",
    "check_factor_args",
    "align_correct_scatter_reference",
    "gate_sq_distances_reference",
    "token_distances_reference",
]


@dataclass(frozen=True)
class AlignArgs:
    """What ``check_align_args`` derives from the arguments of ``align_correct_scatter``."""

    num_tokens: int  # L
    covered: int  # Lc: rows 0..Lc-1 get the correction
    num_anchors: int  # Vn (0 when there is nothing to add)
    rotary_dim: int  # 0 when not rotating
    full_rank: bool  # correction given as dense ``delta`` instead of ``A @ B``


def check_align_args(src, dst, src_idx, dst_idx, *, rotate, inv_freq, rotary_dim, layout,
                     w, A, B, delta, covered) -> AlignArgs:
    """Validate the arguments of ``align_correct_scatter``; raise ValueError saying what to fix."""
    if src.dim() != 3 or dst.dim() != 3 or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src and dst must be [pool, kv_heads, head_dim] with equal heads and dims, "
                         f"got {tuple(src.shape)} and {tuple(dst.shape)}")
    if src_idx.dim() != 1 or src_idx.shape != dst_idx.shape:
        raise ValueError(f"src_idx and dst_idx must be 1-D of equal length, got {tuple(src_idx.shape)} "
                         f"and {tuple(dst_idx.shape)}")
    if src_idx.dtype not in (torch.int64, torch.int32) or dst_idx.dtype not in (torch.int64, torch.int32):
        raise ValueError("src_idx and dst_idx must be integer (int64 or int32) pool indices")
    num_tokens = src_idx.numel()
    _, heads, head_dim = src.shape
    dim = heads * head_dim
    if rotate and inv_freq is None:
        raise ValueError("rotate=True needs inv_freq (the model's rotary inverse frequencies)")
    rd = check_rotary(inv_freq, head_dim, rotary_dim, layout) if rotate else 0
    if delta is not None and (A is not None or B is not None):
        raise ValueError("pass either low-rank factors (A, B) or a dense delta, not both")
    if (A is None) != (B is None):
        raise ValueError("low-rank correction needs both A [Vn, Lc, r] and B [Vn, r, kv_heads*head_dim]")
    full_rank = delta is not None
    if A is not None:
        if A.dim() != 3 or B.dim() != 3 or A.shape[0] != B.shape[0] or A.shape[2] != B.shape[1] or B.shape[2] != dim:
            raise ValueError(f"A must be [Vn, Lc, r] and B [Vn, r, {dim}], got {tuple(A.shape)} and {tuple(B.shape)}")
        num_anchors, max_cov = A.shape[0], A.shape[1]
    elif delta is not None:
        if delta.dim() != 3 or delta.shape[2] != dim:
            raise ValueError(f"delta must be [Vn, Lc, {dim}], got {tuple(delta.shape)}")
        num_anchors, max_cov = delta.shape[0], delta.shape[1]
    else:
        num_anchors, max_cov = 0, 0
    if covered is None:
        covered = min(max_cov, num_tokens)
    if not 0 <= covered <= min(max_cov, num_tokens) and num_anchors > 0:
        raise ValueError(f"covered={covered} must be <= L={num_tokens} and <= the anchors' length {max_cov}")
    if num_anchors == 0:
        covered = 0
    if covered > 0:
        if w is None or w.dim() != 2 or w.shape[1] != num_anchors or w.shape[0] < covered:
            raise ValueError(f"w must be [>= covered={covered}, Vn={num_anchors}] (fp32 per-token weights), "
                             f"got {None if w is None else tuple(w.shape)}")
    return AlignArgs(num_tokens, covered, num_anchors, rd, full_rank)


def check_factor_args(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> None:
    """Validate X [num_layers, k, D], A [Vn, num_layers, k, r], B [Vn, num_layers, r, D]."""
    if X.dim() != 3 or A.dim() != 4 or B.dim() != 4:
        raise ValueError(f"need X [layers, k, D], A [Vn, layers, k, r], B [Vn, layers, r, D]; got "
                         f"{tuple(X.shape)}, {tuple(A.shape)}, {tuple(B.shape)}")
    nl, k, d = X.shape
    vn, r = A.shape[0], A.shape[3]
    if A.shape != (vn, nl, k, r) or B.shape != (vn, nl, r, d):
        raise ValueError(f"anchor factors must be A [{vn}, {nl}, {k}, r] (sliced to the first k={k} rows) and "
                         f"B [{vn}, {nl}, r, {d}]; got {tuple(A.shape)}, {tuple(B.shape)}")


def _correction64(args: AlignArgs, w, A, B, delta) -> torch.Tensor:
    """sum_v w[t, v] * Delta_v[t] for t < covered, float64 [covered, D], without an [Vn, Lc, D] temporary."""
    lc = args.covered
    w64 = w[:lc].to(torch.float64)
    if args.full_rank:
        return torch.einsum("tv,vtd->td", w64, delta[:, :lc].to(torch.float64))
    vn, _, r = A.shape
    wa = (A[:, :lc].to(torch.float64) * w64.t()[:, :, None]).transpose(0, 1).reshape(lc, vn * r)
    return wa @ B.to(torch.float64).reshape(vn * r, -1)


def align_correct_scatter_reference(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    rotate: bool,
    src_start: int = 0,
    dst_start: int = 0,
    inv_freq: torch.Tensor | None = None,
    rotary_dim: int | None = None,
    layout: Layout = "rotate_half",
    w: torch.Tensor | None = None,
    A: torch.Tensor | None = None,
    B: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    covered: int | None = None,
) -> torch.Tensor:
    """Torch reference of ``align_correct.align_correct_scatter_triton``; see ``dispatch.align_correct_scatter``.

    Gathers ``src[src_idx]`` first, so any aliasing of src and dst rows is fine
    here (the kernel needs dst rows not to alias other tokens' src rows).
    Mutates ``dst`` rows ``dst_idx``; returns ``dst``.
    """
    args = check_align_args(src, dst, src_idx, dst_idx, rotate=rotate, inv_freq=inv_freq, rotary_dim=rotary_dim,
                            layout=layout, w=w, A=A, B=B, delta=delta, covered=covered)
    if args.num_tokens == 0:
        return dst
    _, heads, head_dim = src.shape
    x = src[src_idx.long()].to(torch.float64)  # [L, H, Dh]
    if rotate:
        x = rotate_keys(x, dst_start - src_start, inv_freq, args.rotary_dim, layout)
    if args.covered:
        corr = _correction64(args, w, A, B, delta).view(args.covered, heads, head_dim)
        if rotate:
            corr = rotate_keys(corr, dst_start, inv_freq, args.rotary_dim, layout)
        x[: args.covered] += corr
    dst[dst_idx.long()] = x.to(dst.dtype)
    return dst


def gate_sq_distances_reference(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Torch reference of ``gate_distances.gate_sq_distances_triton``.

    d2[v] = sum_layers ||X - A_v B_v||_F^2, expanded as
    ||X||^2 - 2 <X B_v^T, A_v> + <A_v^T A_v, B_v B_v^T> so no [k, D] anchor is
    materialized. X [layers, k, D], A [Vn, layers, k, r], B [Vn, layers, r, D];
    returns fp32 [Vn] on X's device (computed in float64).
    """
    check_factor_args(X, A, B)
    x, a, b = X.to(torch.float64), A.to(torch.float64), B.to(torch.float64)
    xx = (x * x).sum()
    cross = ((x.unsqueeze(0) @ b.transpose(-1, -2)) * a).sum(dim=(1, 2, 3))
    gram = ((a.transpose(-1, -2) @ a) * (b @ b.transpose(-1, -2))).sum(dim=(1, 2, 3))
    return (xx - 2 * cross + gram).to(torch.float32)


def token_distances_reference(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Torch reference of ``token_distances.token_distances_triton``.

    dist[t, v] = mean over layers and dims of |X[l, t, :] - A_v[l, t, :] @ B_v[l]|.
    Shapes as in ``gate_sq_distances_reference``; returns fp32 [k, Vn]. Keys
    must already be in the canonical frame (the caller de-rotates them).
    Reconstructs one anchor at a time (float64 [layers, k, D] temporary).
    """
    check_factor_args(X, A, B)
    nl, k, d = X.shape
    x = X.to(torch.float64)
    out = torch.empty(k, A.shape[0], dtype=torch.float64, device=X.device)
    for v in range(A.shape[0]):
        rec = A[v].to(torch.float64) @ B[v].to(torch.float64)
        out[:, v] = (x - rec).abs().mean(dim=(0, 2))
    return out.to(torch.float32)
