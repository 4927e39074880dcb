"""Scheduler-side ends of the admin channel: the hook functions.

``server/sglang_targets.py`` names their targets; ``server/plugin.py``
installs them when SGLang builds the kvshare cache.

Why these hooks: SGLang already carries two request/response channels
between the HTTP process and the scheduler, and the admin routes ride on them
rather than opening a third:

* reads of config and stats: ``GetInternalStateReq`` (``TokenizerManager.get_internal_state``,
  fanned out to every DP rank by SGLang). An AFTER hook on the scheduler's
  ``SchedulerInternalStateController.get_internal_state`` adds
  ``internal_state["kvshare"] = ops.snapshot(view)`` (no pools: SGLang
  serves that state publicly in ``/get_server_info``).
* writes and pool reads: ``RpcReqInput`` on the scheduler's RPC socket. An AROUND hook on
  ``Scheduler.handle_rpc_request`` answers ``method == "kvshare_admin"``
  itself (``ops.execute``; every other method goes to SGLang unchanged) and
  puts the ``ops.Reply`` JSON, tagged with the request's ``rid``, into
  ``RpcReqOutput.message``. It runs on the scheduler thread between batches,
  so a config change is atomic with respect to requests.
* the same writes with ``--dp-size > 1``: the RPC socket reaches one rank
  only, so the op rides in the ``rid`` of a ``GetInternalStateReq``
  (``ops.fanout_rid``), which SGLang sends to every DP rank (and every TP rank
  of it, like any request); the read hook runs it and adds the reply under
  ``internal_state["kvshare_reply"]`` with the rank's number.

Metrics (``--enable-metrics``): AFTER hooks on the prefill report and on
``Scheduler.on_idle`` refresh ``KVShareMetrics`` at most once a second; reads
and writes refresh it at once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

from sglang_kvshare.admin import ops

logger = logging.getLogger(__name__)

METRICS_INTERVAL_S = 1.0

_metrics: Any = None  # KVShareMetrics of this process, or False where metrics are off
_last_refresh = 0.0


# ------------------------------------------------------------ metrics
def _metrics_for(scheduler: Any) -> Any:
    """This process's exporter, created on first use; None when metrics are off here."""
    global _metrics
    if _metrics is None:
        reporter = getattr(scheduler, "metrics_reporter", None)
        enabled = bool(getattr(reporter, "enable_metrics", False)) and bool(
            getattr(reporter, "is_stats_logging_rank", True))
        if enabled and ops.admin_view(getattr(scheduler, "tree_cache", None)) is not None:
            from sglang_kvshare.admin.metrics import KVShareMetrics

            _metrics = KVShareMetrics(dp_rank=dp_rank_of(scheduler))
        else:
            _metrics = False
    return _metrics or None


def refresh_metrics(scheduler: Any, *, force: bool = False, stats: Optional[dict] = None) -> None:
    """Push the cache's counters to Prometheus (throttled unless ``force``); never raises."""
    global _last_refresh
    try:
        metrics = _metrics_for(scheduler)
        if metrics is None:
            return
        now = time.monotonic()
        if not force and now - _last_refresh < METRICS_INTERVAL_S:
            return
        _last_refresh = now
        view = ops.admin_view(scheduler.tree_cache)
        metrics.update(stats if stats is not None else view.stats(), view.config)
    except Exception:  # noqa: BLE001 - metrics must never stop the scheduler
        logger.exception("sglang-kvshare: refreshing metrics failed")


def after_on_idle(result, scheduler, *args, **kwargs):
    refresh_metrics(scheduler)
    return result


def after_prefill_report(result, reporter, *args, **kwargs):
    refresh_metrics(reporter.scheduler)
    return result


# ------------------------------------------------------------ reads
def dp_rank_of(scheduler: Any) -> int:
    """This scheduler's data-parallel rank (0 without data parallelism): SGLang's runtime context
    holds it (``get_parallel().dp_rank``), unless the scheduler carries its own."""
    rank = getattr(scheduler, "dp_rank", None)
    if rank is None:
        try:
            from sglang.srt.runtime_context import get_parallel

            rank = get_parallel().dp_rank
        except Exception:  # noqa: BLE001 - no context published: one rank
            rank = None
    return int(rank or 0)


def after_get_internal_state(result, controller, recv_req=None, *args, **kwargs):
    """AFTER hook: ``internal_state["kvshare"]`` = config and stats of the cache (and this rank's number);
    for a fan-out write (``ops.parse_fanout_rid``), first the op's reply under ``"kvshare_reply"``."""
    scheduler = controller.scheduler
    view = ops.admin_view(getattr(scheduler, "tree_cache", None))
    state = getattr(result, "internal_state", None)
    if not isinstance(state, dict) or view is None:
        return result
    fanout = ops.parse_fanout_rid(getattr(recv_req, "rid", None))
    if fanout is not None:
        op, params, call_id = fanout
        reply = run_op(scheduler, view, op, params)
        reply.rid = call_id
        state[ops.REPLY_KEY] = {**dataclasses.asdict(reply), "dp_rank": dp_rank_of(scheduler)}
    try:
        snap = ops.snapshot(view)
    except Exception as exc:  # noqa: BLE001 - a read must not break /get_server_info
        logger.exception("sglang-kvshare: reading the cache state failed")
        snap = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        refresh_metrics(scheduler, force=True, stats=snap["stats"])
    snap["dp_rank"] = dp_rank_of(scheduler)
    call = ops.read_call(getattr(recv_req, "rid", None))
    if call is not None:
        snap[ops.CALL_KEY] = call  # the read this answers: a late answer is told apart from the current one
    snap["tp_ranks"] = tp_ranks(scheduler, view)
    state[ops.STATE_KEY] = snap
    return result


def tp_ranks(scheduler: Any, view: Any) -> Optional[list[dict]]:
    """Each tensor-parallel rank's gate summary (``AdminView.gate_summary``), gathered over SGLang's TP CPU
    group; None without tensor parallelism.

    Safe as a collective: SGLang hands every request, this read included, to every TP rank, which all run
    this hook (as its own RPC handler's barrier relies on).
    """
    size = int(getattr(scheduler, "tp_size", 1) or 1)
    if size <= 1:
        return None
    import torch.distributed as dist

    local: dict = {"tp_rank": dist.get_rank(group=scheduler.tp_cpu_group)}
    try:
        local.update(view.gate_summary())
    except Exception as exc:  # noqa: BLE001 - every rank must still reach the gather
        local["error"] = f"{type(exc).__name__}: {exc}"
    gathered: list = [None] * size
    dist.all_gather_object(gathered, local, group=scheduler.tp_cpu_group)
    return gathered


def run_op(scheduler: Any, view: Any, op: str, params: dict) -> ops.Reply:
    """``ops.execute`` for either channel; never raises (a failure becomes a 4xx/5xx reply)."""
    try:
        reply = ops.execute(view, op, **params)
    except TypeError as exc:  # unexpected parameter names
        reply = ops.Reply(400, f"bad kvshare admin parameters: {exc}")
    except Exception as exc:  # noqa: BLE001 - answer instead of leaving the caller waiting
        logger.exception("sglang-kvshare: admin op %r failed", op)
        reply = ops.Reply(500, f"{type(exc).__name__}: {exc}")
    if reply.ok and op != "pools":  # a read changes nothing: no log line, no forced refresh
        logger.info("sglang-kvshare: admin %s: %s", op, reply.message)
        refresh_metrics(scheduler, force=True)
    return reply


# ------------------------------------------------------------ writes
def around_handle_rpc_request(original, scheduler, recv_req, *args, **kwargs):
    """AROUND hook: serve ``RpcReqInput(method="kvshare_admin")``; pass everything else on."""
    if getattr(recv_req, "method", None) != ops.RPC_METHOD:
        return original(scheduler, recv_req, *args, **kwargs)
    from torch.distributed import barrier

    from sglang.srt.managers.io_struct import RpcReqOutput

    params = dict(recv_req.parameters or {})
    op = str(params.pop("op", ""))
    reply = run_op(scheduler, ops.admin_view(scheduler.tree_cache), op, params)
    reply.rid = recv_req.rid
    # Same collective as SGLang's own handler: every TP rank runs the RPC.
    barrier(group=scheduler.tp_group.cpu_group)
    return RpcReqOutput(success=reply.ok, message=reply.to_json(), rid=recv_req.rid)
