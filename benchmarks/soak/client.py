"""The soak's clients: one ``Endpoint`` (every call with a timeout, loopback only), the ``Outcome`` of a call, the
``Recorder`` that tallies what was sent, what came back and what looked wrong; what the client threads share
(``Shared``: texts, recent prompts, locks, turns) and the thread itself (``Client``: a tour through every traffic
kind, then weighted picks until the deadline). The kinds live in ``generate``, ``chat`` and ``admin``."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import requests

from benchmarks.soak.faults import adversarial_name, parse_stream
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part
from sglang_kvshare.protocol import DEFAULT_MAX_SEGMENTS, MAX_NAME_CHARS

REQUEST_TIMEOUT_S = 180.0
TOP_LOGPROBS = 5


def scope_of(salt: Optional[str], workflow: Optional[str]) -> str:
    """A reuse scope's name in the JSON: its cache salt and workflow (the chat API's user by default)."""
    return f"salt={salt or '-'} workflow={workflow or '-'}"


def chat_scope(body: dict) -> str:
    field_ = body.get("kvshare")
    workflow = field_.get("workflow") if isinstance(field_, dict) else None
    salt = body.get("cache_salt")
    return scope_of(salt if isinstance(salt, str) else None, workflow or body.get("user"))


def chat_report(out: "Outcome") -> Optional[dict]:
    """The ``kvshare`` report of a chat answer (top level, or the final chunk's for a stream)."""
    rep = out.body.get("kvshare") if isinstance(out.body, dict) else None
    return rep if isinstance(rep, dict) else None


def error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        return str(body.get("message") or (err.get("message") if isinstance(err, dict) else err) or "")
    return str(body or "")


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

    def keep(self, rows: str, row: dict) -> None:
        """Append ``row`` to the list ``rows`` (``plain``, ``salt_probes``, ``scope_probes``, ...)."""
        with self.lock:
            getattr(self, rows).append(row)

    def fault(self, kind: str) -> None:
        with self.lock:
            self.faults[kind] += 1

    def refused(self, out: Outcome, **where: Any) -> None:
        """A valid request answered 4xx: a ``valid_requests_served`` finding (a 5xx or no answer is one already)."""
        if 0 < out.status < 500 and out.status != 200:
            self.find("valid_requests_served", {**where, "status": out.status, "body": str(out.body)[:300]})

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
            all_status = sum(self.statuses.values(), Counter())
            return {"requests": sum(self.requests.values()),
                    "ok_2xx": sum(v for k, v in all_status.items() if 200 <= k < 300),
                    "client_4xx": sum(v for k, v in all_status.items() if 400 <= k < 500),
                    "server_5xx": sum(v for k, v in all_status.items() if k >= 500),
                    "lost": all_status.get(0, 0)}


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

    def _send(self, label: str, method: str, path: str, read: Callable[[requests.Response], tuple[int, Any]], *,
              record: bool = True, **kw: Any) -> Outcome:
        """One call with the timeout; ``read(response)`` gives (status, body); no answer is status 0."""
        t0 = time.perf_counter()
        try:
            with requests.request(method, self.url + path, timeout=self.timeout, **kw) as r:
                status, body = read(r)
            out = Outcome(status, body, time.perf_counter() - t0)
        except requests.RequestException as exc:
            out = Outcome(0, None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
        if record:
            self.recorder.http(label, out)
        return out

    def call(self, label: str, method: str, path: str, *, body: Any = None, admin: bool = False,
             record: bool = True) -> Outcome:
        headers = {"Authorization": f"Bearer {self.admin_key}"} if admin and self.admin_key else {}
        return self._send(label, method, path, lambda r: (r.status_code, _payload(r)), record=record, json=body,
                          headers=headers)

    def generate(self, label: str, ids: list[int], *, custom_params: Optional[dict] = None,
                 max_new_tokens: int = 8, salt: Optional[str] = None, rid: Optional[str] = None,
                 logprobs: bool = False, sampling: Optional[dict] = None) -> Outcome:
        body = generate_body(ids, custom_params=custom_params, max_new_tokens=max_new_tokens, salt=salt,
                             rid=rid, logprobs=logprobs, sampling=sampling)
        return self.call(label, "POST", "/generate", body=body)

    def stream_and_close(self, label: str, body: dict, chunks: int) -> Outcome:
        """Stream ``body`` and close the connection after ``chunks`` data lines (0: after the headers)."""
        def read(r: requests.Response) -> tuple[int, dict]:
            got = 0
            for line in (r.iter_lines() if r.status_code == 200 and chunks > 0 else ()):
                got += line.startswith(b"data:")
                if got >= chunks:
                    break
            return r.status_code, {"chunks_read": got}
        return self._send(label, "POST", "/generate", read, json={**body, "stream": True}, stream=True)

    def chat(self, label: str, body: dict) -> Outcome:
        """``POST /v1/chat/completions``; a stream is read to its end (``faults.parse_stream``)."""
        stream = bool(body.get("stream"))
        return self._send(label, "POST", "/v1/chat/completions", lambda r: (r.status_code, parse_stream(
            r.iter_lines()) if stream and r.status_code == 200 else _payload(r)), json=body, stream=stream)

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
PLAIN_TOKENS = 24

# Traffic kinds and their weights after each client's first tour through all of them.
TRAFFIC = {"team": 5, "plain": 4, "leak_probe": 3, "salt_probe": 3, "malformed": 4, "fuzzed": 3,
           "slot_flood": 2, "abort": 2, "rid_reuse": 2, "admin": 2, "bad_sampling": 1,
           "chat": 6, "chat_hostile": 2, "scope_probe": 2, "reset_probe": 1, "retract_burst": 1}
EARLY = ("leak_probe", "reset_probe", "scope_probe", "retract_burst")  # first in the tours: even a short run has them


def system_part(agent: str) -> str:
    return f"<|im_start|>system\n{AGENTS[agent]}<|im_end|>\n<|im_start|>user\nContext:\n"


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
    counter_lock: threading.Lock = field(default_factory=threading.Lock)
    monitor: Any = None  # checks.Monitor: read before a reset
    burst_size: int = 32  # requests per retraction burst (0: none)
    burst_lock: threading.Lock = field(default_factory=threading.Lock)
    recent_chats: deque = field(default_factory=lambda: deque(maxlen=16))  # automatic chat bodies, for opt-outs
    turns: Counter = field(default_factory=Counter)  # per family (texts, probes, names, op variants): how many

    @property
    def rec(self) -> Recorder:
        return self.endpoint.recorder

    def turn(self, family: str, k: int = 1) -> int:
        """The next turn of ``family`` (shared by the clients; ``k`` turns taken): each family's variants, texts
        and names come in turn."""
        with self.counter_lock:
            n = self.turns[family]
            self.turns[family] += k
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
        return self._text(self.turn("text"), probe=False)

    def probe_text(self) -> str:
        """A text no other request ever uses: a probe's content must be seen only by the probe."""
        return self._text(self.turn("probe"), probe=True)

    def working_text(self, rng: random.Random) -> str:
        """One of the last six fresh texts (reused by several rounds: sources exist, pools learn);
        a new one now and then, so contents keep changing."""
        hi = self.turns["text"]
        if hi == 0 or rng.random() < 0.1:
            return self.fresh_text()
        return self._text(rng.randrange(max(0, hi - 6), hi), probe=False)

    def names(self, k: int) -> list[str]:
        """``k`` new hostile slot names, each made unique by its ``s<n>:`` tag."""
        base = self.turn("name", k)
        rng, tags = random.Random(base), [f"s{base + i}:" for i in range(k)]
        return [t + adversarial_name(rng, rng.choice([1, 8, 40, MAX_NAME_CHARS]))[:MAX_NAME_CHARS - len(t)]
                for t in tags]

    def request(self, agent: str, text: str, slot: str = "query", suffix: str = SUFFIX) -> tuple[list[int], dict]:
        return build_request(self.tokenizer, agent, [private_part(system_part(agent)), shared_part(text, slot),
                                                     private_part(suffix)])


class Client:
    """One client thread: a tour through every traffic kind, then weighted random picks until the deadline."""

    def __init__(self, index: int, shared_state: Shared, ops: dict[str, Callable[["Client"], None]], seed: int,
                 tour: list[str]) -> None:
        self.i = index
        self.s = shared_state
        self.rng = random.Random(seed * 1000 + index)
        self.tour = list(tour)
        self.ops = ops  # traffic kind -> its function of the client (``run.OPS``)

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
                self.ops[kind](self)
            except Exception as exc:  # noqa: BLE001 - a harness bug must show up in the JSON, not kill a thread
                self.s.rec.find("harness_errors", {"kind": kind, "error": f"{type(exc).__name__}: {exc}"})

    def _names_due(self) -> float:
        total = self.s.deadline - self.s.started
        return self.s.slot_name_target * min(1.0, (time.monotonic() - self.s.started + 10) / max(total, 1))

    def _flood_due(self) -> bool:
        """Distinct slot names go out at an even pace, so the target is met by the deadline."""
        return self.s.turns["name"] < self._names_due()

    def _flood_behind(self) -> bool:
        """More than two requests' worth of names behind the pace: flood now."""
        return self.s.turns["name"] < self._names_due() - 2 * (self.s.max_segments - 1)

    def annotated(self, label: str, agent: str, text: str, salt: Optional[str], suffix: str = SUFFIX,
                  **kw) -> tuple[list[int], Outcome]:
        ids, cp = self.s.request(agent, text, suffix=suffix)
        out = self.s.endpoint.generate(label, ids, custom_params=cp, salt=salt, **kw)
        if out.status == 200:
            self.s.rec.annotated(out)
            self.s.recent.append((ids, salt, estimated_tokens(out.report)))
        else:
            self.s.rec.refused(out, request=label)
        return ids, out

    def plain(self, label: str, ids: list[int], salt: Optional[str], tag: str) -> None:
        out = self.s.endpoint.generate(label, ids, salt=salt, max_new_tokens=PLAIN_TOKENS, logprobs=True)
        if out.status == 200:
            meta = out.body.get("meta_info", {})
            self.s.rec.keep("plain", {"tag": tag, "input_ids": ids, "salt": salt,
                                      "cached_tokens": int(meta.get("cached_tokens", 0) or 0),
                                      "output_ids": output_tokens(out.body),
                                      "annotated_report": bool(meta.get("kvshare"))})

    def admin(self, path: str, body: Any = None, *, key: bool = True, expect: int = 200) -> Outcome:
        out = self.s.endpoint.call("admin", "POST", path, body=body, admin=key)
        with self.s.rec.lock:
            self.s.rec.admin[f"{path} -> {out.status}"] += 1
        if out.status != expect and out.status and out.status < 500:
            self.s.rec.find("admin_answers", {"path": path, "body": body, "status": out.status, "expected": expect,
                                              "reply": str(out.body)[:200]})
        return out

    def chat(self, label: str, body: dict, *, report: Optional[bool]) -> Outcome:
        """One valid chat request. ``report``: True, it must carry a kvshare report (a stream: on its chunk
        with the finish reason) with at most ``max_segments`` segments; False, none (an opt-out)."""
        out = self.s.endpoint.chat(label, body)
        rep = chat_report(out)
        self.s.rec.chat_answer(label, body, rep)
        where = {"request": label, "status": out.status, "stream": bool(body.get("stream")),
                 "explicit": isinstance(body.get("kvshare"), dict), "messages": len(body["messages"]),
                 "scope": chat_scope(body)}
        if out.status != 200:
            self.s.rec.refused(out, **where)
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
