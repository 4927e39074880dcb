"""Learning on the idle scheduler (``learn_on_idle``): steps run only where the scheduler runs them.

Each test fails if a step ran beside the scheduler (on another thread, or
while the scheduler was busy), or if a step's result or error were lost.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace


from sglang_kvshare.counters import Counters
from sglang_kvshare.learning.idle_steps import IdleSteps
from sglang_kvshare.learning.learner import Observation
from sglang_kvshare.correction import make_estimator
from sglang_kvshare.server.idle_learning import before_run_batch, before_sleep_on_idle
from tests.learning.test_learner import _cache, _learner, _SlowEstimator, _spec, _wait_for


class _IdleScheduler:
    """Stands in for SGLang's scheduler loop: runs posted steps only while ``idle`` is set."""

    def __init__(self, steps: IdleSteps) -> None:
        self.steps, self.idle, self.stop = steps, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            if self.idle.is_set():
                self.steps.run_pending()
            time.sleep(0.001)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5.0)


def test_learning_steps_run_on_the_scheduler_thread_and_only_while_it_is_idle():
    estimator = _SlowEstimator(busy=0.02)
    learner, counters = _learner(estimator, asynchronous=True, cpu_share=0.25, yield_s=60.0)
    sched = _IdleScheduler(learner.use_idle_steps())
    try:
        assert learner.submit(Observation("query", _cache(1, 0, "A"), _cache(1, 5, "B"), "c1"))
        time.sleep(0.3)  # the scheduler is busy: nothing may run
        assert estimator.starts == [] and learner.pending() == 1
        sched.idle.set()
        _wait_for(lambda: learner.pending() == 0)
        assert estimator.threads == [sched.thread, sched.thread]  # both steps, on the scheduler thread
        assert counters.get("learn_idle_steps") == 2
        assert counters.get("learn_throttle_seconds") == 0  # no duty cycle: idle time is free
    finally:
        sched.close()


def test_an_observation_learned_on_the_idle_scheduler_reaches_the_pool():
    estimator = make_estimator("kvcmas", _spec(), tau=1.0)
    learner, counters = _learner(estimator, asynchronous=True, yield_s=60.0)
    sched = _IdleScheduler(learner.use_idle_steps())
    sched.idle.set()
    try:
        assert learner.submit(Observation("query", _cache(1, 10, "A"), _cache(2, 20, "B"), "c1"))
        _wait_for(lambda: learner.pending() == 0)
        assert estimator.pool_size("query") == 1 and counters.get("observations") == 1
    finally:
        sched.close()


def test_a_failing_step_raises_on_the_posting_thread_and_the_handoff_stays_usable():
    steps = IdleSteps()
    errors: list[BaseException] = []

    def post(step):
        try:
            errors.append(steps.offer(step, None)[1])
        except ValueError as exc:
            errors.append(exc)

    poster = threading.Thread(target=post, args=(lambda: (_ for _ in ()).throw(ValueError("bad step")),))
    poster.start()
    _wait_for(lambda: steps.pending)
    assert steps.run_pending() is True and steps.run_pending() is False  # one step per pass
    poster.join(timeout=5.0)
    assert isinstance(errors[0], ValueError)
    poster = threading.Thread(target=post, args=(lambda: 7,))
    poster.start()
    _wait_for(lambda: steps.pending)
    steps.run_pending()
    poster.join(timeout=5.0)
    assert errors[1] == 7


def test_the_scheduler_hook_runs_a_posted_step_and_ignores_other_caches():
    steps = IdleSteps()
    ran = threading.Event()
    poster = threading.Thread(target=steps.offer, args=(ran.set, None))
    poster.start()
    _wait_for(lambda: steps.pending)
    before_sleep_on_idle(SimpleNamespace(tree_cache=SimpleNamespace(learner=SimpleNamespace(idle_steps=steps))))
    poster.join(timeout=5.0)
    assert ran.is_set()
    assert before_sleep_on_idle(SimpleNamespace(tree_cache=object())) is None  # stock radix cache: nothing to do
    assert before_sleep_on_idle(SimpleNamespace()) is None


class _Mode:
    def __init__(self, decode: bool) -> None:
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode


def test_a_step_runs_in_front_of_a_decode_batch_only_when_no_request_waits():
    """``learn_before_decode``: a step may delay a decode iteration, never a waiting prefill."""
    counters = Counters()
    steps = IdleSteps(counters)
    ran = threading.Event()
    poster = threading.Thread(target=steps.offer, args=(ran.set, None))
    poster.start()
    _wait_for(lambda: steps.pending)

    def scheduler(waiting: list) -> SimpleNamespace:
        return SimpleNamespace(tree_cache=SimpleNamespace(learner=SimpleNamespace(idle_steps=steps)),
                               waiting_queue=waiting)

    before_run_batch(scheduler([]), SimpleNamespace(forward_mode=_Mode(decode=False)))  # a prefill batch
    before_run_batch(scheduler(["a request"]), SimpleNamespace(forward_mode=_Mode(decode=True)))  # one waits
    before_run_batch(scheduler([]), None)  # no batch object: nothing to judge by
    assert steps.pending and not ran.is_set()
    before_run_batch(scheduler([]), batch=SimpleNamespace(forward_mode=_Mode(decode=True)))
    poster.join(timeout=5.0)
    assert ran.is_set() and not steps.pending
    assert counters.get("learn_decode_steps") == 1 and counters.get("learn_idle_steps") == 0
    assert before_run_batch(SimpleNamespace(tree_cache=object(), waiting_queue=[]),
                            SimpleNamespace(forward_mode=_Mode(decode=True))) is None  # stock radix cache


def test_under_steady_load_a_step_not_taken_in_the_budget_runs_beside_the_scheduler():
    """A scheduler that is never idle must not starve learning (pools would never fill)."""
    estimator = _SlowEstimator(busy=0.0)
    learner, counters = _learner(estimator, asynchronous=True, yield_s=0.2)
    sched = _IdleScheduler(learner.use_idle_steps())  # never idle
    try:
        t0 = time.monotonic()
        assert learner.submit(Observation("query", _cache(1, 0, "A"), _cache(1, 5, "B"), "c1"))
        _wait_for(lambda: learner.pending() == 0)
        assert time.monotonic() - t0 >= 0.2  # it waited its budget first
        assert sched.thread not in estimator.threads and len(estimator.threads) == 2
        assert counters.get("learn_idle_timeouts") == 1  # the budget is per observation: one timeout
        assert counters.get("learn_idle_steps") == 0
    finally:
        sched.close()


def test_a_zero_budget_never_waits_for_the_idle_scheduler():
    """``learn_yield_s = 0`` means never wait: steps go beside the scheduler at once."""
    estimator = _SlowEstimator(busy=0.0)
    learner, counters = _learner(estimator, asynchronous=True, yield_s=0.0)
    sched = _IdleScheduler(learner.use_idle_steps())  # never idle
    try:
        assert learner.submit(Observation("query", _cache(1, 0, "A"), _cache(1, 5, "B"), "c1"))
        _wait_for(lambda: learner.pending() == 0, timeout=2.0)
        assert sched.thread not in estimator.threads and counters.get("learn_idle_steps") == 0
    finally:
        sched.close()
