"""Factor storage: exact byte accounting and optimal truncation."""

from __future__ import annotations

import pytest
import torch

from sglang_kvshare.correction import factor_nbytes, factorize


@pytest.mark.parametrize("nl,length,heads,hd,rank,dtype", [
    (3, 37, 3, 64, 8, torch.float32), (2, 301, 2, 16, 32, torch.float16), (1, 5, 1, 8, 32, torch.float32),
    (4, 64, 3, 64, None, torch.bfloat16)])
def test_bytes_are_r_times_L_plus_D_per_matrix(gen, nl, length, heads, hd, rank, dtype):
    x = torch.randn(nl, length, heads, hd, generator=gen).to(dtype)
    f = factorize(x, rank)
    d, item = heads * hd, x.element_size()
    expected = nl * length * d * item if rank is None else nl * min(rank, length, d) * (length + d) * item
    assert f.nbytes() == expected == factor_nbytes(nl, length, d, rank, item)
    if rank is not None:
        r = min(rank, length, d)
        assert f.a.shape == (nl, length, r) and f.b.shape == (nl, r, d) and f.a.dtype == dtype


def test_full_rank_factors_are_exact_and_truncation_is_optimal(gen):
    x = torch.randn(2, 40, 2, 8, generator=gen)
    torch.testing.assert_close(factorize(x, 16).reconstruct(), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(factorize(x, None).reconstruct(), x)
    f = factorize(x, 4)
    s = torch.linalg.svdvals(x.reshape(2, 40, 16))
    resid = (f.reconstruct() - x).reshape(2, -1).pow(2).sum(1)
    torch.testing.assert_close(resid, s[:, 4:].pow(2).sum(1), rtol=1e-4, atol=1e-4)
    rnd = factorize(x, 4, method="randomized", niter=6)
    resid_rnd = (rnd.reconstruct() - x).reshape(2, -1).pow(2).sum(1)
    assert torch.all(resid_rnd <= resid * 1.05)
    gram = factorize(x, 4, method="gram")  # the server's learner: exact, from the D x D Gram matrix
    resid_gram = (gram.reconstruct() - x).reshape(2, -1).pow(2).sum(1)
    torch.testing.assert_close(resid_gram, resid, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gram.reconstruct(), f.reconstruct(), rtol=1e-4, atol=1e-4)
    # Partial reconstruction returns the leading rows.
    torch.testing.assert_close(f.reconstruct(rows=7), f.reconstruct()[:, :7])


def test_gram_method_on_tall_kv_is_the_optimal_truncation_and_leaves_the_rng_alone(gen):
    """The server's learner path (D = 192 > 2 * (r + 8): the subspace iteration, not the full eigensolve)."""
    u = torch.randn(2, 300, 24, generator=gen) * torch.logspace(0, -2, 24)
    x = (u @ torch.randn(2, 24, 192, generator=gen) + 0.01 * torch.randn(2, 300, 192, generator=gen)).view(2, 300, 3, 64)
    exact = (factorize(x, 8).reconstruct() - x).pow(2).sum()
    state = torch.get_rng_state()
    first = factorize(x, 8, method="gram")
    assert torch.equal(torch.get_rng_state(), state)
    assert (first.reconstruct() - x).pow(2).sum() <= exact * (1 + 1e-4)
    assert torch.equal(factorize(x, 8, method="gram").a, first.a)  # deterministic
