"""Assembly: turn resolved segments into KV in the pool and estimate nodes in the tree.

Given a request whose prefix ``[0, m)`` is matched (ending at ``node``), it
walks the request's remaining segments in order, resolves as many as it can
(``Resolver``), stops at the first it cannot (the reason goes into the
report), allocates pool slots through SGLang's allocator (evicting through
the tree if needed), writes the K/V of every layer (``kv_writer``) and
inserts the rows in the tree's estimate namespace below ``node``
(``tree_paths``). Slots are given back if anything fails before the tree owns
them, so an error never leaks pool memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_kvshare.cache import tree_paths
from sglang_kvshare.cache.kv_pool_io import sync_device
from sglang_kvshare.cache.kv_writer import write_resolved
from sglang_kvshare.cache.registry import NamespaceRecords
from sglang_kvshare.cache.request_state import RequestPlan
from sglang_kvshare.cache.resolver import Resolution, Resolver, Unresolved, is_private_suffix

logger = logging.getLogger(__name__)


@dataclass
class Piece:
    """Rows ``[lo, hi)`` (segment-relative) of one segment, served by ``res``."""

    index: int
    lo: int
    hi: int
    res: Resolution


def head_len(seg, recompute_head: int) -> int:
    """Rows of ``seg`` prefilled densely before reuse starts (its recomputed head)."""
    return min(recompute_head, seg.length)


def plan_pieces(resolver: Resolver, records: NamespaceRecords, plan: RequestPlan, m: int, limit: int,
                locks: list, recompute_head: int = 0) -> list[Piece]:
    """Resolve segments from position ``m`` on, contiguously.

    Stops at the first segment it cannot resolve (its reason goes into the
    report), at a segment whose recomputed head (``recompute_head`` rows) has
    not been prefilled yet, or at ``limit``.
    """
    pieces: list[Piece] = []
    pos = m
    for o, seg in zip(plan.outcomes, plan.annotation.segments):
        if seg.end <= pos:
            continue
        if pos >= limit:
            break
        if is_private_suffix(plan, o):
            break  # prefilled densely by design (see resolver.is_private_suffix): no fallback
        head = head_len(seg, recompute_head)
        if pos < seg.start + head:
            break  # the head is prefilled densely first (staged prefill resumes after it)
        try:
            res = resolver.resolve(records, plan, o, locks)
        except Unresolved as exc:
            o.reason, o.resolved_by = exc.reason, "dense"
            break
        # A source may cover only a prefix of the segment (a producer's output
        # lacks the KV of its last token): resolve what it covers, then stop.
        row_end = min(seg.end, limit, seg.start + res.rows)
        if row_end <= pos:
            o.reason = "source_too_short"
            break
        lo, hi = pos - seg.start, row_end - seg.start
        pieces.append(Piece(o.index, lo, hi, res))
        o.resolved_by, o.reason, o.resolved_tokens = res.how, None, hi - lo
        o.head_recomputed = head or None
        pos = row_end
        if row_end < seg.end:
            o.reason = "partial" if row_end < limit else None
            break  # the last prompt token is always computed
    return pieces


def next_stage(plan: RequestPlan, a: int, limit: int, recompute_head: int, has_source,
               min_rows: int = 1) -> Optional[int]:
    """Where reuse can resume after a dense stretch starting at ``a``, or None.

    The first segment behind ``a`` whose head ends after ``a``, that leaves at
    least ``min_rows`` rows to reuse after its head (a stage costs a forward)
    and that has a copy to reuse (``has_source(outcome)``): reuse resumes right
    after its head. A segment whose head ends at or before ``a`` was just tried
    at ``a`` and failed, so it is prefilled whole. Mutates: segments passed
    over for want of a copy get the reason ``no_source``.
    """
    for o, seg in zip(plan.outcomes, plan.annotation.segments):
        if seg.end <= a:
            continue
        resume = seg.start + head_len(seg, recompute_head)
        if resume <= a or min(seg.end, limit) - resume < min_rows:
            continue
        if has_source(o):
            return resume
        if o.reason is None:
            o.reason = "no_source"  # passed over: prefilled in this dense stretch
    return None


def mark_matched(plan: RequestPlan, m: int) -> None:
    """Mark the segments inside the matched prefix ``[0, m)`` as served by the tree.

    On the first match every such segment; on a later one (the request waited,
    and another request of the same agent prefilled its system prompt
    meanwhile) only those the stale plan had left dense. Why plan again then:
    the old plan's dense stretch may end exactly where the new match ends, so no
    stage would resume reuse and the shared segments behind it would be
    prefilled densely, without a reason (session 10's CI failure).
    """
    for o, seg in zip(plan.outcomes, plan.annotation.segments):
        if seg.end <= m and (not plan.attempted or o.resolved_by == "dense"):
            # A segment inside estimates an earlier identical request left is served
            # approximate KV: reported apart from exact hits, and counted as reuse.
            on_estimate = plan.est_start is not None and seg.end > plan.est_start
            o.resolved_by, o.resolved_tokens = ("estimate_hit" if on_estimate else "hit"), o.tokens
            o.reason = None


def mark_unreached(plan: RequestPlan) -> None:
    """Give every shared segment prefilled densely without a recorded reason the reason ``not_reached``.

    Why: such a segment sat inside a dense stretch no stage resumed from (behind
    a miss, with staging off, or too short to be worth a stage). Without a
    reason it would be a silent miss: the report's ``fallbacks`` and the
    per-reason metric would not show why reuse was lower than the annotation
    allowed (session 10's CI failure was one such miss).
    """
    for o in plan.outcomes:
        if o.kind == "shared" and o.resolved_by == "dense" and o.reason is None:
            o.reason = "not_reached"


def alloc(cache: Any, n: int) -> Optional[torch.Tensor]:
    allocator = cache.token_to_kv_pool_allocator
    idx = allocator.alloc(n)
    if idx is None:
        cache.evict(EvictParams(num_tokens=n))
        idx = allocator.alloc(n)
    return idx


def write_and_insert(cache: Any, plan: RequestPlan, node: Any, m: int, pieces: list[Piece]) -> Optional[Any]:
    """Write every piece into fresh slots and insert them below ``node``; returns the new last node.

    None when the allocator could not provide the slots (nothing changed).
    On any error the fresh slots are freed before the error propagates.
    """
    end = m + sum(p.hi - p.lo for p in pieces)
    new_idx = alloc(cache, end - m)
    if new_idx is None:
        return None
    owned = False
    try:
        kvcache = cache.token_to_kv_pool_allocator.get_kvcache()
        with cache.counters.timed("write"):
            sync_device(new_idx)  # source rows a recent batch computed may still be in flight
            offset = 0
            for p in pieces:
                seg = plan.annotation.segments[p.index]
                write_resolved(kvcache, cache.spec, src_idx=p.res.src_idx,
                               dst_idx=new_idx[offset:offset + p.hi - p.lo], src_start=p.res.source.start,
                               dst_start=seg.start, lo=p.lo, hi=p.hi, correction=p.res.correction)
                offset += p.hi - p.lo
            sync_device(new_idx)  # the next forward (another stream) must see the rows
        with cache.counters.timed("insert"):
            present, last = tree_paths.insert_estimate(cache, node, plan.tokens[m:end], new_idx,
                                                       plan.namespace[0], plan.namespace[1])
        owned = True
        if present:  # part of it appeared meanwhile: give our duplicate slots back
            cache.token_to_kv_pool_allocator.free(new_idx[:present])
        return last
    finally:
        if not owned:
            cache.token_to_kv_pool_allocator.free(new_idx)
