"""Which rows of a reused segment are recomputed in the request's own context: the one seam for row choice.

A reused segment's KV was computed in another context; recomputing some of
its rows in the request's own context (EPIC's head) buys fidelity for reuse.
How many rows is the request's ``RecomputeRule``: the server's share
(``--kvshare-recompute-ratio``), unless the request's annotation asks for a
longer head in rows (``recompute_head``, what the fidelity guard writes into
the requests of a scope it tightens); *which* rows is a ``RowPolicy``. ``HEAD``, the segment's first rows,
is the one policy served: the others measured (the rows a kvcmas correction
moves most, the rows the prompt's tail reads) did no better on the live
frontier (docs/research/STAGED_PREFILL.md; their offline study is
``benchmarks.research.row_policies``). A better policy comes back as one class here,
handed to the cache (``KVShareRadixCache(row_policy=...)``).

With the sparse extend the chosen rows are assembled with the rest of the
segment and owed to the request's next prefill forward
(``PendingRecompute``; ``server.sparse_extend`` folds them into it and
``settle``s them); without it a head is a dense stage before the segment's
reuse resumes, so only a head can be staged (``RecomputeRule.stage_rows``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence

import torch

from sglang_kvshare.cache.plan import RequestPlan
from sglang_kvshare.config import KVShareConfig
from sglang_kvshare.correction.plan import CorrectionPlan
from sglang_kvshare.counters import Counters
from sglang_kvshare.protocol import Annotation, Segment


class RowPolicy(Protocol):
    """Chooses the rows of a reused segment that are recomputed (a sparse extend's rows)."""

    name: str  # part of the estimate key: estimates made under one policy never serve another

    def choose(self, seg: Segment, budget: int, correction: Optional[CorrectionPlan]) -> Sequence[int]:
        """``budget`` distinct segment-relative rows of ``seg`` (each in ``[0, seg.length)``), ascending.

        ``correction``: the kvcmas correction the segment is served with (None: aligned). Pure: called on
        the scheduler thread while the request is matched, once per segment and match.
        """


@dataclass(frozen=True)
class HeadPolicy:
    """The first ``budget`` rows (EPIC): where alignment's error concentrates."""

    name: str = "head"

    def choose(self, seg: Segment, budget: int, correction: Optional[CorrectionPlan]) -> Sequence[int]:
        return range(budget)


HEAD = HeadPolicy()


@dataclass(frozen=True)
class RecomputeRule:
    """How many rows of a reused segment are recomputed, which (``policy``), and how.

    ``ratio`` of the segment (the server's share), or ``head`` rows where the
    request asked for more (the annotation's floor). ``sparse``: the rows
    are assembled with the rest of the segment and recomputed inside the
    request's prefill forward (``server.sparse_extend``); otherwise each head
    is a dense stage before the segment's reuse resumes.
    """

    head: int = 0
    ratio: float = 0.0
    sparse: bool = False
    policy: RowPolicy = HEAD
    min_reuse: int = 0  # a shared segment shorter than this is not reused at all (``reusable``)

    @property
    def key(self) -> str:
        """The rule as a part of the estimate namespace's tree key (``tree_paths.est_extra_key``).

        Why: an estimate hit serves the rows an earlier identical request left,
        recomputed or assembled as *its* rule said. Keyed by the rule, a request
        only ever matches estimates made under its own, so a scope the guard
        moved to a longer head (or a request that asks for one) is never served
        rows a shorter head left assembled. ``sparse`` is not part of it: a head
        recomputed in the forward or as a stage is the same KV.
        """
        return f"h{self.head}r{self.ratio:g}{self.policy.name}" + (f"m{self.min_reuse}" if self.min_reuse else "")

    def reusable(self, seg: Segment) -> bool:
        """Whether ``seg`` may be reused at all: a shared segment needs ``min_reuse`` tokens.

        Why: on segments of a few hundred tokens re-alignment with the recomputed
        share measured no better than prefilling whole segments at random (the
        random-mix line), and their prefill is cheap; a private segment is the
        agent's own text and is not held to it.
        """
        return seg.kind != "shared" or seg.length >= self.min_reuse

    def rows(self, seg: Segment) -> int:
        """How many rows of ``seg`` are recomputed."""
        # NOTE: rounded first, so 0.15 x 100 is 15 rows, not the 16 its float product would give.
        by_ratio = math.ceil(round(self.ratio * seg.length, 6)) if self.ratio > 0 else 0
        return min(max(self.head, by_ratio), seg.length)

    def chosen(self, seg: Segment, correction: Optional[CorrectionPlan], lo: int, hi: int) -> tuple[int, ...]:
        """The segment-relative rows of ``[lo, hi)`` a sparse extend recomputes (none when staged).

        Rows outside ``[lo, hi)`` are exact (below) or prefilled (above) anyway.
        """
        if not self.sparse:
            return ()
        n = self.rows(seg)
        return tuple(r for r in sorted(self.policy.choose(seg, n, correction)) if lo <= r < hi) if n else ()

    def stage_rows(self, seg: Segment) -> int:
        """Rows of ``seg`` prefilled as a stage before its reuse resumes (none with the sparse extend)."""
        return 0 if self.sparse else self.rows(seg)


def rule_of(config: KVShareConfig, annotation: Annotation, sparse_unsupported: Optional[str],
            policy: RowPolicy = HEAD) -> RecomputeRule:
    """The rule of a request of ``annotation``: the server's share, the annotation's head where longer; sparse
    where the sparse extend is on and this server supports it (``sparse_unsupported`` None)."""
    return RecomputeRule(annotation.recompute_head or 0, config.recompute_ratio,
                         sparse=config.sparse_extend and sparse_unsupported is None, policy=policy,
                         min_reuse=config.min_reuse_tokens)


class PendingRecompute:
    """Pool slots of assembled rows a prefill forward must still recompute (the scheduler's thread only).

    Why a registry of slots and not only a list on the request: another
    request with the same tokens may match those estimate rows before the first
    one's forward ran (it waited a round, or was aborted). It then *adopts* the
    owed rows and recomputes them itself; recomputing a row twice in the same
    context gives the same KV, serving it unrecomputed would not. A slot leaves
    the registry when a forward recomputed it, or when the tree evicts its
    node. ``counters`` (the cache's): where the forwards count their cost.
    """

    def __init__(self, counters: Optional[Counters] = None) -> None:
        self._slots: set[int] = set()
        self.counters = counters

    def __len__(self) -> int:
        return len(self._slots)

    def owe(self, slots: Iterable[int]) -> None:
        """Rows just assembled whose recompute is owed."""
        self._slots.update(int(s) for s in slots)

    def owed_positions(self, slots: torch.Tensor, start: int) -> list[int]:
        """Positions ``start + i`` of the request's rows ``slots[i]`` still owed a recompute."""
        if not self._slots or slots.numel() == 0:
            return []
        return [start + i for i, s in enumerate(slots.tolist()) if s in self._slots]

    def settle(self, slots: Iterable[int]) -> None:
        """Rows recomputed by a forward, or freed with their node: nothing owed any more."""
        if self._slots:
            self._slots.difference_update(int(s) for s in slots)

    def clear(self) -> None:
        self._slots.clear()

    def forward_done(self, rows: int, fold_seconds: float) -> None:
        """A prefill forward recomputed ``rows`` owed rows; folding them in took ``fold_seconds``."""
        if self.counters is not None:
            self.counters.add("sparse_forwards")
            self.counters.add("sparse_rows_recomputed", rows)
            self.counters.add("sparse_fold_seconds", fold_seconds)


def owe(plan: RequestPlan, rows: Sequence[int], path_slots: torch.Tensor, pending: PendingRecompute) -> None:
    """Owe the request's next forward the prompt positions ``rows`` (pool slots ``path_slots[rows]``)."""
    if not rows:
        return
    pending.owe(path_slots[list(rows)].tolist())
    plan.state.sparse_rows = sorted(set(plan.state.sparse_rows).union(rows))


def settle(plan: RequestPlan, rows: Sequence[int], slots: Sequence[int]) -> None:
    """A forward recomputed the request's owed positions ``rows`` (pool ``slots``): nothing owed, counted in its
    report (``tokens_sparse_recomputed``)."""
    done = set(rows)
    plan.state.sparse_rows = [p for p in plan.state.sparse_rows if p not in done]
    plan.state.sparse_recomputed += len(rows)
    if plan.state.owed is not None:
        plan.state.owed.settle(slots)
