"""``--kvshare-pool-file`` in the cache: pools saved through the admin op come back in a new cache, which then
corrects a learned edge on its first request; a file of another model stops the launch; nothing is saved where
there is nothing to save."""

from __future__ import annotations

import pytest
import torch

from sglang_kvshare.admin import ops
from sglang_kvshare.cache.pool_persistence import PoolStore
from sglang_kvshare.correction.pool_file import PoolFileError
from tests.cache.fakes import MiniScheduler, make_cache
from tests.cache.test_adapter import _queries, annotated, assert_pool_accounted, learned_kvcmas, warm

SLOT = ((None, None, None), "query")


def _store(tmp_path) -> PoolStore:
    return PoolStore.for_rank(str(tmp_path / "pools.pt"))


def _b_after_a(sched: MiniScheduler, query: list[int]) -> dict:
    sched.run(annotated("A", query=query))
    b = annotated("B", query=query)
    sched.run(b)
    return b.report()["segments"][1]


def test_saved_pools_make_a_new_cache_correct_its_first_request(tmp_path):
    learned = learned_kvcmas(pool_store=_store(tmp_path))
    reply = ops.execute(learned.cache.kvshare_admin, "save")
    assert reply.status == 200, reply.message
    assert reply.result["saved"]["anchors"] == learned.cache.estimator.pool_size(SLOT) >= 2

    cold = MiniScheduler(make_cache("kvcmas", tau=1.0))  # the same requests without the file: it must learn first
    for agent in ("A", "B"):
        warm(cold, agent)
    assert _b_after_a(cold, _queries(4)[-1])["reason"] == "too_few_anchors"

    restarted = MiniScheduler(make_cache("kvcmas", tau=1.0, pool_store=_store(tmp_path)))
    assert restarted.cache.counters.get("pool_file_anchors_loaded") == reply.result["saved"]["anchors"]
    assert restarted.cache.hasher.secret == learned.cache.hasher.secret  # agents and contents hash as before
    for agent in ("A", "B"):
        warm(restarted, agent)
    first = _b_after_a(restarted, _queries(4)[-1])
    assert first["resolved_by"] == "correction", first
    assert_pool_accounted(restarted.cache)


def test_a_pool_file_of_another_model_stops_the_cache_from_starting(tmp_path):
    learned = learned_kvcmas(pool_store=_store(tmp_path))
    assert ops.execute(learned.cache.kvshare_admin, "save").ok
    path = tmp_path / "pools.pt"
    payload = torch.load(path, weights_only=True)
    payload["model"]["architecture"] = "another"
    torch.save(payload, path)
    with pytest.raises(PoolFileError, match="saved for another model"):
        make_cache("kvcmas", tau=1.0, pool_store=_store(tmp_path))


def test_no_file_yet_starts_empty_and_save_says_why_it_cannot(tmp_path):
    empty = make_cache("kvcmas", pool_store=_store(tmp_path))
    assert empty.estimator.pools() == [] and empty.counters.get("pool_file_anchors_loaded") == 0
    unset = make_cache("kvcmas")
    reply = ops.execute(unset.kvshare_admin, "save")
    assert reply.status == 409 and "--kvshare-pool-file" in reply.message
    aligned = make_cache("fullshared", pool_store=_store(tmp_path))
    reply = ops.execute(aligned.kvshare_admin, "save")
    assert reply.status == 409 and "keeps no anchor pools" in reply.message
    assert not (tmp_path / "pools.pt").exists()
    assert ops.execute(empty.kvshare_admin, "save", slot="query").status == 400


def test_an_unwritable_file_is_a_500_and_keeps_the_old_file(tmp_path):
    learned = learned_kvcmas(pool_store=_store(tmp_path))
    assert ops.execute(learned.cache.kvshare_admin, "save").ok
    before = (tmp_path / "pools.pt").read_bytes()
    blocked = learned_kvcmas(pool_store=PoolStore.for_rank(str(tmp_path / "pools.pt" / "inside")))
    reply = ops.execute(blocked.cache.kvshare_admin, "save")
    assert reply.status == 500 and "could not write the pool file" in reply.message
    assert (tmp_path / "pools.pt").read_bytes() == before
