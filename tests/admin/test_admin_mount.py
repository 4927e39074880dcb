"""Mounting on a FastAPI app: every route is visible to SGLang's API-key middleware with its auth level."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sglang.srt.utils.auth import AuthLevel, _get_auth_level_from_app_and_scope, add_api_key_middleware

from sglang_kvshare.admin import routes

WRITES = [("POST", "/kvshare/config"), ("POST", "/kvshare/reset"), ("POST", "/kvshare/pools/out:a/reset")]
READS = [("GET", "/kvshare/stats"), ("GET", "/kvshare/pools"), ("GET", "/kvshare/pools/out:a")]


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


@pytest.mark.parametrize("method, path", READS)
def test_reads_are_normal_like_get_server_info(app, method, path):
    assert _get_auth_level_from_app_and_scope(app, _scope(method, path)) == AuthLevel.NORMAL


def test_routes_are_mounted_once_and_listed_in_openapi(app):
    paths = [getattr(r, "path", "") for r in app.router.routes if getattr(r, "path", "").startswith("/kvshare/")]
    assert len(paths) == len(set(paths)) == 6
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
