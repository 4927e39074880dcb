"""Assembled rows whose recompute is still owed: the cache's side of the sparse extend.

With the sparse extend (``--kvshare-sparse-extend``), a reused segment's head
rows are assembled with the rest of the segment, inserted in the tree's
estimate namespace, and recomputed by the request's next prefill forward
(``server.sparse_extend``), which writes the recomputed KV into the same pool
slots. Between the two, the tree holds rows that are not yet what the
request's setting promises.

Why a registry of slots and not only a list on the request: another request
with the same tokens may match those estimate rows before the first one's
forward ran (it waited a round, or was aborted). It then *adopts* the owed
rows and recomputes them itself; recomputing a row twice in the same context
gives the same KV, serving it unrecomputed would not. A slot leaves the
registry when a forward recomputed it, or when the tree evicts its node.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from sglang_kvshare.counters import Counters


class PendingRecompute:
    """Pool slots of estimate rows a forward must still recompute (the scheduler's thread only).

    ``counters`` (the cache's): where the forwards that recompute them count
    their cost, per phase in ``/kvshare/stats``.
    """

    def __init__(self, counters: Optional[Counters] = None) -> None:
        self._slots: set[int] = set()
        self.counters = counters

    def __len__(self) -> int:
        return len(self._slots)

    def owe(self, slots: Iterable[int]) -> None:
        """Rows just assembled whose recompute is owed."""
        self._slots.update(int(s) for s in slots)

    def owed_positions(self, slots: torch.Tensor, start: int) -> list[int]:
        """Positions ``start + i`` of the request's rows ``slots[i]`` still owed a recompute."""
        if not self._slots or slots.numel() == 0:
            return []
        return [start + i for i, s in enumerate(slots.tolist()) if s in self._slots]

    def settle(self, slots: Iterable[int]) -> None:
        """Rows recomputed by a forward, or freed with their node: nothing owed any more."""
        if self._slots:
            self._slots.difference_update(int(s) for s in slots)

    def clear(self) -> None:
        self._slots.clear()

    def forward_done(self, rows: int, fold_seconds: float) -> None:
        """A prefill forward recomputed ``rows`` owed rows; folding them in took ``fold_seconds``."""
        if self.counters is not None:
            self.counters.add("sparse_forwards")
            self.counters.add("sparse_rows_recomputed", rows)
            self.counters.add("sparse_fold_seconds", fold_seconds)
