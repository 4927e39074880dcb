"""Learning steps handed to the scheduler thread, run only while it is fully idle.

Why: on a CPU server every torch op of the learner competes with the forward
for the same cores. Steps on a thread beside the scheduler, however low their
priority and however they pause for lulls, slowed requests that arrived while
they ran (a kvcmas server's requests took up to 2.5x longer in serving while it
learned; docs/PROFILE.md). SGLang's scheduler, when it has no batch to run and
nothing waits, polls ``Scheduler.maybe_sleep_on_idle`` in a loop; a step run
there, on the scheduler's own thread and OpenMP team, never overlaps a forward.
A request that arrives meanwhile waits at most one step (one factorization:
tens of milliseconds at 1K tokens on this 2-core machine). Under steady load
the scheduler is never idle, steps wait, and the learner's bounded queue drops
new observations (counted): learning yields entirely to serving.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from sglang_kvshare.cache.counters import Counters


class _Job:
    def __init__(self, step: Callable[[], Any]) -> None:
        self.step = step
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None


class IdleSteps:
    """A one-place handoff: the learner's dispatcher posts a step and waits; the idle scheduler runs it."""

    def __init__(self, counters: Optional[Counters] = None) -> None:
        self._counters = counters
        self._lock = threading.Lock()
        self._pending: Optional[_Job] = None

    def run(self, step: Callable[[], Any]) -> Any:
        """Post ``step`` and block until the scheduler ran it; returns its result or raises its error."""
        job = _Job(step)
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("IdleSteps takes one step at a time (one learner dispatcher)")
            self._pending = job
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.value

    def run_pending(self) -> bool:
        """Run the posted step, if any, on the calling (scheduler) thread; True when one ran.

        Never raises: a failing step hands its error to the learner's thread.
        """
        with self._lock:
            job, self._pending = self._pending, None
        if job is None:
            return False
        t0 = time.perf_counter()
        try:
            job.value = job.step()
        except BaseException as exc:  # noqa: BLE001 - raised again on the learner's thread
            job.error = exc
        finally:
            if self._counters is not None:
                self._counters.add("learn_idle_steps")
                self._counters.add("learn_idle_step_seconds", time.perf_counter() - t0)
            job.done.set()
        return True
