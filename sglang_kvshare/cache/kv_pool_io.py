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


def read_segment(kvcache, indices: torch.Tensor, dtype: torch.dtype | None = None,
                 workspace: "ReadWorkspace | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of K and V at ``indices`` (int64 pool slots) for every layer, in ``dtype`` (default: the pool's).

    One gather per layer straight into the result (no stacked temporaries).
    With ``workspace`` the result is a view of its buffers, valid until the
    next read through it.
    """
    idx = indices.to(torch.int64)
    layers = pool_layers(kvcache)
    out = []
    for which, get in enumerate((kvcache.get_key_buffer, kvcache.get_value_buffer)):
        first = get(layers[0])
        shape = (len(layers), idx.numel(), *first.shape[1:])
        out_dtype = dtype or first.dtype
        dst = (workspace.take(which, shape, out_dtype, first.device) if workspace is not None
               else torch.empty(shape, dtype=out_dtype, device=first.device))
        for i, layer in enumerate(layers):
            buf = get(layer)
            if dst.dtype == buf.dtype:
                torch.index_select(buf, 0, idx, out=dst[i])
            else:
                dst[i].copy_(buf[idx])
        out.append(dst)
    return out[0], out[1]


class ReadWorkspace:
    """Two grow-only buffers that ``read_segment`` gathers into, reused from request to request.

    Why: a 1K segment's K and V are 2 x 23.6 MiB on the 135M model; fresh
    tensors of that size come as fresh pages from the kernel on every read, and
    faulting them in cost more than the gather itself on the CPU server. For one
    reader at a time (the scheduler thread); a read returns views that the next
    read overwrites. Segments longer than ``max_rows`` are read into fresh
    tensors, so the buffers stay at most ``max_rows`` rows long.
    """

    def __init__(self, max_rows: int = 4096) -> None:
        self.max_rows = max_rows
        self._bufs: list[torch.Tensor | None] = [None, None]

    def take(self, which: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` ([layers, rows, ...]) whose ``[i]`` slices are contiguous."""
        rows = shape[1]
        if rows > self.max_rows:
            return torch.empty(shape, dtype=dtype, device=device)
        buf = self._bufs[which]
        if (buf is None or buf.shape[0] != shape[0] or buf.shape[2:] != shape[2:] or buf.shape[1] < rows
                or buf.dtype != dtype or buf.device != device):
            buf = torch.empty((shape[0], max(rows, 256), *shape[2:]), dtype=dtype, device=device)
            self._bufs[which] = buf
        return buf[:, :rows]

    def nbytes(self) -> int:
        """What the two buffers hold now."""
        return sum(b.numel() * b.element_size() for b in self._bufs if b is not None)

    def max_nbytes(self, kvcache) -> int:
        """The most the two buffers can grow to for ``kvcache`` (``max_rows`` rows of K and V, every layer)."""
        return pair_nbytes(kvcache, self.max_rows, pool_dtype(kvcache)) // 2


def learning_copy_dtype(kvcache) -> torch.dtype:
    """The dtype the learner's K/V copies are kept in while they wait in its queue.

    Why float16 for a float32 pool (the CPU path): a queued observation of 1K
    tokens holds four copies of every layer (94 MiB on the 135M model in
    float32), and the bounded queue dropped a chain's third edge. float16 halves
    that; its rounding (2^-11 of a value) moved the factorized deltas by 0.3 %
    (deltas of 4 % of the values, tests/cache/test_learning_copies.py), far
    below what the rank-r truncation drops.
    The worker computes in the pool's dtype again. Pools in 16 bits already
    (GPU: bf16/fp16) are copied as they are.
    """
    dtype = pool_dtype(kvcache)
    return torch.float16 if dtype == torch.float32 else dtype


def pair_nbytes(kvcache, rows: int, dtype: torch.dtype) -> int:
    """Bytes ``read_pair`` allocates for ``rows`` rows in ``dtype``: K and V of a source and a target, every layer."""
    first = kvcache.get_key_buffer(pool_layers(kvcache)[0])
    per_row = first[0].numel() * torch.tensor([], dtype=dtype).element_size()
    return 4 * len(pool_layers(kvcache)) * rows * per_row


def pool_dtype(kvcache) -> torch.dtype:
    return kvcache.get_key_buffer(pool_layers(kvcache)[0]).dtype


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


def read_pair(kvcache, src_idx: torch.Tensor, dst_idx: torch.Tensor,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Copies of a source segment and of the target rows of the same length: ``k_src, v_src, k_dst, v_dst``.

    Synchronized on both sides: the source rows may still be in flight on the
    forward stream, and the learner's thread must not read the copies early.
    """
    sync_device(src_idx)
    k_src, v_src = read_segment(kvcache, src_idx, dtype)
    k_dst, v_dst = read_segment(kvcache, dst_idx[:k_src.shape[1]], dtype)
    sync_device(k_src)
    return k_src, v_src, k_dst, v_dst
