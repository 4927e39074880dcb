"""Which KV the radix tree evicts first when the pool is full: the workflow-aware retention policy.

SGLang's ``RadixCache.evict`` heaps the evictable leaves by
``eviction_strategy.get_priority(node)`` at every call and frees the lowest
first. The kvshare cache puts ``RetentionStrategy`` there, around the strategy
SGLang built from ``--radix-eviction-policy``: a leaf's priority is (its rank,
the configured strategy's priority). Ranks, lowest evicted first:

* ``LEFT_BEHIND`` (0): KV a finished workflow last used, and the tail of an
  agent's earlier request that its next request did not extend (its private
  suffix and answer: single-use text);
* ``NEUTRAL`` (1): the rest: requests without an annotation, a live workflow's
  KV that no reader waits for;
* ``KEPT`` (2): the source of a shared content that some reader of its slot
  has not read yet (``PlaceholderNode.pending``), in a live workflow: its
  latest copy, the one reuse reads. Only that one: keeping every copy of a
  pending content measured worse than SGLang's LRU on a fake group-chat mix
  under a small pool (it crowds out the histories the agents re-read).

A workflow has finished once none of its requests is in flight and the
server has released ``IDLE_FACTOR`` times as many requests since its last one
as the longest pause it made between requests (at least ``IDLE_FLOOR``, at
most ``IDLE_CAP``); one whose requests never come back (aborted before their
release) after ``STALE`` releases. Why releases, not seconds: every
tensor-parallel rank releases the same requests in the same order, so every
rank ranks a leaf alike and evicts the same leaves (a clock would differ near a
deadline); and a pool only fills while requests are served.

The policy only orders eviction: every evictable leaf stays in SGLang's heap,
so ``evict(n)`` frees as much as SGLang's own policy would, and no request
waits for memory stock SGLang would have found. What a rank reads is kept on
the node (three attributes, set when a request is released, a copy is
recorded, or an agent moves past its old tail) and on its workflow: a few
attribute reads per leaf at every evict, no patch to SGLang.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from sglang_kvshare.cache.registry import DEAD_ATTR, MAX_READERS, Copies, PlaceholderNode, PlaceholderRegistry
from sglang_kvshare.counters import Counters

LEFT_BEHIND, NEUTRAL, KEPT = 0, 1, 2
RANK_NAMES = {LEFT_BEHIND: "left_behind", NEUTRAL: "neutral", KEPT: "kept"}
IDLE_FLOOR = 32  # releases (any request's) a workflow must stay idle before it counts as finished
IDLE_FACTOR = 4
IDLE_CAP = 4096
STALE = 16384
MAX_WORKFLOWS = 4096  # workflows whose clocks are kept (least recently active dropped first)
POLICY = "workflow"  # the name /kvshare/stats gives this policy (``retention``)

LIFE_ATTR = "kvshare_life"  # the WorkflowLife that last released a request through the node
SOURCE_ATTR = "kvshare_source"  # (slot, copies) of the shared content whose copy ends at the node
TAIL_ATTR = "kvshare_left"  # an agent's later request did not extend this tail


@dataclass(eq=False)
class WorkflowLife:
    """One workflow's clock, in releases: when it was last active, what is in flight, its agents' last tails."""

    last_seen: int
    in_flight: int = 0
    longest_pause: int = 0
    tails: dict[str, Any] = field(default_factory=dict)  # agent -> the last node of its last released request

    def finished(self, now: int) -> bool:
        idle = now - self.last_seen
        if self.in_flight > 0:
            return idle > STALE
        return idle > min(max(IDLE_FLOOR, IDLE_FACTOR * self.longest_pause), IDLE_CAP)


class Retention:
    """The workflows' clocks and the node marks of one cache; ``strategy`` is what SGLang's evict calls.

    ``enabled``: whether the policy is in force (the ``retention`` setting; off, SGLang's strategy alone).
    Scheduler thread only.
    """

    def __init__(self, enabled: Callable[[], bool], counters: Counters, registry: PlaceholderRegistry) -> None:
        self.enabled = enabled
        self.counters = counters
        self.registry = registry  # whose generation says which copies a reset forgot
        self.sglang_policy = "lru"  # the name of the strategy wrapped (``wrap``)
        self.workflows: OrderedDict[tuple, WorkflowLife] = OrderedDict()
        self.now = 0  # requests released so far: the workflows' clock

    @property
    def name(self) -> str:
        """The policy in force, as /kvshare/stats names it: ``workflow``, or SGLang's policy (``lru`` ...)."""
        return POLICY if self.enabled() else self.sglang_policy

    def wrap(self, inner: EvictionStrategy, sglang_policy: str) -> "RetentionStrategy":
        self.sglang_policy = sglang_policy
        return RetentionStrategy(inner, self)

    def reset(self) -> None:
        self.workflows.clear()

    # ------------------------------------------------------------ events
    def _life(self, plan: Any, now: int) -> WorkflowLife:
        key = (plan.namespace, plan.workflow)
        life = self.workflows.get(key)
        if life is None:
            life = self.workflows[key] = WorkflowLife(last_seen=now)
            while len(self.workflows) > MAX_WORKFLOWS:
                self.workflows.popitem(last=False)
        self.workflows.move_to_end(key)
        return life

    def opened(self, plan: Any) -> None:
        """A request of the plan's workflow is matched (also again while it waits)."""
        now = self.now
        life = self._life(plan, now)
        if not plan.state.in_workflow:
            if life.in_flight == 0:
                life.longest_pause = max(life.longest_pause, now - life.last_seen)
            life.in_flight += 1
            plan.state.in_workflow = True
        life.last_seen = now

    def closed(self, plan: Optional[Any], last: Optional[Any], root: Any) -> None:
        """A request is released (``plan``: its plan, None without an annotation); ``last``: the node that ends
        what it left in the tree (None: nothing).

        Advances the clock; marks the path as its workflow's, and the agent's previous tail, where this
        request left it, as left behind (down from where the two paths part).
        """
        self.now += 1
        if plan is None:
            return
        now = self.now
        life = self._life(plan, now)
        if plan.state.in_workflow:
            life.in_flight -= 1
            plan.state.in_workflow = False
        life.last_seen = now
        if last is None or last is root:
            return
        on_path = set()
        node = last
        while node is not None and node is not root:
            setattr(node, LIFE_ATTR, life)
            if getattr(node, TAIL_ATTR, False):
                setattr(node, TAIL_ATTR, False)
            on_path.add(id(node))
            node = node.parent
        prev = life.tails.get(plan.agent_id)
        while prev is not None and prev is not root and id(prev) not in on_path and not getattr(prev, DEAD_ATTR,
                                                                                                   False):
            setattr(prev, TAIL_ATTR, True)
            prev = prev.parent
        if plan.agent_id in life.tails or len(life.tails) < MAX_READERS:
            life.tails[plan.agent_id] = last

    def recorded(self, node: Any, slot: PlaceholderNode, copies: Copies, plan: Any) -> None:
        """A copy of a shared content ends at ``node``: kept while the content is pending in a live workflow."""
        setattr(node, SOURCE_ATTR, (slot, copies))
        setattr(node, LIFE_ATTR, self._life(plan, self.now))

    def evicted(self, node: Any) -> None:
        """Count an evicted leaf's tokens under its rank (a kept one: the pool had nothing else to give)."""
        n = len(node.key) if node.key is not None else 0
        self.counters.add("evicted_tokens", n)
        if self.enabled():
            self.counters.add(f"evicted_{RANK_NAMES[self.rank(node, self.now)]}_tokens", n)

    # ------------------------------------------------------------ ranks
    def rank(self, node: Any, now: int) -> int:
        """The node's rank (module docstring) at clock ``now``: a few attribute reads."""
        life = getattr(node, LIFE_ATTR, None)
        if life is None:
            return NEUTRAL
        if life.finished(now):
            return LEFT_BEHIND
        source = getattr(node, SOURCE_ATTR, None)
        if (source is not None and source[0].pending(source[1])
                and source[1].latest_node(self.registry.generation) is node):
            return KEPT
        return LEFT_BEHIND if getattr(node, TAIL_ATTR, False) else NEUTRAL


class RetentionStrategy(EvictionStrategy):
    """SGLang's eviction strategy with the retention rank in front (module docstring)."""

    def __init__(self, inner: EvictionStrategy, retention: Retention) -> None:
        self.inner = inner
        self.retention = retention

    def get_priority(self, node: Any) -> Union[float, tuple]:
        inner = self.inner.get_priority(node)
        if not self.retention.enabled():
            return inner
        return (self.retention.rank(node, self.retention.now), inner)
