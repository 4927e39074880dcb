"""Head recompute (the served row policy) and the research plan variants of the offline fidelity harness (tiny
random Llama, no server)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import KV, prefill
from benchmarks.fidelity import coarse_errors, head_rows, splice
from benchmarks.research.fidelity_variants import compose, first_rows, keys_only, layers_only
from sglang_kvshare.correction import CorrectionPlan, RopeSpec, factorize, materialize

torch.set_num_threads(1)


def test_dense_head_prefill_equals_the_exact_rows_it_replaces(tiny):
    """Why the harness may splice rows: a dense prefill of ids[:K] behind the prefix is the exact cache's head."""
    g = torch.Generator().manual_seed(1)
    prefix_ids = torch.randint(0, 128, (13,), generator=g).tolist()
    seg = torch.randint(0, 128, (40,), generator=g).tolist()
    prefix, _ = prefill(tiny, prefix_ids)
    exact, _ = prefill(tiny, seg, prefix)
    head, _ = prefill(tiny, seg[:8], prefix)
    torch.testing.assert_close(head.k, exact.k[:, :8], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(head.v, exact.v[:, :8], atol=1e-5, rtol=1e-4)
    # another context's cache, re-aligned, differs in the head; the splice removes exactly that error
    other, _ = prefill(tiny, torch.randint(0, 128, (21,), generator=g).tolist())
    src, _ = prefill(tiny, seg, other)
    spec = RopeSpec.from_hf_config(tiny.config)
    k, v = materialize(src.k, src.v, other.length, prefix.length, None, spec)
    before = coarse_errors(k, v, exact.k, exact.v)
    assert head_rows(40, 8) == list(range(8)) and head_rows(40, 0, 0.15) == list(range(6)) and head_rows(40) == []
    spliced = splice(KV(k, v), KV(torch.cat([head.k, exact.k[:, 8:]], 1), torch.cat([head.v, exact.v[:, 8:]], 1)),
                     head_rows(40, 8))
    k2, v2 = spliced.k, spliced.v
    after = coarse_errors(k2, v2, exact.k, exact.v)
    assert before[0][0] > 1e-3 and before[0][1] > 1e-3
    assert after[0][0] < 1e-5 and after[0][1] < 1e-5  # rows 0-4 now exact
    assert after[2] == pytest.approx(before[2])  # rows 16+ untouched
    torch.testing.assert_close(k2[:, 8:], k[:, 8:])


def _plan(length: int, layers: int = 3, vn: int = 2) -> CorrectionPlan:
    g = torch.Generator().manual_seed(2)
    dk = [factorize(torch.randn(layers, length, 2, 16, generator=g), 4) for _ in range(vn)]
    dv = [factorize(torch.randn(layers, length, 2, 16, generator=g), 4) for _ in range(vn)]
    w = torch.full((length, vn), 1.0 / vn)
    return CorrectionPlan(dk, dv, w, w.clone(), length)


def test_plan_variants_leave_exactly_the_excluded_parts_aligned(tiny):
    spec = RopeSpec.from_hf_config(tiny.config)
    g = torch.Generator().manual_seed(3)
    src_k, src_v = torch.randn(3, 30, 2, 16, generator=g), torch.randn(3, 30, 2, 16, generator=g)
    plan = _plan(30)
    ak, av = materialize(src_k, src_v, 5, 17, None, spec)
    ck, cv = materialize(src_k, src_v, 5, 17, plan, spec)
    assert not torch.allclose(ck, ak) and not torch.allclose(cv, av)

    k, v = materialize(src_k, src_v, 5, 17, keys_only(plan), spec)
    torch.testing.assert_close(k, ck)
    torch.testing.assert_close(v, av)

    k, v = materialize(src_k, src_v, 5, 17, first_rows(10)(plan), spec)
    torch.testing.assert_close(k[:, :10], ck[:, :10])
    torch.testing.assert_close(k[:, 10:], ak[:, 10:])
    torch.testing.assert_close(v[:, 10:], av[:, 10:])

    k, v = materialize(src_k, src_v, 5, 17, layers_only([2], [0], 3)(plan), spec)
    torch.testing.assert_close(k[2], ck[2])
    torch.testing.assert_close(k[:2], ak[:2])
    torch.testing.assert_close(v[0], cv[0])
    torch.testing.assert_close(v[1:], av[1:])

    k, v = materialize(src_k, src_v, 5, 17, compose(keys_only, first_rows(4))(plan), spec)
    torch.testing.assert_close(k[:, :4], ck[:, :4])
    torch.testing.assert_close(k[:, 4:], ak[:, 4:])
    torch.testing.assert_close(v, av)
