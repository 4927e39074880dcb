"""The /kvshare/ routes on a live server: stats move, config applies, reset empties, bad bodies get 422."""

from __future__ import annotations

import pytest

from sglang_kvshare.config import RUNTIME_FIELDS
from tests.admin.conftest import shared_text

pytestmark = pytest.mark.server

GATE_REASONS = {"too_few_anchors", "gate_rejected", "no_edge", "no_source"}


def test_stats_count_reuse_of_a_shared_segment_in_fullshared(admin):
    admin.configure(mode="fullshared")
    assert admin.post("/kvshare/reset").status_code == 200
    before = admin.stats()
    assert before["shared_tokens_seen"] == 0 and before["slots"] == {}

    report = admin.share(shared_text(1), slot="query")
    shared_segment = report["segments"][1]
    assert shared_segment["resolved_by"] == "alignment", report

    after = admin.stats()
    assert after["config"]["mode"] == "fullshared"
    slot = after["slots"]["query"]
    assert slot["requests"] == 2  # the solver's dense prefill and the critic's reuse
    assert slot["resolved_alignment"] == shared_segment["resolved_tokens"] > 0  # rows reused (a head may be prefilled)
    assert slot["shared_tokens_seen"] > before["shared_tokens_seen"]
    assert after["reuse_ratio"] > 0
    assert after["counters"]["annotated_requests"] >= 2

    pools = admin.get("/kvshare/pools", headers=admin.headers()).json()["pools"]
    assert "query" in pools
    one = admin.get("/kvshare/pools/query", headers=admin.headers())
    assert one.status_code == 200 and one.json()["slot"] == "query"
    missing = admin.get("/kvshare/pools/no-such-slot", headers=admin.headers())
    assert missing.status_code == 404 and "no-such-slot" in missing.json()["message"]


def test_config_change_applies_to_the_next_request(admin):
    admin.configure(mode="fullshared")
    assert admin.share(shared_text(2))["tokens_aligned"] > 0

    config = admin.configure(mode="kvcmas", tau=0.0)
    assert config["mode"] == "kvcmas" and config["tau"] == 0.0
    assert admin.stats()["config"] == config

    # Same kind of request as above, new content: with tau 0 the gate accepts nothing.
    # (Short content: the dense prefill it causes is learned as an anchor, an SVD per layer.)
    report = admin.share(shared_text(3, items=3))
    assert report["tokens_corrected"] == 0 and report["shared_tokens_reused"] == 0, report
    shared_segment = report["segments"][1]
    assert shared_segment["resolved_by"] == "dense" and shared_segment["reason"] in GATE_REASONS, report

    admin.configure(mode="off")
    assert admin.share(shared_text(4)).get("tokens_aligned", 0) == 0
    admin.configure(mode="fullshared", tau=0.3)


def test_config_change_is_all_or_nothing(admin):
    before = admin.configure(mode="fullshared", tau=0.25, capacity=8)
    r = admin.post("/kvshare/config", {"tau": 0.5, "capacity": 1})
    assert r.status_code == 422 and "capacity" in r.json()["message"]
    assert admin.stats()["config"] == before  # tau did not change either


def test_reset_empties_the_pools(admin):
    admin.configure(mode="fullshared")
    admin.share(shared_text(5), slot="reset-a")
    admin.share(shared_text(6), slot="reset-b")
    slots = admin.stats()["slots"]
    assert slots["reset-a"]["requests"] > 0 and slots["reset-b"]["requests"] > 0

    r = admin.post("/kvshare/pools/reset-a/reset")
    assert r.status_code == 200, r.text
    slots = admin.stats()["slots"]
    assert slots.get("reset-a", {}).get("requests", 0) == 0
    assert slots["reset-b"]["requests"] > 0
    assert admin.post("/kvshare/pools/never-seen/reset").status_code == 404

    # The solver alone sees a content; a full reset forgets it, so the critic cannot reuse it.
    admin.ask("solver", shared_text(8), slot="reset-a")
    r = admin.post("/kvshare/reset")
    assert r.status_code == 200
    stats = admin.stats()
    assert stats["slots"] == {} and stats["shared_tokens_seen"] == 0 and stats["anchor_bytes"] == 0
    pools = admin.get("/kvshare/pools", headers=admin.headers()).json()["pools"]
    assert all(anchors == [] for anchors in pools.values())
    segment = admin.ask("critic", shared_text(8), slot="reset-a")["segments"][1]
    assert segment["resolved_by"] == "dense" and segment["reason"] == "no_source", segment


@pytest.mark.parametrize("body, field", [
    ({"tau": 1.5}, "tau"),
    ({"tau": "0.2"}, "tau"),
    ({"capacity": 1}, "capacity"),
    ({"capacity": 2.5}, "capacity"),
    ({"rank": -1}, "rank"),
    ({"mode": "kvcomm"}, "mode"),
    ({"mode": "fast"}, "mode"),
    ({"colour": "blue"}, "colour"),
    ({}, "nothing to change"),
    ([0.2], "JSON object"),
])
def test_bad_config_bodies_get_422_with_a_message(admin, body, field):
    before = admin.stats()["config"]
    r = admin.post("/kvshare/config", body)
    assert r.status_code == 422, r.text
    assert field in r.json()["message"]
    assert admin.stats()["config"] == before


def test_malformed_json_gets_422(admin):
    r = admin.post("/kvshare/config", raw=b"{tau: 0.1")
    assert r.status_code == 422 and "JSON" in r.json()["message"]


def test_openapi_lists_the_routes(admin):
    paths = admin.get("/openapi.json").json()["paths"]
    assert set(paths) >= {"/kvshare/stats", "/kvshare/pools", "/kvshare/pools/{slot}", "/kvshare/config",
                          "/kvshare/pools/{slot}/reset", "/kvshare/reset", "/kvshare/save"}
    body = paths["/kvshare/config"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == set(RUNTIME_FIELDS) >= {"tau", "capacity", "rank", "mode"}


def test_save_without_a_pool_file_is_a_409_that_says_how(admin):
    r = admin.post("/kvshare/save")
    assert r.status_code == 409 and "--kvshare-pool-file" in r.json()["message"], r.text
