"""How one segment of one request was served: the unit of the report and of the per-slot stats.

A module of its own (nothing from the cache imported) because both the copy
registry (``registry.SlotStats`` counts outcomes) and the request plan hold
outcomes, and neither may import the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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
    gate_fallback: Optional[str] = None  # kvcmas: aligned because the pool could not gate yet (its reason)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}
