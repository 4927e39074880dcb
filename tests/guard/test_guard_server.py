"""The fidelity guard on the suite's real server: a perturbed scope is caught and made dense, the others keep
their reuse, and the guard's state is visible and steerable through its routes."""

from __future__ import annotations

import json
import time

import pytest
import requests

from benchmarks.harness import verifications_settled
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part
from devtools.fault_injection import FAULT_PREFIX
from tests.servers import ADMIN_HEADERS, reconfigured, shared_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

MIN_SAMPLES = 6


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _reader_request(tokenizer, agent, doc, slot):
    system = f"<|im_start|>system\nYou are the {agent}; summarize the record in one line.<|im_end|>\n<|im_start|>user\n"
    return build_request(tokenizer, agent, [private_part(system), shared_part(doc, slot=slot),
                                            private_part("<|im_end|>\n<|im_start|>assistant\n")])


def _ask(server, tokenizer, agent, doc, slot):
    ids, custom = _reader_request(tokenizer, agent, doc, slot)
    return server.generate(input_ids=ids, custom_params=custom, max_new_tokens=8)["meta_info"]["kvshare"][0]


def _fidelity(server):
    return requests.get(server.url + "/kvshare/fidelity", timeout=60, headers=ADMIN_HEADERS).json()


def _drain(server, timeout=180.0):
    """Wait until every queued reference has run (a job taken off the queue is still in flight until it ends as
    verified, empty or an error)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        snap = _fidelity(server)
        queued = snap["counters"].get("queued", 0)
        if verifications_settled(snap) and queued == last:
            return snap
        last = queued
        time.sleep(0.5)
    return _fidelity(server)


def _doc(kind: str, i: int) -> str:
    return (f"Record {kind}-{i}: " + " ".join(f"station {kind}{i}-{j} measured {(i * 31 + j * 7) % 90} units."
                                              for j in range(12)))


def test_a_perturbed_scope_goes_dense_within_the_minimum_samples_and_the_others_keep_reuse(server_pool, tokenizer):
    server = shared_server(server_pool)
    bad_slot = FAULT_PREFIX + "guard-bad"  # the shared server serves this slot noise
    with reconfigured(server, verify_rate=1.0, fidelity_target="top1>=0.8", fidelity_min_samples=MIN_SAMPLES):
        for i in range(MIN_SAMPLES + 2):
            _ask(server, tokenizer, "guard-writer", _doc("bad", i), bad_slot)  # dense: the first copy
            victim = _ask(server, tokenizer, "guard-victim", _doc("bad", i), bad_slot)  # aligned, then perturbed
            _ask(server, tokenizer, "guard-writer", _doc("good", i), "guard-good")
            reader = _ask(server, tokenizer, "guard-reader", _doc("good", i), "guard-good")  # aligned, intact
            _drain(server)
        snap = _drain(server)
        scopes = snap["per_scope"]
        assert scopes["guard-victim"]["setting"] == "dense", snap
        assert scopes["guard-victim"]["samples"] <= 20  # caught within 20 verified requests
        assert any(a["scope"] == "guard-victim" and a["to"] == "dense" and a["reason"] == "target_missed"
                   for a in snap["recent_actions"])
        assert scopes["guard-reader"]["setting"] == "head0"  # an intact scope keeps its reuse
        # A verified request of a dense scope is a probe of the next looser setting, and its report says so.
        probe = _ask(server, tokenizer, "guard-victim", _doc("bad", 98), bad_slot)
        assert probe["guard"]["probe"] and probe["guard"]["setting"] == "head64", probe
        # Unverified, the victim is served dense, the reader still reuses; the reports say under which setting.
        assert requests.post(server.url + "/kvshare/config", json={"verify_rate": 0.0}, timeout=60,
                             headers=ADMIN_HEADERS).status_code == 200
        victim = _ask(server, tokenizer, "guard-victim", _doc("bad", 99), bad_slot)
        _ask(server, tokenizer, "guard-writer", _doc("good", 99), "guard-good")
        reader = _ask(server, tokenizer, "guard-reader", _doc("good", 99), "guard-good")
        assert victim["guard"]["setting"] == "dense" and not victim["guard"]["probe"], victim
        assert victim["tokens_aligned"] == 0
        assert reader["guard"]["setting"] == "head0" and reader["shared_tokens_reused"] > 0
        stats = requests.get(server.url + "/kvshare/stats", timeout=60).json()
        assert stats["fidelity"]["actions"].get("target_missed", 0) >= 1  # counted, with its reason
        # An operator can pin a scope (and undo it); bad input is a clear 4xx.
        pin = requests.post(server.url + "/kvshare/fidelity/pin", json={"scope": "guard-victim", "setting": "head32"},
                            timeout=60, headers=ADMIN_HEADERS)
        assert pin.status_code == 200 and pin.json()["setting"] == "head32" and pin.json()["pinned"]
        bad = requests.post(server.url + "/kvshare/fidelity/pin", json={"scope": "guard-victim", "setting": "fast"},
                            timeout=60, headers=ADMIN_HEADERS)
        assert bad.status_code == 422 and "head16" in bad.text
        unknown = requests.post(server.url + "/kvshare/fidelity/pin", json={"scope": "nobody", "setting": None},
                                timeout=60, headers=ADMIN_HEADERS)
        assert unknown.status_code == 404
        # Prometheus shows the scopes' settings and estimates (the HTTP process's series, merged by SGLang) by slot,
        # never by a client's agent name; the admin view names each slot's scope.
        metrics = requests.get(server.url + "/metrics", timeout=60).text
        slots = {name: s["slot"] for name, s in _fidelity(server)["per_scope"].items()}
        assert f'sglang_kvshare_guard_setting_head{{slot="{slots["guard-victim"]}"}} 32.0' in metrics
        assert f'sglang_kvshare_guard_top1{{bound="mean",slot="{slots["guard-reader"]}"}}' in metrics
        assert 'sglang_kvshare_guard_actions_total{reason="target_missed"}' in metrics
        guard_lines = [line for line in metrics.splitlines() if line.startswith("sglang_kvshare_guard")]
        assert guard_lines and not [line for line in guard_lines if "guard-" in line]
        # Pins are bounded on their own: past the bound a pin is a 422 that says how to free one.
        held = _fidelity(server)["pins"]
        for i in range(_fidelity(server)["max_pins"] - held):
            r = requests.post(server.url + "/kvshare/fidelity/pin", json={"scope": f"pin-{i}", "setting": "dense"},
                              timeout=60, headers=ADMIN_HEADERS)
            assert r.status_code == 200, r.text
        past = requests.post(server.url + "/kvshare/fidelity/pin", json={"scope": "pin-past", "setting": "dense"},
                             timeout=60, headers=ADMIN_HEADERS)
        assert past.status_code == 422 and "unpin one" in past.text, past.text
        # A reset starts the guard afresh: no scope, no pin, no action.
        assert requests.post(server.url + "/kvshare/fidelity/reset", timeout=60,
                             headers=ADMIN_HEADERS).json() == {"reset": True}
        after = _fidelity(server)
        assert after["per_scope"] == {} and after["recent_actions"] == [] and after["actions"] == {}


@pytest.mark.parametrize("burst", [True, False])
def test_a_new_scope_is_verified_until_it_can_be_judged_then_at_the_rate(server_pool, tokenizer, burst):
    """At a rate that draws nothing, the burst alone verifies a new scope's first approximated requests, exactly
    as many as a decision needs; without it the scope stays unjudged."""
    server = shared_server(server_pool)
    agent = f"burst-reader-{burst}"
    with reconfigured(server, verify_rate=1e-9, fidelity_target="top1>=0.5", fidelity_min_samples=3,
                      verify_burst=burst):
        bursts_before = _fidelity(server)["counters"].get("sampled_burst", 0)
        for i in range(5):
            _ask(server, tokenizer, "burst-writer", _doc(f"burst{burst}", i), f"burst-{burst}")  # the first copy
            reader = _ask(server, tokenizer, agent, _doc(f"burst{burst}", i), f"burst-{burst}")
            assert reader["tokens_aligned"] > 0, reader  # approximated: a candidate for verification
            # The reader's prompt again, prefill only (as a client commits an answer): it hits the tree (exact),
            # generates nothing, and is neither sampled nor taken as a sign that the scope is served exact.
            ids, custom = _reader_request(tokenizer, agent, _doc(f"burst{burst}", i), f"burst-{burst}")
            server.generate(input_ids=ids, custom_params=custom, max_new_tokens=0)
            _drain(server)
        snap = _drain(server)
    samples = snap["per_scope"].get(agent, {}).get("samples", 0)
    assert samples == (3 if burst else 0), snap["per_scope"]
    assert "burst-writer" not in snap["per_scope"]  # its requests were exact: nothing to verify
    # The writer's first request was drawn and found exact; its later ones are not drawn again (only the reader's
    # three, and the writer's one).
    assert snap["counters"].get("sampled_burst", 0) - bursts_before == (4 if burst else 0), snap["counters"]


def _ask_unverified(server, tokenizer, agent, doc, slot):
    """The reader's request marked ``verify: false``, as a benchmark's replay is."""
    from sglang_kvshare.protocol import CUSTOM_PARAMS_KEY, Annotation

    ids, custom = _reader_request(tokenizer, agent, doc, slot)
    ann = Annotation.model_validate_json(custom[CUSTOM_PARAMS_KEY]).model_copy(update={"verify": False})
    return server.generate(input_ids=ids, custom_params=ann.to_custom_params(),
                           max_new_tokens=8)["meta_info"]["kvshare"][0]


def test_a_request_that_opts_out_is_served_under_its_scopes_setting_but_never_sampled(server_pool, tokenizer):
    server = shared_server(server_pool)
    agent = "optout-reader"
    with reconfigured(server, verify_rate=1.0, fidelity_target="top1>=0.5", fidelity_min_samples=3):
        sampled_before = _fidelity(server)["counters"].get("sampled", 0)
        for i in range(3):
            _ask(server, tokenizer, "optout-writer", _doc("optout", i), "optout")  # the first copy (sampled: exact)
            reader = _ask_unverified(server, tokenizer, agent, _doc("optout", i), "optout")
            assert reader["tokens_aligned"] > 0, reader  # approximated, so it would be drawn at rate 1
        snap = _drain(server)
        assert agent not in snap["per_scope"], snap["per_scope"]
        assert snap["counters"].get("sampled", 0) - sampled_before == 3, snap["counters"]  # the writer's only
        # One ordinary request of the scope is sampled as usual; pinned, the scope's setting also reaches the
        # requests that opt out.
        _ask(server, tokenizer, "optout-writer", _doc("optout", 9), "optout")
        _ask(server, tokenizer, agent, _doc("optout", 9), "optout")
        assert _drain(server)["per_scope"][agent]["samples"] == 1
        pin = requests.post(server.url + "/kvshare/fidelity/pin", json={"scope": agent, "setting": "head32"},
                            timeout=60, headers=ADMIN_HEADERS)
        assert pin.status_code == 200, pin.text
        _ask(server, tokenizer, "optout-writer", _doc("optout", 10), "optout")
        pinned = _ask_unverified(server, tokenizer, agent, _doc("optout", 10), "optout")
        assert pinned["guard"]["setting"] == "head32" and not pinned["guard"]["probe"], pinned
        assert _drain(server)["per_scope"][agent]["samples"] == 1
        requests.post(server.url + "/kvshare/fidelity/reset", timeout=60, headers=ADMIN_HEADERS)


@pytest.mark.parametrize("change, fix", [({"verify_rate": 1.5}, "verify_rate"),
                                         ({"fidelity_target": "top1>0.99"}, "top1>="),
                                         ({"fidelity_min_samples": 1}, "fidelity_min_samples"),
                                         ({"fidelity_band": 1.0}, "fidelity_band")])
def test_bad_guard_settings_are_refused_and_change_nothing(server_pool, change, fix):
    server = shared_server(server_pool)
    before = requests.get(server.url + "/kvshare/fidelity", timeout=60, headers=ADMIN_HEADERS).json()
    r = requests.post(server.url + "/kvshare/config", json=change, timeout=60, headers=ADMIN_HEADERS)
    assert r.status_code == 422 and fix in r.text, r.text
    after = requests.get(server.url + "/kvshare/fidelity", timeout=60, headers=ADMIN_HEADERS).json()
    assert (after["verify_rate"], after["target"], after["min_samples"], after["band"]) == \
        (before["verify_rate"], before["target"], before["min_samples"], before["band"])


def _set_rate(server, rate: float) -> None:
    r = requests.post(server.url + "/kvshare/config", json={"verify_rate": rate}, timeout=60, headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text


def _answers(server, body: dict) -> list[dict]:
    """``/generate``'s answers to ``body``: one per choice, or a stream's chunks in order."""
    r = requests.post(server.url + "/generate", json=body, timeout=300, stream=bool(body.get("stream")))
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        out = r.json()
        return out if isinstance(out, list) else [out]
    chunks = [line[len(b"data: "):] for line in r.iter_lines() if line.startswith(b"data: ")]
    return [json.loads(c) for c in chunks if c != b"[DONE]"]


def _shape(answers: list[dict]) -> list:
    """What a client reads in the answers, the kvshare report aside: every key, and the values that greedy
    decoding fixes (the text, the tokens, the top token of each logprob row the client asked for)."""
    shape = []
    for out in answers:
        meta = out.get("meta_info") or {}
        rows = meta.get("output_top_logprobs") or []
        shape.append((sorted(out), sorted(meta), out.get("text"), out.get("output_ids"),
                      [max(row, key=lambda e: e[0])[1] if row else None for row in rows]))
    return shape


def _stream_shape(chunks: list) -> tuple:
    """What a streaming client reads, apart from where the chunks break (which follows timing, not KV): the keys
    the interim chunks carry, the final chunk whole, and that each chunk's text extends the one before."""
    texts = [chunk[2] or "" for chunk in chunks]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:])), texts
    interim_keys = (sorted({key for chunk in chunks[:-1] for key in chunk[0]}),
                    sorted({key for chunk in chunks[:-1] for key in chunk[1]}))
    return interim_keys, chunks[-1]


def test_verification_leaves_every_response_as_the_client_asked_for_it(server_pool, tokenizer):
    """At verify rate 1 a response has exactly the keys and greedy values it has at rate 0 (plus the kvshare
    report): one answer, several (``n``), a stream, and a request that asked for logprobs itself."""
    server = shared_server(server_pool)
    ids, custom = _reader_request(tokenizer, "shape-writer", _doc("shape", 0), "shape")
    sampling = {"max_new_tokens": 6, "temperature": 0.0, "custom_params": custom}
    bodies = {"one": {"input_ids": ids, "sampling_params": sampling},
              "n2": {"input_ids": ids, "sampling_params": {**sampling, "n": 2}},
              "stream": {"input_ids": ids, "sampling_params": sampling, "stream": True},
              "logprobs": {"input_ids": ids, "sampling_params": sampling, "return_logprob": True,
                           "top_logprobs_num": 3, "logprob_start_len": -1}}
    with reconfigured(server, verify_rate=0.0, fidelity_target="top1>=0.5"):
        plain = {name: _shape(_answers(server, body)) for name, body in bodies.items()}
        _set_rate(server, 1.0)
        verified = {name: _shape(_answers(server, body)) for name, body in bodies.items()}
        _drain(server)
    for name in ("one", "n2", "logprobs"):
        assert verified[name] == plain[name], name
    assert _stream_shape(verified["stream"]) == _stream_shape(plain["stream"])
    assert all("output_top_logprobs" in keys[1] for keys in plain["logprobs"])  # what the client asked for stays


def test_requests_whose_logprobs_sglang_changes_are_never_counted_as_kv_error(server_pool, tokenizer):
    """A ``logit_bias`` or ``json_schema`` request of an intact, approximated scope: its served logprobs are taken
    after the bias or grammar, a dense prefill's are not, so it is not verified (counted) and shows no top-1 miss."""
    server = shared_server(server_pool)
    agent = "biased-reader"
    with reconfigured(server, verify_rate=1.0, fidelity_target="top1>=0.5"):
        before = _fidelity(server)["counters"].get("skipped_sampling", 0)
        for i, extra in enumerate(({"logit_bias": {str(tokenizer.encode(" banana")[0]): 100.0}},
                                   {"json_schema": json.dumps({"type": "object", "properties": {
                                       "n": {"type": "integer"}}, "required": ["n"]})})):
            _ask(server, tokenizer, "biased-writer", _doc("biased", i), "biased")  # the first copy
            ids, custom = _reader_request(tokenizer, agent, _doc("biased", i), "biased")
            out = requests.post(server.url + "/generate", timeout=300, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0,
                                                      "custom_params": custom, **extra}})
            assert out.status_code == 200, out.text
            report = out.json()["meta_info"]["kvshare"][0]
            assert report["tokens_aligned"] > 0 and not report["guard"]["verified"], report  # approximated
        snap = _drain(server)
    assert snap["counters"].get("skipped_sampling", 0) - before == 2, snap["counters"]
    assert snap["per_scope"].get(agent, {}).get("samples", 0) == 0, snap["per_scope"]  # no verified miss
