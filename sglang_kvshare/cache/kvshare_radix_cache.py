"""The kvshare tree cache: SGLang's Python ``RadixCache`` plus placeholder reuse.

At this stage it behaves exactly like ``RadixCache``; the placeholder logic
(assembly of shared segments on a prefix miss, learning from dense prefills)
hooks into ``match_prefix`` and ``checkpoint`` below.
"""

from __future__ import annotations

from typing import Any, Optional

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache

from sglang_kvshare.config import KVShareConfig


class KVShareRadixCache(RadixCache):
    """A ``RadixCache`` that knows the kvshare config; see the module docstring."""

    def __init__(self, params: CacheInitParams, *, config: KVShareConfig,
                 model_config: Optional[Any] = None) -> None:
        self.kvshare_config = config
        self.model_config = model_config
        super().__init__(params)
