"""Workflow affinity under data parallelism: the requests of one reuse scope go to one DP worker.

Why: each DP worker has its own tree, KV pool and anchor pools. SGLang's DP
balancing (round robin, or by load) spreads a workflow's agents over the
workers by design, so each worker sees a share of the shared text and reuse
falls toward 1/N of what one worker gets. A request may name its worker
(``routed_dp_rank``); this module names it from what the client already
sends, so no client has to know the ranks.

The key is the reuse scope's own name: the annotation's ``workflow`` (with
``--kvshare-reuse-scope workflow``, the default; on the chat API the
``kvshare`` field's workflow, else the request's ``user``), or the request's
``cache_salt`` (with ``--kvshare-reuse-scope salt`` or ``salt-required``). A request without one,
or one that names its rank itself, keeps SGLang's balancing. The rank is a
stable digest of the key modulo the workers (the same in every process and
after a restart), so one workflow's requests always meet on one worker; many
workflows spread over all of them. The trade-off (a busy workflow cannot use
a second worker; a worker that leaves moves the workflows mapped to it) is in
docs/SCALING.md.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from sglang_kvshare.config import live_config
from sglang_kvshare.protocol import CUSTOM_PARAMS_KEY


def scope_key(obj: Any, reuse_scope: str) -> Optional[str]:
    """The name of the request's reuse scope that picks its worker, or None (no affinity)."""
    if reuse_scope in ("salt", "salt-required"):
        salt = getattr(obj, "cache_salt", None)
        return f"salt:{salt}" if isinstance(salt, str) and salt else None
    sampling = getattr(obj, "sampling_params", None)
    custom = sampling.get("custom_params") if isinstance(sampling, dict) else None
    raw = custom.get(CUSTOM_PARAMS_KEY) if isinstance(custom, dict) else None
    try:
        ann = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return None  # the validation hook answers a malformed annotation with a 400
    workflow = ann.get("workflow") if isinstance(ann, dict) else None
    return f"workflow:{workflow}" if isinstance(workflow, str) and workflow else None


def rank_of(key: str, ranks: int) -> int:
    """The worker of ``key`` among ``ranks`` (a stable digest, not Python's per-process ``hash``)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % ranks


def dp_ranks(manager: Any) -> int:
    """How many DP workers the tokenizer manager routes to (1 without data parallelism)."""
    count = getattr(manager, "elastic_worker_count", None)
    if not isinstance(count, int):
        count = getattr(getattr(manager, "server_args", None), "dp_size", 1)
    return count if isinstance(count, int) and count > 0 else 1


def route(obj: Any, manager: Any) -> Optional[int]:
    """Name the DP worker of an annotated single request from its scope; returns the rank set, or None.

    Mutates ``obj.routed_dp_rank`` only when there are several workers, the
    request named none, and it has a scope key. Batches keep SGLang's routing
    (one rank field for many requests of possibly different scopes).
    """
    ranks = dp_ranks(manager)
    if ranks <= 1 or getattr(obj, "routed_dp_rank", 0) is not None or _is_batch(obj):
        return None
    config = live_config()
    if config.mode == "off":
        return None
    key = scope_key(obj, config.reuse_scope)
    if key is None:
        return None
    obj.routed_dp_rank = rank_of(key, ranks)
    return obj.routed_dp_rank


def _is_batch(obj: Any) -> bool:
    """Several prompts in one request (read before SGLang normalizes it: a list of texts or of id lists)."""
    text, ids = getattr(obj, "text", None), getattr(obj, "input_ids", None)
    return isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
