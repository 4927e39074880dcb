"""The learner's throttles: a known (content, edge) is skipped, a slot's rate is capped, the worker pauses.

Why these matter: on a 2-core machine the learner's SVDs make every request
of a kvcmas server slower while it learns (docs/research/PROFILE.md, finding 1). Each test would fail if a
throttle were missing: an observation the pool already holds copied again, a
slot observed twice inside its interval, a worker that never pauses.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sglang_kvshare.counters import Counters
from sglang_kvshare.learning.learner import Learner, Observation
from sglang_kvshare.learning.single_thread import torch_libgomp
from sglang_kvshare.correction import RopeSpec, SegmentCache, make_estimator

LAYERS, LENGTH, HEADS, DIM = 2, 6, 2, 8


def _spec() -> RopeSpec:
    return RopeSpec.default(DIM)


def _cache(seed: int, start: int, agent: str) -> SegmentCache:
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(LAYERS, LENGTH, HEADS, DIM, generator=g) for _ in range(2))
    return SegmentCache(k, v, start, agent)


def _learner(estimator, **kw) -> tuple[Learner, Counters]:
    counters = Counters()
    kw.setdefault("asynchronous", False)
    return Learner(lambda: estimator, threading.RLock(), counters, max_jobs=4, max_bytes=2**30, **kw), counters


def test_an_observation_the_pool_already_holds_is_skipped():
    estimator = make_estimator("kvcmas", _spec(), tau=1.0)
    learner, counters = _learner(estimator)
    slot = "query"
    assert learner.admit(slot, "c1", "A", "B")
    learner.submit(Observation(slot, _cache(1, 10, "A"), _cache(2, 20, "B"), "c1"))
    assert estimator.pool_size(slot) == 1
    assert not learner.admit(slot, "c1", "A", "B")  # same content, same edge: nothing new
    assert counters.get("observations_skipped_known") == 1
    assert learner.admit(slot, "c1", "C", "B")  # another edge of the same content is new
    assert learner.admit(slot, "c2", "A", "B")  # another content is new


def test_a_mode_that_learns_nothing_admits_nothing():
    learner, _ = _learner(make_estimator("fullshared", _spec()))
    assert not learner.admit("query", "c1", "A", "B")


def test_one_slot_is_observed_at_most_once_per_interval():
    estimator = make_estimator("kvcmas", _spec(), tau=1.0)
    learner, counters = _learner(estimator, slot_interval_s=60.0)
    assert learner.admit("query", "c1", "A", "B")
    assert not learner.admit("query", "c2", "A", "B")
    assert counters.get("observations_skipped_rate") == 1
    assert learner.admit("answer", "c3", "A", "B")  # other slots keep their own clock


class _SlowEstimator:
    """Learns nothing but takes ``busy`` seconds per observation, and records when it ran."""

    learns = True

    def __init__(self, busy: float) -> None:
        self.busy = busy
        self.starts: list[float] = []
        self.middles: list[float] = []  # end of the first step
        self.resumes: list[float] = []  # start of the second step
        self.ends: list[float] = []
        self.threads: list[threading.Thread] = []
        self.torch_threads: list[int] = []  # torch's thread count seen by each step

    def has_content(self, slot, content_key):
        return False

    def observation_steps(self, slot, source, target, content_key=None, with_base=True):
        """Two steps of ``busy / 2`` seconds with a pause in the middle (as the four factorizations)."""
        self.starts.append(time.monotonic())
        self.threads.append(threading.current_thread())
        self.torch_threads.append(torch.get_num_threads())
        time.sleep(self.busy / 2)
        self.middles.append(time.monotonic())
        yield
        self.resumes.append(time.monotonic())
        self.threads.append(threading.current_thread())
        self.torch_threads.append(torch.get_num_threads())
        time.sleep(self.busy / 2)
        self.ends.append(time.monotonic())
        return None


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the learner did not finish"
        time.sleep(0.01)


def test_the_worker_pauses_to_keep_its_cpu_share():
    estimator = _SlowEstimator(busy=0.05)
    learner, counters = _learner(estimator, asynchronous=True, cpu_share=0.25)
    for i in range(2):
        assert learner.submit(Observation("query", _cache(i, 0, "A"), _cache(i, 5, "B"), f"c{i}"))
    _wait_for(lambda: len(estimator.ends) == 2)
    # At a share of 0.25 the rest is 3x the learning time, scaled by the queue's free share:
    # one of 4 jobs still waited when the first ended.
    rest = 3 * (estimator.ends[0] - estimator.starts[0]) * (1 - 1 / 4)
    assert estimator.starts[1] - estimator.ends[0] >= 0.95 * rest
    assert counters.get("learn_throttle_seconds") >= 0.95 * rest


def test_a_full_queue_is_learned_without_a_pause():
    learner, _ = _learner(_SlowEstimator(busy=0.0), cpu_share=0.1)
    with learner._bytes_lock:
        learner._bytes = learner.max_bytes  # as if a burst filled the byte bound
    assert learner._pause(busy=1.0) == 0.0
    with learner._bytes_lock:
        learner._bytes = 0
    assert learner._pause(busy=1.0) == pytest.approx(9.0)  # empty queue: the full duty-cycle rest


def test_the_shares_are_validated():
    with pytest.raises(ValueError, match="cpu_share"):
        _learner(None, cpu_share=0.0)
    with pytest.raises(ValueError, match="slot_interval_s"):
        _learner(None, slot_interval_s=-1.0)


def test_no_thread_that_ran_learning_outlives_its_step():
    """A live thread that once ran torch's OpenMP ops slows the scheduler's forward (learner.py)."""
    estimator = _SlowEstimator(busy=0.0)
    learner, _ = _learner(estimator, asynchronous=True)
    for i in range(2):
        assert learner.submit(Observation("query", _cache(i, 0, "A"), _cache(i, 5, "B"), f"c{i}"))
    _wait_for(lambda: learner.pending() == 0)
    assert len(estimator.threads) == 4 and len(set(estimator.threads)) == 4  # two steps each, a thread per step
    assert learner._worker not in estimator.threads  # the long-lived dispatcher never learns itself
    for t in estimator.threads:
        t.join(timeout=5.0)
        assert not t.is_alive()


@pytest.mark.skipif(torch_libgomp() is None, reason="needs torch on GNU libgomp (Linux CPU builds)")
def test_single_threaded_learning_steps_leave_the_scheduler_its_threads():
    """With ``single_thread`` a step starts no OpenMP team of its own (learning/single_thread.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        estimator = _SlowEstimator(busy=0.0)
        learner, _ = _learner(estimator, asynchronous=True, single_thread=True)
        assert learner.submit(Observation("query", _cache(1, 0, "A"), _cache(1, 5, "B"), "c1"))
        _wait_for(lambda: learner.pending() == 0)
        assert estimator.torch_threads == [1, 1]
        default, _ = _learner(estimator, asynchronous=True)  # the default keeps torch's threads (learns faster)
        assert default.submit(Observation("query", _cache(2, 0, "A"), _cache(2, 5, "B"), "c2"))
        _wait_for(lambda: default.pending() == 0)
        assert estimator.torch_threads[2:] == [2, 2]
        assert torch.get_num_threads() == 2  # the calling (scheduler) thread keeps its count
    finally:
        torch.set_num_threads(before)


def test_an_observation_that_would_not_fit_the_queue_is_dropped_before_it_is_copied():
    estimator = make_estimator("kvcmas", _spec(), tau=1.0)
    counters = Counters()
    learner = Learner(lambda: estimator, threading.RLock(), counters, max_jobs=4, max_bytes=1024, asynchronous=True)
    assert learner.admit("query", "c1", "A", "B", nbytes=1000)
    assert not learner.admit("query", "c2", "A", "B", nbytes=4096)  # a 32K-token segment on a big model, say
    assert counters.get("observations_dropped_queue_full") == 1


def test_the_job_bound_counts_the_observation_being_learned():
    estimator = _SlowEstimator(busy=1.0)
    learner, counters = _learner(estimator, asynchronous=True)
    assert learner.submit(Observation("query", _cache(0, 0, "A"), _cache(0, 5, "B"), "c0"))
    _wait_for(lambda: len(estimator.starts) == 1)  # the worker holds the first one now
    accepted = sum(learner.submit(Observation("query", _cache(i, 0, "A"), _cache(i, 5, "B"), f"c{i}"))
                   for i in range(1, 8))
    assert accepted == learner.max_jobs - 1  # 4 held in all, what stats report as learn_queue_jobs
    assert learner.pending() == learner.max_jobs
    assert counters.get("observations_dropped_queue_full") == 7 - accepted
