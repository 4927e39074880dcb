"""Fused align + correct + scatter for one layer's K or V pool (Triton kernel and its launcher).

For segment token t (row ``src_idx[t]`` of ``src``), written to row ``dst_idx[t]`` of ``dst``:

    keys:   out[t] = Rot(src[src_idx[t]], dst_start - src_start) + [t < Lc] Rot(corr[t], dst_start)
    values: out[t] = src[src_idx[t]] + [t < Lc] corr[t]
    corr[t] = sum_v w[t, v] * (A[v, t, :] @ B[v])        (or sum_v w[t, v] * delta[v, t])

Deltas live in the canonical frame (token t at position t), hence the rotation by
``dst_start``. One read of each source row and of the factors, one write per
destination row, fp32 accumulation. Grid: (token blocks, kv heads); each program
owns BLOCK_T tokens of one head and splits the head into the two members of each
rotary pair plus the pass-through tail, so rotation needs no shuffles.

Reference with the same signature (pools, indices, ``AlignParams``):
``reference.align_correct_scatter_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import AlignParams, check_align_args
from .rope import rotation_cos_sin

__all__ = ["align_correct_scatter_triton"]


@triton.jit
def _align_correct_kernel(
    src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr,
    cos_s_ptr, sin_s_ptr, cos_d_ptr, sin_d_ptr,
    w_ptr, a_ptr, b_ptr,
    L, Lc, Vn, R,
    stride_src_row, stride_src_head, stride_dst_row, stride_dst_head,
    stride_w_t, stride_w_v,
    stride_a_v, stride_a_t, stride_a_r,
    stride_b_v, stride_b_r, stride_b_d,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_R: tl.constexpr,
    INTERLEAVED: tl.constexpr, ROTATE: tl.constexpr, CORRECT: tl.constexpr, FULL_RANK: tl.constexpr,
):
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < L
    s_row = tl.load(src_idx_ptr + t, mask=t_mask, other=0).to(tl.int64)
    d_row = tl.load(dst_idx_ptr + t, mask=t_mask, other=0).to(tl.int64)

    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    if INTERLEAVED:
        c1 = 2 * j
        c2 = 2 * j + 1
    else:
        c1 = j
        c2 = j + HALF
    p = tl.arange(0, BLOCK_PASS)
    p_mask = p < PASS
    cp = 2 * HALF + p
    m_half = t_mask[:, None] & j_mask[None, :]
    m_pass = t_mask[:, None] & p_mask[None, :]

    src_row = src_ptr + s_row[:, None] * stride_src_row + head * stride_src_head
    x1 = tl.load(src_row + c1[None, :], mask=m_half, other=0.0).to(tl.float32)
    x2 = tl.load(src_row + c2[None, :], mask=m_half, other=0.0).to(tl.float32)
    if PASS > 0:
        xp = tl.load(src_row + cp[None, :], mask=m_pass, other=0.0).to(tl.float32)

    if ROTATE:
        cs = tl.load(cos_s_ptr + j, mask=j_mask, other=1.0)[None, :]
        ss = tl.load(sin_s_ptr + j, mask=j_mask, other=0.0)[None, :]
        y1 = x1 * cs - x2 * ss
        y2 = x2 * cs + x1 * ss
    else:
        y1 = x1
        y2 = x2
    if PASS > 0:
        yp = xp

    if CORRECT:
        c_mask = t < Lc
        acc1 = tl.zeros((BLOCK_T, BLOCK_HALF), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_T, BLOCK_HALF), dtype=tl.float32)
        accp = tl.zeros((BLOCK_T, BLOCK_PASS), dtype=tl.float32)
        col0 = head * HEAD_DIM
        r = tl.arange(0, BLOCK_R)
        r_mask = r < R
        for v in range(0, Vn):
            wv = tl.load(w_ptr + t * stride_w_t + v * stride_w_v, mask=c_mask, other=0.0).to(tl.float32)
            if FULL_RANK:
                # a_ptr holds delta [Vn, Lc, D]; stride_a_r is its column stride.
                d_base = a_ptr + v * stride_a_v + t[:, None] * stride_a_t + col0 * stride_a_r
                mc_half = c_mask[:, None] & j_mask[None, :]
                acc1 += wv[:, None] * tl.load(d_base + c1[None, :] * stride_a_r, mask=mc_half, other=0.0).to(tl.float32)
                acc2 += wv[:, None] * tl.load(d_base + c2[None, :] * stride_a_r, mask=mc_half, other=0.0).to(tl.float32)
                if PASS > 0:
                    mc_pass = c_mask[:, None] & p_mask[None, :]
                    accp += wv[:, None] * tl.load(d_base + cp[None, :] * stride_a_r, mask=mc_pass, other=0.0).to(tl.float32)
            else:
                a = tl.load(a_ptr + v * stride_a_v + t[:, None] * stride_a_t + r[None, :] * stride_a_r,
                            mask=c_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
                a = a * wv[:, None]
                b_base = b_ptr + v * stride_b_v + r[:, None] * stride_b_r + col0 * stride_b_d
                mb_half = r_mask[:, None] & j_mask[None, :]
                b1 = tl.load(b_base + c1[None, :] * stride_b_d, mask=mb_half, other=0.0).to(tl.float32)
                b2 = tl.load(b_base + c2[None, :] * stride_b_d, mask=mb_half, other=0.0).to(tl.float32)
                acc1 += tl.dot(a, b1, input_precision="ieee")
                acc2 += tl.dot(a, b2, input_precision="ieee")
                if PASS > 0:
                    mb_pass = r_mask[:, None] & p_mask[None, :]
                    bp = tl.load(b_base + cp[None, :] * stride_b_d, mask=mb_pass, other=0.0).to(tl.float32)
                    accp += tl.dot(a, bp, input_precision="ieee")
        if ROTATE:
            cd = tl.load(cos_d_ptr + j, mask=j_mask, other=1.0)[None, :]
            sd = tl.load(sin_d_ptr + j, mask=j_mask, other=0.0)[None, :]
            y1 += acc1 * cd - acc2 * sd
            y2 += acc2 * cd + acc1 * sd
        else:
            y1 += acc1
            y2 += acc2
        if PASS > 0:
            yp += accp

    out_ty = dst_ptr.dtype.element_ty
    dst_row = dst_ptr + d_row[:, None] * stride_dst_row + head * stride_dst_head
    tl.store(dst_row + c1[None, :], y1.to(out_ty), mask=m_half)
    tl.store(dst_row + c2[None, :], y2.to(out_ty), mask=m_half)
    if PASS > 0:
        tl.store(dst_row + cp[None, :], yp.to(out_ty), mask=m_pass)


def _block(n: int) -> int:
    """Power-of-two block of at least 16 (tl.dot's minimum) covering n."""
    return max(16, triton.next_power_of_2(max(n, 1)))


def align_correct_scatter_triton(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                                 p: AlignParams, block_t: int = 32) -> torch.Tensor:
    """Launch the fused kernel for one layer's K (``p.rotate``) or V pool; returns ``dst``.

    Contract as ``dispatch.align_correct_scatter``. NOTE: programs run in any
    order, so a destination row must not be another token's source row
    (``dst_idx[t] == src_idx[t]`` in place is fine; fresh slots are the normal case).
    """
    args = check_align_args(src, dst, src_idx, dst_idx, p)
    rotate, w, A, B, delta = p.rotate, p.w, p.A, p.B, p.delta
    if args.num_tokens == 0:
        return dst
    if src.stride(2) != 1 or dst.stride(2) != 1:
        raise ValueError("src and dst pools must be contiguous along head_dim")
    others = [t for t in (dst, src_idx, dst_idx, w, A, B, delta) if t is not None]
    if any(t.device != src.device for t in others):
        raise ValueError(f"all tensors must be on the pool's device {src.device} (inv_freq may be anywhere)")
    _, heads, head_dim = src.shape
    dev = src.device
    rd = args.rotary_dim if rotate else 2 * (head_dim // 2)
    half, pas = rd // 2, head_dim - rd
    if rotate:
        cos_s, sin_s = rotation_cos_sin(p.inv_freq, p.dst_start - p.src_start, dev)
        cos_d, sin_d = rotation_cos_sin(p.inv_freq, p.dst_start, dev)
    else:
        cos_s = sin_s = cos_d = sin_d = torch.empty(1, dtype=torch.float32, device=dev)
    correct = args.covered > 0
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    if correct and args.full_rank:
        a_t, b_t, R = delta, dummy, 0
        sa, sb = delta.stride(), (0, 0, 0)
    elif correct:
        a_t, b_t, R = A, B, A.shape[2]
        sa, sb = A.stride(), B.stride()
    else:
        a_t, b_t, R, sa, sb = dummy, dummy, 0, (0, 0, 0), (0, 0, 0)
    w_t = w if correct else dummy
    sw = w.stride() if correct else (0, 0)
    grid = (triton.cdiv(args.num_tokens, block_t), heads)
    _align_correct_kernel[grid](
        src, dst, src_idx, dst_idx,
        cos_s, sin_s, cos_d, sin_d,
        w_t, a_t, b_t,
        args.num_tokens, args.covered, args.num_anchors, R,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        sw[0], sw[1],
        sa[0], sa[1], sa[2],
        sb[0], sb[1], sb[2],
        HEAD_DIM=head_dim, HALF=half, PASS=pas,
        BLOCK_T=block_t, BLOCK_HALF=_block(half), BLOCK_PASS=_block(pas), BLOCK_R=_block(R),
        INTERLEAVED=(p.layout == "interleaved"), ROTATE=rotate, CORRECT=correct, FULL_RANK=args.full_rank,
    )
    return dst
