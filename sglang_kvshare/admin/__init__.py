"""Admin routes and metrics: see and steer the anchor pools of a running server.

Layout (HTTP process on the left, scheduler process on the right)::

    routes.py  --read-->  channel.py --GetInternalStateReq--> scheduler_hooks.py --> ops.snapshot(cache)
               --write->             --RpcReqInput-------->                     --> ops.execute(cache)
    SGLang /metrics  <--PROMETHEUS_MULTIPROC_DIR files--  metrics.py (refreshed by scheduler_hooks)

``ops`` and ``metrics`` import nothing from SGLang; ``routes``, ``channel`` and
``scheduler_hooks`` hold every SGLang symbol the admin layer uses.
"""

from __future__ import annotations

import multiprocessing
import sys

__all__ = ["register"]

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"


def register() -> None:
    """Register the hooks this process needs (called from ``plugin.load_plugin``).

    SGLang runs ``load_plugins`` in every process. The scheduler hooks go where
    SGLang's scheduler module is already loaded (the scheduler process loads
    plugins from inside it), so the detokenizer never imports it; the route
    hook goes in the main process, the one that serves HTTP.
    """
    if SCHEDULER_MODULE in sys.modules:
        from sglang_kvshare.admin import scheduler_hooks

        scheduler_hooks.register()
    if multiprocessing.parent_process() is None:
        from sglang_kvshare.admin import routes

        routes.register()
