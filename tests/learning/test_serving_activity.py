"""Learning yields to serving: the learner waits while a prefill is in flight.

Why: on a 2-core machine an SVD that starts just before a dense
prefill stretches that request's TTFT; the duty cycle bounds how much the
learner takes, not when. Each test fails if the learner ignored an open
prefill, waited past its bound, waited inside a synchronous (scheduler-thread)
learn, or if a forgotten request blocked learning for good.
"""

from __future__ import annotations

import gc
import threading
import time


from sglang_kvshare.counters import Counters
from sglang_kvshare.learning.learner import Learner, Observation
from sglang_kvshare.learning.serving_activity import ServingActivity
from tests.learning.test_learner import _cache, _SlowEstimator, _wait_for


class _Req:
    """Stands in for SGLang's ``Req``: hashable by identity, weakly referenceable."""


class _Clock:
    """A hand-moved clock: the gap and staleness rules without sleeping."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_open_prefill_is_busy_and_the_gap_after_it_too():
    clock = _Clock()
    activity = ServingActivity(quiet_gap_s=0.1, clock=clock)
    req = _Req()
    assert not activity.busy()
    activity.opened(req)
    activity.opened(req)  # matched again while it waits: still one prefill
    assert activity.busy() and activity.open_count() == 1
    activity.closed(req)
    clock.now += 0.05
    assert activity.busy()  # the next agent of a chain is a few ms away
    clock.now += 0.1
    assert not activity.busy()


def test_wait_quiet_returns_when_the_prefill_ends_and_never_past_its_bound():
    activity = ServingActivity(quiet_gap_s=0.0)
    req = _Req()
    activity.opened(req)
    threading.Timer(0.1, activity.closed, args=(req,)).start()
    waited = activity.wait_quiet(5.0)
    assert 0.08 <= waited < 1.0
    activity.opened(req)
    assert 0.1 <= activity.wait_quiet(0.1) < 1.0  # bounded: learning goes on under load


def test_a_forgotten_request_does_not_block_learning():
    clock = _Clock()
    activity = ServingActivity(quiet_gap_s=0.0, stale_s=0.05, clock=clock)
    activity.opened(_Req())  # collected at once (no reference kept): forgotten
    gc.collect()
    assert not activity.busy()
    kept = _Req()
    activity.opened(kept)  # an abort that never closed it: stale after stale_s
    assert activity.busy()
    clock.now += 0.08
    assert not activity.busy()


def _learner(estimator, activity, **kw) -> tuple[Learner, Counters]:
    counters = Counters()
    return Learner(lambda: estimator, threading.RLock(), counters, max_jobs=4, max_bytes=2**30,
                   activity=activity, **kw), counters


def test_the_worker_waits_for_the_open_prefill_before_learning():
    activity = ServingActivity(quiet_gap_s=0.0)
    estimator = _SlowEstimator(busy=0.0)
    learner, counters = _learner(estimator, activity, asynchronous=True, yield_s=5.0)
    req = _Req()
    activity.opened(req)
    assert learner.submit(Observation("query", _cache(1, 0, "A"), _cache(1, 5, "B"), "c1"))
    time.sleep(0.2)
    assert estimator.starts == []  # a prefill is in flight: no SVD now
    closed_at = time.monotonic()
    activity.closed(req)
    _wait_for(lambda: len(estimator.ends) == 1)
    assert estimator.starts[0] >= closed_at
    assert counters.get("learn_yield_seconds") >= 0.15


def test_a_prefill_that_arrives_during_an_observation_pauses_it_between_steps():
    activity = ServingActivity(quiet_gap_s=0.0)
    estimator = _SlowEstimator(busy=0.4)
    learner, counters = _learner(estimator, activity, asynchronous=True, yield_s=5.0)
    assert learner.submit(Observation("query", _cache(1, 0, "A"), _cache(1, 5, "B"), "c1"))
    _wait_for(lambda: len(estimator.starts) == 1)
    req = _Req()
    activity.opened(req)  # arrives during the first step
    _wait_for(lambda: len(estimator.middles) == 1)
    time.sleep(0.3)
    assert estimator.resumes == []  # the second step waits for the prefill
    # ... and not on the first step's thread: one that slept through the prefill would tax it (learner.py)
    estimator.threads[0].join(timeout=1.0)
    assert not estimator.threads[0].is_alive()
    closed_at = time.monotonic()
    activity.closed(req)
    _wait_for(lambda: len(estimator.ends) == 1)
    assert estimator.resumes[0] >= closed_at and estimator.threads[1] is not estimator.threads[0]
    assert counters.get("learn_yield_seconds") >= 0.25


def test_the_pauses_of_one_observation_share_one_bound():
    activity = ServingActivity(quiet_gap_s=0.0)
    estimator = _SlowEstimator(busy=0.0)
    learner, _ = _learner(estimator, activity, asynchronous=True, yield_s=0.2)
    req = _Req()
    activity.opened(req)  # steady load: never closed
    t0 = time.monotonic()
    assert learner.submit(Observation("query", _cache(1, 0, "A"), _cache(1, 5, "B"), "c1"))
    _wait_for(lambda: len(estimator.ends) == 1, timeout=3.0)
    # One bound before the observation and one shared by its pauses, not one per pause.
    assert 0.15 <= estimator.resumes[0] - estimator.middles[0] <= 0.2 + 0.1
    assert time.monotonic() - t0 < 1.0
    assert req is not None  # held until here: a collected request would not count as busy


def test_under_steady_load_the_worker_learns_after_its_bound():
    activity = ServingActivity(quiet_gap_s=0.0)
    estimator = _SlowEstimator(busy=0.0)
    learner, _ = _learner(estimator, activity, asynchronous=True, yield_s=0.1)
    req = _Req()
    activity.opened(req)  # never closed
    assert learner.submit(Observation("query", _cache(1, 0, "A"), _cache(1, 5, "B"), "c1"))
    _wait_for(lambda: len(estimator.ends) == 1, timeout=3.0)


def test_a_synchronous_learn_never_waits_for_its_own_request():
    activity = ServingActivity(quiet_gap_s=0.0)
    estimator = _SlowEstimator(busy=0.0)
    learner, counters = _learner(estimator, activity, asynchronous=False, yield_s=5.0)
    req = _Req()
    activity.opened(req)  # the scheduler learns inside this request's checkpoint
    t0 = time.monotonic()
    learner.submit(Observation("query", _cache(1, 0, "A"), _cache(1, 5, "B"), "c1"))
    assert time.monotonic() - t0 < 1.0 and len(estimator.ends) == 1
    assert counters.get("learn_yield_seconds") == 0
