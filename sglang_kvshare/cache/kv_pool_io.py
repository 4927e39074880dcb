"""Read one segment's K/V in SGLang's KV pool, for every layer at once.

Why a module of its own: it is the only place that knows the pool's layout
(``get_key_buffer(layer)`` rows indexed by pool slot, layers offset by
``start_layer``), so a change of SGLang's pool API is one diff here.
Writes go through ``kv_writer`` (the kernels dispatcher). Shapes follow the correction library: ``[num_layers, L, kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch


def pool_layers(kvcache) -> range:
    start = getattr(kvcache, "start_layer", 0) or 0
    return range(start, start + kvcache.layer_num)


def read_segment(kvcache, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of K and V at ``indices`` (int64 pool slots) for every layer."""
    idx = indices.to(torch.int64)
    ks = [kvcache.get_key_buffer(layer)[idx] for layer in pool_layers(kvcache)]
    vs = [kvcache.get_value_buffer(layer)[idx] for layer in pool_layers(kvcache)]
    return torch.stack(ks), torch.stack(vs)


def sync_device(tensor: torch.Tensor) -> None:
    """Wait for every stream of ``tensor``'s CUDA device (no-op on CPU).

    Why device-wide: with SGLang's overlap scheduling the forward of a batch
    runs on its own stream while the scheduler already prepares the next one,
    so KV rows a checkpoint just published may not be written yet, and rows we
    write must land before the next forward reads them. Called around every
    read of source rows and after every write (once per assembly or
    observation, not per layer).
    """
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def read_pair(kvcache, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of a source segment and of the target rows of the same length: ``k_src, v_src, k_dst, v_dst``.

    Synchronized on both sides: the source rows may still be in flight on the
    forward stream, and the learner's thread must not read the copies early.
    """
    sync_device(src_idx)
    k_src, v_src = read_segment(kvcache, src_idx)
    k_dst, v_dst = read_segment(kvcache, dst_idx[:k_src.shape[1]])
    sync_device(k_src)
    return k_src, v_src, k_dst, v_dst
