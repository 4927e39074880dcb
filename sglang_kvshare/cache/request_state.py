"""Per-request kvshare state, kept on the request object itself.

Why on the request (``req.kvshare_plan``) and not in a table keyed by ``rid``:
a request aborted while it waits never reaches ``on_release``, and clients
choose their own ``rid``s, so a table outlives its requests and hands one
request's plan to the next that reuses the name. On the request, the state
dies with it and a new request always starts clean.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_kvshare.cache.registry import Namespace
from sglang_kvshare.protocol import Annotation

PLAN_ATTR = "kvshare_plan"
REPORT_KEY = "kvshare"


@dataclass
class SegmentOutcome:
    """How one segment of one request was served (part of the report)."""

    index: int
    kind: str
    slot: Optional[str]
    tokens: int
    resolved_by: str = "dense"  # hit | estimate_hit | alignment | correction | dense
    resolved_tokens: int = 0  # rows served without prefill (a partial source or a recomputed head covers fewer)
    head_recomputed: Optional[int] = None  # rows of a reused segment's head prefilled densely
    reason: Optional[str] = None
    source_agent: Optional[str] = None
    entropy: Optional[float] = None
    pool_anchors: Optional[int] = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class RequestPlan:
    """Everything kvshare knows about one annotated request, from first match to release.

    ``est_start`` is the first prompt position whose KV is an estimate (assembled),
    or None while the request holds exact KV only. Everything from there on,
    including what the model computes on top of it, is kept in the tree's
    estimate namespace and never counts as exact.
    """

    annotation: Annotation
    tokens: tuple[int, ...]
    hashes: list[str]
    namespace: Namespace
    agent_id: str
    outcomes: list[SegmentOutcome]
    exact_len: int = 0  # radix hit before any assembly (first match)
    assembled_end: int = 0  # prefix length after assembly
    est_start: Optional[int] = None
    next_stage: Optional[int] = None  # where staged prefill resumes reuse (None: prefill the rest)
    learned: set[int] = field(default_factory=set)
    counted: bool = False
    attempted: bool = False  # assembly ran once; a repeat only re-runs if its nodes were evicted
    assembly_seconds: float = 0.0

    @property
    def agent(self) -> str:
        return self.annotation.agent

    def exact_before(self, end: int) -> bool:
        """True when rows ``[0, end)`` of this request hold exact KV only."""
        return self.est_start is None or end <= self.est_start

    def report(self) -> dict:
        by: dict[str, int] = defaultdict(int)
        for o in self.outcomes:
            if o.resolved_by != "dense":
                by[o.resolved_by] += o.resolved_tokens
        total = sum(o.tokens for o in self.outcomes)
        return {
            "agent": self.agent,
            "tokens_exact_hit": by["hit"],
            "tokens_aligned": by["alignment"],
            "tokens_corrected": by["correction"],
            "tokens_estimate_hit": by["estimate_hit"],
            "tokens_prefilled": total - by["hit"] - by["estimate_hit"] - by["alignment"] - by["correction"],
            "shared_tokens": sum(o.tokens for o in self.outcomes if o.kind == "shared"),
            "shared_tokens_reused": sum(o.resolved_tokens for o in self.outcomes if o.kind == "shared"
                                        and o.resolved_by in ("estimate_hit", "alignment", "correction")),
            "tokens_head_recomputed": sum(o.head_recomputed or 0 for o in self.outcomes),
            "assembly_seconds": round(self.assembly_seconds, 6),
            "segments": [o.as_dict() for o in self.outcomes],
            "fallbacks": [{"segment": o.index, "slot": o.slot, "reason": o.reason}
                          for o in self.outcomes if o.reason is not None],
        }


def plan_of(req: Any) -> Optional[RequestPlan]:
    return getattr(req, PLAN_ATTR, None)


def attach(req: Any, plan: RequestPlan) -> None:
    setattr(req, PLAN_ATTR, plan)


def publish_report(req: Any, plan: RequestPlan) -> None:
    """Attach the report to the response's meta_info (``meta_info["kvshare"][0]``)."""
    info = req.customized_info if isinstance(getattr(req, "customized_info", None), dict) else {}
    info[REPORT_KEY] = [plan.report()]
    req.customized_info = info
