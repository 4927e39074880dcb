"""Admin routes and metrics: see and steer the anchor pools of a running server.

Layout (HTTP process on the left, scheduler process on the right)::

    routes.py  --read-->  channel.py --GetInternalStateReq--> scheduler_hooks.py --> ops.snapshot(cache)
               --write->             --RpcReqInput-------->                     --> ops.execute(cache)
    SGLang /metrics  <--PROMETHEUS_MULTIPROC_DIR files--  metrics.py (refreshed by scheduler_hooks)

``ops`` and ``metrics`` import nothing from SGLang. The hooks are installed by
``sglang_kvshare.server.plugin`` (targets in ``server/sglang_targets.py``).
"""
