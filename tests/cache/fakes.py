"""A fake KV pool, allocator and request table, and a mini scheduler, for cache unit tests.

Why fakes here: the cache's contract with SGLang is narrow (allocator alloc /
free, the pool's per-layer K/V buffers, the request-to-token table, the
request fields the tree reads), and exercising assembly, locking, eviction
and slot accounting through a live server takes minutes. These fakes follow
SGLang 0.5.23's interfaces for exactly what the cache touches; ``MiniScheduler``
drives one request through match -> prefill -> checkpoint -> release the way
SGLang's scheduler does (``match_kv_cache``, ``checkpoint_kv_cache``,
``release_kv_cache``).

"Dense prefill" writes K/V that depend on the whole prefix (a hash of the
context), so a test can tell exact rows from estimated ones.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_kvshare.cache.adapter import KVShareRadixCache
from sglang_kvshare.config import KVShareConfig

LAYERS, HEADS, HEAD_DIM = 2, 1, 8


class FakeKVCache:
    """Per-layer K and V buffers indexed by pool slot (like SGLang's MHATokenToKVPool)."""

    def __init__(self, size: int) -> None:
        self.layer_num = LAYERS
        self.start_layer = 0
        self.k = [torch.zeros(size + 1, HEADS, HEAD_DIM) for _ in range(LAYERS)]
        self.v = [torch.zeros(size + 1, HEADS, HEAD_DIM) for _ in range(LAYERS)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]


class FakeAllocator:
    """Slot allocator with SGLang's method names; slot 0 is reserved like SGLang's padding slot."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.page_size = 1
        self.device = "cpu"
        self.free_slots = list(range(1, size + 1))
        self.kvcache = FakeKVCache(size)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, idx: torch.Tensor) -> None:
        values = [int(i) for i in idx.tolist()]
        assert not set(values) & set(self.free_slots), "double free"
        self.free_slots.extend(values)

    def free_segment(self, idx: torch.Tensor, *, start_pos: int) -> None:
        self.free(idx)

    def get_kvcache(self) -> FakeKVCache:
        return self.kvcache


class FakeReqToTokenPool:
    def __init__(self, rows: int, width: int) -> None:
        self.req_to_token = torch.zeros(rows, width, dtype=torch.int64)
        self.free_rows = list(range(rows))

    def write(self, where, values) -> None:
        row, cols = where
        self.req_to_token[row, cols] = values


_rids = itertools.count()


@dataclass
class FakeReq:
    """The request fields the tree reads and writes."""

    origin_input_ids: list[int]
    custom_params: Optional[dict] = None
    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None
    rid: str = field(default_factory=lambda: f"r{next(_rids)}")
    output_ids: list[int] = field(default_factory=list)
    priority: int = 0
    customized_info: Optional[dict] = None
    lock: Any = None
    last_node: Any = None
    done: bool = False

    def __post_init__(self) -> None:
        self.sampling_params = SimpleNamespace(custom_params=self.custom_params)
        self.kv = SimpleNamespace(req_pool_idx=None, cache_inserted_len=0, cache_protected_len=0, swa_evict_floor=0,
                                  kv_allocated_len=0, kv_committed_len=0)
        self.prefix_len = 0
        self.stages = 0

    def _compute_max_prefix_len(self, input_len: int) -> int:
        return max(input_len - 1, 0)

    @property
    def full_untruncated_fill_ids(self) -> array:
        return array("q", list(self.origin_input_ids) + list(self.output_ids))

    def finished(self) -> bool:
        return self.done

    def report(self) -> Optional[dict]:
        return (self.customized_info or {}).get("kvshare", [None])[0]


def dense_kv(tokens: Sequence[int], pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of token ``pos`` computed "densely": a function of the whole prefix up to it."""
    g = torch.Generator().manual_seed(hash(tuple(int(t) for t in tokens[: pos + 1])) % (2**31))
    return torch.randn(LAYERS, HEADS, HEAD_DIM, generator=g), torch.randn(LAYERS, HEADS, HEAD_DIM, generator=g)


def make_cache(mode: str = "fullshared", pool_tokens: int = 512, sparse_unsupported: Optional[str] = "not_checked",
               pool_store: Optional[Any] = None, reducer: Optional[Any] = None, row_policy: Optional[Any] = None,
               req_width: int = 256, **config) -> KVShareRadixCache:
    from transformers import LlamaConfig

    allocator = FakeAllocator(pool_tokens)
    params = CacheInitParams(disable=False, req_to_token_pool=FakeReqToTokenPool(8, req_width),
                             token_to_kv_pool_allocator=allocator, page_size=1)
    hf = LlamaConfig(hidden_size=HEADS * HEAD_DIM * 2, num_attention_heads=2, num_key_value_heads=HEADS,
                     head_dim=HEAD_DIM, num_hidden_layers=LAYERS, rope_theta=10000.0)
    # NOTE: the gate's own minimum (two anchors per edge), so a test reaches a correction after two contents;
    # tests of the learning rule set edge_anchors themselves. Whole segments of any length are reused (the
    # tests' segments are short); tests of the recompute share or the length rule set them.
    cfg = KVShareConfig(mode=mode, **{"learn_async": False, "edge_anchors": 2, "recompute_ratio": 0.0,
                                      "min_reuse_tokens": 0, **config})
    return KVShareRadixCache(params, config=cfg, model_config=SimpleNamespace(hf_config=hf),
                             sparse_unsupported=sparse_unsupported, reducer=reducer, pool_store=pool_store,
                             **({"row_policy": row_policy} if row_policy is not None else {}))


class MiniScheduler:
    """One request at a time through the cache, the way SGLang's scheduler drives it."""

    def __init__(self, cache: KVShareRadixCache) -> None:
        self.cache = cache

    def match(self, req: FakeReq) -> int:
        tokens = req.full_untruncated_fill_ids
        key = RadixKey(tokens, req.extra_key, limit=len(tokens) - 1, cache_salt=req.cache_salt)
        res = self.cache.match_prefix(MatchPrefixParams(key=key, req=req))
        req.last_node = res.last_device_node
        return res.device_prefix_len

    def run(self, req: FakeReq, new_tokens: int = 0, output: Sequence[int] = ()) -> int:
        """Match, prefill the rest densely, checkpoint, decode ``new_tokens`` (the tokens ``output``, when
        given; else 1000, 1001, ...), release.

        Returns the matched prefix length.
        """
        new_tokens = len(output) or new_tokens
        cache, pool = self.cache, self.cache.req_to_token_pool
        m = self.match(req)
        req.prefix_len = m
        req.lock = cache.lock(req.last_node)
        req.kv.req_pool_idx = pool.free_rows.pop()
        req.kv.cache_protected_len = m
        row = pool.req_to_token[req.kv.req_pool_idx]
        row[:m] = cache.path_device_indices(req.last_node)[:m]
        total = len(req.origin_input_ids)
        pos = m
        while True:  # SGLang's chunked prefill, cut where the cache asks (staged prefill)
            end = cache.kvshare_stage_end(req, pos) or total
            self._prefill(req, pos, end)
            if end >= total:
                break
            req.stages += 1
            cache.checkpoint(req, up_to=end)  # stash_chunked_request
            req.prefix_len = end
            cache.kvshare_resume(req)  # the hook before add_chunked_req
            pos = req.prefix_len
        cache.checkpoint(req, up_to=total)
        for t in range(new_tokens):
            req.output_ids.append(int(output[t]) if output else 1000 + t)
            if t < new_tokens - 1:  # the last sampled token never runs through the model
                self._prefill(req, len(req.full_untruncated_fill_ids) - 1, len(req.full_untruncated_fill_ids))
        req.done = True
        self.release(req)
        return m

    def _prefill(self, req: FakeReq, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        allocator = self.cache.token_to_kv_pool_allocator
        idx = allocator.alloc(hi - lo)
        if idx is None:  # as SGLang does: evict unlocked tree leaves, then retry
            self.cache.evict(EvictParams(num_tokens=hi - lo))
            idx = allocator.alloc(hi - lo)
        assert idx is not None, "fake pool exhausted"
        row = self.cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        row[lo:hi] = idx
        tokens = req.full_untruncated_fill_ids
        for j, slot in zip(range(lo, hi), idx.tolist()):
            k, v = dense_kv(tokens, j)
            for layer in range(LAYERS):
                allocator.kvcache.k[layer][slot] = k[layer]
                allocator.kvcache.v[layer][slot] = v[layer]
        req.kv.owned = hi

    def release(self, req: FakeReq) -> None:
        cache = self.cache
        owned = len(req.full_untruncated_fill_ids) - 1 if req.output_ids else len(req.origin_input_ids)
        cache.checkpoint(req, up_to=owned)
        row = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        if owned > req.kv.cache_protected_len:
            cache.token_to_kv_pool_allocator.free(row[req.kv.cache_protected_len:owned])
        cache.unlock(req.lock)
        req.lock = None
        cache.on_release(req, checkpointed=True)
        cache.req_to_token_pool.free_rows.append(req.kv.req_pool_idx)
