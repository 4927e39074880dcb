"""Workflow affinity: which DP worker an annotated request is routed to (no server)."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from sglang_kvshare import config as config_module
from sglang_kvshare.config import KVShareConfig
from sglang_kvshare.server.affinity import rank_of, route, scope_key


@pytest.fixture
def live(monkeypatch):
    """Set the HTTP process's config in force for one test."""
    def use(**changes):
        monkeypatch.setattr(config_module, "_live", KVShareConfig(**changes))
    use()
    return use


def _request(workflow=None, *, salt=None, rank=None, ids=(1, 2, 3), raw=None):
    ann = {"agent": "solver", "segments": [{"kind": "private", "start": 0, "end": 3}]}
    if workflow is not None:
        ann["workflow"] = workflow
    custom = {"kvshare": raw if raw is not None else json.dumps(ann)}
    return SimpleNamespace(text=None, input_ids=list(ids), cache_salt=salt, routed_dp_rank=rank,
                           sampling_params={"max_new_tokens": 1, "custom_params": custom})


def _manager(workers: int):
    return SimpleNamespace(elastic_worker_count=workers, server_args=SimpleNamespace(dp_size=workers))


def test_a_workflows_requests_meet_on_one_worker(live):
    ranks = {route(_request("wf-7"), _manager(4)) for _ in range(5)}
    assert len(ranks) == 1 and ranks.pop() == rank_of("workflow:wf-7", 4)


def test_many_workflows_spread_over_every_worker(live):
    counts = Counter(route(_request(f"wf-{i}"), _manager(2)) for i in range(200))
    assert set(counts) == {0, 1} and min(counts.values()) > 70


def test_the_rank_is_a_stable_digest_not_pythons_per_process_hash():
    # Fixed values: a restart, or another HTTP worker process (PYTHONHASHSEED differs), must send a workflow
    # to the same rank; a change of the digest would move every workflow and must be deliberate.
    assert [rank_of(f"workflow:{w}", 8) for w in ("a", "b", "team-1", "team-2")] == [5, 2, 5, 3]


@pytest.mark.parametrize("req, workers", [
    (_request(None), 2),  # no workflow: SGLang's balancing
    (_request("wf", rank=1), 2),  # the client named its rank
    (_request("wf"), 1),  # one worker
    (_request("wf", raw="{not json"), 2),  # malformed: the validation hook answers 400
    (_request("wf", ids=[[1, 2], [3, 4]]), 2),  # a batch: one rank field for many scopes
])
def test_requests_without_a_key_keep_sglangs_routing(live, req, workers):
    before = req.routed_dp_rank
    assert route(req, _manager(workers)) is None and req.routed_dp_rank == before


@pytest.mark.parametrize("scope", ["salt", "salt-required"])
def test_with_a_salt_scope_the_salt_picks_the_worker(live, scope):
    live(reuse_scope=scope)
    assert scope_key(_request("wf", salt="tenant-a"), scope) == "salt:tenant-a"
    assert route(_request("wf", salt="tenant-a"), _manager(2)) == rank_of("salt:tenant-a", 2)
    assert route(_request("wf"), _manager(2)) is None  # no salt: no scope to keep together


def test_mode_off_routes_nothing(live):
    live(mode="off")
    assert route(_request("wf"), _manager(2)) is None
