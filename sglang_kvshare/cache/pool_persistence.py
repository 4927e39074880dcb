"""The cache's side of ``--kvshare-pool-file``: which file this scheduler uses, loading it at launch, saving it
(on ``POST /kvshare/save``, and with ``--kvshare-pool-save-interval-s`` on idle time when the pools changed).

Why here and not in ``correction.pool_file``: the file must name this
scheduler's model (its weights, found in the hub's cache for a hub id), rank,
KV layout and KV device, which only SGLang's build context knows
(``server/plugin.py`` builds a ``PoolStore`` from it, the cache adds the model
and its KV pool), and loading must also hand the file's key to the cache's
content hasher. The format and the checks live in ``correction.pool_file``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from sglang_kvshare.cache.kv_pool_io import pool_layers
from sglang_kvshare.correction.pool_file import (PoolFileError, kv_layout, load_pools, model_identity, rank_path,
                                                 save_pools)

logger = logging.getLogger(__name__)

__all__ = ["PoolStore", "PoolSaver", "PoolFileError", "NoPools"]


class NoPools(RuntimeError):
    """Nothing to save: the server has no pool file, or the mode in force keeps no pools."""


def _pooled(state: Any) -> Any:
    """The estimator in force when it keeps anchor pools (kvcmas), else None."""
    estimator = state.estimator
    return estimator if estimator is not None and getattr(estimator, "learns", False) else None


@dataclass(frozen=True)
class PoolStore:
    """The pool file of one scheduler: ``path`` (already per rank), the ``rank`` it belongs to, the ``device``
    loaded tensors go to, and the model's ``identity`` (``pool_file.model_identity``; the cache fills it in
    once it has read the model's RoPE: ``with_model``)."""

    path: Path
    rank: dict
    device: str = "cpu"
    identity: dict = field(default_factory=dict)

    @classmethod
    def for_rank(cls, path: str, *, tp_rank: int = 0, tp_size: int = 1, dp_rank: int = 0, dp_size: int = 1,
                 device: str = "cpu") -> "PoolStore":
        return cls(rank_path(path, tp_rank, tp_size, dp_rank, dp_size),
                   {"tp": [int(tp_rank), int(tp_size)], "dp": [int(dp_rank), int(dp_size)]}, str(device))

    def with_model(self, hf_config: Any, model_path: str | None, spec: Any, kvcache: Any) -> "PoolStore":
        """The store for the model at ``model_path`` (a directory, or a hub id with its weights in the hub's
        cache) whose KV this rank keeps in ``kvcache`` (SGLang's KV pool: its layers, heads and dtype)."""
        layers = pool_layers(kvcache)
        k, v = kvcache.get_key_buffer(layers[0]), kvcache.get_value_buffer(layers[0])
        kv = kv_layout(len(layers), tuple(k.shape[-2:]), tuple(v.shape[-2:]), k.dtype)
        return replace(self, identity=model_identity(hf_config, local_weights(model_path, hf_config), spec, kv))

    def load(self, state: Any, hasher: Any, counters: Any) -> dict | None:
        """Fill ``state``'s (empty, just built) estimator from the file and make ``hasher`` adopt its key.

        Returns the load's summary, or None when there is nothing to load (no file yet, or a mode without
        pools). Raises ``PoolFileError`` for a file this server cannot use: the launch fails, saying why.
        """
        estimator = _pooled(state)
        if estimator is None:
            logger.info("sglang-kvshare: --kvshare-pool-file ignored: mode %s keeps no anchor pools",
                        state.config.mode)
            return None
        if not self.path.exists():
            logger.info("sglang-kvshare: no pool file at %s yet; pools start empty (POST /kvshare/save writes it)",
                        self.path)
            return None
        import torch

        # NOTE: as the learner's anchors (server/idle_learning.py): not inference tensors, whatever mode the
        # scheduler builds its cache in.
        with state.lock, torch.inference_mode(False), torch.no_grad():
            secret, summary = load_pools(self.path, estimator, identity=self.identity, rank=self.rank,
                                         device=self.device)
        hasher.adopt(secret)
        counters.add("pool_file_anchors_loaded", summary["anchors"])
        logger.info("sglang-kvshare: loaded %d anchors of %d slots from %s (%d beyond the bounds dropped)",
                    summary["anchors"], summary["slots"], self.path, summary["dropped"])
        return summary

    def save(self, state: Any, hasher: Any) -> dict:
        """Write the pools in force to the file. Raises ``NoPools`` when the mode keeps none, ``OSError`` when
        the file cannot be written (the old file, if any, is left as it was)."""
        estimator = _pooled(state)
        if estimator is None:
            raise NoPools(f"mode {state.config.mode} keeps no anchor pools (kvcmas does)")
        with state.lock:
            return save_pools(self.path, estimator, secret=hasher.secret, identity=self.identity, rank=self.rank)


def local_weights(model_path: str | None, hf_config: Any = None) -> str | None:
    """The directory holding the weights of ``model_path``: the path itself, or for a hub id (``org/name``) its
    snapshot in the hub's local cache (the revision the config was read from), where SGLang loaded the weights
    from; else ``model_path`` as it is (the identity then names the whole hub id)."""
    if not model_path or Path(model_path).is_dir():
        return model_path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_path, revision=getattr(hf_config, "_commit_hash", None), local_files_only=True)
    except Exception:  # noqa: BLE001 - not a hub id, or not in the cache: the identity keeps the id itself
        return model_path


class PoolSaver:
    """Loads and saves one scheduler's pools through its ``PoolStore``, and knows whether they changed since.

    ``interval_s`` > 0: ``maybe_save`` (the scheduler's idle hook calls it) writes the file when that many
    seconds passed since the last save or load and the estimator changed meanwhile (``AnchorEstimator.changes``:
    commits, resets, a new estimator after a mode switch). Why on idle time: a save holds the scheduler while
    the file is written, and an idle scheduler delays no request. Not thread-safe: the scheduler thread only.
    """

    def __init__(self, store: PoolStore, interval_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.interval_s = float(interval_s)
        self._clock = clock
        self._saved_at = clock()
        self._saved: Optional[tuple[int, int]] = None  # (id of the estimator, its changes) at the last save or load

    def load(self, state: Any, hasher: Any, counters: Any) -> dict | None:
        summary = self.store.load(state, hasher, counters)
        self._mark(state)
        return summary

    def save(self, state: Any, hasher: Any) -> dict:
        written = self.store.save(state, hasher)
        self._mark(state)
        return written

    def due(self, state: Any) -> bool:
        """The interval passed and the pools changed since the last save or load."""
        if self.interval_s <= 0 or self._clock() - self._saved_at < self.interval_s:
            return False
        estimator = _pooled(state)
        return estimator is not None and self._saved != (id(estimator), estimator.changes)

    def maybe_save(self, state: Any, hasher: Any, counters: Any) -> Optional[dict]:
        """Save when ``due``; returns what was written, or None. A failed write is logged and counted
        (``pool_file_save_errors``) and tried again after the interval; it never raises into the scheduler."""
        if not self.due(state):
            return None
        try:
            written = self.save(state, hasher)
        except Exception as exc:  # noqa: BLE001 - a save on idle time must never stop the scheduler
            self._saved_at = self._clock()
            counters.add("pool_file_save_errors")
            logger.warning("sglang-kvshare: saving the pools to %s failed: %s", self.store.path, exc)
            return None
        counters.add("pool_file_autosaves")
        return written

    def _mark(self, state: Any) -> None:
        self._saved_at = self._clock()
        estimator = state.estimator
        self._saved = None if estimator is None else (id(estimator), getattr(estimator, "changes", 0))
