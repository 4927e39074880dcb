"""The kvshare tree cache: SGLang's Python ``RadixCache`` plus placeholder reuse.

Requests without a kvshare annotation (``sglang_kvshare.protocol``), and every
request in mode ``off``, take exactly the ``RadixCache`` code path.

For an annotated request, ``match_prefix`` first runs the normal radix match,
then walks the request's remaining segments in order and resolves as many as
it can without running the model:

* a shared segment whose content is materialized somewhere in the tree (any
  agent, any position): ``fullshared`` re-aligns it; ``kvcmas`` asks the
  slot's anchor pool (gate) and, when it accepts, re-aligns and corrects it;
* a private segment this agent used before behind other content: re-aligned.

It stops at the first segment it cannot resolve (the reason goes into the
request's report), allocates pool slots through SGLang's allocator (evicting
through the tree if needed), writes the K/V of every layer, inserts the path
into the tree (nodes marked ``kvshare_estimated`` so they never serve as
ground truth) and returns the longer match, which the scheduler locks like any
other. ``checkpoint`` learns from what was prefilled densely: it records the
exact materialization and, in ``kvcmas``, the exact correction relative to the
source the segment could have been copied from, as a new anchor.

Errors inside the kvshare path never fail a request: they are logged, counted
as ``internal_error`` and the request is prefilled densely.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sglang_kvshare.cache.kv_pool_io import read_segment
from sglang_kvshare.cache.kv_writer import Correction, write_resolved
from sglang_kvshare.cache.placeholder import Materialization, PlaceholderRegistry, content_hash
from sglang_kvshare.config import KVShareConfig
from sglang_kvshare.protocol import AnnotationError, Annotation, parse_annotation

logger = logging.getLogger(__name__)

REPORT_KEY = "kvshare"


@dataclass
class SegmentOutcome:
    """How one segment of one request was served (part of the report)."""

    index: int
    kind: str
    slot: Optional[str]
    tokens: int
    resolved_by: str = "dense"  # hit | alignment | correction | dense
    resolved_tokens: int = 0  # rows served without prefill (a partial source covers fewer)
    reason: Optional[str] = None
    source_agent: Optional[str] = None
    entropy: Optional[float] = None
    pool_anchors: Optional[int] = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class RequestPlan:
    """Per-request kvshare state, from first match to release."""

    annotation: Annotation
    tokens: tuple[int, ...]
    hashes: list[str]
    extra_key: Optional[str]
    cache_salt: Optional[str]
    exact_len: int = 0  # radix hit before any assembly (first match)
    assembled_end: int = 0  # prefix length after assembly
    outcomes: list[SegmentOutcome] = field(default_factory=list)
    sources: dict[int, Materialization] = field(default_factory=dict)
    learned: set[int] = field(default_factory=set)
    counted: bool = False
    attempted: bool = False  # assembly ran once; a repeat only re-runs if its nodes were evicted
    assembly_seconds: float = 0.0

    @property
    def agent(self) -> str:
        return self.annotation.agent

    def report(self) -> dict:
        by = defaultdict(int)
        for o in self.outcomes:
            if o.resolved_by != "dense":
                by[o.resolved_by] += o.resolved_tokens
        total = sum(o.tokens for o in self.outcomes)
        return {
            "agent": self.agent,
            "tokens_exact_hit": by["hit"],
            "tokens_aligned": by["alignment"],
            "tokens_corrected": by["correction"],
            "tokens_prefilled": total - by["hit"] - by["alignment"] - by["correction"],
            "shared_tokens": sum(o.tokens for o in self.outcomes if o.kind == "shared"),
            "shared_tokens_reused": sum(o.resolved_tokens for o in self.outcomes
                                        if o.kind == "shared" and o.resolved_by in ("alignment", "correction")),
            "assembly_seconds": round(self.assembly_seconds, 6),
            "segments": [o.as_dict() for o in self.outcomes],
            "fallbacks": [{"segment": o.index, "slot": o.slot, "reason": o.reason}
                          for o in self.outcomes if o.reason is not None],
        }


@dataclass
class _Resolution:
    """A resolved segment before it is written: where its source rows are, and the correction."""

    how: str  # alignment | correction
    source: Materialization
    src_idx: torch.Tensor  # pool slots of the source's rows
    correction: Optional[Correction] = None

    @property
    def rows(self) -> int:
        return int(self.src_idx.shape[0])


class _Unresolved(Exception):
    """A segment could not be resolved; ``reason`` goes into the report."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class KVShareRadixCache(RadixCache):
    """A ``RadixCache`` that reuses shared segments across agents; see the module docstring."""

    def __init__(self, params: CacheInitParams, *, config: KVShareConfig,
                 model_config: Optional[Any] = None) -> None:
        self.kvshare_config = config
        self.model_config = model_config
        self.registry = PlaceholderRegistry()
        self._plans: dict[str, RequestPlan] = {}
        self.unsupported_reason: Optional[str] = None
        self.spec = None
        self.estimator = None
        self._estimator_lock = threading.RLock()
        self.counters: dict[str, float] = defaultdict(float)
        self._observations: "queue.Queue[tuple]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        super().__init__(params)
        if config.mode != "off":
            self._init_correction(model_config)

    # ------------------------------------------------------------ set-up
    def _init_correction(self, model_config: Optional[Any]) -> None:
        from sglang_kvshare.correction import RopeSpec, UnsupportedAttentionError, make_estimator

        hf_config = getattr(model_config, "hf_config", None) if model_config is not None else None
        try:
            if hf_config is None:
                raise UnsupportedAttentionError("the model config is not available to the cache")
            self.spec = RopeSpec.from_hf_config(getattr(hf_config, "text_config", None) or hf_config)
        except UnsupportedAttentionError as exc:
            self.unsupported_reason = str(exc)
            logger.warning("sglang-kvshare: %s; kvshare is disabled, serving like stock SGLang", exc)
            return
        self.estimator = self._make_estimator(make_estimator)

    def _make_estimator(self, make_estimator):
        cfg = self.kvshare_config
        if cfg.mode == "fullshared":
            return make_estimator("fullshared", self.spec)
        return make_estimator(cfg.mode, self.spec, tau=cfg.tau, capacity=cfg.effective_capacity,
                              rank=cfg.effective_rank, window=cfg.evict_window, gate_len=cfg.gate_max_tokens or None)

    @property
    def active(self) -> bool:
        return self.kvshare_config.mode != "off" and self.estimator is not None and not self.disable

    # ------------------------------------------------------------ tree hooks
    def reset(self) -> None:
        super().reset()
        # RadixCache.__init__ calls reset() before our attributes exist.
        if hasattr(self, "registry"):
            self.registry.reset()
            self._plans.clear()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        req = params.req
        if req is None or self.kvshare_config.mode == "off" or self.disable or self.is_eagle:
            return result
        try:
            plan = self._plan_for(req)
            if plan is None:
                return result
            if not self.active:
                self._mark_unsupported(plan)
                self._publish_report(req, plan)
                return result
            m = result.device_prefix_len
            if plan.attempted and m >= plan.assembled_end:
                return result  # already assembled (or nothing to do): no redo, no new slots
            t0 = time.perf_counter()
            longer = self._assemble(req, plan, params, result)
            plan.assembly_seconds += time.perf_counter() - t0
            self._publish_report(req, plan)
            return longer
        except Exception:  # noqa: BLE001 - never fail a request because of kvshare
            logger.exception("sglang-kvshare: assembly failed; prefilling densely")
            self.counters["internal_errors"] += 1
            return result

    def checkpoint(self, req, *, up_to: int):
        super().checkpoint(req, up_to=up_to)
        plan = self._plans.get(req.rid)
        if plan is None or not self.active:
            return
        try:
            if not plan.counted:
                self._count(plan)
                plan.counted = True
            self._learn(req, plan, up_to)
            if plan.annotation.output_slot and req.finished():
                self._record_output(req, plan, up_to)
        except Exception:  # noqa: BLE001
            logger.exception("sglang-kvshare: learning from a dense prefill failed")
            self.counters["internal_errors"] += 1

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._plans.pop(req.rid, None)

    def _split_node(self, key, child: TreeNode, split_len: int):
        new_node = super()._split_node(key, child, split_len)
        # Both halves of an estimated node hold estimated KV.
        if getattr(child, "kvshare_estimated", False):
            new_node.kvshare_estimated = True
        return new_node

    # ------------------------------------------------------------ planning
    def _plan_for(self, req) -> Optional[RequestPlan]:
        plan = self._plans.get(req.rid)
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
            self.counters["malformed_annotations"] += 1
            return None
        if ann is None:
            return None
        plan = RequestPlan(
            annotation=ann, tokens=tokens,
            hashes=[content_hash(tokens[s.start:s.end]) for s in ann.segments],
            extra_key=req.extra_key, cache_salt=getattr(req, "cache_salt", None),
            outcomes=[SegmentOutcome(i, s.kind, s.slot, s.length) for i, s in enumerate(ann.segments)],
        )
        self._plans[req.rid] = plan
        return plan

    def _mark_unsupported(self, plan: RequestPlan) -> None:
        for o in plan.outcomes:
            if o.resolved_by == "dense" and o.reason is None:
                o.reason = "model_unsupported"

    # ------------------------------------------------------------ assembly
    def _assemble(self, req, plan: RequestPlan, params: MatchPrefixParams, result: MatchResult) -> MatchResult:
        m = result.device_prefix_len
        limit = len(params.key)  # the scheduler never matches the last prompt token
        if not plan.attempted:
            plan.exact_len = m  # first call: everything matched so far is an exact radix hit
        plan.attempted = True
        for o, seg in zip(plan.outcomes, plan.annotation.segments):
            if seg.end <= plan.exact_len:
                o.resolved_by, o.resolved_tokens = "hit", o.tokens
            if seg.kind == "shared" and seg.end > m:
                src = self.registry.slot(seg.slot).latest(plan.hashes[o.index])
                if src is not None and src.path_tokens != plan.tokens[:seg.end]:
                    plan.sources[o.index] = src

        locks: list[TreeNode] = []
        pieces: list[tuple[object, int, int, _Resolution]] = []  # (segment, lo, hi, resolution)
        resolved: list[tuple[int, bool, Materialization]] = []  # (segment, complete, source)
        pos = m
        self.inc_lock_ref(result.last_device_node)
        locks.append(result.last_device_node)
        try:
            for o, seg in zip(plan.outcomes, plan.annotation.segments):
                if seg.end <= m:
                    continue
                if pos >= limit:
                    break
                try:
                    res = self._resolve(plan, o, seg, locks)
                except _Unresolved as exc:
                    o.reason = exc.reason
                    o.resolved_by = "dense"
                    break
                # A source may cover only a prefix of the segment (a producer's output
                # lacks the KV of its last token): resolve what it covers, then stop.
                row_end = min(seg.end, limit, seg.start + res.rows)
                if row_end <= pos:
                    o.reason = "source_too_short"
                    break
                lo, hi = pos - seg.start, row_end - seg.start
                pieces.append((seg, lo, hi, res))
                o.resolved_by, o.reason, o.resolved_tokens = res.how, None, row_end - seg.start
                pos = row_end
                complete = row_end == seg.end
                resolved.append((o.index, complete, res.source))
                if not complete:
                    o.reason = "partial" if row_end < limit else None
                    break  # the last prompt token is always computed
            if not pieces:
                plan.assembled_end = m
                return result
            new_idx = self._alloc(pos - m)
            if new_idx is None:
                for idx, _, _ in resolved:
                    out = plan.outcomes[idx]
                    out.resolved_by, out.reason, out.resolved_tokens = "dense", "alloc_failed", 0
                plan.assembled_end = m
                self.counters["alloc_failed"] += 1
                return result
            kvcache = self.token_to_kv_pool_allocator.get_kvcache()
            offset = 0
            for seg, lo, hi, res in pieces:
                write_resolved(kvcache, self.spec, src_idx=res.src_idx, dst_idx=new_idx[offset:offset + hi - lo],
                               src_start=res.source.start, dst_start=seg.start, lo=lo, hi=hi,
                               correction=res.correction)
                offset += hi - lo
            self._insert_estimated(plan, result, pos, new_idx)
        finally:
            for node in locks:
                self.dec_lock_ref(node)
        for idx, complete, _ in resolved:
            if complete:
                self._record_materialization(plan, idx, exact=False)
        plan.assembled_end = pos
        longer = super().match_prefix(params)
        if longer.device_prefix_len != pos:
            logger.warning("sglang-kvshare: assembled %d tokens but the tree matches %d",
                           pos, longer.device_prefix_len)
        return longer

    def _resolve(self, plan: RequestPlan, o: SegmentOutcome, seg, locks: list[TreeNode]) -> _Resolution:
        """Find a live source for the segment and decide how to reuse it, or raise _Unresolved."""
        from sglang_kvshare.correction import SegmentCache

        if seg.kind == "shared":
            candidates = self.registry.slot(seg.slot).all_for(plan.hashes[o.index])
        else:
            candidates = self.registry.private_sources(plan.agent, plan.hashes[o.index])
        candidates = [c for c in candidates if c.path_tokens != plan.tokens[:seg.end]]
        if not candidates:
            raise _Unresolved("no_source")
        located = None
        for cand in candidates:  # latest first; skip copies the tree has evicted
            located = self._locate(cand)
            if located is not None:
                source = cand
                break
        if located is None:
            raise _Unresolved("source_evicted")
        indices, node = located
        self.inc_lock_ref(node)
        locks.append(node)
        o.source_agent = source.agent
        if seg.kind == "private" or self.kvshare_config.mode == "fullshared":
            return _Resolution("alignment", source, indices)
        k_src, v_src = read_segment(self.token_to_kv_pool_allocator.get_kvcache(), indices)
        src_cache = SegmentCache(k_src, v_src, source.start, source.agent, exact=source.exact)
        with self._estimator_lock:
            pool = self.estimator.pool(seg.slot)
            o.pool_anchors = len(pool)
            est = self.estimator.estimate(seg.slot, src_cache, plan.agent, seg.start)
            o.entropy = None if est.entropy is None else float(est.entropy)
            if not est.accepted:
                raise _Unresolved(est.reason)
            edge = self.estimator.edge(source.agent, plan.agent)
            by_id = {a.id: a for a in pool.anchors}
            chosen = [by_id[i] for i in est.anchor_ids]
            correction = Correction(deltas_k=[a.deltas[edge][0] for a in chosen],
                                    deltas_v=[a.deltas[edge][1] for a in chosen],
                                    weights_k=est.token_weights_k, weights_v=est.token_weights_v,
                                    covered=est.covered)
        return _Resolution("correction", source, indices, correction)

    def _locate(self, mat: Materialization) -> Optional[tuple[torch.Tensor, TreeNode]]:
        """Current pool indices of a materialization, or None if the tree lost it."""
        key = RadixKey(array("q", mat.path_tokens), mat.extra_key, cache_salt=mat.cache_salt)
        values, node = self._match_prefix_helper(self.root_node, key)
        if sum(len(v) for v in values) < mat.end:
            return None
        return torch.cat(values)[mat.start:mat.end], node

    def _alloc(self, n: int) -> Optional[torch.Tensor]:
        allocator = self.token_to_kv_pool_allocator
        idx = allocator.alloc(n)
        if idx is None:
            self.evict(EvictParams(num_tokens=n))
            idx = allocator.alloc(n)
        return idx

    def _insert_estimated(self, plan: RequestPlan, result: MatchResult, pos: int, new_idx: torch.Tensor) -> None:
        m = result.device_prefix_len
        prefix_idx = self.path_device_indices(result.last_device_node)[:m]
        key = RadixKey(array("q", plan.tokens[:pos]), plan.extra_key, cache_salt=plan.cache_salt)
        ins = self.insert(InsertParams(key=key, value=torch.cat([prefix_idx, new_idx.to(prefix_idx.dtype)])))
        if ins.prefix_len > m:  # part of it appeared meanwhile: give our duplicate slots back
            self.token_to_kv_pool_allocator.free(new_idx[: ins.prefix_len - m])
        node = ins.last_device_node
        depth = pos
        while node is not None and node is not self.root_node and depth > m:
            node.kvshare_estimated = True
            depth -= len(node.key)
            node = node.parent

    def _record_materialization(self, plan: RequestPlan, idx: int, *, exact: bool) -> None:
        seg = plan.annotation.segments[idx]
        mat = Materialization(agent=plan.agent, path_tokens=plan.tokens[:seg.end], extra_key=plan.extra_key,
                              cache_salt=plan.cache_salt, start=seg.start, exact=exact)
        if seg.kind == "shared":
            self.registry.slot(seg.slot).record(plan.hashes[idx], mat)
        else:
            self.registry.record_private(plan.agent, plan.hashes[idx], mat)

    # ------------------------------------------------------------ learning
    def _count(self, plan: RequestPlan) -> None:
        for o in plan.outcomes:
            if o.kind != "shared":
                continue
            st = self.registry.slot(o.slot).stats
            st.requests += 1
            st.shared_tokens_seen += o.tokens
            if o.resolved_by == "hit":
                st.resolved_hit += o.resolved_tokens
            elif o.resolved_by == "alignment":
                st.resolved_alignment += o.resolved_tokens
            elif o.resolved_by == "correction":
                st.resolved_correction += o.resolved_tokens
            st.prefilled_dense += o.tokens - o.resolved_tokens
            if o.reason is not None:
                st.fallbacks[o.reason] += 1
            if o.entropy is not None:
                st.gate_entropy_sum += o.entropy
                st.gate_decisions += 1
        self.counters["annotated_requests"] += 1
        self.counters["assembly_seconds"] += plan.assembly_seconds

    def _learn(self, req, plan: RequestPlan, up_to: int) -> None:
        """Record what the model computed densely (segments fully inside ``up_to``)."""
        from sglang_kvshare.correction import SegmentCache

        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        kvcache = self.token_to_kv_pool_allocator.get_kvcache()
        for o, seg in zip(plan.outcomes, plan.annotation.segments):
            if o.index in plan.learned or seg.end > up_to:
                continue
            plan.learned.add(o.index)
            if o.resolved_by != "dense":
                if o.resolved_by == "hit":
                    self._record_materialization(plan, o.index, exact=True)  # refresh: latest copy
                continue
            self._record_materialization(plan, o.index, exact=True)
            source = plan.sources.get(o.index)
            if seg.kind != "shared" or source is None or self.kvshare_config.mode == "fullshared":
                continue
            if source.agent == plan.agent and source.start == seg.start:
                continue  # same agent, same offset (e.g. a client's commit of its own output): no deviation to learn
            located = self._locate(source)
            if located is None:
                self.counters["observations_source_lost"] += 1
                continue
            t0 = time.perf_counter()
            k_src, v_src = read_segment(kvcache, located[0])
            k_tgt, v_tgt = read_segment(kvcache, row[seg.start:seg.start + k_src.shape[1]])
            self.counters["observation_copy_seconds"] += time.perf_counter() - t0
            job = (seg.slot, SegmentCache(k_src, v_src, source.start, source.agent, exact=source.exact),
                   SegmentCache(k_tgt, v_tgt, seg.start, plan.agent, exact=True), plan.hashes[o.index])
            if self.kvshare_config.learn_async:
                self._ensure_worker()
                self._observations.put(job)
            else:
                self._observe(job)

    def _record_output(self, req, plan: RequestPlan, up_to: int) -> None:
        """A finished producer's generated tokens become a source for its output slot."""
        out_ids = tuple(int(t) for t in req.output_ids)
        in_tree = min(max(up_to - len(plan.tokens), 0), len(out_ids))
        if not out_ids or in_tree == 0:
            return
        mat = Materialization(agent=plan.agent, path_tokens=plan.tokens + out_ids[:in_tree],
                              extra_key=plan.extra_key, cache_salt=plan.cache_salt, start=len(plan.tokens),
                              exact=True)
        node = self.registry.slot(plan.annotation.output_slot)
        # Consumers may pass the whole output or only what has KV; both find it.
        for content in {content_hash(out_ids), content_hash(out_ids[:in_tree])}:
            node.record(content, mat)

    def _observe(self, job) -> None:
        slot, source, target, content = job
        budget = self.kvshare_config.pool_budget_mb * 2**20
        t0 = time.perf_counter()
        with self._estimator_lock:
            if self.estimator.memory_bytes() >= budget:
                self.counters["observations_skipped_budget"] += 1
                return
            self.estimator.observe(slot, source, target, content_key=content)
        self.counters["observations"] += 1
        self.counters["observe_seconds"] += time.perf_counter() - t0

    def _ensure_worker(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            return

        def run() -> None:
            while True:
                job = self._observations.get()
                try:
                    self._observe(job)
                except Exception:  # noqa: BLE001
                    logger.exception("sglang-kvshare: recording an anchor failed")
                    self.counters["internal_errors"] += 1
                finally:
                    self._observations.task_done()

        self._worker = threading.Thread(target=run, name="kvshare-learn", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ reporting
    def _publish_report(self, req, plan: RequestPlan) -> None:
        """Attach the report to the response's meta_info (``meta_info["kvshare"][0]``)."""
        info = req.customized_info if isinstance(getattr(req, "customized_info", None), dict) else {}
        info[REPORT_KEY] = [plan.report()]
        req.customized_info = info

    def kvshare_stats(self) -> dict:
        """Totals and per-slot counters (plain Python types)."""
        slots = {name: node.stats.as_dict() for name, node in self.registry.slots.items()}
        with self._estimator_lock:
            describe = self.estimator.describe() if self.estimator is not None else {}
            memory = self.estimator.memory_bytes() if self.estimator is not None else 0
        for name, info in slots.items():
            anchors = describe.get(name, [])
            info["anchors"] = len(anchors)
            info["anchor_bytes"] = int(sum(a.get("bytes", 0) for a in anchors))
        seen = sum(s["shared_tokens_seen"] for s in slots.values())
        reused = sum(s["resolved_alignment"] + s["resolved_correction"] for s in slots.values())
        allocator = self.token_to_kv_pool_allocator
        return {
            "mode": self.kvshare_config.mode,
            "config": dict(self.kvshare_config.__dict__),
            "kv_pool_tokens": {"available": int(allocator.available_size()), "evictable": int(self.evictable_size()),
                               "protected": int(self.protected_size()), "total": int(allocator.size)},
            "unsupported_reason": self.unsupported_reason,
            "shared_tokens_seen": seen,
            "reuse_ratio": reused / seen if seen else 0.0,
            "anchor_bytes": int(memory),
            "pending_observations": self._observations.unfinished_tasks,
            "counters": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.counters.items()},
            "slots": slots,
        }

    # ------------------------------------------------------------ admin
    def kvshare_pools(self, slot: Optional[str] = None) -> dict:
        """Per slot, each anchor: id, length, age, activations, edges, rank, bytes."""
        with self._estimator_lock:
            describe = self.estimator.describe() if self.estimator is not None else {}
        if slot is not None:
            if slot not in describe and slot not in self.registry.slots:
                raise KeyError(slot)
            return {slot: describe.get(slot, [])}
        names = set(describe) | set(self.registry.slots)
        return {name: describe.get(name, []) for name in sorted(names)}

    def kvshare_configure(self, *, tau: Optional[float] = None, capacity: Optional[int] = None,
                          rank: Optional[int] = None, mode: Optional[str] = None) -> KVShareConfig:
        """Apply a validated change atomically (all or nothing); returns the new config.

        ``mode`` may switch among ``off``, ``fullshared`` and ``kvcmas`` at runtime;
        switching between fullshared and kvcmas rebuilds the estimator (pools start empty).
        """
        from sglang_kvshare.correction import make_estimator

        changes = {k: v for k, v in dict(tau=tau, capacity=capacity, rank=rank, mode=mode).items() if v is not None}
        if changes.get("mode") == "kvcomm":
            raise ValueError("mode kvcomm is not served (it needs reference prefills); use fullshared or kvcmas")
        new = self.kvshare_config.replace(**changes)  # validates; raises ValueError
        with self._estimator_lock:
            rebuild = new.mode != self.kvshare_config.mode and new.mode != "off"
            self.kvshare_config = new
            if new.mode != "off" and self.spec is None and self.unsupported_reason is None:
                self._init_correction(self.model_config)
            elif rebuild and self.spec is not None:
                self.estimator = self._make_estimator(make_estimator)
            elif self.estimator is not None and new.mode == "kvcmas":
                self.estimator.configure(tau=new.tau, capacity=new.effective_capacity,
                                         rank=new.effective_rank)
        return new

    def kvshare_reset(self, slot: Optional[str] = None) -> None:
        """Empty the anchor pools (and materialization records) of one slot or all."""
        with self._estimator_lock:
            if self.estimator is not None:
                if slot is None:
                    self.estimator.reset()
                elif hasattr(self.estimator, "pools") and slot in self.estimator.pools:
                    self.estimator.pools[slot].reset()
            self.registry.reset(slot)
