"""The one entry point the cache uses for the correction and gate math: Triton on CUDA, torch elsewhere.

``backend``: ``"auto"`` picks Triton when the tensors are on CUDA and Triton
imports, else the torch reference; ``"triton"`` forces the kernel (on CPU that
only works under the Triton interpreter, ``TRITON_INTERPRET=1`` set before
Triton is first imported: the tests do this); ``"torch"`` forces the reference.
The kernel modules are imported lazily, so CPU-only installs never need Triton.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
from collections.abc import Sequence
from typing import Literal

import torch

from . import reference
from .reference import AlignParams
from .rope import Layout, compute_dtype

Backend = Literal["auto", "triton", "torch"]

__all__ = [
    "Backend",
    "align_correct_scatter",
    "align_correct_scatter_layers",
    "gate_sq_distances",
    "gate_sq_distances_dense",
    "gate_from_sq_distances",
    "token_distances",
    "token_distances_dense",
    "token_gate_distances",
    "token_weights",
    "triton_available",
]


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` works (it may still lack a GPU: see ``backend``)."""
    try:
        importlib.import_module("triton")
    except Exception:  # noqa: BLE001 - a broken Triton install must fall back to torch, whatever it raises
        return False
    return True


def _use_triton(backend: Backend, device: torch.device) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' but Triton does not import; install triton or use backend='auto'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
            raise RuntimeError("backend='triton' on a non-CUDA tensor needs the Triton interpreter: set "
                               "TRITON_INTERPRET=1 before importing triton, or use backend='auto'")
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return device.type == "cuda" and triton_available()


def align_correct_scatter(
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
    backend: Backend = "auto",
) -> torch.Tensor:
    """Align, correct and scatter one segment of one layer's K or V pool, in one pass.

    For t in [0, L):
        keys (rotate=True):  dst[dst_idx[t]] = Rot(src[src_idx[t]], dst_start - src_start)
                                                + [t < covered] Rot(corr[t], dst_start)
        values (rotate=False): dst[dst_idx[t]] = src[src_idx[t]] + [t < covered] corr[t]
        corr[t] = sum_v w[t, v] * (A[v, t, :] @ B[v])   or   sum_v w[t, v] * delta[v, t]
    Deltas are in the canonical frame (token t at position t). Rot rotates the
    first ``rotary_dim`` dims of each head with angles ``shift * inv_freq``
    (float64 on the host, rounded once), ``layout`` rotate_half or interleaved.

    Shapes: src, dst [pool, kv_heads, head_dim] fp32/bf16/fp16, contiguous in
    head_dim, may be the same tensor; src_idx, dst_idx int64/int32 [L] per-token
    pool slots (page*page_size + offset for paged pools); inv_freq
    [rotary_dim/2]; A [Vn, Lc, r], B [Vn, r, kv_heads*head_dim]; or delta
    [Vn, Lc, kv_heads*head_dim]; w fp32 [>= covered, Vn]; covered <= min(L, Lc),
    default min(L, Lc). Vn = 0 or no factors: alignment only ("fullshared").
    Computes in fp32 (kernel, and the torch path unless the pools are float64)
    with the angles formed in float64; casts on store.

    Mutates ``dst`` rows ``dst_idx`` only; returns ``dst``. The kernel path
    requires that no destination row is another token's source row.
    Raises ValueError on inconsistent shapes, RuntimeError on an unusable backend.
    """
    p = AlignParams(rotate=rotate, src_start=src_start, dst_start=dst_start, inv_freq=inv_freq,
                    rotary_dim=rotary_dim, layout=layout, w=w, A=A, B=B, delta=delta, covered=covered)
    return _align_one(src, dst, src_idx, dst_idx, p, backend)


def _align_one(src, dst, src_idx, dst_idx, p: AlignParams, backend: Backend) -> torch.Tensor:
    if _use_triton(backend, src.device):
        impl = importlib.import_module(".align_correct", __package__).align_correct_scatter_triton
        return impl(src, dst, src_idx, dst_idx, p)
    return reference.align_correct_scatter_reference(src, dst, src_idx, dst_idx, p, compute=compute_dtype(src.dtype))


def align_correct_scatter_layers(
    k_src: Sequence[torch.Tensor],
    v_src: Sequence[torch.Tensor],
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    src_start: int,
    dst_start: int,
    inv_freq: torch.Tensor,
    rotary_dim: int | None = None,
    layout: Layout = "rotate_half",
    k_dst: Sequence[torch.Tensor] | None = None,
    v_dst: Sequence[torch.Tensor] | None = None,
    k_w: torch.Tensor | None = None,
    v_w: torch.Tensor | None = None,
    k_A: Sequence[torch.Tensor] | None = None,
    k_B: Sequence[torch.Tensor] | None = None,
    v_A: Sequence[torch.Tensor] | None = None,
    v_B: Sequence[torch.Tensor] | None = None,
    k_delta: Sequence[torch.Tensor] | None = None,
    v_delta: Sequence[torch.Tensor] | None = None,
    covered: int | None = None,
    backend: Backend = "auto",
) -> None:
    """``align_correct_scatter`` for K and V of every layer (two launches per layer).

    ``k_src[l]`` / ``v_src[l]``: layer l's pool (SGLang's ``k_buffer`` /
    ``v_buffer`` lists); destinations default to the same pools. Per-layer
    factors ``k_A[l]`` [Vn, Lc, r], ``k_B[l]`` [Vn, r, D] (a stacked
    [layers, ...] tensor or a list), or ``k_delta[l]``; the per-token weights
    ``k_w``, ``v_w`` [>= covered, Vn] are shared by all layers (ALGORITHM.md
    3.3: one weight per token, separately for K and V). Mutates the destinations.
    Triton: two launches per layer; torch: one batched pass over all layers
    (``reference.align_correct_scatter_layers_reference``).
    """
    k_dst = k_src if k_dst is None else k_dst
    v_dst = v_src if v_dst is None else v_dst
    if not len(k_src) == len(v_src) == len(k_dst) == len(v_dst):
        raise ValueError("k_src, v_src, k_dst, v_dst must list the same number of layers")
    rot = dict(src_start=src_start, dst_start=dst_start, inv_freq=inv_freq, rotary_dim=rotary_dim, layout=layout)
    kp = AlignParams(rotate=True, **rot, w=k_w, A=k_A, B=k_B, delta=k_delta, covered=covered)
    vp = AlignParams(rotate=False, w=v_w, A=v_A, B=v_B, delta=v_delta, covered=covered)
    if not k_src:
        return
    if not _use_triton(backend, k_src[0].device):
        reference.align_correct_scatter_layers_reference(k_src, v_src, src_idx, dst_idx, kp, vp, k_dst, v_dst,
                                                         compute=compute_dtype(k_src[0].dtype))
        return
    for layer in range(len(k_src)):
        _align_one(k_src[layer], k_dst[layer], src_idx, dst_idx, kp.layer(layer), backend)
        _align_one(v_src[layer], v_dst[layer], src_idx, dst_idx, vp.layer(layer), backend)


def gate_sq_distances(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor, gram: torch.Tensor | None = None, *,
                      backend: Backend = "auto") -> torch.Tensor:
    """d2[v] = sum_layers ||X - A_v B_v||_F^2 without materializing A_v B_v; fp32 [Vn].

    X [layers, k, D] (source values, first k rows); A [Vn, layers, k, r]
    (anchors' first k rows); B [Vn, layers, r, D]. Any float dtypes. ``gram``
    [Vn] optionally gives sum_layers ||A_v B_v||_F^2 precomputed (a cached
    per-anchor summary), which skips the Gram products. Pure.
    """
    if _use_triton(backend, X.device):
        return importlib.import_module(".gate_distances", __package__).gate_sq_distances_triton(X, A, B, gram)
    return reference.gate_sq_distances_reference(X, A, B, gram, compute=compute_dtype(X.dtype))


def gate_sq_distances_dense(X: torch.Tensor, F: Sequence[torch.Tensor]) -> torch.Tensor:
    """``gate_sq_distances`` for full-dimension anchors F_v [layers, >= k, D]; fp32 [Vn]. Torch on every device. Pure."""
    return reference.gate_sq_distances_dense(X, F, compute=compute_dtype(X.dtype))


def token_distances(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """dist[t, v] = mean_{layers, dims} |X[l, t] - A_v[l, t] @ B_v[l]|; fp32 [k, Vn]. Shapes as ``gate_sq_distances``.

    Keys must be passed in the canonical frame. Pure.
    """
    if _use_triton(backend, X.device):
        return importlib.import_module(".token_distances", __package__).token_distances_triton(X, A, B)
    return reference.token_distances_reference(X, A, B, compute=compute_dtype(X.dtype))


def token_gate_distances(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor, gate_rows: int,
                         gram: torch.Tensor | None = None, *,
                         backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_distances(X, A, B), gate_sq_distances(X[:, :g], A[:, :, :g], B, gram))`` with g = ``gate_rows``.

    Why one op: the gate and the value token weights compare the same values with
    the same bases. The Triton path runs the two kernels (the gate on ``gram``, a
    cached per-anchor summary, without reconstructing anything); the torch path
    builds each reconstruction once for both (``reference.token_gate_distances_reference``),
    so a CPU gate costs nothing extra when the weights are needed. Returns
    (dist fp32 [k, Vn], d2 fp32 [Vn]). Pure.
    """
    if _use_triton(backend, X.device):
        return (token_distances(X, A, B, backend=backend),
                gate_sq_distances(X[:, :gate_rows], A[:, :, :gate_rows], B, gram, backend=backend))
    return reference.token_gate_distances_reference(X, A, B, gate_rows, compute=compute_dtype(X.dtype))


def token_distances_dense(X: torch.Tensor, F: Sequence[torch.Tensor]) -> torch.Tensor:
    """``token_distances`` for full-dimension anchors F_v [layers, L_v, D] (rows past L_v compare with zeros); fp32 [k, Vn]."""
    return reference.token_distances_dense(X, F, compute=compute_dtype(X.dtype))


def gate_from_sq_distances(d2: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, float]:
    """The reliability gate of ALGORITHM.md 3.2 from ``gate_sq_distances``.

    Returns (g [Vn] fp32 = softmax(-sqrt(d2) / T), H = normalized entropy in
    [0, 1]). Needs Vn >= 2 (the gate falls back to a dense prefill below that).
    """
    vn = d2.numel()
    if vn < 2:
        raise ValueError(f"the gate needs at least two anchors, got {vn}: prefill densely instead")
    d = d2.to(torch.float64).clamp_min(0).sqrt()  # clamp: the expansion can round a tiny d2 below 0
    g = torch.softmax(-d / temperature, dim=0)
    ent = -(g * torch.log2(g.clamp_min(1e-300))).sum().item() / math.log2(vn)
    return g.to(torch.float32), min(1.0, max(0.0, ent))


def token_weights(dist: torch.Tensor, temperature: float = 1.0, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token weights w[t, v] = softmax_v(-dist[t, v] / T), fp32 [k, Vn], from ``token_distances``.

    ``lengths`` [Vn] (optional): anchor v covers rows t < lengths[v] only; its
    weight is 0 past that. Every row needs at least one covering anchor.
    """
    logits = -dist.to(torch.float32) / temperature
    if lengths is not None:
        rows = torch.arange(dist.shape[0], device=dist.device)[:, None]
        logits = logits.masked_fill(rows >= lengths.to(dist.device)[None, :], float("-inf"))
    return torch.softmax(logits, dim=1)
