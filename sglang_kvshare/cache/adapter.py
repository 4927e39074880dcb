"""The kvshare tree cache: SGLang's Python ``RadixCache`` plus placeholder reuse.

This class is the SGLang adapter: it overrides the tree hooks
(``match_prefix``, ``checkpoint``, ``on_release``, ``reset``, ``_delete_leaf``)
and runs one request's path as a pipeline, each step a module of its own
that never calls back into this class::

    plan (plan.py) -> resolve (resolve.py) -> assemble (assemble.py: write + insert)
                   -> record (record.py) -> report (report.py)

It owns the parts the steps share, and hands each what it needs: the config
and estimator in force (``CorrectionState``), the copy registry, the learner
(``learning/``), the counters, and the admin view (``kvshare_admin``).

Guarantees (docs/ARCHITECTURE.md): a request without an annotation, and
every request in mode ``off``, takes exactly ``RadixCache``'s code path and
can only ever match exact KV (assembled KV lives in the tree's estimate
namespace, ``tree_paths``); everything reused comes from the request's own
``extra_key``/``cache_salt`` namespace; errors inside the kvshare path never
fail a request (logged, counted, prefilled densely).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache

from sglang_kvshare.cache import assemble, report, tree_paths
from sglang_kvshare.cache.admin_view import AdminView
from sglang_kvshare.cache.correction_state import CorrectionState
from sglang_kvshare.cache.kv_pool_io import ReadWorkspace
from sglang_kvshare.cache.parts import CacheParts
from sglang_kvshare.cache.plan import RequestPlan, drop_plan, plan_of, plan_request
from sglang_kvshare.cache.pool_persistence import PoolSaver, PoolStore
from sglang_kvshare.cache.record import Recorder
from sglang_kvshare.cache.registry import ContentHasher, PlaceholderRegistry, RegistryLimits
from sglang_kvshare.cache.recompute import HEAD, PendingRecompute, RecomputeRule, RowPolicy, owe, rule_of
from sglang_kvshare.cache.resolve import (Resolver, candidates, mark_dense_from, mark_matched, mark_unreached,
                                          next_stage, resolve_segments)
from sglang_kvshare.config import KVShareConfig
from sglang_kvshare.correction.rank_reduce import RanksUnreachable, decision_key
from sglang_kvshare.counters import Counters
from sglang_kvshare.learning.learner import Learner
from sglang_kvshare.learning.serving_activity import ServingActivity

logger = logging.getLogger(__name__)


class KVShareRadixCache(RadixCache):
    """A ``RadixCache`` that reuses shared segments across agents; see the module docstring.

    ``reducer``: with tensor parallelism, how kvcmas's gate decisions are taken once for every
    rank (``correction.rank_reduce``; None: one rank).
    ``sparse_unsupported``: why this server cannot recompute heads inside the
    prefill forward (``server.sparse_extend.unsupported_reason``), or None when
    it can; heads are then staged.
    ``row_policy``: which rows of a reused segment are recomputed (``cache.recompute``; the head).
    ``pool_store``: this scheduler's ``--kvshare-pool-file`` (``cache.pool_persistence``); its pools are loaded
    here, before the first request, and ``POST /kvshare/save`` writes them.
    """

    def __init__(self, params: CacheInitParams, *, config: KVShareConfig, model_config: Optional[Any] = None,
                 reducer: Optional[Any] = None, sparse_unsupported: Optional[str] = "not_checked",
                 pool_store: Optional[PoolStore] = None, row_policy: RowPolicy = HEAD) -> None:
        # NOTE: set before RadixCache.__init__, which calls reset().
        self.state = CorrectionState(config, model_config, page_size=params.page_size, reducer=reducer)
        self.hasher = ContentHasher()
        self.pool_saver = None
        if pool_store is not None and self.state.spec is not None:
            hf_config = getattr(model_config, "hf_config", None)
            store = pool_store.with_model(getattr(hf_config, "text_config", None) or hf_config,
                                          getattr(model_config, "model_path", None), self.state.spec,
                                          params.token_to_kv_pool_allocator.get_kvcache())
            self.pool_saver = PoolSaver(store, config.pool_save_interval_s)
        self.registry = PlaceholderRegistry(RegistryLimits(max_namespaces=config.max_namespaces,
                                                           max_slots=config.max_slots))
        self.counters = Counters()
        self.counters.add("plain_tokens_from_estimates", 0)  # reported even while it stays 0 (the soak checks it)
        self.activity = ServingActivity()
        self.sparse_unsupported = sparse_unsupported
        self.row_policy = row_policy
        self.pending_recompute = PendingRecompute(self.counters)
        self.learner = Learner(lambda: self.state.estimator, self.state.lock, self.counters,
                               max_jobs=config.learn_queue_max, max_bytes=int(config.learn_queue_mb * 2**20),
                               asynchronous=config.learn_async, cpu_share=config.learn_cpu_share,
                               slot_interval_s=config.learn_slot_interval_s, activity=self.activity,
                               yield_s=config.learn_yield_s, single_thread=config.learn_single_thread)
        parts = CacheParts(self, self.state, self.registry, self.learner, self.counters, self.hasher, ReadWorkspace())
        self.resolver = Resolver(parts)
        self.recorder = Recorder(parts)
        self.kvshare_admin = AdminView(parts)
        super().__init__(params)
        if self.pool_saver is not None:  # raises PoolFileError for a file of another model: the launch fails
            self.pool_saver.load(self.state, self.hasher, self.counters)

    def autosave_pools(self) -> None:
        """Save the pools when ``--kvshare-pool-save-interval-s`` says so (the scheduler's idle hook calls it)."""
        if self.pool_saver is not None:
            self.pool_saver.maybe_save(self.state, self.hasher, self.counters)

    @property
    def kvshare_config(self) -> KVShareConfig:
        """The config in force (``POST /kvshare/config`` may change it at runtime)."""
        return self.state.config

    @property
    def estimator(self) -> Any:
        return self.state.estimator

    @property
    def active(self) -> bool:
        return self.state.ready and not self.disable

    # ------------------------------------------------------------ tree hooks
    def reset(self) -> None:
        super().reset()
        self.pending_recompute.clear()
        self.registry.reset()
        self.state.new_epoch()

    def on_release(self, req, *, checkpointed: bool) -> None:
        self.activity.closed(req)  # also for a request the tree never checkpointed
        plan = plan_of(req)
        if plan is not None and not checkpointed and not req.finished():
            # Retracted (or aborted) with its KV freed: if it comes back, it is planned afresh.
            plan.state.released = True
        super().on_release(req, checkpointed=checkpointed)

    def _delete_leaf(self, node) -> None:
        super()._delete_leaf(node)
        setattr(node, tree_paths.DEAD_ATTR, True)  # copies ending here are gone
        if len(self.pending_recompute) and node.value is not None:
            self.pending_recompute.settle(node.value.tolist())  # its slots go back to the allocator

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        if req is not None:
            _escape_reserved_extra_key(req, params)
        mode_on = req is not None and self.state.config.mode != "off"
        if mode_on:
            self.activity.opened(req)  # its prefill is coming: the learner waits for it
        plan = None
        if mode_on and not self.disable and not self.is_eagle:
            plan = self._plan(req)
        if plan is None:
            result = super().match_prefix(params)
            if req is not None and not self.disable:
                leaked = tree_paths.estimated_tokens_on_path(result.last_device_node)
                if leaked:  # NOTE: impossible by construction; counted so the soak can prove it
                    self.counters.add("plain_tokens_from_estimates", leaked)
            return result
        result: Optional[MatchResult] = None
        try:
            with self.counters.timed("match"):
                result = self._match_annotated(req, plan, params)
        except Exception:  # noqa: BLE001 - never fail a request because of kvshare
            logger.exception("sglang-kvshare: assembly failed; prefilling densely")
            self.counters.add("internal_errors")
        served = -1 if result is None else result.device_prefix_len
        if result is not None and self._ranks_agree(("match", req.rid, len(plan.tokens)), served):
            return result
        # Every rank prefills from its exact prefix: one that raised, or ranks whose matches differ (a forward
        # of different lengths on two tensor-parallel ranks would pair mismatched collectives).
        result = super().match_prefix(params)
        mark_dense_from(plan, result.device_prefix_len, "internal_error" if served < 0 else "ranks_disagree",
                        exact_before=True)
        report.publish(req, plan)
        return result

    def checkpoint(self, req, *, up_to: int):
        if up_to >= len(req.origin_input_ids) or req.finished():
            self.activity.closed(req)
        plan = plan_of(req)
        if plan is not None and plan.state.est_start is not None and up_to > plan.state.est_start and not self.disable:
            self._checkpoint_with_estimates(req, plan, up_to)
        else:
            super().checkpoint(req, up_to=up_to)
        if plan is None or not self.active:
            return
        try:
            if not plan.state.counted and (up_to >= len(plan.tokens) or req.finished()):
                mark_unreached(plan)
                self.recorder.count(plan)  # once the whole prompt is in: staged segments are decided by then
                plan.state.counted = True
                report.publish(req, plan)
            self.recorder.checkpointed(req, plan, up_to)
            if plan.annotation.output_slot and req.finished():
                self.recorder.output(req, plan, up_to)
        except Exception:  # noqa: BLE001
            logger.exception("sglang-kvshare: learning from a dense prefill failed")
            self.counters.add("internal_errors")

    def _ranks_agree(self, key: tuple, served: int) -> bool:
        """Whether every tensor-parallel rank serves this request the same prefix (``served``; -1 where a rank
        raised), so every rank runs a forward of one length. One small reduce per annotated match at TP > 1,
        bounded by the reducer's deadline; ranks that can no longer reduce go dense together."""
        reducer = self.state.reducer
        if reducer is None or reducer.size < 2:
            return served >= 0
        try:
            lo, hi = reducer.agree(decision_key(*key), [served])
        except RanksUnreachable:
            self.counters.add("ranks_unreachable")
            return False
        if lo[0] != hi[0]:
            self.counters.add("ranks_disagree")
        return lo[0] == hi[0] and lo[0] >= 0

    # ------------------------------------------------------------ the request's path
    def _plan(self, req) -> Optional[RequestPlan]:
        """The plan step; a retracted request's old plan is taken back out of the stats and made afresh."""
        old = plan_of(req)
        if old is not None and old.state.released:
            if old.state.counted:
                self.recorder.count(old, sign=-1)
            drop_plan(req)
            self.counters.add("plans_after_retraction")
        config = self.state.config
        return plan_request(req, self.hasher, config.max_segments, self.counters, reuse_scope=config.reuse_scope,
                            epoch=self.state.epoch, setting=lambda ann: self._rule_of(ann).key)

    def _match_annotated(self, req, plan: RequestPlan, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        limit = len(params.key)  # the scheduler never matches the last prompt token
        m, node = result.device_prefix_len, result.last_device_node
        plan.state.est_start = None
        plan.state.exact_len, plan.state.estimate_len = m, 0  # what this match serves: the latest match is the one prefilled
        if m < limit and plan.may_approximate_from(m):  # an earlier identical request may have left estimates
            more, deeper = self._match_prefix_helper(node, tree_paths.est_key(plan.tokens[m:limit], plan.tree_ns))
            got = sum(len(v) for v in more)
            if got:
                plan.state.est_start, m, node = m, m + got, deeper
                plan.state.estimate_len = got
        # Estimate rows whose recompute another request (or this one, a round ago) still owes: this request's
        # next forward recomputes them.
        plan.state.owed = self.pending_recompute
        plan.state.sparse_rows = []
        if plan.state.est_start is not None and len(self.pending_recompute):
            plan.state.sparse_rows = self.pending_recompute.owed_positions(self.path_device_indices(node)[plan.state.est_start:m],
                                                                     plan.state.est_start)
        plan.state.adopted = len(plan.state.sparse_rows)
        # A waiting request is matched again every round: a longer match makes its plan stale.
        advanced = plan.state.attempted and m > plan.state.assembled_end
        if not plan.state.attempted or advanced:
            mark_matched(plan, m)
        if not self.active:
            for o in plan.state.outcomes:
                if o.resolved_by == "dense" and o.reason is None:
                    o.reason = "model_unsupported"
        elif not plan.state.attempted or m < plan.state.assembled_end or advanced:
            t0 = time.perf_counter()
            m, node = self._reuse(plan, m, limit, node)
            plan.state.assembly_seconds += time.perf_counter() - t0
        plan.state.attempted = True
        report.publish(req, plan)
        return MatchResult(device_prefix_len=m, last_device_node=node, last_host_node=node, best_match_node=node)

    def _reuse(self, plan: RequestPlan, m: int, limit: int, node) -> tuple[int, Any]:
        """Resolve, assemble and record the segments from ``m`` on; the new prefix length and last node."""
        config = self.state.config
        records = self.registry.namespace(plan.namespace)
        generation = self.registry.generation
        head = self._head_rule(plan)
        locks = [node]
        self.inc_lock_ref(node)
        try:
            pieces = resolve_segments(self.resolver, records, plan, m, limit, locks, generation, head)
            last = assemble.write_and_insert(self, self.state.spec, self.counters, plan, node, m, pieces) \
                if pieces else node
        finally:
            for held in locks:
                self.dec_lock_ref(held)
        end = m + sum(p.hi - p.lo for p in pieces)
        if last is None:
            for p in pieces:
                o = plan.state.outcomes[p.index]
                o.resolved_by, o.reason, o.resolved_tokens, o.head_recomputed = "dense", "alloc_failed", 0, None
            self.counters.add("alloc_failed")
            last, end = node, m
        elif pieces:
            if plan.state.est_start is None:
                plan.state.est_start = m
            self.recorder.assembled(plan, pieces)
            if head.sparse:
                rows = [plan.annotation.segments[p.index].start + j for p in pieces for j in p.recompute]
                owe(plan, rows, self.path_device_indices(last), self.pending_recompute)
        plan.state.assembled_end = max(plan.state.assembled_end, end)
        plan.state.next_stage = None
        if config.staged:
            plan.state.next_stage = next_stage(plan, end, limit, head,
                                         lambda o: bool(candidates(records, plan, o, generation)),
                                         config.min_stage_tokens)
        return end, last

    def _rule_of(self, annotation: Any) -> RecomputeRule:
        return rule_of(self.state.config, annotation, self.sparse_unsupported, self.row_policy)

    def _head_rule(self, plan: RequestPlan) -> RecomputeRule:
        """The request's recompute rule, noted in its plan for the report."""
        config = self.state.config
        rule = self._rule_of(plan.annotation)
        if rule.head or rule.ratio:
            plan.state.recompute_via = "sparse" if rule.sparse else "staged"
            plan.state.sparse_fallback = self.sparse_unsupported if config.sparse_extend and not rule.sparse else None
        return rule

    # ------------------------------------------------------------ staged prefill
    def kvshare_stage_end(self, req, prefix_len: int) -> Optional[int]:
        """Where the request's current dense stretch should end (a chunk boundary), or None.

        Read by the scheduler hooks (``sglang_kvshare.server.staged_prefill``) when SGLang
        decides how much of a request to prefill in this round.
        """
        plan = plan_of(req)
        if plan is None or not self.active or plan.state.next_stage is None:
            return None
        end = plan.state.next_stage
        return end if prefix_len < end < len(req.full_untruncated_fill_ids) else None

    def kvshare_resume(self, req) -> int:
        """Between two stages of one request: reuse what can be reused from ``req.prefix_len`` on.

        Called by the scheduler hook before the next chunk is sized, after the
        previous chunk's checkpoint locked ``req.last_node``. Assembled rows go
        below it (estimate namespace), into the request's row and to the tree
        (``cache_protected_len``). Returns the rows reused; never raises (an
        error leaves the request to dense prefill).
        """
        plan = plan_of(req)
        if plan is None or not self.active or plan.state.next_stage is None:
            return 0
        p = req.prefix_len
        if p < plan.state.next_stage:
            return 0  # SGLang's own chunking stopped short of the stage end
        try:
            limit = req._compute_max_prefix_len(len(req.full_untruncated_fill_ids))
            t0 = time.perf_counter()
            end, last = self._reuse(plan, p, limit, req.last_node)
            plan.state.assembly_seconds += time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - never fail a request because of kvshare
            logger.exception("sglang-kvshare: resuming reuse failed; prefilling densely")
            self.counters.add("internal_errors")
            end = -1
        if not self._ranks_agree(("resume", req.rid, p), end):
            plan.state.next_stage = None
            mark_dense_from(plan, p, "internal_error" if end < 0 else "ranks_disagree", exact_before=False)
            report.publish(req, plan)
            return 0
        if end > p:
            rows = self.path_device_indices(last)[p:end]
            self.req_to_token_pool.write((req.kv.req_pool_idx, slice(p, end)), rows)
            kv = req.kv
            # NOTE: the tree owns rows [p, end): nothing of the request's own to free there.
            kv.cache_protected_len = end
            kv.cache_inserted_len = max(kv.cache_inserted_len, end)
            kv.kv_allocated_len = kv.kv_committed_len = end
            self.unlock(req.lock)
            req.lock = self.lock(last)
            req.last_node = last
            req.prefix_len = end
            self.counters.add("stages_resumed")
        report.publish(req, plan)
        return end - p

    # ------------------------------------------------------------ checkpoints
    def _checkpoint_with_estimates(self, req, plan: RequestPlan, up_to: int) -> None:
        """``RadixCache.checkpoint`` for a request that holds estimates: rows from
        ``est_start`` on go to the estimate namespace (never to the request's own)."""
        token_ids = req.full_untruncated_fill_ids[:up_to]
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(token_ids)]
        present, last = tree_paths.insert_exact_then_estimate(self, req, token_ids, plan.state.est_start, row, plan.tree_ns)
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, len(token_ids))
        protected = req.kv.cache_protected_len
        if present > protected:  # the tree already had these rows: ours are duplicates
            self.token_to_kv_pool_allocator.free_segment(row[protected:present], start_pos=protected)
        new_indices = self.path_device_indices(last)
        assert len(new_indices) == len(token_ids), (len(new_indices), len(token_ids))
        self.req_to_token_pool.write((req.kv.req_pool_idx, slice(protected, len(new_indices))),
                                     new_indices[protected:])
        req.kv.cache_protected_len = len(new_indices)
        self.unlock(req.lock)
        req.lock = self.lock(last)
        req.last_node = last


def _escape_reserved_extra_key(req: Any, params: MatchPrefixParams) -> None:
    """Keep a client-chosen ``extra_key`` out of the estimate namespace.

    SGLang builds a request's tree keys from its ``extra_key``; one that looked
    like an estimate key (``kvshare-est:...``) would let a plain request match
    assembled KV, or plant exact rows where annotated requests look for
    estimates. The HTTP process refuses such a key with a 400; a request that
    bypasses it (the Engine API) gets the key escaped, consistently for its
    match and its checkpoints, so it only ever meets its own rows.
    """
    extra = getattr(req, "extra_key", None)
    if isinstance(extra, str) and extra.startswith(tree_paths.EST_PREFIX):
        req.extra_key = tree_paths.RESERVED_ESCAPE + extra
        params.key.extra_key = req.extra_key
