"""Triton kernels for the correction and the gate, each with a torch reference (installed as sglang_kvshare.kernels).

Layer: below the cache, above nothing; imports torch (and Triton, lazily) only.
Use the dispatcher functions re-exported here; each op module
(``align_correct``, ``gate_distances``, ``token_distances``) holds one Triton
kernel and its launcher, ``reference`` the torch versions with the same
signatures (the CPU path, and in float64 the yardstick of the tests), ``rope``
the one key rotation of the project (the correction library uses it too).
"""

from .dispatch import (
    Backend,
    align_correct_scatter,
    align_correct_scatter_layers,
    gate_from_sq_distances,
    gate_sq_distances,
    gate_sq_distances_dense,
    token_distances,
    token_distances_dense,
    token_gate_distances,
    token_weights,
    triton_available,
)

__all__ = [
    "Backend",
    "align_correct_scatter",
    "align_correct_scatter_layers",
    "gate_from_sq_distances",
    "gate_sq_distances",
    "gate_sq_distances_dense",
    "token_distances",
    "token_distances_dense",
    "token_gate_distances",
    "token_weights",
    "triton_available",
]
