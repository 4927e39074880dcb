"""Low-rank storage of per-layer ``L x D`` matrices (ALGORITHM.md section 3.1).

A segment's K or V over all layers, ``[num_layers, L, kv_heads, head_dim]``,
is viewed as ``num_layers`` matrices ``L x D`` (``D = kv_heads * head_dim``)
and stored either as truncated-SVD factors ``A [num_layers, L, r]`` and
``B [num_layers, r, D]`` or, with ``rank=None``, as the matrix itself.

Bytes are exact: ``num_layers * r * (L + D) * itemsize`` for factors and
``num_layers * L * D * itemsize`` for a full matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Factors", "factorize", "factor_nbytes", "stack_factors", "stack_dense", "stack_layer_groups"]


@dataclass
class Factors:
    """One stored matrix stack. Exactly one of (``a``, ``b``) or ``full`` is set.

    Attributes:
        a: ``[num_layers, L, r]`` or None.
        b: ``[num_layers, r, D]`` or None.
        full: ``[num_layers, L, D]`` or None (rank None).
        head_shape: ``(kv_heads, head_dim)`` to restore the cache layout.
    """

    a: torch.Tensor | None
    b: torch.Tensor | None
    full: torch.Tensor | None
    head_shape: tuple[int, int]

    @property
    def rank(self) -> int | None:
        return None if self.full is not None else int(self.a.shape[-1])

    @property
    def length(self) -> int:
        return int((self.full if self.full is not None else self.a).shape[1])

    @property
    def num_layers(self) -> int:
        return int((self.full if self.full is not None else self.a).shape[0])

    def nbytes(self) -> int:
        """Exact bytes held: ``r*(L+D)*itemsize`` per layer, or ``L*D*itemsize``."""
        if self.full is not None:
            return self.full.numel() * self.full.element_size()
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def matrix(self, rows: int | None = None, dtype: torch.dtype | None = None, start: int = 0) -> torch.Tensor:
        """Reconstruct rows ``[start, rows)`` as ``[num_layers, rows - start, D]`` (``rows`` capped at the length)."""
        rows = self.length if rows is None else min(rows, self.length)
        if self.full is not None:
            out = self.full[:, start:rows]
            return out.to(dtype) if dtype is not None else out
        a = self.a[:, start:rows]
        b = self.b
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        return torch.bmm(a, b)

    def row_sq_norms(self) -> torch.Tensor:
        """``sum_layers ||row t||^2`` of the reconstruction, float64 ``[L]``, from the factors' Gram matrix.

        Costs ``layers * r * (r * D + L * r)``, never the ``L x D`` product: the
        anchor pool caches its cumulative sum as the gate's Gram term.
        """
        if self.full is not None:
            return self.full.to(torch.float64).pow(2).sum(dim=(0, 2))
        a, b = self.a.to(torch.float64), self.b.to(torch.float64)
        gram = b @ b.transpose(-1, -2)  # [layers, r, r]
        return ((a @ gram) * a).sum(dim=(0, 2))

    def reconstruct(self, rows: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Reconstruct in cache layout ``[num_layers, rows, kv_heads, head_dim]``."""
        m = self.matrix(rows, dtype)
        return m.view(m.shape[0], m.shape[1], *self.head_shape)


def factor_nbytes(num_layers: int, length: int, dim: int, rank: int | None, itemsize: int) -> int:
    """Bytes ``factorize`` would hold for these sizes (rank capped at min(L, D))."""
    if rank is None:
        return num_layers * length * dim * itemsize
    r = min(rank, length, dim)
    return num_layers * r * (length + dim) * itemsize


def factorize(x: torch.Tensor, rank: int | None, method: Literal["svd", "randomized", "gram"] = "svd",
              dtype: torch.dtype | None = None, niter: int = 2) -> Factors:
    """Truncated-SVD factors of every layer's ``L x D`` matrix.

    Args:
        x: ``[num_layers, L, kv_heads, head_dim]`` (or ``[num_layers, L, D]``).
        rank: kept singular directions; ``None`` stores the matrix itself.
            Capped at ``min(L, D)`` (then the factors are exact).
        method: ``"svd"`` (exact truncation, float32 math), ``"randomized"``
            (``torch.svd_lowrank``, approximate) or ``"gram"``: the truncation
            of ``"svd"`` from the top eigenvectors of the ``D x D`` Gram matrix
            (float64). A K/V matrix is tall (``L`` tokens by
            ``D = kv_heads * head_dim``), so one ``L x D x D`` product and a
            subspace iteration on the small Gram matrix replace the SVD of
            the tall matrix; residual within 1e-4 of the exact truncation and
            no global RNG draw (the learner's default in the server; the three
            methods' times: docs/research/PROFILE.md).
        dtype: storage dtype; defaults to ``x.dtype``.
    Returns: new ``Factors``; ``x`` is not modified.
    """
    head_shape = (x.shape[2], x.shape[3]) if x.dim() == 4 else (1, x.shape[2])
    nl, length = x.shape[0], x.shape[1]
    m = x.reshape(nl, length, -1)
    store = dtype or x.dtype
    if rank is None:
        return Factors(None, None, m.to(store).clone(), head_shape)
    if rank <= 0:
        raise ValueError(f"rank must be positive or None, got {rank}")
    r = min(rank, length, m.shape[-1])
    work = m.float() if m.dtype in (torch.float16, torch.bfloat16) else m
    if method == "gram" and r < min(length, m.shape[-1]):
        a, b = _gram_truncation(work, r, niter)
    elif method == "randomized" and r < min(length, m.shape[-1]):
        u, s, v = torch.svd_lowrank(work, q=min(r + 8, length, m.shape[-1]), niter=niter)
        a = u[..., :r] * s[..., None, :r]
        b = v[..., :r].transpose(-1, -2)
    else:
        u, s, vh = torch.linalg.svd(work, full_matrices=False)
        a = u[..., :r] * s[..., None, :r]
        b = vh[..., :r, :]
    return Factors(a.to(store).contiguous(), b.to(store).contiguous(), None, head_shape)


def _gram_truncation(m: torch.Tensor, r: int, niter: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U_r S_r, V_r^T)`` of every layer of ``m`` from the top eigenvectors of ``m^T m``.

    ``m V_r V_r^T`` is the best rank-``r`` approximation of ``m`` (Eckart-Young).
    The ``D x D`` Gram matrix is formed in ``m``'s dtype (float32) and solved
    in float64; its top eigenvectors come from a subspace iteration of width
    ``r + 8`` (``niter`` power steps on the Gram matrix, that is ``2 * niter + 1``
    on ``m``'s spectrum) and a small eigensolve, because a full ``D x D``
    eigensolve per layer costs more than the rest of an observation. The start
    block comes from a fixed-seed generator: no draw from torch's global RNG,
    the same factors for the same input.
    """
    gram = (m.transpose(-1, -2) @ m).double()
    d = gram.shape[-1]
    width = min(r + 8, d)
    if 2 * width >= d:
        _, vecs = torch.linalg.eigh(gram)  # ascending eigenvalues
        v_r = vecs[..., -r:]
    else:
        start = torch.randn(d, width, generator=torch.Generator().manual_seed(0), dtype=gram.dtype)
        basis = torch.linalg.qr(gram @ start).Q
        for _ in range(niter):
            basis = torch.linalg.qr(gram @ basis).Q
        _, small = torch.linalg.eigh(basis.transpose(-1, -2) @ gram @ basis)
        v_r = basis @ small[..., -r:]
    v_r = v_r.flip(-1).to(m.dtype)  # [layers, D, r], largest first
    return m @ v_r, v_r.transpose(-1, -2)


def stack_layer_groups(parts: list[Factors]) -> Factors:
    """Factors of consecutive layer groups of one matrix stack, as one stack (the layers concatenated)."""
    if not parts:
        raise ValueError("stack_layer_groups needs at least one group")
    if len({(p.rank, p.length, p.head_shape) for p in parts}) != 1:
        raise ValueError("layer groups must share rank, length and head shape")
    if parts[0].full is not None:
        return Factors(None, None, torch.cat([p.full for p in parts]), parts[0].head_shape)
    return Factors(torch.cat([p.a for p in parts]), torch.cat([p.b for p in parts]), None, parts[0].head_shape)


def stack_factors(factors: list[Factors], lo: int, hi: int,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[lo, hi)`` of several low-rank stacks as the kernels' ``A [Vn, layers, hi-lo, r]``, ``B [Vn, layers, r, D]``.

    Ranks may differ (short segments cap theirs): A and B are zero-padded to
    the largest, which leaves every product unchanged; rows past a stack's own
    length are zero. ``dtype`` defaults to the first stack's.
    """
    if not factors or any(f.full is not None for f in factors):
        raise ValueError("stack_factors needs one or more low-rank stacks; use stack_dense for full-dimension ones")
    f0 = factors[0]
    r = max(f.rank for f in factors)
    dtype = dtype or f0.a.dtype
    nl, dim = f0.num_layers, f0.b.shape[-1]
    # Zero padding is needed only where a stack is shorter or of lower rank than the widest.
    ragged = any(f.rank < r or f.length < hi for f in factors)
    fresh = torch.zeros if ragged else torch.empty
    a = fresh(len(factors), nl, hi - lo, r, dtype=dtype, device=f0.a.device)
    b = fresh(len(factors), nl, r, dim, dtype=dtype, device=f0.a.device)
    for i, f in enumerate(factors):  # NOTE: ragged lengths and ranks; one copy per stack, no arithmetic
        n = max(0, min(f.length, hi) - lo)
        a[i, :, :n, :f.rank] = f.a[:, lo:lo + n]
        b[i, :, :f.rank] = f.b
    return a, b


def stack_dense(factors: list[Factors], lo: int, hi: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``[lo, hi)`` of several stacks (any ranks) reconstructed as ``[Vn, layers, hi-lo, D]``, zero past each length."""
    f0 = factors[0]
    dim = f0.head_shape[0] * f0.head_shape[1]
    out = torch.zeros(len(factors), f0.num_layers, hi - lo, dim, dtype=dtype,
                      device=(f0.full if f0.full is not None else f0.a).device)
    for i, f in enumerate(factors):
        n = max(0, min(f.length, hi) - lo)
        if n:
            out[i, :, :n] = f.matrix(lo + n, dtype, start=lo)
    return out
