"""Soak and fault harness: is a kvshare server safe to leave running in front of clients?

``python -m benchmarks.soak`` starts its own kvshare server on 127.0.0.1 (mode
``kvcmas`` with ``--kvshare-tau 1`` by default, so that corrections really happen,
and a small KV pool, ``--max-total-tokens 3072``, so that the tree evicts), runs N
client threads for M minutes against it, stops by itself and writes a JSON verdict.

The clients mix (``TRAFFIC``): valid multi-agent team rounds (four agents with their
own system prompts read the same GSM8K text, chained); plain requests (no
annotation) whose prompt equals an annotated one; probes built to catch a leak
(agent B assembled from agent A's copy, then a plain request with B's exact prompt)
and reuse across ``cache_salt`` (content seen only under salt A, asked under salt B);
malformed and adversarial annotations (a fixed catalogue and fuzzed JSON, see
``soak_faults``); requests with thousands of distinct slot names; streams closed
early; client-chosen ``rid`` reused (after completion, after an abort, twice at
once); and admin calls (reset, config, a switch to ``off`` and back, calls without
the key).

Checks (``verdicts`` in the JSON): the server stayed up and its log holds no
traceback or leak message; no 5xx and no request lost; every malformed annotation
got a 4xx and every valid one a 200; the allocator is back where it started once
idle and flushed (``kv_pool_tokens``); kvshare memory within its limits
(``stats["limits"]`` vs ``stats["usage"]``); zero aligned or corrected tokens across
salts; and every plain request served from exact KV only, structurally
(``counters["plain_tokens_from_estimates"] == 0``) and by output: a sample of plain
requests is replayed one at a time on a fresh server in mode ``off`` (or on the
running one ``--reference-url`` names, flushed before each replay) and must give
the same greedy tokens (divergences whose first differing token was a near-tie in
the ``off`` run are listed apart). A check the server cannot answer yet (a missing
field) is reported as ``"not checked"`` and does not fail the run.

Every request has a timeout, the run has a deadline, and nothing leaves loopback.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import threading
import time
from contextlib import nullcontext
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import requests
from tqdm import tqdm

from benchmarks.harness import RESULTS, machine, run_meta, write_json
from benchmarks.soak_faults import Case, adversarial_name, catalogue, expected_status, fuzzed, many_slots
from sglang_kvshare.protocol import DEFAULT_MAX_SEGMENTS, MAX_NAME_CHARS
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part
from devtools.server_process import ServerProcess

AGENTS = {
    "solver": "You are a math solver. Solve the problem step by step and give the final number.",
    "analyst": "You are a mathematical analyst. Check each quantity in the problem and point out what matters.",
    "coder": "You are a programming expert. Describe a short Python program that computes the answer.",
    "judge": "You are the final judge. Read the problem carefully and state the answer in one line.",
}
TEAM = tuple(AGENTS)  # the chain order: each agent's source is the previous one
SUFFIX = "\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n"
SALTS = ("tenant-a", "tenant-b")
NEAR_TIE = 0.05  # top-2 logprob gap below which a differing greedy token counts as a near-tie
REQUEST_TIMEOUT_S = 180.0
PLAIN_TOKENS = 24
TOP_LOGPROBS = 5

# Traffic kinds and their weights after each client's first tour through all of them.
TRAFFIC = {"team": 5, "plain": 4, "leak_probe": 3, "salt_probe": 3, "malformed": 4, "fuzzed": 3,
           "slot_flood": 2, "abort": 2, "rid_reuse": 2, "admin": 2, "bad_sampling": 1}
ESTIMATE_TAGS = ("leak_probe", "leak_probe_off", "plain_after_estimate")  # plain prompts assembled before
ADMIN_CALLS = ("mode_off_and_back", "reset", "no_key", "tau", "reset_slot", "pools", "mode_switch", "bad_config")


def system_part(agent: str) -> str:
    return f"<|im_start|>system\n{AGENTS[agent]}<|im_end|>\n<|im_start|>user\nContext:\n"


# ------------------------------------------------------------ bookkeeping
@dataclass
class Outcome:
    status: int  # 0: no answer (connection error or client timeout)
    body: Any = None
    seconds: float = 0.0
    error: str = ""

    @property
    def report(self) -> dict:
        meta = (self.body or {}).get("meta_info", {}) if isinstance(self.body, dict) else {}
        reps = meta.get("kvshare") or [{}]
        return reps[0] or {}


class Recorder:
    """Thread-safe tallies of what was sent, what came back and what looked wrong."""

    MAX_EXAMPLES = 40

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: Counter = Counter()  # per traffic kind: operations run
        self.requests: Counter = Counter()  # per request label: HTTP calls
        self.statuses: dict[str, Counter] = defaultdict(Counter)
        self.faults: Counter = Counter()  # per fault kind: injected
        self.findings: dict[str, list] = defaultdict(list)  # check -> examples
        self.finding_counts: Counter = Counter()
        self.plain: list[dict] = []  # plain requests kept for the replay
        self.salt_probes: list[dict] = []
        self.malformed = {"sent": 0, "got_4xx": 0, "valid_after_fuzz": 0, "valid_got_200": 0}
        self.reuse: Counter = Counter()  # annotated requests: tokens by how they were resolved
        self.fallbacks: Counter = Counter()
        self.slot_names: set[str] = set()
        self.admin: Counter = Counter()

    def http(self, label: str, out: Outcome) -> None:
        with self.lock:
            self.requests[label] += 1
            self.statuses[label][out.status] += 1
            if out.status == 0 or out.status >= 500:
                self._find("no_5xx" if out.status else "nothing_lost",
                           {"request": label, "status": out.status, "error": out.error[:300],
                            "body": str(out.body)[:300]})

    def find(self, check: str, example: dict) -> None:
        with self.lock:
            self._find(check, example)

    def _find(self, check: str, example: dict) -> None:
        self.finding_counts[check] += 1
        if len(self.findings[check]) < self.MAX_EXAMPLES:
            self.findings[check].append(example)

    def annotated(self, out: Outcome) -> None:
        rep = out.report
        with self.lock:
            for key in ("tokens_exact_hit", "tokens_estimate_hit", "tokens_aligned", "tokens_corrected",
                        "tokens_prefilled"):
                self.reuse[key] += int(rep.get(key, 0) or 0)
            for fb in rep.get("fallbacks", []) or []:
                self.fallbacks[str(fb.get("reason"))] += 1

    def totals(self) -> dict:
        with self.lock:
            all_status = Counter()
            for c in self.statuses.values():
                all_status.update(c)
            return {"requests": sum(self.requests.values()),
                    "ok_2xx": sum(v for k, v in all_status.items() if 200 <= k < 300),
                    "client_4xx": sum(v for k, v in all_status.items() if 400 <= k < 500),
                    "server_5xx": sum(v for k, v in all_status.items() if k >= 500),
                    "lost": all_status.get(0, 0)}


# ------------------------------------------------------------ the HTTP side
@dataclass
class Endpoint:
    """The soak server's URL and admin key; every call has a timeout and stays on loopback."""

    url: str
    admin_key: Optional[str]
    recorder: Recorder
    timeout: float = REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        assert self.url.startswith("http://127.0.0.1:"), "the soak talks to loopback only"

    def _headers(self, admin: bool) -> dict:
        return {"Authorization": f"Bearer {self.admin_key}"} if admin and self.admin_key else {}

    def call(self, label: str, method: str, path: str, *, body: Any = None, admin: bool = False,
             record: bool = True) -> Outcome:
        t0 = time.perf_counter()
        try:
            r = requests.request(method, self.url + path, json=body, headers=self._headers(admin),
                                 timeout=self.timeout)
            try:
                payload = r.json()
            except ValueError:
                payload = r.text
            out = Outcome(r.status_code, payload, time.perf_counter() - t0)
        except requests.RequestException as exc:
            out = Outcome(0, None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
        if record:
            self.recorder.http(label, out)
        return out

    def generate(self, label: str, ids: list[int], *, custom_params: Optional[dict] = None,
                 max_new_tokens: int = 8, salt: Optional[str] = None, rid: Optional[str] = None,
                 logprobs: bool = False, sampling: Optional[dict] = None) -> Outcome:
        body = generate_body(ids, custom_params=custom_params, max_new_tokens=max_new_tokens, salt=salt,
                             rid=rid, logprobs=logprobs, sampling=sampling)
        return self.call(label, "POST", "/generate", body=body)

    def stream_and_close(self, label: str, body: dict, chunks: int) -> Outcome:
        """Stream ``body`` and close the connection after ``chunks`` data lines (0: after the headers)."""
        t0 = time.perf_counter()
        got = 0
        try:
            with requests.post(self.url + "/generate", json={**body, "stream": True}, stream=True,
                               timeout=self.timeout) as r:
                status = r.status_code
                if status == 200 and chunks > 0:
                    for line in r.iter_lines():
                        if line.startswith(b"data:"):
                            got += 1
                            if got >= chunks:
                                break
            out = Outcome(status, {"chunks_read": got}, time.perf_counter() - t0)
        except requests.RequestException as exc:
            out = Outcome(0, None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
        self.recorder.http(label, out)
        return out

    def stats(self, record: bool = False) -> Optional[dict]:
        out = self.call("stats", "GET", "/kvshare/stats", record=record)
        return out.body if out.status == 200 and isinstance(out.body, dict) else None


def generate_body(ids: list[int], *, custom_params: Optional[dict] = None, max_new_tokens: int = 8,
                  salt: Optional[str] = None, rid: Optional[str] = None, logprobs: bool = False,
                  sampling: Optional[dict] = None) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **(sampling or {})}
    if custom_params is not None:
        params["custom_params"] = custom_params
    body: dict = {"input_ids": list(ids), "sampling_params": params}
    if salt is not None:
        body["cache_salt"] = salt  # GenerateReqInput.cache_salt (top level, not in sampling_params)
    if rid is not None:
        body["rid"] = rid
    if logprobs:
        body.update(return_logprob=True, top_logprobs_num=TOP_LOGPROBS, logprob_start_len=-1)
    return body


def estimated_tokens(report: dict) -> int:
    """Tokens of an annotated request served from an estimate (aligned or corrected), per its report."""
    return int(report.get("tokens_aligned", 0) or 0) + int(report.get("tokens_corrected", 0) or 0)


def output_tokens(body: dict) -> list[int]:
    meta = body.get("meta_info", {})
    return [int(t[1]) for t in meta.get("output_token_logprobs") or []] or list(body.get("output_ids") or [])


# ------------------------------------------------------------ the traffic
@dataclass
class Shared:
    """What all clients share: texts, recent annotated prompts, the admin lock, the counters."""

    tokenizer: Any
    texts: list[str]
    endpoint: Endpoint
    mode: str
    tau: float
    slot_name_target: int
    deadline: float
    started: float
    max_segments: int = DEFAULT_MAX_SEGMENTS
    admin_lock: threading.Lock = field(default_factory=threading.Lock)
    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (ids, salt, estimated tokens)
    next_text: int = 0
    next_probe: int = 0
    next_name: int = 0
    next_admin: int = 0
    counter_lock: threading.Lock = field(default_factory=threading.Lock)
    monitor: Optional["Monitor"] = None

    @property
    def rec(self) -> Recorder:
        return self.endpoint.recorder

    def _text(self, i: int, probe: bool) -> str:
        half = len(self.texts) // 2
        base = self.texts[(half if probe else 0) + i % half]
        return base if i < half else f"{base}\nVariant {i}."

    def fresh_text(self) -> str:
        """A new text for the team rounds' working set (they reuse the last six)."""
        with self.counter_lock:
            i = self.next_text
            self.next_text += 1
        return self._text(i, probe=False)

    def probe_text(self) -> str:
        """A text no other request ever uses: a probe's content must be seen only by the probe."""
        with self.counter_lock:
            i = self.next_probe
            self.next_probe += 1
        return self._text(i, probe=True)

    def working_text(self, rng: random.Random) -> str:
        """One of the last six fresh texts (reused by several rounds: sources exist, pools learn);
        a new one now and then, so contents keep changing."""
        with self.counter_lock:
            hi = self.next_text
        if hi == 0 or rng.random() < 0.1:
            return self.fresh_text()
        return self._text(rng.randrange(max(0, hi - 6), hi), probe=False)

    def names(self, k: int) -> list[str]:
        rng = random.Random(self.next_name)
        with self.counter_lock:
            base = self.next_name
            self.next_name += k
        out = []
        for i in range(k):
            tag = f"s{base + i}:"
            out.append(tag + adversarial_name(rng, rng.choice([1, 8, 40, MAX_NAME_CHARS]) )[:MAX_NAME_CHARS - len(tag)])
        return out

    def request(self, agent: str, text: str, slot: str = "query", suffix: str = SUFFIX) -> tuple[list[int], dict]:
        return build_request(self.tokenizer, agent, [private_part(system_part(agent)), shared_part(text, slot),
                                                     private_part(suffix)])


class Client:
    """One client thread: a tour through every traffic kind, then weighted random picks until the deadline."""

    def __init__(self, index: int, shared_state: Shared, seed: int, tour: list[str]) -> None:
        self.i = index
        self.s = shared_state
        self.rng = random.Random(seed * 1000 + index)
        self.tour = list(tour)
        self.ops: dict[str, Callable[[], None]] = {k: getattr(self, f"op_{k}") for k in TRAFFIC}

    def run(self) -> None:
        kinds, weights = list(TRAFFIC), list(TRAFFIC.values())
        # NOTE: the tour (a few operations) runs to its end even past the deadline, so that a short run
        # still injects every kind; after it, no operation starts past the deadline.
        while self.tour or time.monotonic() < self.s.deadline:
            if self.tour:
                kind = self.tour.pop(0)
            else:
                kind = self.rng.choices(kinds, weights)[0]
                if self._flood_behind():
                    kind = "slot_flood"
            if kind == "slot_flood" and not self._flood_due():
                kind = "team"
            with self.s.rec.lock:
                self.s.rec.sent[kind] += 1
            try:
                self.ops[kind]()
            except Exception as exc:  # noqa: BLE001 - a harness bug must show up in the JSON, not kill a thread
                self.s.rec.find("harness_errors", {"kind": kind, "error": f"{type(exc).__name__}: {exc}"})

    # --- valid traffic --------------------------------------------------------
    def _annotated(self, label: str, agent: str, text: str, salt: Optional[str], suffix: str = SUFFIX,
                   **kw) -> tuple[list[int], Outcome]:
        ids, cp = self.s.request(agent, text, suffix=suffix)
        out = self.s.endpoint.generate(label, ids, custom_params=cp, salt=salt, **kw)
        if out.status == 200:
            self.s.rec.annotated(out)
            self.s.recent.append((ids, salt, estimated_tokens(out.report)))
        elif out.status and out.status < 500:
            self.s.rec.find("valid_requests_served", {"request": label, "status": out.status,
                                                      "body": str(out.body)[:300]})
        return ids, out

    def op_team(self) -> None:
        """A chain of 2 to 4 agents on one working text, under no salt or one of the two."""
        text = self.s.working_text(self.rng)
        # Mostly unsalted: pools are per namespace, and kvcmas corrects only once a pool holds anchors.
        salt = self.rng.choice((None, None, None, *SALTS))
        for agent in TEAM[:self.rng.randint(2, 4)]:
            self._annotated("team", agent, text, salt)

    def _plain(self, label: str, ids: list[int], salt: Optional[str], tag: str) -> None:
        out = self.s.endpoint.generate(label, ids, salt=salt, max_new_tokens=PLAIN_TOKENS, logprobs=True)
        if out.status == 200:
            meta = out.body.get("meta_info", {})
            with self.s.rec.lock:
                self.s.rec.plain.append({"tag": tag, "input_ids": ids, "salt": salt,
                                         "cached_tokens": int(meta.get("cached_tokens", 0) or 0),
                                         "output_ids": output_tokens(out.body),
                                         "annotated_report": bool(meta.get("kvshare"))})

    def op_plain(self) -> None:
        """A plain request whose prompt equals a recent annotated one (same salt)."""
        if not self.s.recent:
            return self.op_team()
        recent = list(self.s.recent)
        assembled = [r for r in recent if r[2]]
        ids, salt, estimated = self.rng.choice(assembled if assembled and self.rng.random() < 0.7 else recent)
        self._plain("plain", ids, salt, "plain_after_estimate" if estimated else "plain")

    def op_leak_probe(self) -> None:
        """solver then analyst on a fresh text (the analyst is assembled from the solver's copy), then a plain
        request with the analyst's exact prompt; sometimes with the server switched to ``off`` for it.

        When the analyst was not assembled (in kvcmas, a pool without two anchors on the edge), the
        coder reads the text under ``fullshared`` (switched for it, then back), which aligns whenever a
        source exists, and the plain request takes the coder's prompt: the probe always leaves estimates."""
        text = self.s.probe_text()
        salt = self.rng.choice((None, None, SALTS[0]))
        self._annotated("leak_probe", "solver", text, salt)
        ids, out = self._annotated("leak_probe", "analyst", text, salt)
        if out.status != 200:
            return
        estimated = estimated_tokens(out.report)
        with self.s.admin_lock:
            if not estimated and self.s.mode != "fullshared":
                self._admin_write("/kvshare/config", {"mode": "fullshared"})
                ids, out = self._annotated("leak_probe", "coder", text, salt)
                self._admin_write("/kvshare/config", {"mode": self.s.mode, "tau": self.s.tau})
                if out.status != 200:
                    return
                estimated = estimated_tokens(out.report)
            if self.rng.random() < 0.3:
                self._admin_write("/kvshare/config", {"mode": "off"})
                self._plain("leak_probe", ids, salt, "leak_probe_off" if estimated else "probe_off_unassembled")
                self._admin_write("/kvshare/config", {"mode": self.s.mode, "tau": self.s.tau})
            else:
                self._plain("leak_probe", ids, salt, "leak_probe" if estimated else "probe_unassembled")

    def op_salt_probe(self) -> None:
        """A fresh text and a fresh private suffix, seen by the solver under salt A only, then the solver
        again or the analyst under salt B: nothing of B's request may be aligned or corrected (B's agent has
        seen neither the text nor the suffix in its own namespace; its system prompt is an exact hit)."""
        text = self.s.probe_text()
        suffix = SUFFIX.replace("briefly", f"briefly (case {self.rng.getrandbits(32):x})")
        first, second = (SALTS if self.rng.random() < 0.5 else SALTS[::-1])
        reader = self.rng.choice(("solver", "analyst"))
        self._annotated("salt_probe", "solver", text, first, suffix=suffix)
        _, out = self._annotated("salt_probe", reader, text, second, suffix=suffix)
        if out.status != 200:
            return
        rep = out.report
        reused = int(rep.get("tokens_aligned", 0) or 0) + int(rep.get("tokens_corrected", 0) or 0)
        segs = rep.get("segments") or []
        shared_by = [s.get("resolved_by") for s in segs if s.get("kind", "shared") == "shared"] if segs else []
        probe = {"salts": [first, second], "agents": ["solver", reader], "aligned": int(rep.get("tokens_aligned", 0) or 0),
                 "corrected": int(rep.get("tokens_corrected", 0) or 0), "shared_resolved_by": shared_by,
                 "has_report": bool(rep)}
        with self.s.rec.lock:
            self.s.rec.salt_probes.append(probe)
        if reused:
            self.s.rec.find("zero_cross_salt_reuse", probe)

    def _names_due(self) -> float:
        total = self.s.deadline - self.s.started
        return self.s.slot_name_target * min(1.0, (time.monotonic() - self.s.started + 10) / max(total, 1))

    def _flood_due(self) -> bool:
        """Distinct slot names go out at an even pace, so the target is met by the deadline."""
        return self.s.next_name < self._names_due()

    def _flood_behind(self) -> bool:
        """More than two requests' worth of names behind the pace: flood now."""
        return self.s.next_name < self._names_due() - 2 * (self.s.max_segments - 1)

    def op_slot_flood(self) -> None:
        """A valid request with up to 63 shared segments, each under a new hostile slot name,
        from an agent with a hostile name."""
        k = min(self.s.max_segments - 1, max(1, self.s.slot_name_target - self.s.next_name))
        agent = adversarial_name(self.rng, self.rng.choice([5, MAX_NAME_CHARS]))
        head = self.s.tokenizer(system_part("judge"), add_special_tokens=False).input_ids
        body_ids = self.s.tokenizer(self.s.working_text(self.rng), add_special_tokens=False).input_ids
        while len(body_ids) < 2 * k:
            body_ids = body_ids + body_ids
        ids = list(head) + list(body_ids[:2 * k])
        names = self.s.names(k)
        raw = json.dumps(many_slots(agent, len(head), len(ids), names), ensure_ascii=False)
        with self.s.rec.lock:
            self.s.rec.faults["slot_flood_requests"] += 1
            self.s.rec.slot_names.update(names)
        out = self.s.endpoint.generate("slot_flood", ids, custom_params={"kvshare": raw}, max_new_tokens=1,
                                       salt=self.rng.choice((None, *SALTS)))
        if out.status and out.status != 200 and out.status < 500:
            self.s.rec.find("valid_requests_served", {"request": "slot_flood", "status": out.status,
                                                      "body": str(out.body)[:300]})

    # --- faults ----------------------------------------------------------------
    def _send_case(self, label: str, case: Case, ids: list[int]) -> None:
        expected = expected_status(case.raw, len(ids), self.s.max_segments)
        out = self.s.endpoint.generate(label, ids, custom_params=case.custom_params(), max_new_tokens=2)
        with self.s.rec.lock:
            self.s.rec.faults[case.kind] += 1
            m = self.s.rec.malformed
            if expected == 400:
                m["sent"] += 1
                m["got_4xx"] += int(400 <= out.status < 500)
            else:
                m["valid_after_fuzz"] += 1
                m["valid_got_200"] += int(out.status == 200)
        if expected == 400 and not 400 <= out.status < 500:
            self.s.rec.find("malformed_get_4xx", {"kind": case.kind, "raw": str(case.raw)[:200],
                                                  "status": out.status, "body": str(out.body)[:200]})
        elif expected == 200 and out.status != 200:
            self.s.rec.find("valid_requests_served", {"kind": case.kind, "raw": str(case.raw)[:200],
                                                      "status": out.status, "body": str(out.body)[:200]})

    def _long_prompt(self) -> list[int]:
        ids, _ = self.s.request(self.rng.choice(TEAM), self.s.working_text(self.rng))
        while len(ids) < self.s.max_segments + 2:
            ids = ids + ids
        return ids

    def op_malformed(self) -> None:
        ids = self._long_prompt()
        self._send_case("malformed", self.rng.choice(catalogue(len(ids), self.s.max_segments)), ids)

    def op_fuzzed(self) -> None:
        ids = self._long_prompt()
        self._send_case("fuzzed", fuzzed(len(ids), self.rng), ids)

    def op_bad_sampling(self) -> None:
        """Bad parameters SGLang itself validates (not kvshare): it answers 4xx."""
        ids = self._long_prompt()[:40]
        kind, sampling = self.rng.choice([("negative_max_new_tokens", {"max_new_tokens": -1}),
                                          ("negative_temperature", {"temperature": -1.0}),
                                          ("top_p_zero", {"top_p": 0.0})])
        out = self.s.endpoint.generate("bad_sampling", ids, sampling=sampling)
        with self.s.rec.lock:
            self.s.rec.faults[kind] += 1
        if not 400 <= out.status < 500:
            self.s.rec.find("bad_sampling_get_4xx", {"kind": kind, "status": out.status, "body": str(out.body)[:200]})

    def op_abort(self) -> None:
        """An annotated (or plain) stream closed after 0 to 3 chunks."""
        agent = self.rng.choice(TEAM)
        ids, cp = self.s.request(agent, self.s.working_text(self.rng))
        chunks = self.rng.choice([0, 1, 3])
        body = generate_body(ids, custom_params=cp if self.rng.random() < 0.7 else None, max_new_tokens=64,
                             salt=self.rng.choice((None, *SALTS)))
        with self.s.rec.lock:
            self.s.rec.faults[f"abort_after_{chunks}_chunks"] += 1
        self.s.endpoint.stream_and_close("abort", body, chunks)

    def op_rid_reuse(self) -> None:
        """The same client-chosen rid twice: after completion, after an abort (then a plain request with the
        aborted prompt), or two at once."""
        rid = f"soak-{self.i}-{self.rng.getrandbits(40):x}"
        text_a, text_b = self.s.working_text(self.rng), self.s.fresh_text()
        ids_a, cp_a = self.s.request("coder", text_a)
        ids_b, cp_b = self.s.request("judge", text_b)
        variant = self.rng.choice(["after_completion", "after_abort", "concurrent"])
        with self.s.rec.lock:
            self.s.rec.faults[f"rid_reuse_{variant}"] += 1
        ep = self.s.endpoint
        if variant == "after_completion":
            ep.generate("rid_reuse", ids_a, custom_params=cp_a, rid=rid)
            self._expect_rid(ep.generate("rid_reuse", ids_b, custom_params=cp_b, rid=rid), variant)
        elif variant == "after_abort":
            ep.stream_and_close("rid_reuse", generate_body(ids_a, custom_params=cp_a, max_new_tokens=64, rid=rid),
                                self.rng.choice([0, 1]))
            for attempt in range(8):  # SGLang answers 400 "Duplicate request ID" until the abort is processed
                out = ep.generate("rid_reuse", ids_b, custom_params=cp_b, rid=rid)
                if out.status != 400:
                    break
                time.sleep(0.5)
            self._expect_rid(out, variant)
            self._plain("rid_reuse", ids_a, None, "after_rid_reuse")
        else:
            outs: list[Outcome] = []
            t = threading.Thread(target=lambda: outs.append(
                ep.generate("rid_reuse", ids_a, custom_params=cp_a, rid=rid)))
            t.start()
            outs.append(ep.generate("rid_reuse", ids_b, custom_params=cp_b, rid=rid))
            t.join(REQUEST_TIMEOUT_S + 5)
            for out in outs:
                self._expect_rid(out, variant)

    def _expect_rid(self, out: Outcome, variant: str) -> None:
        ok = out.status == 200 or (out.status == 400 and "Duplicate request ID" in str(out.body))
        if not ok and out.status < 500 and out.status:
            self.s.rec.find("rid_reuse_answered", {"variant": variant, "status": out.status,
                                                   "body": str(out.body)[:200]})

    # --- admin -----------------------------------------------------------------
    def _admin_write(self, path: str, body: Any = None, *, key: bool = True, expect: int = 200) -> Outcome:
        out = self.s.endpoint.call("admin", "POST", path, body=body, admin=key)
        with self.s.rec.lock:
            self.s.rec.admin[f"{path} -> {out.status}"] += 1
        if out.status != expect and out.status and out.status < 500:
            self.s.rec.find("admin_answers", {"path": path, "body": body, "status": out.status, "expected": expect,
                                              "reply": str(out.body)[:200]})
        return out

    def op_admin(self) -> None:
        """The admin calls in turn (shared counter), so even a short run makes each of them."""
        with self.s.counter_lock:
            choice = ADMIN_CALLS[self.s.next_admin % len(ADMIN_CALLS)]
            self.s.next_admin += 1
        with self.s.rec.lock:
            self.s.rec.faults[f"admin_{choice}"] += 1
        with self.s.admin_lock:
            if choice in ("reset", "reset_slot") and self.s.monitor is not None:
                # A reset may zero the counters: read them first, so no count is lost.
                self.s.monitor.observe(self.s.endpoint.call("stats", "GET", "/kvshare/stats"))
            if choice == "reset":
                self._admin_write("/kvshare/reset")
            elif choice == "reset_slot":
                known = self.rng.random() < 0.5
                self._admin_write("/kvshare/pools/query/reset" if known else
                                  f"/kvshare/pools/never-{self.rng.getrandbits(32):x}/reset",
                                  expect=200 if known else 404)
            elif choice == "tau":
                self._admin_write("/kvshare/config", {"tau": self.rng.choice([0.3, 0.7, self.s.tau])})
                time.sleep(1.0)
                self._admin_write("/kvshare/config", {"tau": self.s.tau})
            elif choice == "mode_off_and_back":
                self._admin_write("/kvshare/config", {"mode": "off"})
                time.sleep(self.rng.uniform(0.5, 3.0))
                self._admin_write("/kvshare/config", {"mode": self.s.mode, "tau": self.s.tau})
            elif choice == "mode_switch":
                other = "fullshared" if self.s.mode == "kvcmas" else "kvcmas"
                self._admin_write("/kvshare/config", {"mode": other})
                time.sleep(self.rng.uniform(0.5, 3.0))
                self._admin_write("/kvshare/config", {"mode": self.s.mode, "tau": self.s.tau})
            elif choice == "bad_config":
                self._admin_write("/kvshare/config", self.rng.choice([{"tau": 2}, {"mode": "kvcomm"}, {}]),
                                  expect=422)
            elif choice == "no_key":
                if self.s.endpoint.admin_key:
                    self._admin_write("/kvshare/reset", key=False, expect=401)
                    out = self.s.endpoint.call("admin", "GET", "/kvshare/pools")
                    if out.status != 401:
                        self.s.rec.find("pools_need_admin_key", {"status": out.status})
            else:
                out = self.s.endpoint.call("admin", "GET", "/kvshare/pools", admin=True)
                if out.status != 200:
                    self.s.rec.find("admin_answers", {"path": "/kvshare/pools", "status": out.status})


# ------------------------------------------------------------ the run
class Monitor:
    """Polls ``/kvshare/stats`` every ``period`` s: answers, bounds, the plain-estimate counter."""

    def __init__(self, endpoint: Endpoint, period: float = 2.0) -> None:
        self.endpoint = endpoint
        self.period = period
        self.stop = threading.Event()
        self.polls = 0
        self.over_limit: dict[str, dict] = {}
        self.limit_keys: Optional[set] = None
        self.plain_from_estimates: list[int] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(self.period):
            self.observe(self.endpoint.call("stats", "GET", "/kvshare/stats"))

    def observe(self, out: Outcome) -> None:
        """Record one stats answer (called from the poll thread and before admin resets)."""
        self.polls += 1
        if out.status != 200 or not isinstance(out.body, dict):
            return
        stats = out.body
        bounds = check_bounds(stats)
        if bounds["checked"]:
            self.limit_keys = set(bounds["keys"])
            for key, row in bounds["over"].items():
                self.over_limit.setdefault(key, row)
        counter = (stats.get("counters") or {}).get("plain_tokens_from_estimates")
        if counter is not None:
            self.plain_from_estimates.append(int(counter))


def check_bounds(stats: dict) -> dict:
    """Every key present in both ``stats["limits"]`` and ``stats["usage"]`` must have usage <= limit."""
    limits, usage = stats.get("limits"), stats.get("usage")
    if not isinstance(limits, dict) or not isinstance(usage, dict):
        return {"checked": False, "missing": [k for k in ("limits", "usage") if not isinstance(stats.get(k), dict)],
                "keys": [], "over": {}}
    keys = sorted(set(limits) & set(usage))
    over = {}
    for k in keys:
        try:
            if limits[k] is not None and float(usage[k]) > float(limits[k]):
                over[k] = {"usage": usage[k], "limit": limits[k]}
        except (TypeError, ValueError):
            over[k] = {"usage": usage[k], "limit": limits[k], "error": "not a number"}
    return {"checked": True, "missing": [], "keys": keys, "over": over}


def pool_ok(pool: dict) -> bool:
    return pool["protected"] == 0 and pool["available"] + pool["evictable"] == pool["total"]


def wait_idle(endpoint: Endpoint, timeout: float = 120.0) -> Optional[dict]:
    """Stats once no request holds KV and the learning queue is empty (or at the timeout)."""
    deadline = time.monotonic() + timeout
    stats = None
    while time.monotonic() < deadline:
        stats = endpoint.stats()
        if stats and stats["kv_pool_tokens"]["protected"] == 0 and not stats.get("pending_observations"):
            return stats
        time.sleep(1.0)
    return stats


def flush(endpoint: Endpoint, attempts: int = 20) -> int:
    """SGLang's ``/flush_cache`` (refused while requests run, so retried); its last status."""
    status = 0
    for _ in range(attempts):
        out = endpoint.call("flush", "POST", "/flush_cache", admin=True)
        status = out.status
        if status == 200:
            return status
        time.sleep(1.0)
    return status


def warm_up(s: Shared, rounds: int) -> None:
    """Every agent's private prefix under every salt, then ``rounds`` team rounds, so that
    sources exist and kvcmas pools hold anchors before the clients start."""
    for salt in (None, *SALTS):
        for agent in TEAM:
            ids, cp = build_request(s.tokenizer, agent, [private_part(system_part(agent))])
            s.endpoint.generate("warmup", ids, custom_params=cp, salt=salt, max_new_tokens=1)
    for _ in range(rounds):
        text = s.fresh_text()
        for agent in TEAM:
            ids, cp = s.request(agent, text)
            s.endpoint.generate("warmup", ids, custom_params=cp, max_new_tokens=1)


def scan_log(text: str) -> dict:
    after = text.split("fired up")[-1]
    needles = ("Traceback", "memory leak detected", "use-after-free", "double free", "Exception in thread",
               "Segmentation fault")
    found = {n: after.count(n) for n in needles if n in after}
    lines = [ln for ln in after.splitlines() if any(n in ln for n in needles)]
    return {"found": found, "lines": lines[:20]}


def soak_launch_args(mode: str, tau: float, max_total_tokens: int, admin_key: str) -> dict:
    """``ServerProcess`` keyword arguments of the soak's server (``kvshare_args``, ``extra_args``)."""
    return {"kvshare_args": ("--kvshare-mode", mode, "--kvshare-tau", str(tau)),
            "extra_args": ("--max-total-tokens", str(max_total_tokens), "--admin-api-key", admin_key)}


def run_soak(args, tokenizer, model_path: str, texts: list[str], launched: Optional[ServerProcess] = None,
             admin_key: Optional[str] = None) -> dict:
    """Soak a fresh server: one started here, or ``launched`` (started by the caller with
    ``soak_launch_args(args.mode, args.tau, args.max_total_tokens, admin_key)``, and either never
    used or set back to those settings with its pools reset and its cache flushed)."""
    rec = Recorder()
    key = admin_key or secrets.token_hex(16)
    launch = soak_launch_args(args.mode, args.tau, args.max_total_tokens, key)
    if launched is not None and (tuple(launched.kvshare_args), tuple(launched.extra_args)) != (
            launch["kvshare_args"], launch["extra_args"]):
        raise ValueError(f"the launched server's arguments {launched.kvshare_args} {launched.extra_args} "
                         f"are not the soak's {launch}")
    result: dict = {}
    with (nullcontext(launched) if launched is not None else ServerProcess(model_path=model_path, **launch)) as server:
        ep = Endpoint(server.url, key, rec)
        started = time.monotonic()
        s = Shared(tokenizer, texts, ep, args.mode, args.tau, args.slot_names, deadline=0.0, started=started)
        t0 = time.monotonic()
        warm_up(s, args.warm_rounds)
        idle = wait_idle(ep, 120)
        start_stats = idle or ep.stats() or {}
        result["warmup_s"] = round(time.monotonic() - t0, 1)
        result["start"] = {"kv_pool_tokens": start_stats.get("kv_pool_tokens"),
                           "limits": start_stats.get("limits"), "usage": start_stats.get("usage")}
        s.started = time.monotonic()
        s.deadline = s.started + args.minutes * 60
        kinds = list(TRAFFIC)
        random.Random(args.seed).shuffle(kinds)
        kinds.remove("leak_probe")
        kinds.insert(0, "leak_probe")  # the leak needs one probe early, even in the shortest run
        clients = [Client(i, s, args.seed, kinds[i::args.clients] if args.clients > 1 else kinds)
                   for i in range(args.clients)]
        if args.clients > 1:
            clients[1 % args.clients].tour.insert(0, "salt_probe")
        monitor = Monitor(ep)
        s.monitor = monitor
        monitor.thread.start()
        threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
        for t in threads:
            t.start()
        total = int(args.minutes * 60)
        with tqdm(total=total, desc=f"soak {args.mode} x{args.clients}", unit="s", mininterval=2) as bar:
            while any(t.is_alive() for t in threads) and time.monotonic() < s.deadline + REQUEST_TIMEOUT_S + 30:
                time.sleep(5.0)
                bar.n = min(total, int(time.monotonic() - s.started))
                tot = rec.totals()
                bar.set_postfix(req=tot["requests"], c4xx=tot["client_4xx"], c5xx=tot["server_5xx"],
                                lost=tot["lost"], refresh=False)
                bar.refresh()
        stuck = sum(t.is_alive() for t in threads)
        result["clients_stuck_at_end"] = stuck
        result["load_s"] = round(time.monotonic() - s.started, 1)
        monitor.stop.set()
        monitor.thread.join(10)

        # Idle, flushed: the allocator must be back where it started.
        before_flush = wait_idle(ep, 180) or {}
        monitor.observe(Outcome(200, before_flush) if before_flush else Outcome(0))
        flush_status = flush(ep)
        time.sleep(1.0)
        end_stats = ep.stats() or {}
        alive = server.proc.poll() is None
        health = ep.call("health", "GET", "/health_generate", record=False).status if alive else 0
        result["server_log"] = scan_log(server.log_text())
        result["server_log_path"] = str(server.log_path)

    start_pool, end_pool = result["start"]["kv_pool_tokens"], end_stats.get("kv_pool_tokens")
    bounds = check_bounds(end_stats) if end_stats else {"checked": False, "missing": ["stats"], "over": {}}
    result.update(
        rec=rec, monitor=monitor, alive=alive, health=health, flush_status=flush_status,
        end={"kv_pool_tokens": end_pool, "limits": end_stats.get("limits"), "usage": end_stats.get("usage"),
             "counters": end_stats.get("counters"), "before_flush_kv_pool_tokens": before_flush.get("kv_pool_tokens")},
        allocator={"start_ok": bool(start_pool) and pool_ok(start_pool),
                   "end_ok": bool(end_pool) and pool_ok(end_pool),
                   "free_plus_evictable_same_as_start": bool(start_pool and end_pool) and (
                       start_pool["available"] + start_pool["evictable"]
                       == end_pool["available"] + end_pool["evictable"]),
                   "total_same": bool(start_pool and end_pool) and start_pool["total"] == end_pool["total"]},
        bounds=bounds, slot_names=len(rec.slot_names), clients=clients)
    return result


# ------------------------------------------------------------ replay against mode off
def pick_replay(plain: list[dict], n: int, seed: int) -> list[dict]:
    """Up to ``n`` plain requests: leak probes first, then those served most from cache."""
    order = {"leak_probe": 0, "leak_probe_off": 0, "plain_after_estimate": 1, "after_rid_reuse": 2, "plain": 3}
    rng = random.Random(seed)
    pool = list(plain)
    rng.shuffle(pool)
    pool.sort(key=lambda p: (order.get(p["tag"], 3), -p["cached_tokens"]))
    return pool[:n]


def compare(sample: dict, off_body: dict) -> dict:
    """Greedy tokens of the soak run vs the ``off`` replay; the top-2 gap where they first differ."""
    got, ref = sample["output_ids"], output_tokens(off_body)
    row = {"tag": sample["tag"], "prompt_tokens": len(sample["input_ids"]), "cached_tokens": sample["cached_tokens"],
           "salt": sample["salt"], "same": got == ref}
    if got == ref:
        return row
    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    tops = (off_body.get("meta_info", {}).get("output_top_logprobs") or [])
    gap = None
    if first < len(tops) and tops[first] and len(tops[first]) >= 2:
        vals = sorted((float(t[0]) for t in tops[first] if t[0] is not None), reverse=True)
        gap = vals[0] - vals[1] if len(vals) >= 2 else None
    row.update(first_diff=first, off_top2_gap=gap, near_tie=gap is not None and gap < NEAR_TIE,
               soak_tokens=got[:first + 3], off_tokens=ref[:first + 3])
    return row


def reference_server(model_path: str, max_total_tokens: int) -> ServerProcess:
    """The ``off`` server the plain requests are replayed on (not started)."""
    return ServerProcess(model_path=model_path, kvshare_args=["--kvshare-mode", "off"],
                         extra_args=["--max-total-tokens", str(max_total_tokens)])


def replay(url: str, samples: list[dict]) -> list[dict]:
    rows = []
    rec = Recorder()
    ep = Endpoint(url, None, rec)
    for sample in tqdm(samples, desc="replay in mode off", unit="req"):
        flush(ep, attempts=3)  # alone on a cold cache: no prefix of another replay
        out = ep.generate("replay", sample["input_ids"], salt=sample["salt"], max_new_tokens=PLAIN_TOKENS,
                          logprobs=True)
        if out.status != 200:
            rows.append({"tag": sample["tag"], "error": out.status, "same": None})
            continue
        rows.append(compare(sample, out.body))
    return rows


# ------------------------------------------------------------ verdicts and output
def verdicts(res: dict, replay_rows: list[dict]) -> dict:
    rec: Recorder = res["rec"]
    mon: Monitor = res["monitor"]
    tot = rec.totals()
    malformed = rec.malformed
    log_found = res["server_log"]["found"]
    salt_reuse = [p for p in rec.salt_probes if p["aligned"] or p["corrected"]]
    real = [r for r in replay_rows if r.get("same") is False and not r.get("near_tie")]
    counter_vals = mon.plain_from_estimates
    bounds = res["bounds"]
    v = {
        "no_crash": res["alive"] and res["health"] == 200 and not log_found,
        "no_5xx": tot["server_5xx"] == 0,
        "nothing_lost": tot["lost"] == 0 and res["clients_stuck_at_end"] == 0,
        "malformed_get_4xx": malformed["sent"] > 0 and malformed["got_4xx"] == malformed["sent"],
        "valid_requests_served": rec.finding_counts["valid_requests_served"] == 0,
        "allocator_restored": res["allocator"]["end_ok"] and res["allocator"]["free_plus_evictable_same_as_start"],
        "kvshare_within_bounds": ("not checked" if not bounds["checked"] and mon.limit_keys is None
                                  else not bounds["over"] and not mon.over_limit),
        "zero_cross_salt_reuse": bool(rec.salt_probes) and not salt_reuse,
        "plain_exact_structural": ("not checked" if not counter_vals else max(counter_vals) == 0),
        "plain_exact_by_output": bool(replay_rows) and not real and all(r.get("same") is not None
                                                                         for r in replay_rows),
        "harness_ok": rec.finding_counts["harness_errors"] == 0,
    }
    return v


def summarize(args, res: dict, replay_rows: list[dict], wall: float) -> dict:
    rec: Recorder = res["rec"]
    mon: Monitor = res["monitor"]
    v = verdicts(res, replay_rows)
    passed = all(x is True or x == "not checked" for x in v.values())
    command = "python -m benchmarks.soak " + " ".join(args.argv)
    return {
        "meta": run_meta(command.strip()),
        "command": command,
        "machine": machine(),
        "settings": {k: getattr(args, k) for k in ("mode", "tau", "clients", "minutes", "replay", "max_total_tokens",
                                                   "slot_names", "seed", "warm_rounds")},
        "passed": passed,
        "verdicts": v,
        "not_checked": [k for k, x in v.items() if x == "not checked"],
        "wall_s": round(wall, 1), "warmup_s": res["warmup_s"], "load_s": res["load_s"],
        "totals": rec.totals(),
        "operations_by_kind": dict(rec.sent),
        "requests_by_label": {k: dict(sorted((str(s), n) for s, n in c.items())) for k, c in rec.statuses.items()},
        "faults_injected": dict(sorted(rec.faults.items())),
        "faults_injected_total": sum(rec.faults.values()),
        "malformed": rec.malformed,
        "distinct_slot_names": res["slot_names"],
        "admin_calls": dict(rec.admin),
        "annotated_tokens": dict(rec.reuse),
        "annotated_fallbacks": dict(rec.fallbacks),
        "salt_probes": {"n": len(rec.salt_probes), "with_reuse": sum(bool(p["aligned"] or p["corrected"])
                                                                    for p in rec.salt_probes),
                        "examples": rec.salt_probes[:10]},
        "plain_requests": {"n": len(rec.plain), "by_tag": dict(Counter(p["tag"] for p in rec.plain)),
                           "with_cached_tokens": sum(p["cached_tokens"] > 0 for p in rec.plain)},
        "plain_tokens_from_estimates": {
            "readings": len(mon.plain_from_estimates),
            "max": max(mon.plain_from_estimates) if mon.plain_from_estimates else None,
            "note": None if mon.plain_from_estimates else "the counter never appeared in /kvshare/stats: either the "
                    "server lacks it or it exists only once non-zero; the output replay still checks plain requests"},
        "replay": {"n": len(replay_rows), "same": sum(r.get("same") is True for r in replay_rows),
                   "after_estimates": sum(r.get("tag") in ESTIMATE_TAGS for r in replay_rows),
                   "real_divergences": [r for r in replay_rows if r.get("same") is False and not r.get("near_tie")],
                   "near_tie_divergences": [r for r in replay_rows if r.get("same") is False and r.get("near_tie")],
                   "errors": [r for r in replay_rows if r.get("same") is None],
                   "near_tie_gap": NEAR_TIE},
        "allocator": {**res["allocator"], "start": res["start"]["kv_pool_tokens"],
                      "before_flush": res["end"]["before_flush_kv_pool_tokens"], "end": res["end"]["kv_pool_tokens"],
                      "flush_status": res["flush_status"]},
        "bounds": {"end": res["bounds"], "over_during_run": mon.over_limit, "stats_polls": mon.polls,
                   "limits": res["end"]["limits"], "usage": res["end"]["usage"]},
        "server": {"alive_at_end": res["alive"], "health_generate": res["health"], "log": res["server_log"]},
        "findings": {k: {"count": rec.finding_counts[k], "examples": ex} for k, ex in rec.findings.items()},
        "end_counters": res["end"]["counters"],
    }


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 clients x 1.25 min, 8 replays: < 5 minutes here")
    ap.add_argument("--mode", default="kvcmas", choices=["fullshared", "kvcmas"])
    ap.add_argument("--tau", type=float, default=1.0, help="gate threshold (1 accepts every correction)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--replay", type=int, default=40, help="plain requests replayed against mode off")
    ap.add_argument("--max-total-tokens", type=int, default=3072, help="KV pool of the soak server (small: evicts)")
    ap.add_argument("--slot-names", type=int, default=10000, help="distinct slot names to send over the run")
    ap.add_argument("--warm-rounds", type=int, default=3, help="team rounds before the clients start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/soak[_quick].json)")
    ap.add_argument("--reference-url", default=None,
                    help="replay on this running mode-off server (flushed before each replay) instead of "
                         "starting one; it must serve the same model")
    args = ap.parse_args(argv)
    args.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    if args.quick:
        args.clients, args.minutes, args.replay, args.slot_names = 2, 1.25, 8, 1500
    if args.clients < 1 or args.minutes <= 0 or args.replay < 0:
        ap.error("--clients must be >= 1, --minutes > 0 and --replay >= 0")
    return args


def main(argv=None, *, launched: Optional[ServerProcess] = None, admin_key: Optional[str] = None) -> int:
    """``launched``/``admin_key``: soak a server the caller started (see ``run_soak``; the test
    suite takes it from its server pool)."""
    args = parse_args(argv)
    out = Path(args.out or RESULTS / ("soak_quick.json" if args.quick else "soak.json"))
    from transformers import AutoTokenizer

    from benchmarks.texts import gsm8k_questions
    from devtools.models import prepare

    model_path = str(prepare("smollm2-135m"))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    qs = gsm8k_questions()
    texts = ["\n".join(f"Problem {j + 1}: {q}" for j, q in enumerate(qs[i:i + 2])) for i in range(0, 1200, 2)]
    t0 = time.monotonic()
    # NOTE: the off reference starts now, beside the soak's own server (a start is mostly
    # single-threaded imports), and idles (--sleep-on-idle) until the replay: about half a
    # server start saved. Launched from this thread, which outlives it (see ServerProcess.launch).
    reference = None if args.reference_url else reference_server(model_path, args.max_total_tokens)
    if reference is not None and args.replay > 0:
        reference.launch()
    try:
        res = run_soak(args, tokenizer, model_path, texts, launched, admin_key)
        samples = pick_replay(res["rec"].plain, args.replay, args.seed)
        rows = []
        if samples:
            if reference is not None:
                reference.wait_ready()
            rows = replay(args.reference_url or reference.url, samples)
    finally:
        if reference is not None:
            reference.stop()
    data = summarize(args, res, rows, time.monotonic() - t0)
    write_json(out, data)
    print(json.dumps({"passed": data["passed"], "verdicts": data["verdicts"], "totals": data["totals"],
                      "faults_injected_total": data["faults_injected_total"], "out": str(out)}, indent=1))
    return 0 if data["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
