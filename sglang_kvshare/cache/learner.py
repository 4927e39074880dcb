"""Learning anchors from dense prefills, off the scheduler's critical path.

The scheduler thread only copies the source and target K/V of a segment it
just prefilled densely (``Observation``) and queues it. A worker thread turns
observations into low-rank anchors in two steps: the expensive, pure part
(``estimator.prepare_observation``: canonical frames, deltas, SVD) runs
without any lock, and only the cheap commit into the pool takes the
estimator lock, so a gate decision on the scheduler thread never waits for an
SVD.

Bounds: at most ``max_jobs`` observations and ``max_bytes`` of copied K/V wait
in the queue; a full queue drops the new observation (counted), it never
grows. ``reset`` bumps a generation and drains the queue, so observations
queued before a reset never refill the pools after it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional


from sglang_kvshare.cache.counters import Counters

logger = logging.getLogger(__name__)


@dataclass
class Observation:
    """One dense prefill to learn from: copies of the source and the exact target."""

    slot: Hashable
    source: Any  # correction.SegmentCache (a copy, owned by the job)
    target: Any
    content_key: Hashable
    generation: int = 0
    queued_at: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.source.k, self.source.v, self.target.k, self.target.v))


class Learner:
    """A bounded queue of observations and the thread that learns from them.

    ``estimator`` is a callable returning the current estimator (the cache may
    rebuild it on a mode switch); ``lock`` is the estimator lock. With
    ``asynchronous=False`` ``submit`` learns at once (deterministic tests).
    """

    def __init__(self, estimator: Callable[[], Any], lock: threading.RLock, counters: Counters, *,
                 max_jobs: int, max_bytes: int, asynchronous: bool = True) -> None:
        self._estimator = estimator
        self._lock = lock
        self._counters = counters
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.asynchronous = asynchronous
        self._queue: "queue.Queue[Observation]" = queue.Queue()
        self._bytes = 0
        self._bytes_lock = threading.Lock()
        self.generation = 0
        self._worker: Optional[threading.Thread] = None

    # ------------------------------------------------------------ scheduler side
    def submit(self, obs: Observation) -> bool:
        """Queue (or, synchronous, learn) one observation; False when the bounds drop it."""
        obs.generation = self.generation
        if not self.asynchronous:
            self._learn(obs)
            return True
        size = obs.nbytes
        with self._bytes_lock:
            if self._queue.qsize() >= self.max_jobs or self._bytes + size > self.max_bytes:
                self._counters.add("observations_dropped_queue_full")
                return False
            self._bytes += size
        self._ensure_worker()
        obs.queued_at = time.perf_counter()
        self._queue.put(obs)
        return True

    def reset(self) -> None:
        """Forget every queued observation; one being learned now is discarded at commit."""
        self.generation += 1
        while True:
            try:
                obs = self._queue.get_nowait()
            except queue.Empty:
                break
            self._release(obs)
            self._queue.task_done()

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def queued_bytes(self) -> int:
        with self._bytes_lock:
            return self._bytes

    # ------------------------------------------------------------ worker side
    def _release(self, obs: Observation) -> None:
        with self._bytes_lock:
            self._bytes -= obs.nbytes

    def _learn(self, obs: Observation) -> None:
        estimator = self._estimator()
        if estimator is None:
            return
        t0 = time.perf_counter()
        if obs.queued_at:
            self._counters.add("learn_queue_wait_seconds", t0 - obs.queued_at)
        with self._lock:  # cheap: half the SVDs are skipped for a content the pool already holds
            with_base = not estimator.has_content(obs.slot, obs.content_key)
        prepared = estimator.prepare_observation(obs.slot, obs.source, obs.target, content_key=obs.content_key,
                                                 with_base=with_base)
        t1 = time.perf_counter()
        if prepared is None:  # a mode that learns nothing
            return
        with self._lock:
            if obs.generation != self.generation or estimator is not self._estimator():
                self._counters.add("observations_discarded_after_reset")
                return
            estimator.commit_observation(prepared)
        self._counters.add("observations")
        self._counters.add("learn_prepare_seconds", t1 - t0)
        self._counters.add("learn_commit_seconds", time.perf_counter() - t1)

    def _ensure_worker(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            return

        def run() -> None:
            # NOTE: lowest CPU priority for this thread (and the OpenMP team its torch ops
            # start, which inherits it): on a machine with few cores the forward wins.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (AttributeError, OSError):
                pass
            while True:
                obs = self._queue.get()
                try:
                    self._learn(obs)
                except Exception:  # noqa: BLE001 - a bad observation must not stop learning
                    logger.exception("sglang-kvshare: recording an anchor failed")
                    self._counters.add("internal_errors")
                finally:
                    self._release(obs)
                    self._queue.task_done()

        self._worker = threading.Thread(target=run, name="kvshare-learn", daemon=True)
        self._worker.start()
