"""A running mean with a 95 % interval, in constant memory, over one value per verified request.

Why per request and not per position: positions of one answer are strongly
correlated (one early divergence changes every later token), so treating them
as independent samples would give intervals far too narrow. The unit of
evidence is a request; its value is the share (top-1) or the mean (KL) over
its positions. The interval is Student's t on the mean (Welford's running
variance), clipped to the metric's range; with fewer than two requests it is
the whole range. Why t and not the normal quantile: a scope is judged on
few requests (the controller's minimum is 5-20), where a spread estimated
from the same requests makes a normal interval too narrow: at 5 requests a
nominal 95 % normal interval holds the mean about 88 % of the time. The
variance carries a prior (``prior_std``, worth ``PRIOR_WEIGHT`` requests): a
few identical values (every position agreed in each of five answers) must not
give a zero-width interval that lets the controller act on five requests; as evidence grows the prior fades. The
prior's pseudo-requests count as degrees of freedom: ``n - 1 + PRIOR_WEIGHT``.

A value that moves in steps (top-1 of an answer of P positions moves by 1/P
per disagreeing position) may pass its mean step with each value
(``add(value, step=1/P)``); the prior spread is then at least that step: one
flip per answer. Why: on short answers (8 positions) a run of answers that
all agree says little about a rate of rare flips: with the fixed prior of
0.03 alone, ten such answers give [0.992, 1.0] whatever the true mean. With
a prior of one step at weight 2, ``n`` answers that all agree give a lower
end of about ``1 - 3 / (n P)`` (``1 - 2.97 / (n P)`` at ten answers), the
exact zero-event bound on the rate of answers with one flip; on long answers
(1/P below ``prior_std``) nothing changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from scipy.stats import t as student_t

Z95 = 1.959963984540054
PRIOR_WEIGHT = 2.0  # pseudo-requests behind the prior variance


@lru_cache(maxsize=256)
def t95(dof: float) -> float:
    """The two-sided 95 % quantile of Student's t with ``dof`` degrees of freedom (``Z95`` in the limit)."""
    return float(student_t.ppf(0.975, dof))


@dataclass
class RunningEstimate:
    """Count, mean and variance of the values added so far; ``lo``/``hi`` bound what the metric can be,
    ``prior_std`` is the per-request spread assumed before evidence (0: none), raised to the mean step of the
    values added with one."""

    lo: float = 0.0
    hi: float = 1.0
    prior_std: float = 0.0
    n: int = 0
    mean: float = 0.0
    _m2: float = 0.0
    _step_sum: float = 0.0

    def add(self, value: float, step: float = 0.0) -> None:
        """One request's value; ``step``: the smallest change it can show (1/positions for a share), or 0."""
        self.n += 1
        self._step_sum += max(step, 0.0)
        delta = value - self.mean
        self.mean += delta / self.n
        self._m2 += delta * (value - self.mean)

    def _prior(self) -> tuple[float, float]:
        """The prior spread and its weight in pseudo-requests (0 without a prior)."""
        prior = max(self.prior_std, self._step_sum / self.n)
        return prior, (PRIOR_WEIGHT if prior > 0 else 0.0)

    @property
    def dof(self) -> float:
        """Degrees of freedom of the spread: the requests less one, plus the prior's pseudo-requests."""
        return self.n - 1 + self._prior()[1] if self.n >= 2 else 0.0

    @property
    def std(self) -> float:
        """The sample spread, shrunk towards ``prior_std`` by ``PRIOR_WEIGHT`` pseudo-requests."""
        if self.n < 2:
            return float("inf")
        prior, weight = self._prior()
        return math.sqrt((self._m2 + weight * prior ** 2) / (self.n - 1 + weight))

    def interval(self, z: Optional[float] = None) -> tuple[float, float]:
        """The 95 % interval of the mean, Student's t on ``dof`` (the metric's whole range below two samples);
        ``z``: a fixed multiple of the standard error instead (1.0: one standard error either side)."""
        if self.n < 2:
            return self.lo, self.hi
        half = (t95(self.dof) if z is None else z) * self.std / math.sqrt(self.n)
        return max(self.lo, self.mean - half), min(self.hi, self.mean + half)

    def as_dict(self) -> dict:
        """Plain JSON: an unbounded end of the interval is null."""
        low, high = self.interval()
        return {"n": self.n, "mean": None if self.n == 0 else self.mean,
                "ci95": [v if math.isfinite(v) else None for v in (low, high)]}
