"""Head recompute (the served row policy) of the offline fidelity harness (tiny random Llama, no server)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import KV, prefill
from benchmarks.fidelity import coarse_errors, head_rows, splice
from sglang_kvshare.correction import RopeSpec, materialize

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
