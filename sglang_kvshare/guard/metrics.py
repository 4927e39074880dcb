"""Prometheus export of the fidelity guard (``sglang_kvshare_guard_*`` on SGLang's ``/metrics``).

The guard lives in the HTTP process, which SGLang runs under prometheus_client's
multiprocess mode like the scheduler: gauges written here are merged into the
same ``/metrics``. Per scope: the estimates (mean and both ends of the 95 %
interval), the sample count and the setting in force (the recomputed head, -1
for dense). Refreshed after each verification and each pin, never per request.

Per-scope series are labelled by **slot** (``slot="0"`` .. ``MAX_SCOPE_LABELS - 1``),
never by the scope's name. Why: in multiprocess mode every label set ever
written stays in the process's file (``Gauge.remove`` does not reach it), so
labels drawn from an open set (agent names, digests of namespaces) grow the
export without bound; and ``/metrics`` is served without a key, so a label must
carry nothing a client chose. The most recently verified scopes hold the
slots; a scope keeps its slot while it stays among them, a slot it leaves is
given to the next scope, and a slot nobody holds reads NaN (a comparison with
it is false: no alert fires on an empty slot). ``GET /kvshare/fidelity`` (admin
key) shows each scope's slot. Counters: verification outcomes and setting
changes by reason (fixed sets of names).
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Optional

PREFIX = "sglang_kvshare_guard_"
MAX_SCOPE_LABELS = 32
BOUNDS = ("mean", "low", "high")
SLOTS = tuple(str(i) for i in range(MAX_SCOPE_LABELS))


class GuardMetrics:
    """The guard's gauges and counters; one per process (tests pass their own ``registry``)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Gauge(PREFIX + name, doc, labelnames=labels, multiprocess_mode="mostrecent", registry=registry)

        self.top1 = gauge("top1", "Top-1 agreement with the dense reference, per scope slot (GET /kvshare/fidelity "
                          "names its scope): the running mean and the ends of its 95 % interval (bound=mean|low|high).",
                          ("slot", "bound"))
        self.kl = gauge("kl", "KL(reference || served) over the top-k, per generated token, per scope slot "
                        "(bound=mean|low|high).", ("slot", "bound"))
        self.samples = gauge("samples", "Verified requests behind the slot's scope's current estimates.", ("slot",))
        self.setting = gauge("setting_head", "Recomputed head the slot's scope is served under; -1 = dense.",
                             ("slot",))
        self.queue = gauge("queue_jobs", "Verified requests waiting for their dense reference.")
        self.events = Counter(PREFIX + "events", "Guard events: sampled, verified, probes, dropped_queue_full, "
                              "verify_errors, ...", labelnames=("event",), registry=registry)
        self.actions = Counter(PREFIX + "actions", "Setting changes by reason (target_missed, undecided_below, "
                               "within_band, met_with_margin, pinned, unpinned).", labelnames=("reason",),
                               registry=registry)
        self._slots: dict[Hashable, int] = {}  # scope -> slot, at most MAX_SCOPE_LABELS
        self._written: set[int] = set()  # slots whose series hold a scope's values
        self._counted: dict[str, int] = {}
        self._actions: dict[str, int] = {}

    def slot(self, scope: Hashable) -> Optional[int]:
        """The slot whose series show ``scope``, or None (not among the most recently verified)."""
        return self._slots.get(scope)

    def update(self, per_scope: dict[Hashable, dict], heads: dict[Hashable, int], counters: dict[str, int],
               actions: dict[str, int], queue_jobs: int) -> None:
        """Bring every series up to the guard's state. ``per_scope``: ``Controller.scopes()``, most recently
        verified last (its keys are never exported); ``heads``: each scope's setting as a head (-1 dense)."""
        keep = list(per_scope)[-MAX_SCOPE_LABELS:]
        self._slots = {s: i for s, i in self._slots.items() if s in set(keep)}
        free = sorted(set(range(MAX_SCOPE_LABELS)) - set(self._slots.values()))
        for scope in keep:
            if scope not in self._slots:
                self._slots[scope] = free.pop(0)
        for scope, i in self._slots.items():
            state, slot = per_scope[scope], SLOTS[i]
            for metric, gauge in (("top1", self.top1), ("kl", self.kl)):
                est = state[metric]
                values = (est["mean"], *est["ci95"]) if est["n"] >= 2 else (None,) * 3
                for bound, value in zip(BOUNDS, values):
                    gauge.labels(slot, bound).set(math.nan if value is None else value)
            self.samples.labels(slot).set(state["samples"])
            self.setting.labels(slot).set(heads[scope])
        for i in self._written - set(self._slots.values()):  # a slot left empty: its old scope's values go
            for gauge in (self.top1, self.kl):
                for bound in BOUNDS:
                    gauge.labels(SLOTS[i], bound).set(math.nan)
            self.samples.labels(SLOTS[i]).set(math.nan)
            self.setting.labels(SLOTS[i]).set(math.nan)
        self._written = set(self._slots.values())
        self.queue.set(queue_jobs)
        _add(self.events, self._counted, counters)
        _add(self.actions, self._actions, actions)


def _add(counter: Any, last: dict[str, int], now: dict[str, int]) -> None:
    """Add each key's increase since the previous call (the guard's counters only grow)."""
    for key, value in now.items():
        delta = value - last.get(key, 0)
        if delta > 0:
            counter.labels(key).inc(delta)
        last[key] = value
