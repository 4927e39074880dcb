"""Fixtures of the admin-route tests, on the suite's shared server (metrics on, an admin key).

A server start costs about 40 s here, so the admin tests use the server most
server tests share (``tests.servers.shared_server``). Each test first sets the
config it needs through the routes under test and resets what it asserts on, so
the tests depend neither on their order nor on earlier users of the server; an
autouse fixture restores the launch config after each one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import requests

from sglang_kvshare.protocol import Annotation, Segment
from devtools.server_process import ServerProcess
from tests.servers import ADMIN_KEY, restore, shared_server


AGENTS = {
    "solver": "You are a math solver. Solve the problem step by step and give the final number.",
    "critic": "You are a careful critic. Point out every mistake in the reasoning you are given.",
}
SUFFIX = "\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n"


def system_part(agent: str) -> str:
    return f"<|im_start|>system\n{AGENTS[agent]}<|im_end|>\n<|im_start|>user\nContext:\n"


def shared_text(seed: int, items: int = 12) -> str:
    """A distinct shared document per seed (about 10 tokens an item), so contents never collide across tests."""
    listing = ", ".join(f"crate {seed}-{i} holds {(seed * 7 + i * 13) % 97} apples" for i in range(items))
    return f"Inventory report number {seed}: {listing}. How many apples are there in total?"


@dataclass
class Admin:
    """Client of one server's admin routes; writes carry the admin key unless told otherwise."""

    server: ServerProcess
    tokenizer: object
    key: str = ADMIN_KEY

    @property
    def url(self) -> str:
        return self.server.url

    def headers(self, auth: bool = True) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if auth else {}

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=120, **kw)

    def post(self, path: str, body=None, *, auth: bool = True, raw: bytes | None = None) -> requests.Response:
        headers = self.headers(auth)
        if raw is not None:
            return requests.post(self.url + path, data=raw, timeout=120,
                                 headers={**headers, "Content-Type": "application/json"})
        return requests.post(self.url + path, json=body, timeout=120, headers=headers)

    def configure(self, **changes) -> dict:
        r = self.post("/kvshare/config", changes)
        assert r.status_code == 200, r.text
        return r.json()["config"]

    def stats(self) -> dict:
        r = self.get("/kvshare/stats")
        assert r.status_code == 200, r.text
        return r.json()

    # --- annotated requests ------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def ask(self, agent: str, content: str | None, *, slot: str = "query", max_new_tokens: int = 1) -> dict:
        """One annotated request: the agent's system prompt, then (if given) ``content`` in ``slot``
        and a private suffix. Returns the request's kvshare report ({} when none came back)."""
        parts = [("private", self.encode(system_part(agent)), None)]
        if content is not None:
            parts += [("shared", self.encode(content), slot), ("private", self.encode(SUFFIX), None)]
        ids, segments = [], []
        for kind, toks, name in parts:
            segments.append(Segment(kind=kind, start=len(ids), end=len(ids) + len(toks), slot=name))
            ids += toks
        ann = Annotation(agent=agent, segments=tuple(segments))
        out = self.server.generate(input_ids=ids, custom_params=ann.to_custom_params(),
                                   max_new_tokens=max_new_tokens)
        reports = out["meta_info"].get("kvshare") or [{}]
        return reports[0]

    def share(self, content: str, *, slot: str = "query") -> dict:
        """Warm both agents' prompts, let the solver see ``content``, then the critic; the critic's report."""
        for agent in AGENTS:
            self.ask(agent, None)
        self.ask("solver", content, slot=slot)
        return self.ask("critic", content, slot=slot)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def admin(server_pool, tokenizer) -> Admin:
    # The suite's shared server (fullshared, synchronous learning, metrics, this admin key):
    # each admin test resets what it asserts on, so earlier users of the server do not matter.
    return Admin(shared_server(server_pool), tokenizer)


@pytest.fixture(autouse=True)
def _restore_the_shared_server(request):
    """Admin tests change the config of the suite's shared server: put it back after each one."""
    yield
    if "admin" in request.fixturenames:
        restore(request.getfixturevalue("admin").server)
