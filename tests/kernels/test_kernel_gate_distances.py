"""gate_sq_distances and token_distances: kernels vs references, references vs explicit reconstruction."""

from __future__ import annotations

import math

import pytest
import torch
from helpers_kernels import DTYPE_TOLS

from sglang_kvshare.kernels import (gate_from_sq_distances, gate_sq_distances, gate_sq_distances_dense, token_distances,
                                    token_distances_dense, token_gate_distances, token_weights)
from sglang_kvshare.kernels.reference import gate_sq_distances_reference, token_distances_reference

# (layers, k, kv_heads * head_dim, rank, Vn): k not a multiple of the 32-row tile,
# D of 1..8 heads of 64 or 128, ranks 8..64, Vn 1..20.
CASES = [
    (2, 37, 192, 32, 10),
    (1, 50, 128, 8, 1),
    (3, 17, 512, 64, 3),
    (2, 9, 64, 16, 20),
    (1, 70, 1024, 24, 2),
]


def make_factors(layers, k, D, r, vn, dtype, device, gen):
    A = 0.5 * torch.randn(vn, layers, k, r, generator=gen)
    B = torch.randn(vn, layers, r, D, generator=gen) / r**0.5
    # X near anchor 0 so the cancellation in the expansion is exercised.
    X = (A[0] @ B[0]) + 0.2 * torch.randn(layers, k, D, generator=gen)
    return X.to(dtype).to(device), A.to(dtype).to(device), B.to(dtype).to(device)


def _scale(X, A, B):
    """Magnitude of the terms the expansion subtracts: the error of any fp32 evaluation is relative to it."""
    x, a, b = X.double(), A.double(), B.double()
    return ((x * x).sum() + ((a @ b) ** 2).sum(dim=(1, 2, 3))).float()


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
@pytest.mark.parametrize("dtype", [t[0] for t in DTYPE_TOLS], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[f"NL{c[0]}-k{c[1]}-D{c[2]}-r{c[3]}-V{c[4]}" for c in CASES])
def test_distances_match_float64_reference(case, dtype, backend, device, gen):
    """The kernel and the CPU path (both fp32) against the float64 yardstick, on the same inputs."""
    X, A, B = make_factors(*case, dtype, device, gen)
    d2 = gate_sq_distances(X, A, B, backend=backend)
    assert d2.dtype == torch.float32 and d2.shape == (case[4],)
    # Only fp32-vs-float64 accumulation differs, whatever the input dtype; the expansion's
    # error is relative to ||X||^2 + ||A B||^2, not to d2 (see gate_distances.py).
    want = gate_sq_distances_reference(X, A, B)
    assert torch.all((d2 - want).abs() <= 1e-5 * _scale(X, A, B) + 1e-4), (d2, want)
    dist = token_distances(X, A, B, backend=backend)
    assert dist.dtype == torch.float32 and dist.shape == (case[1], case[4])
    torch.testing.assert_close(dist, token_distances_reference(X, A, B), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
@pytest.mark.parametrize("case", CASES, ids=[f"NL{c[0]}-k{c[1]}-D{c[2]}-r{c[3]}-V{c[4]}" for c in CASES])
def test_token_gate_distances_is_both_ops_on_the_gate_rows(case, backend, device, gen, monkeypatch):
    """One pass (CPU) or two kernels (GPU): the token distances of every row and the gate of the first g."""
    from sglang_kvshare.kernels import reference

    monkeypatch.setattr(reference, "_BLOCK_BYTES", 4096)  # several row blocks, a shorter last one
    X, A, B = make_factors(*case, torch.float32, device, gen)
    for g in (0, 1, case[1] // 2, case[1]):
        dist, d2 = token_gate_distances(X, A, B, g, backend=backend)
        torch.testing.assert_close(dist, token_distances_reference(X, A, B), atol=1e-5, rtol=1e-5)
        want = gate_sq_distances_reference(X[:, :g], A[:, :, :g], B) if g else torch.zeros(case[4])
        assert d2.shape == (case[4],) and torch.all((d2 - want).abs() <= 1e-5 * _scale(
            X[:, :g], A[:, :, :g], B) + 1e-4), (g, d2, want)


@pytest.mark.parametrize("case", CASES[:3])
def test_references_match_explicit_reconstruction(case, gen):
    X, A, B = make_factors(*case, torch.float64, "cpu", gen)
    anchors = A @ B  # [Vn, layers, k, D], materialized on purpose
    d2 = ((X.unsqueeze(0) - anchors) ** 2).sum(dim=(1, 2, 3))
    torch.testing.assert_close(gate_sq_distances_reference(X, A, B).double(), d2, atol=1e-4, rtol=1e-6)
    dist = (X.unsqueeze(0) - anchors).abs().mean(dim=(1, 3)).t()  # [k, Vn]
    torch.testing.assert_close(token_distances_reference(X, A, B).double(), dist, atol=1e-6, rtol=1e-6)


@pytest.mark.triton
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_zero_anchors(backend, device, gen):
    X = torch.randn(2, 10, 64, generator=gen).to(device)
    A, B = torch.zeros(0, 2, 10, 8, device=device), torch.zeros(0, 2, 8, 64, device=device)
    assert gate_sq_distances(X, A, B, backend=backend).shape == (0,)
    assert token_distances(X, A, B, backend=backend).shape == (10, 0)


def test_gate_and_weights():
    g, h = gate_from_sq_distances(torch.tensor([4.0, 4.0, 4.0]))
    torch.testing.assert_close(g, torch.full((3,), 1 / 3))
    assert h == pytest.approx(1.0)
    g, h = gate_from_sq_distances(torch.tensor([0.0, 1e4]))
    assert g[0] > 0.999 and 0 <= h < 0.01
    d = torch.tensor([1.0, 2.0])
    g, h = gate_from_sq_distances(d**2, temperature=2.0)
    p = torch.softmax(-d / 2.0, 0)
    assert h == pytest.approx(float(-(p * p.log2()).sum() / math.log2(2)))
    w = token_weights(torch.rand(7, 4))
    torch.testing.assert_close(w.sum(1), torch.ones(7))
    with pytest.raises(ValueError, match="two anchors"):
        gate_from_sq_distances(torch.tensor([1.0]))


def test_bad_factor_shapes_raise():
    with pytest.raises(ValueError, match="sliced to the first k"):
        gate_sq_distances(torch.randn(2, 10, 64), torch.randn(3, 2, 12, 8), torch.randn(3, 2, 8, 64), backend="torch")


@pytest.mark.triton
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_precomputed_gram_gives_the_same_distances(backend, device, gen):
    """An anchor's cached Gram term (sum_layers ||A B||^2) replaces the kernel's own Gram products."""
    X, A, B = make_factors(2, 37, 192, 32, 4, torch.float32, device, gen)
    gram = ((A.double() @ B.double()) ** 2).sum(dim=(1, 2, 3))
    got = gate_sq_distances(X, A, B, gram, backend=backend)
    want = gate_sq_distances_reference(X, A, B)  # float64 yardstick, Gram computed inside
    assert torch.all((got - want).abs() <= 1e-5 * _scale(X, A, B) + 1e-4), (got, want)
    with pytest.raises(ValueError, match="gram"):
        gate_sq_distances(X, A, B, gram[:2], backend=backend)


def test_dense_anchor_distances_match_explicit(gen):
    X = torch.randn(2, 9, 64, generator=gen)
    F = [torch.randn(2, n, 64, generator=gen) for n in (9, 14, 5)]
    d2 = gate_sq_distances_dense(X, F[:2])
    torch.testing.assert_close(d2, torch.stack([((X - f[:, :9]) ** 2).sum() for f in F[:2]]))
    dist = token_distances_dense(X, F)
    padded = [torch.cat([f[:, :9], torch.zeros(2, max(0, 9 - f.shape[1]), 64)], dim=1) for f in F]
    torch.testing.assert_close(dist, torch.stack([(X - f).abs().mean(dim=(0, 2)) for f in padded], dim=1))


def test_token_weights_respect_anchor_lengths():
    dist = torch.rand(6, 3)
    w = token_weights(dist, 1.0, torch.tensor([6, 2, 4]))
    torch.testing.assert_close(w.sum(1), torch.ones(6))
    assert torch.all(w[2:, 1] == 0) and torch.all(w[4:, 2] == 0) and torch.all(w[4:, 0] == 1)
    torch.testing.assert_close(w[:2], token_weights(dist[:2]))
