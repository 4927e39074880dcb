"""Segments -> sources -> resolutions: how each segment of a request could be served without prefill.

For one segment the resolver finds a live copy of the same content in the
request's own namespace (a shared slot's latest materialization, or the
agent's own earlier copy of a private segment), locks it, and decides:

* ``alignment``: private segments, and every shared segment in ``fullshared``;
* ``correction``: ``kvcmas`` asks the estimator (gate on the slot's anchor
  pool) and gets a correction plan, or a reason to prefill densely.

It raises ``Unresolved`` with the reason that goes into the report. It never
touches the KV pool except to read the source rows the gate needs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from sglang_kvshare.cache import tree_paths
from sglang_kvshare.cache.kv_pool_io import ReadWorkspace, read_segment, sync_device
from sglang_kvshare.cache.registry import Materialization, NamespaceRecords
from sglang_kvshare.cache.request_state import RequestPlan, SegmentOutcome


@dataclass
class Resolution:
    """A resolved segment before it is written: where its source rows are, and the correction."""

    how: str  # alignment | correction
    source: Materialization
    src_idx: torch.Tensor  # pool slots of the source's rows
    correction: Optional[Any] = None  # correction.CorrectionPlan

    @property
    def rows(self) -> int:
        return int(self.src_idx.shape[0])


class Unresolved(Exception):
    """A segment could not be resolved; ``reason`` goes into the report."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_private_suffix(plan: RequestPlan, o: SegmentOutcome) -> bool:
    """The request's last segment, when private: always prefilled, never taken from another context.

    Why: generation starts right after it, so its KV conditions the answer more
    than any other, and the client marked it private (it asked for no reuse of
    it). An agent's own copy from an earlier request sits behind other shared
    text there; aligning it here served, e.g., a retrieval question's KV computed
    after another document, an approximation nobody asked for. Private segments
    in between (short connectors before a shared segment) are still aligned.
    """
    return o.index == len(plan.outcomes) - 1 and plan.annotation.segments[o.index].kind == "private"


class Resolver:
    """Resolves segments against the registry, the tree and the estimator of one cache."""

    def __init__(self, cache: Any, estimator: Callable[[], Any], lock: threading.RLock) -> None:
        self.cache = cache
        self._estimator = estimator
        self._lock = lock
        # The gate's copy of a source: read into reused buffers (the estimate keeps no reference).
        self._reads = ReadWorkspace()

    def candidates(self, records: NamespaceRecords, plan: RequestPlan, o: SegmentOutcome) -> list[Materialization]:
        """Copies of the segment's content, latest first, of this cache generation."""
        seg = plan.annotation.segments[o.index]
        if is_private_suffix(plan, o):
            return []
        if seg.kind == "shared":
            mats = records.slot(seg.slot).copies(plan.hashes[o.index])
        else:
            mats = records.private_copies(plan.agent_id, plan.hashes[o.index])
        return [m for m in mats if m.generation == self.cache.kvshare_generation]

    def resolve(self, records: NamespaceRecords, plan: RequestPlan, o: SegmentOutcome,
                locks: list) -> Resolution:
        """Find a live source and decide how to reuse it, or raise ``Unresolved``.

        Mutates: ``locks`` gets the source node (the caller unlocks it after
        writing); ``o`` gets the source agent, gate entropy and pool size.
        """
        seg = plan.annotation.segments[o.index]
        mats = self.candidates(records, plan, o)
        if not mats:
            raise Unresolved("no_source")
        with self.cache.counters.timed("locate"):
            for source in mats:  # latest first; skip copies the tree has evicted
                src_idx = tree_paths.rows(source.node, source.start, source.end)
                if src_idx is not None:
                    break
            else:
                raise Unresolved("source_evicted")
        self.cache.inc_lock_ref(source.node)
        locks.append(source.node)
        o.source_agent = source.agent_name
        mode = self.cache.kvshare_config.mode
        if seg.kind == "private" or mode == "fullshared":
            return Resolution("alignment", source, src_idx)
        return self._correct(plan, o, seg, source, src_idx)

    def _correct(self, plan: RequestPlan, o: SegmentOutcome, seg, source: Materialization,
                 src_idx: torch.Tensor) -> Resolution:
        from sglang_kvshare.correction import SegmentCache

        counters = self.cache.counters
        with counters.timed("read_source"):
            sync_device(src_idx)  # the source rows may still be in flight (overlap scheduling)
            k_src, v_src = read_segment(self.cache.token_to_kv_pool_allocator.get_kvcache(), src_idx,
                                        workspace=self._reads)
        src_cache = SegmentCache(k_src, v_src, source.start, source.agent, exact=source.exact)
        with counters.timed("gate_estimate"), self._lock:
            estimator = self._estimator()
            est = estimator.estimate((plan.namespace, seg.slot), src_cache, plan.agent_id, seg.start)
        o.pool_anchors = est.pool_anchors
        o.entropy = None if est.entropy is None else float(est.entropy)
        if not est.accepted:
            raise Unresolved(est.reason)
        return Resolution("correction", source, src_idx, est.plan)
