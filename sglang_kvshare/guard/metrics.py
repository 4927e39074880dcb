"""Prometheus export of the fidelity guard (``sglang_kvshare_guard_*`` on SGLang's ``/metrics``).

The guard lives in the HTTP process, which SGLang runs under prometheus_client's
multiprocess mode like the scheduler: gauges written here are merged into the
same ``/metrics``. Per scope: the estimates (mean and both ends of the 95 %
interval), the sample count and the setting in force (the recomputed head, -1
for dense). Label sets are bounded: at most ``MAX_SCOPE_LABELS`` scopes carry
their own labels, the most recently verified ones; a scope that leaves that set
has its series removed, so a dashboard never shows a stale estimate. Counters: verification outcomes and setting changes
by reason. Refreshed after each verification and each pin, never per request.
"""

from __future__ import annotations

from typing import Any

PREFIX = "sglang_kvshare_guard_"
MAX_SCOPE_LABELS = 32
BOUNDS = ("mean", "low", "high")


class GuardMetrics:
    """The guard's gauges and counters; one per process (tests pass their own ``registry``)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Gauge(PREFIX + name, doc, labelnames=labels, multiprocess_mode="mostrecent", registry=registry)

        self.top1 = gauge("top1", "Top-1 agreement with the dense reference, per scope: the running mean and the "
                          "ends of its 95 % interval (bound=mean|low|high).", ("scope", "bound"))
        self.kl = gauge("kl", "KL(reference || served) over the top-k, per generated token, per scope "
                        "(bound=mean|low|high).", ("scope", "bound"))
        self.samples = gauge("samples", "Verified requests behind the scope's current estimates.", ("scope",))
        self.setting = gauge("setting_head", "Recomputed head the scope is served under; -1 = dense.", ("scope",))
        self.queue = gauge("queue_jobs", "Verified requests waiting for their dense reference.")
        self.events = Counter(PREFIX + "events", "Guard events: sampled, verified, probes, dropped_queue_full, "
                              "verify_errors, ...", labelnames=("event",), registry=registry)
        self.actions = Counter(PREFIX + "actions", "Setting changes by reason (target_missed, undecided_below, "
                               "within_band, met_with_margin, pinned, unpinned).", labelnames=("reason",),
                               registry=registry)
        self._labelled: set[str] = set()
        self._counted: dict[str, int] = {}
        self._actions: dict[str, int] = {}

    def update(self, per_scope: dict[str, dict], heads: dict[str, int], counters: dict[str, int],
               actions: dict[str, int], queue_jobs: int) -> None:
        """Bring every series up to the guard's state. ``per_scope``: ``Controller.scopes()`` by display name,
        most recently verified last; ``heads``: each scope's setting as a head (-1 dense)."""
        keep = list(per_scope)[-MAX_SCOPE_LABELS:]
        for scope in self._labelled - set(keep):
            for bound in BOUNDS:
                _remove(self.top1, scope, bound)
                _remove(self.kl, scope, bound)
            _remove(self.samples, scope)
            _remove(self.setting, scope)
        for scope in keep:
            state = per_scope[scope]
            for metric, gauge in (("top1", self.top1), ("kl", self.kl)):
                est = state[metric]
                if est["n"] >= 2:
                    low, high = est["ci95"]
                    for bound, value in zip(BOUNDS, (est["mean"], low, high)):
                        if value is not None:
                            gauge.labels(scope, bound).set(value)
            self.samples.labels(scope).set(state["samples"])
            self.setting.labels(scope).set(heads[scope])
        self._labelled = set(keep)
        self.queue.set(queue_jobs)
        _add(self.events, self._counted, counters)
        _add(self.actions, self._actions, actions)


def _remove(gauge: Any, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:  # never set (an estimate below two samples)
        pass


def _add(counter: Any, last: dict[str, int], now: dict[str, int]) -> None:
    """Add each key's increase since the previous call (the guard's counters only grow)."""
    for key, value in now.items():
        delta = value - last.get(key, 0)
        if delta > 0:
            counter.labels(key).inc(delta)
        last[key] = value
