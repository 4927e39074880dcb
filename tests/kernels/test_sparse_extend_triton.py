"""The sparse extend on SGLang's triton backend: its custom mask, run through SGLang's own extend kernel (GPU, or
the Triton interpreter on CPU), gives the torch-native sparse extend's attention; the hooks swap the metadata
and the kernel's prefix masking for a sparse forward only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_kvshare.server.sparse_extend import sparse_sdpa_extend
from sglang_kvshare.server.sparse_extend_triton import (MOVED_ATTR, RequestLayout, after_triton_init_forward_metadata,
                                                        around_triton_forward_extend, mask_metadata,
                                                        request_layouts, request_mask)
from tests.kv_pools import scattered_pool

HEADS, KV_HEADS, DIM = 4, 2, 16


def test_layouts_read_the_own_run_from_the_positions():
    # request 0: rows 2 and 5 folded in front of its own tokens 9..11; request 1: nothing folded
    layouts = request_layouts([2, 5, 9, 10, 11, 4, 5, 6], [5, 3], [12, 7])
    assert layouts == [RequestLayout(prefix=9, extend=5, folded=2), RequestLayout(prefix=4, extend=3, folded=0)]
    # a folded row just below the request's tokens joins their run: the same attention
    assert request_layouts([1, 8, 9, 10], [4], [11]) == [RequestLayout(prefix=8, extend=4, folded=1)]
    with pytest.raises(ValueError, match="last position"):
        request_layouts([1, 2, 3], [3], [9])


def test_the_mask_lets_a_folded_row_see_the_prefix_up_to_itself_and_own_tokens_everything_before_them():
    mask = request_mask(torch.tensor([2, 5, 9, 10, 11]), RequestLayout(prefix=9, extend=5, folded=2))
    assert mask.shape == (5, 14)
    assert mask[0, :9].tolist() == [True] * 3 + [False] * 6 and not mask[0, 9:].any()  # row at 2: keys 0..2
    assert mask[1, :9].tolist() == [True] * 6 + [False] * 3 and not mask[1, 9:].any()
    assert mask[2, :9].all() and mask[2, 9:].tolist() == [False, False, True, False, False]
    assert mask[4, :9].all() and mask[4, 9:].tolist() == [False, False, True, True, True]


def _pool(seq_lens, seed=0):
    return scattered_pool(seq_lens, KV_HEADS, DIM, seed)


@pytest.mark.triton
def test_sglangs_triton_kernel_with_the_mask_equals_the_torch_native_sparse_extend(device):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    seq_lens = [40, 23]
    positions = torch.tensor([0, 7, 8, 21, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39,  # 4 folded, 10 own
                              3, 4, 11, 18, 19, 20, 21, 22])  # 3 folded, 5 own
    extend = [14, 8]
    k_buf, v_buf, table = _pool(seq_lens, seed=3)
    q = torch.randn(sum(extend), HEADS, DIM, generator=torch.Generator().manual_seed(4))
    pool_rows = [0, 1]
    want = sparse_sdpa_extend(q, torch.empty_like(q), k_buf, v_buf, table, torch.tensor(pool_rows),
                              torch.tensor(seq_lens), torch.tensor([s - e for s, e in zip(seq_lens, extend)]),
                              torch.tensor(extend), scaling=DIM ** -0.5, enable_gqa=True, causal=True,
                              positions=positions)

    meta = mask_metadata(positions, extend, seq_lens, table.to(device), pool_rows)
    # SGLang writes the extend rows' KV to their slots before the kernel; k_extend / v_extend are those rows.
    locs = torch.cat([table[i, positions[s:s + n]] for i, (s, n) in enumerate(zip([0, extend[0]], extend))])
    qo = torch.tensor([0, extend[0], sum(extend)], dtype=torch.int32, device=device)
    out = torch.empty_like(q, device=device)
    extend_attention_fwd(q.to(device), k_buf[locs].to(device), v_buf[locs].to(device), out, k_buf.to(device),
                         v_buf.to(device), qo, meta.kv_indptr, meta.kv_indices, meta.custom_mask, True,
                         meta.mask_indptr, max(extend), 1.0, 1.0, sm_scale=DIM ** -0.5,
                         skip_prefix_custom_mask=False)
    torch.testing.assert_close(out.cpu(), want, rtol=2e-3, atol=2e-3)


def _forward_batch(positions, extend, seq_lens):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lens = torch.tensor(extend)
    return SimpleNamespace(forward_mode=ForwardMode.EXTEND, positions=positions, extend_seq_lens=lens,
                           extend_seq_lens_cpu=list(extend), extend_start_loc=torch.cumsum(lens, 0) - lens,
                           extend_prefix_lens=torch.tensor([s - e for s, e in zip(seq_lens, extend)]),
                           seq_lens_cpu=torch.tensor(seq_lens), req_pool_indices=torch.tensor([0, 1]))


def test_the_hooks_replace_the_metadata_and_unmask_nothing_for_a_stock_forward():
    from sglang.srt.layers.attention.triton_backend import ForwardMetadata

    _, _, table = _pool([12, 7])
    stock_meta = ForwardMetadata(*([None] * 13))
    backend = SimpleNamespace(forward_metadata=stock_meta, req_to_token=table, extend_attention_fwd=None)
    calls = []
    backend.extend_attention_fwd = lambda *a, **kw: calls.append(kw.get("skip_prefix_custom_mask", True))

    def original(self, q, k, v, layer, forward_batch):
        self.extend_attention_fwd()
        return "out"

    layer = SimpleNamespace(sliding_window_size=-1)
    # a stock forward (positions = prefix + arange): SGLang's metadata and kernel call stay as they were
    stock = _forward_batch(torch.cat([torch.arange(8, 12), torch.arange(4, 7)]), [4, 3], [12, 7])
    after_triton_init_forward_metadata(None, backend, stock)
    assert backend.forward_metadata is stock_meta and not getattr(backend, MOVED_ATTR)
    around_triton_forward_extend(original, backend, None, None, None, layer, stock)
    # a sparse forward: the mask metadata, and the kernel told to mask the prefix keys, for that call only
    sparse = _forward_batch(torch.tensor([2, 5, 9, 10, 11, 4, 5, 6]), [5, 3], [12, 7])
    after_triton_init_forward_metadata(None, backend, sparse)
    assert getattr(backend, MOVED_ATTR) and backend.forward_metadata.custom_mask is not None
    assert backend.forward_metadata.kv_indptr.tolist() == [0, 9, 13]
    assert backend.forward_metadata.kv_indices.tolist() == table[0, :9].tolist() + table[1, :4].tolist()
    assert around_triton_forward_extend(original, backend, None, None, None, layer, sparse) == "out"
    assert calls == [True, False]
    backend.extend_attention_fwd()
    assert calls == [True, False, True]  # restored


@pytest.mark.parametrize("args, hf, graph, reason", [
    ({}, {}, "disabled", None),
    ({}, {"sliding_window": 4096}, "disabled", "sliding-window"),
    ({"enable_deterministic_inference": True}, {}, "disabled", "deterministic"),
    ({"dcp_size": 2}, {}, "disabled", "context parallelism"),
    ({}, {}, "breakable", "--disable-prefill-cuda-graph"),
])
def test_triton_serves_the_sparse_extend_except_where_its_kernel_cannot_take_the_mask(monkeypatch, args, hf, graph,
                                                                                      reason):
    import sglang.srt.runtime_context as rc

    from sglang_kvshare.server.sparse_extend import unsupported_reason

    monkeypatch.setattr(rc, "attention_backends", lambda: ("triton", "triton"))
    monkeypatch.setattr(rc, "get_server_args", lambda: SimpleNamespace(**args))
    prefill = SimpleNamespace(prefill=SimpleNamespace(backend=graph))
    monkeypatch.setattr(rc, "get_exec", lambda: SimpleNamespace(graph=SimpleNamespace(cuda_graph_config=prefill)))
    got = unsupported_reason(SimpleNamespace(hf_config=SimpleNamespace(**hf)))
    assert got is None if reason is None else reason in got
