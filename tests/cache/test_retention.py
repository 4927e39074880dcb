"""What the tree evicts first under a full pool, and the copy records that outlive the pool's churn.

On fake pools (``tests/cache/fakes.py``): a source read by reuse is touched
like a prefix match; the records are sized to the pool; the retention policy
evicts what finished workflows and superseded tails left before a live
workflow's unread source, and never keeps a leaf SGLang needs to free.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_kvshare.cache import retention
from sglang_kvshare.cache.registry import Copies, Materialization, PlaceholderNode, RegistryLimits
from tests.cache.fakes import FakeReq, MiniScheduler, make_cache

SYS = {"A": list(range(10, 30)), "B": list(range(40, 53)), "C": list(range(60, 77))}
SUFFIX = [5, 6, 7]


def request(agent: str, query: list[int], *, workflow: str = "w1", slot: str = "query",
            suffix: list[int] = SUFFIX) -> FakeReq:
    sys_ids = SYS[agent]
    tokens = sys_ids + query + suffix
    segs = [{"kind": "private", "start": 0, "end": len(sys_ids)},
            {"kind": "shared", "start": len(sys_ids), "end": len(sys_ids) + len(query), "slot": slot},
            {"kind": "private", "start": len(sys_ids) + len(query), "end": len(tokens)}]
    ann = {"agent": agent, "workflow": workflow, "segments": segs}
    return FakeReq(tokens, custom_params={"kvshare": json.dumps(ann)})


def query(i: int, length: int = 40) -> list[int]:
    return list(range(1000 + 100 * i, 1000 + 100 * i + length))


def path_nodes(cache, tokens: list[int]) -> list:
    """The tree nodes of an exact path, deepest first, root excluded (read without touching them)."""
    node, at, nodes = cache.root_node, 0, []
    while at < len(tokens):
        node = next(c for c in node.children.values()
                    if c.key.extra_key is None and c.key.token_ids[0] == tokens[at])
        nodes.append(node)
        at += len(node.key)
    return nodes[::-1]


def source_node(cache, agent: str, q: list[int]):
    """The node that ends ``agent``'s copy of ``q`` (the source others are aligned from)."""
    return path_nodes(cache, SYS[agent] + q)[0]


def test_a_source_read_by_reuse_is_touched_up_its_path():
    sched = MiniScheduler(make_cache("fullshared"))
    sched.run(request("A", query(0)))
    sched.run(FakeReq(SYS["B"] + [1]))  # B's private prefix, plain
    path = path_nodes(sched.cache, SYS["A"] + query(0))
    for node in path:
        node.last_access_time = 0.0  # long unused, as far as the LRU can tell
    b = request("B", query(0))
    sched.run(b)
    assert b.report()["segments"][1]["resolved_by"] == "alignment"
    assert all(node.last_access_time > 0.0 for node in path)  # the source and everything above it


def test_records_are_sized_to_the_pool_and_hard_capped():
    small = RegistryLimits.for_pool(512, 256)
    assert (small.max_contents, small.max_private, small.max_namespaces) == (256, 4096, 64)
    big = RegistryLimits.for_pool(1_000_000, 256)
    assert big.max_contents == big.max_namespaces == 1_000_000 // 256 + 1
    assert RegistryLimits.for_pool(1_000_000, 256, max_namespaces=8).max_namespaces == 8
    flood = RegistryLimits.for_pool(10**9, 0)  # every length reused: the shortest record still counts
    assert flood.max_contents == 16384 and flood.max_private == 16384 and flood.max_namespaces == 4096
    cache = make_cache("fullshared", pool_tokens=65536)
    assert cache.registry.limits.max_contents == 65536 // 32  # the fakes reuse every length


def _live_node() -> SimpleNamespace:
    return SimpleNamespace()


def test_a_pool_sized_slot_keeps_every_content_whose_kv_is_live():
    limits = RegistryLimits.for_pool(40 * 600, 40)  # 600 contents of 40 tokens fill the pool
    slot = PlaceholderNode("auto:message", limits)
    nodes = [_live_node() for _ in range(600)]
    for i, node in enumerate(nodes):
        slot.record(f"c{i}", Materialization("A", "A", node, 0, 40, True, 0))
    assert slot.copies("c0") and slot.copies("c0")[0].node is nodes[0]  # 256 used to be the limit


def test_a_full_table_drops_a_content_whose_copies_are_gone_before_a_live_one():
    slot = PlaceholderNode("s", RegistryLimits(max_contents=3))
    nodes = [_live_node() for _ in range(4)]
    for i, node in enumerate(nodes[:3]):
        slot.record(f"c{i}", Materialization("A", "A", node, 0, 4, True, 0))
    nodes[1].kvshare_dead = True  # evicted by the tree
    slot.record("c3", Materialization("A", "A", nodes[3], 0, 4, True, 0))
    assert list(slot.contents) == ["c0", "c2", "c3"]


def test_a_content_is_pending_until_every_reader_of_its_slot_holds_it():
    slot = PlaceholderNode("s", RegistryLimits())
    copies: Copies = slot.record("doc", Materialization("A", "A", _live_node(), 0, 4, True, 0))
    assert slot.pending(copies)  # read by its producer only
    slot.record("other", Materialization("B", "B", _live_node(), 0, 4, True, 0))
    slot.record("doc", Materialization("B", "B", _live_node(), 0, 4, True, 0))
    slot.record("other", Materialization("C", "C", _live_node(), 0, 4, True, 0))
    assert slot.pending(copies)  # C reads the slot and has not read doc
    slot.record("doc", Materialization("C", "C", _live_node(), 0, 4, True, 0))
    assert not slot.pending(copies)


def _evicted_first(cache, tokens: int) -> None:
    freed = cache.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted
    assert freed >= tokens


def _alive(node) -> bool:
    return not getattr(node, "kvshare_dead", False)


@pytest.mark.parametrize("policy", ["workflow", "sglang"])
def test_a_finished_workflows_kv_goes_before_a_live_workflows_unread_source(policy):
    cache = make_cache("fullshared", retention=policy)
    sched = MiniScheduler(cache)
    sched.run(request("A", query(0), workflow="live"))  # older: a plain LRU evicts it first
    sched.run(request("C", query(1), workflow="done"))
    source = source_node(cache, "A", query(0))
    done = path_nodes(cache, SYS["C"] + query(1) + SUFFIX)
    cache.retention.now += 100  # the server released 100 more requests; "done" sent none, "live" has one in flight
    sched.match(request("B", query(2), workflow="live"))
    _evicted_first(cache, sum(len(n.key) for n in done))
    if policy == "workflow":
        assert _alive(source) and not any(_alive(n) for n in done)
    else:
        assert not _alive(source)  # SGLang's LRU: the older source goes first
    assert cache.kvshare_admin.stats()["retention"] == ("workflow" if policy == "workflow" else "lru")


def test_an_agents_superseded_tail_goes_before_a_live_agents_older_kv():
    cache = make_cache("fullshared")
    sched = MiniScheduler(cache)
    sched.run(request("B", query(5)))  # older: a plain LRU evicts B's tail first
    other = path_nodes(cache, SYS["B"] + query(5) + SUFFIX)[0]
    sched.run(request("A", query(0)))
    old_tail = path_nodes(cache, SYS["A"] + query(0) + SUFFIX)[0]
    sched.run(request("A", query(0), suffix=[4, 4, 4]))  # A's next request leaves the old tail
    _evicted_first(cache, len(SUFFIX))
    assert not _alive(old_tail) and _alive(other)


def test_the_policy_never_keeps_a_leaf_evict_needs():
    cache = make_cache("fullshared", pool_tokens=400)
    sched = MiniScheduler(cache)
    for i in range(4):
        sched.run(request("A", query(i), slot=f"s{i}"))  # four unread sources of one live workflow
    sched.match(request("B", query(9)))  # the workflow stays live
    kept = [source_node(cache, "A", query(i)) for i in range(4)]
    assert all(cache.retention.rank(n, cache.retention.now) == retention.KEPT for n in kept)
    evictable = cache.evictable_size()
    assert cache.evict(EvictParams(num_tokens=evictable)).num_tokens_evicted == evictable
    assert cache.evictable_size() == 0 and not any(_alive(n) for n in kept)
    assert cache.kvshare_admin.stats()["counters"]["evicted_kept_tokens"] > 0


def test_a_source_forgotten_by_a_reset_is_no_longer_kept():
    cache = make_cache("fullshared")
    sched = MiniScheduler(cache)
    sched.run(request("A", query(0)))
    sched.match(request("B", query(9)))
    source = source_node(cache, "A", query(0))
    assert cache.retention.rank(source, cache.retention.now) == retention.KEPT
    cache.kvshare_admin.reset()  # the copy records are gone: nobody can be served from it any more
    assert cache.retention.rank(source, cache.retention.now) == retention.NEUTRAL


def test_a_workflow_is_finished_after_an_idle_stretch_that_grows_with_its_pauses():
    life = retention.WorkflowLife(last_seen=0)  # counted in requests the server released
    assert not life.finished(retention.IDLE_FLOOR) and life.finished(retention.IDLE_FLOOR + 1)
    life.longest_pause = 60
    assert not life.finished(4 * 60) and life.finished(4 * 60 + 1)
    life.in_flight = 1  # a request in flight keeps it live, up to the stale bound
    assert not life.finished(1000) and life.finished(retention.STALE + 1)


def test_every_release_advances_the_clock_and_a_pause_is_measured_in_releases():
    cache = make_cache("fullshared")
    sched = MiniScheduler(cache)
    sched.run(request("A", query(0)))
    for _ in range(5):
        sched.run(FakeReq(SYS["C"] + [1]))  # other traffic: plain requests
    sched.run(request("B", query(1)))
    life = next(iter(cache.retention.workflows.values()))
    assert cache.retention.now == 7 and life.longest_pause == 5 and life.in_flight == 0


def test_the_retention_policy_switches_at_runtime():
    cache = make_cache("fullshared")
    assert cache.kvshare_admin.stats()["retention"] == "workflow"
    cache.kvshare_admin.configure(retention="sglang")
    assert cache.kvshare_admin.stats()["retention"] == "lru"
    assert not isinstance(cache.eviction_strategy.get_priority(cache.root_node), tuple)
