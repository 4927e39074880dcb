"""The sparse extend on SGLang's triton attention backend (GPU): the folded rows expressed as a custom mask.

``sparse_extend`` folds a request's owed rows in front of its own tokens and
sets their true positions; the torch-native backend then places each query at
its position. SGLang's triton extend kernel cannot move a query, but it takes
a per-request custom mask over ``[its queries] x [its prefix keys, its extend
keys]`` (speculative decoding's verify uses it). So the same forward is
expressed as a mask:

* the kernel's prefix is every row of the request below its own tokens
  (``seq_len - own``), read from the pool: the folded rows' slots included,
  which hold their new KV because SGLang writes a layer's KV before its
  attention;
* a folded row's query at position ``p`` may see the prefix keys ``0..p`` and
  no extend key (its own and the other folded rows' new KV are already in the
  prefix);
* the request's own tokens see the whole prefix and each other causally; the
  folded rows among the extend keys are masked (they are in the prefix).

Each recomputed row thus attends to every row before it, reused or
recomputed, and the request's tokens to all of it: the torch-native sparse
extend's attention (``sparse_sdpa_extend``), one forward, SGLang's kernel.
``own`` is read from the positions: the longest run at the end of the
request's rows whose positions count up to ``seq_len - 1``. A folded row just
below the request's tokens joins that run, which is the same attention (it
sees the rows before it and is seen by the ones after).

Cost: one ``[extend] x [prefix + extend]`` boolean mask per request (150
recomputed rows and 100 own tokens over 1,000 rows: 250 x 1,250 bytes, about
310 KB), one host copy of the positions per sparse forward, and the kernel's
masked prefix stage (tiles with nothing visible are skipped).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import torch

MOVED_ATTR = "_kvshare_sparse_mask"  # the backend's flag for the forward whose metadata carries the mask


class RequestLayout(NamedTuple):
    """One request of a sparse forward: the kernel's prefix rows, its extend rows, how many of those are folded."""

    prefix: int
    extend: int
    folded: int


class MaskMetadata(NamedTuple):
    """What replaces the triton backend's extend metadata for a sparse forward."""

    kv_indptr: torch.Tensor  # int32 [bs + 1]: each request's kernel prefix in ``kv_indices``
    kv_indices: torch.Tensor  # int64: the prefix rows' pool slots, request after request
    custom_mask: torch.Tensor  # bool, flat: each request's [extend, prefix + extend] mask, row-major
    mask_indptr: torch.Tensor  # int64 [bs + 1]: where each request's mask starts


def request_layouts(positions: Sequence[int], extend_lens: Sequence[int], seq_lens: Sequence[int]
                    ) -> list[RequestLayout]:
    """Per request: its own run (the trailing rows at ``seq_len - own .. seq_len - 1``), the folded rows before.

    Raises ``ValueError`` when a request's rows do not end at its last position (not a sparse forward of
    ``sparse_extend``: the mask would be wrong, so nothing is served from it).
    """
    out, start = [], 0
    for extend, seq in zip(extend_lens, seq_lens):
        rows = positions[start:start + extend]
        own = 0
        while own < extend and rows[extend - 1 - own] == seq - 1 - own:
            own += 1
        if own == 0 and extend:
            raise ValueError(f"a request's last row sits at {rows[-1]}, not at its last position {seq - 1}")
        folded = extend - own
        if any(p >= seq - own for p in rows[:folded]):
            raise ValueError("a folded row lies at or after the request's own tokens")
        out.append(RequestLayout(seq - own, extend, folded))
        start += extend
    return out


def request_mask(positions: torch.Tensor, layout: RequestLayout) -> torch.Tensor:
    """The request's ``[extend, prefix + extend]`` mask (module docstring), on ``positions``' device."""
    device = positions.device
    q_pos = positions.to(torch.int64)[:, None]
    prefix = torch.arange(layout.prefix, device=device)[None, :] <= q_pos
    idx = torch.arange(layout.extend, device=device)
    extend = (idx[None, :] <= idx[:, None]) & (idx[None, :] >= layout.folded)
    return torch.cat([prefix, extend], dim=1)


def mask_metadata(positions: torch.Tensor, extend_lens: Sequence[int], seq_lens: Sequence[int],
                  req_to_token: torch.Tensor, pool_rows: Sequence[int]) -> MaskMetadata:
    """The kernel prefixes and masks of a sparse forward (``positions``: the forward's, one per extend row)."""
    layouts = request_layouts(positions.tolist(), extend_lens, seq_lens)
    device = req_to_token.device
    indices, masks, start = [], [], 0
    for row, layout in zip(pool_rows, layouts):
        indices.append(req_to_token[row, :layout.prefix].to(torch.int64))
        masks.append(request_mask(positions[start:start + layout.extend].to(device), layout).flatten())
        start += layout.extend
    kv_indptr = torch.zeros(len(layouts) + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(torch.tensor([lay.prefix for lay in layouts], device=device), 0)
    mask_indptr = torch.zeros(len(layouts) + 1, dtype=torch.int64, device=device)
    mask_indptr[1:] = torch.cumsum(torch.tensor([m.numel() for m in masks], device=device), 0)
    return MaskMetadata(kv_indptr, torch.cat(indices) if indices else torch.empty(0, dtype=torch.int64,
                                                                                    device=device),
                        torch.cat(masks) if masks else torch.empty(0, dtype=torch.bool, device=device), mask_indptr)


def after_triton_init_forward_metadata(result: Any, self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``TritonAttnBackend.init_forward_metadata``: a sparse forward's metadata carries the mask instead
    of SGLang's causal prefix + extend layout (which would read the wrong prefix rows)."""
    from sglang_kvshare.server.sparse_extend import queries_moved

    moved = forward_batch.forward_mode.is_extend() and queries_moved(forward_batch)
    setattr(self, MOVED_ATTR, moved)
    if not moved:
        return result
    bs = len(forward_batch.extend_seq_lens_cpu)
    meta = mask_metadata(forward_batch.positions.cpu(), forward_batch.extend_seq_lens_cpu,
                         forward_batch.seq_lens_cpu[:bs].tolist(), self.req_to_token,
                         forward_batch.req_pool_indices[:bs].tolist())
    self.forward_metadata = dataclasses.replace(self.forward_metadata, kv_indptr=meta.kv_indptr,
                                                kv_indices=meta.kv_indices, custom_mask=meta.custom_mask,
                                                mask_indptr=meta.mask_indptr)
    return result


def around_triton_forward_extend(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    """AROUND ``TritonAttnBackend.forward_extend``: the kernel applies the mask to the prefix keys too."""
    if not getattr(self, MOVED_ATTR, False):
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        raise ValueError("the sparse extend on triton serves full-attention layers only")
    kernel = self.extend_attention_fwd
    self.extend_attention_fwd = functools.partial(kernel, skip_prefix_custom_mask=False)
    try:
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        self.extend_attention_fwd = kernel
