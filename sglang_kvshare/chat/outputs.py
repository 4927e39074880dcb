"""Answers the server generated, remembered so that they can come back as shared messages.

Why: an agent framework sends another agent's answer back as message *text*.
The KV computed while generating it belongs to the generated ids; the cache
can reuse it only if the consumer's message has exactly those ids. This
memory maps (namespace, text) to the generated ids and the slot they were
shared under, so the chat hooks can tell whether a message is an earlier
answer and whether re-tokenizing its text reproduces the ids (counted in
``OutputMemory.counters``; the automatic mode reuses only when it does).

Namespaced by ``(cache_salt, extra_key, lora)``: an answer produced for one
tenant or adapter is never even looked up for another. Bounded (LRU).
No SGLang imports.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence


DEFAULT_CAPACITY = 4096
DEFAULT_MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class OutputRecord:
    ids: tuple[int, ...]
    slot: str


def record_bytes(namespace: Hashable, text: str, ids: Sequence[int]) -> int:
    """What one remembered answer holds, roughly: its text (UTF-8), its ids and its key."""
    return len(text.encode("utf-8", "replace")) + 8 * len(ids) + len(repr(namespace)) + 64


class OutputMemory:
    """A thread-safe LRU of remembered answers with hit counters, bounded in answers and in bytes.

    An answer larger than the whole byte budget is not remembered (counted).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._records: OrderedDict[tuple[Hashable, str], OutputRecord] = OrderedDict()
        self._sizes: dict[tuple[Hashable, str], int] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.counters = {"remembered": 0, "seen_again": 0, "retokenized_equal": 0, "too_large": 0}

    def remember(self, namespace: Hashable, text: str, ids: Sequence[int], slot: str) -> None:
        size = record_bytes(namespace, text, ids)
        with self._lock:
            if size > self.max_bytes:
                self.counters["too_large"] += 1
                return
            key = (namespace, text)
            self._bytes -= self._sizes.pop(key, 0)
            self._records[key] = OutputRecord(tuple(int(t) for t in ids), slot)
            self._records.move_to_end(key)
            self._sizes[key] = size
            self._bytes += size
            while len(self._records) > self.capacity or self._bytes > self.max_bytes:
                old, _ = self._records.popitem(last=False)
                self._bytes -= self._sizes.pop(old)
            self.counters["remembered"] += 1

    def lookup(self, namespace: Hashable, text: str, retokenized: Sequence[int],
               slot: Optional[str] = None) -> Optional[tuple[OutputRecord, bool]]:
        """The record for ``text`` (of ``slot`` when given) and whether ``retokenized`` equals its ids.

        Counts every hit and every hit whose re-tokenization matches.
        """
        with self._lock:
            rec = self._records.get((namespace, text))
            if rec is None or (slot is not None and rec.slot != slot):
                return None
            self._records.move_to_end((namespace, text))
            equal = tuple(retokenized) == rec.ids
            self.counters["seen_again"] += 1
            self.counters["retokenized_equal"] += int(equal)
            return rec, equal

    def stats(self) -> dict:
        with self._lock:
            seen = self.counters["seen_again"]
            return {**self.counters, "size": len(self._records), "capacity": self.capacity,
                    "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "retokenized_equal_ratio": self.counters["retokenized_equal"] / seen if seen else None}
