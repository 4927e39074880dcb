"""The fidelity guard in the HTTP process: sample, verify against a dense reference, keep each scope on target.

For an annotated request (``/generate`` with an annotation, or a chat request
kvshare annotated), ``Guard.prepare`` runs before SGLang sees it:

* it applies the request's scope setting (``controller``): a longer recomputed
  head (``recompute_head`` in the annotation) or ``dense`` (every shared
  segment ``reuse: false``);
* with probability ``--kvshare-verify-rate`` it asks SGLang for the request's
  own top-k next-token distributions (``return_logprob``, ``top_logprobs_num``),
  which the response does not carry unless the client asked for them; with a
  target and ``verify_burst``, always while the scope's setting has
  fewer verified or waiting requests than a decision needs
  (``Controller.wants_evidence``). A prefill-only request (``max_new_tokens=0``,
  as a client commits an answer) is never sampled: it has no output to judge.
  Nor is a request whose logprobs SGLang takes after changes a plain prefill
  does not make (penalties, ``min_new_tokens``, ``logit_bias``, a grammar, a
  temperature other than 1 or 0, a custom logit processor: ``_sampling_changes``),
  nor one with ``n > 1``; such a draw is counted (``skipped_sampling``,
  ``skipped_parallel``) and the request passes as it came.

The returned ``Collector`` watches the outputs as they pass, adds the guard's
part to the report (``kvshare.guard``: scope, setting, whether verified) and,
once the answer is finished and was served approximated KV, queues a job. A
single worker takes the jobs one at a time, waits until no user request is in
flight (at most ``IDLE_WAIT_S``), and sends the reference: the same prompt
plus the generated tokens, as a plain request (exact KV only: an unannotated
request never meets an estimate) with ``max_new_tokens=0`` and the input
top-k logprobs from the last prompt token on. ``measure.compare`` scores the
served distributions against it; the controller updates the scope's estimates
and may change its setting. The reference never delays a user's response, is
never an estimate, and waits in a bounded queue (a full one drops, counted).
A reference not answered within ``REFERENCE_WAIT_S`` is aborted, counted
(``verify_timeouts``) and named (``timed_out_references``); the next job runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import time
import uuid
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

from sglang_kvshare.config import KVShareConfig, live_config
from sglang_kvshare.guard.controller import DENSE, Action, Controller, ladder, setting_name, share_floor
from sglang_kvshare.guard.measure import compare
from sglang_kvshare.guard.saved import DEFAULT_NAMESPACE, GuardFile, SavedScope, parse_setting
from sglang_kvshare.guard.target import FidelityTarget
from sglang_kvshare.protocol import CUSTOM_PARAMS_KEY, MAX_NAME_CHARS, AnnotationError, parse_annotation

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 30.0  # a reference waits at most this long for no user request to be in flight
REFERENCE_WAIT_S = 120.0  # then at most this long for its answer: a stuck reference must not stop verification
TIMED_OUT_SHOWN = 16  # the last timed-out references named in the snapshot
# What SGLang adds to ``meta_info`` for ``return_logprob`` (``TokenizerManager.convert_logprob_style``): all of it
# leaves the response of a client that did not ask.
LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs",
                "output_token_ids_logprobs", "input_token_ids_logprobs", "output_token_logprobs_length")
# Sampling parameters at which SGLang's logprobs are those of the model's logits (a dense prefill's): any other
# value changes the logits before the logprobs are taken (``Sampler``: penalties, min_new_tokens, logit_bias and
# grammars in ``apply_logits_bias``, then the temperature; top-p, top-k and min-p only after).
NEUTRAL_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                    "min_new_tokens": 0}
CONSTRAINTS = ("logit_bias", "json_schema", "regex", "ebnf", "structural_tag")
GREEDY_TEMPERATURE = 1e-6  # below it SGLang samples greedily, from the unscaled logits (``SamplingParams``)
TOKEN_BYTES = 36  # a token id in a Python list: the int object and its pointer
ROW_BYTES = 160  # one (logprob, token id, text) entry of a top-k row
APPROXIMATED = ("tokens_aligned", "tokens_corrected", "tokens_estimate_hit")
EXACT_SCOPES_MAX = 1024  # scopes whose last sampled request was served exact KV, kept out of the burst


@dataclass
class Job:
    """One verified request: what it was served and what the reference needs."""

    scope: Hashable
    setting: int
    prompt: list[int]
    output: list[int]
    served: list
    manager: Any  # SGLang's TokenizerManager, which sends the reference
    lora_path: Any = None
    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None
    display: str = ""  # the scope as the admin view shows it: how a timed-out reference is named

    @property
    def approx_bytes(self) -> int:
        """What the job holds in Python objects, roughly: token ids and the served top-k rows."""
        return TOKEN_BYTES * (len(self.prompt) + len(self.output)) + ROW_BYTES * sum(len(r or ()) for r in self.served)


@dataclass
class Collector:
    """One annotated request's outputs as they pass; see the module docstring."""

    guard: "Guard"
    scope: Hashable
    display: str
    setting: int
    prompt: Optional[list[int]]
    sampled: bool
    strip: bool
    obj: Any
    manager: Any
    probe: bool = False  # a request of a dense scope served under the next looser setting
    finished: bool = False
    approximated: int = 0
    _dists: list = field(default_factory=list)
    _ids: list = field(default_factory=list)

    def observe(self, out: dict, incremental: bool) -> None:
        meta = out.get("meta_info") or {}
        reports = meta.get("kvshare")
        if reports and isinstance(reports[0], dict):
            report = reports[0]
            report["guard"] = {"scope": self.display, "setting": setting_name(self.setting),
                               "verified": self.sampled, "probe": self.probe}
            self.approximated = sum(int(report.get(k) or 0) for k in APPROXIMATED)
        if self.sampled:
            for parts, value in ((self._dists, meta.get("output_top_logprobs")), (self._ids, out.get("output_ids"))):
                if value is not None:
                    if incremental:
                        parts.append(list(value))
                    else:
                        parts[:] = [value]
        if self.strip:
            for key in LOGPROB_KEYS:
                meta.pop(key, None)
        if meta.get("finish_reason") is not None:
            self.finished = True

    def finish(self) -> None:
        """Queue the verification when the answer is complete and was served approximated KV."""
        if not self.sampled:
            return
        if not (self.finished and self.approximated and self.prompt):
            self.guard.release(self.scope)  # every sampled request waits until verified or dropped
            if self.finished and not self.approximated:
                self.guard.served_exact(self.scope)
            return
        output = [int(t) for part in self._ids for t in part]
        served = [row for part in self._dists for row in part]
        if not output or len(served) < len(output):
            self.guard.counters["verify_incomplete"] += 1
            self.guard.release(self.scope)
            return
        obj = self.obj
        self.guard.enqueue(Job(self.scope, self.setting, list(self.prompt), output, served[:len(output)],
                               self.manager, getattr(obj, "lora_path", None), getattr(obj, "extra_key", None),
                               getattr(obj, "cache_salt", None), self.display))


class Guard:
    """The HTTP process's guard: the controller, the sampler, the queue and its worker."""

    def __init__(self, seed: Optional[int] = None) -> None:
        self.counters: dict[str, int] = defaultdict(int)
        self._rng = random.Random(seed)
        self._key = os.urandom(16)  # names of namespaces and auto agents; with a guard file, derived from its key
        self._built_for: Optional[tuple] = None
        self.controller: Optional[Controller] = None
        self._queue: Optional[asyncio.Queue] = None
        self._worker: Optional[asyncio.Task] = None
        # Display name -> scope of the scopes served lately, so that any of them can be pinned by the name the admin
        # view shows; never read to name a scope (``_display`` derives the name from the scope itself).
        self._served: OrderedDict[str, Hashable] = OrderedDict()
        self.last_actions: list[dict] = []
        self._queued_bytes = 0
        self._waiting: dict[Hashable, int] = {}  # per scope: sampled requests not yet verified (in flight or queued)
        # Scopes whose last sampled request had nothing approximated (a producer that prefills its text first):
        # a burst there would only make SGLang compute logprobs nobody verifies; a rate draw that finds the scope
        # approximated lets it burst again.
        self._exact_scopes: OrderedDict[Hashable, None] = OrderedDict()
        self._metrics: Any = None  # GuardMetrics where SGLang runs with --enable-metrics; False where not
        self._file: Optional[GuardFile] = None  # --kvshare-fidelity-file: settings and pins across restarts
        self._timed_out: list[dict] = []  # the last references that did not answer in time, by rid and scope

    def attach_file(self, path: Optional[str]) -> None:
        """Keep the scopes' settings and pins in ``path`` (``guard.saved``), created at once when missing; raises
        ``GuardFileError`` for a file this server cannot use or create. Called once, at launch, in the HTTP process.

        The names the guard makes (a namespace's digest on the admin view, an automatic-mode agent's name) are then
        keyed from the file's key, so they stay the same across restarts and the pins made on them still apply;
        without a file, from a key of this process."""
        self._file = None if not path else GuardFile.create(path)
        self._key = os.urandom(16) if self._file is None else self._file.derived_key("names")

    @property
    def agent_key(self) -> bytes:
        """The key of automatic-mode agent names (``chat.annotation.auto_agent``); never shown."""
        return hashlib.blake2b(b"auto-agent", digest_size=16, key=self._key).digest()

    # ------------------------------------------------------------ configuration
    def _refresh(self, config: KVShareConfig) -> Controller:
        """The controller for the settings in force: a change of the recompute share, the minimum segment length
        (both set the ladder) or the target starts every scope afresh (its estimates measured other settings); a
        change of the minimum samples or the band applies as it is."""
        key = (config.recompute_ratio, config.min_reuse_tokens, config.fidelity_target)
        if self.controller is None or key != self._built_for:
            target = FidelityTarget.parse(config.fidelity_target) if config.fidelity_target else None
            steps = ladder(share_floor(config.recompute_ratio, config.min_reuse_tokens))
            self.controller = Controller(target, steps, min_samples=config.fidelity_min_samples,
                                         band=config.fidelity_band, parent=_outside_workflow)
            self._built_for = key
            if self._file is not None and not self._file.under(None if target is None else str(target),
                                                               self.controller.settings):
                self._write_file()  # the learned settings measured another target or ladder: only pins stay
        self.controller.min_samples = config.fidelity_min_samples
        self.controller.band = config.fidelity_band
        return self.controller

    def _scope(self, obj: Any, agent: str, workflow: Optional[str] = None) -> tuple[Hashable, str]:
        """The request's guard scope and its display name. A scope is a reuse scope plus an agent: the namespace
        (cache salt, extra key, LoRA) and, under ``--kvshare-reuse-scope workflow``, the workflow, since the
        agents of two workflows are served KV from different requests. A namespace without a workflow is the
        3-tuple a guard file digests (``guard.saved``), so files written before keep naming the same scopes."""
        namespace: tuple = (getattr(obj, "cache_salt", None), getattr(obj, "extra_key", None),
                            json.dumps(getattr(obj, "lora_path", None), default=str))
        if workflow and live_config().reuse_scope == "workflow":
            namespace += (workflow,)
        scope = (namespace, agent)
        if self._file is not None and self.controller is not None:
            for known in (scope, _outside_workflow(scope)):  # the scope, and the parent whose pin it follows
                if known is not None and not self.controller.known(known):
                    saved = self._file.scopes.get((self._file.namespace_id(known[0]), agent))
                    if saved is not None:
                        self.controller.restore(known, saved.setting, saved.pinned)
        display = self._display(scope)
        self._served[display] = scope
        self._served.move_to_end(display)
        while len(self._served) > 4 * (self.controller.max_scopes if self.controller else 256):
            self._served.popitem(last=False)
        return scope, display

    def _display(self, scope: Hashable) -> str:
        """How every output names ``scope``: its agent, and outside the default namespace a keyed digest of the
        namespace (the admin view tells namespaces apart without showing a salt, extra key or workflow). Derived
        from the scope alone, whatever the tables hold. A default-namespace agent whose own name holds an ``@``
        is shown with ``@-``, so no client can choose a name that reads as another namespace's agent: a salted
        display ends in ``@`` and sixteen hex digits."""
        namespace, agent = scope
        if namespace == DEFAULT_NAMESPACE:
            return agent if "@" not in agent else f"{agent}@-"
        digest = hashlib.blake2b(repr(namespace).encode(), digest_size=8, key=self._key).hexdigest()
        return f"{agent}@{digest}"

    # ------------------------------------------------------------ per request
    def prepare(self, obj: Any, manager: Any) -> Optional[Collector]:
        """Apply the scope's setting to an annotated request and decide whether to verify it; None to pass."""
        config = live_config()
        if config.mode == "off" or (config.reuse_scope == "salt-required" and not getattr(obj, "cache_salt", None)):
            return None  # served as stock: nothing approximated to verify, no scope to hold
        sampling = getattr(obj, "sampling_params", None)
        ids = getattr(obj, "input_ids", None)
        if not isinstance(sampling, dict) or not isinstance(ids, list) or (ids and isinstance(ids[0], list)):
            return None  # batches and text prompts: a token-span annotation needs its ids (validation answers)
        custom = sampling.get("custom_params")
        try:
            ann = parse_annotation(custom, len(ids), config.max_segments)
        except AnnotationError:
            return None  # the validation hook answers with a 400
        if ann is None:
            return None
        controller = self._refresh(config)
        scope, display = self._scope(obj, ann.agent, ann.workflow)
        setting = controller.setting(scope)
        # A prefill-only request (``max_new_tokens=0``: a client committing an answer as a shared segment, a
        # warm-up) generates nothing to verify; sampled, it would also pass as exact and stop its scope's burst.
        # A request that opts out (``verify: false``: replays, evaluation traffic) is served under its scope's
        # setting but never counted as evidence about the scope.
        verifiable = config.verify_rate > 0 and sampling.get("max_new_tokens") != 0 and ann.verify
        draw = verifiable and self._rng.random() < config.verify_rate
        burst = (not draw and verifiable and config.verify_burst and scope not in self._exact_scopes
                 and controller.wants_evidence(scope, self._waiting.get(scope, 0)))
        skip = (draw or burst) and _unverifiable(obj, sampling, manager)
        if skip:  # its logprobs are not what a plain prefill gives, or it has several answers: never compared
            self.counters[f"skipped_{skip}"] += 1
            draw = burst = False
        probe = controller.probe_setting(scope) if draw else None
        if probe is not None:  # a dense scope: this request probes the next looser setting
            setting = probe
            self.counters["probes"] += 1
        if setting != controller.settings[0]:
            custom[CUSTOM_PARAMS_KEY] = _with_setting(ann, setting).to_custom_params()[CUSTOM_PARAMS_KEY]
            self.counters[f"served_{'dense' if setting == DENSE else 'longer_head'}"] += 1
        sampled, strip = False, False
        if draw or burst:
            sampled, strip = _ask_logprobs(obj, config.verify_top_k)
            self.counters["sampled" if sampled else "not_sampled_logprobs_taken"] += 1
            if sampled:
                self._waiting[scope] = self._waiting.get(scope, 0) + 1
                self.counters["sampled_burst" if burst else "sampled_rate"] += 1
        return Collector(self, scope, display, setting, list(ids), sampled, strip, obj, manager,
                         probe=probe is not None)

    # ------------------------------------------------------------ the worker
    def served_exact(self, scope: Hashable) -> None:
        self._exact_scopes[scope] = None
        self._exact_scopes.move_to_end(scope)
        while len(self._exact_scopes) > EXACT_SCOPES_MAX:
            self._exact_scopes.popitem(last=False)

    def enqueue(self, job: Job) -> None:
        self._exact_scopes.pop(job.scope, None)
        if self._queue is None:
            self._queue = asyncio.Queue()
        if self._queue.qsize() >= live_config().verify_queue_max:
            self.counters["dropped_queue_full"] += 1
            self.release(job.scope)
            return
        self._queue.put_nowait(job)
        self._queued_bytes += job.approx_bytes
        self.counters["queued"] += 1
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._queue is not None and not self._queue.empty():
            job = self._queue.get_nowait()
            self._queued_bytes -= job.approx_bytes
            try:
                await self._verify(job.manager, job)
            except Exception:  # noqa: BLE001 - a failed reference only costs one sample
                logger.exception("sglang-kvshare: a fidelity reference failed")
                self.counters["verify_errors"] += 1
            finally:
                self.release(job.scope)

    def _reference_timed_out(self, job: Job, rid: str) -> None:
        """Count and name a reference that did not answer within ``REFERENCE_WAIT_S``, and abort it in SGLang."""
        self.counters["verify_timeouts"] += 1
        entry = {"reference": rid, "scope": job.display, "at": round(time.time(), 3)}
        self._timed_out = (self._timed_out + [entry])[-TIMED_OUT_SHOWN:]
        logger.warning("sglang-kvshare: fidelity reference %s (scope %s) did not answer within %gs; aborted",
                       rid, job.display, REFERENCE_WAIT_S)
        try:
            abort = getattr(job.manager, "abort_request", None)
            if abort is not None:
                abort(rid)
        except Exception:  # noqa: BLE001 - the reference is already given up; SGLang finishes it on its own
            logger.exception("sglang-kvshare: aborting the fidelity reference %s failed", rid)

    def release(self, scope: Hashable) -> None:
        """One sampled request of ``scope`` is verified or will not be: it no longer counts as waiting."""
        left = self._waiting.get(scope, 0) - 1
        if left > 0:
            self._waiting[scope] = left
        else:
            self._waiting.pop(scope, None)

    async def _verify(self, manager: Any, job: Job) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        deadline = time.monotonic() + IDLE_WAIT_S
        while getattr(manager, "rid_to_state", None) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # never beside a user's request while one is in flight
        k = live_config().verify_top_k
        rid = f"kvshare-verify-{uuid.uuid4().hex}"
        obj = GenerateReqInput(input_ids=job.prompt + job.output, sampling_params={"max_new_tokens": 0},
                               return_logprob=True, logprob_start_len=len(job.prompt) - 1, top_logprobs_num=k,
                               lora_path=job.lora_path, extra_key=job.extra_key, cache_salt=job.cache_salt, rid=rid)
        try:
            meta = await asyncio.wait_for(_answer_meta(manager, obj), REFERENCE_WAIT_S)
        except asyncio.TimeoutError:
            self._reference_timed_out(job, rid)
            return
        reference = (meta.get("input_top_logprobs") or [])[1:]  # from the first generated token on
        fidelity = compare(_pairs(job.served), _pairs(reference))
        if fidelity is None:
            self.counters["verify_empty"] += 1
            return
        self.counters["verified"] += 1
        action = self.controller.observe(job.scope, job.setting, fidelity) if self.controller else None
        if action is not None:
            self._record(action)
        if self._metrics is None:
            self._metrics = _metrics_if_enabled(manager)
        self._export()

    def _export(self) -> None:
        """Bring the Prometheus series up to date (after a verification or a pin; never per request)."""
        if not self._metrics or self.controller is None:
            return
        controller = self.controller
        per_scope = controller.scopes()  # the exporter labels slots, never these keys
        heads = {s: controller.setting(s) for s in per_scope}
        self._metrics.update(per_scope, heads, dict(self.counters), dict(controller.counters),
                             0 if self._queue is None else self._queue.qsize())

    def _record(self, action: Action) -> None:
        self.counters[f"action_{action.reason}"] += 1
        self._save(action.scope)
        entry = {"scope": self._display(action.scope), "from": setting_name(action.before),
                 "to": setting_name(action.after), "reason": action.reason, "at": round(time.time(), 3)}
        self.last_actions = (self.last_actions + [entry])[-32:]
        logger.info("sglang-kvshare: fidelity guard: %s %s -> %s (%s)", entry["scope"], entry["from"], entry["to"],
                    action.reason)

    # ------------------------------------------------------------ admin
    def snapshot(self) -> dict:
        """``GET /kvshare/fidelity``: settings, per-scope estimates with 95 % intervals, actions, queue."""
        config = live_config()
        controller = self._refresh(config)
        slot = self._metrics.slot if self._metrics else lambda scope: None
        scopes = {self._display(s): {**v, "slot": slot(s)} for s, v in controller.scopes().items()}
        return {"verify_rate": config.verify_rate, "target": config.fidelity_target,
                "settings": [setting_name(h) for h in controller.settings], **controller.snapshot(),
                "queue": {"jobs": 0 if self._queue is None else self._queue.qsize(),
                          "max": config.verify_queue_max, "approx_bytes": self._queued_bytes},
                "counters": dict(self.counters), "recent_actions": list(self.last_actions), "per_scope": scopes,
                "timed_out_references": list(self._timed_out),
                "file": None if self._file is None else str(self._file.path)}

    def reset(self) -> None:
        """Forget every scope (estimates, settings, pins), the counters and the actions; queued jobs are
        dropped (their samples measured the old state). The exporter keeps its series until the next update."""
        self.controller, self._built_for = None, None
        self.counters.clear()
        if self._file is not None:
            self._file.scopes.clear()
            self._write_file()
        self.last_actions = []
        self._served.clear()
        self._timed_out = []
        self._waiting.clear()
        self._exact_scopes.clear()
        if self._queue is not None:
            while not self._queue.empty():
                self._queued_bytes -= self._queue.get_nowait().approx_bytes

    def _save(self, scope: Hashable) -> None:
        """Write ``scope``'s setting and pin to the guard file, if there is one. The loosest setting unpinned is
        what a scope starts under anyway: not stored. A pinned scope keeps, beside its pin, the setting the guard
        had reached, which it returns to when unpinned."""
        if self._file is None or self.controller is None:
            return
        namespace, agent = scope
        key = (self._file.namespace_id(namespace), agent)
        learned, pinned = self.controller.learned(scope), self.controller.pinned(scope)
        self._file.scopes.pop(key, None)
        if pinned is not None or learned != self.controller.settings[0]:
            self._file.scopes[key] = SavedScope(learned, pinned)
            while len(self._file.scopes) > self.controller.max_scopes:  # the oldest learned setting; pins stay
                oldest = next((k for k, v in self._file.scopes.items() if v.pinned is None), None)
                if oldest is None:
                    break
                self._file.scopes.pop(oldest)
        self._write_file()

    def _write_file(self) -> None:
        try:
            self._file.write()
            self.counters["file_writes"] += 1
        except OSError:
            logger.exception("sglang-kvshare: the guard file %s could not be written", self._file.path)
            self.counters["file_write_errors"] += 1

    def summary(self) -> dict:
        """What ``/kvshare/stats`` shows of the guard."""
        snap = self.snapshot()
        out = {k: snap[k] for k in ("verify_rate", "target", "scopes", "actions", "queue", "counters")}
        out["limits"] = {"queue_jobs": snap["queue"]["max"], "scopes": snap["max_scopes"], "pins": snap["max_pins"]}
        out["usage"] = {"queue_jobs": snap["queue"]["jobs"], "scopes": snap["scopes"], "pins": snap["pins"]}
        return out

    def pin(self, display: str, setting: Optional[str]) -> dict:
        """Pin the scope shown as ``display`` to ``setting`` (``dense``, ``headK``) or unpin it (None).

        Any scope the guard has served lately (or holds) can be pinned, verified or not, and an agent of the
        default namespace (no cache salt, extra key or LoRA) by its name before it is served at all: a judge is
        pinned ``dense`` before its first request. A pin on an agent outside any workflow also holds for that agent
        in each workflow of its namespace that has no pin of its own (``Controller.parent``). Raises ``KeyError``
        for a scope there is nothing to unpin in, or of another namespace not served yet; ``ValueError`` for a bad
        setting, ``PinLimitError`` (a ``ValueError``) for a new pin past the guard's bound on pins.
        """
        controller = self._refresh(live_config())
        head = _parse_setting(setting)
        scope = next((s for s in controller.scopes() if self._display(s) == display), self._served.get(display))
        if scope is None:
            if head is None or "@" in display or len(display) > MAX_NAME_CHARS:
                raise KeyError(display)  # nothing to unpin; another namespace is named only once served
            scope = (DEFAULT_NAMESPACE, display)  # an agent of the default namespace, pinned before it is served
        action = controller.pin(scope, head)
        self._record(action)
        self._export()
        return controller.view(scope)


def _outside_workflow(scope: Hashable) -> Optional[Hashable]:
    """The parent of an agent's scope in a workflow: the same agent of the same namespace outside any workflow,
    whose pin it follows when it has none of its own."""
    namespace, agent = scope
    return (namespace[:3], agent) if len(namespace) > 3 else None


def _metrics_if_enabled(manager: Any) -> Any:
    """The guard's exporter where SGLang exports metrics (``--enable-metrics``), else False."""
    if not getattr(manager, "enable_metrics", False):
        return False
    from sglang_kvshare.guard.metrics import GuardMetrics

    return GuardMetrics()


def _with_setting(ann: Any, setting: int) -> Any:
    """The annotation served under ``setting``: every shared segment prefilled, or a longer head."""
    if setting == DENSE:
        segments = tuple(s.model_copy(update={"reuse": False}) if s.kind == "shared" else s for s in ann.segments)
        return ann.model_copy(update={"segments": segments})
    return ann.model_copy(update={"recompute_head": max(ann.recompute_head or 0, setting)})


async def _answer_meta(manager: Any, obj: Any) -> dict:
    """The last ``meta_info`` SGLang answers ``obj`` with; its generator is closed however this ends."""
    meta: dict = {}
    answers = manager.generate_request(obj, None)
    try:
        async for out in answers:
            meta = out.get("meta_info") or meta
    finally:
        await answers.aclose()
    return meta


def _unverifiable(obj: Any, sampling: dict, manager: Any) -> Optional[str]:
    """Why a request cannot be compared with a plain dense prefill (None: it can).

    ``sampling``: its logprobs are taken after changes the reference does not make (``_sampling_changes``).
    ``parallel``: ``n > 1`` answers come back as one list, several answers to one request.
    """
    preferred = getattr(manager, "preferred_sampling_params", None)  # SGLang fills what the request leaves out
    effective = {**preferred, **sampling} if isinstance(preferred, dict) else sampling
    if _sampling_changes(effective) or getattr(obj, "custom_logit_processor", None):
        return "sampling"
    n = effective.get("n")
    if n is not None and n != 1:
        return "parallel"
    return None


def _sampling_changes(sampling: dict) -> bool:
    """Whether SGLang's logprobs for these sampling parameters differ from the model's own (a dense prefill's)."""
    try:
        temperature = float(sampling["temperature"]) if sampling.get("temperature") is not None else 1.0
        if not (0 <= temperature < GREEDY_TEMPERATURE or temperature == 1.0):
            return True
        if any(float(sampling[k]) != v for k, v in NEUTRAL_SAMPLING.items() if sampling.get(k) is not None):
            return True
    except (TypeError, ValueError):
        return True  # SGLang refuses it; nothing to verify either way
    return any(sampling.get(k) for k in CONSTRAINTS)


def _ask_logprobs(obj: Any, k: int) -> tuple[bool, bool]:
    """Make SGLang return the request's top-k distributions; (can verify, strip them from the response)."""
    if getattr(obj, "return_logprob", False):
        if (getattr(obj, "top_logprobs_num", 0) or 0) < 1:
            return False, False  # the client asked for logprobs without distributions: do not change its answer
        return True, False
    obj.return_logprob = True
    obj.top_logprobs_num = k
    obj.logprob_start_len = -1
    return True, True


def _pairs(rows: list) -> list:
    """SGLang's top-logprob rows ``[(logprob, token_id, text), ...]`` as ``[(logprob, token_id), ...]``."""
    return [[(row[0], row[1]) for row in pos] if pos else [] for pos in rows]


def _parse_setting(setting: Optional[str]) -> Optional[int]:
    """A pin's setting (``saved.parse_setting``: the bound of a request's ``recompute_head``); None unpins."""
    if setting is None:
        return None
    try:
        return parse_setting(setting)
    except ValueError as exc:
        raise ValueError(f"{exc}, or null to unpin") from None


guard = Guard()
