"""Which rows of a reused segment the request's own tail reads: the probe of the ``query`` recompute policy.

Why: a reused segment's error matters where the request reads it. ProphetKV
and A3 choose the rows to recompute by the attention the request's own query
puts on them. Here the *tail* is the request's last prompt tokens (its
question, instruction and assistant prompt: ``TAIL_TOKENS`` at most); it is
run through the model's first layers over the KV the request will read (its
exact prefix and the segments just assembled, straight from SGLang's pool),
and the attention its queries put on each row at ``PROBE_LAYER``, averaged
over heads and tail tokens, is the row's score. Measured offline
(``benchmarks.fidelity --select-policies``, docs/STAGED_PREFILL.md): the tail's
attention alone misses the segment's first rows, where alignment's error
concentrates, so the policy spends half of its budget on the head and the
rest on the rows the tail reads most.

What it reads and costs: the tail's tokens (tens) through ``PROBE_LAYER + 1``
layers, each attending to every assembled row; the context's K/V of those
layers are read from the pool, nothing is written. Rows between the last
assembled one and the tail (text the request's forward has not computed yet)
are not seen by the probe. With tensor parallelism each rank scores its own
heads and the scores are summed over the ranks (the gate's reducer), so every
rank recomputes the same rows.

Only the Llama family's module layout is supported (``unsupported_reason``);
another model gets the head, with the reason in the report.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

PROBE_LAYER = 2  # an early layer: the tail's attention there already points at the rows it reads
TAIL_TOKENS = 64
_ATTN_PARTS = ("qkv_proj", "o_proj", "rotary_emb", "q_size", "kv_size", "num_heads", "num_kv_heads", "head_dim",
               "scaling", "attn")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")


def _layers(model: Any) -> Sequence[Any]:
    return model.model.layers


def unsupported_reason(model: Any, probe_layer: int = PROBE_LAYER) -> Optional[str]:
    """Why the probe cannot run on ``model`` (None when it can): it needs Llama's decoder-layer parts."""
    try:
        layers = _layers(model)
        embed = model.model.embed_tokens
    except AttributeError:
        return f"query policy: {type(model).__name__} has no model.layers / model.embed_tokens"
    if embed is None or len(layers) <= probe_layer:
        return f"query policy: {type(model).__name__} has fewer than {probe_layer + 1} layers on this rank"
    for layer in layers[:probe_layer + 1]:
        missing = [p for p in _LAYER_PARTS if getattr(layer, p, None) is None]
        missing += [f"self_attn.{p}" for p in _ATTN_PARTS if getattr(getattr(layer, "self_attn", None), p, None) is None]
        if missing:
            return f"query policy: {type(layer).__name__} lacks {', '.join(missing)}"
    return None


class TailProbe:
    """Scores rows of the pool by the attention a request's tail puts on them (module docstring).

    ``model``: SGLang's model object of this rank; ``kvcache``: its KV pool;
    ``reducer``: sums the scores over tensor-parallel ranks (None: one rank).
    """

    def __init__(self, model: Any, kvcache: Any, reducer: Optional[Any] = None,
                 probe_layer: int = PROBE_LAYER) -> None:
        reason = unsupported_reason(model, probe_layer)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self.kvcache = kvcache
        self.reducer = reducer
        self.probe_layer = probe_layer

    @torch.no_grad()
    def row_scores(self, context_slots: torch.Tensor, tail_ids: Sequence[int], tail_start: int) -> torch.Tensor:
        """Per context row, the tail's mean attention on it at the probe layer (float32 ``[C]``, on the CPU).

        ``context_slots``: pool slots of the rows the tail may read, positions
        ``0..C-1``; ``tail_ids`` sit at positions ``tail_start..`` (>= C), causal
        among themselves.
        """
        lm = self.model.model
        kbuf = self.kvcache.get_key_buffer(_layers(self.model)[0].self_attn.attn.layer_id)
        device = kbuf.device
        slots = context_slots.to(device=device, dtype=torch.int64)
        c, t = slots.numel(), len(tail_ids)
        ids = torch.tensor(list(tail_ids), dtype=torch.int64, device=device)
        positions = torch.arange(tail_start, tail_start + t, dtype=torch.int64, device=device)
        x = lm.embed_tokens(ids)
        visible = torch.ones(t, c + t, dtype=torch.bool, device=device)
        visible[:, c:] = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        scores = None
        for i, layer in enumerate(_layers(self.model)[:self.probe_layer + 1]):
            attn = layer.self_attn
            qkv, _ = attn.qkv_proj(layer.input_layernorm(x))
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, k = attn.rotary_emb(positions, q, k)
            lid = attn.attn.layer_id
            keys = torch.cat([self.kvcache.get_key_buffer(lid)[slots].float(),
                              k.reshape(t, attn.num_kv_heads, attn.head_dim).float()])
            rep = attn.num_heads // attn.num_kv_heads
            logits = torch.einsum("thd,shd->hts", q.reshape(t, attn.num_heads, attn.head_dim).float(),
                                  keys.repeat_interleave(rep, dim=1)) * attn.scaling
            probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)  # [H, T, C+T]
            if i == self.probe_layer:
                scores = probs[:, :, :c].sum(dim=(0, 1))
                break
            values = torch.cat([self.kvcache.get_value_buffer(lid)[slots].float(),
                                v.reshape(t, attn.num_kv_heads, attn.head_dim).float()])
            out = torch.einsum("hts,shd->thd", probs, values.repeat_interleave(rep, dim=1))
            o, _ = attn.o_proj(out.reshape(t, attn.num_heads * attn.head_dim).to(x.dtype))
            x = x + o
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        scores = scores.double().cpu()
        if self.reducer is not None:
            scores = self.reducer.sum(scores)
        return (scores / max(t, 1)).float()


def pick_rows(scores: torch.Tensor, fixed: Sequence[int], candidates: Sequence[int], count: int) -> tuple[int, ...]:
    """``fixed`` rows plus the ``count`` ``candidates`` with the highest ``scores`` (ascending; ties: the first)."""
    cand = torch.tensor(list(candidates), dtype=torch.int64)
    count = min(count, cand.numel())
    chosen = set(int(r) for r in fixed)
    if count > 0:
        top = torch.topk(scores[cand].float(), count, sorted=False).indices
        chosen.update(cand[top].tolist())
    return tuple(sorted(chosen))
