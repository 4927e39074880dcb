"""The last step of a request's path: what the response says about its reuse (``meta_info["kvshare"][0]``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sglang_kvshare.cache.plan import RequestPlan

REPORT_KEY = "kvshare"


def build(plan: RequestPlan) -> dict:
    """The report of ``plan`` as plain types: token counts by how they were served, per segment, fallbacks."""
    by: dict[str, int] = defaultdict(int)
    for o in plan.state.outcomes:
        if o.resolved_by != "dense":
            by[o.resolved_by] += o.resolved_tokens
    total = sum(o.tokens for o in plan.state.outcomes)
    # NOTE: the totals count tokens, not segments: an exact or estimate match may end inside a segment
    # (a system prompt that shares its first tokens with another), which then stays "dense" below.
    # NOTE: estimate rows another request still owed a recompute are recomputed by this one's forward: counted
    # there (tokens_sparse_recomputed), not as an estimate hit.
    exact, estimate = plan.state.exact_len, plan.state.estimate_len - plan.state.adopted
    return {
        "agent": plan.agent,
        "tokens_exact_hit": exact,
        "tokens_aligned": by["alignment"],
        "tokens_corrected": by["correction"],
        "tokens_estimate_hit": estimate,
        "tokens_prefilled": total - exact - estimate - by["alignment"] - by["correction"],
        "shared_tokens": sum(o.tokens for o in plan.state.outcomes if o.kind == "shared"),
        "shared_tokens_reused": sum(o.resolved_tokens for o in plan.state.outcomes if o.kind == "shared"
                                    and o.resolved_by in ("estimate_hit", "alignment", "correction")),
        "tokens_head_recomputed": sum(o.head_recomputed or 0 for o in plan.state.outcomes),
        # Rows recomputed inside the prefill forward (the sparse extend): SGLang counts them as cached.
        "tokens_sparse_recomputed": plan.state.sparse_recomputed,
        "prefill_forwards": plan.state.prefill_forwards,
        "assembly_seconds": round(plan.state.assembly_seconds, 6),
        **({"recompute": plan.state.recompute_via} if plan.state.recompute_via else {}),
        **({"sparse_fallback": plan.state.sparse_fallback} if plan.state.sparse_fallback else {}),
        "segments": [o.as_dict() for o in plan.state.outcomes],
        "fallbacks": [{"segment": o.index, "slot": o.slot, "reason": o.reason}
                      for o in plan.state.outcomes if o.reason is not None],
    }


def publish(req: Any, plan: RequestPlan) -> None:
    """Attach the report to the response's meta_info (``meta_info["kvshare"][0]``); mutates ``req.customized_info``."""
    info = req.customized_info if isinstance(getattr(req, "customized_info", None), dict) else {}
    info[REPORT_KEY] = [build(plan)]
    req.customized_info = info
