"""The soak and fault harness: its fault catalogues, output comparison and report readers (fast), and a
short soak against live servers, chat traffic included, whose JSON verdicts must all hold (``server``)."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks import soak
from benchmarks.soak.faults import (HOSTILE_FIRST, SENTINEL, catalogue, chat_hostile, cross_scope_signs,
                                    expected_status, foreign_sources, fuzzed, many_slots, parse_stream)
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


def test_hostile_chats_cover_every_family_and_refusals_name_a_fix():
    cases = chat_hostile("You solve problems.", "Problem 1: Natalia sold 48 clips in April.", random.Random(0))
    kinds = [c.kind for c in cases]
    assert len(set(kinds)) == len(kinds) >= 25 and kinds[:len(HOSTILE_FIRST)] == list(HOSTILE_FIRST)
    assert any(SENTINEL in json.dumps(c.body, ensure_ascii=False) for c in cases)
    assert {"tool_messages", "list_content", "n_2", "logprobs_top"} <= set(kinds)
    assert all(c.fix for c in cases if c.refuse) and all(not c.auto for c in cases if c.fix)


def test_parse_stream_finds_the_report_on_the_final_chunk_and_errors():
    lines = [b'data: {"choices":[{"delta":{"content":"4"},"finish_reason":null}]}', b"",
             b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"kvshare":{"agent":"a"}}',
             b'data: {"choices":[],"usage":{"completion_tokens":1}}', b"data: [DONE]"]
    got = parse_stream(lines)
    assert got["kvshare"] == {"agent": "a"} and got["report_on_final_chunk"] and got["done"]
    assert got["text"] == "4" and got["finish_reasons"] == ["stop"] and got["usage"]["completion_tokens"] == 1
    bad = parse_stream([b'data: {"error": {"message": "boom"}}', b"data: [DONE]"])
    assert bad["errors"] and not bad["finish_reasons"] and bad["kvshare"] is None


def test_cross_scope_signs_ignore_glue_and_count_found_copies():
    def seg(slot, by="dense", reason="no_source", **kw):
        return {"kind": "shared", "slot": slot, "tokens": 10, "resolved_by": by, "reason": reason, **kw}
    clean = {"segments": [{"kind": "private", "resolved_by": "hit"}, seg("query"),
                          seg("chat:glue", "alignment", None, resolved_tokens=5), seg("query", reason="not_reached")]}
    got = cross_scope_signs(clean)
    assert got == {"segments": 2, "reused_tokens": 0, "found": [], "reached": 1}
    assert cross_scope_signs({"segments": [seg("query", "alignment", None, resolved_tokens=7)]})["reused_tokens"] == 7
    assert cross_scope_signs({"segments": [seg("query", reason="too_few_anchors")]})["found"]


def test_foreign_sources_tells_foreign_from_unknown_agents():
    reports = [{"scope": "A", "agent": "a1", "sources": []}, {"scope": "A", "agent": "a2", "sources": ["a1"]},
               {"scope": "B", "agent": "b1", "sources": ["a1", "ghost"]}]
    got = foreign_sources(reports)
    assert (got["named_sources"], got["foreign"], got["unknown"], got["scopes"]) == (3, 1, 1, 2)


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
            "harness_ok", "zero_cross_scope_reuse", "zero_foreign_agent_names", "chat_hostile_answered",
            "chat_reports_carried", "memory_within_bounds", "no_estimates_after_reset", "metrics_served"]


@pytest.mark.server
@pytest.mark.parametrize("verdict", VERDICTS)
def test_short_soak_verdict_holds(short_soak, verdict):
    value = short_soak["verdicts"][verdict]
    assert value is True or value == "not checked", (verdict, value, short_soak["findings"].get(verdict),
                                                     short_soak["verdict_counts"].get(verdict),
                                                     short_soak["replay"], short_soak["salt_probes"])


@pytest.mark.server
def test_short_soak_injected_every_fault_family(short_soak):
    kinds = short_soak["operations_by_kind"]
    assert set(kinds) >= set(soak.TRAFFIC) - {"slot_flood"}, kinds
    assert short_soak["malformed"]["sent"] >= 1 and short_soak["salt_probes"]["n"] >= 1
    assert short_soak["replay"]["n"] >= 1 and short_soak["totals"]["requests"] >= 30


@pytest.mark.server
def test_short_soak_sent_chat_traffic_and_its_probes(short_soak):
    counts = short_soak["verdict_counts"]
    # How sensitive each probe was (its control found a copy; its reset probe was armed) is in the JSON:
    # a busy pool may evict a copy before the probe reads it, so the short run does not require it.
    assert counts["zero_cross_scope_reuse"]["probes"] >= 1 and counts["no_estimates_after_reset"]["probes"] >= 1
    assert counts["zero_foreign_agent_names"]["reports"] >= 10 and counts["zero_foreign_agent_names"]["scopes"] >= 2
    assert counts["chat_hostile_answered"]["sent"] >= 1 and counts["no_5xx"]["chat_requests"] >= 10
    assert counts["metrics_served"]["ok"] >= 1 and counts["memory_within_bounds"]["chat_polls"] >= 1
    for verdict in ("metrics_served", "memory_within_bounds", "zero_cross_scope_reuse", "zero_foreign_agent_names",
                    "chat_hostile_answered"):
        assert short_soak["verdicts"][verdict] != "not checked", verdict
    retraction = short_soak["retraction"]  # counted, not required
    assert retraction["bursts"] and retraction["events"] >= 0
