"""Shared benchmark helpers: the real model through transformers, its KV caches
as ``[num_layers, L, kv_heads, head_dim]`` tensors, batched suffix evaluation
and the forwards that recompute some rows of a reused segment (the sparse extend's, CacheBlend's).

Everything here runs the model's own modules (no re-implementation of the
weights); the partial forward re-uses each decoder layer's projections,
norms, RoPE and MLP and only replaces the attention call, so it can take a
mixed cache and a subset of query tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .baselines import select_tokens, token_deviation


def load_model(name: str = "smollm2-135m"):
    """(model, tokenizer, path) of a prepared model, fp32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from devtools.models import prepare

    path = prepare(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path), path


@dataclass
class KV:
    """A stretch of cache: K, V ``[num_layers, L, kv_heads, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.k.shape[1])

    def cat(self, other: "KV") -> "KV":
        return KV(torch.cat([self.k, other.k], 1), torch.cat([self.v, other.v], 1))


def kv_from_cache(cache) -> KV:
    """transformers DynamicCache (batch 1) -> KV."""
    ks = [layer.keys[0].transpose(0, 1) for layer in cache.layers]
    vs = [layer.values[0].transpose(0, 1) for layer in cache.layers]
    return KV(torch.stack(ks), torch.stack(vs))


def cache_from_kvs(kvs: list[KV]):
    """Batch of KV (same length) -> DynamicCache with batch ``len(kvs)``."""
    from transformers import DynamicCache

    nl = kvs[0].k.shape[0]
    data = []
    for layer in range(nl):
        k = torch.stack([kv.k[layer].transpose(0, 1) for kv in kvs])  # [B, H, L, hd]
        v = torch.stack([kv.v[layer].transpose(0, 1) for kv in kvs])
        data.append((k.contiguous(), v.contiguous()))
    return DynamicCache(ddp_cache_data=data)


@torch.no_grad()
def prefill(model, ids: list[int], past: KV | None = None) -> tuple[KV, float]:
    """Dense prefill of ``ids`` after ``past`` (or from position 0).

    Returns the new tokens' KV only, and the wall seconds of the forward.
    """
    x = torch.tensor([ids])
    cache = cache_from_kvs([past]) if past is not None else None
    t0 = time.perf_counter()
    out = model(input_ids=x, past_key_values=cache, use_cache=True)
    secs = time.perf_counter() - t0
    full = kv_from_cache(out.past_key_values)
    start = 0 if past is None else past.length
    return KV(full.k[:, start:].clone(), full.v[:, start:].clone()), secs


@torch.no_grad()
def suffix_eval(model, contexts: list[KV], suffix: list[int], greedy: int = 0, greedy_rows: int | None = None):
    """Run ``suffix`` after each context (a batch) and optionally decode greedily.

    Returns (log-probs ``[B, T, vocab]`` float32 at the suffix positions,
    greedy tokens ``[B', greedy]`` for the first ``greedy_rows`` contexts or None).
    """
    b = len(contexts)
    cache = cache_from_kvs(contexts)
    out = model(input_ids=torch.tensor([suffix] * b), past_key_values=cache, use_cache=True)
    logp = torch.log_softmax(out.logits.float(), dim=-1)
    if not greedy:
        return logp, None
    rows = b if greedy_rows is None else greedy_rows
    if rows < b:  # NOTE: decode only the rows that need it; crop the batch of the cache
        for layer in out.past_key_values.layers:
            layer.keys, layer.values = layer.keys[:rows], layer.values[:rows]
    tok = logp[:rows, -1].argmax(-1, keepdim=True)
    toks = [tok]
    past = out.past_key_values
    for _ in range(greedy - 1):
        o = model(input_ids=tok, past_key_values=past, use_cache=True)
        past = o.past_key_values
        tok = o.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(tok)
    return logp, torch.cat(toks, 1)


@torch.no_grad()
def project_qkv(layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """One decoder layer's Q ``[1, H, n, hd]`` and K, V ``[1, kvh, n, hd]`` of hidden states ``h``, RoPE applied."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    hd, n = attn.head_dim, h.shape[1]
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(1, n, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(1, n, -1, hd).transpose(1, 2)
    v = attn.v_proj(x).view(1, n, -1, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def attend_and_mlp(layer, h: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """The rest of the layer: ``q`` attends to ``keys``/``values`` ``[1, kvh, K, hd]`` under ``mask`` ``[n, K]``
    (True = visible), then output projection, residual and MLP; returns the layer's output hidden states."""
    attn = layer.self_attn
    rep = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None, None], scale=attn.scaling)
    h = h + attn.o_proj(o.transpose(1, 2).reshape(1, h.shape[1], -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _recompute(model, prefix: KV, ids: list[int], reused: KV, chosen: torch.Tensor | None, check_layer: int,
               ratio: float, criterion: str) -> tuple[KV, torch.Tensor]:
    """The segment's KV after ``prefix`` with some rows recomputed through the layers, in one forward: each
    recomputed row attends to the prefix and to the segment rows at or before it (the others as reused, the
    recomputed ones as recomputed in that layer). ``chosen``: those rows through every layer; None: CacheBlend,
    every row through layers ``0..check_layer``, then only the ``ratio`` whose K (or V) deviates most there."""
    lm = model.model
    p, s = prefix.length, len(ids)
    sel = torch.arange(s) if chosen is None else chosen.sort().values
    h = lm.embed_tokens(torch.tensor([ids]))[:, sel]
    pos = torch.arange(p, p + s)[sel]
    cos, sin = lm.rotary_emb(h, pos[None])
    out_k, out_v = reused.k.clone(), reused.v.clone()
    key_pos = torch.arange(p + s)
    for li, layer in enumerate(lm.layers):
        q, k, v = project_qkv(layer, h, cos, sin)
        k_rows, v_rows = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [n, kvh, hd]
        out_k[li, sel], out_v[li, sel] = k_rows.to(out_k.dtype), v_rows.to(out_v.dtype)
        keys = torch.cat([prefix.k[li], out_k[li]], 0).transpose(0, 1)[None]  # [1, kvh, P+S, hd]
        values = torch.cat([prefix.v[li], out_v[li]], 0).transpose(0, 1)[None]
        h = attend_and_mlp(layer, h, q, keys, values, key_pos[None, :] <= pos[:, None])
        if chosen is None and li == check_layer and ratio < 1.0:
            dev = token_deviation(k_rows if criterion == "k" else v_rows,
                                  (reused.k if criterion == "k" else reused.v)[li])
            keep = select_tokens(dev, ratio)
            h, cos, sin, pos, sel = h[:, keep], cos[:, keep], sin[:, keep], pos[keep], keep
    return KV(out_k, out_v), sel


@torch.no_grad()
def recompute_rows(model, prefix: KV, ids: list[int], reused: KV, chosen: torch.Tensor) -> KV:
    """The segment's KV with rows ``chosen`` recomputed through every layer in one forward (as the sparse extend
    does); the other rows stay as reused. ``chosen`` = every row gives the dense KV."""
    return _recompute(model, prefix, ids, reused, chosen, 0, 1.0, "k")[0]


@torch.no_grad()
def partial_recompute(model, prefix: KV, ids: list[int], reused: KV, check_layer: int = 1, ratio: float = 0.15,
                      criterion: str = "k") -> tuple[KV, torch.Tensor]:
    """CacheBlend's selective recompute of a segment placed after ``prefix`` (``reused`` aligned to its
    positions): layers ``0..check_layer`` recomputed for every row, later layers only for the ``ratio`` of rows
    whose recomputed K (or V) deviates most from ``reused`` at ``check_layer``. Returns (the blended KV, the
    selected rows); ``ratio=1`` gives the exact dense cache."""
    return _recompute(model, prefix, ids, reused, None, check_layer, ratio, criterion)
