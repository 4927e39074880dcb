"""Builds the kvshare tree cache from SGLang's ``TreeCacheBuildContext``.

Why a factory apart from the cache class: it holds the launch-time checks, so
that a setup kvshare cannot serve correctly is refused with a message that
says what to change, before any request sees wrong KV.
"""

from __future__ import annotations

import logging

from sglang_kvshare.config import KVShareConfig

logger = logging.getLogger(__name__)


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


def build_kvshare_cache(ctx):
    from sglang_kvshare.cache.adapter import KVShareRadixCache

    config = KVShareConfig.from_env()
    check_setup(ctx, config)
    from sglang_kvshare import staged_prefill

    staged_prefill.register()  # inert for requests the cache gives no stage end
    cache = KVShareRadixCache(ctx.params, config=config, model_config=ctx.model_config, tp_size=ctx.tp_size)
    if config.learn_on_idle and config.learn_async:
        from sglang_kvshare import idle_learning

        # Runs the learner's steps while the scheduler is fully idle (and in front of decode batches).
        idle_learning.register(before_decode=config.learn_before_decode)
        cache.learner.use_idle_steps()
    logger.info("sglang-kvshare: KVShareRadixCache live (mode=%s%s)", config.mode,
                f", disabled: {cache.unsupported_reason}" if cache.unsupported_reason else "")
    return cache
