"""The guard's math: per-request fidelity, running intervals, targets and the controller (no server)."""

from __future__ import annotations

import math
import random

import pytest

from sglang_kvshare.cache.recompute import RecomputeRule
from sglang_kvshare.config import MIN_REUSE_TOKENS, KVShareConfig
from sglang_kvshare.guard.controller import DENSE, Controller, PinLimitError, ladder, share_floor, steps_for
from sglang_kvshare.protocol import Segment
from sglang_kvshare.guard.estimate import Z95, RunningEstimate
from sglang_kvshare.guard.measure import RequestFidelity, compare
from sglang_kvshare.guard.target import FidelityTarget


def _dist(*pairs):
    return [(math.log(p), t) for p, t in pairs]


def test_compare_counts_top1_and_a_topk_kl():
    same = [_dist((0.7, 1), (0.2, 2)), _dist((0.6, 3), (0.3, 4))]
    assert compare(same, same) == RequestFidelity(2, 1.0, 0.0)
    served = [_dist((0.7, 1), (0.2, 2)), _dist((0.3, 3), (0.6, 4))]  # the second position's top-1 flipped
    fid = compare(served, same)
    assert fid.positions == 2 and fid.top1 == 0.5 and fid.kl > 0
    missing = [_dist((0.9, 5), (0.05, 1))]  # the reference's top token 3 is absent: the served floor is used
    assert compare(missing, [_dist((0.6, 3), (0.3, 1))]).kl > 0
    assert compare([], same) is None


def test_the_running_interval_covers_the_mean_as_often_as_it_says():
    rng = random.Random(7)
    covered = 0
    for trial in range(400):
        est = RunningEstimate(0.0, 1.0)
        for _ in range(30):
            est.add(min(1.0, max(0.0, rng.gauss(0.9, 0.05))))
        low, high = est.interval()
        covered += low <= 0.9 <= high
    assert 0.9 <= covered / 400 <= 0.99  # a 95 % interval, within sampling noise
    assert RunningEstimate().interval() == (0.0, 1.0)  # no evidence: the whole range


def test_the_interval_holds_its_level_on_few_requests():
    # A scope is judged on 5-20 requests: there a normal interval on the sample spread holds the mean about 88 %
    # of the time at five; Student's t holds it 95 %.
    rng = random.Random(11)
    t_covered = z_covered = 0
    for _ in range(2000):
        est = RunningEstimate(0.0, 1.0)
        for _ in range(5):
            est.add(rng.gauss(0.5, 0.1))
        low, high = est.interval()
        t_covered += low <= 0.5 <= high
        low, high = est.interval(z=Z95)
        z_covered += low <= 0.5 <= high
    assert 0.93 <= t_covered / 2000 <= 0.97
    assert z_covered / 2000 < 0.91


@pytest.mark.parametrize("text, metric, bound", [("top1>=0.99", "top1", 0.99), (" kl <= 0.01 ", "kl", 0.01),
                                                 ("top1>=1", "top1", 1.0), ("kl<=2e-3", "kl", 0.002)])
def test_targets_parse(text, metric, bound):
    target = FidelityTarget.parse(text)
    assert (target.metric, target.bound) == (metric, bound)


@pytest.mark.parametrize("text", ["top1<=0.99", "kl>=0.1", "top1>=1.5", "top1>=0", "kl<=0", "accuracy>=0.9", "",
                                  "top1>=abc"])
def test_bad_targets_say_what_is_accepted(text):
    with pytest.raises(ValueError, match="top1>=|kl"):
        FidelityTarget.parse(text)


def _feed(ctl, scope, top1, n, seed=0, sd=0.01):
    rng = random.Random(seed)
    actions = []
    for _ in range(n):
        value = min(1.0, max(0.0, rng.gauss(top1, sd)))
        action = ctl.observe(scope, ctl.setting(scope), RequestFidelity(32, value, 0.01))
        if action is not None:
            actions.append(action)
    return actions


def test_every_step_of_the_default_ladder_recomputes_more_than_the_share_on_every_reused_segment():
    """A head is a floor over the share: the ladder starts above what the share recomputes on the shortest segment
    the server reuses, so no step is a no-op; without a share or a minimum it starts at 8 rows."""
    config = KVShareConfig()
    steps = ladder(share_floor(config.recompute_ratio, config.min_reuse_tokens))
    assert steps == (0, 64, 128, 256, 512, DENSE) and share_floor(0.15, MIN_REUSE_TOKENS) == 39
    assert ladder(share_floor(0.0, 0)) == ladder(share_floor(0.15, 0)) == (0, 8, 16, 32, 64, DENSE)
    shortest = Segment(kind="shared", start=0, end=config.min_reuse_tokens, slot="s")
    rows = [RecomputeRule(head=h, ratio=config.recompute_ratio).rows(shortest) for h in steps[:-1]]
    whole = shortest.length
    # each step recomputes more rows than the one below, until a head covers the whole segment
    assert all(b > a or a == whole for a, b in zip(rows, rows[1:])), rows
    assert rows[1] > rows[0]


def test_a_miss_climbs_as_many_steps_as_its_error_asks_and_others_keep_theirs():
    ctl = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=10)
    assert ctl.settings == (0, 8, 16, 32, 64, DENSE)
    # 0.97 for ten requests: the interval's best end, about 0.978, shows twice the allowed disagreement: three
    # steps at once (0.75 per step: 2 -> 0.84).
    actions = _cycle(ctl, "twice", [0.97], 10)
    assert [(a.after, a.reason) for a in actions] == [(32, "target_missed")]
    # 0.98: the best end a little below the bound, one step.
    actions = _cycle(ctl, "near", [0.98], 10)
    assert [(a.after, a.reason) for a in actions] == [(8, "target_missed")]
    # Ten times it, not yet severe: the error model asks for more steps than the heads hold, so the longest
    # head, and dense only once the longest head misses too.
    actions = _feed(ctl, "bad", 0.90, 200)
    assert [(a.after, a.reason) for a in actions] == [(64, "target_missed"), (DENSE, "target_missed")]
    assert ctl.setting("bad") == DENSE
    # Missed by far (severe): straight to dense, from any head.
    actions = _feed(ctl, "broken", 0.5, 200)
    assert [(a.after, a.reason) for a in actions] == [(DENSE, "target_missed")]
    assert _feed(ctl, "good", 0.999, 200) == [] and ctl.setting("good") == 0
    assert ctl.counters["target_missed"] == 5


@pytest.mark.parametrize("ratio, steps", [(0.5, 1), (1.0, 1), (1.2, 1), (1.34, 2), (2.0, 3), (4.0, 5),
                                          (math.inf, 10**6)])
def test_steps_for_an_error_ratio(ratio, steps):
    assert steps_for(ratio) == steps


def test_the_error_ratio_reads_the_favourable_end():
    top1 = FidelityTarget.parse("top1>=0.99")
    assert top1.error_ratio((0.95, 0.98)) == pytest.approx(2.0)
    assert top1.error_ratio((0.99, 1.0)) == 0.0
    assert FidelityTarget.parse("top1>=1").error_ratio((0.9, 0.99)) == math.inf
    assert FidelityTarget.parse("kl<=0.01").error_ratio((0.03, 0.05)) == pytest.approx(3.0)


def test_a_scope_relaxes_only_with_margin_and_twice_the_evidence():
    ctl = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=10, band=0.0)
    _cycle(ctl, "s", [0.98], 10)
    assert ctl.setting("s") == 8
    assert _feed(ctl, "s", 0.993, 60, seed=1, sd=0.001) == []  # met, but not by the margin: it stays
    actions = _feed(ctl, "s", 0.9999, 120, seed=2, sd=0.0005)
    assert actions and actions[0].reason == "met_with_margin" and ctl.setting("s") == 0


def _cycle(ctl, scope, values, n):
    """``n`` verified requests cycling through ``values``: their mean, with a wide interval."""
    actions = []
    for i in range(n):
        action = ctl.observe(scope, ctl.setting(scope), RequestFidelity(32, values[i % len(values)], 0.01))
        actions += [action] if action else []
    return actions


def test_an_undecided_scope_below_the_target_tightens_early_when_clearly_below_and_on_its_mean_later():
    ctl = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=6, band=0.0)  # decide_after 18
    # Mean 0.975, interval [0.958, 0.992]: straddling, but one standard error still below: at the minimum.
    assert _cycle(ctl, "clear", [0.96, 0.99], 5) == []  # fewer than min_samples: nothing moves
    assert ctl.wants_evidence("clear", 0)
    actions = _cycle(ctl, "clear", [0.99], 1)
    assert [(a.after, a.reason) for a in actions] == [(8, "undecided_below")]
    assert ctl.counters["undecided_below"] == 1
    # Mean 0.985, within a standard error of the bound at the minimum: it waits for more evidence, and tightens
    # once the mean stays below by more than the (shrinking) standard error, or at decide_after whatever.
    near = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=6, band=0.0)
    assert _cycle(near, "near", [1.0, 0.97], 6) == [] and near.wants_evidence("near", 0)
    actions = _cycle(near, "near", [1.0, 0.97], 12)
    assert [(a.after, a.reason) for a in actions] == [(8, "undecided_below")]
    late = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=6, band=0.0)
    assert _cycle(late, "late", [1.0] * 7 + [0.9] + [1.0] * 3 + [0.98] * 6, 17) == []  # mean 0.9894 at 17
    actions = _cycle(late, "late", [0.98], 1)  # the 18th: decide_after, the mean below: tighten on it
    assert [(a.after, a.reason) for a in actions] == [(8, "undecided_below")]
    assert _cycle(ctl, "above", [1.0] * 19 + [0.9], 60) == [] and ctl.setting("above") == 0  # mean 0.995: stays
    assert not ctl.wants_evidence("above", 0)  # judged: the rate applies again


def test_a_decided_scope_leaves_the_burst_at_min_samples():
    ctl = Controller(FidelityTarget.parse("top1>=0.9"), ladder(0), min_samples=4, band=0.0)
    _cycle(ctl, "clear", [0.999, 1.0], 4)  # the whole interval above 0.9
    assert not ctl.wants_evidence("clear", 0)
    _cycle(ctl, "unclear", [0.8, 1.0], 4)
    assert ctl.wants_evidence("unclear", 0) and ctl.wants_evidence("unclear", 7)
    assert not ctl.wants_evidence("unclear", 8)  # 4 verified + 8 waiting = decide_after


def test_samples_of_a_setting_the_scope_has_left_are_dropped():
    ctl = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=2)
    ctl.pin("s", 16)
    assert ctl.observe("s", 0, RequestFidelity(8, 0.1, 1.0)) is None  # served before the pin
    assert ctl.counters["stale_samples"] == 1 and ctl.scopes()["s"]["samples"] == 0
    for _ in range(50):
        assert ctl.observe("s", 16, RequestFidelity(8, 0.1, 1.0)) is None  # pinned: measured, never moved
    assert ctl.setting("s") == 16
    assert ctl.pin("s", None).reason == "unpinned" and ctl.setting("s") == 0


def test_a_scope_wants_evidence_until_its_setting_can_be_judged():
    ctl = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=4)
    assert ctl.wants_evidence("new", 0) and ctl.wants_evidence("new", 3) and not ctl.wants_evidence("new", 4)
    _cycle(ctl, "s", [0.97], 3)
    assert ctl.wants_evidence("s", 0) and ctl.wants_evidence("s", 1)  # straddling at three: the burst goes on
    _cycle(ctl, "wide", [0.9], 3)
    assert ctl.wants_evidence("wide", 0) and not ctl.wants_evidence("wide", 1)  # missed: one more decides
    _cycle(ctl, "s", [0.97], 1)  # the interval misses by a step
    assert ctl.setting("s") == 8 and ctl.wants_evidence("s", 0)  # moved: the new setting starts afresh
    ctl.pin("s", 16)
    assert not ctl.wants_evidence("s", 0)  # a pin decides nothing
    _feed(ctl, "bad", 0.1, 4)
    assert ctl.setting("bad") == DENSE and not ctl.wants_evidence("bad", 0)  # dense: probes at the rate only
    assert not Controller(None, ladder(0), min_samples=4).wants_evidence("new", 0)  # measuring only: uniform


def test_scopes_are_bounded():
    ctl = Controller(None, ladder(0), max_scopes=3)
    for i in range(10):
        ctl.observe(f"s{i}", 0, RequestFidelity(4, 1.0, 0.0))
    assert len(ctl.scopes()) == 3 and ctl.counters["scopes_dropped"] == 7


def test_a_broken_scope_goes_dense_within_the_minimum_samples_and_probes_to_come_back():
    ctl = Controller(FidelityTarget.parse("top1>=0.9"), ladder(0), min_samples=20)
    actions = _feed(ctl, "broken", 0.3, 20)
    assert [a.after for a in actions] == [DENSE] and ctl.setting("broken") == DENSE  # one step, 20 samples
    assert ctl.probe_setting("broken") == 64
    assert ctl.observe("broken", DENSE, RequestFidelity(8, 1.0, 0.0)) is None  # dense serves nothing to measure
    assert ctl.counters["stale_samples"] == 1
    relaxed = []
    for _ in range(40):  # fixed since: the probes under the next looser setting are good
        action = ctl.observe("broken", 64, RequestFidelity(16, 1.0, 0.0))
        relaxed += [action] if action else []
    assert relaxed and relaxed[0].reason == "met_with_margin" and ctl.setting("broken") == 64


def test_estimates_serialize_as_plain_json():
    import json

    est = RunningEstimate(0.0, float("inf"))
    json.dumps(est.as_dict(), allow_nan=False)  # no sample yet: the open end is null, not Infinity
    est.add(0.1)
    est.add(0.3)
    assert json.loads(json.dumps(est.as_dict(), allow_nan=False))["n"] == 2


def test_identical_values_do_not_give_a_zero_width_interval():
    est = RunningEstimate(0.0, 1.0, prior_std=0.03)
    for _ in range(5):
        est.add(1.0)
    low, high = est.interval()
    assert high == 1.0 and low < 0.99  # five perfect answers cannot yet prove top1 >= 0.99 with margin
    for _ in range(200):
        est.add(1.0)
    assert est.interval()[0] > 0.995  # the prior fades with evidence
    plain = RunningEstimate(0.0, 1.0)
    for _ in range(5):
        plain.add(1.0)
    assert plain.interval() == (1.0, 1.0)  # without the prior: the collapse the prior prevents


def test_short_answers_that_all_agree_leave_room_for_rare_flips():
    short = RunningEstimate(0.0, 1.0, prior_std=0.03)
    for _ in range(10):
        short.add(1.0, step=1 / 8)  # ten 8-token answers, every position agreed
    low, _ = short.interval()
    assert low < 0.98  # a flip in one answer of six (truth 0.98) is still inside
    assert abs(low - (1 - 3 / 80)) < 0.002  # about the zero-event bound 1 - 3/(n P)
    long = RunningEstimate(0.0, 1.0, prior_std=0.03)
    fixed = RunningEstimate(0.0, 1.0, prior_std=0.03)
    for _ in range(10):
        long.add(1.0, step=1 / 64)  # one step of a long answer is below the fixed prior: no change
        fixed.add(1.0)
    assert long.interval() == fixed.interval()


def test_the_controller_passes_the_answer_length_as_the_step():
    ctl = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=6)
    for _ in range(6):
        ctl.observe("short", 0, RequestFidelity(8, 1.0, 0.0))
        ctl.observe("long", 0, RequestFidelity(64, 1.0, 0.0))
    short, long = (ctl._state(s).top1.interval()[0] for s in ("short", "long"))
    assert short < long



def test_the_band_steers_an_undecided_scope_to_a_mean_inside_the_target():
    # Mean 0.993 at decide_after (18): above the bound, but not by half the allowed error (the aim 0.995).
    values = [1.0, 0.986]
    on_bound = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=6, band=0.0)
    assert _cycle(on_bound, "s", values, 40) == [] and on_bound.setting("s") == 0  # the mean meets it: stays
    banded = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=6, band=0.5)
    assert banded.aim == FidelityTarget("top1", pytest.approx(0.995))
    assert _cycle(banded, "s", values, 17) == []  # before decide_after only a clear shortfall moves it
    actions = _cycle(banded, "s", values, 1)
    assert [(a.after, a.reason) for a in actions] == [(8, "within_band")]
    assert banded.counters["within_band"] == 1
    # The aim reached: it stays; and an interval wholly above the bound is met, whatever the aim.
    assert _cycle(banded, "good", [1.0, 0.992], 60) == [] and banded.setting("good") == 0
    with pytest.raises(ValueError, match="band"):
        Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), band=1.0)


def test_the_inner_target_keeps_a_share_of_the_allowed_error():
    assert FidelityTarget.parse("top1>=0.99").inner(0.6).bound == pytest.approx(0.996)
    assert FidelityTarget.parse("kl<=0.01").inner(0.5).bound == pytest.approx(0.005)
    assert FidelityTarget.parse("top1>=0.99").inner(0.0) == FidelityTarget.parse("top1>=0.99")


def test_a_pin_outlives_any_number_of_other_scopes_and_pins_are_bounded_on_their_own():
    ctl = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=2, max_scopes=8, max_pins=2)
    ctl.pin("judge", DENSE)  # never verified: the least recently verified of all
    for i in range(300):
        ctl.observe(f"agent-{i}", 0, RequestFidelity(4, 1.0, 0.0))
    assert ctl.setting("judge") == DENSE and ctl.scopes()["judge"]["pinned"]
    assert len(ctl.scopes()) == 8 + 1 and ctl.snapshot()["pins"] == 1
    ctl.pin("critic", 32)
    with pytest.raises(PinLimitError, match="unpin one"):
        ctl.pin("third", DENSE)
    assert ctl.setting("third") == 0 and not ctl.known("third")  # a refused pin changes nothing
    ctl.pin("critic", 16)  # re-pinning a pinned scope needs no room
    ctl.pin("critic", None)
    ctl.pin("third", DENSE)  # an unpin frees its room
    assert ctl.setting("third") == DENSE and ctl.setting("critic") == 0


def test_a_scope_without_a_pin_of_its_own_follows_its_parents():
    parent = {("w1", "judge"): "judge", ("w2", "judge"): "judge"}
    ctl = Controller(FidelityTarget.parse("top1>=0.99"), ladder(0), min_samples=2, parent=parent.get)
    ctl.pin("judge", DENSE)
    ctl.pin(("w2", "judge"), 16)
    assert ctl.setting(("w1", "judge")) == DENSE and ctl.setting(("w2", "judge")) == 16
    assert ctl.pinned(("w1", "judge")) is None  # what a guard file stores: the scope's own pin
    assert not ctl.wants_evidence(("w1", "judge"), 0) and ctl.wants_evidence(("w1", "critic"), 0)
