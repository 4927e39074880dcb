"""Learning steps handed to the scheduler thread, run only while it is fully idle.

Why: on a CPU server every torch op of the learner competes with the forward
for the same cores. Steps on a thread beside the scheduler, however low their
priority and however they pause for lulls, slowed requests that arrived while
they ran (in a quick 4-agent serving sweep kvcmas consumers that reused their
whole prompt took 1.2-1.35 s while it learned, fullshared's 0.46-0.51 s;
docs/research/PROFILE.md). SGLang's scheduler, when it has no batch to run and
nothing waits, polls ``Scheduler.maybe_sleep_on_idle`` in a loop; a step run
there, on the scheduler's own thread and OpenMP team, never overlaps a forward.
A request that arrives meanwhile waits at most one step (one factorization of
``learn_step_layers`` layers: about 26 ms at 1K tokens on this
2-core machine with 10 layers, 74 ms with all 30). Under serving load the
scheduler is rarely fully idle but decodes most of the time: with
``learn_before_decode`` it also takes a step in front of a decode
batch when no request waits for a prefill (the step delays one decode
iteration, not a first token). A step not taken within the learner's wait
budget (``learn_yield_s`` per observation) is withdrawn and run
beside the scheduler as before, so pools fill under any load (idle-only
learning left a serving run with 4 observations learned, 28 dropped and no
reuse).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from sglang_kvshare.counters import Counters


class _Job:
    def __init__(self, step: Callable[[], Any]) -> None:
        self.step = step
        self.taken = threading.Event()
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None


class IdleSteps:
    """A one-place handoff: the learner's dispatcher posts a step and waits; the idle scheduler runs it."""

    def __init__(self, counters: Optional[Counters] = None) -> None:
        self._counters = counters
        self._lock = threading.Lock()
        self._pending: Optional[_Job] = None

    @property
    def pending(self) -> bool:
        """Whether a step waits: read without the lock, so the idle loop's poll stays a bare attribute check."""
        return self._pending is not None

    def offer(self, step: Callable[[], Any], wait_s: Optional[float]) -> tuple[bool, Any, float]:
        """Post ``step``; ``(taken, result, seconds waited)``, or its error raised when it failed.

        ``wait_s`` (None: forever) bounds the wait for the scheduler to *take*
        the step; past it the step is withdrawn, untaken (``taken`` False), so
        the caller can run it elsewhere: under steady load the scheduler is
        never idle, and a learner that only waited would never fill its pools.
        A step once taken is always waited for.
        """
        job = _Job(step)
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("IdleSteps takes one step at a time (one learner dispatcher)")
            self._pending = job
        t0 = time.perf_counter()
        if not job.taken.wait(wait_s):
            with self._lock:
                if self._pending is job:  # not taken yet: withdraw it
                    self._pending = None
                    return False, None, time.perf_counter() - t0
        waited = time.perf_counter() - t0
        job.done.wait()
        if job.error is not None:
            raise job.error
        return True, job.value, waited

    def run_pending(self, where: str = "idle") -> bool:
        """Run the posted step, if any, on the calling (scheduler) thread; True when one ran.

        ``where`` names the scheduler's state for the counters
        (``learn_<where>_steps``, ``learn_<where>_step_seconds``): ``idle``, or
        ``decode`` for a step taken in front of a decode batch. Never raises: a
        failing step hands its error to the learner's thread.
        """
        with self._lock:
            job, self._pending = self._pending, None
        if job is None:
            return False
        job.taken.set()
        t0 = time.perf_counter()
        try:
            job.value = job.step()
        except BaseException as exc:  # noqa: BLE001 - raised again on the learner's thread
            job.error = exc
        finally:
            if self._counters is not None:
                self._counters.add(f"learn_{where}_steps")
                self._counters.add(f"learn_{where}_step_seconds", time.perf_counter() - t0)
            job.done.set()
        return True
