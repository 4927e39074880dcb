"""Mounting on a FastAPI app: every route is visible to SGLang's API-key middleware with its auth level,
and with several data-parallel ranks every route reaches every rank."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sglang.srt.utils.auth import AuthLevel, _get_auth_level_from_app_and_scope, add_api_key_middleware

from types import SimpleNamespace

from sglang_kvshare.admin import routes, scheduler_hooks
from tests.admin.test_admin_ops import FakeCache

WRITES = [("POST", "/kvshare/config"), ("POST", "/kvshare/reset"), ("POST", "/kvshare/pools/out:a/reset"),
          ("POST", "/kvshare/save")]
POOL_READS = [("GET", "/kvshare/pools"), ("GET", "/kvshare/pools/out:a")]
READS = [("GET", "/kvshare/stats")]


def _scope(method: str, path: str) -> dict:
    return {"type": "http", "method": method, "path": path, "root_path": "", "headers": [], "query_string": b""}


@pytest.fixture
def app() -> FastAPI:
    app = FastAPI()
    routes.mount(app, tokenizer_manager=None, rpc_endpoint="ipc:///nonexistent")
    routes.mount(app, tokenizer_manager=None, rpc_endpoint="ipc:///nonexistent")  # idempotent
    return app


@pytest.mark.parametrize("method, path", WRITES)
def test_writes_are_admin_optional(app, method, path):
    assert _get_auth_level_from_app_and_scope(app, _scope(method, path)) == AuthLevel.ADMIN_OPTIONAL


@pytest.mark.parametrize("method, path", POOL_READS)
def test_pool_reads_are_admin_optional(app, method, path):
    # Pools name agents and describe contents: with only --admin-api-key they must not be public.
    assert _get_auth_level_from_app_and_scope(app, _scope(method, path)) == AuthLevel.ADMIN_OPTIONAL


@pytest.mark.parametrize("method, path", READS)
def test_stats_are_normal_like_get_server_info(app, method, path):
    assert _get_auth_level_from_app_and_scope(app, _scope(method, path)) == AuthLevel.NORMAL


def test_admin_key_only_guards_pools_but_not_stats(app):
    add_api_key_middleware(app, api_key=None, admin_api_key="admin-key")
    client = TestClient(app, raise_server_exceptions=False)
    assert client.get("/kvshare/pools").status_code == 401
    assert client.get("/kvshare/pools/query").status_code == 401
    assert client.get("/kvshare/pools", headers={"Authorization": "Bearer user-guess"}).status_code == 401
    # Stats pass the middleware (NORMAL); with no scheduler behind this app the route itself fails.
    assert client.get("/kvshare/stats").status_code != 401


class RanksBehindSGLang:
    """SGLang's tokenizer side of ``GetInternalStateReq`` with its IPC left out: each request goes to every
    rank's read hook (the real one, on a stand-in cache), one answer per rank; ``silent`` ranks never answer."""

    def __init__(self, ranks: int, silent: tuple[int, ...] = ()) -> None:
        self.controllers = [SimpleNamespace(scheduler=SimpleNamespace(tree_cache=FakeCache(), dp_rank=r,
                                                                      metrics_reporter=None))
                            for r in range(ranks)]
        self.silent = silent

    def auto_create_handle_loop(self) -> None:
        pass

    async def get_internal_state_communicator(self, req):
        outputs = []
        for rank, controller in enumerate(self.controllers):
            result = SimpleNamespace(internal_state={})
            scheduler_hooks.after_get_internal_state(result, controller, req)
            if rank not in self.silent:
                outputs.append(result)
        return outputs

    async def get_internal_state(self):
        return [out.internal_state for out in await self.get_internal_state_communicator(SimpleNamespace(rid=None))]


def _dp_app(ranks: RanksBehindSGLang) -> TestClient:
    app = FastAPI()
    routes.mount(app, tokenizer_manager=ranks, rpc_endpoint="ipc:///nonexistent", dp_size=len(ranks.controllers))
    return TestClient(app)


@pytest.fixture
def back_to_one_rank():
    yield
    routes.mount(FastAPI(), tokenizer_manager=None, rpc_endpoint="ipc:///nonexistent")


def test_with_several_dp_ranks_a_write_reaches_every_rank(back_to_one_rank):
    ranks = RanksBehindSGLang(2)
    client = _dp_app(ranks)
    r = client.post("/kvshare/config", json={"tau": 0.5})
    assert r.status_code == 200, r.text
    assert [c.scheduler.tree_cache.kvshare_admin.config.tau for c in ranks.controllers] == [0.5, 0.5]
    assert [x["dp_rank"] for x in r.json()["ranks"]] == [0, 1]
    r = client.post("/kvshare/pools/out:a/reset")
    assert r.status_code == 200 and all(c.scheduler.tree_cache.kvshare_admin.resets == ["out:a"]
                                        for c in ranks.controllers)
    pools = client.get("/kvshare/pools").json()["pools"]
    assert pools["query"] == [{"id": 0, "bytes": 10, "dp_rank": 0}, {"id": 0, "bytes": 10, "dp_rank": 1}]
    stats = client.get("/kvshare/stats").json()
    assert stats["dp_size"] == 2 and [x["dp_rank"] for x in stats["ranks"]] == [0, 1]


def test_a_rank_that_does_not_answer_is_named(back_to_one_rank):
    r = _dp_app(RanksBehindSGLang(3, silent=(2,))).post("/kvshare/reset")
    assert r.status_code == 502 and "rank(s) [2] did not answer" in r.json()["message"]


def test_the_mount_hook_reads_dp_size_from_the_server_args(monkeypatch, back_to_one_rank):
    app = FastAPI()
    from sglang_kvshare.server import http_routes

    monkeypatch.setattr(http_routes, "_http_app", lambda: app)
    server_args = SimpleNamespace(radix_cache_backend="kvshare", dp_size=3, admin_api_key="k", api_key=None)
    port_args = SimpleNamespace(rpc_ipc_name="ipc:///nonexistent")
    http_routes.before_setup_http_server(server_args, RanksBehindSGLang(3), None, port_args)
    r = TestClient(app).post("/kvshare/reset")
    assert r.status_code == 200 and [x["dp_rank"] for x in r.json()["ranks"]] == [0, 1, 2]
    assert TestClient(app).get("/kvshare/chat").status_code == 200  # the chat layer's stats route too
    assert "per_scope" in TestClient(app).get("/kvshare/fidelity").json()  # and the fidelity guard's
    http_routes.before_setup_http_server(SimpleNamespace(radix_cache_backend=None), object(), None, port_args)


def test_routes_are_mounted_once_and_listed_in_openapi(app):
    paths = [getattr(r, "path", "") for r in app.router.routes if getattr(r, "path", "").startswith("/kvshare/")]
    assert len(paths) == len(set(paths)) == 7
    schema = app.openapi()
    assert "/kvshare/config" in schema["paths"] and "/kvshare/pools/{slot}/reset" in schema["paths"]


def test_api_key_only_guards_reads_and_writes_with_that_key(app):
    add_api_key_middleware(app, api_key="user-key", admin_api_key=None)
    client = TestClient(app)
    assert client.get("/kvshare/stats").status_code == 401
    assert client.post("/kvshare/reset").status_code == 401
    # With the key the route runs: its own validation answers before any scheduler is needed.
    r = client.post("/kvshare/config", json={"tau": 2}, headers={"Authorization": "Bearer user-key"})
    assert r.status_code == 422 and "tau" in r.json()["message"]


@pytest.mark.parametrize("method, path", WRITES)
def test_writes_on_a_server_without_keys_need_the_operator_to_open_them(method, path, monkeypatch):
    from sglang_kvshare.admin import routes as admin_routes
    from sglang_kvshare.config import KVShareConfig

    app = FastAPI()
    routes.mount(app, tokenizer_manager=None, rpc_endpoint="ipc:///nonexistent", keyed=False)
    try:
        body = {"tau": 0.5} if path.endswith("/config") else None
        r = TestClient(app).request(method, path, json=body)
        assert r.status_code == 403 and "--kvshare-admin-open" in r.json()["message"], r.text
        assert admin_routes.unkeyed_write_error("pools") is None  # reads follow SGLang's key rules only
        from sglang_kvshare.admin.ops import Reply

        class Channel:  # stands for the scheduler: answers every op
            async def call(self, op, **params):
                return Reply(200, f"{op} done")

        monkeypatch.setattr(admin_routes, "live_config", lambda: KVShareConfig(admin_open=True))
        monkeypatch.setattr(admin_routes, "_channel_or_error", lambda: Channel())
        r = TestClient(app).request(method, path, json=body)
        assert r.status_code == 200 and r.json()["message"].endswith("done")  # opened: the write goes through
    finally:
        routes.mount(FastAPI(), tokenizer_manager=None, rpc_endpoint="ipc:///nonexistent")  # keyed again
