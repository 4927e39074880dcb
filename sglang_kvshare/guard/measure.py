"""One verified request: its served next-token distributions against a dense reference's, position by position.

Both sides come as SGLang returns them: per generated position, the top-k
``(logprob, token_id)`` pairs (``output_top_logprobs`` for the served request,
``input_top_logprobs`` of a dense prefill of prompt + output for the
reference). The reference was computed with exact KV only, so the comparison
never judges an approximation by itself.

* top-1 agreement: the share of positions whose most likely token is the same.
* KL(reference || served) over the reference's top-k: a token missing from
  the served top-k is given the served k-th logprob (the most it could have),
  so the value is a lower bound of the KL over those tokens; the mass outside
  the reference's top-k is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

Dist = Sequence[tuple[float, int]]  # (logprob, token id), most likely first or in any order


@dataclass(frozen=True)
class RequestFidelity:
    """What one verified request measured: positions compared, top-1 agreement and mean top-k KL."""

    positions: int
    top1: float
    kl: float


def _top1(dist: Dist) -> Optional[int]:
    return max(dist, key=lambda pair: pair[0])[1] if dist else None


def _kl(reference: Dist, served: Dist) -> float:
    served_lp = {token: lp for lp, token in served}
    floor = min(served_lp.values()) if served_lp else -30.0
    total = 0.0
    for lp, token in reference:
        if lp is None or not math.isfinite(lp):
            continue
        q = served_lp.get(token, floor)
        q = q if q is not None and math.isfinite(q) else floor
        total += math.exp(lp) * (lp - q)
    return max(total, 0.0)


def compare(served: Sequence[Dist], reference: Sequence[Dist]) -> Optional[RequestFidelity]:
    """The fidelity of ``served`` against ``reference`` over their common positions; None when there is none."""
    pairs = [(s, r) for s, r in zip(served, reference) if s and r]
    if not pairs:
        return None
    agree = sum(_top1(s) == _top1(r) for s, r in pairs)
    kl = sum(_kl(r, s) for s, r in pairs) / len(pairs)
    return RequestFidelity(len(pairs), agree / len(pairs), kl)
