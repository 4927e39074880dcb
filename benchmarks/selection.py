"""Which rows of a reused segment to recompute, offline: the policies ``benchmarks.fidelity`` compares.

A reused segment (aligned, or corrected) differs from the dense prefill most
where its rows attended to the other context. Recomputing a share ``r`` of its
rows, in one forward at their true positions (each recomputed row attends to the
prefix and to every row before it, reused or recomputed: ``recompute_rows``),
spends ``r`` of the reuse on fidelity. The policies differ in what they look at,
and only at what a server has when the request arrives (never the dense
reference):

* ``head``: the first rows (EPIC; the server's ``--kvshare-recompute-head``).
* ``random``: a seeded random share (the baseline every policy must beat).
* ``kv_deviation``: CacheBlend; every row recomputed through the first layers, then
  the rows whose K deviates most at ``check_layer`` (``common.partial_recompute``).
* ``query_aware``: ProphetKV / A3; the request's own private tail (its question,
  instruction and assistant prompt) is run over the prefix and the reused segment
  up to the probe layer(s), and the rows its queries attend to most are chosen.
  Cost: a forward of the tail's tokens (tens) through the probe layers, and one
  attention row per tail token and head over the context: far below a prefill of
  the segment.
* ``head_query``: half of the budget the head, the rest as ``query_aware``: the
  tail's attention alone misses the first rows, where alignment's error is
  largest (measured, never served: no better than the head).
* ``head_kv_deviation``: half of the budget the head, the rest the rows whose
  layer-1 K and V deviate most from the reused ones (CacheBlend's criterion), read
  by a probe that runs every row of the segment through layer 0 only, over the
  prefix and the reused rows, and projects layer 1's K and V
  (``kv_deviation_scores``); nothing the probe computes is kept: the chosen rows
  are recomputed by the one forward as with every other policy. Cost: one layer
  of the segment's forward (1/30 of a prefill of it on SmolLM2).
* ``correction``: ours, on ``kvcmas``'s corrected segment: the rows whose
  correction the anchor pool predicts largest (what the pool learned moves
  most between contexts). Cost: the aligned copy beside the corrected one and
  a norm per row; no forward.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .common import KV, attend_and_mlp, project_qkv

POLICIES = ("head", "random", "kv_deviation", "query_aware", "head_query", "head_kv_deviation", "correction")
PROBE_LAYERS = (2,)  # an early layer: the tail's attention there already points at the rows it reads


def budget(n: int, ratio: float) -> int:
    """Rows recomputed for a segment of ``n`` rows at share ``ratio`` (at least one)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return min(n, max(1, math.ceil(ratio * n)))


def select_head(n: int, ratio: float) -> torch.Tensor:
    return torch.arange(budget(n, ratio))


def select_random(n: int, ratio: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[:budget(n, ratio)].sort().values


def top_rows(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices (ascending) of the ``budget`` highest ``scores``."""
    return torch.topk(scores, budget(scores.numel(), ratio)).indices.sort().values


def relative_sum(dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """Per-row K and V distances ``[S]`` added, each relative to its mean over the segment (K and V differ in
    scale, and neither should decide alone)."""
    return dk / dk.mean().clamp(min=1e-12) + dv / dv.mean().clamp(min=1e-12)


def head_then_top(scores: torch.Tensor, ratio: float, head_share: float = 0.5) -> torch.Tensor:
    """``head_share`` of the budget on the first rows (where alignment's error concentrates), the rest the
    highest ``scores`` past them."""
    scores = scores.clone()
    scores[:int(budget(scores.numel(), ratio) * head_share)] = float("inf")
    return top_rows(scores, ratio)


def correction_size(aligned: KV, corrected: KV) -> torch.Tensor:
    """Per row ``[S]``: how far the correction moves it, K and V each relative to their mean over the segment."""
    return relative_sum((corrected.k.float() - aligned.k.float()).pow(2).sum(dim=(0, 2, 3)),
                        (corrected.v.float() - aligned.v.float()).pow(2).sum(dim=(0, 2, 3)))


def select_by_correction(aligned: KV, corrected: KV, ratio: float) -> torch.Tensor:
    return top_rows(correction_size(aligned, corrected), ratio)


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


def select_query_aware(model, prefix: KV, reused: KV, tail: Sequence[int], ratio: float,
                       probe_layers: Sequence[int] = PROBE_LAYERS) -> torch.Tensor:
    return top_rows(tail_attention(model, prefix, reused, tail, probe_layers), ratio)


def select_head_then_query(model, prefix: KV, reused: KV, tail: Sequence[int], ratio: float,
                           probe_layers: Sequence[int] = PROBE_LAYERS, head_share: float = 0.5) -> torch.Tensor:
    """``head_share`` of the budget on the first rows (where alignment's error concentrates), the rest by the
    tail's attention."""
    return head_then_top(tail_attention(model, prefix, reused, tail, probe_layers), ratio, head_share)


def kv_deviation_scores(model, prefix: KV, ids: Sequence[int], reused: KV, check_layer: int = 1) -> torch.Tensor:
    """Per row ``[S]``: how far the segment's reused K and V at ``check_layer`` lie from what the request's own
    context gives there, each relative to its mean over the segment. Layers below ``check_layer`` are run for
    every row over ``prefix`` and the reused rows as they stand (at layer 0 an aligned row is exact: its K and V
    depend on its token and position only), so the probe reads nothing a server lacks at request time."""
    lm = model.model
    p, s = prefix.length, len(ids)
    h = lm.embed_tokens(torch.tensor([list(ids)]))
    pos = torch.arange(p, p + s)
    cos, sin = lm.rotary_emb(h, pos[None])
    mask = torch.arange(p + s)[None, :] <= pos[:, None]
    for li, layer in enumerate(lm.layers[:check_layer + 1]):
        q, k, v = project_qkv(layer, h, cos, sin)
        if li == check_layer:
            dk = (k[0].transpose(0, 1).float() - reused.k[li].float()).pow(2).sum(dim=(1, 2))
            dv = (v[0].transpose(0, 1).float() - reused.v[li].float()).pow(2).sum(dim=(1, 2))
            return relative_sum(dk, dv)
        keys = torch.cat([prefix.k[li], reused.k[li]], 0).transpose(0, 1)[None]
        values = torch.cat([prefix.v[li], reused.v[li]], 0).transpose(0, 1)[None]
        h = attend_and_mlp(layer, h, q, keys, values, mask)
    raise ValueError(f"check_layer {check_layer} is past the model's {len(lm.layers)} layers")


def select_head_then_kv_deviation(model, prefix: KV, ids: Sequence[int], reused: KV, ratio: float,
                                  head_share: float = 0.5) -> torch.Tensor:
    """``head_share`` of the budget on the first rows, the rest by ``kv_deviation_scores``."""
    return head_then_top(kv_deviation_scores(model, prefix, ids, reused), ratio, head_share)


def recompute_rows(model, prefix: KV, ids: list[int], reused: KV, chosen: torch.Tensor) -> KV:
    """The segment's KV with rows ``chosen`` recomputed through every layer, in one forward: each chosen row
    attends to the prefix and to the segment rows at or before it (reused ones as they are, chosen ones as
    recomputed in this layer); the other rows stay as reused. ``chosen`` = every row gives the dense KV."""
    lm = model.model
    p, s = prefix.length, len(ids)
    chosen = chosen.sort().values
    h = lm.embed_tokens(torch.tensor([ids]))[:, chosen]
    pos = torch.arange(p, p + s)[chosen]
    cos, sin = lm.rotary_emb(h, pos[None])
    out_k, out_v = reused.k.clone(), reused.v.clone()
    mask = torch.arange(p + s)[None, :] <= pos[:, None]  # [n, P+S]
    for li, layer in enumerate(lm.layers):
        q, k, v = project_qkv(layer, h, cos, sin)
        out_k[li, chosen] = k[0].transpose(0, 1).to(out_k.dtype)
        out_v[li, chosen] = v[0].transpose(0, 1).to(out_v.dtype)
        keys = torch.cat([prefix.k[li], out_k[li]], 0).transpose(0, 1)[None]  # [1, kvh, P+S, hd]
        values = torch.cat([prefix.v[li], out_v[li]], 0).transpose(0, 1)[None]
        h = attend_and_mlp(layer, h, q, keys, values, mask)
    return KV(out_k, out_v)
