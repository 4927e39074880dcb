"""The launch-time checks: a setup kvshare cannot serve correctly is refused before any request.

Run when SGLang builds the cache (``server.plugin.build_cache``) and again on
every runtime mode switch (``POST /kvshare/config``), each with a message that
says what to change.
"""

from __future__ import annotations

from sglang_kvshare.config import KVShareConfig


class UnsupportedSetupError(ValueError):
    """The server was launched with options kvshare cannot honour."""


def check_mode(mode: str, *, page_size: int, tp_size: int) -> None:
    """Raise ``UnsupportedSetupError`` when ``mode`` cannot serve correctly with these launch facts.

    Runs at launch and again on every runtime mode switch (``POST /kvshare/config``).
    """
    if mode == "off":
        return
    if page_size != 1:
        raise UnsupportedSetupError(
            f"--kvshare-mode {mode} needs --page-size 1 (got {page_size}): assembled "
            "segments start at arbitrary token offsets. Use --page-size 1 or --kvshare-mode off.")
    if tp_size > 1 and mode != "fullshared":
        raise UnsupportedSetupError(
            f"--kvshare-mode {mode} with --tp-size {tp_size} is not supported yet: every rank "
            "must take the same gate decision. Use --tp-size 1, or --kvshare-mode fullshared (no gate).")


def check_setup(ctx, config: KVShareConfig) -> None:
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise UnsupportedSetupError(
            "--radix-cache-backend kvshare supports full-attention models without hierarchical "
            "cache; drop the backend flag for hybrid SWA/SSM models or --enable-hierarchical-cache.")
    check_mode(config.mode, page_size=ctx.params.page_size, tp_size=ctx.tp_size)


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
