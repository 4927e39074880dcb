"""The sparse extend's parts without a server: the attention with queries at their positions, and the fold."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_kvshare.cache.recompute import PendingRecompute
from sglang_kvshare.cache.plan import PLAN_ATTR, RequestState
from sglang_kvshare.server.sparse_extend import (Fold, fold_batch, owed_rows, queries_moved, settle,
                                                 sparse_sdpa_extend)
from tests.kv_pools import scattered_pool

HEADS, KV_HEADS, DIM = 4, 2, 8


def _pool(seq_lens: list[int], seed: int = 0):
    return scattered_pool(seq_lens, KV_HEADS, DIM, seed)


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, scale: float):
    """Attention of queries ``q [n, H, D]`` at ``pos`` over ``keys [s, KVH, D]``, one softmax per query."""
    rep = HEADS // KV_HEADS
    k, v = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    out = torch.empty_like(q)
    for j, p in enumerate(pos.tolist()):
        logits = torch.einsum("hd,shd->hs", q[j], k[:p + 1]) * scale
        out[j] = torch.einsum("hs,shd->hd", logits.softmax(-1), v[:p + 1])
    return out


def test_queries_at_the_end_equal_sglangs_own_extend():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    seq_lens, ext = [9, 6], [4, 6]
    k, v, table = _pool(seq_lens)
    q = torch.randn(sum(ext), HEADS, DIM)
    args = (k, v, table, torch.tensor([0, 1]), torch.tensor(seq_lens), torch.tensor([5, 0]), torch.tensor(ext))
    ours = sparse_sdpa_extend(q, torch.empty_like(q), *args, scaling=0.3, enable_gqa=True, causal=True,
                              positions=torch.cat([torch.arange(5, 9), torch.arange(0, 6)]))
    stock = TorchNativeAttnBackend._run_sdpa_forward_extend(SimpleNamespace(), q, torch.empty_like(q), *args,
                                                            scaling=0.3, enable_gqa=True, causal=True)
    torch.testing.assert_close(ours, stock)


def test_scattered_queries_attend_to_every_row_up_to_their_position():
    seq_lens = [12, 7]
    k, v, table = _pool(seq_lens, seed=1)
    positions = [torch.tensor([0, 3, 4, 10, 11]), torch.tensor([2, 5, 6])]
    q = torch.randn(sum(len(p) for p in positions), HEADS, DIM)
    out = sparse_sdpa_extend(q, torch.empty_like(q), k, v, table, torch.tensor([0, 1]), torch.tensor(seq_lens),
                             torch.tensor([7, 4]), torch.tensor([5, 3]), scaling=0.5, enable_gqa=True, causal=True,
                             positions=torch.cat(positions))
    start = 0
    for i, pos in enumerate(positions):
        rows = table[i, :seq_lens[i]]
        want = _reference(q[start:start + len(pos)], k[rows], v[rows], pos, 0.5)
        torch.testing.assert_close(out[start:start + len(pos)], want, rtol=1e-5, atol=1e-5)
        start += len(pos)


def test_only_causal_self_attention_is_served():
    k, v, table = _pool([3])
    q = torch.randn(1, HEADS, DIM)
    with pytest.raises(ValueError, match="causal"):
        sparse_sdpa_extend(q, torch.empty_like(q), k, v, table, torch.tensor([0]), torch.tensor([3]),
                           torch.tensor([2]), torch.tensor([1]), causal=False, positions=torch.tensor([2]))


def _req(tokens: list[int], rows: list[int], owed=None):
    state = RequestState([], sparse_rows=list(rows), owed=owed)
    req = SimpleNamespace(full_untruncated_fill_ids=tokens)
    setattr(req, PLAN_ATTR, SimpleNamespace(state=state))
    return req, state


def _batch(reqs, prefix_lens, extend_lens, logprob_starts=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    ids = torch.cat([torch.tensor(r.full_untruncated_fill_ids[p:p + n]) for r, p, n in zip(reqs, prefix_lens,
                                                                                             extend_lens)])
    return SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs, prefix_lens=list(prefix_lens),
                           extend_lens=list(extend_lens), input_ids=ids, prefill_input_ids_cpu=ids.clone(),
                           out_cache_loc=torch.arange(100, 100 + sum(extend_lens)),
                           req_pool_indices=torch.tensor([0, 1]), req_pool_indices_cpu=torch.tensor([0, 1]),
                           extend_num_tokens=sum(extend_lens), extend_logprob_start_lens=logprob_starts)


def test_fold_puts_owed_rows_in_front_of_each_extend_at_their_true_positions():
    owed = PendingRecompute()
    a, plan_a = _req(list(range(10, 30)), [2, 3, 4, 17], owed)  # 17 lies beyond the prefix: a later forward's
    b, plan_b = _req(list(range(50, 60)), [], owed)
    table = torch.arange(200).reshape(2, 100)
    owed.owe(table[0, [2, 3, 4, 17]].tolist())
    batch = _batch([a, b], prefix_lens=[12, 6], extend_lens=[3, 4], logprob_starts=[2, 3])
    before = (batch.input_ids.clone(), batch.out_cache_loc.clone(), list(batch.prefix_lens))

    fold = owed_rows(batch)
    assert fold.rows == [[2, 3, 4], []] and plan_a.prefill_forwards == plan_b.prefill_forwards == 1
    folded, positions = fold_batch(batch, fold, table)
    assert folded.input_ids.tolist() == [12, 13, 14, 22, 23, 24, 56, 57, 58, 59]
    assert folded.prefill_input_ids_cpu.tolist() == folded.input_ids.tolist()
    assert folded.out_cache_loc.tolist() == [2, 3, 4, 100, 101, 102, 103, 104, 105, 106]
    assert positions.tolist() == [2, 3, 4, 12, 13, 14, 6, 7, 8, 9]
    assert folded.prefix_lens == [9, 6] and folded.extend_lens == [6, 4] and folded.extend_num_tokens == 10
    assert folded.extend_logprob_start_lens == [5, 3]  # logprobs stay those of the request's own tokens
    # The scheduler's batch is left as it was.
    assert torch.equal(batch.input_ids, before[0]) and torch.equal(batch.out_cache_loc, before[1])
    assert batch.prefix_lens == before[2]

    assert settle(batch, fold, table) is owed
    assert plan_a.sparse_rows == [17] and plan_a.sparse_recomputed == 3 and len(owed) == 1


def test_a_forward_without_owed_rows_is_left_to_sglang():
    a, plan = _req(list(range(10)), [7])
    batch = _batch([a, _req(list(range(10)), [])[0]], prefix_lens=[5, 5], extend_lens=[2, 2])
    assert owed_rows(batch) is None and plan.prefill_forwards == 1  # row 7 is not below the prefix yet
    assert Fold([[], []]).total == 0


def test_a_forward_is_sparse_exactly_when_a_query_sits_off_its_prefix_plus_index():
    lens, prefix = torch.tensor([3, 2]), torch.tensor([4, 0])
    fb = SimpleNamespace(extend_seq_lens=lens, extend_prefix_lens=prefix, extend_start_loc=torch.tensor([0, 3]),
                         positions=torch.tensor([4, 5, 6, 0, 1]))
    assert not queries_moved(fb)
    fb.positions = torch.tensor([1, 5, 6, 0, 1])  # a folded row in front of the first request's extend
    assert queries_moved(fb)
    fb.positions, fb.extend_start_loc = torch.tensor([4, 5, 6, 0, 1]), None  # the start offsets derived
    assert not queries_moved(fb)
