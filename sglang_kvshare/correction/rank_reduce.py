"""How a gate decision is made once for every tensor-parallel rank.

Why: under tensor parallelism each rank holds the KV (and learns the anchors)
of its own KV heads only, so each rank's gate distances cover a share of the
heads. Decided rank by rank, the accept/reject and the activated anchors
could differ, and ranks would serve KV corrected with different anchors
(wrong) and go on with pools that drift apart. Reduced first, every rank sees
the distances over all heads, the same numbers as one rank holding every head
would compute (the squared gate distance is a sum over heads; a token distance
is a mean over equally many dims per rank), and takes the same decision.

The rule that keeps the ranks in step: every rank makes every collective of a
decision, whatever its own pool or errors say. ``agree`` comes first (the
ranks compare what each would do, one small reduce), then the distances are
reduced only when every rank can weigh them. A rank never returns early while
another waits in a collective.

``LocalReducer`` is the single-rank case (no-op). The server builds a
``GroupReducer`` over SGLang's TP CPU group (``server.plugin.tp_gate_reducer``); it
communicates over a gloo group of its own whose every wait has a deadline
(``GATE_TIMEOUT_S``). After a missed deadline, a closed connection or a
decision the ranks reached out of step, the reducer never communicates again
(``RanksUnreachable`` from every later call), so every rank falls back to dense
prefill, and SGLang's own collectives never see one of the gate's half done.
This module imports no SGLang.
"""

from __future__ import annotations

import datetime
import logging
import zlib
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

__all__ = ["Reducer", "LocalReducer", "GroupReducer", "RanksDisagree", "RanksUnreachable", "decision_digest",
           "decision_key", "GATE_TIMEOUT_S"]

logger = logging.getLogger(__name__)

GATE_TIMEOUT_S = 60.0
"""The longest a rank waits for the others in one of the gate's collectives. Ranks reach a gate together (every
batch's forward syncs them), so only a rank that will never come waits this long."""


class RanksDisagree(RuntimeError):
    """The ranks reached one ``sum`` with tensors of different shapes: raised on every rank at once (each sees the
    same reduced shape check), so every rank can take the same way out."""


class RanksUnreachable(RuntimeError):
    """The ranks can no longer decide together: a collective missed its deadline, a rank's connection closed, or
    the ranks reached different decisions (one skipped a gate). Raised by that call and by every later one."""


class Reducer(Protocol):
    """What the ranks that share one gate decision compute together; every rank calls each in the same order."""

    size: int

    def agree(self, key: int, values: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per entry of ``values``, its minimum and maximum over the ranks (equal where every rank agrees).

        ``key`` names the decision (equal on every rank that reaches the same one); ``RanksUnreachable`` when it
        differs between the ranks: they are out of step.
        """
        ...

    def sum(self, t: torch.Tensor, shape_agreed: bool = False) -> torch.Tensor:
        """The elementwise sum over the ranks; ``shape_agreed``: the ranks already agreed on ``t``'s shape."""
        ...

    def mean(self, t: torch.Tensor) -> torch.Tensor: ...


class LocalReducer:
    """One rank holds every head: nothing to reduce."""

    size = 1

    def agree(self, key: int, values: Sequence[int]) -> tuple[list[int], list[int]]:
        return list(values), list(values)

    def sum(self, t: torch.Tensor, shape_agreed: bool = False) -> torch.Tensor:
        return t

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return t


FRAME_VALUES = 16  # the values one frame carries: a gate's agreement, a tensor's rank and shape
_AGREE, _SUM = 1, 2  # what a frame announces


class GroupReducer:
    """All-reduces over a gloo group of the ranks of ``group``, in float64 so every rank gets the same bits.

    ``group`` is resolved on first use (a callable returning the group): the
    cache is built before SGLang's scheduler holds its TP group. The reducer's
    own group is made then, among those ranks only, with ``timeout_s`` as the
    deadline of every wait.
    """

    def __init__(self, group: Callable[[], Any], size: int, timeout_s: float = GATE_TIMEOUT_S) -> None:
        if size < 2:
            raise ValueError(f"a group reducer needs at least two ranks, got {size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._group_fn = group
        self._group: Optional[Any] = None
        self.size = size
        self.timeout_s = timeout_s
        self.calls = 0
        self.failed: Optional[str] = None
        """Why this reducer stopped communicating (None while it works)."""

    def agree(self, key: int, values: Sequence[int]) -> tuple[list[int], list[int]]:
        return self._frame(_AGREE, key, values)

    def sum(self, t: torch.Tensor, shape_agreed: bool = False) -> torch.Tensor:
        """The elementwise sum over the ranks; ``RanksDisagree`` on every rank when a rank's ``t`` has another
        shape (checked in the frame sent first, so no rank reduces a tensor the others do not have).
        ``shape_agreed``: the ranks already agreed on ``t``'s shape, so a difference means they are out of step."""
        if t.dim() >= FRAME_VALUES:
            raise ValueError(f"sum takes tensors of fewer than {FRAME_VALUES} dimensions, got {t.dim()}")
        lo, hi = self._frame(_SUM, 0, [t.dim(), *t.shape])
        if lo != hi:
            if shape_agreed:
                self._fail("the ranks reduced tensors of different shapes where their shapes were agreed")
            raise RanksDisagree(f"tensor-parallel ranks reduce different shapes (this rank {tuple(t.shape)})")
        buf = self._all_reduce(t.detach().to("cpu", torch.float64).contiguous(), max_op=False)
        self.calls += 1
        return buf.to(device=t.device, dtype=t.dtype)

    def _frame(self, kind: int, key: int, values: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per entry of ``values``, its minimum and maximum over the ranks, in a frame of one fixed size.

        Why a fixed size: gloo aborts the process when two ranks reduce buffers of different lengths, so every
        collective starts with this frame (what it is, its key, how many values) and a payload follows only
        once every rank's frame matched. Ranks whose frames differ are out of step: ``RanksUnreachable`` on every
        rank, at once.
        """
        if len(values) > FRAME_VALUES:
            raise ValueError(f"a frame holds at most {FRAME_VALUES} values, got {len(values)}")
        row = torch.zeros(3 + FRAME_VALUES, dtype=torch.int64)
        row[:3] = torch.tensor([kind, key, len(values)], dtype=torch.int64)
        row[3:3 + len(values)] = torch.tensor(list(values), dtype=torch.int64)
        both = self._all_reduce(torch.cat([row, -row]), max_op=True)
        hi, lo = both[:row.numel()], -both[row.numel():]
        if not torch.equal(hi[:3], lo[:3]):
            self._fail("the ranks reached different collectives (a rank skipped one)")
        n = int(hi[2])
        return lo[3:3 + n].tolist(), hi[3:3 + n].tolist()

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return self.sum(t) / self.size

    def _all_reduce(self, buf: torch.Tensor, max_op: bool) -> torch.Tensor:
        import torch.distributed as dist

        if self.failed is not None:
            raise RanksUnreachable(self.failed)
        try:
            if self._group is None:
                self._group = _own_group(self._group_fn(), self.timeout_s)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX if max_op else dist.ReduceOp.SUM, group=self._group)
        except Exception as exc:  # noqa: BLE001 - a deadline, a closed connection: the same way out on every rank
            self._fail(f"a gate collective failed: {type(exc).__name__}: {str(exc)[:200]}")
        return buf

    def _fail(self, why: str) -> None:
        """Stop communicating for good and raise: a rank that came late would pair its collective with another."""
        if self.failed is None:
            logger.error("sglang-kvshare: tensor-parallel gate: %s; every kvcmas gate of this rank prefills densely "
                         "from now on (restart the server to correct again)", why)
            self.failed = why
        raise RanksUnreachable(self.failed)


def _own_group(base: Any, timeout_s: float) -> Any:
    """A gloo group of ``base``'s ranks whose waits end after ``timeout_s``; made by those ranks alone."""
    import torch.distributed as dist

    return dist.new_group(ranks=dist.get_process_group_ranks(base), backend="gloo",
                          timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=True)


def decision_digest(previous: int, slot: Any, reason: str, anchor_ids: list[int], entropy: Optional[float]) -> int:
    """A running CRC of gate decisions: equal on every rank exactly when the ranks decided alike."""
    record = f"{slot}|{reason}|{','.join(map(str, anchor_ids))}|{'' if entropy is None else f'{entropy:.9f}'}"
    return zlib.crc32(record.encode(), previous)


def decision_key(*parts: Any) -> int:
    """A key naming one decision (``Reducer.agree``) from parts that are equal on every rank."""
    return zlib.crc32("|".join(map(str, parts)).encode())
