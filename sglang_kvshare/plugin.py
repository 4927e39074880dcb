"""SGLang plugin entry point (group ``sglang.srt.plugins``).

SGLang calls ``load_plugin`` in each of its processes (HTTP, scheduler,
detokenizer). It registers the ``kvshare`` tree-cache backend, so that
``--radix-cache-backend kvshare`` selects our cache, and a hook that rejects
malformed request annotations with an HTTP 400 (``request_validation``), the
kvshare layer of ``/v1/chat/completions`` (``chat_hooks``), and the
``/kvshare/`` admin routes and metrics (``admin``). It is cheap and idempotent:
the cache module is imported only when SGLang builds the cache.
"""

from __future__ import annotations

import logging

from sglang_kvshare.config import BACKEND_NAME

logger = logging.getLogger(__name__)


def _build_cache(ctx):
    """Factory called by SGLang's ``create_tree_cache`` in the scheduler process."""
    from sglang_kvshare.cache.factory import build_kvshare_cache

    return build_kvshare_cache(ctx)


def load_plugin() -> None:
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    if BACKEND_NAME in registered_radix_cache_backends():
        return
    register_radix_cache_backend(BACKEND_NAME, _build_cache)
    from sglang_kvshare import request_validation

    request_validation.register()
    from sglang_kvshare import chat_hooks

    chat_hooks.register()
    from sglang_kvshare import admin

    admin.register()
    logger.info("sglang-kvshare: registered radix cache backend %r", BACKEND_NAME)
