"""The kvshare tree cache: SGLang's Python ``RadixCache`` plus placeholder reuse.

This class is the thin SGLang adapter: it overrides the tree hooks
(``match_prefix``, ``checkpoint``, ``reset``, ``_delete_leaf``) and hands the
work to single-purpose parts:

* ``resolver`` / ``assembly``: segments -> sources -> resolutions -> KV in the
  pool and estimate nodes in the tree;
* ``learner``: anchors from dense prefills, on a worker thread, bounded;
* ``registry``: where each content's copies live, per namespace;
* ``cache_admin``: stats, pools, configure and reset for the admin API.

Guarantees (docs/ARCHITECTURE.md): a request without an annotation, and
every request in mode ``off``, takes exactly ``RadixCache``'s code path and
can only ever match exact KV (assembled KV lives in the tree's estimate
namespace, ``tree_paths``); everything reused comes from the request's own
``extra_key``/``cache_salt`` namespace; errors inside the kvshare path never
fail a request (logged, counted, prefilled densely).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache

from sglang_kvshare.cache import assembly, tree_paths
from sglang_kvshare.cache.cache_admin import CacheAdmin
from sglang_kvshare.cache.counters import Counters
from sglang_kvshare.cache.kv_pool_io import learning_copy_dtype, pool_dtype, read_pair
from sglang_kvshare.cache.learner import Learner, Observation
from sglang_kvshare.cache.registry import ContentHasher, Materialization, PlaceholderRegistry, RegistryLimits
from sglang_kvshare.cache.request_state import (RequestPlan, SegmentOutcome, attach, plan_of,
                                                 publish_report)
from sglang_kvshare.cache.resolver import Resolver
from sglang_kvshare.cache.serving_activity import ServingActivity
from sglang_kvshare.config import KVShareConfig
from sglang_kvshare.protocol import AnnotationError, parse_annotation

logger = logging.getLogger(__name__)


class KVShareRadixCache(CacheAdmin, RadixCache):
    """A ``RadixCache`` that reuses shared segments across agents; see the module docstring.

    ``page_size``/``tp_size`` are the launch facts the mode checks need again
    when the mode is switched at runtime.
    """

    def __init__(self, params: CacheInitParams, *, config: KVShareConfig, model_config: Optional[Any] = None,
                 tp_size: int = 1) -> None:
        self.kvshare_config = config
        self.model_config = model_config
        self.tp_size = tp_size
        self.kvshare_generation = 0
        self.hasher = ContentHasher()
        self.registry = PlaceholderRegistry(RegistryLimits(max_namespaces=config.max_namespaces,
                                                           max_slots=config.max_slots))
        self.counters = Counters()
        self.counters.add("plain_tokens_from_estimates", 0)  # reported even while it stays 0 (the soak checks it)
        self.unsupported_reason: Optional[str] = None
        self.spec = None
        self.estimator = None
        self._estimator_lock = threading.RLock()
        self.activity = ServingActivity()
        self.learner = Learner(lambda: self.estimator, self._estimator_lock, self.counters,
                               max_jobs=config.learn_queue_max, max_bytes=int(config.learn_queue_mb * 2**20),
                               asynchronous=config.learn_async, cpu_share=config.learn_cpu_share,
                               slot_interval_s=config.learn_slot_interval_s, activity=self.activity,
                               yield_s=config.learn_yield_s, single_thread=config.learn_single_thread)
        self.resolver = Resolver(self, lambda: self.estimator, self._estimator_lock)
        super().__init__(params)
        if config.mode != "off":
            self._init_correction()

    @property
    def active(self) -> bool:
        return self.kvshare_config.mode != "off" and self.estimator is not None and not self.disable

    # ------------------------------------------------------------ tree hooks
    def reset(self) -> None:
        super().reset()
        # RadixCache.__init__ calls reset() before our attributes exist.
        if hasattr(self, "registry"):
            self.registry.reset()
            self.kvshare_generation += 1

    def on_release(self, req, *, checkpointed: bool) -> None:
        self.activity.closed(req)  # also for a request the tree never checkpointed
        super().on_release(req, checkpointed=checkpointed)

    def _delete_leaf(self, node) -> None:
        super()._delete_leaf(node)
        setattr(node, tree_paths.DEAD_ATTR, True)  # materializations ending here are gone

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        if req is not None and self.kvshare_config.mode != "off":
            self.activity.opened(req)  # its prefill is coming: the learner waits for it (learner.py)
        plan = None
        if req is not None and self.kvshare_config.mode != "off" and not self.disable and not self.is_eagle:
            plan = self._plan_for(req)
        if plan is None:
            result = super().match_prefix(params)
            if req is not None and not self.disable:
                leaked = tree_paths.estimated_tokens_on_path(result.last_device_node)
                if leaked:  # NOTE: impossible by construction; counted so the soak can prove it
                    self.counters.add("plain_tokens_from_estimates", leaked)
            return result
        try:
            with self.counters.timed("match"):
                return self._match_annotated(req, plan, params)
        except Exception:  # noqa: BLE001 - never fail a request because of kvshare
            logger.exception("sglang-kvshare: assembly failed; prefilling densely")
            self.counters.add("internal_errors")
            plan.est_start = None
            return super().match_prefix(params)

    def checkpoint(self, req, *, up_to: int):
        if up_to >= len(req.origin_input_ids) or req.finished():
            self.activity.closed(req)
        plan = plan_of(req)
        if plan is not None and plan.est_start is not None and up_to > plan.est_start and not self.disable:
            self._checkpoint_with_estimates(req, plan, up_to)
        else:
            super().checkpoint(req, up_to=up_to)
        if plan is None or not self.active:
            return
        try:
            if not plan.counted and (up_to >= len(plan.tokens) or req.finished()):
                assembly.mark_unreached(plan)
                self._count(plan)  # once the whole prompt is in: staged segments are decided by then
                plan.counted = True
                publish_report(req, plan)
            self._learn(req, plan, up_to)
            if plan.annotation.output_slot and req.finished():
                self._record_output(req, plan, up_to)
        except Exception:  # noqa: BLE001
            logger.exception("sglang-kvshare: learning from a dense prefill failed")
            self.counters.add("internal_errors")

    # ------------------------------------------------------------ planning
    def _plan_for(self, req) -> Optional[RequestPlan]:
        plan = plan_of(req)
        if plan is not None:
            return plan
        custom = getattr(req.sampling_params, "custom_params", None)
        tokens = tuple(int(t) for t in req.origin_input_ids)
        try:
            ann = parse_annotation(custom, len(tokens), self.kvshare_config.max_segments)
        except AnnotationError as exc:
            # The HTTP process rejects these with a 400; reaching here means the
            # request bypassed it (e.g. the Engine API): serve it unannotated.
            logger.warning("sglang-kvshare: ignoring a malformed annotation: %s", exc)
            self.counters.add("malformed_annotations")
            return None
        if ann is None:
            return None
        namespace = (req.extra_key, getattr(req, "cache_salt", None))
        first = ann.segments[0]
        own_prefix = tokens[first.start:first.end] if first.kind == "private" else ()
        plan = RequestPlan(
            annotation=ann, tokens=tokens, namespace=namespace,
            # NOTE: an agent is its name *and* its private prefix, so a client that
            # borrows a name cannot feed corrections into another agent's edges.
            agent_id=self.hasher(own_prefix, "agent", namespace, ann.agent),
            hashes=[self.hasher(tokens[s.start:s.end]) for s in ann.segments],
            outcomes=[SegmentOutcome(i, s.kind, s.slot, s.length) for i, s in enumerate(ann.segments)],
        )
        attach(req, plan)
        return plan

    # ------------------------------------------------------------ matching and assembly
    def _match_annotated(self, req, plan: RequestPlan, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        limit = len(params.key)  # the scheduler never matches the last prompt token
        m, node = result.device_prefix_len, result.last_device_node
        plan.est_start = None
        if m < limit:  # an earlier identical annotated request may have left estimates here
            more, deeper = self._match_prefix_helper(node, tree_paths.est_key(plan.tokens[m:limit], plan.namespace))
            got = sum(len(v) for v in more)
            if got:
                plan.est_start, m, node = m, m + got, deeper
        # A waiting request is matched again every round: a longer match makes its plan stale.
        advanced = plan.attempted and m > plan.assembled_end
        if not plan.attempted:
            plan.exact_len = m  # first call: everything matched so far is a hit
        if not plan.attempted or advanced:
            assembly.mark_matched(plan, m)
        if not self.active:
            self._mark_unsupported(plan)
        elif not plan.attempted or m < plan.assembled_end or advanced:
            t0 = time.perf_counter()
            m, node = self._assemble(plan, m, limit, node)
            plan.assembly_seconds += time.perf_counter() - t0
        plan.attempted = True
        publish_report(req, plan)
        return MatchResult(device_prefix_len=m, last_device_node=node, last_host_node=node, best_match_node=node)

    def _assemble(self, plan: RequestPlan, m: int, limit: int, node) -> tuple[int, Any]:
        records = self.registry.namespace(plan.namespace)
        locks = [node]
        self.inc_lock_ref(node)
        head = self.kvshare_config.recompute_head
        try:
            pieces = assembly.plan_pieces(self.resolver, records, plan, m, limit, locks, head)
            last = assembly.write_and_insert(self, plan, node, m, pieces) if pieces else node
        finally:
            for held in locks:
                self.dec_lock_ref(held)
        end = m + sum(p.hi - p.lo for p in pieces)
        if last is None:
            for p in pieces:
                o = plan.outcomes[p.index]
                o.resolved_by, o.reason, o.resolved_tokens, o.head_recomputed = "dense", "alloc_failed", 0, None
            self.counters.add("alloc_failed")
            last, end = node, m
        elif pieces:
            if plan.est_start is None:
                plan.est_start = m
            for p in pieces:
                seg = plan.annotation.segments[p.index]
                if seg.start + p.hi == seg.end:
                    self._record(plan, p.index, exact=False)
        plan.assembled_end = max(plan.assembled_end, end)
        plan.next_stage = None
        if self.kvshare_config.staged:
            plan.next_stage = assembly.next_stage(
                plan, end, limit, head, lambda o: bool(self.resolver.candidates(records, plan, o)),
                self.kvshare_config.min_stage_tokens)
        return end, last

    # ------------------------------------------------------------ staged prefill
    def kvshare_stage_end(self, req, prefix_len: int) -> Optional[int]:
        """Where the request's current dense stretch should end (a chunk boundary), or None.

        Read by the scheduler hooks (``sglang_kvshare.staged_prefill``) when SGLang
        decides how much of a request to prefill in this round.
        """
        plan = plan_of(req)
        if plan is None or not self.active or plan.next_stage is None:
            return None
        end = plan.next_stage
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
        if plan is None or not self.active or plan.next_stage is None:
            return 0
        p = req.prefix_len
        if p < plan.next_stage:
            return 0  # SGLang's own chunking stopped short of the stage end
        try:
            limit = req._compute_max_prefix_len(len(req.full_untruncated_fill_ids))
            t0 = time.perf_counter()
            end, last = self._assemble(plan, p, limit, req.last_node)
            plan.assembly_seconds += time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - never fail a request because of kvshare
            logger.exception("sglang-kvshare: resuming reuse failed; prefilling densely")
            self.counters.add("internal_errors")
            plan.next_stage = None
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
        publish_report(req, plan)
        return end - p

    def _mark_unsupported(self, plan: RequestPlan) -> None:
        for o in plan.outcomes:
            if o.resolved_by == "dense" and o.reason is None:
                o.reason = "model_unsupported"

    # ------------------------------------------------------------ checkpoints
    def _checkpoint_with_estimates(self, req, plan: RequestPlan, up_to: int) -> None:
        """``RadixCache.checkpoint`` for a request that holds estimates: rows from
        ``est_start`` on go to the estimate namespace (never to the request's own)."""
        token_ids = req.full_untruncated_fill_ids[:up_to]
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(token_ids)]
        present, last = tree_paths.insert_exact_then_estimate(self, req, token_ids, plan.est_start, row)
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

    # ------------------------------------------------------------ records and learning
    def _node_at(self, plan: RequestPlan, tokens) -> Optional[Any]:
        return tree_paths.node_at(self, tokens, plan.est_start, plan.namespace[0], plan.namespace[1])

    def _record(self, plan: RequestPlan, index: int, *, exact: bool) -> None:
        seg = plan.annotation.segments[index]
        node = self._node_at(plan, plan.tokens[:seg.end])
        if node is None:
            return
        mat = Materialization(agent=plan.agent_id, agent_name=plan.agent, node=node, start=seg.start, end=seg.end,
                              exact=exact, generation=self.kvshare_generation)
        records = self.registry.namespace(plan.namespace)
        if seg.kind == "shared":
            records.slot(seg.slot).record(plan.hashes[index], mat)
        else:
            records.record_private(plan.agent_id, plan.hashes[index], mat)

    def _learn(self, req, plan: RequestPlan, up_to: int) -> None:
        """Record what this request holds (segments fully inside ``up_to``) and queue observations."""
        records = self.registry.namespace(plan.namespace)
        for o, seg in zip(plan.outcomes, plan.annotation.segments):
            if o.index in plan.learned or seg.end > up_to:
                continue
            plan.learned.add(o.index)
            if o.resolved_by in ("alignment", "correction"):
                continue  # recorded as an estimate when it was assembled
            exact = plan.exact_before(seg.end)
            source = None
            if o.resolved_by == "dense" and seg.kind == "shared" and exact:
                source = next(iter(self.resolver.candidates(records, plan, o)), None)
            self._record(plan, o.index, exact=exact)
            if source is None or self.kvshare_config.mode != "kvcmas":
                continue
            if source.agent == plan.agent_id and source.start == seg.start:
                continue  # same agent, same offset (a client's commit of its own output): nothing to learn
            self._observe(req, plan, o.index, source)

    def _observe(self, req, plan: RequestPlan, index: int, source: Materialization) -> None:
        from sglang_kvshare.correction import SegmentCache

        src_idx = tree_paths.rows(source.node, source.start, source.end)
        if src_idx is None:
            self.counters.add("observations_source_lost")
            return
        seg = plan.annotation.segments[index]
        if not self.learner.admit((plan.namespace, seg.slot), plan.hashes[index], source.agent, plan.agent_id):
            return
        t0 = time.perf_counter()
        kvcache = self.token_to_kv_pool_allocator.get_kvcache()
        k_src, v_src, k_tgt, v_tgt = read_pair(kvcache, src_idx,
                                               self.req_to_token_pool.req_to_token[req.kv.req_pool_idx][seg.start:],
                                               learning_copy_dtype(kvcache))
        self.counters.add("learn_copy_seconds", time.perf_counter() - t0)
        self.learner.submit(Observation(
            slot=(plan.namespace, seg.slot),
            source=SegmentCache(k_src, v_src, source.start, source.agent, exact=source.exact),
            target=SegmentCache(k_tgt, v_tgt, seg.start, plan.agent_id, exact=True),
            content_key=plan.hashes[index], compute_dtype=pool_dtype(kvcache)))

    def _record_output(self, req, plan: RequestPlan, up_to: int) -> None:
        """A finished producer's generated tokens become a source for its output slot."""
        out_ids = tuple(int(t) for t in req.output_ids)
        in_tree = min(max(up_to - len(plan.tokens), 0), len(out_ids))
        if not out_ids or in_tree == 0:
            return
        node = self._node_at(plan, plan.tokens + out_ids[:in_tree])
        if node is None:
            return
        mat = Materialization(agent=plan.agent_id, agent_name=plan.agent, node=node, start=len(plan.tokens),
                              end=len(plan.tokens) + in_tree, exact=plan.est_start is None,
                              generation=self.kvshare_generation)
        slot = self.registry.namespace(plan.namespace).slot(plan.annotation.output_slot)
        # Consumers may pass the whole output or only what has KV; both find it.
        for content in {self.hasher(out_ids), self.hasher(out_ids[:in_tree])}:
            slot.record(content, mat)

    def _count(self, plan: RequestPlan) -> None:
        records = self.registry.namespace(plan.namespace)
        for o in plan.outcomes:
            if o.kind != "shared":
                continue
            records.slot(o.slot).stats.add(o)
        self.counters.add("annotated_requests")
        self.counters.add("assembly_seconds", plan.assembly_seconds)
