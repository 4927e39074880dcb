"""The estimate namespace of the radix tree: where assembled KV lives, and how to walk to it.

Why a namespace and not a flag: SGLang's tree keeps one child per (namespace,
first token) under a node, so an estimate of some tokens and the exact KV of
the same tokens cannot both hang under one parent. A flag on a shared node
would let a plain request match the estimate (it asked for exact KV), and a
plain request's exact KV inserted over it would be thrown away as a
duplicate while the request decoded on the estimate. So a request's rows
``[0, est_start)`` (exact) live in its own namespace (``extra_key``,
``cache_salt``) and rows ``[est_start, ...)`` (assembled, or computed on top
of something assembled) in the estimate namespace
``kvshare-est:<epoch>:<scope>:<setting>:<extra_key>`` with the same
``cache_salt``, as children of the exact node at ``est_start``. The reuse scope
keeps one workflow's estimates from another's; the epoch changes on every reset
and config change, so estimates made under old settings are never matched again
(they age out of the tree like any unused leaf); the setting (the request's
recompute rule) keeps a request from being served rows a looser rule left
assembled where its own recomputes them. SGLang's own code (plain match, insert, checkpoint) only ever
builds keys in the request's namespace, so it never reaches an estimate; the
parent-chain operations (locking, ``path_device_indices``, eviction of
leaves) work across the boundary unchanged.

Functions take the cache (a ``RadixCache``) and use only its tree helpers.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_kvshare.cache.registry import DEAD_ATTR
from sglang_kvshare.protocol import RESERVED_EXTRA_KEY_PREFIX

EST_PREFIX = RESERVED_EXTRA_KEY_PREFIX
RESERVED_ESCAPE = "client:"  # put before a client's extra_key that starts with EST_PREFIX


@dataclass(frozen=True)
class TreeNamespace:
    """Where one request's rows live: exact ones under SGLang's own key (``extra_key``, ``cache_salt``),
    estimates under ``est_extra_key`` (the request's reuse scope, the estimate epoch and its recompute rule)
    with the same salt."""

    extra_key: Optional[str]
    cache_salt: Optional[str]
    est_extra_key: str


def est_extra_key(extra_key: Optional[str], scope: str = "", epoch: int = 0, setting: str = "") -> str:
    """The extra key of the estimate namespace of (``extra_key``, a scope digest, an epoch, a setting)."""
    return f"{EST_PREFIX}{epoch}:{scope}:{setting}:{extra_key or ''}"


def is_estimate_node(node: TreeNode) -> bool:
    key = getattr(node, "key", None)
    extra = getattr(key, "extra_key", None)
    return isinstance(extra, str) and extra.startswith(EST_PREFIX)


def estimated_tokens_on_path(node: TreeNode) -> int:
    """Tokens of estimate-namespace nodes between ``node`` and the root."""
    total = 0
    while node is not None and node.parent is not None:
        if is_estimate_node(node):
            total += len(node.key)
        node = node.parent
    return total


def _key(tokens: Sequence[int], extra_key: Optional[str], cache_salt: Optional[str]) -> RadixKey:
    return RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)


def est_key(tokens: Sequence[int], ns: TreeNamespace) -> RadixKey:
    """The estimate-namespace key of ``tokens`` for a request of ``ns``."""
    return _key(tokens, ns.est_extra_key, ns.cache_salt)


def walk(cache: Any, tokens: Sequence[int], est_start: Optional[int],
         ns: TreeNamespace) -> tuple[int, TreeNode, list[torch.Tensor]]:
    """Match ``tokens`` exactly up to ``est_start``, then in the estimate namespace.

    Returns (matched length, last node, values along the path). Splits a node
    where the match ends inside it (as SGLang's own match does), so the last
    node always ends at the matched length.
    """
    exact_end = len(tokens) if est_start is None else min(est_start, len(tokens))
    values, node = cache._match_prefix_helper(cache.root_node, _key(tokens[:exact_end], ns.extra_key, ns.cache_salt))
    matched = sum(len(v) for v in values)
    if matched == exact_end < len(tokens):
        more, node = cache._match_prefix_helper(node, est_key(tokens[exact_end:], ns))
        values += more
        matched += sum(len(v) for v in more)
    return matched, node, values


def insert_estimate(cache: Any, parent: TreeNode, tokens: Sequence[int], value: torch.Tensor,
                    ns: TreeNamespace) -> tuple[int, TreeNode]:
    """Insert ``tokens`` with pool slots ``value`` below ``parent`` in the estimate namespace.

    Returns (tokens that were already there, last node). The caller frees its
    duplicate slots for the tokens already present.
    """
    return cache._insert_helper(parent, est_key(tokens, ns), value.to(torch.int64, copy=True), 0, 0)


def node_at(cache: Any, tokens: Sequence[int], est_start: Optional[int], ns: TreeNamespace) -> Optional[TreeNode]:
    """The node that ends exactly at ``len(tokens)`` (splitting one if needed), or None if absent."""
    matched, node, _ = walk(cache, tokens, est_start, ns)
    return node if matched == len(tokens) else None


def rows(node: TreeNode, start: int, end: int) -> Optional[torch.Tensor]:
    """Pool slots of rows ``[start, end)`` of the path ending at ``node`` (which ends at ``end``).

    Walks up only as far as ``start`` (no whole-path concatenation). None when
    the node was evicted.
    """
    if getattr(node, DEAD_ATTR, False):
        return None
    need = end - start
    parts: list[torch.Tensor] = []
    have = 0
    while have < need:
        if node is None or node.parent is None:
            return None  # the path is shorter than recorded: treat as lost
        parts.append(node.value)
        have += len(node.value)
        node = node.parent
    parts.reverse()
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[have - need:]


def touch(node: TreeNode, root: TreeNode) -> None:
    """Mark the path to ``node`` as just read, as SGLang's own match does (``last_access_time`` of every node
    up to the root, what its LRU orders eviction by).

    Why: a source read by non-prefix reuse is never matched as anyone's prefix; untouched, the LRU would take
    it for unused and evict it before the KV nobody reads.
    """
    now = time.monotonic()
    while node is not None and node is not root:
        node.last_access_time = now
        node = node.parent
    root.last_access_time = now


def insert_exact_then_estimate(cache: Any, req: Any, token_ids: Sequence[int], est_start: int,
                               kv_indices: torch.Tensor, ns: TreeNamespace) -> tuple[int, TreeNode]:
    """Insert a request's rows: ``[0, est_start)`` in its namespace, the rest as estimates.

    Returns (tokens the tree already had, last node), like SGLang's insert.
    """
    inserted = req.kv.cache_inserted_len
    head = cache.insert(InsertParams(key=_key(token_ids[:est_start], ns.extra_key, ns.cache_salt),
                                     value=kv_indices[:est_start].to(torch.int64, copy=True),
                                     inserted_len=min(inserted, est_start), priority=req.priority or 0))
    node = head.last_device_node
    if len(token_ids) == est_start:
        return head.prefix_len, node
    # NOTE: when part of the exact rows was new, nothing can hang below them yet,
    # so the estimate part is new too and the present rows stay one prefix.
    tail_len, node = insert_estimate(cache, node, token_ids[est_start:], kv_indices[est_start:len(token_ids)], ns)
    return head.prefix_len + tail_len, node
