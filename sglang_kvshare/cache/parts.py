"""What one cache's pipeline steps and admin view share, in one bundle the adapter builds.

Why a bundle: the pipeline, the recorder, the resolver and the admin view
each read a few of the same objects; passing them as one frozen value keeps
every constructor to one argument and makes plain what a step may touch. None
of it is the adapter: SGLang's tree reaches the steps as ``SGLangTree``, which
calls ``RadixCache``'s own methods only, so no step can call back into the
adapter (its overrides and kvshare attributes are out of reach).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, InsertResult
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sglang_kvshare.cache.correction_state import CorrectionState
from sglang_kvshare.cache.kv_pool_io import ReadWorkspace
from sglang_kvshare.cache.registry import ContentHasher, PlaceholderRegistry
from sglang_kvshare.cache.retention import Retention
from sglang_kvshare.counters import Counters
from sglang_kvshare.learning.learner import Learner


class SGLangTree:
    """SGLang's radix tree and pools as the steps use them: ``RadixCache``'s methods on one cache's tree.

    Each method is ``RadixCache``'s own (not an override of the cache it
    wraps), except where SGLang itself dispatches (``evict`` deletes leaves
    through the cache's ``_delete_leaf`` hook, as SGLang's eviction always does).
    """

    def __init__(self, cache: RadixCache) -> None:
        self._cache = cache
        self.token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator = cache.token_to_kv_pool_allocator
        self.req_to_token_pool: ReqToTokenPool = cache.req_to_token_pool

    @property
    def root_node(self) -> TreeNode:
        return self._cache.root_node

    def inc_lock_ref(self, node: TreeNode) -> Any:
        return RadixCache.inc_lock_ref(self._cache, node)

    def dec_lock_ref(self, node: TreeNode) -> Any:
        return RadixCache.dec_lock_ref(self._cache, node)

    def evict(self, params: EvictParams) -> Any:
        return RadixCache.evict(self._cache, params)

    def path_device_indices(self, node: TreeNode) -> torch.Tensor:
        return RadixCache.path_device_indices(self._cache, node)

    def evictable_size(self) -> int:
        return RadixCache.evictable_size(self._cache)

    def protected_size(self) -> int:
        return RadixCache.protected_size(self._cache)

    def insert(self, params: InsertParams) -> InsertResult:
        return RadixCache.insert(self._cache, params)

    def _match_prefix_helper(self, node: TreeNode, key: RadixKey) -> tuple[list[torch.Tensor], TreeNode]:
        return RadixCache._match_prefix_helper(self._cache, node, key)

    def _insert_helper(self, node: TreeNode, key: RadixKey, value: torch.Tensor, priority: int = 0,
                       inserted_len: int = 0) -> tuple[int, TreeNode]:
        return RadixCache._insert_helper(self._cache, node, key, value, priority, inserted_len)


@dataclass(frozen=True)
class CacheParts:
    """``tree``: SGLang's tree, walks, locks, KV pool, allocator and request table (``SGLangTree``)."""

    tree: SGLangTree
    state: CorrectionState  # the config and estimator in force
    registry: PlaceholderRegistry  # where each content's copies live
    learner: Learner
    counters: Counters
    hasher: ContentHasher
    reads: ReadWorkspace  # the gate's reused read buffers (scheduler thread only)
    retention: Retention  # which KV the tree evicts first (the recorder marks the copies it keeps)
    pool_saver: Optional[Any] = None  # pool_persistence.PoolSaver of --kvshare-pool-file (None: no file)
