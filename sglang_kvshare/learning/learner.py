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

Throttles (on a machine with few cores the learner's SVDs share the cores
with the forward and slow every request while it learns; docs/research/PROFILE.md):
* ``admit`` runs before the scheduler copies anything: an observation whose
  (content, edge) the pool already holds is skipped (it would only replace
  that delta: the pool has converged there), and one slot is observed at most
  once per ``slot_interval_s``;
* the worker keeps a duty cycle: after learning for ``t`` seconds it sleeps
  ``t * (1 / cpu_share - 1)`` times the free share of the queue, so it is busy
  at most ``cpu_share`` of the time while observations trickle in, and catches
  up at full speed when a burst fills the queue (a full queue drops new
  observations, counted; it never blocks the scheduler);
* the worker yields to serving (``activity``, ``yield_s``): before each
  observation it waits, at most ``yield_s``, until no prefill is in flight,
  and again between the observation's factorizations (at most ``yield_s`` in
  all), so a request shares the cores with at most one factorization; under
  steady load it waits the bounds and learns anyway;
* each step of an observation (a factorization) runs on a thread of its own
  that ends with it, and the pauses between steps run on the worker, which
  never runs a torch op (see ``_learn_stepwise``: a thread with an OpenMP team
  of its own slows the scheduler's forward while it lives, computing or
  asleep); with ``single_thread`` each step runs on its thread alone (no
  OpenMP team, no MKL threads): no tax on the forward, half the learning speed;
* with ``idle_steps`` (``learn_on_idle``, the server's default) the
  steps run instead on the scheduler's own thread while it is fully idle, or
  in front of a decode batch (``learning/idle_steps.py``): such a step never
  overlaps a forward; a step the scheduler does not take within the
  observation's ``yield_s`` budget runs beside it as above, and only those
  count towards the duty cycle.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional


from sglang_kvshare.counters import Counters
from sglang_kvshare.learning.idle_steps import IdleSteps
from sglang_kvshare.learning.serving_activity import ServingActivity
from sglang_kvshare.learning.single_thread import single_threaded_torch
from sglang_kvshare.correction import advance

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
    compute_dtype: Any = None  # torch.dtype to learn in; the copies may wait narrower (``kv_pool_io.learning_copy_dtype``)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.source.k, self.source.v, self.target.k, self.target.v))


def _widened(cache: Any, dtype: Any) -> Any:
    """``cache`` in ``dtype`` (None: as it is); None when the narrow copy overflowed (a value past float16's range)."""
    if dtype is None or cache.k.dtype == dtype:
        return cache
    k, v = cache.k.to(dtype), cache.v.to(dtype)
    if not (bool(k.isfinite().all()) and bool(v.isfinite().all())):
        return None
    return dataclasses.replace(cache, k=k, v=v)


def _edge_key(obs: Observation) -> tuple:
    return obs.slot, obs.source.agent, obs.target.agent


class Learner:
    """A bounded queue of observations and the thread that learns from them.

    ``estimator`` is a callable returning the current estimator (the cache may
    rebuild it on a mode switch); ``lock`` is the estimator lock. With
    ``asynchronous=False`` ``submit`` learns at once (deterministic tests).
    """

    def __init__(self, estimator: Callable[[], Any], lock: threading.RLock, counters: Counters, *,
                 max_jobs: int, max_bytes: int, asynchronous: bool = True, cpu_share: float = 1.0,
                 slot_interval_s: float = 0.0, activity: Optional[ServingActivity] = None,
                 yield_s: float = 0.0, single_thread: bool = False) -> None:
        if not 0.0 < cpu_share <= 1.0:
            raise ValueError(f"cpu_share must lie in (0, 1], got {cpu_share}")
        if slot_interval_s < 0:
            raise ValueError(f"slot_interval_s must be >= 0, got {slot_interval_s}")
        if yield_s < 0:
            raise ValueError(f"yield_s must be >= 0, got {yield_s}")
        self._estimator = estimator
        self._lock = lock
        self._counters = counters
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.asynchronous = asynchronous
        self.cpu_share = cpu_share
        self.slot_interval_s = slot_interval_s
        self.activity = activity
        self.yield_s = yield_s
        self.single_thread = single_thread
        self._last_admitted: OrderedDict[Hashable, float] = OrderedDict()  # slot -> monotonic time, LRU-bounded
        self._queue: "queue.Queue[Observation]" = queue.Queue()
        self._bytes = 0
        self._bytes_lock = threading.Lock()  # guards _bytes and _queued_edges
        self._queued_edges: Counter = Counter()  # (slot, source agent, target agent) -> observations queued
        self.generation = 0
        self._worker: Optional[threading.Thread] = None
        self.idle_steps: Optional[IdleSteps] = None
        self._beside_s = 0.0  # with idle_steps: seconds of steps run beside the scheduler (the duty cycle's busy)

    def use_idle_steps(self) -> IdleSteps:
        """Offer learning steps to the thread that calls ``idle_steps.run_pending()`` (the idle scheduler)."""
        if self.idle_steps is None:
            self.idle_steps = IdleSteps(self._counters)
        return self.idle_steps

    # ------------------------------------------------------------ scheduler side
    _MAX_TRACKED_SLOTS = 4096

    def admit(self, slot: Hashable, content_key: Hashable, src_agent: Hashable, dst_agent: Hashable,
              nbytes: int = 0) -> bool:
        """Whether an observation is worth copying and fits the queue (call before reading any K/V); counts the
        skips and drops.

        ``nbytes`` is the size of the copies it would make: a full queue (in jobs or bytes) drops it here, before
        a byte is copied, so a long segment never allocates its copies only to be dropped.
        """
        estimator = self._estimator()
        if estimator is None:
            return False
        if self.asynchronous and not self._fits(nbytes):
            self._counters.add("observations_dropped_queue_full")
            return False
        with self._lock:
            known = estimator.has_observation(slot, content_key, src_agent, dst_agent)
        if known:
            self._counters.add("observations_skipped_known")
            return False
        if self.slot_interval_s > 0:
            now = time.monotonic()
            last = self._last_admitted.get(slot)
            if last is not None and now - last < self.slot_interval_s:
                self._counters.add("observations_skipped_rate")
                return False
            self._last_admitted[slot] = now
            self._last_admitted.move_to_end(slot)
            while len(self._last_admitted) > self._MAX_TRACKED_SLOTS:
                self._last_admitted.popitem(last=False)
        return True

    def submit(self, obs: Observation) -> bool:
        """Queue (or, synchronous, learn) one observation; False when the bounds drop it."""
        obs.generation = self.generation
        if not self.asynchronous:
            self._learn(obs)
            return True
        size = obs.nbytes
        with self._bytes_lock:
            if not self._fits_locked(size):
                self._counters.add("observations_dropped_queue_full")
                return False
            self._bytes += size
        self._ensure_worker()
        obs.queued_at = time.perf_counter()
        with self._bytes_lock:
            self._queued_edges[_edge_key(obs)] += 1
        self._queue.put(obs)
        return True

    def _fits_locked(self, nbytes: int) -> bool:
        # Jobs and bytes both count the observation being learned now: it still holds its copies.
        return self._queue.unfinished_tasks < self.max_jobs and self._bytes + nbytes <= self.max_bytes

    def _fits(self, nbytes: int) -> bool:
        with self._bytes_lock:
            return self._fits_locked(nbytes)

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
            key = _edge_key(obs)
            self._queued_edges[key] -= 1
            if self._queued_edges[key] <= 0:
                del self._queued_edges[key]

    def queued_for(self, slot: Hashable, src_agent: Hashable, dst_agent: Hashable) -> int:
        """Observations of ``slot`` from ``src_agent``'s copy into ``dst_agent``'s context not yet learned."""
        with self._bytes_lock:
            return self._queued_edges.get((slot, src_agent, dst_agent), 0)

    def _learn(self, obs: Observation, run: Callable[[Callable[[], Any]], Any] = lambda step: step(),
               between: Optional[Callable[[], None]] = None) -> None:
        """Learn one observation: each torch step through ``run``, ``between`` called between two steps.

        Synchronously (the defaults) everything runs on the caller's thread. The
        worker passes a ``run`` that starts a thread per step and a ``between``
        that waits for a lull on its own (torch-free) thread; see ``_learn_stepwise``.
        """
        estimator = self._estimator()
        if estimator is None:
            return
        t0 = time.perf_counter()
        if obs.queued_at:
            self._counters.add("learn_queue_wait_seconds", t0 - obs.queued_at)

        def first_step():
            source, target = _widened(obs.source, obs.compute_dtype), _widened(obs.target, obs.compute_dtype)
            if source is None or target is None:
                self._counters.add("observations_dropped_overflow")
                return None
            with self._lock:  # cheap: half the SVDs are skipped for a content the pool already holds
                with_base = not estimator.has_content(obs.slot, obs.content_key)
            steps = estimator.observation_steps(obs.slot, source, target, content_key=obs.content_key,
                                                with_base=with_base)
            return steps, advance(steps)

        started = run(first_step)
        if started is None:
            return
        steps, (done, prepared) = started
        while not done:
            if between is not None:
                between()
            done, prepared = run(lambda: advance(steps))
        t1 = time.perf_counter()
        if prepared is None:  # a mode that learns nothing
            return

        def commit() -> bool:
            with self._lock:
                if obs.generation != self.generation or estimator is not self._estimator():
                    return False
                estimator.commit_observation(prepared)
                return True

        if not run(commit):
            self._counters.add("observations_discarded_after_reset")
            return
        self._counters.add("observations")
        self._counters.add("learn_prepare_seconds", t1 - t0)
        self._counters.add("learn_commit_seconds", time.perf_counter() - t1)

    def _learn_stepwise(self, obs: Observation) -> None:
        """Learn one observation: each step on the idle scheduler or on a thread that ends with it.

        NOTE: never on the worker itself: a thread that has run torch's OpenMP
        ops keeps its OpenMP team alive while it lives, and with more OpenMP
        threads than cores libgomp stops spinning at its barriers, so the
        forward pays a futex round trip per parallel region (an idle side
        thread: 263 -> 740 us on a small op mix, ``benchmarks/results/idle_torch_thread.json``;
        docs/research/PROFILE.md, 1b). For the same reason the pauses wait here, not
        inside a step's thread. A thread per step costs microseconds.
        """
        beside = functools.partial(_in_own_thread, single=self.single_thread)
        if self.idle_steps is None:
            self._learn(obs, run=beside, between=self._yield_between_steps() if self.asynchronous else None)
            return
        left = self.yield_s  # one wait budget per observation, as the yields' (0: never wait)

        def on_idle_scheduler(step: Callable[[], Any]) -> Any:
            nonlocal left
            if left <= 0:
                return self._timed_beside(beside, step)
            taken, value, waited = self.idle_steps.offer(step, left)
            left -= waited
            if taken:
                return value
            self._counters.add("learn_idle_timeouts")
            return self._timed_beside(beside, step)

        self._learn(obs, run=on_idle_scheduler)

    def _timed_beside(self, beside: Callable[[Callable[[], Any]], Any], step: Callable[[], Any]) -> Any:
        """A step run beside the scheduler; its time counts towards the duty cycle (``_pause``)."""
        t0 = time.perf_counter()
        try:
            return beside(step)
        finally:
            self._beside_s += time.perf_counter() - t0

    def _yield_to_serving(self, budget_s: Optional[float] = None) -> float:
        """Wait (at most ``budget_s``, default ``yield_s``) until no prefill is in flight.

        Counted in ``learn_yield_seconds``; returns the seconds waited.
        """
        if self.activity is None or self.yield_s <= 0:
            return 0.0
        waited = self.activity.wait_quiet(self.yield_s if budget_s is None else budget_s)
        if waited > 0:
            self._counters.add("learn_yield_seconds", waited)
        return waited

    def _yield_between_steps(self) -> Optional[Callable[[], None]]:
        """The pause between an observation's factorizations: wait for a lull again.

        Why: the wait before an observation cannot see the request that arrives
        during it (a 1K observation is four factorizations, about 0.25 s alone and
        seconds beside a forward). All the pauses of one observation share one
        ``yield_s`` budget, so under steady load learning slows, never stops.
        """
        if self.activity is None or self.yield_s <= 0:
            return None
        left = self.yield_s

        def between() -> None:
            nonlocal left
            if left > 0:
                left -= self._yield_to_serving(left)

        return between

    def _pause(self, busy: float) -> float:
        """Seconds to rest after ``busy`` seconds of learning.

        ``busy * (1 / cpu_share - 1)`` keeps the duty cycle at ``cpu_share``,
        scaled down by how full the queue is: a burst (one dense chain queues an
        observation per edge, ~47 MiB each at 1K tokens on the 135M model) would
        otherwise overflow the byte bound while the worker rests, and be dropped.
        """
        if self.cpu_share >= 1.0:
            return 0.0
        with self._bytes_lock:
            fill = max(self._queue.qsize() / self.max_jobs, self._bytes / self.max_bytes)
        return busy * (1.0 / self.cpu_share - 1.0) * max(0.0, 1.0 - fill)

    def _ensure_worker(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            return

        def run() -> None:
            # NOTE: this dispatcher never runs a torch op (see _learn_stepwise):
            # it waits for work, for a lull in serving and out its rests.
            while True:
                obs = self._queue.get()
                try:
                    if self.idle_steps is None:
                        self._yield_to_serving()
                    busy_since, self._beside_s = time.perf_counter(), 0.0
                    try:
                        self._learn_stepwise(obs)
                    except Exception:  # noqa: BLE001 - a bad observation must not stop learning
                        logger.exception("sglang-kvshare: recording an anchor failed")
                        self._counters.add("internal_errors")
                    busy = time.perf_counter() - busy_since
                finally:
                    self._release(obs)
                    self._queue.task_done()
                pause = self._pause(self._beside_s if self.idle_steps is not None else busy)
                if pause > 0:
                    self._counters.add("learn_throttle_seconds", pause)
                    time.sleep(pause)

        self._worker = threading.Thread(target=run, name="kvshare-learn", daemon=True)
        self._worker.start()


def _in_own_thread(step: Callable[[], Any], single: bool = False) -> Any:
    """``step()`` on a fresh low-priority thread that ends with it; returns its result or raises its error.

    ``single``: the thread's torch ops run on it alone (``learn_single_thread``).
    """
    out: dict[str, Any] = {}

    def body() -> None:
        # NOTE: lowest CPU priority for this thread (and the OpenMP team its torch ops
        # start, which inherits it): on a machine with few cores the forward wins.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        if single:
            # NOTE: on this thread alone: an OpenMP team of its own makes the scheduler's
            # forward stop spinning at its barriers (learning/single_thread.py).
            single_threaded_torch()
        try:
            out["value"] = step()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=body, name="kvshare-learn-step", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")
