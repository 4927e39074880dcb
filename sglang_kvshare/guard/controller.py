"""Per scope, the setting that keeps the fidelity target: a longer recomputed head, then dense, and back.

A **scope** is a reuse scope plus an agent (``guard.serving``): the measured
quantity, one request's output distributions, mixes every reused segment of
that request, so it cannot be split by slot; an agent's role (its prompt, its position in the workflow)
decides how much reuse moves its outputs. Each scope climbs a ladder of
settings, from the server's own (its recompute share, head 0 here) through
longer heads (floors in rows over the share, each above what the share
already recomputes: ``ladder``) to ``dense`` (no reuse at all):

* tighten when the 95 % interval of the scope's estimate lies wholly on the
  wrong side of the target (``FidelityTarget.missed``), by as many steps as
  the miss asks for (``steps_for``): each step of the ladder cut the error by
  about a quarter on the frontier's fixed heads (``RUNG_ERROR_FACTOR``), so an
  interval whose best end still shows twice the allowed error climbs three
  steps at once, not one per ``min_samples``; such a climb stops at the
  longest head, since the model describes heads, not ``dense``: on short
  segments the longest head recomputes most rows and cuts far more than a
  quarter of the error (on development GSM8K questions the final agent's
  top-1 is 0.88 at head 0, yet a global head 64 meets 0.99), so ``dense`` is
  taken on evidence at the longest head; straight to ``dense`` when it misses
  by far (``severe``: a broken scope, which no head fixes, is caught within
  ``min_samples`` verified requests);
* tighten one step when the interval straddles the target and the mean falls
  short of the **aim**: the target moved ``band`` of the allowed error towards
  the ideal (``FidelityTarget.inner``; top1>=0.99 at the default 0.6: 0.996).
  Reason ``undecided_below`` when the mean is below the target itself,
  ``within_band`` when it is between the target and the aim. From
  ``min_samples`` verified requests on when the mean is short by more than its
  standard error (its one-sigma interval wholly short of the aim), and on the
  mean alone once ``DECIDE_AFTER`` times the minimum are in. Why the standard
  error early: at the minimum a scope whose truth meets the aim often shows a
  mean short of it by chance, and each such step climbs a rung the scope does
  not need and, with the margin a relax asks for, keeps it there. Why on the
  mean at all: a scope a few thousandths below the target needs hundreds of
  verified requests before its interval excludes it ((1.96 sigma / gap)^2 with
  a per-request spread of 0.02-0.05); a rule that waits for that serves the
  miss indefinitely. Why an aim inside the target: a scope kept where its mean
  over a few dozen answers sits just past the bound has a truth on either side
  about equally often, and the requests it serves next miss the target as
  often as not; the band is that margin. The guard errs towards exact KV: a
  relax needs the whole interval on the right side with a margin and twice the
  evidence, so a scope does not swing back and forth between two settings on
  noise;
* relax one step when the interval lies wholly on the right side by a margin
  (``met_with_margin``) and at least twice the minimum samples back it;
* otherwise stay. Every change starts the scope's estimates afresh (they
  measured the old setting), and samples of requests served under another
  setting than the current one are dropped as stale.

A ``dense`` scope serves no approximation, so it has nothing to measure: the
guard serves a small share of its requests under the next looser setting as
probes (``probe_setting``), and those samples decide whether it relaxes.

So a scope moves only on evidence (``min_samples`` verified requests at the
least), never back and forth on noise (a relax needs more evidence and a
margin). While its interval straddles the target the verify burst keeps
sampling it, up to ``DECIDE_AFTER`` times the minimum. Bounded: at most
``max_scopes`` scopes, least recently verified dropped first.

An operator may pin a scope to a setting. Pins live in a table of their own,
outside the scopes' LRU order: a pinned scope is never verified (nothing it
could decide), so in that order it would be the first dropped and the judge an
operator pinned ``dense`` would be served approximations again after a few
hundred other agents. Pins are never dropped; the table is bounded on its own
(``max_pins``), and a pin past it is refused (``PinLimitError``). A scope may
have a **parent** (``parent``: the guard makes an agent of a named workflow
the child of the same agent outside any workflow): a scope without a pin of
its own is served under its parent's pin.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

from sglang_kvshare.guard.estimate import RunningEstimate
from sglang_kvshare.guard.measure import RequestFidelity
from sglang_kvshare.guard.target import DEFAULT_BAND, FidelityTarget

DENSE = -1  # the setting "no reuse": every segment prefilled
# Per-request spreads assumed before evidence (estimate.py): of the order the frontier measured between
# answers at K=0 on SmolLM2-135M (top-1 0.95-1.0 per answer; KL a few 1e-3).
TOP1_PRIOR_STD = 0.03
KL_PRIOR_STD = 0.005
# The verify burst keeps sampling a scope whose interval straddles the target up to this many times
# min_samples verified requests: at 3, a setting costs at most 3 x min_samples burst verifications, and the mean
# of 3 x 6 requests with a spread of 0.03 has a standard error of 0.007.
DECIDE_AFTER = 3
# The share of a scope's error one step of the ladder leaves: on the frontier's fixed heads (50 GSM8K and 50
# HumanEval questions, SmolLM2-135M) teacher-forced disagreement fell from head 0 to 8, 16 and 32 by a factor of
# 0.72-0.81 per step. Only the size of a tightening reads it; a step too short is made up at the next decision.
RUNG_ERROR_FACTOR = 0.75
# Pins an operator can hold at once: a handful per deployment of agents; bounded so that a loop of pin calls
# cannot grow the table, and at most the scope table's default so a guard file keeps every pin (``guard.saved``).
MAX_PINS = 128


class PinLimitError(ValueError):
    """A pin past ``max_pins``: the message says how many are held and how to free one."""


# The heads a ladder draws its steps from, and how many it takes: doubling, so each step recomputes about twice the
# rows of the one below (the per-step error cut ``RUNG_ERROR_FACTOR`` was measured on such steps).
HEAD_STEPS = (8, 16, 32, 64, 128, 256, 512)
LADDER_HEADS = 4


def ladder(share_rows: int = 0, steps: tuple[int, ...] = HEAD_STEPS, heads: int = LADDER_HEADS) -> tuple[int, ...]:
    """The settings a scope may take, loosest first: the server's own (head 0), ``heads`` longer heads, ``DENSE``.

    ``share_rows``: the rows the server's recompute share already recomputes on the shortest segment it reuses
    (``share_floor``). A head is a floor over the share, so a head at or below that recomputes nothing more on
    any reused segment: the ladder starts above it, and each step changes what is served.
    """
    longer = sorted(h for h in set(steps) if h > max(share_rows, 0))[:heads]
    return (0, *longer, DENSE)


def share_floor(recompute_ratio: float, min_reuse_tokens: int) -> int:
    """The rows the share recomputes on the shortest reusable segment (``RecomputeRule.rows`` at the minimum)."""
    if recompute_ratio <= 0 or min_reuse_tokens <= 0:
        return 0
    return math.ceil(round(recompute_ratio * min_reuse_tokens, 6))


def steps_for(error_ratio: float) -> int:
    """Steps up the ladder that bring an error ``error_ratio`` times the allowed one within the target, if each
    step leaves ``RUNG_ERROR_FACTOR`` of it: at least one."""
    if not math.isfinite(error_ratio):
        return 10**6  # the caller caps it at dense
    if error_ratio <= 1.0:
        return 1
    return max(1, math.ceil(math.log(error_ratio) / math.log(1.0 / RUNG_ERROR_FACTOR) - 1e-9))


def rule() -> dict:
    """The controller's rule and constants, for a benchmark to record beside what it measured."""
    return {"tighten": f"as many steps as the miss asks for (each step leaves {RUNG_ERROR_FACTOR:g} of the error), "
                       "up to the longest head (dense only from it, or on a severe miss); while the interval "
                       "straddles the target, one step when the mean is short of the aim (the target moved the band "
                       "towards the ideal) by more than its standard error from min_samples, or short of it at all "
                       f"from {DECIDE_AFTER} x min_samples",
            "relax": "one step, the whole interval past the target by the margin, 2 x min_samples",
            "rung_error_factor": RUNG_ERROR_FACTOR, "burst_up_to_x_min_samples": DECIDE_AFTER, "band": DEFAULT_BAND}


def setting_name(head: int) -> str:
    return "dense" if head == DENSE else f"head{head}"


@dataclass(frozen=True)
class Action:
    """One change of a scope's setting and why."""

    scope: Hashable
    before: int
    after: int
    reason: str  # target_missed | undecided_below | within_band | met_with_margin | pinned | unpinned


@dataclass
class ScopeState:
    level: int = 0
    top1: RunningEstimate = field(default_factory=lambda: RunningEstimate(0.0, 1.0, TOP1_PRIOR_STD))
    kl: RunningEstimate = field(default_factory=lambda: RunningEstimate(0.0, float("inf"), KL_PRIOR_STD))
    samples: int = 0  # all verified requests of the scope, across settings

    def reset_estimates(self) -> None:
        self.top1 = RunningEstimate(0.0, 1.0, TOP1_PRIOR_STD)
        self.kl = RunningEstimate(0.0, float("inf"), KL_PRIOR_STD)

    def estimate(self, metric: str) -> RunningEstimate:
        return self.top1 if metric == "top1" else self.kl


class Controller:
    """Per-scope estimates and settings; not thread-safe (one owner: the guard's worker)."""

    def __init__(self, target: Optional[FidelityTarget], settings: tuple[int, ...], *, min_samples: int = 20,
                 margin: float = 0.5, max_scopes: int = 256, band: float = DEFAULT_BAND, max_pins: int = MAX_PINS,
                 parent: Optional[Callable[[Hashable], Optional[Hashable]]] = None) -> None:
        if min_samples < 2:
            raise ValueError(f"min_samples must be >= 2 (an interval needs two samples), got {min_samples}")
        self.target = target
        self.settings = settings
        self.min_samples = min_samples
        self.margin = margin
        self.band = band
        self.max_scopes = max_scopes
        self.max_pins = max_pins
        self.parent = parent
        self._scopes: OrderedDict[Hashable, ScopeState] = OrderedDict()
        self._pins: dict[Hashable, int] = {}  # a head (or DENSE) an operator set; never dropped
        self.counters: dict[str, int] = defaultdict(int)

    @property
    def band(self) -> float:
        """The share of the allowed error an undecided scope's mean must keep in hand (``aim``)."""
        return self._band

    @band.setter
    def band(self, band: float) -> None:
        if not 0.0 <= band < 1.0:
            raise ValueError(f"band must lie in [0, 1), got {band}")
        self._band = band
        self.aim = None if self.target is None else self.target.inner(band)

    # ------------------------------------------------------------ reads
    def in_force(self, scope: Hashable) -> Optional[int]:
        """The pin the scope is served under: its own, else its parent's; None when neither is pinned."""
        pin = self._pins.get(scope)
        if pin is None and self.parent is not None:
            parent = self.parent(scope)
            if parent is not None:
                pin = self._pins.get(parent)
        return pin

    def setting(self, scope: Hashable) -> int:
        """The head (or ``DENSE``) the scope is served under now."""
        pin = self.in_force(scope)
        return pin if pin is not None else self.learned(scope)

    def snapshot(self) -> dict:
        return {"target": None if self.target is None else str(self.target), "min_samples": self.min_samples,
                "band": self.band, "aim": None if self.aim is None else str(self.aim),
                "scopes": len(self._scopes), "max_scopes": self.max_scopes, "pins": len(self._pins),
                "max_pins": self.max_pins, "actions": dict(self.counters)}

    def scopes(self) -> dict[Hashable, dict]:
        """Every pinned scope without estimates, then every scope with estimates, least recently verified first."""
        return {scope: self.view(scope) for scope in [*(s for s in self._pins if s not in self._scopes), *self._scopes]}

    def view(self, scope: Hashable) -> dict:
        """One scope's setting, pin, samples and estimates (a scope the controller does not hold: none yet)."""
        state = self._scopes.get(scope) or ScopeState()
        return {"setting": setting_name(self.setting(scope)), "pinned": self.in_force(scope) is not None,
                "samples": state.samples, "top1": state.top1.as_dict(), "kl": state.kl.as_dict()}

    # ------------------------------------------------------------ writes
    def _state(self, scope: Hashable) -> ScopeState:
        state = self._scopes.get(scope)
        if state is None:
            state = self._scopes[scope] = ScopeState()
            while len(self._scopes) > self.max_scopes:
                self._scopes.popitem(last=False)
                self.counters["scopes_dropped"] += 1
        self._scopes.move_to_end(scope)
        return state

    def probe_setting(self, scope: Hashable) -> Optional[int]:
        """For a ``dense`` scope the controller moved there: the setting its probes are served under."""
        state = self._scopes.get(scope)
        if (state is None or self.in_force(scope) is not None or self.settings[state.level] != DENSE
                or state.level == 0):
            return None
        return self.settings[state.level - 1]

    @property
    def decide_after(self) -> int:
        """Verified requests up to which the burst keeps sampling a scope whose interval straddles the target."""
        return DECIDE_AFTER * self.min_samples

    def wants_evidence(self, scope: Hashable, waiting: int) -> bool:
        """Whether the scope's current setting lacks the evidence a decision needs, counting ``waiting``
        requests already drawn for it: fewer than ``min_samples``, or fewer than ``decide_after`` while its
        interval straddles the target. The guard then verifies its next approximated request whatever the rate
        (a burst), so a new or just-moved scope is judged after ``min_samples`` requests, not that many divided
        by the rate, and one left undecided keeps being judged on fresh evidence up to ``decide_after``. Never
        for a pinned or ``dense`` scope (a pin decides nothing; a dense scope's probes stay at the rate: relaxing
        may be slow) nor without a target (measuring only: the samples stay a uniform draw)."""
        if self.target is None:
            return False
        if self.in_force(scope) is not None:
            return False
        state = self._scopes.get(scope)
        if state is None:
            return waiting < self.min_samples
        if self.settings[state.level] == DENSE:
            return False
        drawn = state.top1.n + waiting
        if drawn < self.min_samples:
            return True
        return drawn < self.decide_after and self.target.straddles(state.estimate(self.target.metric).interval())

    def observe(self, scope: Hashable, served_under: int, fidelity: RequestFidelity) -> Optional[Action]:
        """Add one verified request of ``scope`` served under ``served_under``; the setting change it causes."""
        state = self._state(scope)
        probe = self.probe_setting(scope)
        if served_under != (probe if probe is not None else self.setting(scope)):
            # Measured a setting the scope has left (or dense itself, whose probes decide instead).
            self.counters["stale_samples"] += 1
            return None
        state.samples += 1
        state.top1.add(fidelity.top1, step=1.0 / max(fidelity.positions, 1))  # one flip: the least it moves
        state.kl.add(fidelity.kl)
        self.counters["samples"] += 1
        if self.target is None or self.in_force(scope) is not None or state.top1.n < self.min_samples:
            return None
        estimate = state.estimate(self.target.metric)
        interval = estimate.interval()
        last = len(self.settings) - 1
        if self.target.missed(interval) and state.level < last:
            if self.target.severe(interval):
                step = last - state.level
            else:  # the error model sizes steps between heads; dense is taken on evidence at the longest head
                step = min(steps_for(self.target.error_ratio(interval)), max(1, last - 1 - state.level))
            return self._move(scope, state, step, "target_missed")
        if state.level < last and self.target.straddles(interval):
            # Undecided: judged against the aim (the target with the band kept in hand), on the mean.
            if self.aim.missed(estimate.interval(z=1.0)) or (
                    estimate.n >= self.decide_after and self.aim.missed((estimate.mean, estimate.mean))):
                below = self.target.missed((estimate.mean, estimate.mean))
                return self._move(scope, state, 1, "undecided_below" if below else "within_band")
        if (state.level > 0 and state.top1.n >= 2 * self.min_samples
                and self.target.met_with_margin(interval, self.margin)):
            return self._move(scope, state, -1, "met_with_margin")
        return None

    def _move(self, scope: Hashable, state: ScopeState, step: int, reason: str) -> Action:
        before = self.settings[state.level]
        state.level += step
        state.reset_estimates()
        self.counters[reason] += 1
        return Action(scope, before, self.settings[state.level], reason)

    def known(self, scope: Hashable) -> bool:
        return scope in self._scopes or scope in self._pins

    def learned(self, scope: Hashable) -> int:
        """The setting the evidence put the scope under, whatever its pin."""
        state = self._scopes.get(scope)
        return self.settings[0] if state is None else self.settings[state.level]

    def pinned(self, scope: Hashable) -> Optional[int]:
        """The scope's own pin (not its parent's): what a guard file stores."""
        return self._pins.get(scope)

    def pins(self) -> tuple[Hashable, ...]:
        return tuple(self._pins)

    def restore(self, scope: Hashable, head: int, pinned: Optional[int]) -> None:
        """Start ``scope`` under ``head`` with ``pinned``, as a saved guard left it (``guard.saved``): no action,
        no evidence. A head not on this ladder leaves the scope at the loosest setting (the pin still applies);
        a pin past ``max_pins`` is not restored (counted ``pins_not_restored``)."""
        if head in self.settings and head != self.settings[0]:
            self._state(scope).level = self.settings.index(head)
        if pinned is not None:
            try:
                self._set_pin(scope, pinned)
            except PinLimitError:
                self.counters["pins_not_restored"] += 1

    def pin(self, scope: Hashable, head: Optional[int]) -> Action:
        """Serve ``scope`` under ``head`` (``DENSE`` for no reuse) whatever its estimates say; None unpins.
        Raises ``PinLimitError`` for a new pin past ``max_pins``."""
        if head is not None and head != DENSE and head < 0:
            raise ValueError(f"a pinned head must be >= 0 or dense, got {head}")
        before = self.setting(scope)
        self._set_pin(scope, head)
        state = self._scopes.get(scope)
        if state is not None:
            state.reset_estimates()
        reason = "pinned" if head is not None else "unpinned"
        self.counters[reason] += 1
        return Action(scope, before, self.setting(scope), reason)

    def _set_pin(self, scope: Hashable, head: Optional[int]) -> None:
        if head is None:
            self._pins.pop(scope, None)
            return
        if scope not in self._pins and len(self._pins) >= self.max_pins:
            raise PinLimitError(f"{len(self._pins)} scopes are pinned, the most the guard holds: unpin one "
                                f"(setting null) or reset the guard before pinning another")
        self._pins[scope] = head
