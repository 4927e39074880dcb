"""The third step of a request's path: write the resolved pieces into the pool and the tree.

Allocates pool slots through SGLang's allocator (evicting through the tree if
needed), writes the K/V of every layer (``kv_writer``: the kernels
dispatcher) and inserts the rows in the tree's estimate namespace below the
matched node (``tree_paths``). Slots are given back if anything fails before
the tree owns them, so an error never leaks pool memory.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_kvshare.cache import tree_paths
from sglang_kvshare.cache.kv_pool_io import sync_device
from sglang_kvshare.cache.kv_writer import write_resolved
from sglang_kvshare.cache.plan import RequestPlan
from sglang_kvshare.cache.resolve import Piece
from sglang_kvshare.counters import Counters


def alloc(tree: Any, n: int) -> Optional[torch.Tensor]:
    """``n`` fresh pool slots from SGLang's allocator, evicting tree leaves once if needed; None if none."""
    allocator = tree.token_to_kv_pool_allocator
    idx = allocator.alloc(n)
    if idx is None:
        tree.evict(EvictParams(num_tokens=n))
        idx = allocator.alloc(n)
    return idx


def write_and_insert(tree: Any, spec: Any, counters: Counters, plan: RequestPlan, node: Any, m: int,
                     pieces: list[Piece]) -> Optional[Any]:
    """Write every piece into fresh slots and insert them below ``node``; returns the new last node.

    ``tree`` is SGLang's ``RadixCache``; ``spec`` the model's ``RopeSpec``. None
    when the allocator could not provide the slots (nothing changed). On any
    error the fresh slots are freed before the error propagates.
    """
    end = m + sum(p.hi - p.lo for p in pieces)
    new_idx = alloc(tree, end - m)
    if new_idx is None:
        return None
    owned = False
    try:
        kvcache = tree.token_to_kv_pool_allocator.get_kvcache()
        with counters.timed("write"):
            sync_device(new_idx)  # source rows a recent batch computed may still be in flight
            offset = 0
            for p in pieces:
                seg = plan.annotation.segments[p.index]
                dst_idx = new_idx[offset:offset + p.hi - p.lo]
                write_resolved(kvcache, spec, src_idx=p.res.src_idx, dst_idx=dst_idx, src_start=p.res.source.start,
                               dst_start=seg.start, lo=p.lo, hi=p.hi, correction=p.res.correction)
                offset += p.hi - p.lo
            sync_device(new_idx)  # the next forward (another stream) must see the rows
        with counters.timed("insert"):
            present, last = tree_paths.insert_estimate(tree, node, plan.tokens[m:end], new_idx, plan.tree_ns)
        owned = True
        if present:  # part of it appeared meanwhile: give our duplicate slots back
            tree.token_to_kv_pool_allocator.free(new_idx[:present])
        return last
    finally:
        if not owned:
            tree.token_to_kv_pool_allocator.free(new_idx)

