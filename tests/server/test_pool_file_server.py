"""Saved anchor pools in live servers: a kvcmas server learns an edge and saves its pools (on idle time, and
on ``POST /kvshare/save``); a new server launched with the same ``--kvshare-pool-file`` corrects that edge on
its first request of a content it has never seen, instead of aligning while it learns again. The same restart
keeps the fidelity guard's pin (``--kvshare-fidelity-file``): an agent pinned dense before it was ever served is
served dense from its first request on the new server, and an automatic-mode chat agent keeps its name (keyed from
the guard file), so its pin applies too. A pin past the request bound is refused; the guard file is private."""

from __future__ import annotations

import stat
import time

import pytest
import requests

from tests.agent_chain import agent_request, context, report, warm_request

pytestmark = pytest.mark.server

# Synchronous learning: each dense prefill is learned before the next request (the test counts anchors);
# edge anchors 2: the gate's minimum, reached by the second content; whole segments of any length are reused
# (the contents are short).
# A save interval of 1 s: the idle scheduler saves the pools once they changed (checked before the explicit save).
KVSHARE = ("--kvshare-mode", "kvcmas", "--kvshare-learn-async", "false", "--kvshare-edge-anchors", "2",
           "--kvshare-tau", "1.0", "--kvshare-verify-rate", "0", "--kvshare-admin-open", "true",
           "--kvshare-pool-save-interval-s", "1", "--kvshare-auto", "true", "--kvshare-recompute-ratio", "0",
           "--kvshare-min-reuse-tokens", "0")
A, B, C = "solver", "analyst", "coder"


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _serve(model_path, pool_file):
    from devtools.server_process import ServerProcess

    saved = ("--kvshare-pool-file", str(pool_file), "--kvshare-fidelity-file", str(pool_file.with_suffix(".json")))
    return ServerProcess(model_path=model_path, kvshare_args=KVSHARE + saved, extra_args=("--max-total-tokens", "4096"))


def _pin_c_dense(server) -> None:
    """The operator pins C dense before C's first request (C is of the default namespace: no salt)."""
    pin = requests.post(server.url + "/kvshare/fidelity/pin", json={"scope": C, "setting": "dense"}, timeout=60)
    assert pin.status_code == 200 and pin.json()["pinned"], pin.text


def _auto_chat(server) -> dict:
    """A chat request without the kvshare field (the server names its agent): its kvshare report."""
    body = {"model": "default", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": "You judge answers."}, {"role": "user", "content": "2+2=4?"}]}
    resp = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["kvshare"]


def _read_by_a_then_b(server, tokenizer, text: str) -> dict:
    """A reads ``text`` (its copy is the source), then B: B's report."""
    for agent in (A, B):
        ids, cp = agent_request(tokenizer, agent, text)
        out = server.generate(input_ids=ids, custom_params=cp, max_new_tokens=1)
    return report(out)


def _counters(server) -> dict:
    return requests.get(server.url + "/kvshare/stats", timeout=60).json()["counters"]


def _warm(server, tokenizer) -> None:
    for agent in (A, B):
        ids, cp = warm_request(tokenizer, agent)
        server.generate(input_ids=ids, custom_params=cp, max_new_tokens=1)


def test_a_restarted_server_corrects_from_its_first_request(model_path, tokenizer, tmp_path):
    pool_file = tmp_path / "pools.pt"
    with _serve(model_path, pool_file) as first:
        assert requests.post(first.url + "/kvshare/save", timeout=120).status_code == 200  # empty pools save too
        _warm(first, tokenizer)
        learning = [_read_by_a_then_b(first, tokenizer, context(400 + 2 * i, 2)) for i in range(3)]
        assert learning[0]["tokens_corrected"] == 0  # a cold edge: aligned or prefilled while it learns
        _pin_c_dense(first)
        judge = _auto_chat(first)["agent"]
        pin = requests.post(first.url + "/kvshare/fidelity/pin", json={"scope": judge, "setting": "dense"}, timeout=60)
        assert pin.status_code == 200 and pin.json()["pinned"], pin.text
        too_long = requests.post(first.url + "/kvshare/fidelity/pin", json={"scope": C, "setting": "head70000"},
                                 timeout=60)
        assert too_long.status_code == 422 and "at most 65536" in too_long.text, too_long.text
        assert stat.S_IMODE(pool_file.with_suffix(".json").stat().st_mode) == 0o600  # it holds the namespace key
        deadline = time.monotonic() + 60
        while _counters(first).get("pool_file_autosaves", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _counters(first).get("pool_file_autosaves", 0) >= 1 and pool_file.stat().st_size > 0
        saved = requests.post(first.url + "/kvshare/save", timeout=120)
        assert saved.status_code == 200, saved.text
        assert saved.json()["saved"]["anchors"] >= 2 and pool_file.stat().st_size == saved.json()["saved"]["bytes"]
        pools_before = requests.get(first.url + "/kvshare/pools", timeout=60).json()["pools"]

    with _serve(model_path, pool_file) as second:
        stats = requests.get(second.url + "/kvshare/stats", timeout=60).json()
        assert stats["counters"]["pool_file_anchors_loaded"] == saved.json()["saved"]["anchors"]
        pools_after = requests.get(second.url + "/kvshare/pools", timeout=60).json()["pools"]
        assert {s: [a["edges"] for a in p] for s, p in pools_after.items() if p} == \
               {s: [a["edges"] for a in p] for s, p in pools_before.items() if p}
        _warm(second, tokenizer)
        fresh = _read_by_a_then_b(second, tokenizer, context(460, 2))  # a content neither server saw
        assert fresh["tokens_corrected"] > 0, fresh
        assert fresh["segments"][1].get("gate_fallback") is None, fresh
        ids, cp = agent_request(tokenizer, C, context(460, 2))  # C's first request on the new server: dense
        c_report = report(second.generate(input_ids=ids, custom_params=cp, max_new_tokens=1))
        assert c_report["guard"]["setting"] == "dense" and c_report["shared_tokens_reused"] == 0, c_report
        judge_again = _auto_chat(second)
        assert judge_again["agent"] == judge and judge_again["guard"]["setting"] == "dense", judge_again

