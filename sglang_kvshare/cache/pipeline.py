"""One annotated request's path through the cache, called from the adapter's SGLang overrides::

    plan (plan.py) -> resolve (resolve.py) -> choose rows (recompute.py) -> assemble (assemble.py)
         -> record (record.py) -> report (report.py)

``RequestPipeline`` runs those steps in that order for each entry the adapter
has: a match (``match``), a stage resume between two chunks (``resume``) and a
checkpoint (``checkpointed``). Each entry ends by publishing the request's
report, once. The plan is frozen once made (``plan.RequestPlan``); what
changes while the request runs is its ``RequestState``. The pipeline and its
steps get the parts they use (``parts.CacheParts``: SGLang's tree as
``SGLangTree``, the config and estimator in force, the copy registry, the
learner, the counters), never the adapter.

Errors inside the path never fail a request: the adapter logs and counts
them, and every tensor-parallel rank then prefills densely from the same row
(``ranks_differ``, ``resolve.mark_dense_from``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_kvshare.cache import assemble, report, tree_paths
from sglang_kvshare.cache.parts import CacheParts
from sglang_kvshare.cache.plan import RequestPlan, drop_plan, plan_of, plan_request
from sglang_kvshare.cache.recompute import PendingRecompute, RecomputeRule, RowPolicy, owe, rule_of
from sglang_kvshare.cache.record import Recorder
from sglang_kvshare.cache.resolve import (Resolver, candidates, mark_alloc_failed, mark_dense_from, mark_matched,
                                          mark_unreached, mark_unsupported, next_stage, resolve_segments)
from sglang_kvshare.correction.rank_reduce import RanksUnreachable, decision_key

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


class RequestPipeline:
    """The steps of one cache, in order (module docstring). Scheduler thread only.

    ``sparse_unsupported``: why this server cannot recompute rows inside the
    prefill forward (None: it can). ``row_policy``: which rows of a reused
    segment are recomputed (``recompute.py``).
    """

    def __init__(self, parts: CacheParts, pending: PendingRecompute, sparse_unsupported: Optional[str],
                 row_policy: RowPolicy) -> None:
        self.parts = parts
        self.tree = parts.tree
        self.state = parts.state
        self.counters = parts.counters
        self.pending = pending
        self.sparse_unsupported = sparse_unsupported
        self.row_policy = row_policy
        self.resolver = Resolver(parts)
        self.recorder = Recorder(parts)

    # ------------------------------------------------------------ plan
    def plan(self, req: Req) -> Optional[RequestPlan]:
        """The plan step; a retracted request's old plan is taken back out of the stats and made afresh."""
        old = plan_of(req)
        if old is not None and old.state.released:
            if old.state.counted:
                self.recorder.count(old, sign=-1)
            drop_plan(req)
            self.counters.add("plans_after_retraction")
        config = self.state.config
        return plan_request(req, self.parts.hasher, config.max_segments, self.counters,
                            reuse_scope=config.reuse_scope, epoch=self.state.epoch,
                            setting=lambda ann: self._rule(ann).key)

    # ------------------------------------------------------------ entries
    def match(self, req: "Req", plan: RequestPlan, key: RadixKey, m: int, node: TreeNode,
              active: bool) -> tuple[int, TreeNode]:
        """After SGLang's exact match (``m`` rows, ending at ``node``): the estimate walk, then resolve ->
        choose rows -> assemble -> record from there; the prefix served and its last node.

        ``active``: kvshare can serve this model (otherwise the plan only says why not). Raises whatever a
        step raises (the adapter prefills densely then).
        """
        st = plan.state
        limit = len(key)  # the scheduler never matches the last prompt token
        st.est_start = None
        st.exact_len, st.estimate_len = m, 0  # what this match serves: the latest match is the one prefilled
        if m < limit and plan.may_approximate_from(m):  # an earlier identical request may have left estimates
            more, deeper = self.tree._match_prefix_helper(node, tree_paths.est_key(plan.tokens[m:limit],
                                                                                   plan.tree_ns))
            got = sum(len(v) for v in more)
            if got:
                st.est_start, m, node = m, m + got, deeper
                st.estimate_len = got
        # Estimate rows whose recompute another request (or this one, a round ago) still owes: this request's
        # next forward recomputes them.
        st.owed = self.pending
        st.sparse_rows = []
        if st.est_start is not None and len(self.pending):
            st.sparse_rows = self.pending.owed_positions(self.tree.path_device_indices(node)[st.est_start:m],
                                                         st.est_start)
        st.adopted = len(st.sparse_rows)
        # A waiting request is matched again every round: a longer match makes its plan stale.
        advanced = st.attempted and m > st.assembled_end
        if not st.attempted or advanced:
            mark_matched(plan, m)
        if not active:
            mark_unsupported(plan)
        elif not st.attempted or m < st.assembled_end or advanced:
            m, node = self._reuse(plan, m, limit, node)
        st.attempted = True
        report.publish(req, plan)
        return m, node

    def resume(self, req: "Req", plan: RequestPlan, p: int, limit: int, node: TreeNode) -> tuple[int, TreeNode]:
        """Between two stages: resolve -> choose rows -> assemble -> record from row ``p`` (below ``node``).

        Returns the new prefix end and its last node (``p`` and ``node`` when nothing was reused); the
        adapter hands them to the request and publishes the report (``publish``). Raises what a step raises.
        """
        return self._reuse(plan, p, limit, node)

    def fell_back(self, req: "Req", plan: RequestPlan, m: int, reason: str, *, exact_before: bool) -> None:
        """The request is prefilled densely from row ``m`` on (``reason``: internal_error, ranks_disagree)."""
        mark_dense_from(plan, m, reason, exact_before=exact_before)
        report.publish(req, plan)

    def checkpointed(self, req: "Req", plan: RequestPlan, up_to: int) -> None:
        """Rows ``[0, up_to)`` are in the tree: record -> report (counted once the whole prompt is in)."""
        st = plan.state
        if not st.counted and (up_to >= len(plan.tokens) or req.finished()):
            mark_unreached(plan)
            self.recorder.count(plan)  # once the whole prompt is in: staged segments are decided by then
            st.counted = True
            report.publish(req, plan)
        self.recorder.checkpointed(req, plan, up_to)
        if plan.annotation.output_slot and req.finished():
            self.recorder.output(req, plan, up_to)

    def publish(self, req: "Req", plan: RequestPlan) -> None:
        report.publish(req, plan)

    # ------------------------------------------------------------ steps
    def _reuse(self, plan: RequestPlan, m: int, limit: int, node: TreeNode) -> tuple[int, TreeNode]:
        """Resolve (choosing the rows to recompute), assemble and record the segments from ``m`` on; the new
        prefix length and last node."""
        t0 = time.perf_counter()
        st = plan.state
        config = self.state.config
        records = self.parts.registry.namespace(plan.namespace)
        generation = self.parts.registry.generation
        rule = self._noted_rule(plan)
        locks = [node]
        self.tree.inc_lock_ref(node)
        try:
            pieces = resolve_segments(self.resolver, records, plan, m, limit, locks, generation, rule)
            last = assemble.write_and_insert(self.tree, self.state.spec, self.counters, plan, node, m, pieces) \
                if pieces else node
        finally:
            for held in locks:
                self.tree.dec_lock_ref(held)
        end = m + sum(p.hi - p.lo for p in pieces)
        if last is None:
            mark_alloc_failed(plan, pieces)
            self.counters.add("alloc_failed")
            last, end = node, m
        elif pieces:
            if st.est_start is None:
                st.est_start = m
            self.recorder.assembled(plan, pieces)
            if rule.sparse:
                rows = [plan.annotation.segments[p.index].start + j for p in pieces for j in p.recompute]
                owe(plan, rows, self.tree.path_device_indices(last), self.pending)
        st.assembled_end = max(st.assembled_end, end)
        st.next_stage = None
        if config.staged:
            st.next_stage = next_stage(plan, end, limit, rule,
                                       lambda o: bool(candidates(records, plan, o, generation)),
                                       config.min_stage_tokens)
        st.assembly_seconds += time.perf_counter() - t0
        return end, last

    def _rule(self, annotation: Any) -> RecomputeRule:
        return rule_of(self.state.config, annotation, self.sparse_unsupported, self.row_policy)

    def _noted_rule(self, plan: RequestPlan) -> RecomputeRule:
        """The request's recompute rule, noted in its state for the report."""
        config = self.state.config
        rule = self._rule(plan.annotation)
        if rule.head or rule.ratio:
            plan.state.recompute_via = "sparse" if rule.sparse else "staged"
            plan.state.sparse_fallback = self.sparse_unsupported if config.sparse_extend and not rule.sparse else None
        return rule

    # ------------------------------------------------------------ tensor parallelism
    def ranks_differ(self, key: tuple, served: list[int]) -> Optional[str]:
        """Why this request must be prefilled densely from its exact prefix, or None to serve it as matched.

        ``served``: what this rank would serve (the prefix, the rows its forward recomputes, where estimates
        start), ``[-1]`` where this rank raised; every rank calls this for every annotated match, raised or not.
        At TP > 1 the ranks compare it in one small reduce, bounded by the reducer's deadline, so no two ranks
        run forwards of different lengths: ranks that differ (``ranks_disagree``) or can no longer reduce
        (``ranks_out_of_step``, until a restart) go dense together.
        """
        failed = served[0] < 0
        reducer = self.state.reducer
        if reducer is None or reducer.size < 2:
            return "internal_error" if failed else None
        try:
            lo, hi = reducer.agree(decision_key(*key), served + [0] * (3 - len(served)))
        except RanksUnreachable:
            self.counters.add("ranks_unreachable")
            return "ranks_out_of_step"
        if failed:
            return "internal_error"
        if lo[0] < 0:
            return "ranks_disagree"  # another rank raised
        if lo != hi:
            self.counters.add("ranks_disagree")
            return "ranks_disagree"
        return None
