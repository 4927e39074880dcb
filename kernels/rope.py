"""Rotary position alignment shared by the kernels and their references (torch only).

A key cached after RoPE at position ``p`` is needed at ``p + shift``: rotating it
by ``shift`` is exact because rotations compose. The angle ``shift * inv_freq``
is computed in float64 and rounded once (ALGORITHM.md section 2); with shifts
of tens of thousands of positions an fp32 angle would be off by about 1e-3 rad.
The rotation itself runs in fp32 (float64 only for float64 input or when a
reference asks for it): the one rotation of the project, used by the kernels'
references and by ``sglang_kvshare.correction.rope``.

Layouts (both pair dimensions ``c1(j)`` and ``c2(j)`` that share ``inv_freq[j]``):

* ``rotate_half`` (Llama, HF default): pairs ``j`` and ``j + rotary_dim / 2``.
* ``interleaved`` (GPT-J, GGUF-native): pairs ``2 j`` and ``2 j + 1``.

Only the first ``rotary_dim`` dims of each head rotate (partial rotary); the
rest pass through. For either layout the rotated pair is
``(x1 cos - x2 sin, x2 cos + x1 sin)``.
"""

from __future__ import annotations

from typing import Literal

import torch

Layout = Literal["rotate_half", "interleaved"]
LAYOUTS: tuple[str, ...] = ("rotate_half", "interleaved")


def check_rotary(inv_freq: torch.Tensor, head_dim: int, rotary_dim: int | None, layout: str) -> int:
    """Validate the rotary settings against a head size and return ``rotary_dim``.

    ``inv_freq``: [rotary_dim / 2], any float dtype, any device.
    Raises ValueError with what to pass instead.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if inv_freq.dim() != 1:
        raise ValueError(f"inv_freq must be 1-D [rotary_dim/2], got shape {tuple(inv_freq.shape)}")
    if rotary_dim is None:
        rotary_dim = 2 * inv_freq.numel()
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    if inv_freq.numel() != rotary_dim // 2:
        raise ValueError(f"inv_freq has {inv_freq.numel()} entries, rotary_dim={rotary_dim} needs {rotary_dim // 2}")
    return rotary_dim


def rotation_cos_sin(inv_freq: torch.Tensor, shift: int, device: torch.device | None = None,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``shift * inv_freq``, computed in float64, returned as ``dtype``: two [rotary_dim/2]."""
    angle = float(shift) * inv_freq.to(device=device, dtype=torch.float64)
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def pair_slices(rotary_dim: int, layout: str) -> tuple[slice, slice]:
    """Columns (within one head) of the two members of each rotary pair, as slices (views, no gather)."""
    if layout == "interleaved":
        return slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    return slice(0, rotary_dim // 2), slice(rotary_dim // 2, rotary_dim)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the torch paths compute in: float64 stays float64, everything else runs in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rotate(x: torch.Tensor, shift: int, inv_freq: torch.Tensor, rotary_dim: int | None = None,
           layout: Layout = "rotate_half", compute: torch.dtype | None = None) -> torch.Tensor:
    """Rotate keys ``x`` [..., head_dim] by ``shift`` positions; returns a new tensor in ``compute`` dtype.

    ``compute`` defaults to ``compute_dtype(x.dtype)`` (fp32, or float64 for
    float64 input); the references pass float64 to be the yardstick. The angle
    is always formed in float64 and rounded once to ``compute``. Does not
    mutate ``x``; dims past ``rotary_dim`` are copied unchanged.
    """
    rotary_dim = check_rotary(inv_freq, x.shape[-1], rotary_dim, layout)
    compute = compute or compute_dtype(x.dtype)
    cos, sin = rotation_cos_sin(inv_freq, shift, x.device, compute)
    c1, c2 = pair_slices(rotary_dim, layout)
    x = x.to(compute)
    out = torch.empty_like(x)
    x1, x2, o1, o2 = x[..., c1], x[..., c2], out[..., c1], out[..., c2]
    # NOTE: written into the output's halves in place (two passes each, no temporaries):
    # with fresh temporaries a [30, 1024, 3, 64] rotation took 8x as long on the CPU.
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out
