"""The dispatcher's backend choice, and the rotation convention against the model code's RoPE."""

from __future__ import annotations

import pytest
import torch
from helpers_kernels import llama_inv_freq

from sglang_kvshare.kernels import align_correct_scatter, gate_sq_distances, token_distances
from sglang_kvshare.kernels.dispatch import _use_triton
from sglang_kvshare.kernels.reference import AlignParams, align_correct_scatter_reference, gate_sq_distances_reference
from sglang_kvshare.kernels.rope import rotate


def test_auto_uses_torch_off_cuda(gen):
    assert not _use_triton("auto", torch.device("cpu"))
    assert not _use_triton("torch", torch.device("cuda"))
    src = torch.randn(40, 2, 64, generator=gen)
    idx = torch.arange(20)
    a, b, c = src.clone(), src.clone(), src.clone()
    kw = dict(rotate=True, src_start=3, dst_start=70, inv_freq=llama_inv_freq(64))
    align_correct_scatter(a, a, idx, idx + 20, **kw)
    align_correct_scatter_reference(b, b, idx, idx + 20, AlignParams(**kw), compute=torch.float32)
    assert torch.equal(a, b)  # the CPU path is the reference computing in fp32 (the kernel's precision) ...
    align_correct_scatter_reference(c, c, idx, idx + 20, AlignParams(**kw))
    torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)  # ... within fp32 rounding of the float64 yardstick
    X, A, B = torch.randn(2, 5, 64), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 8, 64)
    assert torch.equal(gate_sq_distances(X, A, B), gate_sq_distances_reference(X, A, B, compute=torch.float32))
    assert token_distances(X, A, B).shape == (5, 3)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="backend"):
        _use_triton("cuda", torch.device("cpu"))


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotation_matches_transformers_rope(rotary_dim, gen):
    """A key RoPE'd by the model code at p, rotated by d, equals the key RoPE'd at p + d (rotate_half layout)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    head_dim, p, d = 64, 17, 4000
    inv_freq = llama_inv_freq(rotary_dim)
    k = torch.randn(1, 2, 1, head_dim, generator=gen, dtype=torch.float64)  # [batch, heads, seq, head_dim]

    def hf_rope(pos):
        freqs = pos * inv_freq.double()
        emb = torch.cat([freqs, freqs])[None, None, :]
        rot, rest = k[..., :rotary_dim], k[..., rotary_dim:]
        out, _ = llama.apply_rotary_pos_emb(rot, rot, emb.cos(), emb.sin())
        return torch.cat([out, rest], dim=-1)

    moved = rotate(hf_rope(p), d, inv_freq, rotary_dim, "rotate_half")
    torch.testing.assert_close(moved, hf_rope(p + d), atol=1e-9, rtol=1e-9)
