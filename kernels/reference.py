"""Pure-torch references of the kernels, with the launchers' signatures; the CPU path.

Every function takes ``compute``, the dtype it computes in. Called directly they
default to float64 and round once on output, so they are the accuracy yardstick
the Triton kernels are tested against (see the tolerance table in tests/kernels).
The dispatcher's torch path (the CPU serving path) calls them with fp32, the
Triton kernels' own accumulation precision: float64 over whole segments costs
about 2x on CPU and buys nothing the fp32 kernel does not already deliver.
Torch only: no Triton, no SGLang, no other sglang_kvshare module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .rope import Layout, check_rotary
from .rope import rotate as rotate_rows  # NOTE: the align functions have a ``rotate`` flag

__all__ = [
    "AlignArgs",
    "AlignParams",
    "check_align_args",
    "check_factor_args",
    "align_correct_scatter_reference",
    "align_correct_scatter_layers_reference",
    "gate_sq_distances_reference",
    "token_distances_reference",
    "token_gate_distances_reference",
    "gate_sq_distances_dense",
    "token_distances_dense",
]

# The CPU path works in row blocks of about this many bytes of [layers, rows, D]
# (one anchor's reconstruction, one block of aligned rows): the block's temporaries
# stay in cache and reuse one buffer. Whole-segment temporaries (tens of MiB, fresh
# pages each time) measured 2-3x slower on this project's CPU (1K tokens, 6 anchors).
_BLOCK_BYTES = 4 * 2**20


@dataclass(frozen=True)
class AlignParams:
    """One ``align_correct_scatter`` call minus the pools and indices; fields as its keyword arguments.

    Why a struct: the dispatcher, the Triton launcher and the torch reference
    take the same settings; passing them as one value keeps one signature (the
    dispatcher's) and one validation (``check_align_args``). For the layer-wise
    functions ``A``/``B``/``delta`` hold one entry per layer (a list or a
    stacked tensor); ``layer(l)`` picks one.
    """

    rotate: bool
    src_start: int = 0
    dst_start: int = 0
    inv_freq: torch.Tensor | None = None
    rotary_dim: int | None = None
    layout: Layout = "rotate_half"
    w: torch.Tensor | None = None
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    covered: int | None = None

    def layer(self, index: int) -> "AlignParams":
        """The settings of layer ``index`` when the factors are given per layer."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return replace(self, A=pick(self.A), B=pick(self.B), delta=pick(self.delta))


@dataclass(frozen=True)
class AlignArgs:
    """What ``check_align_args`` derives from the arguments of ``align_correct_scatter``."""

    num_tokens: int  # L
    covered: int  # Lc: rows 0..Lc-1 get the correction
    num_anchors: int  # Vn (0 when there is nothing to add)
    rotary_dim: int  # 0 when not rotating
    full_rank: bool  # correction given as dense ``delta`` instead of ``A @ B``


def check_align_args(src, dst, src_idx, dst_idx, p: AlignParams) -> AlignArgs:
    """Validate the arguments of ``align_correct_scatter``; raise ValueError saying what to fix."""
    rotate, inv_freq, rotary_dim, layout = p.rotate, p.inv_freq, p.rotary_dim, p.layout
    w, A, B, delta, covered = p.w, p.A, p.B, p.delta, p.covered
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


def align_correct_scatter_reference(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                                    p: AlignParams, compute: torch.dtype = torch.float64) -> torch.Tensor:
    """Torch reference of ``align_correct.align_correct_scatter_triton``; see ``dispatch.align_correct_scatter``.

    Gathers ``src[src_idx]`` first, so any aliasing of src and dst rows is fine
    here (the kernel needs dst rows not to alias other tokens' src rows).
    Mutates ``dst`` rows ``dst_idx``; returns ``dst``.
    """
    args = check_align_args(src, dst, src_idx, dst_idx, p)
    if args.num_tokens:
        rows = _aligned_rows([src], src_idx, p, args, compute, per_layer=False)[0]
        dst[dst_idx.long()] = rows.to(dst.dtype)
    return dst


def _aligned_rows(srcs: Sequence[torch.Tensor], src_idx: torch.Tensor, p: AlignParams, args: AlignArgs,
                  compute: torch.dtype, per_layer: bool) -> torch.Tensor:
    """Rows ``src_idx`` of every pool in ``srcs``, aligned and corrected: ``compute`` [len(srcs), L, H, Dh].

    ``per_layer``: ``p`` holds the factors per layer (stacked here); else one
    set for the single pool. Everything runs batched over the pools.
    """
    n = len(srcs)
    _, heads, head_dim = srcs[0].shape
    idx = src_idx.long()
    x = torch.empty((n, idx.numel(), heads, head_dim), dtype=srcs[0].dtype, device=srcs[0].device)
    for i, s in enumerate(srcs):  # one gather per pool, straight into the stack
        torch.index_select(s, 0, idx, out=x[i])
    x = x.to(compute)
    if p.rotate:
        x = rotate_rows(x, p.dst_start - p.src_start, p.inv_freq, args.rotary_dim, p.layout, compute)
    lc = args.covered
    if lc:
        A, B, delta = (_stacked(t) if per_layer or t is None else t[None] for t in (p.A, p.B, p.delta))
        wc = p.w[:lc].to(compute)
        if args.full_rank:
            corr = torch.einsum("tv,lvtd->ltd", wc, delta[:, :, :lc].to(compute))
        else:
            # sum_v w[t, v] A_v[t] B_v as one GEMM per layer: [lc, Vn*r] @ [Vn*r, D]. The weighted
            # factors are written once, already in that layout (no transposed copy).
            vn, r = A.shape[1], A.shape[3]
            wa = torch.empty((n, lc, vn, r), dtype=compute, device=x.device)
            torch.mul(A[:, :, :lc].permute(0, 2, 1, 3), wc[None, :, :, None], out=wa)
            corr = torch.bmm(wa.view(n, lc, vn * r), B.to(compute).reshape(n, vn * r, -1))
        corr = corr.view(n, lc, heads, head_dim)
        if p.rotate:
            corr = rotate_rows(corr, p.dst_start, p.inv_freq, args.rotary_dim, p.layout, compute)
        x[:, :lc] += corr
    return x


def _stacked(t) -> torch.Tensor | None:
    """Per-layer tensors (a list or an already stacked [layers, ...] tensor) as one tensor."""
    if t is None or isinstance(t, torch.Tensor):
        return t
    return torch.stack(list(t))


def align_correct_scatter_layers_reference(k_src: Sequence[torch.Tensor], v_src: Sequence[torch.Tensor],
                                           src_idx: torch.Tensor, dst_idx: torch.Tensor, k: AlignParams,
                                           v: AlignParams, k_dst: Sequence[torch.Tensor],
                                           v_dst: Sequence[torch.Tensor], compute: torch.dtype = torch.float64) -> None:
    """``align_correct_scatter_reference`` for K (``k``, factors per layer) and V of every layer, batched.

    Contract as ``dispatch.align_correct_scatter_layers``. Per row block (about
    ``_BLOCK_BYTES`` of [layers, rows, kv_heads, head_dim]): one gather and one
    scatter per layer (the pools are separate tensors), and the rotation and the
    correction once over the block's rows of every layer, so the Python work does
    not grow with the number of anchors.
    """
    idx = dst_idx.long()
    for srcs, dsts, p in ((k_src, k_dst, k), (v_src, v_dst, v)):
        for name, t in (("A", p.A), ("B", p.B), ("delta", p.delta)):
            if t is not None and len(t) != len(srcs):
                raise ValueError(f"{name} must hold one entry per layer ({len(srcs)}), got {len(t)}")
        if not srcs:
            return
        args = check_align_args(srcs[0], dsts[0], src_idx, dst_idx, p.layer(0))
        if args.num_tokens == 0:
            return
        # B is the same for every row block: laid out once as the correction GEMM reads it.
        B = None if p.B is None else _stacked(p.B).to(compute).contiguous()
        p = replace(p, A=_stacked(p.A), B=B, delta=_stacked(p.delta))
        item = torch.empty((), dtype=compute).element_size()
        row_bytes = len(srcs) * srcs[0].shape[1] * srcs[0].shape[2] * item
        # Rows are gathered block by block, so a destination row that is also a later block's
        # source would be read after it was written: such calls run as one block.
        aliased = any(s is d for s, d in zip(srcs, dsts)) and bool(torch.isin(idx, src_idx.long()).any())
        blocks = [(0, args.num_tokens)] if aliased else _row_blocks(args.num_tokens, row_bytes)
        for lo, hi in blocks:
            pb, ab = _row_block(p, args, lo, hi)
            rows = _aligned_rows(srcs, src_idx[lo:hi], pb, ab, compute, per_layer=True).to(dsts[0].dtype)
            for layer, d in enumerate(dsts):
                d.index_copy_(0, idx[lo:hi], rows[layer])


def _row_block(p: AlignParams, args: AlignArgs, lo: int, hi: int) -> tuple[AlignParams, AlignArgs]:
    """The settings of rows ``[lo, hi)`` of a layer-wise call (factors stacked [layers, Vn, rows, ...])."""
    covered = max(0, min(args.covered, hi) - lo)
    if covered == 0:
        return replace(p, A=None, B=None, delta=None, w=None, covered=None), replace(
            args, num_tokens=hi - lo, covered=0, num_anchors=0)
    rows = slice(lo, lo + covered)
    pick = lambda t: None if t is None else t[:, :, rows]  # noqa: E731
    return (replace(p, A=pick(p.A), delta=pick(p.delta), w=p.w[rows], covered=covered),
            replace(args, num_tokens=hi - lo, covered=covered))


def gate_sq_distances_reference(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor, gram: torch.Tensor | None = None,
                                compute: torch.dtype = torch.float64) -> torch.Tensor:
    """Torch reference of ``gate_distances.gate_sq_distances_triton``.

    d2[v] = sum_layers ||X - A_v B_v||_F^2, expanded as
    ||X||^2 - 2 <X B_v^T, A_v> + <A_v^T A_v, B_v B_v^T> so no [k, D] anchor is
    materialized. X [layers, k, D], A [Vn, layers, k, r], B [Vn, layers, r, D];
    ``gram`` [Vn], when given, is the last term precomputed (an anchor's cached
    summary). The [layers, k, r] products run in ``compute``; the reductions in
    float64, so the expansion's cancellation costs no more than fp32 rounding
    of the products. Returns fp32 [Vn] on X's device.
    """
    check_factor_args(X, A, B)
    if gram is not None and gram.shape != (A.shape[0],):
        raise ValueError(f"gram must be [Vn={A.shape[0]}], got {tuple(gram.shape)}")
    x = X.to(compute)
    xx = (x * x).sum(dtype=torch.float64)
    cross = torch.empty(A.shape[0], dtype=torch.float64, device=X.device)
    grams = []
    for v in range(A.shape[0]):
        a, b = A[v].to(compute), B[v].to(compute)
        # <X, A_v B_v> = <A_v^T X, B_v>: the [layers, r, D] product has the long inner dimension k
        # (an efficient GEMM), and X is never broadcast into a per-anchor copy.
        cross[v] = ((a.transpose(-1, -2) @ x) * b).sum(dtype=torch.float64)
        if gram is None:
            grams.append(((a.transpose(-1, -2) @ a) * (b @ b.transpose(-1, -2))).sum(dtype=torch.float64))
    if gram is None:
        gram = torch.stack(grams) if grams else torch.zeros(0, dtype=torch.float64, device=X.device)
    return (xx - 2 * cross + gram.to(device=X.device, dtype=torch.float64)).to(torch.float32)


def _row_blocks(rows: int, per_row_bytes: int):
    step = max(1, _BLOCK_BYTES // max(per_row_bytes, 1))
    return ((lo, min(lo + step, rows)) for lo in range(0, rows, step))


def token_distances_reference(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                              compute: torch.dtype = torch.float64) -> torch.Tensor:
    """Torch reference of ``token_distances.token_distances_triton``.

    dist[t, v] = mean over layers and dims of |X[l, t, :] - A_v[l, t, :] @ B_v[l]|.
    Shapes as in ``gate_sq_distances_reference``; returns fp32 [k, Vn]. Keys
    must already be in the canonical frame (the caller de-rotates them).
    """
    return token_gate_distances_reference(X, A, B, 0, compute)[0]


def token_gate_distances_reference(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor, gate_rows: int,
                                   compute: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_distances`` of all k rows and ``gate_sq_distances`` of the first ``gate_rows``, in one pass.

    Why one pass: the gate and the value token weights compare the same source
    values with the same anchor bases; on the CPU each reconstruction A_v B_v is
    the cost, so it is built once, block by block, and both reductions read it
    while it is in cache. The gate's squared distances come from the differences
    themselves (no expansion, so no cancellation): each block's norm in
    ``compute``, the sum over blocks in float64. Returns
    (dist fp32 [k, Vn], d2 fp32 [Vn]; zeros when ``gate_rows`` is 0).
    """
    check_factor_args(X, A, B)
    nl, k, d = X.shape
    vn = A.shape[0]
    if not 0 <= gate_rows <= k:
        raise ValueError(f"gate_rows must lie in [0, k={k}], got {gate_rows}")
    out = torch.zeros(k, vn, dtype=torch.float32, device=X.device)
    d2 = torch.zeros(vn, dtype=torch.float64, device=X.device)
    if vn == 0 or nl == 0 or d == 0:
        return out, d2.to(torch.float32)
    item = torch.empty((), dtype=compute).element_size()
    diff = None
    for lo, hi in _row_blocks(k, nl * d * item):
        x = X[:, lo:hi].to(compute)  # a view when X is already in ``compute``
        if diff is None or diff.shape[1] != hi - lo:  # a shorter last block gets its own (contiguous) buffer
            diff = torch.empty((nl, hi - lo, d), dtype=compute, device=X.device)
        g = max(0, min(gate_rows, hi) - lo)
        for v in range(vn):
            # A_v B_v - X: beta=-1 subtracts X inside the GEMM (no negated copy of the block).
            torch.baddbmm(x, A[v, :, lo:hi].to(compute), B[v].to(compute), beta=-1, out=diff)
            if g:
                d2[v] += torch.linalg.vector_norm(diff[:, :g]).to(torch.float64) ** 2
            out[lo:hi, v] = (diff.abs_().sum(dim=2).sum(dim=0) / (nl * d)).to(torch.float32)
    return out, d2.to(torch.float32)


def gate_sq_distances_dense(X: torch.Tensor, F: Sequence[torch.Tensor],
                            compute: torch.dtype = torch.float64) -> torch.Tensor:
    """``gate_sq_distances`` for anchors stored at full dimension: d2[v] = sum_layers ||X - F_v[:, :k]||_F^2.

    X [layers, k, D]; F: Vn tensors [layers, >= k, D] (a sequence, so the
    anchors are never stacked into one copy). Direct differences, no expansion.
    Returns fp32 [Vn]. Torch only: full-dimension anchors are the ablation
    baselines, memory-bound either way.
    """
    k = X.shape[1]
    x = X.to(compute)
    out = [(x - f[:, :k].to(compute)).pow(2).sum(dtype=torch.float64) for f in F]
    return torch.stack(out).to(torch.float32) if out else torch.zeros(0, dtype=torch.float32, device=X.device)


def token_distances_dense(X: torch.Tensor, F: Sequence[torch.Tensor],
                          compute: torch.dtype = torch.float64) -> torch.Tensor:
    """``token_distances`` for full-dimension anchors; rows past an anchor's length compare against zeros.

    X [layers, k, D]; F: Vn tensors [layers, L_v, D]. Returns fp32 [k, Vn].
    """
    nl, k, d = X.shape
    x = X.to(compute)
    out = torch.zeros(k, len(F), dtype=torch.float32, device=X.device)
    for v, f in enumerate(F):
        n = min(k, f.shape[1])
        out[:n, v] = (x[:, :n] - f[:, :n].to(compute)).abs().mean(dim=(0, 2)).to(torch.float32)
        out[n:, v] = x[:, n:].abs().mean(dim=(0, 2)).to(torch.float32)
    return out
