"""The sparse extend: a reused segment's head rows recomputed inside the request's one prefill forward.

Why: a recomputed head (EPIC) as a stage costs a scheduling round and a
forward of its own per segment; at a few hundred shared tokens that costs
more than the reuse saves. Here the head rows are assembled with the rest of
the segment (``cache.recompute.PendingRecompute`` keeps them owed) and the request's
next prefill forward carries them in front of its own tokens: each at its
true position, attending to every row before it, reused or recomputed, and
writing its recomputed KV over the assembled rows' slots. One forward, any
number of heads; the KV is that of the staged head.

How, with SGLang's own machinery and nothing of the scheduler changed:

* AROUND ``ForwardBatch.init_new``: a request owing rows below its prefix gets
  them *folded* into the batch SGLang builds the forward from (a copy of the
  ``ScheduleBatch``, as SGLang's own encoder-SWA replay folds rows): their
  tokens before the request's extend, their slots in ``out_cache_loc``, its
  prefix shortened and its extend lengthened by as many, its logprob start
  moved with them (the sampled token and any logprobs stay those of the
  request's own last tokens). Then the forward's positions are set to the
  rows' true positions.
* AROUND ``TorchNativeAttnBackend.forward_extend``: for a forward whose
  positions are not its prefix plus arange (``queries_moved``, decided once
  per forward when the backend's metadata is built) the attention places each query at its position (``sparse_sdpa_extend``) instead
  of at the end of the sequence. SGLang's own KV write runs first, as always,
  so a recomputed row is read back at its slot with its new KV.

A backend without this support gets staged heads (``unsupported_reason``, in
the report's ``sparse_fallback``). Every prefill forward of an annotated
request is counted in its report (``prefill_forwards``).
"""

from __future__ import annotations

import functools
import logging
import time
from copy import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang_kvshare.cache import recompute
from sglang_kvshare.cache.plan import plan_of

logger = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("torch_native", "triton")  # triton: as a custom mask (``sparse_extend_triton``)


def prefill_backend() -> Optional[str]:
    """The attention backend of this scheduler's prefill forwards, or None where it cannot be read."""
    try:
        from sglang.srt.runtime_context import attention_backends

        return attention_backends()[0]
    except Exception:  # noqa: BLE001 - read again (with its reason) by ``unsupported_reason``
        return None


def prefill_cuda_graph() -> str:
    """The prefill phase's CUDA-graph backend (``disabled`` when prefills run eagerly), or ``unknown``."""
    try:
        from sglang.srt.runtime_context import get_exec

        return str(get_exec().graph.cuda_graph_config.prefill.backend)
    except Exception:  # noqa: BLE001 - an unknown graph setup is served staged heads
        return "unknown"


def unsupported_reason(model_config: Any = None) -> Optional[str]:
    """Why this scheduler process cannot run the sparse extend, or None when it can (read at cache build)."""
    try:
        from sglang.srt.runtime_context import attention_backends, get_server_args

        prefill_backend = attention_backends()[0]
        args = get_server_args()
    except Exception as exc:  # noqa: BLE001 - an unknown setup is served staged heads
        return f"backend_unknown: {type(exc).__name__}"
    if prefill_backend not in SUPPORTED_BACKENDS:
        return f"attention backend {prefill_backend} has no sparse extend (supported: {', '.join(SUPPORTED_BACKENDS)})"
    if prefill_backend == "triton":
        hf_config = getattr(model_config, "hf_config", None)
        if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True):
            return "triton: sliding-window attention"
        if getattr(args, "enable_deterministic_inference", False):
            return "triton: --enable-deterministic-inference (its unified kernel takes no prefix mask)"
        if (getattr(args, "dcp_size", 1) or 1) > 1:
            return "triton: decode context parallelism"
        graph = prefill_cuda_graph()
        if graph != "disabled":
            return (f"triton: the prefill CUDA graph ({graph}) replays without the sparse mask; "
                    "--disable-prefill-cuda-graph serves the sparse extend")
    if getattr(args, "speculative_algorithm", None):
        return "speculative decoding"
    if getattr(args, "enable_mixed_chunk", False):
        return "--enable-mixed-chunk"
    if getattr(args, "enable_dp_attention", False):
        return "--enable-dp-attention"
    return None


@dataclass
class Fold:
    """The rows folded into one forward: per request, the owed positions below its prefix."""

    rows: list[list[int]]

    @property
    def total(self) -> int:
        return sum(len(r) for r in self.rows)


def owed_rows(batch: Any) -> Optional[Fold]:
    """The rows each request of a prefill ``batch`` owes below its prefix, or None when none owes any.

    Also counts the forward in every annotated request's plan (its report's ``prefill_forwards``).
    """
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if batch.forward_mode != ForwardMode.EXTEND or not batch.reqs:
        return None
    rows: list[list[int]] = []
    for req, prefix_len in zip(batch.reqs, batch.prefix_lens):
        plan = plan_of(req)
        if plan is None:
            rows.append([])
            continue
        plan.state.prefill_forwards += 1
        rows.append([p for p in plan.state.sparse_rows if p < prefix_len])
    fold = Fold(rows)
    return fold if fold.total else None


def fold_batch(batch: Any, fold: Fold, req_to_token: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """A copy of ``batch`` with each request's owed rows in front of its extend, and the true positions.

    ``batch`` itself is not changed (``ForwardBatch.init_new`` must not mutate it).
    """
    device = batch.out_cache_loc.device
    pool_rows = _pool_rows(batch)
    ids, cpu_ids, locs, positions = [], [], [], []
    off = 0
    for i, req in enumerate(batch.reqs):
        rows, n, pre = fold.rows[i], batch.extend_lens[i], batch.prefix_lens[i]
        if rows:
            tokens = [req.full_untruncated_fill_ids[p] for p in rows]
            where = torch.tensor(rows, dtype=torch.int64, device=req_to_token.device)
            locs.append(req_to_token[pool_rows[i], where].to(device=device, dtype=batch.out_cache_loc.dtype))
            if batch.input_ids is not None:
                ids.append(torch.tensor(tokens, dtype=batch.input_ids.dtype, device=batch.input_ids.device))
            if batch.prefill_input_ids_cpu is not None:
                cpu_ids.append(torch.tensor(tokens, dtype=batch.prefill_input_ids_cpu.dtype))
            positions.append(torch.tensor(rows, dtype=torch.int64))
        if batch.input_ids is not None:
            ids.append(batch.input_ids[off:off + n])
        if batch.prefill_input_ids_cpu is not None:
            cpu_ids.append(batch.prefill_input_ids_cpu[off:off + n])
        locs.append(batch.out_cache_loc[off:off + n])
        positions.append(torch.arange(pre, pre + n, dtype=torch.int64))
        off += n
    folded = copy(batch)
    folded.input_ids = torch.cat(ids) if batch.input_ids is not None else None
    folded.prefill_input_ids_cpu = torch.cat(cpu_ids) if batch.prefill_input_ids_cpu is not None else None
    folded.out_cache_loc = torch.cat(locs)
    folded.prefix_lens = [p - len(r) for p, r in zip(batch.prefix_lens, fold.rows)]
    folded.extend_lens = [n + len(r) for n, r in zip(batch.extend_lens, fold.rows)]
    folded.extend_num_tokens = batch.extend_num_tokens + fold.total
    if batch.extend_logprob_start_lens is not None:
        folded.extend_logprob_start_lens = [s + len(r) for s, r in zip(batch.extend_logprob_start_lens, fold.rows)]
    return folded, torch.cat(positions)


def settle(batch: Any, fold: Fold, req_to_token: torch.Tensor) -> Optional[Any]:
    """The folded rows are recomputed by this forward: nothing owed any more, counted in each report.

    Returns the registry they were owed in (the cache's ``PendingRecompute``), or None.
    """
    pool_rows = _pool_rows(batch)
    registry = None
    for i, req in enumerate(batch.reqs):
        rows = fold.rows[i]
        plan = plan_of(req)
        if not rows or plan is None:
            continue
        where = torch.tensor(rows, dtype=torch.int64, device=req_to_token.device)
        recompute.settle(plan, rows, req_to_token[pool_rows[i], where].tolist())
        if plan.state.owed is not None:
            registry = plan.state.owed
    return registry


def _pool_rows(batch: Any) -> list[int]:
    """The requests' rows in ``req_to_token`` (from the host copy when SGLang keeps one: no device sync)."""
    cpu = getattr(batch, "req_pool_indices_cpu", None)
    return (cpu if cpu is not None else batch.req_pool_indices).tolist()


def around_init_new(original, cls, batch, model_runner, *args, **kwargs):
    """AROUND ``ForwardBatch.init_new``: fold owed rows into a prefill forward (module docstring)."""
    try:
        fold = owed_rows(batch)
    except Exception:  # noqa: BLE001 - never fail a forward because of kvshare
        logger.exception("sglang-kvshare: reading the owed rows failed; the forward runs as SGLang built it")
        fold = None
    if fold is None:
        return original(cls, batch, model_runner, *args, **kwargs)
    t0 = time.perf_counter()
    req_to_token = model_runner.req_to_token_pool.req_to_token
    folded, positions = fold_batch(batch, fold, req_to_token)
    seconds = time.perf_counter() - t0
    forward_batch = original(cls, folded, model_runner, *args, **kwargs)
    forward_batch.positions = positions.to(device=forward_batch.positions.device, dtype=forward_batch.positions.dtype)
    owed = settle(batch, fold, req_to_token)
    if owed is not None:
        owed.forward_done(fold.total, seconds)
    return forward_batch


MOVED_ATTR = "_kvshare_queries_moved"  # set on the backend once per forward (``after_init_forward_metadata``)


def after_init_forward_metadata(result, self, forward_batch, *args, **kwargs):
    """AFTER ``TorchNativeAttnBackend.init_forward_metadata``: whether this forward's queries moved, decided
    once per forward instead of in every layer's attention."""
    setattr(self, MOVED_ATTR, queries_moved(forward_batch))
    return result


def around_torch_native_forward_extend(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    """AROUND ``TorchNativeAttnBackend.forward_extend``: a sparse forward's queries sit at their positions."""
    if not getattr(self, MOVED_ATTR, False):
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    # NOTE: an instance attribute shadows the method for this call only; SGLang's KV write and argument
    # handling stay its own.
    self._run_sdpa_forward_extend = functools.partial(sparse_sdpa_extend, positions=forward_batch.positions)
    try:
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        del self._run_sdpa_forward_extend


def queries_moved(forward_batch: Any) -> bool:
    """Whether some query of this prefill forward sits elsewhere than its request's prefix plus its index.

    Why from the data and not from a mark on the batch: SGLang's eager runner
    copies the batch into its static buffers field by field before the model
    runs, so an attribute set in ``init_new`` does not reach the attention;
    the positions do. A stock forward's positions are exactly
    ``prefix + arange``, so it keeps SGLang's own attention.
    """
    positions, lens = forward_batch.positions, forward_batch.extend_seq_lens
    if positions is None or lens is None or forward_batch.extend_prefix_lens is None:
        return False
    n = int(lens.sum())
    first = forward_batch.extend_start_loc if forward_batch.extend_start_loc is not None else (
        torch.cumsum(lens, 0) - lens)
    offset = torch.repeat_interleave((forward_batch.extend_prefix_lens - first).to(torch.int64), lens.to(torch.int64),
                                     output_size=n)
    expected = offset + torch.arange(n, device=positions.device)
    return not torch.equal(positions[:n].to(torch.int64), expected)


def sparse_sdpa_extend(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                       encoder_lens: Optional[torch.Tensor] = None, scaling: Optional[float] = None,
                       enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
                       sliding_window_size: Optional[int] = None, *, positions: torch.Tensor) -> torch.Tensor:
    """Extend attention whose queries sit at ``positions`` (one per query row) instead of the sequence's end.

    Same arguments as ``TorchNativeAttnBackend._run_sdpa_forward_extend``,
    and the same computation: each request's queries are placed in a query
    matrix as long as its sequence, causal attention runs over all of it, and
    the query rows are read back; only *where* they are placed differs (at
    their positions, not after the prefix). So a query at position ``p``
    attends to the request's rows ``0..p`` (within the sliding window, if any),
    read from the pool through ``req_to_token``, where the rows this forward
    writes already hold their new KV; and a sparse forward costs what SGLang's
    own extend of the same sequence costs.
    """
    if not causal or is_cross_attn or encoder_lens is not None:
        raise ValueError("the sparse extend serves causal self-attention of decoder-only models")
    q = query.movedim(0, 1)  # [heads, tokens, dim]
    start = 0
    for i in range(seq_lens.shape[0]):
        n, s = int(extend_seq_lens[i]), int(seq_lens[i])
        pos = positions[start:start + n].to(device=q.device, dtype=torch.int64)
        rows = req_to_token[req_pool_indices[i], :s]
        keys = k_cache[rows].movedim(0, 1)  # [kv heads, s, dim]
        values = v_cache[rows].movedim(0, 1)
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        placed = q.new_zeros((q.shape[0], s, q.shape[2]))
        placed[:, pos] = q[:, start:start + n]
        mask, is_causal = None, True
        if sliding_window_size is not None and sliding_window_size > -1:
            k_pos = torch.arange(s, device=q.device)
            mask = (k_pos[None, :] <= k_pos[:, None]) & (k_pos[None, :] >= k_pos[:, None] - sliding_window_size)
            is_causal = False
        out = torch.nn.functional.scaled_dot_product_attention(
            placed[None], keys[None], values[None], attn_mask=mask, is_causal=is_causal, scale=scaling,
            enable_gqa=enable_gqa)
        output[start:start + n] = out[0][:, pos].movedim(0, 1)
        start += n
    return output
