"""Exact RoPE re-alignment of cached keys (ALGORITHM.md section 2).

Keys are cached after RoPE. A key computed at position ``p`` and needed at
``p'`` is rotated by ``p' - p`` with the model's own inverse frequencies,
rotary dims and layout. Rotations compose, so this is exact up to rounding; the
angle is formed in float64 and rounded once.

The **canonical frame** of a segment puts its token ``t`` at position ``t``
(the segment starts at 0). Deltas between caches of one segment seen at
different offsets are stored in that frame, so they do not depend on where
the segment sat.

Tensor convention: keys are ``[..., L, kv_heads, head_dim]`` (token axis is
``-3``); a whole segment over all layers is ``[num_layers, L, kv_heads,
head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_kvshare.kernels.rope import Layout, check_rotary, rotate

__all__ = [
    "RopeSpec",
    "UnsupportedAttentionError",
    "rotate_keys",
    "to_canonical",
    "from_canonical",
]

# NOTE: these rope types change their frequencies with the running sequence
# length, so a key's rotation is not a pure function of its position.
_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}
_ALIBI_MODEL_TYPES = {"bloom", "mpt", "baichuan", "jais"}
_INTERLEAVED_MODEL_TYPES = {"gptj", "codegen", "chatglm", "glm"}


class UnsupportedAttentionError(ValueError):
    """The model's attention is not plain, position-only RoPE, so cached keys
    cannot be re-aligned exactly. Serve such a model with sharing off."""


@dataclass(frozen=True)
class RopeSpec:
    """Everything needed to rotate a cached key by a position offset.

    Attributes:
        inv_freq: float64 CPU tensor ``[rotary_dim // 2]``, the exact inverse
            frequencies the model's forward uses (scaling already applied).
        rotary_dim: number of leading head dims that are rotated (partial
            rotary models rotate fewer than ``head_dim``); the rest pass through.
        head_dim: size of one key head.
        layout: ``"rotate_half"`` pairs dim ``i`` with ``i + rotary_dim/2``
            (Llama, Qwen, Mistral); ``"interleaved"`` pairs ``2i`` with ``2i+1``
            (GPT-J style).
        attention_scaling: the factor the model multiplies cos/sin with (yarn);
            informational, a relative rotation never needs it.
    """

    inv_freq: torch.Tensor
    rotary_dim: int
    head_dim: int
    layout: Layout = "rotate_half"
    attention_scaling: float = 1.0

    def __post_init__(self) -> None:
        check_rotary(self.inv_freq, self.head_dim, self.rotary_dim, self.layout)  # the kernels' own validation

    @classmethod
    def default(cls, head_dim: int, theta: float = 10000.0, layout: Layout = "rotate_half",
                rotary_dim: int | None = None) -> "RopeSpec":
        """Plain RoPE, with frequencies rounded to float32 exactly as HF computes them."""
        rd = head_dim if rotary_dim is None else rotary_dim
        inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.int64).float() / rd))
        return cls(inv_freq=inv.double(), rotary_dim=rd, head_dim=head_dim, layout=layout)

    @classmethod
    def from_hf_config(cls, config: Any) -> "RopeSpec":
        """Read the rotary configuration of a transformers config.

        Reuses transformers' own ``ROPE_INIT_FUNCTIONS`` for scaled variants
        (linear, llama3, yarn, ...), so the frequencies are bit-identical to the
        model's forward. Raises ``UnsupportedAttentionError`` for ALiBi,
        sliding-window layers, multimodal RoPE and length-dependent scaling.
        """
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        model_type = getattr(config, "model_type", "")
        _refuse_unsupported(config, model_type)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = _rope_parameters(config)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise UnsupportedAttentionError(
                f"rope_type {rope_type!r} changes its frequencies with the sequence length; cached keys "
                "cannot be re-aligned exactly. Disable KV sharing for this model.")
        if "mrope_section" in params or rope_type in ("mrope", "3d", "multimodal"):
            raise UnsupportedAttentionError(
                "multimodal RoPE (M-RoPE) rotates by several position ids; re-alignment by one offset "
                "would be wrong. Disable KV sharing for this model.")
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        # GPT-J style configs name the rotated dims directly.
        rotary_dim = getattr(config, "rotary_dim", None) or int(head_dim * partial)
        scaling = 1.0
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise UnsupportedAttentionError(f"unknown rope_type {rope_type!r}; cannot align its keys")
            inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        layout: Layout = "interleaved" if _is_interleaved(config, model_type) else "rotate_half"
        return cls(inv_freq=inv.double().cpu(), rotary_dim=rotary_dim, head_dim=head_dim,
                   layout=layout, attention_scaling=float(scaling))


def rotate_keys(k: torch.Tensor, shift: int, spec: RopeSpec) -> torch.Tensor:
    """Move post-RoPE keys by ``shift`` positions; returns a new tensor.

    Args:
        k: ``[..., L, kv_heads, head_dim]`` keys, any float dtype and device.
        shift: the same offset for every token.
        spec: the model's rotary configuration.
    Returns: keys of the same shape and dtype; dims past ``rotary_dim`` untouched.
    The math is ``kernels.rope.rotate``: angles in float64 rounded once, the
    rotation in fp32 (float64 for float64 keys), one rounding to ``k.dtype``.
    """
    if k.shape[-1] != spec.head_dim:
        raise ValueError(f"key head_dim {k.shape[-1]} does not match RopeSpec.head_dim {spec.head_dim}")
    return rotate(k, int(shift), spec.inv_freq, spec.rotary_dim, spec.layout).to(k.dtype)


def to_canonical(k: torch.Tensor, start_pos: int, spec: RopeSpec) -> torch.Tensor:
    """Keys of a segment that started at ``start_pos`` -> canonical frame (start 0)."""
    return rotate_keys(k, -int(start_pos), spec)


def from_canonical(k: torch.Tensor, start_pos: int, spec: RopeSpec) -> torch.Tensor:
    """Canonical-frame keys -> keys of the segment placed at ``start_pos``."""
    return rotate_keys(k, int(start_pos), spec)


def _rope_parameters(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if "rope_theta" not in params and hasattr(config, "rope_theta"):
        params["rope_theta"] = config.rope_theta
    return params


def _refuse_unsupported(config: Any, model_type: str) -> None:
    if model_type in _ALIBI_MODEL_TYPES or getattr(config, "alibi", False) \
            or getattr(config, "position_embedding_type", None) == "alibi":
        raise UnsupportedAttentionError(
            f"{model_type or 'this model'} uses ALiBi position biases, not RoPE; cached keys cannot be "
            "re-aligned. Disable KV sharing for this model.")
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any("sliding" in str(t) for t in layer_types)
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        sliding = True
    if sliding:
        raise UnsupportedAttentionError(
            "the model has sliding-window attention layers; a shared segment's keys would be attended "
            "differently at a new offset. Disable KV sharing for this model.")
    if getattr(config, "mrope_section", None) is not None:
        raise UnsupportedAttentionError("multimodal RoPE (M-RoPE) is not supported; disable KV sharing.")


def _is_interleaved(config: Any, model_type: str) -> bool:
    for name in ("rope_interleave", "rotary_interleaved", "rope_interleaved"):
        if getattr(config, name, False):
            return True
    return model_type in _INTERLEAVED_MODEL_TYPES
