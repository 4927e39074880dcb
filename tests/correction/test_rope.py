"""Alignment is exact: a segment computed at position p and at p' differs in
layer-0 keys only by the RoPE rotation (layer 0 sees no context)."""

from __future__ import annotations

import pytest
import torch

from sglang_kvshare.correction import (RopeSpec, UnsupportedAttentionError, from_canonical, rotate_keys,
                                       to_canonical)

SHIFTS = [(0, 1), (5, 0), (3, 1000), (2500, 17), (7, 4090)]


@pytest.mark.parametrize("p,q", SHIFTS)
def test_rotate_half_matches_llama_forward(tiny_llama, kv_of, gen, p, q):
    spec = RopeSpec.from_hf_config(tiny_llama.config)
    assert spec.layout == "rotate_half" and spec.rotary_dim == 16
    ids = torch.randint(0, 128, (23,), generator=gen)
    k_p, v_p = kv_of(tiny_llama, ids, torch.arange(p, p + 23))
    k_q, v_q = kv_of(tiny_llama, ids, torch.arange(q, q + 23))
    moved = rotate_keys(k_p[0], q - p, spec)
    torch.testing.assert_close(moved, k_q[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(v_p[0], v_q[0])  # values are not rotated
    # Without the rotation they differ a lot: the test can fail.
    assert (k_p[0] - k_q[0]).abs().max() > 1e-2 if p != q else True


@pytest.mark.parametrize("p,q", SHIFTS)
def test_interleaved_partial_matches_gptj_forward(gen, p, q):
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    cfg = GPTJConfig(n_embd=64, n_head=4, rotary_dim=8, n_layer=1, vocab_size=100, n_positions=8192,
                     bos_token_id=0, eos_token_id=0)
    model = GPTJForCausalLM(cfg).eval()
    spec = RopeSpec.from_hf_config(cfg)
    assert spec.layout == "interleaved" and spec.rotary_dim == 8 and spec.head_dim == 16
    ids = torch.randint(0, 100, (19,), generator=gen)

    def keys(start):
        with torch.no_grad():
            out = model(ids[None], position_ids=torch.arange(start, start + 19)[None], use_cache=True)
        return out.past_key_values.layers[0].keys[0].transpose(0, 1)  # [L, H, hd]

    k_p, k_q = keys(p), keys(q)
    torch.testing.assert_close(rotate_keys(k_p, q - p, spec), k_q, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(k_p[..., 8:], k_q[..., 8:])  # pass-through dims


def test_canonical_roundtrip_and_composition(gen):
    spec = RopeSpec.default(head_dim=32, theta=1e5)
    k = torch.randn(2, 11, 3, 32, generator=gen)
    torch.testing.assert_close(from_canonical(to_canonical(k, 777, spec), 777, spec), k, atol=1e-5, rtol=1e-5)
    # Composition: rotating by a then b equals rotating by a + b.
    torch.testing.assert_close(rotate_keys(rotate_keys(k, 300, spec), -1200, spec), rotate_keys(k, -900, spec),
                               atol=1e-5, rtol=1e-5)


def test_half_precision_rounds_once(gen):
    spec = RopeSpec.default(head_dim=64)
    k = torch.randn(4, 64, 2, 64, generator=gen)
    ref = rotate_keys(k.double(), 12345, spec)
    got = rotate_keys(k.half(), 12345, spec)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), ref, atol=5e-3, rtol=5e-3)
    # fp32 math with float64 angles: within fp32 rounding of the float64 yardstick, even 12345 positions away.
    torch.testing.assert_close(rotate_keys(k, 12345, spec).double(), ref, atol=2e-6, rtol=2e-6)


def test_scaled_rope_uses_model_frequencies():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for params in ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                   {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                   {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                    "original_max_position_embeddings": 2048}):
        cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=8192, rope_parameters=params)
        spec = RopeSpec.from_hf_config(cfg)
        emb = LlamaRotaryEmbedding(cfg)
        torch.testing.assert_close(spec.inv_freq, emb.inv_freq.double(), rtol=0, atol=0)
        assert spec.attention_scaling == pytest.approx(emb.attention_scaling)


@pytest.mark.parametrize("make", [
    lambda: __import__("transformers").LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                      "rope_theta": 10000.0}),
    lambda: __import__("transformers").MistralConfig(sliding_window=4096),
    lambda: __import__("transformers").BloomConfig(),
    lambda: __import__("transformers").Qwen2Config(layer_types=["sliding_attention", "full_attention"],
                                                     num_hidden_layers=2, use_sliding_window=True,
                                                     sliding_window=128),
])
def test_unsupported_attention_is_refused(make):
    with pytest.raises(UnsupportedAttentionError, match="Disable KV sharing|not supported"):
        RopeSpec.from_hf_config(make())
