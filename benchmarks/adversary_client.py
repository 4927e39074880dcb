"""The adversarial run's client side: one ``Run`` (the soak's endpoint and tallies, the tokenizer, a random tag
in every agent name, fresh documents) and ``Watch``, the soak's recorder that also looks for the run's secrets
(random-hex cache salts and extra keys) in every answer."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Optional

from benchmarks.harness import verifications_settled
from benchmarks.soak import Endpoint, Outcome, Recorder, generate_body
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part

APPROXIMATED = ("tokens_aligned", "tokens_corrected", "tokens_estimate_hit")
SUFFIX = "\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n"
DOC = ("Problem {i}: A farmer has {a} apples and buys {b} more boxes of {c} apples each. He gives away {d} apples. "
       "How many apples does he have now? Show the steps of the computation.")


class Watch(Recorder):
    """``soak.Recorder`` that also looks for the run's secrets (salts, extra keys) in every answer; an answer
    that holds one is a leak."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: dict[str, str] = {}  # secret -> what it is
        self.leaks: list[dict] = []
        self.scanned = 0

    def secret(self, kind: str) -> str:
        value = secrets.token_hex(12)
        self.secrets[value] = kind
        return value

    def http(self, label: str, out: Outcome) -> None:
        super().http(label, out)
        self.scan(label, out.body)

    def scan(self, label: str, body: Any) -> None:
        text = body if isinstance(body, str) else json.dumps(body, default=str, ensure_ascii=False)
        with self.lock:
            self.scanned += 1
            for value, kind in list(self.secrets.items()):
                if value in text and len(self.leaks) < 40:
                    at = text.index(value)
                    self.leaks.append({"answer": label, "secret": kind, "context": text[max(0, at - 80):at + 40]})


class Run:
    """One run's state: the endpoint (its recorder a ``Watch``), the tokenizer, the tag in every agent name."""

    def __init__(self, ep: Endpoint, tokenizer: Any) -> None:
        self.ep, self.tok = ep, tokenizer
        self.watch: Watch = ep.recorder  # type: ignore[assignment]
        self.tag = secrets.token_hex(4)
        self.docs = 0

    # --- requests -----------------------------------------------------------------
    def doc(self) -> str:
        self.docs += 1
        i = self.docs
        return DOC.format(i=i, a=17 + i, b=3 + i % 7, c=12, d=5 + i % 11) + f" Case {self.tag}{i}."

    def request(self, agent: str, text: str, *, workflow: Optional[str] = None, slot: str = "query",
                system: Optional[str] = None) -> tuple[list[int], dict]:
        head = f"<|im_start|>system\n{system or 'You are ' + agent + ', a careful assistant.'}<|im_end|>\n" \
               "<|im_start|>user\nContext:\n"
        ids, cp = build_request(self.tok, agent, [private_part(head), shared_part(text, slot), private_part(SUFFIX)])
        if workflow is not None:
            cp = {"kvshare": json.dumps({**json.loads(cp["kvshare"]), "workflow": workflow})}
        return ids, cp

    def generate(self, label: str, agent: str, text: str, *, salt: Optional[str] = None,
                 extra_key: Optional[str] = None, workflow: Optional[str] = None, tokens: int = 4,
                 warm_head: bool = False, sampling: Optional[dict] = None, **body_extra: Any) -> Outcome:
        """One annotated ``/generate``; ``warm_head``: first the agent's private prefix alone, so that the cache
        reaches the shared text (it resolves segments in order)."""
        ids, cp = self.request(agent, text, workflow=workflow)
        if warm_head:
            head = ids[:json.loads(cp["kvshare"])["segments"][0]["end"]]
            hcp = {"kvshare": json.dumps({"agent": agent, "segments": [
                {"kind": "private", "start": 0, "end": len(head)}], **({"workflow": workflow} if workflow else {})})}
            self.ep.call(label, "POST", "/generate", body=self._body(head, hcp, 1, salt, extra_key, None, {}))
        return self.ep.call(label, "POST", "/generate", body=self._body(ids, cp, tokens, salt, extra_key, sampling,
                                                                         body_extra))

    @staticmethod
    def _body(ids, cp, tokens, salt, extra_key, sampling, extra) -> dict:
        body = {**generate_body(ids, custom_params=cp, max_new_tokens=tokens, salt=salt, sampling=sampling), **extra}
        if extra_key is not None:
            body["extra_key"] = extra_key
        return body

    def admin(self, label: str, method: str, path: str, body: Any = None) -> Outcome:
        return self.ep.call(label, method, path, body=body, admin=True)

    def configure(self, **changes: Any) -> None:
        out = self.admin("config", "POST", "/kvshare/config", changes)
        if out.status != 200:
            raise RuntimeError(f"POST /kvshare/config {changes}: {out.status} {out.body}")

    def fidelity(self) -> dict:
        out = self.admin("fidelity", "GET", "/kvshare/fidelity")
        return out.body if out.status == 200 and isinstance(out.body, dict) else {}

    def pin(self, scope: str, setting: Any) -> Outcome:
        return self.admin("pin", "POST", "/kvshare/fidelity/pin", {"scope": scope, "setting": setting})

    def wait_verified(self, timeout: float = 90.0) -> dict:
        """The guard's snapshot once every queued verification has ended and no new one was queued for a poll."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            snap = self.fidelity()
            count = (snap.get("counters") or {}).get("queued", 0)
            if verifications_settled(snap) and count == last:
                return snap
            last = count
            time.sleep(1.0)
        return self.fidelity()


def scope_of(out: Outcome) -> Optional[str]:
    return ((out.report or {}).get("guard") or {}).get("scope")


def approximated(out: Outcome) -> int:
    return sum(int(out.report.get(k) or 0) for k in APPROXIMATED) if out.status == 200 else 0
