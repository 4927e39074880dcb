"""The soak and fault harness: its fault catalogue and output comparison (fast), and a short soak
against live servers whose JSON verdicts must all hold (``server``; about 3 minutes here)."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks import soak
from benchmarks.soak_faults import catalogue, expected_status, fuzzed, many_slots
from sglang_kvshare.protocol import DEFAULT_MAX_SEGMENTS, MAX_NAME_CHARS
from tests.servers import OFF, SOAK_KEY, soak_pool


def test_every_catalogued_fault_is_a_400_by_the_parser():
    n = DEFAULT_MAX_SEGMENTS + 40
    cases = catalogue(n)
    assert len({c.kind for c in cases}) == len(cases) >= 25
    assert {c.kind for c in cases if expected_status(c.raw, n) != 400} == set()


def test_fuzzed_cases_are_mostly_bad_and_the_oracle_decides_the_rest():
    rng = random.Random(0)
    statuses = [expected_status(fuzzed(120, rng).raw, 120) for _ in range(200)]
    assert set(statuses) <= {200, 400} and statuses.count(400) > 150


def test_a_slot_flood_is_valid_with_the_most_segments_and_longest_names():
    names = [f"{i}:" + "名" * (MAX_NAME_CHARS - 4) for i in range(DEFAULT_MAX_SEGMENTS - 1)]
    raw = json.dumps(many_slots("名" * MAX_NAME_CHARS, 10, 10 + 2 * len(names), names), ensure_ascii=False)
    assert expected_status(raw, 10 + 2 * len(names)) == 200


def _off_body(tokens: list[int], gap_at: dict[int, float]) -> dict:
    tops = [[[-0.1, t, None], [-0.1 - gap_at.get(i, 3.0), 7, None]] for i, t in enumerate(tokens)]
    return {"meta_info": {"output_token_logprobs": [[-0.1, t, None] for t in tokens], "output_top_logprobs": tops}}


def test_compare_separates_near_ties_from_real_divergences():
    sample = {"tag": "plain", "input_ids": [1, 2], "cached_tokens": 0, "salt": None, "output_ids": [5, 6, 9]}
    assert soak.compare(sample, _off_body([5, 6, 9], {}))["same"] is True
    tie = soak.compare(sample, _off_body([5, 6, 8], {2: 0.01}))
    assert tie["same"] is False and tie["first_diff"] == 2 and tie["near_tie"] is True
    real = soak.compare(sample, _off_body([5, 4, 9], {1: 0.5}))
    assert real["near_tie"] is False and real["off_top2_gap"] == pytest.approx(0.5)


def test_bounds_check_reports_missing_fields_and_overruns():
    assert soak.check_bounds({})["checked"] is False
    res = soak.check_bounds({"limits": {"slots": 10, "queue": 4, "only_limit": 1}, "usage": {"slots": 11, "queue": 4}})
    assert res["checked"] and res["keys"] == ["queue", "slots"] and set(res["over"]) == {"slots"}


@pytest.fixture(scope="module")
def short_soak(tmp_path_factory, server_pool) -> dict:
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    # The suite's off server is the replay reference (one start fewer); the soak's own server
    # comes from the pool too; the eviction tests borrow it and leave it as launched, caches cold.
    reference = server_pool("off", kvshare_args=OFF)
    server = server_pool("soak", **soak_pool())
    soak.main(["--clients", "2", "--minutes", "0.5", "--replay", "5", "--slot-names", "300", "--out", str(out),
               "--reference-url", reference.url], launched=server, admin_key=SOAK_KEY)
    return json.loads(out.read_text())


VERDICTS = ["no_crash", "no_5xx", "nothing_lost", "malformed_get_4xx", "valid_requests_served", "allocator_restored",
            "kvshare_within_bounds", "zero_cross_salt_reuse", "plain_exact_structural", "plain_exact_by_output",
            "harness_ok"]


@pytest.mark.server
@pytest.mark.parametrize("verdict", VERDICTS)
def test_short_soak_verdict_holds(short_soak, verdict):
    value = short_soak["verdicts"][verdict]
    assert value is True or value == "not checked", (verdict, value, short_soak["findings"].get(verdict),
                                                     short_soak["replay"], short_soak["salt_probes"])


@pytest.mark.server
def test_short_soak_injected_every_fault_family(short_soak):
    kinds = short_soak["operations_by_kind"]
    assert set(kinds) >= set(soak.TRAFFIC) - {"slot_flood"}, kinds
    assert short_soak["malformed"]["sent"] >= 1 and short_soak["salt_probes"]["n"] >= 1
    assert short_soak["replay"]["n"] >= 1 and short_soak["totals"]["requests"] >= 30

