"""align_correct_scatter: Triton kernel vs torch reference, and the reference vs a direct dense computation."""

from __future__ import annotations

import pytest
import torch
from helpers_kernels import DTYPE_TOLS, llama_inv_freq, paged_indices

from sglang_kvshare.kernels import align_correct_scatter, align_correct_scatter_layers
from sglang_kvshare.kernels.reference import AlignParams, align_correct_scatter_reference

# (L, kv_heads, head_dim, rotary_dim, rank or None=full, Vn, covered, page_size, layout, same_buffer)
# Sampled to cover: L not a multiple of the 32-token block, 1..8 heads, head_dim 64/128,
# partial rotary, ranks 8..64, Vn 0..20, covered < L, page size 1 and 16, one buffer for src and dst.
CASES = [
    (37, 3, 64, 64, 32, 10, 37, 1, "rotate_half", False),
    (50, 1, 128, 128, 8, 1, 20, 16, "interleaved", True),
    (33, 8, 64, 32, 64, 3, 33, 16, "rotate_half", True),
    (45, 2, 128, 64, 16, 20, 40, 1, "interleaved", False),
    (17, 4, 64, 64, None, 5, 9, 16, "rotate_half", False),
    (70, 3, 64, 64, 24, 0, 0, 16, "interleaved", True),
    (5, 5, 128, 96, 12, 2, 5, 1, "rotate_half", False),
]


def make_case(L, heads, head_dim, rotary_dim, rank, vn, covered, page_size, same_buffer, dtype, device, gen):
    num_pages = (3 * L) // page_size + 4
    pool = num_pages * page_size
    src = torch.randn(pool, heads, head_dim, generator=gen).to(dtype)
    src_idx, used = paged_indices(L, page_size, num_pages, gen, offset=3 % page_size)
    dst_idx, _ = paged_indices(L, page_size, num_pages, gen, exclude_pages=used, offset=5 % page_size)
    dst = src if same_buffer else torch.randn(pool, heads, head_dim, generator=gen).to(dtype)
    lc = max(covered, 1) + 2  # anchors may be longer than the covered prefix
    D = heads * head_dim
    corr = {}
    if rank is None:
        corr["delta"] = 0.1 * torch.randn(vn, lc, D, generator=gen)
    else:
        corr["A"] = 0.3 * torch.randn(vn, lc, rank, generator=gen)
        corr["B"] = 0.3 * torch.randn(vn, rank, D, generator=gen) / rank**0.5
    w = torch.softmax(torch.randn(L, vn, generator=gen), dim=1)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(src), to(dst), to(src_idx), to(dst_idx), to(llama_inv_freq(rotary_dim)), to(w),
            {k: to(v) for k, v in corr.items()})


@pytest.mark.triton
@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[f"L{c[0]}-H{c[1]}-d{c[2]}-rd{c[3]}-r{c[4]}-V{c[5]}-p{c[7]}" for c in CASES])
def test_kernel_matches_reference(case, dtype, atol, rtol, device, gen):
    L, heads, head_dim, rotary_dim, rank, vn, covered, page_size, layout, same_buffer = case
    src, dst, src_idx, dst_idx, inv_freq, w, corr = make_case(
        L, heads, head_dim, rotary_dim, rank, vn, covered, page_size, same_buffer, dtype, device, gen)
    for rotate in (True, False):
        outs = []
        for backend in ("triton", "torch"):
            s = src.clone()
            d = s if same_buffer else dst.clone()
            align_correct_scatter(s, d, src_idx, dst_idx, rotate=rotate, src_start=11, dst_start=4099 + L,
                                  inv_freq=inv_freq, rotary_dim=rotary_dim, layout=layout, w=w,
                                  covered=covered if vn else None, backend=backend, **corr)
            outs.append(d)
        torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=atol, rtol=rtol)
        untouched = torch.ones(src.shape[0], dtype=torch.bool, device=device)
        untouched[dst_idx] = False
        base = src if same_buffer else dst
        assert torch.equal(outs[0][untouched], base[untouched]), "rows outside dst_idx changed"


@pytest.mark.triton
def test_kernel_in_place_rows(device, gen):
    """dst_idx == src_idx on one buffer (int32 indices): each program reads its rows before writing them."""
    src, _, idx, _, inv_freq, w, corr = make_case(40, 2, 64, 64, 8, 3, 40, 16, True, torch.float32, device, gen)
    idx = idx.to(torch.int32)
    a, b = src.clone(), src.clone()
    for buf, backend in ((a, "triton"), (b, "torch")):
        align_correct_scatter(buf, buf, idx, idx, rotate=True, src_start=0, dst_start=77, inv_freq=inv_freq,
                              w=w, backend=backend, **corr)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
def test_align_round_trip(backend, layout, device, gen):
    """Aligning by +d then by -d returns the input (rotations compose exactly)."""
    pool = torch.randn(96, 3, 64, generator=gen).to(device)
    idx = torch.arange(96, device=device)
    first, second, back = idx[:30], idx[32:62], idx[64:94]
    inv_freq = llama_inv_freq(48).to(device)
    kw = dict(rotate=True, inv_freq=inv_freq, rotary_dim=48, layout=layout, backend=backend)
    align_correct_scatter(pool, pool, first, second, src_start=100, dst_start=100 + 31337, **kw)
    assert not torch.allclose(pool[second], pool[first], atol=1e-2)
    align_correct_scatter(pool, pool, second, back, src_start=100 + 31337, dst_start=100, **kw)
    torch.testing.assert_close(pool[back], pool[first], atol=2e-5, rtol=1e-5)


def _dense_expected(src, src_idx, shift, dst_start, inv_freq, rotary_dim, layout, delta_sum, covered, rotate):
    """Direct float64 computation: rotation as complex multiplication, deltas reconstructed densely."""
    x = src[src_idx].to(torch.float64)
    heads, head_dim = x.shape[1:]
    half = rotary_dim // 2
    if layout == "interleaved":
        c1, c2 = torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)
    else:
        c1, c2 = torch.arange(half), torch.arange(half, rotary_dim)

    def rot(y, s):
        z = torch.complex(y[..., c1], y[..., c2]) * torch.polar(torch.ones(half, dtype=torch.float64),
                                                                s * inv_freq.to(torch.float64))
        out = y.clone()
        out[..., c1], out[..., c2] = z.real, z.imag
        return out

    corr = delta_sum.view(-1, heads, head_dim)[:covered]
    if rotate:
        x, corr = rot(x, shift), rot(corr, dst_start)
    x[:covered] += corr
    return x


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("low_rank", [True, False])
@pytest.mark.parametrize("rotate", [True, False])
def test_reference_matches_dense(layout, low_rank, rotate, gen):
    L, heads, head_dim, rd, vn, r, covered = 23, 2, 64, 32, 4, 8, 15
    src = torch.randn(64, heads, head_dim, generator=gen, dtype=torch.float64)
    dst = torch.zeros_like(src)
    src_idx, dst_idx = torch.randperm(64, generator=gen)[:L], torch.randperm(64, generator=gen)[:L]
    inv_freq = llama_inv_freq(rd)
    A = torch.randn(vn, covered, r, generator=gen, dtype=torch.float64)
    B = torch.randn(vn, r, heads * head_dim, generator=gen, dtype=torch.float64)
    w = torch.softmax(torch.randn(L, vn, generator=gen, dtype=torch.float64), dim=1).float()
    dense = torch.stack([A[v] @ B[v] for v in range(vn)])  # [Vn, Lc, D]
    delta_sum = sum(w[:covered, v, None].double() * dense[v] for v in range(vn))
    corr = dict(A=A, B=B) if low_rank else dict(delta=dense)
    align_correct_scatter_reference(src, dst, src_idx, dst_idx, AlignParams(
        rotate=rotate, src_start=9, dst_start=1234, inv_freq=inv_freq, layout=layout, w=w, covered=covered, **corr))
    expected = _dense_expected(src, src_idx, 1234 - 9, 1234, inv_freq, rd, layout, delta_sum, covered, rotate)
    torch.testing.assert_close(dst[dst_idx], expected, atol=1e-10, rtol=1e-10)


@pytest.mark.triton
@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS[:2], ids=["fp32", "bf16"])
def test_all_layers_same_pools_through_either_path(dtype, atol, rtol, device, gen):
    """SGLang-shaped k_buffer / v_buffer lists end up with the same contents through Triton and torch."""
    layers, heads, head_dim, L, vn, r, page = 3, 3, 64, 41, 4, 16, 16
    k_pool = [torch.randn(160, heads, head_dim, generator=gen).to(dtype).to(device) for _ in range(layers)]
    v_pool = [torch.randn(160, heads, head_dim, generator=gen).to(dtype).to(device) for _ in range(layers)]
    src_idx, used = paged_indices(L, page, 10, gen)
    dst_idx, _ = paged_indices(L, page, 10, gen, exclude_pages=used)
    D = heads * head_dim
    fac = lambda *s: (0.1 * torch.randn(*s, generator=gen)).to(device)  # noqa: E731
    kw = dict(src_start=5, dst_start=300, inv_freq=llama_inv_freq(head_dim).to(device), covered=30,
              k_w=torch.softmax(fac(L, vn), 1), v_w=torch.softmax(fac(L, vn), 1),
              k_A=fac(layers, vn, 30, r), k_B=fac(layers, vn, r, D), v_A=fac(layers, vn, 30, r),
              v_B=fac(layers, vn, r, D))
    results = []
    for backend in ("triton", "torch"):
        ks, vs = [k.clone() for k in k_pool], [v.clone() for v in v_pool]
        align_correct_scatter_layers(ks, vs, src_idx.to(device), dst_idx.to(device), backend=backend, **kw)
        results.append((ks, vs))
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1]):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("bad,match", [
    (dict(layout="neox"), "layout"),
    (dict(rotary_dim=30), "inv_freq has"),
    (dict(inv_freq=None), "needs inv_freq"),
    (dict(w=None), "w must be"),
    (dict(covered=50), "covered"),
])
def test_bad_arguments_raise(bad, match, gen):
    src = torch.randn(64, 2, 64, generator=gen)
    idx = torch.arange(20)
    kw = dict(rotate=True, inv_freq=llama_inv_freq(64), A=torch.randn(2, 20, 8), B=torch.randn(2, 8, 128),
              w=torch.full((20, 2), 0.5))
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        align_correct_scatter(src, src, idx, idx + 20, backend="torch", **kw)


@pytest.mark.parametrize("low_rank", [True, False])
@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS, ids=["fp32", "bf16", "fp16"])
def test_layers_torch_path_matches_per_layer_float64_reference(low_rank, dtype, atol, rtol, gen):
    """The CPU serving path (all layers batched, fp32) against the float64 reference run layer by layer."""
    layers, heads, head_dim, L, vn, r, covered = 3, 2, 64, 29, 3, 8, 21
    k_pool = [torch.randn(96, heads, head_dim, generator=gen).to(dtype) for _ in range(layers)]
    v_pool = [torch.randn(96, heads, head_dim, generator=gen).to(dtype) for _ in range(layers)]
    src_idx, dst_idx = torch.randperm(48, generator=gen)[:L], 48 + torch.randperm(48, generator=gen)[:L]
    D = heads * head_dim
    if low_rank:
        fk = dict(k_A=0.3 * torch.randn(layers, vn, covered, r, generator=gen),
                  k_B=0.3 * torch.randn(layers, vn, r, D, generator=gen))
        fv = dict(v_A=0.3 * torch.randn(layers, vn, covered, r, generator=gen),
                  v_B=0.3 * torch.randn(layers, vn, r, D, generator=gen))
    else:
        fk = dict(k_delta=0.1 * torch.randn(layers, vn, covered, D, generator=gen))
        fv = dict(v_delta=0.1 * torch.randn(layers, vn, covered, D, generator=gen))
    kw = dict(src_start=7, dst_start=3000, inv_freq=llama_inv_freq(48), rotary_dim=48,
              k_w=torch.softmax(torch.randn(L, vn, generator=gen), 1),
              v_w=torch.softmax(torch.randn(L, vn, generator=gen), 1), covered=covered)
    ks, vs = [k.clone() for k in k_pool], [v.clone() for v in v_pool]
    align_correct_scatter_layers(ks, vs, src_idx, dst_idx, backend="torch", **kw, **fk, **fv)
    for layer in range(layers):
        for pool, got, rot, w, f in ((k_pool, ks, True, kw["k_w"], fk), (v_pool, vs, False, kw["v_w"], fv)):
            want = pool[layer].clone()
            per_layer = {name[2:]: t[layer] for name, t in f.items()}
            align_correct_scatter_reference(pool[layer], want, src_idx, dst_idx, AlignParams(
                rotate=rot, src_start=7, dst_start=3000, inv_freq=kw["inv_freq"], rotary_dim=48, w=w,
                covered=covered, **per_layer))
            torch.testing.assert_close(got[layer].float(), want.float(), atol=atol, rtol=rtol)
