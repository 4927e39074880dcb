"""What one cache's pipeline steps and admin view share, in one bundle the adapter builds.

Why a bundle: the recorder, the resolver and the admin view each read a few
of the same objects; passing them as one frozen value keeps every
constructor to one argument and makes plain what a step may touch (none of it
is the adapter itself, so no step can call back into it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_kvshare.cache.correction_state import CorrectionState
from sglang_kvshare.cache.kv_pool_io import ReadWorkspace
from sglang_kvshare.cache.registry import ContentHasher, PlaceholderRegistry
from sglang_kvshare.counters import Counters
from sglang_kvshare.learning.learner import Learner


@dataclass(frozen=True)
class CacheParts:
    """``tree`` is SGLang's ``RadixCache`` (its tree walks, locks, KV pool, allocator and request table)."""

    tree: Any
    state: CorrectionState  # the config and estimator in force
    registry: PlaceholderRegistry  # where each content's copies live
    learner: Learner
    counters: Counters
    hasher: ContentHasher
    reads: ReadWorkspace  # the gate's reused read buffers (scheduler thread only)
