"""How a gate decision is made once for every tensor-parallel rank.

Why: under tensor parallelism each rank holds the KV (and learns the anchors)
of its own KV heads only, so each rank's gate distances cover a share of the
heads. Decided rank by rank, the accept/reject and the activated anchors
could differ, and ranks would serve KV corrected with different anchors
(wrong) and go on with pools that drift apart (the next collective hangs).
Reduced first, every rank sees the distances over all heads, the same numbers
as one rank holding every head would compute (the squared gate distance is a
sum over heads; a token distance is a mean over equally many dims per rank),
and takes the same decision.

``LocalReducer`` is the single-rank case (no-op). The server builds a
``GroupReducer`` over SGLang's TP CPU group (``server.tp_gate``); this module
imports no SGLang.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Optional, Protocol

import torch

__all__ = ["Reducer", "LocalReducer", "GroupReducer", "RanksDisagree", "decision_digest"]


class RanksDisagree(RuntimeError):
    """The ranks reached one reduce with tensors of different shapes: their pools differ.

    Raised on every rank at once (each sees the same reduced shape check), so
    every rank can take the same way out (the estimator empties its pools).
    """


class Reducer(Protocol):
    """Sums and means across the ranks that share one gate decision; every rank calls each in the same order."""

    size: int

    def sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def mean(self, t: torch.Tensor) -> torch.Tensor: ...


class LocalReducer:
    """One rank holds every head: nothing to reduce."""

    size = 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return t


MAX_DIMS = 4  # the distances reduced are 1-D or 2-D


class GroupReducer:
    """All-reduce over a ``torch.distributed`` CPU (gloo) group, in float64 so every rank gets the same bits.

    ``group`` is resolved on first use (a callable returning the group): the
    cache is built before SGLang's scheduler holds its TP group.
    """

    def __init__(self, group: Callable[[], Any], size: int) -> None:
        if size < 2:
            raise ValueError(f"a group reducer needs at least two ranks, got {size}")
        self._group_fn = group
        self._group: Optional[Any] = None
        self.size = size
        self.calls = 0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the ranks; ``RanksDisagree`` on every rank when a rank's ``t`` has
        another shape (checked first, so no rank reduces a tensor the others do not have)."""
        import torch.distributed as dist

        if self._group is None:
            self._group = self._group_fn()
        shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
        bounds = torch.tensor([t.dim(), *shape, -t.dim(), *(-x for x in shape)], dtype=torch.int64)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self._group)
        half = MAX_DIMS + 1
        if not torch.equal(bounds[:half], -bounds[half:]):
            raise RanksDisagree(f"tensor-parallel ranks reduce different shapes (this rank {tuple(t.shape)})")
        buf = t.detach().to("cpu", torch.float64).contiguous()
        dist.all_reduce(buf, group=self._group)
        self.calls += 1
        return buf.to(device=t.device, dtype=t.dtype)

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return self.sum(t) / self.size


def decision_digest(previous: int, slot: Any, reason: str, anchor_ids: list[int], entropy: Optional[float]) -> int:
    """A running CRC of gate decisions: equal on every rank exactly when the ranks decided alike."""
    record = f"{slot}|{reason}|{','.join(map(str, anchor_ids))}|{'' if entropy is None else f'{entropy:.9f}'}"
    return zlib.crc32(record.encode(), previous)
