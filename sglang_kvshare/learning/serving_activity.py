"""Which prefills the scheduler has in flight, so that learning can wait for a lull.

Why: on a machine with few cores the learner's SVDs and the model's forward
share the cores. A duty cycle (``Learner.cpu_share``) bounds *how much* the
learner takes, not *when*: an SVD that starts just before a dense prefill
stretches that request's TTFT (``python -m benchmarks.chain_ttft --probe-gap``
measures dense requests spaced out while the server learns, with and without
this wait). The cache sees every request twice, at
``match_prefix`` (its prefill is about to run) and at the checkpoint that
covers its whole prompt or its release (the prefill is over), so it can tell
the learner when serving is quiet.

A request that vanishes without either call (an abort while waiting) is
forgotten when it is garbage collected, and after ``stale_s`` at the latest:
a leak may delay learning, never stop it.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, Optional


class ServingActivity:
    """Open prefills and the end of the last one, shared by the scheduler and the learner.

    ``quiet_gap_s``: how long after the last prefill ended serving still counts
    as busy (the next agent of a chain arrives a few milliseconds after the
    previous one's first token).
    """

    def __init__(self, *, quiet_gap_s: float = 0.2, stale_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet_gap_s = quiet_gap_s
        self.stale_s = stale_s
        self._clock = clock
        # NOTE: keyed by id(): a request class need not be hashable; the weak
        # reference tells a reused id from the request it belonged to.
        self._open: dict[int, tuple[Optional[weakref.ref], float]] = {}
        self._last_closed = float("-inf")
        self._cond = threading.Condition()

    # ------------------------------------------------------------ scheduler side
    def opened(self, req: Any) -> None:
        """``req``'s prefill is about to be scheduled (idempotent: waiting requests are matched again)."""
        with self._cond:
            entry = self._open.get(id(req))
            if entry is not None and self._alive(entry) is req:
                return
            try:
                ref: Optional[weakref.ref] = weakref.ref(req)
            except TypeError:  # not weakly referenceable: only stale_s forgets it
                ref = None
            self._open[id(req)] = (ref, self._clock())

    def closed(self, req: Any) -> None:
        """``req``'s prefill is over (or the request is released); idempotent."""
        with self._cond:
            if self._open.pop(id(req), None) is not None:
                self._last_closed = self._clock()
                self._cond.notify_all()

    # ------------------------------------------------------------ learner side
    @staticmethod
    def _alive(entry: tuple[Optional[weakref.ref], float]) -> Any:
        ref = entry[0]
        return ref() if ref is not None else True

    def _busy_locked(self) -> bool:
        now = self._clock()
        for key, entry in list(self._open.items()):
            if self._alive(entry) is None or now - entry[1] >= self.stale_s:
                del self._open[key]  # collected, or open past any prefill: forgotten
        return bool(self._open) or now - self._last_closed < self.quiet_gap_s

    def busy(self) -> bool:
        with self._cond:
            return self._busy_locked()

    def open_count(self) -> int:
        with self._cond:
            self._busy_locked()
            return len(self._open)

    def wait_quiet(self, timeout_s: float, poll_s: float = 0.02) -> float:
        """Block until serving is quiet or ``timeout_s`` passed; returns the seconds waited."""
        if timeout_s <= 0:
            return 0.0
        start = self._clock()
        with self._cond:
            while self._busy_locked():
                left = timeout_s - (self._clock() - start)
                if left <= 0:
                    break
                # NOTE: polled too, because the quiet gap ends without any notify.
                self._cond.wait(min(left, poll_s))
        return self._clock() - start
