"""A data-parallel rank that never answers, without a server: SGLang's own fan-out communicator in front of
the real read hooks of the other ranks. The admin call returns at its deadline, names the rank, and the next
call is not held behind it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from sglang.srt.managers.communicator import FanOutCommunicator

from sglang_kvshare.admin import aggregate, scheduler_hooks
from sglang_kvshare.admin.channel import AdminChannel
from tests.admin.test_admin_ops import FakeCache

DEADLINE_S = 0.3
BOUND_S = 5.0  # far above the deadline: what fails here is a wait without one


class RanksWithOneStuck:
    """SGLang's tokenizer side of ``GetInternalStateReq`` with its IPC left out: every rank but ``stuck``
    answers through its real read hook, one answer per rank and request, as SGLang's sockets deliver them."""

    def __init__(self, ranks: int, stuck: int) -> None:
        self.server_args = SimpleNamespace(dp_size=ranks)
        self.controllers = [SimpleNamespace(scheduler=SimpleNamespace(tree_cache=FakeCache(), dp_rank=r,
                                                                      metrics_reporter=None))
                            for r in range(ranks)]
        self.stuck = stuck
        self.get_internal_state_communicator = FanOutCommunicator(self._send, ranks)

    def auto_create_handle_loop(self) -> None:
        pass

    def _send(self, req) -> None:
        loop = asyncio.get_running_loop()
        for rank, controller in enumerate(self.controllers):
            if rank == self.stuck:
                continue
            result = SimpleNamespace(internal_state={})
            scheduler_hooks.after_get_internal_state(result, controller, req)
            loop.call_soon(self.get_internal_state_communicator.handle_recv, result)


async def _timed(awaitable):
    start = time.monotonic()
    result = await asyncio.wait_for(awaitable, BOUND_S)
    return result, time.monotonic() - start


def test_a_write_returns_at_its_deadline_and_names_the_rank_that_never_answered():
    async def run():
        ranks = RanksWithOneStuck(3, stuck=2)
        channel = AdminChannel(ranks, "ipc:///nonexistent", timeout=DEADLINE_S)
        replies, took = await _timed(channel.fan_out("configure", tau=0.5))
        reply = aggregate.merge_replies("configure", replies, 3)
        assert reply.status == 502 and reply.result["timed_out_ranks"] == [2], reply
        assert "rank(s) [2] did not answer in time" in reply.message
        assert [c.scheduler.tree_cache.kvshare_admin.config.tau for c in ranks.controllers[:2]] == [0.5, 0.5]
        assert took < BOUND_S
        # The next calls are not held behind the stuck one: each returns at its own deadline.
        again, _ = await _timed(channel.fan_out("pools"))
        assert sorted(r["dp_rank"] for r in again) == [0, 1]
        snaps, _ = await _timed(channel.read())
        merged = aggregate.merge_stats(snaps)
        assert [r["dp_rank"] for r in merged["ranks"]] == [0, 1]
        assert merged["stats"]["timed_out_ranks"] == [2]

    asyncio.run(run())


def test_every_rank_answering_names_none():
    async def run():
        ranks = RanksWithOneStuck(2, stuck=-1)
        channel = AdminChannel(ranks, "ipc:///nonexistent", timeout=DEADLINE_S)
        reply = aggregate.merge_replies("reset", await channel.fan_out("reset"), 2)
        assert reply.ok and "timed_out_ranks" not in reply.result
        merged = aggregate.merge_stats(await channel.read())
        assert merged["dp_size"] == 2 and "timed_out_ranks" not in merged["stats"]

    asyncio.run(run())


class RanksWithOneLate(RanksWithOneStuck):
    """Rank ``stuck`` answers each request only when the next one is sent: its late answer lands in the list of
    the call after (SGLang's communicator has no call ids)."""

    def __init__(self, ranks: int, stuck: int) -> None:
        super().__init__(ranks, stuck)
        self.held = None

    def _send(self, req) -> None:
        loop = asyncio.get_running_loop()
        if self.held is not None:
            loop.call_soon(self.get_internal_state_communicator.handle_recv, self.held)
        self.held = SimpleNamespace(internal_state={})
        scheduler_hooks.after_get_internal_state(self.held, self.controllers[self.stuck], req)
        super()._send(req)


def test_a_late_answer_to_an_earlier_read_is_never_shown_as_the_current_state():
    async def run():
        ranks = RanksWithOneLate(3, stuck=2)
        channel = AdminChannel(ranks, "ipc:///nonexistent", timeout=DEADLINE_S)
        first, _ = await _timed(channel.read())  # rank 2 says nothing in time
        assert aggregate.merge_stats(first)["stats"]["timed_out_ranks"] == [2]
        second, _ = await _timed(channel.read())  # rank 2's answer to the first read arrives now
        merged = aggregate.merge_stats(second)
        assert [r["dp_rank"] for r in merged["ranks"]] == [0, 1] and merged["stats"]["timed_out_ranks"] == [2]

    asyncio.run(run())
