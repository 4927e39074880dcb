"""``--kvshare-pool-file`` in the cache: pools saved through the admin op come back in a new cache, which then
corrects a learned edge on its first request; a file of another model stops the launch; nothing is saved where
there is nothing to save; with a save interval, idle time saves pools that changed, once per interval."""

from __future__ import annotations

import pytest
import torch

from sglang_kvshare.admin import ops
from types import SimpleNamespace

from sglang_kvshare.cache.pool_persistence import PoolSaver, PoolStore
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


def test_idle_time_saves_pools_that_changed_once_per_interval(tmp_path):
    from sglang_kvshare.server.idle_learning import before_sleep_on_idle

    now = [0.0]
    sched = learned_kvcmas(pool_store=_store(tmp_path), pool_save_interval_s=10)
    cache = sched.cache
    assert cache.pool_saver.interval_s == 10
    cache.pool_saver = PoolSaver(cache.pool_saver.store, 10, clock=lambda: now[0])  # learned, never saved
    scheduler = SimpleNamespace(tree_cache=cache)  # what SGLang's idle loop hands the hook
    path = tmp_path / "pools.pt"

    now[0] = 5.0
    before_sleep_on_idle(scheduler)
    assert not path.exists()  # the interval has not passed
    now[0] = 11.0
    before_sleep_on_idle(scheduler)
    assert path.exists() and cache.counters.get("pool_file_autosaves") == 1
    now[0] = 30.0
    before_sleep_on_idle(scheduler)
    assert cache.counters.get("pool_file_autosaves") == 1  # nothing changed since
    warm(sched, "C")
    before = cache.estimator.changes
    sched.run(annotated("C", query=_queries(3)[-1]))  # a new edge A -> C: prefilled densely, and learned
    assert cache.estimator.changes > before
    before_sleep_on_idle(scheduler)
    assert cache.counters.get("pool_file_autosaves") == 2
    restored = make_cache("kvcmas", tau=1.0, pool_store=_store(tmp_path))
    assert restored.estimator.pool_size(SLOT) == cache.estimator.pool_size(SLOT)


def test_a_failed_idle_save_is_counted_and_never_raises(tmp_path):
    now = [0.0]
    sched = learned_kvcmas()
    blocked = PoolStore.for_rank(str(tmp_path / "file"))
    (tmp_path / "file").write_text("x")
    sched.cache.pool_saver = PoolSaver(PoolStore.for_rank(str(tmp_path / "file" / "inside")), 10, clock=lambda: now[0])
    now[0] = 100.0
    sched.cache.autosave_pools()
    assert sched.cache.counters.get("pool_file_save_errors") == 1 and blocked.path.read_text() == "x"
    sched.cache.autosave_pools()
    assert sched.cache.counters.get("pool_file_save_errors") == 1  # tried again only after the interval


def test_the_idle_hook_is_installed_for_saving_alone():
    from sglang_kvshare.config import KVShareConfig
    from sglang_kvshare.server import sglang_targets
    from sglang_kvshare.server.plugin import scheduler_hooks

    synchronous = KVShareConfig(mode="kvcmas", learn_async=False)
    assert sglang_targets.IDLE_LEARNING_HOOK not in scheduler_hooks(synchronous)
    saving = synchronous.replace(pool_file="p.pt", pool_save_interval_s=60)
    assert sglang_targets.IDLE_LEARNING_HOOK in scheduler_hooks(saving)
    assert sglang_targets.DECODE_LEARNING_HOOK not in scheduler_hooks(saving)


def test_a_forged_file_of_another_kv_layout_stops_the_cache_from_starting(tmp_path, monkeypatch):
    """A head_dim-8 file that claims a head_dim-16 server's identity is refused at launch, never loaded to fail
    at a later gate (on one rank only, under tensor parallelism)."""
    from tests.cache import fakes

    learned = learned_kvcmas(pool_store=_store(tmp_path))  # head_dim 8
    assert ops.execute(learned.cache.kvshare_admin, "save").ok
    monkeypatch.setattr(fakes, "HEAD_DIM", 16)
    wider = make_cache("kvcmas", tau=1.0, pool_store=PoolStore.for_rank(str(tmp_path / "none.pt")))
    identity = wider.pool_saver.store.identity
    assert identity["kv"] == {"layers": fakes.LAYERS, "k": [fakes.HEADS, 16], "v": [fakes.HEADS, 16],
                              "dtype": "float32"}
    path = tmp_path / "pools.pt"
    with pytest.raises(PoolFileError, match=r"kv differs: .*'k': \[1, 8\].* there"):
        make_cache("kvcmas", tau=1.0, pool_store=_store(tmp_path))
    payload = torch.load(path, weights_only=True)
    payload["model"] = identity  # forged: the tensors stay head_dim 8
    torch.save(payload, path)
    with pytest.raises(PoolFileError, match=r"head shape \[1, 8\]; this server's KV has \[1, 16\]"):
        make_cache("kvcmas", tau=1.0, pool_store=_store(tmp_path))


def test_a_hub_id_is_identified_by_its_cached_weights_and_its_whole_name(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from sglang_kvshare.cache.pool_persistence import local_weights

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    for org, byte in (("a", b"\0"), ("b", b"\1")):  # two models of one name, in the hub's cache layout
        repo = tmp_path / f"models--{org}--Llama-3.2-1B-Instruct"
        snapshot = repo / "snapshots" / "0123abcd"
        snapshot.mkdir(parents=True)
        (snapshot / "model.safetensors").write_bytes(byte * 100)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd")
    a, b = (local_weights(f"{org}/Llama-3.2-1B-Instruct") for org in ("a", "b"))
    assert a == str(tmp_path / "models--a--Llama-3.2-1B-Instruct" / "snapshots" / "0123abcd") and a != b
    from sglang_kvshare.correction.pool_file import weights_digest

    assert weights_digest(a) != weights_digest(b)
    assert local_weights("c/not-cached") == "c/not-cached" and local_weights(str(tmp_path)) == str(tmp_path)
