"""Generated bodies thrown at the write routes: only 200/404/422 come back and the server keeps serving."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.server

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)
config_like = st.fixed_dictionaries({}, optional={
    "tau": st.one_of(st.floats(min_value=-1, max_value=2, allow_nan=False), values),
    "capacity": st.one_of(st.integers(min_value=-3, max_value=5000), values),
    "rank": st.one_of(st.integers(min_value=-3, max_value=70000), values),
    "mode": st.one_of(st.sampled_from(["off", "fullshared", "kvcomm", "kvcmas", ""]), values),
})
bodies = st.one_of(config_like, values, st.dictionaries(st.text(max_size=8), values, max_size=4))
paths = st.sampled_from(["/kvshare/config", "/kvshare/config", "/kvshare/reset", "/kvshare/pools/query/reset",
                         "/kvshare/pools/%2F..%2F/reset"])


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=paths, body=bodies)
def test_generated_bodies_never_break_the_server(admin, path, body):
    r = admin.post(path, raw=json.dumps(body).encode())
    assert r.status_code in (200, 404, 422), (path, body, r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["message"]


def test_server_still_generates_after_the_fuzzing(admin):
    admin.configure(mode="fullshared", tau=0.3, capacity=10, rank=32)
    out = admin.server.generate("The capital of France is", max_new_tokens=4)
    assert out["text"]
    assert admin.share('{"still": "alive"} ' * 10)["segments"][1]["resolved_by"] == "alignment"
