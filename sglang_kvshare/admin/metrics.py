"""Prometheus export of the kvshare counters (``sglang_kvshare_*`` on SGLang's ``/metrics``).

Why in the scheduler process: the counters live in the cache there. SGLang
runs prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``,
set before it spawns the scheduler): every process writes its samples to
files in that folder and the HTTP process's ``/metrics`` merges them. So the
scheduler only has to create the metrics and keep them current; SGLang
serves them. ``scheduler_hooks`` calls ``KVShareMetrics.update`` after prefill
batches and when idle (at most once a second), and after every admin call.

The cache's numbers are cumulative since its last ``/kvshare/reset``;
Prometheus counters must never go down, so ``update`` adds the increase since
the previous update and treats a drop as a reset (the new value is all new).
Its tables hold only what the current stats hold (at most ``MAX_SLOT_LABELS``
labels; the stats themselves are bounded by the registry's limits), so each
refresh costs time in proportion to the slots the cache keeps now.
"""

from __future__ import annotations

from typing import Any, Optional

from sglang_kvshare.config import MODES, KVShareConfig

PREFIX = "sglang_kvshare_"
MAX_SLOT_LABELS = 64  # slot labels at once (s0 ..): slot names come from requests, never a label
OTHER_SLOT = "_other"
RESOLVED_BY = ("hit", "alignment", "correction", "dense")
_RESOLVED_FIELD = {"hit": "resolved_hit", "alignment": "resolved_alignment",
                   "correction": "resolved_correction", "dense": "prefilled_dense"}


class KVShareMetrics:
    """The ``sglang_kvshare_*`` metrics of one scheduler process.

    Create it once per process (prometheus_client refuses duplicate names in
    one registry; tests pass their own ``registry``) after
    ``PROMETHEUS_MULTIPROC_DIR`` is set. Not thread-safe:
    call ``update`` from the scheduler thread only.
    """

    def __init__(self, registry: Any = None, dp_rank: int = 0) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry

        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Any:
            return Counter(PREFIX + name, doc, labelnames=labels, registry=registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = (), mode: str = "livesum") -> Any:
            return Gauge(PREFIX + name, doc, labelnames=labels, multiprocess_mode=mode, registry=registry)

        self.requests = counter("requests", "Annotated requests that carried a shared segment of this slot.",
                                ("slot", "dp_rank"))
        self.shared_tokens = counter("shared_tokens", "Shared-segment tokens seen, per slot.", ("slot", "dp_rank"))
        self.resolved_tokens = counter(
            "resolved_tokens", "Shared-segment tokens by how they were served: exact radix hit, "
            "re-alignment, correction, or dense prefill.", ("slot", "by", "dp_rank"))
        self.fallbacks = counter("fallbacks", "Shared segments prefilled densely, by reason.",
                                 ("slot", "reason", "dp_rank"))
        self.events = counter("events", "Cache-wide events (annotated_requests, observations, "
                              "internal_errors, alloc_failed, ...).", ("event",))
        self.seconds = counter("seconds", "Time spent in kvshare work, by phase.", ("phase",))
        self.anchors = gauge("anchors", "Anchors held in the slot's pool.", ("slot", "dp_rank"))
        self.anchor_bytes = gauge("anchor_bytes", "Bytes held by the slot's anchors.", ("slot", "dp_rank"))
        self.pool_bytes = gauge("pool_bytes", "Bytes held by all anchor pools together.")
        self.pending = gauge("pending_observations", "Dense prefills queued for anchor learning.")
        # Ratios do not add up over data-parallel ranks (each runs its own cache): one series per rank.
        self.gate_entropy = gauge("mean_gate_entropy", "Mean normalized entropy of the slot's gate decisions "
                                  "(kvcmas; since the last reset), per data-parallel rank.", ("slot", "dp_rank"),
                                  mode="mostrecent")
        self.reuse_ratio = gauge("reuse_ratio", "Shared tokens re-aligned or corrected / shared tokens seen "
                                 "(since the last reset), per data-parallel rank.", ("dp_rank",), mode="mostrecent")
        self.dp_rank = str(int(dp_rank))
        self.tau = gauge("tau", "Gate threshold in force.", mode="mostrecent")
        self.capacity = gauge("capacity", "Anchors per slot pool in force (V).", mode="mostrecent")
        self.mode = gauge("mode", "1 for the kvshare mode in force, 0 for the others.", ("mode",), mode="mostrecent")
        self._last: dict[tuple, float] = {}
        self._seen: set[tuple] = set()
        self._slot_labels: dict[str, str] = {}
        self._gauged_slots: set[str] = set()

    # ------------------------------------------------------------ public
    def update(self, stats: dict, config: Optional[KVShareConfig] = None) -> None:
        """Bring every metric up to ``stats`` (``KVShareRadixCache.kvshare_admin.stats()``)."""
        self._seen: set[tuple] = set()
        slots: dict[str, dict] = stats.get("slots", {})
        anchors: dict[str, float] = {}
        anchor_bytes: dict[str, float] = {}
        for name in self._slot_labels.keys() - slots.keys():  # first: their labels go to this update's new slots
            del self._slot_labels[name]
        for name, s in slots.items():
            label = s["metric_label"] = self._label(name)  # the admin read returns these stats: its map
            self._count(self.requests, (label, self.dp_rank), ("req", name), s.get("requests", 0))
            self._count(self.shared_tokens, (label, self.dp_rank), ("tok", name), s.get("shared_tokens_seen", 0))
            for by in RESOLVED_BY:
                self._count(self.resolved_tokens, (label, by, self.dp_rank), ("by", name, by),
                            s.get(_RESOLVED_FIELD[by], 0))
            for reason, n in (s.get("fallbacks") or {}).items():
                self._count(self.fallbacks, (label, str(reason), self.dp_rank), ("fb", name, reason), n)
            mean = s.get("mean_gate_entropy")
            if mean is not None:
                self.gate_entropy.labels(label, self.dp_rank).set(mean)
            anchors[label] = anchors.get(label, 0) + s.get("anchors", 0)
            anchor_bytes[label] = anchor_bytes.get(label, 0) + s.get("anchor_bytes", 0)
        for key, value in (stats.get("counters") or {}).items():
            if key.endswith("_seconds"):
                self._count(self.seconds, (key[: -len("_seconds")],), ("s", key), value)
            else:
                self._count(self.events, (key,), ("ev", key), value)
        # NOTE: a slot gone from the stats (reset, or evicted from the bounded registry) counts from 0 if it
        # comes back, so its last values are dropped: these tables hold only the slots the stats hold now.
        for key in self._last.keys() - self._seen:
            del self._last[key]
        for label in self._gauged_slots - set(anchors):  # slots emptied by a reset
            self.anchors.labels(label, self.dp_rank).set(0)
            self.anchor_bytes.labels(label, self.dp_rank).set(0)
        for label, n in anchors.items():
            self.anchors.labels(label, self.dp_rank).set(n)
            self.anchor_bytes.labels(label, self.dp_rank).set(anchor_bytes[label])
        self._gauged_slots = set(anchors)
        self.pool_bytes.set(stats.get("anchor_bytes", 0))
        self.pending.set(stats.get("pending_observations", 0))
        self.reuse_ratio.labels(self.dp_rank).set(stats.get("reuse_ratio", 0.0))
        if config is not None:
            self.tau.set(config.tau)
            self.capacity.set(config.effective_capacity)
            for m in MODES:
                self.mode.labels(m).set(1 if config.mode == m else 0)

    # ------------------------------------------------------------ helpers
    def _label(self, slot: str) -> str:
        """The slot's label: ``s0`` .. ``s{MAX_SLOT_LABELS - 1}``, the lowest one free, else ``OTHER_SLOT``.

        Why not the slot's name: it is a string clients choose, and ``/metrics`` is served without a key. A
        label freed when its slot leaves the stats goes to the next new slot, so the series stay bounded in
        prometheus_client's multiprocess mode too (where a series, once written, is never removed);
        ``/kvshare/stats`` names each slot's label (``metric_label``).
        """
        label = self._slot_labels.get(slot)
        if label is None:
            used = set(self._slot_labels.values())
            label = next((f"s{i}" for i in range(MAX_SLOT_LABELS) if f"s{i}" not in used), OTHER_SLOT)
            if label != OTHER_SLOT:
                self._slot_labels[slot] = label
        return label

    def _count(self, counter: Any, labels: tuple, key: tuple, value: float) -> None:
        value = float(value or 0)
        self._seen.add(key)
        last = self._last.get(key, 0.0)
        delta = value - last if value >= last else value  # a drop means the cache was reset
        self._last[key] = value
        if delta > 0:
            counter.labels(*labels).inc(delta)
