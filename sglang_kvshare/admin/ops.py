"""The admin operations, run in the scheduler process against the live cache.

Why a module without SGLang imports: the wire format between the HTTP
process (``channel.py``) and the scheduler (``scheduler_hooks.py``) and what
each operation does to the cache are one contract, testable on its own. The
operations run on the cache's admin view (``KVShareRadixCache.kvshare_admin``,
``cache/admin_view.py``), duck-typed: anything with ``config``, ``stats``,
``pools``, ``configure`` and ``reset``.

Wire format: a write travels as SGLang's ``RpcReqInput(method=RPC_METHOD,
parameters={"op": ..., ...})`` and comes back as ``RpcReqOutput`` whose
``message`` is the JSON of a ``Reply``. Config and stats travel inside SGLang's
``GetInternalStateReqOutput.internal_state[STATE_KEY]`` (``snapshot``). The pools
(agent names, anchor details) do not: ``/get_server_info`` serves that internal
state at SGLang's ``NORMAL`` auth level (public when only ``--admin-api-key`` is
set), so they travel as the RPC op ``pools``, behind the admin key like the writes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_kvshare.cache.pool_persistence import NoPools

RPC_METHOD = "kvshare_admin"
STATE_KEY = "kvshare"
REPLY_KEY = "kvshare_reply"
FANOUT_PREFIX = "kvshare-admin:"
READ_PREFIX = "kvshare-read:"  # a read's rid: its snapshots carry the call id back (``CALL_KEY``)
CALL_KEY = "call"
OPS = ("configure", "reset", "pools", "save")


ADMIN_ATTR = "kvshare_admin"


def admin_view(cache: Any) -> Any:
    """The admin view of ``cache`` when it is a kvshare cache, else None (the routes work on nothing else)."""
    view = getattr(cache, ADMIN_ATTR, None)
    if view is None or not all(hasattr(view, name) for name in ("config", "stats", "pools", "configure", "reset")):
        return None
    return view


def _plain(value: Any) -> Any:
    """Builtin types only (dict subclasses, tuples and numpy scalars become JSON types)."""
    return json.loads(json.dumps(value, default=float))


def config_dict(view: Any) -> dict:
    return dataclasses.asdict(view.config)


def snapshot(view: Any) -> dict:
    """What ``GET /kvshare/stats`` serves: ``{"config", "stats"}`` as builtin types.

    NOTE: no pools here; this dict also appears in ``/get_server_info`` (see the
    module docstring). Takes the cache's estimator lock through its methods.
    """
    return _plain({"config": config_dict(view), "stats": view.stats()})


@dataclass
class Reply:
    """Outcome of one write: an HTTP status, a message for people, a result for programs."""

    status: int
    message: str = ""
    result: dict = field(default_factory=dict)
    rid: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.status < 400

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Reply":
        data = json.loads(text)
        return cls(status=int(data["status"]), message=str(data.get("message", "")),
                   result=dict(data.get("result") or {}), rid=data.get("rid"))


def fanout_rid(op: str, params: dict, call_id: str) -> str:
    """The ``rid`` of a ``GetInternalStateReq`` that carries one op to every DP rank.

    Why in the rid: SGLang fans that request out to every data-parallel rank and
    collects one answer from each (its RPC socket reaches one rank only), and
    ``rid`` is the one free text field it carries. ``params`` are flat scalars,
    as on the RPC channel.
    """
    return FANOUT_PREFIX + json.dumps({"op": op, "params": params, "id": call_id}, separators=(",", ":"))


def read_call(rid: Any) -> Optional[str]:
    """The call id of a kvshare read's rid (``READ_PREFIX`` + id); None for any other rid."""
    if isinstance(rid, str) and rid.startswith(READ_PREFIX) and len(rid) <= len(READ_PREFIX) + 64:
        return rid[len(READ_PREFIX):]
    return None


def parse_fanout_rid(rid: Any) -> Optional[tuple[str, dict, str]]:
    """``(op, params, call_id)`` of a fan-out rid; None for any other rid (SGLang's own reads)."""
    if not isinstance(rid, str) or not rid.startswith(FANOUT_PREFIX):
        return None
    try:
        data = json.loads(rid[len(FANOUT_PREFIX):])
        return str(data["op"]), dict(data.get("params") or {}), str(data["id"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def execute(view: Any, op: str, *, slot: Optional[str] = None, **changes: Any) -> Reply:
    """Run one write on the cache's admin view (None: not a kvshare cache); never raises for bad input
    (it becomes a 4xx ``Reply``).

    * ``configure``: ``view.configure(**changes)`` (all or nothing; ``ValueError`` -> 422);
      the result is the new config.
    * ``reset``: empties the anchor pools and materialization records of ``slot``
      (404 when the cache does not know it) or of every slot; the result is the
      pools left.
    * ``pools`` (a read): the anchors of ``slot`` (404 when unknown) or of every
      slot, as ``{"pools": {slot: [anchor, ...]}}``; changes nothing.
    * ``save``: ``view.save_pools()`` writes the pools to the server's pool file (409 when it has
      none or keeps no pools, 500 when the file cannot be written); the result says what was written.
    """
    if view is None:
        return Reply(503, "the kvshare cache is not active in this scheduler "
                          "(start the server with --radix-cache-backend kvshare)")
    if op == "configure":
        try:
            new = view.configure(**changes)
        except (TypeError, ValueError) as exc:
            return Reply(422, str(exc))
        return Reply(200, "config applied", {"config": _plain(dataclasses.asdict(new))})
    if changes:
        return Reply(400, f"kvshare admin op {op!r} takes no {sorted(changes)}")
    if op == "pools":
        try:
            pools = view.pools(slot) if slot is not None else view.pools()
        except KeyError:
            return Reply(404, f"unknown slot {slot!r}; GET /kvshare/pools lists the known slots")
        return Reply(200, "pools", {"pools": _plain(pools)})
    if op == "save":
        if slot is not None:
            return Reply(400, "kvshare admin op 'save' writes every slot's pool; it takes no slot")
        try:
            written = view.save_pools()
        except OSError as exc:
            return Reply(500, f"could not write the pool file: {exc}")
        except NoPools as exc:
            return Reply(409, str(exc))
        return Reply(200, f"saved {written['anchors']} anchors of {written['slots']} slots", {"saved": written})
    if op == "reset":
        if slot is not None:
            try:
                view.pools(slot)
            except KeyError:
                return Reply(404, f"unknown slot {slot!r}; GET /kvshare/pools lists the known slots")
        view.reset(slot)
        return Reply(200, f"reset {'slot ' + repr(slot) if slot is not None else 'all slots'}",
                     {"pools": _plain(view.pools())})
    return Reply(400, f"unknown kvshare admin op {op!r}; expected one of {OPS}")
