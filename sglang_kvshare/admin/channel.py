"""HTTP-process end of the admin channel (the scheduler end is ``scheduler_hooks``).

* ``read()``: SGLang's ``TokenizerManager.get_internal_state()`` (one
  ``GetInternalStateReq``, answered by every DP rank); our scheduler hook puts
  the cache's snapshot under ``internal_state["kvshare"]``.
* ``call(op, **params)``: an ``RpcReqInput(method="kvshare_admin")`` on
  SGLang's RPC socket (``PortArgs.rpc_ipc_name``). The scheduler side connects
  a DEALER socket there at start-up; in ``sglang.launch_server`` nothing binds
  the other end (only the offline ``Engine`` does), so this channel binds it on
  first use. Calls are serialized by a lock (one outstanding RPC, as in
  ``Engine.collective_rpc``); each carries a fresh ``rid`` that the scheduler
  echoes, so a late answer to a call that timed out is recognised and dropped.

* ``fan_out(op, **params)``: the same op for every data-parallel rank
  (``--dp-size > 1``, where the RPC socket reaches one rank only): carried in
  the ``rid`` of a ``GetInternalStateReq``, which SGLang sends to every rank
  and answers with one state per rank; each carries that rank's reply.

Every wait has a deadline (``timeout``). SGLang's fan-out waits for every rank
without one, so a stuck rank would hold this call and every later read behind
it; here a read or fan-out returns at the deadline with the ranks that
answered, and names the others (``timed_out_ranks``).

Limits: ``--tokenizer-worker-num 1`` (the default; SGLang's API keys need it too).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Optional

from sglang_kvshare.admin import ops

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 60.0


class ChannelError(RuntimeError):
    """The scheduler did not answer (in time); ``status`` is the HTTP status to return."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


class AdminChannel:
    """Reads and writes the scheduler's kvshare state over SGLang's own IPC."""

    def __init__(self, tokenizer_manager: Any, rpc_endpoint: str, *, timeout: float = RPC_TIMEOUT_S) -> None:
        self.tokenizer_manager = tokenizer_manager
        self.rpc_endpoint = rpc_endpoint
        self.timeout = timeout
        self._socket = None
        self._lock: Optional[asyncio.Lock] = None

    async def read(self) -> list[dict]:
        """One snapshot (``{"config", "stats", "pools"}``) per DP rank that answered within ``timeout``;
        when a rank did not, every snapshot carries ``timed_out_ranks`` (``aggregate.merge_stats`` shows it).

        Raises ``ChannelError``: 503 when no rank carries a snapshot (the scheduler does not run the
        kvshare cache), 504 when no rank answered in time.
        """
        from sglang.srt.managers.io_struct import GetInternalStateReq

        call_id = uuid.uuid4().hex
        outputs, timed_out = await self._gather(GetInternalStateReq(rid=ops.READ_PREFIX + call_id))
        states = [getattr(out, "internal_state", None) for out in outputs]
        snaps = [s[ops.STATE_KEY] for s in states if isinstance(s, dict) and ops.STATE_KEY in s]
        # NOTE: SGLang's communicator has no call ids: a rank's late answer to an earlier read can fill a later
        # read's list. Snapshots of another call are dropped and their rank counted as not answering.
        late = [s for s in snaps if s.get(ops.CALL_KEY) != call_id]
        snaps = [s for s in snaps if s.get(ops.CALL_KEY) == call_id]
        timed_out = timed_out or bool(late)
        missing = self._missing({int(s.get("dp_rank", 0)) for s in snaps}) if timed_out else []
        if timed_out and not snaps:
            raise ChannelError(f"no data-parallel rank answered the kvshare read within {self.timeout:g}s "
                               f"(timed out: rank(s) {missing})", status=504)
        if not snaps:
            raise ChannelError("the scheduler does not run the kvshare cache "
                               "(start the server with --radix-cache-backend kvshare)")
        for snap in snaps:
            snap.pop(ops.CALL_KEY, None)
            if "error" in snap:
                raise ChannelError(f"reading the kvshare state failed: {snap['error']}", status=500)
            if missing:
                snap["timed_out_ranks"] = missing
        return snaps

    async def call(self, op: str, **params: Any) -> ops.Reply:
        """Run ``ops.execute(cache, op, **params)`` in the scheduler; its ``Reply``.

        ``params`` must be flat scalars (SGLang's ``RpcReqInput`` contract).
        Raises ``ChannelError`` (504) after ``timeout`` seconds without an answer.
        """
        from sglang.srt.managers.io_struct import RpcReqInput, RpcReqOutput, async_sock_recv, async_sock_send

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            sock = self._ensure_socket()
            rid = f"kvshare-{uuid.uuid4().hex}"
            await async_sock_send(sock, RpcReqInput(method=ops.RPC_METHOD, parameters={"op": op, **params},
                                                    rid=rid))
            deadline = time.monotonic() + self.timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(timeout=int(left * 1000)):
                    raise ChannelError(f"the scheduler did not answer the kvshare {op!r} call within "
                                       f"{self.timeout:.0f}s; it may still apply it", status=504)
                out = await async_sock_recv(sock)
                if not isinstance(out, RpcReqOutput):
                    logger.warning("sglang-kvshare: unexpected message on the RPC socket: %r", type(out))
                    continue
                try:
                    reply = ops.Reply.from_json(out.message)
                except (ValueError, KeyError, TypeError):
                    # Not ours (another RPC's answer) or an error SGLang raised itself.
                    if getattr(out, "rid", None) == rid:
                        return ops.Reply(500 if not out.success else 200, out.message)
                    continue
                if reply.rid == rid:
                    return reply
                logger.warning("sglang-kvshare: dropping a late answer (%s) on the RPC socket", reply.rid)

    async def fan_out(self, op: str, **params: Any) -> list[dict]:
        """Run the op on every DP rank; the replies (``Reply`` as a dict plus ``dp_rank``) of the ranks
        that answered with one within ``timeout`` (``aggregate.merge_replies`` names the others)."""
        from sglang.srt.managers.io_struct import GetInternalStateReq

        call_id = uuid.uuid4().hex
        outputs, timed_out = await self._gather(GetInternalStateReq(rid=ops.fanout_rid(op, params, call_id)))
        replies = []
        for out in outputs:
            reply = (getattr(out, "internal_state", None) or {}).get(ops.REPLY_KEY)
            if isinstance(reply, dict) and reply.get("rid") == call_id:  # not a late answer to an earlier call
                replies.append(reply)
        if timed_out:
            logger.warning("sglang-kvshare: the kvshare %r call timed out after %gs on data-parallel rank(s) %s",
                           op, self.timeout, self._missing({int(r.get("dp_rank", 0)) for r in replies}))
        return replies

    async def _gather(self, req: Any) -> tuple[list, bool]:
        """SGLang's fan-out of ``req`` to every DP rank, within ``timeout``: (what arrived, whether it timed out).

        SGLang's communicator waits for every rank and holds its queue while it does. At the deadline this
        takes what has arrived so far (the communicator's own list of the call in flight) and cancels the wait,
        which frees the queue for the next caller; a rank's late answer is then dropped or, on a fan-out, told
        apart by its call id.
        """
        tm = self.tokenizer_manager
        tm.auto_create_handle_loop()
        communicator = tm.get_internal_state_communicator
        task = asyncio.ensure_future(communicator(req))
        done, _ = await asyncio.wait({task}, timeout=self.timeout)
        if task in done:
            return list(task.result()), False
        arrived = list(getattr(communicator, "_result_values", None) or [])
        task.cancel()
        await asyncio.wait({task})  # the communicator's queue is free again before this returns
        return arrived, True

    def _missing(self, answered: set[int]) -> list[int]:
        """The data-parallel ranks (of ``--dp-size``) not in ``answered``."""
        dp_size = int(getattr(getattr(self.tokenizer_manager, "server_args", None), "dp_size", 1) or 1)
        return sorted(set(range(max(dp_size, 1))) - answered)

    def _ensure_socket(self):
        if self._socket is None:
            import zmq
            import zmq.asyncio

            from sglang.srt.utils.network import get_zmq_socket

            self._socket = get_zmq_socket(zmq.asyncio.Context.instance(), zmq.DEALER, self.rpc_endpoint, True)
        return self._socket
