"""The kvshare tree cache: SGLang's Python ``RadixCache`` plus placeholder reuse.

This class is the SGLang adapter and holds SGLang's overrides only: the tree
hooks (``match_prefix``, ``checkpoint``, ``on_release``, ``reset``,
``_delete_leaf``) and the staged-prefill hooks (``kvshare_stage_end``,
``kvshare_resume``). Each hands an annotated request to one pipeline
(``cache/pipeline.py``: plan -> resolve -> choose rows -> assemble -> record
-> report) and does SGLang's bookkeeping around it (locks, the request's row,
its protected length). It owns the parts the steps share (``CacheParts``: the
config and estimator in force, the copy registry, the learner, the counters,
SGLang's tree as ``SGLangTree``) and the admin view (``kvshare_admin``); no
step is handed this class.

Guarantees (docs/ARCHITECTURE.md): a request without an annotation, and
every request in mode ``off``, takes exactly ``RadixCache``'s code path and
can only ever match exact KV (assembled KV lives in the tree's estimate
namespace, ``tree_paths``); everything reused comes from the request's own
``extra_key``/``cache_salt`` namespace; errors inside the kvshare path never
fail a request (logged, counted, prefilled densely).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from sglang_kvshare.cache import tree_paths
from sglang_kvshare.cache.admin_view import AdminView
from sglang_kvshare.cache.correction_state import CorrectionState
from sglang_kvshare.cache.kv_pool_io import ReadWorkspace
from sglang_kvshare.cache.parts import CacheParts, SGLangTree
from sglang_kvshare.cache.pipeline import RequestPipeline
from sglang_kvshare.cache.plan import RequestPlan, plan_of
from sglang_kvshare.cache.pool_persistence import PoolSaver, PoolStore
from sglang_kvshare.cache.recompute import HEAD, PendingRecompute, RowPolicy
from sglang_kvshare.cache.registry import ContentHasher, PlaceholderRegistry, RegistryLimits
from sglang_kvshare.cache.retention import POLICY as RETENTION_POLICY, Retention
from sglang_kvshare.config import KVShareConfig
from sglang_kvshare.correction.rank_reduce import Reducer
from sglang_kvshare.counters import Counters
from sglang_kvshare.learning.learner import Learner
from sglang_kvshare.learning.serving_activity import ServingActivity

if TYPE_CHECKING:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.schedule_batch import Req

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

    def __init__(self, params: CacheInitParams, *, config: KVShareConfig,
                 model_config: Optional["ModelConfig"] = None, reducer: Optional[Reducer] = None,
                 sparse_unsupported: Optional[str] = "not_checked",
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
        allocator = params.token_to_kv_pool_allocator
        self.registry = PlaceholderRegistry(RegistryLimits.for_pool(
            getattr(allocator, "size", 0) if allocator is not None else 0, config.min_reuse_tokens,
            max_namespaces=config.max_namespaces, max_slots=config.max_slots))
        self.counters = Counters()
        self.retention = Retention(lambda: self.state.config.retention == RETENTION_POLICY, self.counters,
                                   self.registry)
        self.counters.add("plain_tokens_from_estimates", 0)  # reported even while it stays 0 (the soak checks it)
        self.activity = ServingActivity()
        self.sparse_unsupported = sparse_unsupported
        self.pending_recompute = PendingRecompute(self.counters)
        self.learner = Learner(lambda: self.state.estimator, self.state.lock, self.counters,
                               max_jobs=config.learn_queue_max, max_bytes=int(config.learn_queue_mb * 2**20),
                               asynchronous=config.learn_async, cpu_share=config.learn_cpu_share,
                               slot_interval_s=config.learn_slot_interval_s, activity=self.activity,
                               yield_s=config.learn_yield_s, single_thread=config.learn_single_thread)
        super().__init__(params)
        # Eviction order: SGLang's configured strategy, behind the retention rank (cache/retention.py).
        self.eviction_strategy = self.retention.wrap(self.eviction_strategy, self.eviction_policy)
        parts = CacheParts(SGLangTree(self), self.state, self.registry, self.learner, self.counters, self.hasher,
                           ReadWorkspace(), self.retention, self.pool_saver)
        self.pipeline = RequestPipeline(parts, self.pending_recompute, sparse_unsupported, row_policy)
        self.recorder = self.pipeline.recorder
        self.kvshare_admin = AdminView(parts)
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
        self.retention.reset()
        self.state.new_epoch()

    def on_release(self, req: "Req", *, checkpointed: bool) -> None:
        self.activity.closed(req)  # also for a request the tree never checkpointed
        plan = plan_of(req)
        if plan is not None and not checkpointed and not req.finished():
            # Retracted (or aborted) with its KV freed: if it comes back, it is planned afresh.
            plan.state.released = True
        self.retention.closed(plan, getattr(req, "last_node", None) if checkpointed else None, self.root_node)
        super().on_release(req, checkpointed=checkpointed)

    def _delete_leaf(self, node: TreeNode) -> None:
        self.retention.evicted(node)  # counted under its rank while its copies still count as live
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
            plan = self.pipeline.plan(req)
            if plan is not None:
                self.retention.opened(plan)
        if plan is None:
            result = super().match_prefix(params)
            if req is not None and not self.disable:
                leaked = tree_paths.estimated_tokens_on_path(result.last_device_node)
                if leaked:  # NOTE: impossible by construction; counted so the soak can prove it
                    self.counters.add("plain_tokens_from_estimates", leaked)
            return result
        served, node = -1, None
        try:
            with self.counters.timed("match"):
                exact = super().match_prefix(params)
                served, node = self.pipeline.match(req, plan, params.key, exact.device_prefix_len,
                                                   exact.last_device_node, self.active)
        except Exception:  # noqa: BLE001 - never fail a request because of kvshare
            logger.exception("sglang-kvshare: assembly failed; prefilling densely")
            self.counters.add("internal_errors")
            served = -1
        st = plan.state
        why = self.pipeline.ranks_differ(("match", req.rid, len(plan.tokens)), [-1] if served < 0 else [
            served, len(st.sparse_rows), -1 if st.est_start is None else st.est_start])
        if why is None:
            return MatchResult(device_prefix_len=served, last_device_node=node, last_host_node=node,
                               best_match_node=node)
        # Every rank prefills from its exact prefix: one that raised, or ranks whose matches differ (a forward
        # of different lengths on two tensor-parallel ranks would pair mismatched collectives).
        result = super().match_prefix(params)
        self.pipeline.fell_back(req, plan, result.device_prefix_len, why, exact_before=True)
        return result

    def checkpoint(self, req: "Req", *, up_to: int) -> None:
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
            self.pipeline.checkpointed(req, plan, up_to)
        except Exception:  # noqa: BLE001
            logger.exception("sglang-kvshare: learning from a dense prefill failed")
            self.counters.add("internal_errors")

    # ------------------------------------------------------------ staged prefill
    def kvshare_stage_end(self, req: "Req", prefix_len: int) -> Optional[int]:
        """Where the request's current dense stretch should end (a chunk boundary), or None.

        Read by the scheduler hooks (``sglang_kvshare.server.staged_prefill``) when SGLang
        decides how much of a request to prefill in this round.
        """
        plan = plan_of(req)
        if plan is None or not self.active or plan.state.next_stage is None:
            return None
        end = plan.state.next_stage
        return end if prefix_len < end < len(req.full_untruncated_fill_ids) else None

    def kvshare_resume(self, req: "Req") -> int:
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
            end, last = self.pipeline.resume(req, plan, p, limit, req.last_node)
        except Exception:  # noqa: BLE001 - never fail a request because of kvshare
            logger.exception("sglang-kvshare: resuming reuse failed; prefilling densely")
            self.counters.add("internal_errors")
            end = -1
        why = self.pipeline.ranks_differ(("resume", req.rid, p), [end, len(plan.state.sparse_rows)])
        if why is not None:
            self.pipeline.fell_back(req, plan, p, why, exact_before=False)
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
        self.pipeline.publish(req, plan)
        return end - p

    # ------------------------------------------------------------ checkpoints
    def _checkpoint_with_estimates(self, req: "Req", plan: RequestPlan, up_to: int) -> None:
        """``RadixCache.checkpoint`` for a request that holds estimates: rows from
        ``est_start`` on go to the estimate namespace (never to the request's own)."""
        token_ids = req.full_untruncated_fill_ids[:up_to]
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(token_ids)]
        present, last = tree_paths.insert_exact_then_estimate(self, req, token_ids, plan.state.est_start, row,
                                                              plan.tree_ns)
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
