"""The ``query`` policy's probe: the attention of a request's tail on the rows in the pool (tiny random Llama).

The probe runs SGLang's decoder-layer parts; here they wrap a transformers Llama
with the same call shapes (fused QKV returning ``(out, bias)``, RoPE on flat
``[T, H x hd]`` tensors), and its scores are checked against the offline
harness's own implementation (``benchmarks.selection.tail_attention``), which
uses transformers' layers directly. The live server check is in
``tests/server/test_sparse_extend_server.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import selection as sel
from benchmarks.common import KV, prefill
from sglang_kvshare.cache.tail_probe import TailProbe, pick_rows, unsupported_reason
from sglang_kvshare.correction import RopeSpec, materialize
from tests.tiny_models import tiny_llama

torch.set_num_threads(1)


class _Fused(torch.nn.Module):
    """A projection as SGLang's linear layers return it: ``(output, bias)``."""

    def __init__(self, *linears):
        super().__init__()
        self.linears = torch.nn.ModuleList(linears)

    def forward(self, x):
        return torch.cat([lin(x) for lin in self.linears], -1), None


class _Rope:
    """SGLang's ``rotary_emb(positions, q, k)`` on flat ``[T, heads x hd]`` tensors, from transformers' RoPE."""

    def __init__(self, hf_model, head_dim):
        self.rotary, self.hd = hf_model.model.rotary_emb, head_dim

    def __call__(self, positions, q, k):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        t = q.shape[0]
        cos, sin = self.rotary(q[None], positions[None])
        q4, k4 = q.view(1, t, -1, self.hd).transpose(1, 2), k.view(1, t, -1, self.hd).transpose(1, 2)
        q4, k4 = apply_rotary_pos_emb(q4, k4, cos, sin)
        return q4.transpose(1, 2).reshape(t, -1), k4.transpose(1, 2).reshape(t, -1)


def sglang_shaped(hf_model):
    """The parts of ``hf_model`` as SGLang's Llama names and calls them."""
    cfg = hf_model.config
    hd = cfg.head_dim
    layers = []
    for i, layer in enumerate(hf_model.model.layers):
        a = layer.self_attn
        attn = SimpleNamespace(qkv_proj=_Fused(a.q_proj, a.k_proj, a.v_proj), o_proj=_Fused(a.o_proj),
                               rotary_emb=_Rope(hf_model, hd), q_size=cfg.num_attention_heads * hd,
                               kv_size=cfg.num_key_value_heads * hd, num_heads=cfg.num_attention_heads,
                               num_kv_heads=cfg.num_key_value_heads, head_dim=hd, scaling=hd ** -0.5,
                               attn=SimpleNamespace(layer_id=i))
        layers.append(SimpleNamespace(input_layernorm=layer.input_layernorm, self_attn=attn, mlp=layer.mlp,
                                      post_attention_layernorm=layer.post_attention_layernorm))
    return SimpleNamespace(model=SimpleNamespace(layers=layers, embed_tokens=hf_model.model.embed_tokens))


class _Pool:
    """A KV pool: rows of every layer at scattered slots, read as SGLang's ``get_key_buffer(layer_id)``."""

    def __init__(self, kv: KV, slots: torch.Tensor, size: int):
        layers, _, kvh, hd = kv.k.shape
        self.k = torch.randn(layers, size, kvh, hd)
        self.v = torch.randn(layers, size, kvh, hd)
        self.k[:, slots], self.v[:, slots] = kv.k, kv.v

    def get_key_buffer(self, layer_id):
        return self.k[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v[layer_id]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(max_position_embeddings=4096, attn_implementation="eager")


def _context(tiny):
    """A prefix, a segment re-aligned from another context, and a tail behind them."""
    g = torch.Generator().manual_seed(3)
    prefix, _ = prefill(tiny, torch.randint(0, 128, (11,), generator=g).tolist())
    seg = torch.randint(0, 128, (37,), generator=g).tolist()
    other, _ = prefill(tiny, torch.randint(0, 128, (19,), generator=g).tolist())
    src, _ = prefill(tiny, seg, other)
    k, v = materialize(src.k, src.v, other.length, prefix.length, None, RopeSpec.from_hf_config(tiny.config))
    tail = torch.randint(0, 128, (9,), generator=g).tolist()
    return prefix, KV(k, v), tail


@torch.no_grad()
def test_probe_scores_are_the_tails_attention_on_each_row(tiny):
    prefix, reused, tail = _context(tiny)
    ctx = prefix.cat(reused)
    slots = torch.randperm(200, generator=torch.Generator().manual_seed(0))[:ctx.length]
    probe = TailProbe(sglang_shaped(tiny), _Pool(ctx, slots, 200), probe_layer=2)
    scores = probe.row_scores(slots, tail, ctx.length)
    assert scores.shape == (ctx.length,)
    want = sel.tail_attention(tiny, prefix, reused, tail, probe_layers=(2,))  # mean over heads
    got = scores[prefix.length:] / tiny.config.num_attention_heads
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # Summed over heads and averaged over the tail's tokens, a row's score is a share of the attention.
    assert float(scores.sum()) <= tiny.config.num_attention_heads + 1e-4


@torch.no_grad()
def test_probe_sums_its_scores_over_tensor_parallel_ranks(tiny):
    prefix, reused, tail = _context(tiny)
    ctx = prefix.cat(reused)
    slots = torch.arange(ctx.length)

    class Twice:
        calls = 0

        def sum(self, t):
            Twice.calls += 1
            return 2 * t

    alone = TailProbe(sglang_shaped(tiny), _Pool(ctx, slots, ctx.length)).row_scores(slots, tail, ctx.length)
    reduced = TailProbe(sglang_shaped(tiny), _Pool(ctx, slots, ctx.length), reducer=Twice()).row_scores(
        slots, tail, ctx.length)
    assert Twice.calls == 1
    torch.testing.assert_close(reduced, 2 * alone)


def test_a_model_without_llamas_parts_is_refused_with_a_reason(tiny):
    model = sglang_shaped(tiny)
    del model.model.layers[1].self_attn.qkv_proj
    reason = unsupported_reason(model)
    assert reason is not None and "qkv_proj" in reason
    with pytest.raises(ValueError, match="qkv_proj"):
        TailProbe(model, None)
    assert "fewer than" in unsupported_reason(sglang_shaped(tiny), probe_layer=5)
    assert "has no model.layers" in unsupported_reason(SimpleNamespace())


def test_pick_rows_keeps_the_fixed_rows_and_takes_the_highest_scores():
    scores = torch.tensor([0.0, 0.1, 0.9, 0.2, 0.8, 0.3])
    assert pick_rows(scores, range(0, 2), range(2, 6), 2) == (0, 1, 2, 4)
    assert pick_rows(scores, (), range(3, 6), 5) == (3, 4, 5)  # no more than the candidates
    assert pick_rows(scores, (0,), range(1, 6), 0) == (0,)
