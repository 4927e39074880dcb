"""Row policies measured offline and never served: which rows of a reused segment to recompute, other than the
served ``HEAD`` (``sglang_kvshare.cache.recompute``). ``benchmarks.fidelity`` runs them as ``select_<policy>_r<share>``
arms; each looks only at what a server has when the request arrives (never the dense reference):

* ``random``: a seeded random share (the baseline every policy must beat).
* ``kv_deviation``: CacheBlend (``common.partial_recompute``: every row through the first layers, then the rows
  whose K deviates most).
* ``query_aware``: ProphetKV / A3; the request's private tail runs over the prefix and the reused segment up to
  the probe layer(s), and the rows its queries attend to most are chosen.
* ``head_query`` / ``head_kv_deviation``: half of the budget the head, the rest by the tail's attention, or by
  how far each row's layer-1 K and V lie from what one layer of the segment's own forward gives.
* ``correction``: on ``kvcmas``'s segment, the rows whose predicted correction is largest (no forward).

None did better than the head on the live frontier (docs/STAGED_PREFILL.md).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from benchmarks.common import KV, attend_and_mlp, project_qkv

POLICIES = ("random", "kv_deviation", "query_aware", "head_query", "head_kv_deviation", "correction")
PROBE_LAYERS = (2,)  # an early layer: the tail's attention there already points at the rows it reads


def budget(n: int, ratio: float) -> int:
    """Rows recomputed for a segment of ``n`` rows at share ``ratio`` (at least one)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return min(n, max(1, math.ceil(ratio * n)))


def select_random(n: int, ratio: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[:budget(n, ratio)].sort().values


def top_rows(scores: torch.Tensor, ratio: float, head_share: float = 0.0) -> torch.Tensor:
    """Indices (ascending) of the ``budget`` highest ``scores``; ``head_share`` of the budget the first rows."""
    scores = scores.clone()
    scores[:int(budget(scores.numel(), ratio) * head_share)] = float("inf")
    return torch.topk(scores, budget(scores.numel(), ratio)).indices.sort().values


def relative_sum(dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """Per-row K and V distances ``[S]`` added, each relative to its mean (K and V differ in scale)."""
    return dk / dk.mean().clamp(min=1e-12) + dv / dv.mean().clamp(min=1e-12)


def correction_size(aligned: KV, corrected: KV) -> torch.Tensor:
    """Per row ``[S]``: how far the correction moves it."""
    return relative_sum((corrected.k.float() - aligned.k.float()).pow(2).sum(dim=(0, 2, 3)),
                        (corrected.v.float() - aligned.v.float()).pow(2).sum(dim=(0, 2, 3)))


@torch.no_grad()
def tail_attention(model, prefix: KV, reused: KV, tail: Sequence[int],
                   probe_layers: Sequence[int] = PROBE_LAYERS) -> torch.Tensor:
    """Attention mass ``[S]`` the tail's queries put on each reused row, averaged over heads, tail tokens and the
    probe layers; the tail runs over ``prefix + reused`` as it would in the request (causally among itself)."""
    lm = model.model
    p, s, t = prefix.length, reused.length, len(tail)
    h = lm.embed_tokens(torch.tensor([list(tail)]))
    cos, sin = lm.rotary_emb(h, torch.arange(p + s, p + s + t)[None])
    ctx = prefix.cat(reused)
    mask = torch.ones(t, p + s + t, dtype=torch.bool)
    mask[:, p + s:] = torch.ones(t, t, dtype=torch.bool).tril()
    scores = torch.zeros(s)
    for li, layer in enumerate(lm.layers[:max(probe_layers) + 1]):
        q, k, v = project_qkv(layer, h, cos, sin)
        keys = torch.cat([ctx.k[li].transpose(0, 1)[None], k], 2)  # [1, kvh, P+S+T, hd]
        values = torch.cat([ctx.v[li].transpose(0, 1)[None], v], 2)
        if li in probe_layers:
            rep = q.shape[1] // keys.shape[1]
            logits = (q @ keys.repeat_interleave(rep, 1).transpose(-1, -2)) * layer.self_attn.scaling
            probs = logits.masked_fill(~mask[None, None], float("-inf")).softmax(-1)  # [1, H, T, P+S+T]
            scores += probs[0, :, :, p:p + s].float().mean(dim=(0, 1))
        h = attend_and_mlp(layer, h, q, keys, values, mask)
    return scores / len(probe_layers)


@torch.no_grad()
def kv_deviation_scores(model, prefix: KV, ids: Sequence[int], reused: KV, check_layer: int = 1) -> torch.Tensor:
    """Per row ``[S]``: how far the reused K and V at ``check_layer`` lie from what the request's own context gives
    there; layers below it run every row over ``prefix`` and the reused rows as they stand."""
    lm = model.model
    p, s = prefix.length, len(ids)
    if check_layer >= len(lm.layers):
        raise ValueError(f"check_layer {check_layer} is past the model's {len(lm.layers)} layers")
    h = lm.embed_tokens(torch.tensor([list(ids)]))
    pos = torch.arange(p, p + s)
    cos, sin = lm.rotary_emb(h, pos[None])
    mask = torch.arange(p + s)[None, :] <= pos[:, None]
    for li, layer in enumerate(lm.layers[:check_layer + 1]):
        q, k, v = project_qkv(layer, h, cos, sin)
        if li == check_layer:
            return relative_sum((k[0].transpose(0, 1).float() - reused.k[li].float()).pow(2).sum(dim=(1, 2)),
                                (v[0].transpose(0, 1).float() - reused.v[li].float()).pow(2).sum(dim=(1, 2)))
        keys = torch.cat([prefix.k[li], reused.k[li]], 0).transpose(0, 1)[None]
        values = torch.cat([prefix.v[li], reused.v[li]], 0).transpose(0, 1)[None]
        h = attend_and_mlp(layer, h, q, keys, values, mask)


def choose(policy: str, model, prefix: KV, ids: list[int], reused: KV, tail: list[int], ratio: float, seed: int,
           aligned: KV | None = None) -> torch.Tensor:
    """The rows ``policy`` recomputes (``kv_deviation`` is a forward of its own: ``common.partial_recompute``).
    ``aligned``: the segment re-aligned without correction, beside the corrected ``reused`` (``correction``)."""
    if policy == "random":
        return select_random(len(ids), ratio, seed)
    if policy in ("query_aware", "head_query"):
        return top_rows(tail_attention(model, prefix, reused, tail), ratio, 0.5 if policy == "head_query" else 0.0)
    if policy == "head_kv_deviation":
        return top_rows(kv_deviation_scores(model, prefix, ids, reused), ratio, 0.5)
    if policy == "correction":
        if aligned is None:
            raise ValueError("the correction policy needs the aligned segment beside the corrected one")
        return top_rows(correction_size(aligned, reused), ratio)
    raise ValueError(f"unknown row policy {policy!r}; one of head, {', '.join(POLICIES)}")
