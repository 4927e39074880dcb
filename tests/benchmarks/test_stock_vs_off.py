"""The paired stock-vs-off analysis: ABBA order and the 2 % verdict (no server: pure functions)."""

import pytest

from benchmarks.stock_vs_off import bootstrap_median_ci, pair_order, verdict


def test_pairs_alternate_which_server_goes_first():
    orders = [pair_order(i) for i in range(4)]
    assert orders == [("stock", "off"), ("off", "stock"), ("stock", "off"), ("off", "stock")]


def test_tight_ratios_near_one_are_within_two_percent():
    ratios = [1.0 + 0.004 * ((i % 5) - 2) for i in range(40)]  # 0.992-1.008
    v = verdict(ratios)
    assert v["verdict"] == "within"
    assert 0.98 <= v["ci95"][0] <= v["median"] <= v["ci95"][1] <= 1.02


def test_a_clear_five_percent_slowdown_is_outside():
    ratios = [1.05 + 0.003 * ((i % 3) - 1) for i in range(30)]
    assert verdict(ratios)["verdict"] == "outside"


def test_noisy_ratios_leave_it_unresolved():
    ratios = [0.85, 1.2, 0.9, 1.15, 1.0, 0.88, 1.12, 1.01]
    assert verdict(ratios)["verdict"] == "unresolved"


def test_the_interval_is_seeded_and_needs_two_ratios():
    ratios = [0.97, 1.01, 1.03, 0.99, 1.02, 1.0]
    assert bootstrap_median_ci(ratios) == bootstrap_median_ci(ratios)
    with pytest.raises(ValueError):
        bootstrap_median_ci([1.0])
