"""A KV pool for attention tests without a server: each request's rows at shuffled slots, as SGLang's allocator
leaves them, so a test that reads rows by position through ``req_to_token`` cannot pass by reading them in order."""

from __future__ import annotations

import torch


def scattered_pool(seq_lens: list[int], kv_heads: int, dim: int, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K pool, V pool, ``req_to_token``): three unused slots first, then every request's rows, shuffled."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    k = torch.randn(total + 3, kv_heads, dim, generator=g)
    v = torch.randn(total + 3, kv_heads, dim, generator=g)
    slots = torch.randperm(total, generator=g) + 3
    table = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int64)
    off = 0
    for i, s in enumerate(seq_lens):
        table[i, :s] = slots[off:off + s]
        off += s
    return k, v, table
