"""Gate distances between a source cache and low-rank anchors, without materializing the anchors.

    d2[v] = sum_layers ||X - A_v B_v||_F^2
          = sum_layers ||X||^2 - 2 <X B_v^T, A_v> + <A_v^T A_v, B_v B_v^T>

X [layers, k, D] (the source values' first k rows), A [Vn, layers, k, r],
B [Vn, layers, r, D]. One program per (anchor, layer) reads X, A_v and B_v once
and writes one fp32 partial; the layer sum is a tiny torch reduction (no atomics,
so the result is deterministic). A caller holding each anchor's Gram term
(``gram``) skips the third term. NOTE: the expansion cancels when X ~ A B; in fp32
the absolute error is about 1e-6 * (||X||^2 + ||A B||^2), ample for a softmax gate.

Reference with the same signature: ``reference.gate_sq_distances_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_factor_args

__all__ = ["gate_sq_distances_triton"]


@triton.jit
def _gate_sq_kernel(x_ptr, a_ptr, b_ptr, out_ptr, NL, K, D, R,  # X [NL, K, D], A [Vn, NL, K, R], B [Vn, NL, R, D]
                    sx_l, sx_t, sx_d, sa_v, sa_l, sa_t, sa_r, sb_v, sb_l, sb_r, sb_d,  # their strides
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, GRAM: tl.constexpr):
    v = tl.program_id(0)
    layer = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    x_base = x_ptr + layer * sx_l
    a_base = a_ptr + v * sa_v + layer * sa_l
    b_base = b_ptr + v * sb_v + layer * sb_l

    xsq = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    cross = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    gram_a = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
    for t0 in range(0, K, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_mask = t < K
        xb = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_mask = d < D
            x = tl.load(x_base + t[:, None] * sx_t + d[None, :] * sx_d,
                        mask=t_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            xsq += x * x
            bt = tl.load(b_base + d[:, None] * sb_d + r[None, :] * sb_r,
                         mask=d_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
            xb += tl.dot(x, bt, input_precision="ieee")
        a = tl.load(a_base + t[:, None] * sa_t + r[None, :] * sa_r,
                    mask=t_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        cross += xb * a
        if GRAM:
            gram_a += tl.dot(tl.trans(a), a, input_precision="ieee")

    total = tl.sum(tl.sum(xsq, axis=1), axis=0) - 2.0 * tl.sum(tl.sum(cross, axis=1), axis=0)
    if GRAM:
        gram_b = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            b = tl.load(b_base + r[:, None] * sb_r + d[None, :] * sb_d,
                        mask=r_mask[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
            gram_b += tl.dot(b, tl.trans(b), input_precision="ieee")
        total += tl.sum(tl.sum(gram_a * gram_b, axis=1), axis=0)
    tl.store(out_ptr + v * NL + layer, total)


def gate_sq_distances_triton(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor, gram: torch.Tensor | None = None,
                             block_t: int = 32, block_d: int = 64) -> torch.Tensor:
    """Squared Frobenius distances summed over layers, fp32 [Vn]; contract as ``dispatch.gate_sq_distances``.

    With ``gram`` (the anchors' precomputed sum_layers ||A_v B_v||^2, [Vn]) the
    kernel skips the Gram products and the layer sum adds it (in float64).
    """
    check_factor_args(X, A, B)
    if gram is not None and gram.shape != (A.shape[0],):
        raise ValueError(f"gram must be [Vn={A.shape[0]}], got {tuple(gram.shape)}")
    if A.device != X.device or B.device != X.device:
        raise ValueError(f"X, A and B must be on one device, got {X.device}, {A.device}, {B.device}")
    nl, k, d = X.shape
    vn, r = A.shape[0], A.shape[3]
    partial = torch.empty(vn, nl, dtype=torch.float32, device=X.device)
    if vn == 0:
        return partial.sum(dim=1)
    if nl == 0 or k == 0:
        return torch.zeros(vn, dtype=torch.float32, device=X.device)
    _gate_sq_kernel[(vn, nl)](
        X, A, B, partial, nl, k, d, r,
        *X.stride(), *A.stride(), *B.stride(),
        BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_R=max(16, triton.next_power_of_2(r)), GRAM=gram is None,
    )
    if gram is None:
        return partial.sum(dim=1)
    return (partial.sum(dim=1, dtype=torch.float64) + gram.to(device=X.device, dtype=torch.float64)).to(torch.float32)
