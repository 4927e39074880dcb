"""What the soak's client threads share (``Shared``: texts, recent prompts, locks, turn counters) and the client
thread itself (``Client``): a tour through every traffic kind, then weighted picks until the deadline. The kinds
live in ``generate``, ``chat`` and ``admin``, each a function of the client."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from benchmarks.soak.client import (Endpoint, Outcome, Recorder, chat_report, chat_scope,
                                    estimated_tokens, output_tokens)
from benchmarks.soak.faults import adversarial_name
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part
from sglang_kvshare.protocol import DEFAULT_MAX_SEGMENTS, MAX_NAME_CHARS

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


def with_workflow(custom_params: dict, workflow: str) -> dict:
    """``custom_params`` of ``build_request`` with the annotation's ``workflow`` set."""
    ann = json.loads(custom_params["kvshare"])
    return {"kvshare": json.dumps({**ann, "workflow": workflow})}


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
    next_text: int = 0
    next_probe: int = 0
    next_name: int = 0
    next_admin: int = 0
    counter_lock: threading.Lock = field(default_factory=threading.Lock)
    monitor: Any = None  # checks.Monitor: read before a reset
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
        return self.s.next_name < self._names_due()

    def _flood_behind(self) -> bool:
        """More than two requests' worth of names behind the pace: flood now."""
        return self.s.next_name < self._names_due() - 2 * (self.s.max_segments - 1)

    def annotated(self, label: str, agent: str, text: str, salt: Optional[str], suffix: str = SUFFIX,
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

    def plain(self, label: str, ids: list[int], salt: Optional[str], tag: str) -> None:
        out = self.s.endpoint.generate(label, ids, salt=salt, max_new_tokens=PLAIN_TOKENS, logprobs=True)
        if out.status == 200:
            meta = out.body.get("meta_info", {})
            with self.s.rec.lock:
                self.s.rec.plain.append({"tag": tag, "input_ids": ids, "salt": salt,
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
