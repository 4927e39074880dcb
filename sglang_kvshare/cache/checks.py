"""The launch-time checks: a setup kvshare cannot serve correctly is refused before any request.

Run when SGLang builds the cache (``server.plugin.build_cache``) and again on
every runtime mode switch (``POST /kvshare/config``), each with a message that
says what to change.
"""

from __future__ import annotations

from sglang_kvshare.config import KVShareConfig


class UnsupportedSetupError(ValueError):
    """The server was launched with options kvshare cannot honour."""


def check_mode(mode: str, *, page_size: int) -> None:
    """Raise ``UnsupportedSetupError`` when ``mode`` cannot serve correctly with these launch facts.

    Runs at launch and again on every runtime mode switch (``POST /kvshare/config``).
    Any tensor-parallel size serves every mode: kvcmas takes each gate decision
    once for all ranks (``correction.rank_reduce``).
    """
    if mode == "off":
        return
    if page_size != 1:
        raise UnsupportedSetupError(
            f"--kvshare-mode {mode} needs --page-size 1 (got {page_size}): assembled "
            "segments start at arbitrary token offsets. Use --page-size 1, or serve without reuse: "
            "--kvshare-mode off with python -m sglang_kvshare.launch_server, or leave out --radix-cache-backend "
            "kvshare with python -m sglang.launch_server.")


def check_setup(ctx, config: KVShareConfig) -> None:
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise UnsupportedSetupError(
            "--radix-cache-backend kvshare supports full-attention models without hierarchical "
            "cache; drop the backend flag for hybrid SWA/SSM models or --enable-hierarchical-cache.")
    check_mode(config.mode, page_size=ctx.params.page_size)


def tensor_parallel_config(config: KVShareConfig, tp_size: int) -> KVShareConfig:
    """``config`` as tensor parallelism needs it: learning in step on every rank.

    Why: each rank learns the anchors of its own heads from the same dense
    prefills, and the gate reduces over the ranks' pools, which must hold the
    same anchors at every decision. A background learner commits when its
    thread gets to it (at another moment on each rank), and a per-slot
    interval depends on each rank's clock; learning inside the scheduler's
    step (``learn_async false``), without the interval, happens at the same
    point of the same request on every rank. The price: each observation's
    factorization runs in the scheduler loop (docs/SCALING.md). For the same reason no rank saves its
    pool file on its own idle time (``pool_save_interval_s``): ``POST /kvshare/save`` reaches every rank
    at the same point.
    """
    if tp_size <= 1 or (not config.learn_async and config.learn_slot_interval_s == 0
                        and config.pool_save_interval_s == 0):
        return config
    return config.replace(learn_async=False, learn_slot_interval_s=0.0, pool_save_interval_s=0.0)


# The share of the device memory left free after SGLang allocated its KV pool that kvshare may fill
# (anchors and queued learning copies); the rest stays for the forward's activations.
DEVICE_MEMORY_SHARE = 0.5


def fit_memory_budget(config: KVShareConfig, free_bytes: int, share: float = DEVICE_MEMORY_SHARE) -> KVShareConfig:
    """``config`` with its anchor and learning-queue budgets scaled down to ``share`` of ``free_bytes``.

    Why: on a GPU these live beside SGLang's KV pool, outside
    ``--mem-fraction-static``; budgets larger than what the device has left
    would end in an out-of-memory error in the middle of serving instead of an
    eviction. Returns ``config`` itself when it fits.
    """
    allowed_mb = share * free_bytes / 2**20
    wanted_mb = config.pool_budget_mb + config.learn_queue_mb
    if wanted_mb <= allowed_mb:
        return config
    scale = max(allowed_mb, 1.0) / wanted_mb
    return config.replace(pool_budget_mb=config.pool_budget_mb * scale, learn_queue_mb=config.learn_queue_mb * scale)
