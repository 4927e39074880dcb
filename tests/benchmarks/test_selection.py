"""The offline row policies and the one-forward sparse recompute (tiny random Llama, no server)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import KV, prefill, recompute_rows
from benchmarks.research import row_policies as sel
from sglang_kvshare.correction import RopeSpec, materialize

torch.set_num_threads(1)


def _setup(tiny, seed: int = 1):
    """A prefix, a segment's ids, its exact KV there, and the KV another context gave it, re-aligned."""
    g = torch.Generator().manual_seed(seed)
    prefix_ids = torch.randint(0, 128, (13,), generator=g).tolist()
    seg = torch.randint(0, 128, (40,), generator=g).tolist()
    prefix, _ = prefill(tiny, prefix_ids)
    exact, _ = prefill(tiny, seg, prefix)
    other, _ = prefill(tiny, torch.randint(0, 128, (21,), generator=g).tolist())
    src, _ = prefill(tiny, seg, other)
    k, v = materialize(src.k, src.v, other.length, prefix.length, None, RopeSpec.from_hf_config(tiny.config))
    return prefix_ids, prefix, seg, exact, KV(k, v)


@torch.no_grad()
def test_recomputing_every_row_gives_the_dense_kv(tiny):
    _, prefix, seg, exact, reused = _setup(tiny)
    out = recompute_rows(tiny, prefix, seg, reused, torch.arange(len(seg)))
    torch.testing.assert_close(out.k, exact.k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.v, exact.v, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_a_sparse_recompute_keeps_the_other_rows_and_fixes_what_it_recomputes(tiny):
    _, prefix, seg, exact, reused = _setup(tiny)
    chosen = torch.tensor([3, 17, 30])
    out = recompute_rows(tiny, prefix, seg, reused, chosen)
    rest = torch.ones(len(seg), dtype=torch.bool)
    rest[chosen] = False
    torch.testing.assert_close(out.k[:, rest], reused.k[:, rest])  # untouched
    torch.testing.assert_close(out.k[0, chosen], exact.k[0, chosen], atol=1e-5, rtol=1e-4)  # layer 0: exact
    err_before = (reused.v[:, chosen] - exact.v[:, chosen]).norm()
    err_after = (out.v[:, chosen] - exact.v[:, chosen]).norm()
    assert err_after < 0.5 * err_before


@torch.no_grad()
def test_tail_attention_is_the_models_own_attention_from_the_tail(tiny):
    prefix_ids, prefix, seg, exact, _ = _setup(tiny)
    tail = [5, 9, 77, 3]
    scores = sel.tail_attention(tiny, prefix, exact, tail, probe_layers=(1,))
    out = tiny(input_ids=torch.tensor([prefix_ids + seg + tail]), output_attentions=True)
    p, s = len(prefix_ids), len(seg)
    want = out.attentions[1][0, :, p + s:, p:p + s].float().mean(dim=(0, 1))
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-4)
    chosen = sel.top_rows(sel.tail_attention(tiny, prefix, exact, tail, probe_layers=(1,)), 0.1)
    assert set(chosen.tolist()) == set(torch.topk(want, 4).indices.tolist())
    mixed = sel.top_rows(scores, 0.2, head_share=0.5)  # 8 rows: 4 + 4
    rest = want.clone()
    rest[:4] = -1
    assert mixed.tolist()[:4] == [0, 1, 2, 3]
    assert set(mixed.tolist()[4:]) == set(torch.topk(rest, 4).indices.tolist())


@torch.no_grad()
def test_the_deviation_probe_scores_how_far_each_reused_row_lies_from_its_own_context(tiny):
    _, prefix, seg, exact, reused = _setup(tiny)
    # Layer 1 of the dense KV with two rows pushed off: those two score highest, whatever the other layers hold.
    k, v = exact.k.clone(), exact.v.clone()
    k[1, 11] += 2.0
    v[1, 25] -= 2.0
    scores = sel.kv_deviation_scores(tiny, prefix, seg, KV(k, v))
    assert set(torch.topk(scores, 2).indices.tolist()) == {11, 25}
    # An aligned row is exact at layer 0, so the probe's layer 1 is the dense one: its score is the true distance.
    dk = (reused.k[1] - exact.k[1]).pow(2).sum(dim=(1, 2))
    dv = (reused.v[1] - exact.v[1]).pow(2).sum(dim=(1, 2))
    torch.testing.assert_close(sel.kv_deviation_scores(tiny, prefix, seg, reused), dk / dk.mean() + dv / dv.mean(),
                               atol=1e-3, rtol=1e-3)
    # The policy keeps the head, then takes the rows that deviate most.
    chosen = sel.choose("head_kv_deviation", tiny, prefix, seg, reused, [], 0.2, 0)  # 8 rows: the first 4, then 4
    dev = sel.kv_deviation_scores(tiny, prefix, seg, reused)
    dev[:4] = -1
    assert chosen.tolist()[:4] == [0, 1, 2, 3]
    assert set(chosen.tolist()[4:]) == set(torch.topk(dev, 4).indices.tolist())
    with pytest.raises(ValueError, match="past the model"):
        sel.kv_deviation_scores(tiny, prefix, seg, reused, check_layer=99)


def test_budgets_and_simple_policies():
    assert sel.budget(40, 0.15) == 6 and sel.budget(3, 0.01) == 1 and sel.budget(5, 1.0) == 5
    r = sel.select_random(40, 0.2, seed=3)
    assert len(r) == 8 and r.tolist() == sorted(set(r.tolist())) and sel.select_random(40, 0.2, 3).equal(r)
    assert sel.top_rows(torch.tensor([0.1, 0.9, 0.3, 0.8]), 0.5).tolist() == [1, 3]
    with pytest.raises(ValueError, match="unknown row policy"):
        sel.choose("nope", None, None, [1], None, [], 0.5, 0)
    with pytest.raises(ValueError, match="ratio"):
        sel.budget(10, 0.0)


def test_the_correction_policy_picks_the_rows_the_correction_moves_most():
    g = torch.Generator().manual_seed(0)
    aligned = KV(torch.randn(2, 10, 2, 4, generator=g), torch.randn(2, 10, 2, 4, generator=g))
    k, v = aligned.k.clone(), aligned.v.clone()
    k[:, 7] += 3.0  # the pool moves row 7's keys and row 2's values most; rows past every anchor not at all
    v[:, 2] -= 2.0
    k[:, 4] += 0.1
    chosen = sel.choose("correction", None, None, list(range(10)), KV(k, v), [], 0.2, 0, aligned)
    assert chosen.tolist() == [2, 7]
    assert sel.correction_size(aligned, aligned).abs().max() == 0  # no correction, no preference


def test_the_correction_policy_runs_on_kvcmas_and_the_others_on_fullshared():
    from benchmarks import fidelity as fid

    arms = {a.label: a for a in fid.make_arms(RopeSpec.default(8), 0.3, 32, 256, [], [],
                                              select_policies=("correction", "head"), select_ratios=(0.15,))}
    ours, head = arms["select_correction_r0.15"], arms["select_head_r0.15"]
    assert ours.mode == "kvcmas" and ours.select == ("correction", 0.15) and ours.tau == 0.3
    assert head.mode == "fullshared" and head.select == ("head", 0.15)
