"""Soak and fault harness: is a kvshare server safe to leave running in front of clients?

``python -m benchmarks.soak`` starts its own kvshare server on 127.0.0.1 (mode
``kvcmas`` with ``--kvshare-tau 1`` and ``--kvshare-edge-anchors 2`` by default, so that corrections really happen,
a small KV pool, ``--max-total-tokens 3072``, so that the tree evicts and SGLang
retracts, ``--kvshare-auto true`` and ``--enable-metrics``), runs N client threads
for M minutes against it, stops by itself and writes a JSON verdict.

The clients mix (``TRAFFIC``): valid multi-agent team rounds (four agents with their
own system prompts read the same GSM8K text, chained); plain requests (no
annotation) whose prompt equals an annotated one; probes built to catch a leak
(agent B assembled from agent A's copy, then a plain request with B's exact prompt)
and reuse across ``cache_salt`` (content seen only under salt A, asked under salt B);
malformed and adversarial annotations (a fixed catalogue and fuzzed JSON, see
``soak_faults``); requests with thousands of distinct slot names; streams closed
early; client-chosen ``rid`` reused (after completion, after an abort, twice at
once); admin calls (reset, config, a switch to ``off`` and back, calls without
the key). On ``/v1/chat/completions``: chained agents of four tenants (two OpenAI
``user``s, two ``cache_salt``s, each with its own system prompts) reading the same
documents, automatic and explicit (``kvshare`` field), streamed and not, 40-message
conversations, opt-outs (``"kvshare": false``); hostile chats (the chat layer's
sentinel text, list-valued content, tool calls, ``n > 1``, logprobs, explicit fields
to refuse); scope probes (a document only tenant A sent, then read by tenant B; also
``/generate`` annotations of two workflows); estimate probes (an assembled prompt
repeated, ``POST /kvshare/reset`` or ``/kvshare/config``, repeated again); and bursts
of concurrent decodes of staggered lengths that over-commit the KV pool, so that
SGLang retracts requests (counted from its log, not required).

Checks (``verdicts`` in the JSON): the server stayed up and its log holds no
traceback or leak message; no 5xx and no request lost (chat streams included);
every malformed annotation got a 4xx and every valid one a 200; the allocator is
back where it started once idle and flushed (``kv_pool_tokens``); kvshare memory
within its limits (``stats["limits"]`` vs ``stats["usage"]``, the read workspace
and the chat answer memory included); zero aligned or corrected tokens across
salts, users and workflows; no report names another scope's agent; hostile chats
answered like stock or refused with a message naming the fix; chat reports where
they belong; no estimate hit after a reset or a config change; ``/metrics``
serving ``sglang_kvshare_*``; and every plain request served from exact KV only,
structurally (``counters["plain_tokens_from_estimates"] == 0``) and by output: a
sample of plain requests is replayed one at a time on a fresh server in mode
``off`` (or on the running one ``--reference-url`` names, flushed before each
replay) and must give the same greedy tokens (divergences whose first differing
token was a near-tie in the ``off`` run are listed apart). A check the server
cannot answer yet (a missing field) is reported as ``"not checked"`` and does not
fail the run.

Every request has a timeout, the run has a deadline, and nothing leaves loopback.
"""

from __future__ import annotations

import argparse
import json
import random
import re
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
from benchmarks.soak_faults import (Case, ChatCase, adversarial_name, catalogue, chat_hostile, cross_scope_signs,
                                    expected_status, foreign_sources, fuzzed, many_slots, parse_stream,
                                    source_found)
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
           "slot_flood": 2, "abort": 2, "rid_reuse": 2, "admin": 2, "bad_sampling": 1,
           "chat": 6, "chat_hostile": 2, "scope_probe": 2, "reset_probe": 1, "retract_burst": 1}
EARLY = ("leak_probe", "reset_probe", "scope_probe", "retract_burst")  # first in the tours: even a short run has them
ESTIMATE_TAGS = ("leak_probe", "leak_probe_off", "plain_after_estimate")  # plain prompts assembled before
ADMIN_CALLS = ("mode_off_and_back", "reset", "no_key", "tau", "reset_slot", "pools", "mode_switch", "bad_config")

# The chat tenants: two OpenAI users and two cache salts, each with its own system prompts, all reading
# the same documents. A tenant is a reuse scope: (cache_salt, workflow), the workflow being the user.
CHAT_TENANTS = {
    "alice": {"user": "alice", "who": "Alice's study group"},
    "bob": {"user": "bob", "who": "Bob's tutoring service"},
    "salt-x": {"cache_salt": "chat-x", "who": "school X"},
    "salt-y": {"cache_salt": "chat-y", "who": "school Y"},
}
CHAT_ROLES = {"planner": "You plan how to solve the problem, step by step.",
              "checker": "You check every number in the problem and say which ones matter.",
              "writer": "You write the final answer in one sentence."}
# op_chat's variants in turn (shared counter): (mode, streamed, 40-message conversation)
CHAT_VARIANTS = (("auto", False, False), ("explicit", True, False), ("auto", True, True), ("opt_out", False, False),
                 ("explicit", False, True), ("auto", True, False), ("opt_out", True, False), ("auto", False, True))
LONG_CHAT_MESSAGES = 40
CHAT_MAX_TOKENS = 8
HOSTILE_PER_OP = 8
SCOPE_VARIANTS = ("user", "salt", "workflow")
# Retraction bursts: N concurrent decodes of about BURST_PROMPT prompt tokens (plus system prompt and
# template), 3 in 4 decoding BURST_LONG tokens and the others BURST_SHORT (min = max new tokens, so EOS ends
# none early; ignore_eos would make SGLang reserve every remaining token). SGLang admits a new request against
# the running ones' remaining tokens times its new-token ratio (0.7 after idle) and tries again only when one
# finishes: when a short one does, queued ones fill that estimate, the long ones then outgrow it and the
# scheduler retracts ("KV cache pool is full. Retract requests."). Sized for the 3072-token pool: 15 to 30 s
# here beside the other client; whether it retracts depends on that client's traffic, so it is counted,
# not required.
BURST_PROMPT, BURST_LONG, BURST_SHORT = 90, 48, 4
RETRACT_LOG = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")
RETRACTED_METRIC = "sglang:num_retracted_requests_total"
METRICS_PREFIX = "sglang_kvshare_"


def burst_lengths(n: int) -> list[int]:
    """New tokens of a burst's requests, in the order they are sent (see ``BURST_PROMPT``)."""
    return [BURST_SHORT if i % 4 == 1 else BURST_LONG for i in range(n)]


def chat_system(tenant: str, role: str) -> str:
    return f"You work for {CHAT_TENANTS[tenant]['who']}. {CHAT_ROLES[role]}"


def tenant_fields(tenant: str) -> dict:
    return {k: v for k, v in CHAT_TENANTS[tenant].items() if k in ("user", "cache_salt")}


def scope_of(salt: Optional[str], workflow: Optional[str]) -> str:
    """A reuse scope's name in the JSON: its cache salt and workflow (the chat API's user by default)."""
    return f"salt={salt or '-'} workflow={workflow or '-'}"


def chat_scope(body: dict) -> str:
    field_ = body.get("kvshare")
    workflow = field_.get("workflow") if isinstance(field_, dict) else None
    salt = body.get("cache_salt")
    return scope_of(salt if isinstance(salt, str) else None, workflow or body.get("user"))


def with_workflow(custom_params: dict, workflow: str) -> dict:
    """``custom_params`` of ``build_request`` with the annotation's ``workflow`` set."""
    ann = json.loads(custom_params["kvshare"])
    return {"kvshare": json.dumps({**ann, "workflow": workflow})}


def chat_report(out: "Outcome") -> Optional[dict]:
    """The ``kvshare`` report of a chat answer (top level, or the final chunk's for a stream)."""
    rep = out.body.get("kvshare") if isinstance(out.body, dict) else None
    return rep if isinstance(rep, dict) else None


def error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        return str(body.get("message") or (err.get("message") if isinstance(err, dict) else err) or "")
    return str(body or "")


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
        # the chat side
        self.chat: Counter = Counter()  # chat requests by variant (mode, streamed, long, tenant)
        self.chat_reports: list[dict] = []  # {"scope", "agent", "sources", "label"} per chat report
        self.hostile: list[dict] = []  # one row per hostile chat sent
        self.scope_probes: list[dict] = []
        self.reset_probes: list[dict] = []
        self.bursts: list[dict] = []

    def chat_answer(self, label: str, body: dict, report: Optional[dict]) -> None:
        """Keep what the scope checks need from one chat report: its scope, agent and source agents."""
        if not report:
            return
        sources = [seg["source_agent"] for seg in report.get("segments") or [] if seg.get("source_agent")]
        with self.lock:
            self.chat_reports.append({"scope": chat_scope(body), "agent": report.get("agent"), "sources": sources,
                                      "label": label})

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
def _payload(r: requests.Response) -> Any:
    """The answer's JSON, or its text when it is not JSON."""
    try:
        return r.json()
    except ValueError:
        return r.text


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
            out = Outcome(r.status_code, _payload(r), time.perf_counter() - t0)
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

    def chat(self, label: str, body: dict) -> Outcome:
        """``POST /v1/chat/completions``; a stream is read to its end (``soak_faults.parse_stream``)."""
        t0 = time.perf_counter()
        stream = bool(body.get("stream"))
        try:
            with requests.post(self.url + "/v1/chat/completions", json=body, stream=stream,
                               timeout=self.timeout) as r:
                payload = parse_stream(r.iter_lines()) if stream and r.status_code == 200 else _payload(r)
                out = Outcome(r.status_code, payload, time.perf_counter() - t0)
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
    burst_size: int = 32  # requests per retraction burst (0: none)
    burst_lock: threading.Lock = field(default_factory=threading.Lock)
    recent_chats: deque = field(default_factory=lambda: deque(maxlen=16))  # automatic chat bodies, for opt-outs
    turns: Counter = field(default_factory=Counter)  # per chat op family: how many ran (variants in turn)

    @property
    def rec(self) -> Recorder:
        return self.endpoint.recorder

    def turn(self, family: str) -> int:
        """The next turn of ``family`` (shared by the clients): each family's variants come in turn."""
        with self.counter_lock:
            n = self.turns[family]
            self.turns[family] += 1
        return n

    def clip(self, text: str, tokens: int) -> str:
        """``text`` cut to about ``tokens`` tokens."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return text if len(ids) <= tokens else self.tokenizer.decode(ids[:tokens])

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


    # --- chat -------------------------------------------------------------------
    def _chat(self, label: str, body: dict, *, report: Optional[bool]) -> Outcome:
        """One valid chat request. ``report``: True, it must carry a kvshare report (a stream: on its chunk
        with the finish reason) with at most ``max_segments`` segments; False, none (an opt-out)."""
        out = self.s.endpoint.chat(label, body)
        rep = chat_report(out)
        self.s.rec.chat_answer(label, body, rep)
        where = {"request": label, "status": out.status, "stream": bool(body.get("stream")),
                 "explicit": isinstance(body.get("kvshare"), dict), "messages": len(body["messages"]),
                 "scope": chat_scope(body)}
        if out.status != 200:
            if out.status and out.status < 500:
                self.s.rec.find("valid_requests_served", {**where, "body": str(out.body)[:300]})
            return out
        if body.get("stream"):
            got = out.body
            if got["errors"]:
                self.s.rec.find("valid_requests_served", {**where, "stream_errors": got["errors"][:3]})
            if not got["done"] or not got["finish_reasons"]:
                self.s.rec.find("nothing_lost", {**where, "incomplete_stream": {
                    k: got[k] for k in ("chunks", "done", "finish_reasons")}})
        if report is True:
            if rep is None:
                self.s.rec.find("chat_reports_carried", {**where, "missing": "no kvshare report"})
            elif body.get("stream") and not out.body["report_on_final_chunk"]:
                self.s.rec.find("chat_reports_carried", {**where, "reports": out.body["reports"],
                                                         "misplaced": "not on the chunk with the finish reason"})
            elif len(rep.get("segments") or []) > self.s.max_segments:
                self.s.rec.find("chat_reports_carried", {**where, "segments": len(rep["segments"])})
        elif report is False and rep is not None:
            self.s.rec.find("chat_reports_carried", {**where, "opt_out": "an opted-out request carried a report"})
        return out

    @staticmethod
    def _answer_text(out: Outcome) -> str:
        if out.status != 200 or not isinstance(out.body, dict):
            return ""
        if out.body.get("stream"):
            return str(out.body.get("text") or "")
        choices = out.body.get("choices") or [{}]
        return str(((choices[0] or {}).get("message") or {}).get("content") or "")

    def _history(self, n: int) -> list[dict]:
        """``n`` earlier turns of a long conversation: GSM8K snippets, user and assistant in turn."""
        turns = []
        for j in range(n):
            snippet = self.s.texts[self.rng.randrange(len(self.s.texts))][:90]
            turns.append({"role": "user" if j % 2 == 0 else "assistant", "content": f"Earlier note {j}: {snippet}"})
        return turns

    def op_chat(self) -> None:
        """Agents of one tenant in a chain on a working document (a later agent reads the previous answer),
        the variant in turn: automatic, explicit or opted out; streamed or not; 40 messages or a few."""
        turn = self.s.turn("chat")
        mode, stream, long = CHAT_VARIANTS[turn % len(CHAT_VARIANTS)]
        tenant = list(CHAT_TENANTS)[(turn + turn // len(CHAT_VARIANTS)) % len(CHAT_TENANTS)]
        with self.s.rec.lock:
            self.s.rec.chat[f"{mode}{' streamed' if stream else ''}{' long' if long else ''}"] += 1
            self.s.rec.chat[f"tenant {tenant}"] += 1
        if mode == "opt_out":
            return self._chat_opt_out(tenant, stream)
        text = self.s.working_text(self.rng)
        history = self._history(LONG_CHAT_MESSAGES - 4) if long else []
        prev: Optional[tuple[str, str]] = None  # (role, answer)
        for role in self.rng.sample(list(CHAT_ROLES), 1 if long else self.rng.randint(2, 3)):
            messages = [{"role": "system", "content": chat_system(tenant, role)}, *history,
                        {"role": "user", "content": f"Context:\n{text}"}]
            if prev:
                messages.append({"role": "assistant", "content": prev[1]})
            messages.append({"role": "user", "content": "Answer briefly."})
            body = {"model": "default", "messages": messages, "max_tokens": CHAT_MAX_TOKENS, "temperature": 0.0,
                    "stream": stream, **tenant_fields(tenant)}
            if mode == "explicit":
                ctx = 1 + len(history)
                shared = [{"message": 1 + j, "slot": "history"} for j in range(0, len(history), 4)]
                shared.append({"message": ctx, "slot": "query"})
                if prev:
                    shared.append({"message": ctx + 1, "slot": f"out:{prev[0]}"})
                body["kvshare"] = {"agent": f"{role}@{tenant}", "shared": shared, "output_slot": f"out:{role}"}
            out = self._chat("chat", body, report=True)
            if mode == "auto" and out.status == 200:
                self.s.recent_chats.append(body)
            answer = self._answer_text(out)
            prev = (role, answer) if answer.strip() else None

    def _chat_opt_out(self, tenant: str, stream: bool) -> None:
        """``"kvshare": false``: an earlier automatic chat repeated word for word (its prompt was assembled),
        which must be served as stock: no report, and no estimate among its cached tokens."""
        recent = list(self.s.recent_chats)
        if recent:
            body = dict(self.rng.choice(recent))
        else:
            role = self.rng.choice(list(CHAT_ROLES))
            body = {"model": "default", "max_tokens": CHAT_MAX_TOKENS, "temperature": 0.0, **tenant_fields(tenant),
                    "messages": [{"role": "system", "content": chat_system(tenant, role)},
                                 {"role": "user", "content": f"Context:\n{self.s.working_text(self.rng)}"},
                                 {"role": "user", "content": "Answer briefly."}]}
        body.update(stream=stream, kvshare=False)
        self._chat("chat", body, report=False)

    def op_chat_hostile(self) -> None:
        """The next ``HOSTILE_PER_OP`` cases of the hostile chat catalogue (in turn over the run) for one tenant."""
        turn = self.s.turn("chat_hostile")
        tenant = list(CHAT_TENANTS)[turn % len(CHAT_TENANTS)]
        role = self.rng.choice(list(CHAT_ROLES))
        cases = chat_hostile(chat_system(tenant, role), self.s.clip(self.s.working_text(self.rng), 80), self.rng)
        for k in range(HOSTILE_PER_OP):
            case: ChatCase = cases[(turn * HOSTILE_PER_OP + k) % len(cases)]
            body = {"model": "default", "max_tokens": 4, "temperature": 0.0, **tenant_fields(tenant), **case.body}
            out = self.s.endpoint.chat("chat_hostile", body)
            rep = chat_report(out)
            self.s.rec.chat_answer("chat_hostile", body, rep)
            streamed = out.status == 200 and isinstance(out.body, dict) and out.body.get("stream") is True
            row = {"kind": case.kind, "auto": case.auto, "fix": case.fix, "refuse": case.refuse, "status": out.status,
                   "message": error_message(out.body)[:300] if out.status != 200 else "",
                   "stream_errors": out.body["errors"][:3] if streamed else [], "report": rep is not None}
            if out.status != 200 and case.auto:
                row["body"] = body  # replayed on the off reference: does stock SGLang answer the same?
            with self.s.rec.lock:
                self.s.rec.hostile.append(row)
                self.s.rec.faults[f"chat_{case.kind}"] += 1

    def op_scope_probe(self) -> None:
        """Content only tenant A has sent (a fresh document and a nonce): a second agent of A reads it (the
        control: it finds A's copy), then an agent of tenant B, another user or another cache salt, reads it
        (automatic or explicit); or the same on ``/generate`` with annotations of two workflows. Nothing of
        B's request may be aligned, corrected, or even find a copy of A's."""
        turn = self.s.turn("scope_probe")
        variant = SCOPE_VARIANTS[turn % len(SCOPE_VARIANTS)]
        doc = self.s.clip(self.s.probe_text(), 120)
        nonce = f"{self.rng.getrandbits(32):x}"
        explicit = variant == "workflow" or self.rng.random() < 0.5
        with self.s.admin_lock:  # no mode switch in the middle
            if variant == "workflow":
                scopes = [f"wf-{nonce}-a", f"wf-{nonce}-a", f"wf-{nonce}-b"]
                reps = self._workflow_probe(doc, nonce, scopes)
            else:
                pair = ["alice", "bob"] if variant == "user" else ["salt-x", "salt-y"]
                self.rng.shuffle(pair)
                scopes = [pair[0], pair[0], pair[1]]
                reps = []
                for tenant, role in zip(scopes, self.rng.sample(list(CHAT_ROLES), 3)):
                    messages = [{"role": "system", "content": chat_system(tenant, role)},
                                {"role": "user", "content": f"Context:\n{doc}"},
                                {"role": "assistant", "content": f"Noted (case {nonce})."},
                                {"role": "user", "content": f"Answer briefly (case {nonce})."}]
                    body = {"model": "default", "messages": messages, "max_tokens": 2, "temperature": 0.0,
                            **tenant_fields(tenant)}
                    if explicit:
                        body["kvshare"] = {"agent": f"{role}@{tenant}", "shared": [{"message": 1, "slot": "query"}]}
                    out = self._chat("scope_probe", body, report=True)
                    reps.append(chat_report(out) if out.status == 200 else None)
        if reps[2] is None:
            return  # the failed request is a finding already
        signs = cross_scope_signs(reps[2])
        probe = {"variant": variant, "explicit": explicit, "scopes": [scopes[0], scopes[2]],
                 "control_found_a_copy": source_found(reps[1]), "reached": signs["reached"] > 0,
                 "reused_tokens": signs["reused_tokens"], "found": signs["found"],
                 "tokens_aligned": int(reps[2].get("tokens_aligned") or 0),
                 "tokens_corrected": int(reps[2].get("tokens_corrected") or 0)}
        with self.s.rec.lock:
            self.s.rec.scope_probes.append(probe)
        if signs["reused_tokens"] or signs["found"]:
            self.s.rec.find("zero_cross_scope_reuse", probe)

    def _workflow_probe(self, doc: str, nonce: str, workflows: list[str]) -> list[Optional[dict]]:
        """solver and analyst of workflow A, then coder of workflow B, on ``/generate`` (no salt)."""
        suffix = SUFFIX.replace("briefly", f"briefly (case {nonce})")
        reps: list[Optional[dict]] = []
        for i, (agent, wf) in enumerate(zip(("solver", "analyst", "coder"), workflows)):
            if i:  # its private prefix in the tree, so that the cache reaches the shared text
                head, cp = build_request(self.s.tokenizer, agent, [private_part(system_part(agent))])
                self.s.endpoint.generate("scope_probe", head, custom_params=with_workflow(cp, wf), max_new_tokens=1)
            ids, cp = self.s.request(agent, doc, suffix=suffix)
            out = self.s.endpoint.generate("scope_probe", ids, custom_params=with_workflow(cp, wf), max_new_tokens=2)
            if out.status == 200:
                self.s.rec.annotated(out)
            elif out.status and out.status < 500:
                self.s.rec.find("valid_requests_served", {"request": "scope_probe", "status": out.status,
                                                          "body": str(out.body)[:300]})
            reps.append(out.report if out.status == 200 else None)
        return reps

    def op_reset_probe(self) -> None:
        """An assembled prompt repeated (its estimate is hit), then ``POST /kvshare/reset`` or a
        ``/kvshare/config`` write (in turn), then repeated again: that repeat must hit no estimate."""
        variant = ("reset", "config")[self.s.turn("reset_probe") % 2]
        text = self.s.probe_text()
        suffix = SUFFIX.replace("briefly", f"briefly (case {self.rng.getrandbits(32):x})")
        ep = self.s.endpoint
        with self.s.admin_lock:
            if self.s.monitor is not None:  # a reset may zero the counters: read them first
                self.s.monitor.observe(ep.call("stats", "GET", "/kvshare/stats"))
            switched = self.s.mode != "fullshared"
            if switched:  # fullshared aligns whenever a source exists: the analyst is assembled
                self._admin_write("/kvshare/config", {"mode": "fullshared"})
            head, cp = build_request(self.s.tokenizer, "analyst", [private_part(system_part("analyst"))])
            ep.generate("reset_probe", head, custom_params=cp, max_new_tokens=1)
            self._annotated("reset_probe", "solver", text, None, suffix=suffix)
            _, first = self._annotated("reset_probe", "analyst", text, None, suffix=suffix)
            _, before = self._annotated("reset_probe", "analyst", text, None, suffix=suffix)
            if variant == "reset":
                self._admin_write("/kvshare/reset")
                _, after = self._annotated("reset_probe", "analyst", text, None, suffix=suffix)
                if switched:
                    self._admin_write("/kvshare/config", {"mode": self.s.mode, "tau": self.s.tau})
            else:
                self._admin_write("/kvshare/config", {"mode": self.s.mode, "tau": self.s.tau})
                _, after = self._annotated("reset_probe", "analyst", text, None, suffix=suffix)
        hit_before = int(before.report.get("tokens_estimate_hit") or 0) if before.status == 200 else 0
        hit_after = int(after.report.get("tokens_estimate_hit") or 0) if after.status == 200 else None
        keys = ("tokens_exact_hit", "tokens_estimate_hit", "tokens_aligned", "tokens_corrected", "tokens_prefilled")
        probe = {"variant": variant, "assembled_tokens": estimated_tokens(first.report) if first.status == 200 else 0,
                 "estimate_hit_before": hit_before, "armed": hit_before > 0, "estimate_hit_after": hit_after,
                 "after_report": {k: after.report.get(k) for k in keys} if after.status == 200 else None}
        with self.s.rec.lock:
            self.s.rec.reset_probes.append(probe)
        if hit_before > 0 and hit_after:
            self.s.rec.find("no_estimates_after_reset", probe)

    def op_retract_burst(self) -> None:
        """``burst_size`` concurrent decodes of staggered lengths (annotated and plain ``/generate``, automatic
        chats streamed and not) over-committing the KV pool, so that SGLang retracts some; every one must
        still come back whole (min = max new tokens). One burst at a time; else a chat round."""
        if self.s.burst_size <= 0 or not self.s.burst_lock.acquire(blocking=False):
            return self.op_chat()
        try:
            self._burst()
        finally:
            self.s.burst_lock.release()

    def _burst(self) -> None:
        n = self.s.burst_size
        docs = [self.s.clip(self.s.probe_text(), BURST_PROMPT) for _ in range((n + 1) // 2)]
        kinds = ("annotated", "chat", "plain", "chat_stream")
        lengths = burst_lengths(n)
        results: dict[int, dict] = {}
        ep = self.s.endpoint

        def one(i: int) -> None:
            m = lengths[i]
            kind = kinds[(i + i // 4) % 4]
            doc = docs[i // 2]
            got = None
            if kind in ("annotated", "plain"):
                ids, cp = self.s.request(TEAM[i % len(TEAM)], doc)
                out = ep.generate("retract_burst", ids, custom_params=cp if kind == "annotated" else None,
                                  max_new_tokens=m, sampling={"min_new_tokens": m})
                if out.status == 200:
                    got = out.body.get("meta_info", {}).get("completion_tokens")
                    if kind == "annotated":
                        self.s.rec.annotated(out)
                elif out.status and out.status < 500:
                    self.s.rec.find("valid_requests_served", {"request": "retract_burst", "status": out.status,
                                                              "body": str(out.body)[:300]})
            else:
                tenant = list(CHAT_TENANTS)[i % len(CHAT_TENANTS)]
                role = list(CHAT_ROLES)[i % len(CHAT_ROLES)]
                body = {"model": "default", "max_tokens": m, "min_tokens": m, "temperature": 0.0,
                        "stream": kind == "chat_stream", **tenant_fields(tenant),
                        "messages": [{"role": "system", "content": chat_system(tenant, role)},
                                     {"role": "user", "content": f"Context:\n{doc}"},
                                     {"role": "assistant", "content": "Noted."},
                                     {"role": "user", "content": "Answer briefly."}]}
                if body["stream"]:
                    body["stream_options"] = {"include_usage": True}
                out = self._chat("retract_burst", body, report=True)
                if out.status == 200 and isinstance(out.body, dict):
                    got = (out.body.get("usage") or {}).get("completion_tokens")
            results[i] = {"kind": kind, "max_new_tokens": m, "status": out.status, "completion_tokens": got}

        t0 = time.monotonic()
        threads = []
        for i in range(n):  # in order: the long and short ones interleave in the queue as planned
            threads.append(threading.Thread(target=one, args=(i,), daemon=True))
            threads[-1].start()
            time.sleep(0.01)
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 30)
        rows = [results.get(i, {"status": None}) for i in range(n)]
        short = [r for r in rows if r.get("status") == 200 and r.get("completion_tokens") != r.get("max_new_tokens")]
        for r in short:
            self.s.rec.find("nothing_lost", {"request": "retract_burst", "cut_short": r})
        with self.s.rec.lock:
            self.s.rec.bursts.append({"requests": n, "seconds": round(time.monotonic() - t0, 1),
                                      "answered_200": sum(r.get("status") == 200 for r in rows),
                                      "complete": sum(r.get("status") == 200 and r not in short for r in rows),
                                      "by_kind": dict(Counter(r.get("kind") for r in rows))})


# ------------------------------------------------------------ the run
class Monitor:
    """Polls ``/kvshare/stats`` every ``period`` s (answers, bounds, the plain-estimate counter), the chat
    layer's answer memory (``GET /kvshare/chat``) every ``chat_every`` polls and ``/metrics`` every
    ``metrics_every`` polls."""

    def __init__(self, endpoint: Endpoint, period: float = 2.0, chat_every: int = 3, metrics_every: int = 5) -> None:
        self.endpoint = endpoint
        self.period = period
        self.chat_every = chat_every
        self.metrics_every = metrics_every
        self.stop = threading.Event()
        self.polls = 0
        self.over_limit: dict[str, dict] = {}
        self.limit_keys: Optional[set] = None
        self.plain_from_estimates: list[int] = []
        self.workspace_polls = 0  # stats polls whose limits and usage both had read_workspace_bytes
        self.over_memory_bound: list[dict] = []
        self.chat_polls = 0
        self.chat_outputs_max_bytes = 0
        self.chat_over: list[dict] = []
        self.metrics_polls = 0
        self.metrics_ok = 0
        self.metrics_bad: list[dict] = []
        self.metrics_kvshare_lines = 0
        self.retracted_metric: list[float] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        n = 0
        while not self.stop.wait(self.period):
            n += 1
            self.observe(self.endpoint.call("stats", "GET", "/kvshare/stats"))
            if n % self.chat_every == 0:
                self.observe_chat(self.endpoint.call("chat_stats", "GET", "/kvshare/chat"))
            if n % self.metrics_every == 0:
                self.observe_metrics(self.endpoint.call("metrics", "GET", "/metrics"))

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
            if "read_workspace_bytes" in bounds["keys"]:
                self.workspace_polls += 1
            bound, usage = stats.get("memory_bound_bytes"), stats["usage"]
            held = sum(int(usage.get(k) or 0) for k in ("anchor_bytes", "learn_queue_bytes", "read_workspace_bytes"))
            if isinstance(bound, (int, float)) and held > bound and len(self.over_memory_bound) < 10:
                self.over_memory_bound.append({"held_bytes": held, "memory_bound_bytes": bound})
        counter = (stats.get("counters") or {}).get("plain_tokens_from_estimates")
        if counter is not None:
            self.plain_from_estimates.append(int(counter))

    def observe_chat(self, out: Outcome) -> None:
        """The chat answer memory is bounded in bytes (and answers): ``outputs.bytes <= outputs.max_bytes``."""
        outputs = out.body.get("outputs") if out.status == 200 and isinstance(out.body, dict) else None
        if not isinstance(outputs, dict) or "bytes" not in outputs:
            return
        self.chat_polls += 1
        self.chat_outputs_max_bytes = max(self.chat_outputs_max_bytes, int(outputs["bytes"]))
        over = outputs["bytes"] > outputs.get("max_bytes", float("inf")) or \
            outputs.get("size", 0) > outputs.get("capacity", float("inf"))
        if over and len(self.chat_over) < 10:
            self.chat_over.append({k: outputs.get(k) for k in ("bytes", "max_bytes", "size", "capacity")})

    def observe_metrics(self, out: Outcome) -> None:
        """``/metrics`` answers 200 and carries ``sglang_kvshare_*`` lines; SGLang's retraction counter."""
        self.metrics_polls += 1
        text = out.body if isinstance(out.body, str) else ""
        lines = text.splitlines()
        kvshare = sum(ln.startswith(METRICS_PREFIX) for ln in lines)
        if out.status == 200 and kvshare:
            self.metrics_ok += 1
            self.metrics_kvshare_lines = kvshare
        elif len(self.metrics_bad) < 10:
            self.metrics_bad.append({"status": out.status, "kvshare_lines": kvshare, "head": text[:200]})
        if out.status == 200:  # the counter appears once SGLang first retracts: absent is 0
            self.retracted_metric.append(sum(float(ln.rsplit(" ", 1)[-1]) for ln in lines
                                             if ln.startswith(RETRACTED_METRIC)))


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


def retractions(text: str) -> dict:
    """SGLang's decode retractions in a server log: ``KV cache pool is full. Retract requests.``"""
    counts = [int(m.group(1)) for m in RETRACT_LOG.finditer(text)]
    return {"events": len(counts), "requests_retracted": sum(counts),
            "lines": [ln.strip()[-160:] for ln in text.splitlines() if "Retract requests" in ln][:10]}


def scan_log(text: str) -> dict:
    after = text.split("fired up")[-1]
    needles = ("Traceback", "memory leak detected", "use-after-free", "double free", "Exception in thread",
               "Segmentation fault")
    found = {n: after.count(n) for n in needles if n in after}
    lines = [ln for ln in after.splitlines() if any(n in ln for n in needles)]
    return {"found": found, "lines": lines[:20]}


def soak_launch_args(mode: str, tau: float, max_total_tokens: int, admin_key: str) -> dict:
    """``ServerProcess`` keyword arguments of the soak's server (``kvshare_args``, ``extra_args``)."""
    # NOTE: edge anchors 2 (the gate's minimum), so that corrections start within the soak's minutes; segments
    # of any length reused, so that the soak's short chats exercise reuse (the product's default keeps them dense).
    return {"kvshare_args": ("--kvshare-mode", mode, "--kvshare-tau", str(tau), "--kvshare-auto", "true",
                             "--kvshare-edge-anchors", "2", "--kvshare-min-reuse-tokens", "0"),
            "extra_args": ("--max-total-tokens", str(max_total_tokens), "--admin-api-key", admin_key,
                           "--enable-metrics")}


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
        log_start = len(server.log_text())  # a launched server may have served others before
        started = time.monotonic()
        s = Shared(tokenizer, texts, ep, args.mode, args.tau, args.slot_names, deadline=0.0, started=started,
                   burst_size=args.retract_burst)
        t0 = time.monotonic()
        warm_up(s, args.warm_rounds)
        idle = wait_idle(ep, 120)
        start_stats = idle or ep.stats() or {}
        result["warmup_s"] = round(time.monotonic() - t0, 1)
        result["start"] = {"kv_pool_tokens": start_stats.get("kv_pool_tokens"),
                           "limits": start_stats.get("limits"), "usage": start_stats.get("usage")}
        s.started = time.monotonic()
        s.deadline = s.started + args.minutes * 60
        kinds = [k for k in TRAFFIC if k not in EARLY]
        random.Random(args.seed).shuffle(kinds)
        kinds = [*EARLY, *kinds]  # the probes early, even in the shortest run
        clients = [Client(i, s, args.seed, kinds[i::args.clients] if args.clients > 1 else kinds)
                   for i in range(args.clients)]
        if args.clients > 1:
            clients[1 % args.clients].tour.insert(0, "salt_probe")
        monitor = Monitor(ep)
        s.monitor = monitor
        monitor.observe_metrics(ep.call("metrics", "GET", "/metrics"))  # the retraction counter before the load
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
        monitor.observe(Outcome(200, end_stats) if end_stats else Outcome(0))
        monitor.observe_chat(ep.call("chat_stats", "GET", "/kvshare/chat"))
        monitor.observe_metrics(ep.call("metrics", "GET", "/metrics"))
        alive = server.proc.poll() is None
        health = ep.call("health", "GET", "/health_generate", record=False).status if alive else 0
        log = server.log_text()
        result["server_log"] = scan_log(log)
        result["server_log_path"] = str(server.log_path)
        result["retraction_log"] = retractions(log[log_start:])

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


def stock_statuses(url: str, rows: list[dict]) -> None:
    """Hostile automatic chats the soak server refused: the status stock SGLang (mode ``off``) gives the
    same body, in ``row["stock_status"]``. The ``off`` reference has no automatic mode: it is stock here."""
    ep = Endpoint(url, None, Recorder())
    for row in rows:
        body = {k: v for k, v in row["body"].items() if k != "kvshare"}
        row["stock_status"] = ep.chat("stock", body).status


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
        "nothing_lost": (tot["lost"] == 0 and res["clients_stuck_at_end"] == 0
                         and rec.finding_counts["nothing_lost"] == 0),
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
    counts = verdict_counts(res)
    v.update({
        "zero_cross_scope_reuse": ("not checked" if not rec.scope_probes
                                   else counts["zero_cross_scope_reuse"]["reused_tokens"] == 0
                                   and counts["zero_cross_scope_reuse"]["found_a_foreign_copy"] == 0),
        "zero_foreign_agent_names": ("not checked" if not rec.chat_reports
                                     else counts["zero_foreign_agent_names"]["foreign"] == 0
                                     and counts["zero_foreign_agent_names"]["unknown"] == 0),
        "chat_hostile_answered": ("not checked" if not rec.hostile
                                  else counts["chat_hostile_answered"]["not_ok"] == 0),
        "chat_reports_carried": ("not checked" if not rec.chat_reports
                                 else rec.finding_counts["chat_reports_carried"] == 0),
        "memory_within_bounds": memory_verdict(mon),
        "no_estimates_after_reset": ("not checked" if not counts["no_estimates_after_reset"]["armed"]
                                     else counts["no_estimates_after_reset"]["hit_after_reset"] == 0),
        "metrics_served": ("not checked" if not mon.metrics_polls else mon.metrics_ok == mon.metrics_polls),
    })
    return v


def memory_verdict(mon: "Monitor") -> Any:
    """Stats usage <= limits at every poll, the read workspace among them; what kvshare holds <=
    ``memory_bound_bytes``; the chat answer memory within its byte (and answer) bound."""
    if not mon.workspace_polls and not mon.chat_polls:
        return "not checked"
    return not mon.over_limit and not mon.over_memory_bound and not mon.chat_over and mon.workspace_polls > 0 \
        and mon.chat_polls > 0


def hostile_ok(row: dict) -> bool:
    """A hostile chat: no 5xx; answered (a 200 without an error chunk) when stock answers it, or a 4xx
    whose message names the fix; a 4xx on one stock SGLang answers the same way is fine too."""
    status = row["status"]
    if not status or status >= 500:
        return False
    if status == 200:
        return not row["refuse"] and not row["stream_errors"]
    if not 400 <= status < 500:
        return False
    if row["fix"] is None:
        return row.get("stock_status") == status
    return str(row["fix"]).lower() in row["message"].lower()


def verdict_counts(res: dict) -> dict:
    """Per new verdict, the counts behind it (also written to the JSON)."""
    rec: Recorder = res["rec"]
    mon: Monitor = res["monitor"]
    probes = rec.scope_probes
    resets = rec.reset_probes
    hostile = rec.hostile
    agents = foreign_sources(rec.chat_reports)
    tot = rec.totals()
    chat_labels = ("chat", "chat_hostile", "scope_probe", "retract_burst")
    chat_status: Counter = Counter()
    for label in chat_labels:
        chat_status.update(rec.statuses.get(label, Counter()))
    return {
        "zero_cross_scope_reuse": {
            "probes": len(probes), "by_variant": dict(Counter(p["variant"] for p in probes)),
            "explicit": sum(p["explicit"] for p in probes),
            "control_found_a_copy": sum(p["control_found_a_copy"] for p in probes),
            "reached_the_shared_text": sum(p["reached"] for p in probes),
            "sensitive": sum(p["control_found_a_copy"] and p["reached"] for p in probes),
            "reused_tokens": sum(p["reused_tokens"] for p in probes),
            "found_a_foreign_copy": sum(bool(p["found"]) for p in probes),
            "generate_salt_probes": len(rec.salt_probes), "examples": probes[:6]},
        "zero_foreign_agent_names": {k: agents[k] for k in ("reports", "scopes", "named_sources", "foreign", "unknown",
                                                             "examples")},
        "chat_hostile_answered": {
            "sent": len(hostile), "kinds": len({h["kind"] for h in hostile}),
            "ok_200": sum(h["status"] == 200 and hostile_ok(h) for h in hostile),
            "refused_4xx_naming_the_fix": sum(h["status"] != 200 and hostile_ok(h) for h in hostile),
            "server_5xx": sum(h["status"] >= 500 for h in hostile), "lost": sum(not h["status"] for h in hostile),
            "not_ok": sum(not hostile_ok(h) for h in hostile),
            "by_kind": {k: dict(Counter(str(h["status"]) for h in hostile if h["kind"] == k))
                        for k in sorted({h["kind"] for h in hostile})},
            "failures": [{k: v for k, v in h.items() if k != "body"} for h in hostile if not hostile_ok(h)][:10]},
        "chat_reports_carried": {
            "chat_requests": dict(rec.chat), "reports": len(rec.chat_reports),
            "findings": rec.finding_counts["chat_reports_carried"]},
        "memory_within_bounds": {
            "stats_polls": mon.polls, "polls_with_read_workspace": mon.workspace_polls,
            "over_limit": mon.over_limit, "over_memory_bound": mon.over_memory_bound,
            "chat_polls": mon.chat_polls, "chat_outputs_max_bytes_seen": mon.chat_outputs_max_bytes,
            "chat_over": mon.chat_over},
        "no_estimates_after_reset": {
            "probes": len(resets), "armed": sum(p["armed"] for p in resets),
            "by_variant": dict(Counter(p["variant"] for p in resets)),
            "hit_after_reset": sum(bool(p["armed"] and p["estimate_hit_after"]) for p in resets),
            "examples": resets[:6]},
        "metrics_served": {"polls": mon.metrics_polls, "ok": mon.metrics_ok,
                           "kvshare_lines": mon.metrics_kvshare_lines, "bad": mon.metrics_bad},
        "no_5xx": {"server_5xx": tot["server_5xx"], "chat_requests": sum(chat_status.values()),
                   "chat_server_5xx": sum(v for k, v in chat_status.items() if k >= 500)},
        "nothing_lost": {"lost": tot["lost"], "chat_lost": chat_status.get(0, 0),
                         "clients_stuck_at_end": res["clients_stuck_at_end"],
                         "incomplete": rec.finding_counts["nothing_lost"]},
    }


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
                                                   "slot_names", "seed", "warm_rounds", "retract_burst")},
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
        "verdict_counts": verdict_counts(res),
        "chat": {"requests_by_variant": dict(rec.chat), "reports": len(rec.chat_reports),
                 "reports_by_scope": dict(Counter(r["scope"] for r in rec.chat_reports)),
                 "hostile_sent": len(rec.hostile), "scope_probes": len(rec.scope_probes),
                 "reset_probes": len(rec.reset_probes)},
        "retraction": {**res["retraction_log"], "bursts": rec.bursts,
                       "metric_delta": (mon.retracted_metric[-1] - mon.retracted_metric[0]
                                        if len(mon.retracted_metric) >= 2 else None),
                       "note": "counted, not required: whether SGLang retracts depends on timing here"},
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
    ap.add_argument("--retract-burst", type=int, default=32,
                    help="concurrent decodes per retraction burst (0: no bursts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/soak[_quick].json)")
    ap.add_argument("--reference-url", default=None,
                    help="replay on this running mode-off server (flushed before each replay) instead of "
                         "starting one; it must serve the same model")
    args = ap.parse_args(argv)
    args.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    if args.quick:
        args.clients, args.minutes, args.replay, args.slot_names = 2, 1.25, 8, 1500
    if args.clients < 1 or args.minutes <= 0 or args.replay < 0 or args.retract_burst < 0:
        ap.error("--clients must be >= 1, --minutes > 0, --replay >= 0 and --retract-burst >= 0")
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
        refused = [h for h in res["rec"].hostile if h.get("body") is not None]
        if samples or refused:
            if reference is not None:
                if args.replay == 0:
                    reference.launch()
                reference.wait_ready()
            rows = replay(args.reference_url or reference.url, samples) if samples else []
            stock_statuses(args.reference_url or reference.url, refused)
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
