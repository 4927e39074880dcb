"""The soak's HTTP side and bookkeeping: one ``Endpoint`` (every call with a timeout, loopback only), the
``Outcome`` of a call, and the ``Recorder`` that tallies what was sent, what came back and what looked wrong."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import requests

from benchmarks.soak.faults import parse_stream

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
        """``POST /v1/chat/completions``; a stream is read to its end (``faults.parse_stream``)."""
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
