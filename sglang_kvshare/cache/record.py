"""The fourth step of a request's path: remember its copies, learn from its dense prefills, count it.

* ``assembled``: a segment just assembled becomes a (non-exact) copy other
  requests can be served from.
* ``checkpointed``: each segment a checkpoint finished becomes a copy (exact
  only when everything before it is exact); in ``kvcmas`` a dense shared
  segment with an earlier copy becomes an observation for the learner (the
  exact correction relative to the copy it could have used).
* ``output``: a finished producer's generated tokens become a copy of its
  output slot.
* ``count``: the request's outcomes go into the per-slot stats, once.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from sglang_kvshare.cache import tree_paths
from sglang_kvshare.cache.kv_pool_io import learning_copy_dtype, pair_nbytes, pool_dtype, read_pair
from sglang_kvshare.cache.parts import CacheParts
from sglang_kvshare.cache.plan import RequestPlan
from sglang_kvshare.cache.registry import Materialization
from sglang_kvshare.cache.resolve import Piece, candidates
from sglang_kvshare.learning.learner import Observation


class Recorder:
    """Copy records, observations and per-slot counts of one cache."""

    def __init__(self, parts: CacheParts) -> None:
        self.parts = parts

    # ------------------------------------------------------------ copies
    def _node_at(self, plan: RequestPlan, tokens: Sequence[int]) -> Optional[Any]:
        return tree_paths.node_at(self.parts.tree, tokens, plan.state.est_start, plan.tree_ns)

    def _record(self, plan: RequestPlan, index: int, *, exact: bool) -> None:
        seg = plan.annotation.segments[index]
        node = self._node_at(plan, plan.tokens[:seg.end])
        if node is None:
            return
        mat = Materialization(agent=plan.agent_id, agent_name=plan.agent, node=node, start=seg.start, end=seg.end,
                              exact=exact, generation=self.parts.registry.generation, workflow=plan.workflow)
        records = self.parts.registry.namespace(plan.namespace)
        if seg.kind == "shared":
            slot = records.slot(seg.slot)
            self.parts.retention.recorded(node, slot, slot.record(plan.hashes[index], mat), plan)
        else:
            records.record_private(plan.agent_id, plan.hashes[index], mat)

    def assembled(self, plan: RequestPlan, pieces: list[Piece]) -> None:
        """Record each segment the pieces complete as a copy (an estimate)."""
        for p in pieces:
            seg = plan.annotation.segments[p.index]
            if seg.start + p.hi == seg.end:
                self._record(plan, p.index, exact=False)

    def checkpointed(self, req: Any, plan: RequestPlan, up_to: int) -> None:
        """Record the segments ``[0, up_to)`` finished and queue observations (kvcmas); each segment once."""
        records = self.parts.registry.namespace(plan.namespace)
        for o, seg in zip(plan.state.outcomes, plan.annotation.segments):
            if o.index in plan.state.learned or seg.end > up_to:
                continue
            plan.state.learned.add(o.index)
            if o.resolved_by in ("alignment", "correction"):
                continue  # recorded as an estimate when it was assembled
            exact = plan.state.exact_before(seg.end)
            source = None
            if o.resolved_by == "dense" and seg.kind == "shared" and exact:
                source = next(iter(candidates(records, plan, o, self.parts.registry.generation)), None)
            self._record(plan, o.index, exact=exact)
            if source is None or self.parts.state.config.mode != "kvcmas":
                continue
            if source.agent == plan.agent_id and source.start == seg.start:
                continue  # same agent, same offset (a client's commit of its own output): nothing to learn
            self._observe(req, plan, o.index, source)

    def _observe(self, req: Any, plan: RequestPlan, index: int, source: Materialization) -> None:
        from sglang_kvshare.correction import SegmentCache

        src_idx = tree_paths.rows(source.node, source.start, source.end)
        if src_idx is None:
            self.parts.counters.add("observations_source_lost")
            return
        seg = plan.annotation.segments[index]
        kvcache = self.parts.tree.token_to_kv_pool_allocator.get_kvcache()
        nbytes = pair_nbytes(kvcache, int(src_idx.numel()), learning_copy_dtype(kvcache))
        if not self.parts.learner.admit((plan.namespace, seg.slot), plan.hashes[index], source.agent, plan.agent_id,
                                        nbytes):
            return
        t0 = time.perf_counter()
        row = self.parts.tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx][seg.start:]
        k_src, v_src, k_tgt, v_tgt = read_pair(kvcache, src_idx, row, learning_copy_dtype(kvcache))
        self.parts.counters.add("learn_copy_seconds", time.perf_counter() - t0)
        self.parts.learner.submit(Observation(
            slot=(plan.namespace, seg.slot),
            source=SegmentCache(k_src, v_src, source.start, source.agent, exact=source.exact),
            target=SegmentCache(k_tgt, v_tgt, seg.start, plan.agent_id, exact=True),
            content_key=plan.hashes[index], compute_dtype=pool_dtype(kvcache)))

    def output(self, req: Any, plan: RequestPlan, up_to: int) -> None:
        """A finished producer's generated tokens become a copy of its output slot."""
        out_ids = tuple(int(t) for t in req.output_ids)
        in_tree = min(max(up_to - len(plan.tokens), 0), len(out_ids))
        if not out_ids or in_tree == 0:
            return
        node = self._node_at(plan, plan.tokens + out_ids[:in_tree])
        if node is None:
            return
        mat = Materialization(agent=plan.agent_id, agent_name=plan.agent, node=node, start=len(plan.tokens),
                              end=len(plan.tokens) + in_tree, exact=plan.state.est_start is None,
                              generation=self.parts.registry.generation, workflow=plan.workflow)
        slot = self.parts.registry.namespace(plan.namespace).slot(plan.annotation.output_slot)
        # Consumers may pass the whole output or only what has KV; both find it.
        for content in {self.parts.hasher(out_ids), self.parts.hasher(out_ids[:in_tree])}:
            self.parts.retention.recorded(node, slot, slot.record(content, mat), plan)

    # ------------------------------------------------------------ stats
    def count(self, plan: RequestPlan, sign: int = 1) -> None:
        """Add the request's shared-segment outcomes to the per-slot stats, once per request;
        ``sign=-1`` takes them back (a retracted request is planned and counted again)."""
        records = self.parts.registry.namespace(plan.namespace)
        for o in plan.state.outcomes:
            if o.kind != "shared":
                continue
            records.slot(o.slot).stats.add(o, sign)
        self.parts.counters.add("annotated_requests", sign)
        self.parts.counters.add("assembly_seconds", sign * plan.state.assembly_seconds)
