"""Event counters shared by the scheduler thread and the learning thread.

Why a class with a lock: the learner adds to the same counters the admin
snapshot iterates, and a plain dict changing size mid-iteration is an
intermittent 500. Reads return a copy.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator


class Counters:
    """Named float counters; ``add`` and ``snapshot`` are safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = defaultdict(float)

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._values[name] += value

    def get(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0.0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: (round(v, 6) if isinstance(v, float) and not v.is_integer() else int(v))
                    for k, v in self._values.items()}

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to ``<phase>_seconds`` (a Prometheus phase)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(f"{phase}_seconds", time.perf_counter() - t0)
