"""The one seam for row choice (``cache/recompute.py``): the head policy served, and a policy plugged in."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang_kvshare.cache.plan import plan_of
from sglang_kvshare.cache.recompute import HEAD, RecomputeRule
from sglang_kvshare.protocol import Segment
from tests.cache.fakes import MiniScheduler, make_cache
from tests.cache.test_adapter import QUERY, SYS, annotated, warm


@dataclass(frozen=True)
class LastRows:
    """Test only: the segment's last rows, so a test sees rows the head would never choose."""

    name: str = "last"

    def choose(self, seg, budget, correction):
        return range(seg.length - budget, seg.length)


def test_the_head_rule_counts_chooses_and_stages_the_first_rows():
    seg = Segment(kind="shared", start=10, end=110, slot="s")
    rule = RecomputeRule(head=4, ratio=0.15, sparse=True)
    assert rule.policy is HEAD and rule.rows(seg) == 15  # the larger of the two, 0.15 x 100 rounded first
    assert rule.chosen(seg, None, 0, 100) == tuple(range(15)) and rule.stage_rows(seg) == 0
    assert rule.chosen(seg, None, 6, 100) == tuple(range(6, 15))  # rows below the match are exact already
    staged = RecomputeRule(head=4, ratio=0.15)
    assert staged.chosen(seg, None, 0, 100) == () and staged.stage_rows(seg) == 15
    assert rule.key == "h4r0.15head" and RecomputeRule(4, 0.15, policy=LastRows()).key == "h4r0.15last"


def _owed(policy, **config):
    sched = MiniScheduler(make_cache("fullshared", sparse_unsupported=None, recompute_ratio=0.25, row_policy=policy,
                                     **config))
    for agent in ("A", "B"):
        warm(sched, agent)
    sched.run(annotated("A"))
    b = annotated("B")
    sched.match(b)
    start = len(SYS["B"])
    return sched, b, [p - start for p in plan_of(b).state.sparse_rows]


def test_a_plugged_in_policy_chooses_the_rows_the_next_forward_recomputes():
    n = math.ceil(0.25 * len(QUERY))
    _, head_b, head_rows = _owed(None)
    assert head_rows == list(range(n))
    sched, b, rows = _owed(LastRows())
    assert rows == list(range(len(QUERY) - n, len(QUERY)))
    seg = b.report()["segments"][1]
    assert seg["resolved_by"] == "alignment" and seg["head_recomputed"] == n
    assert seg["resolved_tokens"] == len(QUERY) - n and b.report()["tokens_head_recomputed"] == n
    slots = sched.cache.path_device_indices(b.last_node)[[len(SYS["B"]) + r for r in rows]].tolist()
    assert len(sched.cache.pending_recompute) == n
    assert sched.cache.pending_recompute.owed_positions(sched.cache.path_device_indices(b.last_node),
                                                        0) == [len(SYS["B"]) + r for r in rows]
    # Estimates made under one policy never serve another.
    assert plan_of(b).tree_ns.est_extra_key != plan_of(head_b).tree_ns.est_extra_key
    assert slots


def test_staged_heads_are_the_first_rows_whatever_the_policy():
    """A stage is a contiguous dense stretch: without the sparse extend only a head can be recomputed."""
    sched = MiniScheduler(make_cache("fullshared", recompute_ratio=0.25, row_policy=LastRows()))
    for agent in ("A", "B"):
        warm(sched, agent)
    sched.run(annotated("A"))
    b = annotated("B")
    sched.run(b)
    n = math.ceil(0.25 * len(QUERY))
    seg = b.report()["segments"][1]
    assert plan_of(b).state.sparse_rows == [] and b.stages == 1 and b.report()["recompute"] == "staged"
    assert seg["head_recomputed"] == n and seg["resolved_tokens"] == len(QUERY) - n
