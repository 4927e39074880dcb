"""The fidelity target a server keeps (``--kvshare-fidelity-target``): ``top1>=0.99`` or ``kl<=0.01``.

No imports of the rest: the config validates the flag with it at launch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

Metric = Literal["top1", "kl"]
_FORMS = {"top1": ">=", "kl": "<="}
# The share of the allowed error a scope left undecided must keep in hand (``FidelityTarget.inner``): its mean is held
# to the target moved this far towards the ideal (top1>=0.99: 0.996). Why: a scope is judged on a few dozen verified
# answers, and one whose mean sits just past the bound serves the next requests below it about as often as above.
# Chosen offline (benchmarks.research.guard_sim) on development runs of the GSM8K and retrieval workloads, not on scored samples.
DEFAULT_BAND = 0.6
_SYNTAX = re.compile(r"^\s*(top1|kl)\s*(>=|<=)\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$")


@dataclass(frozen=True)
class FidelityTarget:
    """``metric`` must be ``>=`` (top1) or ``<=`` (kl) ``bound``, judged on a scope's 95 % interval."""

    metric: Metric
    bound: float

    @classmethod
    def parse(cls, text: str) -> "FidelityTarget":
        """Raises ``ValueError`` that shows the accepted forms."""
        match = _SYNTAX.match(text or "")
        if match is None:
            raise ValueError(f"fidelity target {text!r}: write top1>=P (0 < P <= 1) or kl<=D (D > 0), e.g. top1>=0.99")
        metric, op, value = match.group(1), match.group(2), float(match.group(3))
        if op != _FORMS[metric]:
            raise ValueError(f"fidelity target {text!r}: {metric} takes {_FORMS[metric]} (write top1>=P or kl<=D)")
        if metric == "top1" and not 0.0 < value <= 1.0:
            raise ValueError(f"fidelity target {text!r}: top1 must lie in (0, 1]")
        if metric == "kl" and not (value > 0.0 and math.isfinite(value)):
            raise ValueError(f"fidelity target {text!r}: kl must be positive")
        return cls(metric, value)

    def __str__(self) -> str:
        return f"{self.metric}{_FORMS[self.metric]}{self.bound:g}"

    def missed(self, interval: tuple[float, float]) -> bool:
        """The whole 95 % interval ``(low, high)`` is on the wrong side: the scope misses the target."""
        low, high = interval
        return high < self.bound if self.metric == "top1" else low > self.bound

    def inner(self, band: float) -> "FidelityTarget":
        """The target moved ``band`` of the allowed error towards the ideal (top1>=0.99 at 0.5: top1>=0.995;
        kl<=0.01 at 0.5: kl<=0.005): the mean a controller steers to, so that what it serves next meets the
        target itself, not only the sample it judged."""
        if self.metric == "top1":
            return FidelityTarget("top1", self.bound + band * (1.0 - self.bound))
        return FidelityTarget("kl", self.bound * (1.0 - band))

    def straddles(self, interval: tuple[float, float]) -> bool:
        """The interval holds the bound: neither missed nor met, the evidence decides nothing yet."""
        low, high = interval
        return low < self.bound <= high if self.metric == "top1" else low <= self.bound < high

    def severe(self, interval: tuple[float, float]) -> bool:
        """Missed by far (top-1 below 90 % of the bound, or KL above twice it): no head will fix it."""
        low, high = interval
        return high < 0.9 * self.bound if self.metric == "top1" else low > 2.0 * self.bound

    def error_ratio(self, interval: tuple[float, float]) -> float:
        """How many times the error the target allows the interval's most favourable end still shows: top-1's
        disagreement ``1 - high`` over ``1 - bound``, KL's ``low`` over ``bound`` (above 1: missed). Why the
        favourable end: a tightening sized on it is the least the evidence asks for, never an overshoot on noise."""
        low, high = interval
        if self.metric == "top1":
            allowed = 1.0 - self.bound
            return math.inf if allowed <= 0.0 else (1.0 - high) / allowed
        return low / self.bound

    def met_with_margin(self, interval: tuple[float, float], margin: float) -> bool:
        """The whole interval is on the right side by ``margin`` (of the distance to the metric's ideal)."""
        low, high = interval
        if self.metric == "top1":
            return low >= self.bound + margin * (1.0 - self.bound)
        return high <= self.bound * (1.0 - margin)
