"""A tiny random Llama for tests of the math (RoPE, corrections, the offline harness): no real model needed."""

from __future__ import annotations

import torch


def tiny_llama(**overrides):
    """Three layers, GQA (4 query heads, 2 KV heads); ``overrides`` go to ``LlamaConfig``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    kw.update(overrides)
    torch.manual_seed(0)
    cfg = LlamaConfig(**kw)
    model = LlamaForCausalLM(cfg).eval()
    # NOTE: random init gives tiny weights; larger ones make contexts matter.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model
