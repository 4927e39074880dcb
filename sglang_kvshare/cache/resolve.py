"""The second step of a request's path: which segments can be served without prefill, and how.

For one segment the ``Resolver`` finds a live copy of the same content in the
request's own namespace (a shared slot's latest materialization, or the
agent's own earlier copy of a private segment), locks it, and decides:

* ``alignment``: private segments, and every shared segment in ``fullshared``;
* ``correction``: ``kvcmas`` asks the estimator (gate on the slot's anchor
  pool) and gets a correction plan, or a reason to prefill densely; while a
  pool cannot correct an edge yet, ``alignment`` for the contents that do not
  teach it (``Resolver._align_while_learning``).

``resolve_segments`` walks a request's segments in order from the matched
prefix on and stops at the first it cannot serve; the reason goes into the
segment's outcome (``Unresolved``). It never writes the KV pool; it reads only
the source rows the gate needs. ``next_stage`` says where staged prefill can
resume reuse after a dense stretch.
"""

from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from sglang_kvshare.cache import tree_paths
from sglang_kvshare.cache.kv_pool_io import read_segment, sync_device
from sglang_kvshare.cache.outcome import SegmentOutcome
from sglang_kvshare.cache.parts import CacheParts
from sglang_kvshare.cache.plan import RequestPlan
from sglang_kvshare.cache.recompute import RecomputeRule
from sglang_kvshare.cache.registry import Materialization, NamespaceRecords
from sglang_kvshare.correction import MIN_GATE_ANCHORS

COLD_REASONS = ("too_few_anchors", "no_edge")  # the gate cannot weigh anchors yet (not: it weighed and refused)


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


@dataclass
class Piece:
    """Rows ``[lo, hi)`` (segment-relative) of one segment, served by ``res``.

    ``recompute``: the segment-relative rows of ``[lo, hi)`` assembled here but
    owed a recompute by the request's next forward (the sparse extend).
    """

    index: int
    lo: int
    hi: int
    res: Resolution
    recompute: tuple[int, ...] = ()


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
    return o.index == len(plan.state.outcomes) - 1 and plan.annotation.segments[o.index].kind == "private"


def prefilled_by_request(plan: RequestPlan, o: SegmentOutcome) -> bool:
    """The segment is prefilled in the request's own context by design: its private suffix, or a shared
    segment the client marked ``reuse: false``."""
    return is_private_suffix(plan, o) or not plan.annotation.segments[o.index].reuse


def candidates(records: NamespaceRecords, plan: RequestPlan, o: SegmentOutcome,
               generation: int) -> list[Materialization]:
    """Copies of the segment's content, latest first, of the registry's current ``generation``."""
    seg = plan.annotation.segments[o.index]
    if prefilled_by_request(plan, o):
        return []
    if seg.kind == "shared":
        mats = records.slot(seg.slot).copies(plan.hashes[o.index])
    else:
        mats = records.private_copies(plan.agent_id, plan.hashes[o.index])
    return [m for m in mats if m.generation == generation]


class Resolver:
    """Resolves segments against the copy records, the tree and the estimator of one cache.

    Keeps one read workspace, so it serves one thread (the scheduler's).
    """

    def __init__(self, parts: CacheParts) -> None:
        self.tree = parts.tree  # SGLang's RadixCache: its locks and KV pool
        self.state = parts.state  # the config and estimator in force
        self.counters = parts.counters
        self.learner = parts.learner  # what is queued for learning (the cold-pool rule)
        # The gate's copy of a source: read into reused buffers (the estimate keeps no reference).
        self._reads = parts.reads

    def resolve(self, records: NamespaceRecords, plan: RequestPlan, o: SegmentOutcome, locks: list,
                generation: int) -> Resolution:
        """Find a live source and decide how to reuse it, or raise ``Unresolved``.

        Mutates: ``locks`` gets the source node (the caller unlocks it after
        writing); ``o`` gets the source agent, gate entropy and pool size.
        """
        seg = plan.annotation.segments[o.index]
        mats = candidates(records, plan, o, generation)
        if not mats:
            raise Unresolved("no_source")
        with self.counters.timed("locate"):
            for source in mats:  # latest first; skip copies the tree has evicted
                src_idx = tree_paths.rows(source.node, source.start, source.end)
                if src_idx is not None:
                    break
            else:
                raise Unresolved("source_evicted")
        self.tree.inc_lock_ref(source.node)
        locks.append(source.node)
        tree_paths.touch(source.node, self.tree.root_node)  # read: the LRU must not take it for unused
        # NOTE: a report names the source's agent only to the same workflow (with --kvshare-reuse-scope salt or
        # salt-required a source may belong to another one, whose agent names are not this client's to see).
        o.source_agent = source.agent_name if source.workflow == plan.workflow else None
        if seg.kind == "private" or self.state.config.mode == "fullshared":
            return Resolution("alignment", source, src_idx)
        return self._correct(plan, o, seg, source, src_idx)

    def _correct(self, plan: RequestPlan, o: SegmentOutcome, seg: Any, source: Materialization,
                 src_idx: torch.Tensor) -> Resolution:
        from sglang_kvshare.correction import SegmentCache

        with self.counters.timed("read_source"):
            sync_device(src_idx)  # the source rows may still be in flight (overlap scheduling)
            k_src, v_src = read_segment(self.tree.token_to_kv_pool_allocator.get_kvcache(), src_idx,
                                        workspace=self._reads)
        src_cache = SegmentCache(k_src, v_src, source.start, source.agent, exact=source.exact)
        with self.counters.timed("gate_estimate"), self.state.lock:
            est = self.state.estimator.estimate((plan.namespace, seg.slot), src_cache, plan.agent_id, seg.start)
        o.pool_anchors = est.pool_anchors
        o.entropy = None if est.entropy is None else float(est.entropy)
        if not est.accepted:
            if est.reason in COLD_REASONS and self._align_while_learning(plan, o, seg, source, est.edge_anchors):
                o.gate_fallback = est.reason
                self.counters.add("cold_pool_aligned")
                return Resolution("alignment", source, src_idx)
            raise Unresolved(est.reason)
        return Resolution("correction", source, src_idx, est.plan)

    def _align_while_learning(self, plan: RequestPlan, o: SegmentOutcome, seg: Any, source: Materialization,
                              edge_anchors: int) -> bool:
        """True: align this segment while its edge learns; False: prefill it densely, so that it teaches the pool.

        Why: the pool learns only from dense prefills, and it corrects an edge
        only once it holds ``--kvshare-edge-anchors`` contents for it; until
        then alignment is the better estimate (``KVShareConfig.edge_anchors``).
        The first two contents of an edge teach (without them nothing is
        learned), then every content whose tokens' checksum is even, until the
        observations queued or learned reach the target; a content the pool
        already holds for this edge teaches nothing and is aligned. The rule
        reads only the tokens and the pool, so every tensor-parallel rank
        decides alike. Learning waits for lulls in serving, so an observation
        may still be queued: it counts as learned.
        """
        config = self.state.config
        if not config.cold_pool_align or config.tau <= 0:
            return False  # tau 0: the operator wants no correction, and so no stand-in for one
        have = edge_anchors + self.learner.queued_for((plan.namespace, seg.slot), source.agent, plan.agent_id)
        if have >= config.effective_edge_anchors:
            return True
        if have < MIN_GATE_ANCHORS:
            return False
        with self.state.lock:
            known = self.state.estimator.has_observation((plan.namespace, seg.slot), plan.hashes[o.index],
                                                         source.agent, plan.agent_id)
        if known:
            return True
        return not teaches(plan.tokens[seg.start:seg.end])


def teaches(tokens: Any) -> bool:
    """Half of all contents, chosen by their tokens alone (the same on every rank and in every run)."""
    return zlib.crc32(array("q", (int(t) for t in tokens)).tobytes()) % 2 == 0


def resolve_segments(resolver: Resolver, records: NamespaceRecords, plan: RequestPlan, m: int, limit: int,
                     locks: list, generation: int, head: RecomputeRule = RecomputeRule()) -> list[Piece]:
    """Resolve segments from position ``m`` on, contiguously; the pieces to write, in order.

    Stops at the first segment it cannot resolve (its reason goes into the
    report), at a segment whose head must first be prefilled as a stage
    (``head.stage_rows``), or at ``limit``. With the sparse extend a piece
    covers its segment's head too (``Piece.recompute``, chosen by
    ``head.chosen``): the outcome counts those rows in ``head_recomputed`` and
    only the others as reused. Mutates the outcomes of
    the segments it reaches.
    """
    pieces: list[Piece] = []
    pos = m
    for o, seg in zip(plan.state.outcomes, plan.annotation.segments):
        if seg.end <= pos:
            continue
        if pos >= limit:
            break
        if prefilled_by_request(plan, o):
            break  # prefilled densely by design (see prefilled_by_request): no fallback
        if not head.reusable(seg):
            o.reason, o.resolved_by = "short_segment", "dense"
            break
        if pos < seg.start + head.stage_rows(seg):
            break  # the head is prefilled densely first (staged prefill resumes after it)
        try:
            res = resolver.resolve(records, plan, o, locks, generation)
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
        with resolver.counters.timed("select"):
            owed = head.chosen(seg, res.correction, lo, hi)
        pieces.append(Piece(o.index, lo, hi, res, owed))
        o.resolved_by, o.reason, o.resolved_tokens = res.how, None, hi - lo - len(owed)
        o.head_recomputed = head.rows(seg) or None
        pos = row_end
        if row_end < seg.end:
            o.reason = "partial" if row_end < limit else None
            break  # the last prompt token is always computed
    return pieces


def next_stage(plan: RequestPlan, a: int, limit: int, head: RecomputeRule,
               has_source: Callable[[SegmentOutcome], bool], min_rows: int = 1) -> Optional[int]:
    """Where reuse can resume after a dense stretch starting at ``a``, or None.

    The first segment behind ``a`` whose head ends after ``a``, that leaves at
    least ``min_rows`` rows to reuse after its head (a stage costs a forward)
    and that has a copy to reuse (``has_source(outcome)``): reuse resumes right
    after its head. A segment whose head ends at or before ``a`` was just tried
    at ``a`` and failed, so it is prefilled whole. Mutates: segments passed
    over for want of a copy get the reason ``no_source``, segments too short to reuse
    (``RecomputeRule.reusable``) ``short_segment``.
    """
    for o, seg in zip(plan.state.outcomes, plan.annotation.segments):
        if seg.end <= a or prefilled_by_request(plan, o):
            continue  # behind, or prefilled by design (no fallback, so no reason either)
        if not head.reusable(seg):
            o.reason = o.reason or "short_segment"  # prefilled in this dense stretch by the length rule
            continue
        resume = seg.start + head.stage_rows(seg)
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
    prefilled densely, without a reason.
    """
    for o, seg in zip(plan.state.outcomes, plan.annotation.segments):
        if seg.end <= m and (not plan.state.attempted or o.resolved_by == "dense"):
            # A segment inside estimates an earlier identical request left is served
            # approximate KV: reported apart from exact hits, and counted as reuse.
            on_estimate = plan.state.est_start is not None and seg.end > plan.state.est_start
            o.resolved_by, o.resolved_tokens = ("estimate_hit" if on_estimate else "hit"), o.tokens
            o.reason = None


def mark_unreached(plan: RequestPlan) -> None:
    """Give every shared segment prefilled densely without a recorded reason the reason ``not_reached``.

    Why: such a segment sat inside a dense stretch no stage resumed from (behind
    a miss, with staging off, or too short to be worth a stage). Without a
    reason it would be a silent miss: the report's ``fallbacks`` and the
    per-reason metric would not show why reuse was lower than the annotation
    allowed.
    """
    for o in plan.state.outcomes:
        if o.kind == "shared" and o.resolved_by == "dense" and o.reason is None and not prefilled_by_request(plan, o):
            o.reason = "not_reached"


def mark_unsupported(plan: RequestPlan) -> None:
    """Every segment prefilled densely without a reason gets ``model_unsupported`` (kvshare cannot serve it)."""
    for o in plan.state.outcomes:
        if o.resolved_by == "dense" and o.reason is None:
            o.reason = "model_unsupported"


def mark_alloc_failed(plan: RequestPlan, pieces: list[Piece]) -> None:
    """The pieces resolved could not be given pool slots: their segments are prefilled densely."""
    for p in pieces:
        o = plan.state.outcomes[p.index]
        o.resolved_by, o.reason, o.resolved_tokens, o.head_recomputed = "dense", "alloc_failed", 0, None


def mark_dense_from(plan: RequestPlan, m: int, reason: str, *, exact_before: bool) -> None:
    """The plan as served when the cache falls back to dense prefill from row ``m`` on.

    Every segment past ``m`` is prefilled densely; a shared one without a reason of its own gets ``reason``.
    ``exact_before``: ``[0, m)`` is the tree's exact prefix (a fallback at the match), so the segments inside it
    are hits; otherwise (a fallback between two stages) they keep how they were served. Why: the report and the
    stats count what was served, not what was assembled and then not used.
    """
    plan.state.est_start, plan.state.sparse_rows, plan.state.next_stage = None, [], None
    if exact_before:
        plan.state.exact_len, plan.state.estimate_len = m, 0
    for o, seg in zip(plan.state.outcomes, plan.annotation.segments):
        if seg.end <= m:
            if exact_before:
                o.resolved_by, o.resolved_tokens, o.reason = "hit", o.tokens, None
            continue
        if o.resolved_by != "dense" or (o.kind == "shared" and o.reason is None):
            o.reason = (o.reason if o.resolved_by == "dense" else None) or (reason if o.kind == "shared" else None)
            o.resolved_by, o.resolved_tokens, o.head_recomputed = "dense", 0, None
            o.source_agent, o.entropy, o.pool_anchors, o.gate_fallback = None, None, None, None
