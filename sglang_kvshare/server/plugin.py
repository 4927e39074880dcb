"""SGLang plugin entry point (group ``sglang.srt.plugins``) and the one place hooks are installed.

SGLang calls ``load_plugin`` in each of its processes (HTTP, scheduler,
detokenizer, DP controller), on every server in the environment. So it does
the least it can there: it registers the ``kvshare`` tree-cache backend (a
name in SGLang's registry; a server selects it with
``--radix-cache-backend kvshare``) and nothing else, unless this process
serves HTTP for a kvshare server. A plain ``sglang.launch_server`` therefore
runs exactly as stock SGLang: no hook, no route, no changed response.

* HTTP process: ``sglang_targets.HTTP_HOOKS`` (request validation, the chat
  layer, the route mount) go in when ``kvshare_requested``: our launcher set
  the config, or the command line selects the backend.
* Scheduler process: SGLang builds the cache through ``build_cache`` only when
  the backend is selected; that is where ``sglang_targets.SCHEDULER_HOOKS``
  (admin channel, metrics, staged prefill, idle learning) go in.

Before installing anything, every target is resolved against the installed
SGLang (``sglang_targets.check_targets``): a mismatch stops the server with
the names that differ instead of silently turning a feature off.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from typing import Any, Mapping, Optional, Sequence

from sglang_kvshare.config import BACKEND_NAME, ENV_VAR, KVShareConfig
from sglang_kvshare.server import sglang_targets
from sglang_kvshare.server.sglang_targets import Hook

logger = logging.getLogger(__name__)

BACKEND_FLAG = "--radix-cache-backend"

_installed: set[Hook] = set()  # hooks this process registered (install is idempotent per hook)


def kvshare_requested(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether this process starts a kvshare server: our launcher's config, or the backend flag."""
    if environ.get(ENV_VAR):
        return True
    for i, arg in enumerate(argv):
        if arg == f"{BACKEND_FLAG}={BACKEND_NAME}" or (arg == BACKEND_FLAG and i + 1 < len(argv)
                                                        and argv[i + 1] == BACKEND_NAME):
            return True
    return False


def install(hooks: Sequence[Hook]) -> None:
    """Check every target, then register and apply ``hooks`` (idempotent per hook).

    Raises ``IncompatibleSGLangError`` when a target does not match the
    installed SGLang, and ``RuntimeError`` when another plugin already applied
    hooks to a target (SGLang patches a target once, so ours would be lost).
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    todo = [h for h in hooks if h not in _installed]
    if not todo:
        return
    sglang_targets.check_targets(h.target for h in todo)
    taken = sorted({h.target.path for h in todo} & HookRegistry._patched)
    if taken:
        raise RuntimeError(f"sglang-kvshare: another plugin already patched {taken}; kvshare's hooks there "
                           "would not run. Load kvshare first (SGLANG_PLUGINS) or drop the other plugin.")
    for hook in todo:
        HookRegistry.register(hook.target.path, sglang_targets.resolve_hook(hook), HookType(hook.kind))
        _installed.add(hook)
    HookRegistry.apply_hooks()
    logger.info("sglang-kvshare: installed %d hooks (%s process)", len(todo), todo[0].process)


def scheduler_hooks(config: KVShareConfig) -> tuple[Hook, ...]:
    """The scheduler hooks ``config`` needs (idle learning, or saving pools on idle time, only when on)."""
    hooks = sglang_targets.SCHEDULER_HOOKS
    idle_learning = config.learn_on_idle and config.learn_async
    if idle_learning or (config.pool_file and config.pool_save_interval_s > 0):
        hooks += (sglang_targets.IDLE_LEARNING_HOOK,)
    if idle_learning and config.learn_before_decode:
        hooks += (sglang_targets.DECODE_LEARNING_HOOK,)
    return hooks


def build_cache(ctx: Any) -> Any:
    """Factory SGLang's ``create_tree_cache`` calls in the scheduler process (backend selected)."""
    from sglang_kvshare.cache.adapter import KVShareRadixCache
    from sglang_kvshare.cache.checks import check_setup, tensor_parallel_config

    launched = _fit_device_memory(KVShareConfig.from_env())
    check_setup(ctx, launched)
    config = tensor_parallel_config(launched, ctx.tp_size)
    if config is not launched:
        logger.warning("sglang-kvshare: --tp-size %d: anchors are learned inside the scheduler step on every rank "
                       "(--kvshare-learn-async false, no slot interval), so all ranks hold the same pools",
                       ctx.tp_size)
    from sglang_kvshare.server.sparse_extend import prefill_backend, unsupported_reason

    sparse_unsupported = unsupported_reason(ctx.model_config)
    hooks = scheduler_hooks(config)
    if sparse_unsupported is None and prefill_backend() == "triton":
        hooks += sglang_targets.TRITON_SPARSE_HOOKS
    install(hooks)
    reducer = tp_gate_reducer(ctx.tp_size)
    cache = KVShareRadixCache(ctx.params, config=config, model_config=ctx.model_config, reducer=reducer,
                              sparse_unsupported=sparse_unsupported, pool_store=pool_store(ctx, config))
    if config.learn_on_idle and config.learn_async:
        cache.learner.use_idle_steps()  # the scheduler's idle hook runs the learner's steps
    logger.info("sglang-kvshare: KVShareRadixCache live (mode=%s%s)", config.mode,
                f", disabled: {cache.state.unsupported_reason}" if cache.state.unsupported_reason else "")
    return cache


def pool_store(ctx: Any, config: KVShareConfig) -> Any:
    """This scheduler's ``--kvshare-pool-file`` (one file per DP and TP rank, on the KV pool's device), or None."""
    if not config.pool_file:
        return None
    from sglang_kvshare.admin.scheduler_hooks import dp_rank_of
    from sglang_kvshare.cache.pool_persistence import PoolStore

    kvcache = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    return PoolStore.for_rank(config.pool_file, tp_rank=int(getattr(ctx, "tp_rank", 0) or 0), tp_size=ctx.tp_size,
                              dp_rank=dp_rank_of(None), dp_size=int(getattr(ctx.server_args, "dp_size", 1) or 1),
                              device=str(getattr(kvcache, "device", "cpu")))


def tp_gate_reducer(tp_size: int) -> Any:
    """kvcmas's gate reducer over SGLang's TP CPU (gloo) group; None without tensor parallelism."""
    if tp_size <= 1:
        return None
    from sglang.srt.distributed.parallel_state import get_tp_group

    from sglang_kvshare.correction import GroupReducer

    return GroupReducer(lambda: get_tp_group().cpu_group, tp_size)


def _fit_device_memory(config: KVShareConfig) -> KVShareConfig:
    """On a GPU, shrink kvshare's memory budgets to what the device has free (``checks.fit_memory_budget``)."""
    import torch

    from sglang_kvshare.cache.checks import fit_memory_budget

    if not torch.cuda.is_available():
        return config
    free, _total = torch.cuda.mem_get_info()
    fitted = fit_memory_budget(config, free)
    if fitted is not config:
        logger.warning("sglang-kvshare: %.0f MiB free on the device: anchor budget %.0f -> %.0f MiB, learning queue "
                       "%.0f -> %.0f MiB (docs/OPERATIONS.md, 'Memory on a GPU')", free / 2**20, config.pool_budget_mb,
                       fitted.pool_budget_mb, config.learn_queue_mb, fitted.learn_queue_mb)
    return fitted


def load_plugin() -> None:
    """Register the backend; in a kvshare server's HTTP process also install the HTTP hooks."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, build_cache)
    if multiprocessing.parent_process() is None and kvshare_requested(sys.argv, os.environ):
        install(sglang_targets.HTTP_HOOKS)
