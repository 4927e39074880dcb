"""Per-token distances between a source cache and low-rank anchors, for the per-token weights.

    dist[t, v] = mean_{layers, dims} |X[l, t, :] - A_v[l, t, :] @ B_v[l]|      (t < k)

X [layers, k, D] (keys already in the canonical frame), A [Vn, layers, k, r],
B [Vn, layers, r, D]; fp32 [k, Vn]. Rows of A_v B_v are rebuilt tile by tile in
registers and never written. The weights are then
``softmax(-dist / T, dim=1)`` (see ``dispatch.token_weights``).

Reference with the same signature: ``reference.token_distances_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_factor_args

__all__ = ["token_distances_triton"]


@triton.jit
def _token_dist_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr,
    NL, K, D, R, Vn, inv_count,
    sx_l, sx_t, sx_d,
    sa_v, sa_l, sa_t, sa_r,
    sb_v, sb_l, sb_r, sb_d,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_t = tl.program_id(0)
    v = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < K
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for layer in range(0, NL):
        a = tl.load(a_ptr + v * sa_v + layer * sa_l + t[:, None] * sa_t + r[None, :] * sa_r,
                    mask=t_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_mask = d < D
            b = tl.load(b_ptr + v * sb_v + layer * sb_l + r[:, None] * sb_r + d[None, :] * sb_d,
                        mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            rec = tl.dot(a, b, input_precision="ieee")
            m = t_mask[:, None] & d_mask[None, :]
            x = tl.load(x_ptr + layer * sx_l + t[:, None] * sx_t + d[None, :] * sx_d, mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(tl.where(m, tl.abs(x - rec), 0.0), axis=1)
    tl.store(out_ptr + t * Vn + v, acc * inv_count, mask=t_mask)


def token_distances_triton(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           block_t: int = 32, block_d: int = 64) -> torch.Tensor:
    """Per-token mean-abs distances, fp32 [k, Vn]; contract as ``dispatch.token_distances``."""
    check_factor_args(X, A, B)
    if A.device != X.device or B.device != X.device:
        raise ValueError(f"X, A and B must be on one device, got {X.device}, {A.device}, {B.device}")
    nl, k, d = X.shape
    vn, r = A.shape[0], A.shape[3]
    out = torch.zeros(k, vn, dtype=torch.float32, device=X.device)
    if vn == 0 or k == 0 or nl == 0 or d == 0:
        return out
    _token_dist_kernel[(triton.cdiv(k, block_t), vn)](
        X, A, B, out, nl, k, d, r, vn, 1.0 / (nl * d),
        *X.stride(), *A.stride(), *B.stride(),
        BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_R=max(16, triton.next_power_of_2(r)),
    )
    return out
