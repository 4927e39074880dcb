"""SGLang's admin key guards the kvshare writes and pools; stats follow /get_server_info's rule."""

from __future__ import annotations

import pytest
import requests

from tests.admin.conftest import shared_text

pytestmark = pytest.mark.server

WRITES = [("/kvshare/config", {"tau": 0.9}), ("/kvshare/reset", None), ("/kvshare/pools/query/reset", None)]


@pytest.mark.parametrize("path, body", WRITES)
def test_a_write_without_the_admin_key_gets_401_and_changes_nothing(admin, path, body):
    before = admin.stats()
    r = admin.post(path, body, auth=False)
    assert r.status_code == 401, r.text
    after = admin.stats()
    assert after["config"] == before["config"] and after["slots"] == before["slots"]


def test_a_wrong_key_gets_401(admin):
    before = admin.stats()["config"]
    r = requests.post(admin.url + "/kvshare/config", json={"tau": 0.9}, timeout=60,
                      headers={"Authorization": "Bearer not-the-key"})
    assert r.status_code == 401
    assert admin.stats()["config"] == before


def test_the_admin_key_unlocks_writes_and_stats_need_no_key(admin):
    r = admin.post("/kvshare/config", {"tau": 0.35})
    assert r.status_code == 200 and r.json()["config"]["tau"] == 0.35
    # Only --admin-api-key is set: stats, like /get_server_info, stay open.
    assert admin.get("/kvshare/stats").status_code == 200


def test_pools_need_the_admin_key_and_do_not_leak_through_server_info(admin):
    admin.configure(mode="fullshared")
    admin.share(shared_text(21), slot="auth-pools")
    for path in ("/kvshare/pools", "/kvshare/pools/auth-pools"):
        assert admin.get(path).status_code == 401, path
        assert admin.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert admin.get(path, headers=admin.headers()).status_code == 200, path
    assert "auth-pools" in admin.get("/kvshare/pools", headers=admin.headers()).json()["pools"]
    # /get_server_info is public here and carries the scheduler's kvshare snapshot: config and stats only.
    info = admin.get("/get_server_info").json()
    states = [s.get("kvshare", {}) for s in info.get("internal_states", [])]
    assert states and all("pools" not in s for s in states), states
