"""Anchor pools on disk: what a restarted kvcmas server loads so that it corrects from its first requests.

Why: a slot's edge corrects only once its pool holds ``--kvshare-edge-anchors``
contents for it (docs/research/ALGORITHM_STUDY.md), and every anchor is a dense prefill
the server had to serve first. A restart loses all of them. Saving the pools
(``POST /kvshare/save``) and loading them at launch (``--kvshare-pool-file``)
carries the learned anchors over.

What the file holds: the format name and version, the identity of the model
the anchors were computed on (``model_identity``: architecture numbers, RoPE,
the rank's KV layout and a digest of the weight files), the rank it belongs to,
the content hasher's secret, and per slot (least recently used first) the anchors (oldest first):
their low-rank bases, the gate's Gram summary, the deltas of every edge and
the activation counts. Slots, edges and content keys are keyed digests made
with that secret (``cache.registry.ContentHasher``), so the loading server
adopts the secret: the same agents and contents hash to the same keys again.

Loading goes through ``AnchorEstimator.commit_observation``, so the server's
bounds (pools, anchors per pool, bytes) hold for what is loaded as for what is
learned. A file that does not match (another model, format or rank) raises
``PoolFileError`` saying what differs: the server must not serve corrections
learned on another model. Every tensor's shape and dtype is then checked
against the server's KV layout (layers, heads, head_dim, dtype), and every key
against the types the estimator uses: a forged or damaged file is refused at
launch, on the rank that reads it, before anything is loaded, rather than
failing at a later gate on that rank alone. ``torch.load`` runs with
``weights_only=True``: the file is data, never code.

No SGLang imports; the cache (``cache/pool_persistence.py``) supplies the
identity, the rank and the device.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Hashable, Optional

import torch

from .anchor_pool import PreparedObservation
from .estimators import AnchorEstimator
from .low_rank import Factors

__all__ = ["FORMAT", "VERSION", "PoolFileError", "kv_layout", "model_identity", "rank_path", "save_pools",
           "load_pools"]

FORMAT = "sglang-kvshare-pools"
VERSION = 2  # 2: the model identity holds the KV layout and the weights digest
# The config fields that decide what a layer's K and V are (a fine-tune changes none of them: the weights digest
# tells it apart).
_ARCH_FIELDS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "rope_theta", "rope_scaling",
                "rms_norm_eps", "tie_word_embeddings")
_DIGEST_BYTES = 1 << 20  # of each weight file, its first and last MiB (with its size): cheap at launch
_KEY_DEPTH = 8  # slots, edges and content keys: strings, numbers and None in tuples nested at most this deep


class PoolFileError(ValueError):
    """A pool file this server cannot use: unreadable, another format or version, another model or rank."""


def _digest(data: Any) -> str:
    return hashlib.blake2b(json.dumps(data, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def weights_digest(model_path: Optional[str]) -> Optional[str]:
    """A digest of the weight files under ``model_path`` (each file's name, size, first and last MiB), or None
    when it is not a local directory holding ``*.safetensors`` or ``*.bin`` files.

    Why not the whole files: reading gigabytes at every launch. A fine-tune of the same architecture changes
    every tensor, so the bytes at both ends of its files differ too.
    """
    if not model_path or not Path(model_path).is_dir():
        return None
    files = sorted(p for ext in ("*.safetensors", "*.bin") for p in Path(model_path).glob(ext))
    if not files:
        return None
    h = hashlib.blake2b(digest_size=16)
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            h.update(f.read(_DIGEST_BYTES))
            if size > 2 * _DIGEST_BYTES:
                f.seek(size - _DIGEST_BYTES)
                h.update(f.read(_DIGEST_BYTES))
    return h.hexdigest()


def kv_layout(layers: int, k_head: tuple[int, int], v_head: tuple[int, int], dtype: torch.dtype) -> dict:
    """One rank's KV as anchors store it: ``layers``, ``(kv_heads, head_dim)`` of K and of V, the dtype."""
    return {"layers": int(layers), "k": [int(x) for x in k_head], "v": [int(x) for x in v_head],
            "dtype": str(dtype).removeprefix("torch.")}


def model_identity(hf_config: Any, model_path: Optional[str], spec: Any, kv: dict) -> dict:
    """What anchors depend on: the architecture's numbers, the RoPE spec, the rank's KV layout and the weights.

    ``hf_config``: the model's transformers config; ``spec``: its ``RopeSpec``; ``kv``: ``kv_layout`` of the
    rank's KV pool; ``model_path``: a local directory of the weights. Returns plain types. ``weights`` falls back
    to the whole model path (a hub id with its organisation) when no weight files are found there.
    """
    fields = {name: getattr(hf_config, name, None) for name in _ARCH_FIELDS}
    rope = {"rotary_dim": int(spec.rotary_dim), "layout": str(spec.layout),
            "inv_freq": _digest([round(float(x), 9) for x in spec.inv_freq.flatten().tolist()])}
    weights = weights_digest(model_path)
    return {"architecture": _digest(fields), "rope": rope, "kv": dict(kv),
            "weights": weights if weights is not None else f"path:{model_path or ''}"}


def rank_path(path: str, tp_rank: int = 0, tp_size: int = 1, dp_rank: int = 0, dp_size: int = 1) -> Path:
    """The file of one scheduler: ``path`` itself on a single rank, else ``path.dp<d>.tp<t>`` (each rank holds
    its own heads' and its own traffic's anchors)."""
    if tp_size <= 1 and dp_size <= 1:
        return Path(path)
    return Path(f"{path}.dp{dp_rank}.tp{tp_rank}")


def _factors(f: Factors) -> dict:
    return {"a": f.a, "b": f.b, "full": f.full, "head_shape": list(f.head_shape)}


def _unfactors(d: Any, head: list, layers: int, length: Optional[int], dtype: str,
               device: torch.device | str) -> Factors:
    """One saved ``Factors`` checked against the server's KV: ``head`` ``[kv_heads, head_dim]``, ``layers``,
    ``length`` rows (None: any, the base's), ``dtype``. Raises ``ValueError`` saying what differs."""
    if not isinstance(d, dict) or set(d) != {"a", "b", "full", "head_shape"}:
        raise ValueError("a factor entry is not {a, b, full, head_shape}")
    shape = d["head_shape"]
    if not isinstance(shape, list) or [type(x) for x in shape] != [int, int] or shape != list(head):
        raise ValueError(f"factors of head shape {shape!r}; this server's KV has {head}")
    width = head[0] * head[1]
    a, b, full = d["a"], d["b"], d["full"]
    if full is not None:
        if a is not None or b is not None:
            raise ValueError("factors with both a full matrix and low-rank factors")
        _tensor(full, [layers, length, width], dtype)
    else:
        _tensor(a, [layers, length, None], dtype)
        rank = int(a.shape[2])
        if not 1 <= rank <= min(int(a.shape[1]), width):
            raise ValueError(f"factors of rank {rank} for {int(a.shape[1])} rows of width {width}")
        _tensor(b, [layers, rank, width], dtype)
    move = (lambda t: None if t is None else t.to(device))
    return Factors(move(a), move(b), move(full), (head[0], head[1]))


def _tensor(t: Any, shape: list, dtype: str) -> None:
    """``t`` is a dense, finite tensor of ``dtype`` whose shape is ``shape`` (None: any positive size)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        raise ValueError(f"{type(t).__name__} where a dense tensor belongs")
    if str(t.dtype).removeprefix("torch.") != dtype:
        raise ValueError(f"a tensor of {t.dtype}; this server's KV is {dtype}")
    got = list(t.shape)
    if len(got) != len(shape) or any(n < 1 or (want is not None and n != want) for n, want in zip(got, shape)):
        want = ", ".join("*" if w is None else str(w) for w in shape)
        raise ValueError(f"a tensor of shape {got} where [{want}] belongs (layers, rows, heads x head_dim of this "
                         "server's KV)")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError("a tensor with inf or NaN values")


def _key(value: Any, depth: int = 0) -> Hashable:
    """A slot, edge or content key as the estimator makes them: strings, numbers and None, in nested tuples."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) is tuple and depth < _KEY_DEPTH:
        return tuple(_key(v, depth + 1) for v in value)
    raise ValueError(f"a key of type {type(value).__name__}")


def _list(value: Any, what: str) -> list:
    if type(value) is not list:
        raise ValueError(f"{what} is a {type(value).__name__}, not a list")
    return value


def save_pools(path: Path, estimator: AnchorEstimator, *, secret: bytes, identity: dict, rank: dict) -> dict:
    """Write every pool of ``estimator`` to ``path`` (atomically: a new file moved over the old one, mode 0600:
    it holds factors of prompts' KV). The caller holds the estimator lock. Returns what was written:
    ``{"path", "slots", "anchors", "bytes"}``. Raises ``OSError`` when the file cannot be written.
    """
    pools = []
    anchors = 0
    for slot, pool in estimator.pools():
        entries = []
        for a in pool.anchors:
            entries.append({"content_key": a.content_key, "activations": int(a.activations),
                            "base_k": _factors(a.base_k), "base_v": _factors(a.base_v), "base_v_gram": a.base_v_gram,
                            "deltas": [{"edge": edge, "k": _factors(dk), "v": _factors(dv)}
                                       for edge, (dk, dv) in a.deltas.items()]})
        anchors += len(entries)
        pools.append({"slot": slot, "anchors": entries})
    payload = {"format": FORMAT, "version": VERSION, "model": identity, "rank": rank, "mode": estimator.name,
               "secret": torch.frombuffer(bytearray(secret), dtype=torch.uint8).clone(), "pools": pools}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {"path": str(path), "slots": len(pools), "anchors": anchors, "bytes": path.stat().st_size}


def _check(payload: Any, path: Path, identity: dict, rank: dict, mode: str) -> None:
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise PoolFileError(f"{path} is not a kvshare pool file (saved by POST /kvshare/save)")
    if payload.get("version") != VERSION:
        raise PoolFileError(f"{path} has pool file format {payload.get('version')!r}; this sglang-kvshare reads "
                            f"format {VERSION}: remove the file (the server then learns its pools again)")
    if payload.get("mode") != mode:
        raise PoolFileError(f"{path} holds {payload.get('mode')!r} anchors; this server runs {mode!r}")
    saved = payload.get("model") if isinstance(payload.get("model"), dict) else {}
    for name in ("kv", "architecture", "rope", "weights"):  # the readable difference first
        if saved.get(name) != identity.get(name):
            raise PoolFileError(f"{path} was saved for another model ({name} differs: {saved.get(name)!r} there, "
                                f"{identity.get(name)!r} here); its corrections would be wrong for this one: "
                                "remove the file or point --kvshare-pool-file elsewhere")
    if payload.get("rank") != rank:
        raise PoolFileError(f"{path} belongs to rank {payload.get('rank')!r}, this scheduler is {rank!r}")


def load_pools(path: Path, estimator: AnchorEstimator, *, identity: dict, rank: dict,
               device: torch.device | str = "cpu") -> tuple[bytes, dict]:
    """Load the pools saved at ``path`` into ``estimator`` (which should be empty: a launch).

    Returns ``(secret, summary)``: the content hasher's secret the keys were made with (the caller adopts it)
    and ``{"path", "slots", "anchors", "dropped"}`` (anchors the server's bounds did not keep). Tensors go to
    ``device``. Raises ``PoolFileError`` for an unreadable or mismatched file, before anything is loaded.
    """
    path = Path(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same error for the operator
        # NOTE: not torch's own message: for a file holding more than data it suggests weights_only=False.
        raise PoolFileError(f"cannot read the pool file {path} ({type(exc).__name__}): it is not a file "
                            "POST /kvshare/save wrote, or it is damaged; remove it (the server then learns its "
                            "pools again) or point --kvshare-pool-file elsewhere") from exc
    _check(payload, path, identity, rank, estimator.name)
    kv = identity["kv"]
    try:
        secret = payload["secret"]
        _tensor(secret, [16], "uint8")
        observations = [_observations(_key(p["slot"]), a, kv, device)
                        for p in _list(payload["pools"], "pools") for a in _list(p["anchors"], "anchors")]
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise PoolFileError(f"the pool file {path} is damaged or does not fit this server: {exc}; remove it (the "
                            "server then learns its pools again) or point --kvshare-pool-file elsewhere") from None
    for (first, *edges), activations in observations:
        anchor_id = estimator.commit_observation(first)  # the base and the first edge; the others attach to it
        for obs in edges:
            estimator.commit_observation(obs)
        if anchor_id is not None:
            estimator.restore_activations(first.slot, anchor_id, activations)
    pools = list(estimator.pools())
    kept = sum(len(pool) for _, pool in pools)
    return bytes(secret.tolist()), {"path": str(path), "slots": len(pools), "anchors": kept,
                                    "dropped": len(observations) - kept}


def _observations(slot: Hashable, anchor: Any, kv: dict,
                  device: torch.device | str) -> tuple[list[PreparedObservation], int]:
    """One saved anchor as the observations that rebuild it: its first edge with the base, every other edge
    attached to it by content key (an anchor without a content key keeps its first edge only). Every tensor is
    checked against ``kv`` (``kv_layout``) first; raises ``ValueError`` (or ``KeyError``, ``TypeError``)."""
    if not isinstance(anchor, dict):
        raise ValueError(f"an anchor is a {type(anchor).__name__}")
    content_key = _key(anchor["content_key"])
    activations = anchor["activations"]
    if type(activations) is not int or activations < 0:
        raise ValueError(f"activations {activations!r}")
    layers, dtype = kv["layers"], kv["dtype"]
    base_k = _unfactors(anchor["base_k"], kv["k"], layers, None, dtype, device)
    length = base_k.length
    base_v = _unfactors(anchor["base_v"], kv["v"], layers, length, dtype, device)
    gram = anchor["base_v_gram"]
    _tensor(gram, [length], "float64")
    out = []
    for i, d in enumerate(_list(anchor["deltas"], "deltas")):
        if i and content_key is None:
            break
        if not isinstance(d, dict):
            raise ValueError(f"an edge is a {type(d).__name__}")
        first = i == 0
        out.append(PreparedObservation(
            edge=_key(d["edge"]), content_key=content_key, length=length,
            delta_k=_unfactors(d["k"], kv["k"], layers, length, dtype, device),
            delta_v=_unfactors(d["v"], kv["v"], layers, length, dtype, device),
            base_k=base_k if first else None, base_v=base_v if first else None,
            base_v_gram=gram.to(device) if first else None, slot=slot))
    if not out:
        raise ValueError("an anchor without any edge")
    return out, activations
