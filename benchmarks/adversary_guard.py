"""The attacks on the fidelity guard: verification must not change answers (``verify_keys``) nor score sampling
changes as KV error (``sampling_not_error``); pins are held to the request bounds (``pin_bounds``); floods of
agent names past every table leave the operator's pins, ``/metrics`` and every answer as they must be
(``name_flood``)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import requests

from benchmarks.adversary_client import Run, approximated, scope_of
from benchmarks.soak import Outcome, generate_body
from benchmarks.soak.faults import many_slots

SEVERAL = 8  # concurrent flood requests
FIXED_LABELS = ("bound", "event", "reason")  # guard metric labels drawn from a fixed set
TOP1_SLACK = 0.2  # a modified request's top-1 may sit this far under the plain request's on the same KV


def verify_keys(r: Run) -> dict:
    """The same requests at verify rate 0 and at rate 1, after one that puts the prompt in the cache (so that
    both rates are served the same KV)."""
    salt = r.watch.secret("salt")
    ids, cp = r.request(f"keys-{r.tag}", r.doc())
    base = generate_body(ids, custom_params=cp, max_new_tokens=4, salt=salt)
    r.configure(verify_rate=0.0)
    r.ep.call("verify_keys", "POST", "/generate", body=base)
    variants = {"n1": base, "n2": {**base, "sampling_params": {**base["sampling_params"], "n": 2}},
                "stream": {**base, "stream": True},
                "logprobs": {**base, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1}}
    shapes: dict[str, dict] = {}
    for rate in (0.0, 1.0):
        r.configure(verify_rate=rate)
        for name, body in variants.items():
            shapes.setdefault(name, {})[f"rate{rate:g}"] = _shape(r, name, body)
    r.configure(verify_rate=0.0)
    rows = {}
    for name, pair in shapes.items():
        a, b = pair["rate0"], pair["rate1"]
        rows[name] = {"same_keys": a["keys"] == b["keys"], "same_outputs": a["outputs"] == b["outputs"],
                      "report_at_rate_1": b["report"], "extra_keys_at_rate_1": sorted(set(b["keys"]) - set(a["keys"])),
                      "missing_at_rate_1": sorted(set(a["keys"]) - set(b["keys"])), "status": [a["status"], b["status"]]}
    passed = all(v["same_keys"] and v["same_outputs"] and v["report_at_rate_1"] and v["status"] == [200, 200]
                 for v in rows.values())
    return {"passed": passed, "variants": rows}


def _shape(r: Run, label: str, body: dict) -> dict:
    """Status, key paths (``meta_info.kvshare`` as one key), greedy outputs and whether a kvshare report came."""
    if body.get("stream"):
        chunks, status = [], 0
        try:
            with requests.post(r.ep.url + "/generate", json=body, stream=True, timeout=r.ep.timeout) as resp:
                status = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        chunks.append(json.loads(line[5:]))
        except requests.RequestException as exc:
            r.watch.http(label, Outcome(0, None, 0.0, str(exc)))
            return {"status": 0, "keys": [], "outputs": None, "report": False}
        r.watch.http(label, Outcome(status, chunks))
        items = chunks
        outputs = [c.get("text") for c in chunks[-1:]]
    else:
        out = r.ep.call(label, "POST", "/generate", body=body)
        status, items = out.status, (out.body if isinstance(out.body, list) else [out.body])
        outputs = [i.get("output_ids") or i.get("text") for i in items if isinstance(i, dict)]
    keys, report = set(), False
    for item in items:
        if isinstance(item, dict):
            meta = item.get("meta_info") or {}
            keys |= {k for k in item if k != "meta_info"} | {f"meta_info.{k}" for k in meta}
            report = report or bool(meta.get("kvshare"))
    return {"status": status, "keys": sorted(keys), "outputs": outputs, "report": report}


def sampling_not_error(r: Run) -> dict:
    """A source reads a document; then agents read it (aligned, so verified at rate 1): one plain, one with
    ``logit_bias`` towards a token the model would not pick, one with a ``json_schema`` it would not write."""
    salt = r.watch.secret("salt")
    text = r.doc()
    r.configure(verify_rate=0.0)
    r.generate("sampling", f"src-{r.tag}", text, salt=salt, tokens=1)
    r.configure(verify_rate=1.0)
    token = r.tok(" zebra", add_special_tokens=False).input_ids[0]
    schema = {"type": "object", "properties": {"qzx": {"type": "string", "enum": ["vvq zzk xxj"]}}, "required": ["qzx"]}
    kinds = {"plain": {}, "logit_bias": {"logit_bias": {str(token): 100.0}},
             "json_schema": {"json_schema": json.dumps(schema)}}
    rows = {}
    for kind, sampling in kinds.items():
        out = r.generate("sampling", f"{kind}-{r.tag}", text, salt=salt, tokens=8, warm_head=True, sampling=sampling)
        rows[kind] = {"status": out.status, "scope": scope_of(out), "approximated_tokens": approximated(out)}
    snap = r.wait_verified()
    r.configure(verify_rate=0.0)
    for row in rows.values():
        est = ((snap.get("per_scope") or {}).get(row["scope"]) or {}).get("top1") or {}
        row.update(verified=est.get("n", 0), top1=est.get("mean"))
    control = rows["plain"]
    sensitive = control["approximated_tokens"] > 0 and control["verified"] > 0 and control["top1"] is not None
    scored = {k: v for k, v in rows.items() if k != "plain"}
    ok = sensitive and all(v["status"] == 200 and v["approximated_tokens"] > 0 and (
        not v["verified"] or v["top1"] >= control["top1"] - TOP1_SLACK) for v in scored.values())
    return {"passed": ok, "control_verified": sensitive, "slack": TOP1_SLACK, "requests": rows}


def pin_bounds(r: Run) -> dict:
    """Pins past and at the request bound of ``recompute_head``, malformed settings; the agent's requests after."""
    from sglang_kvshare.protocol import Annotation

    bound = Annotation.model_fields["recompute_head"].metadata
    top = next((int(m.le) for m in bound if hasattr(m, "le")), 65536)
    salt = r.watch.secret("salt")
    agent, text = f"pinned-{r.tag}", r.doc()
    first = r.generate("pin_bounds", agent, text, salt=salt)
    scope = scope_of(first)
    if scope is None:
        return {"passed": False, "why": f"no guard scope in the report (status {first.status})"}
    past = {s: r.pin(scope, s).status for s in (f"head{top + 1}", "head70000", "head-1", "headx", "HEAD8", 5)}
    after_past = r.generate("pin_bounds", agent, text, salt=salt).status
    at = r.pin(scope, f"head{top}").status
    after_at = r.generate("pin_bounds", agent, text, salt=salt).status
    r.pin(scope, None)
    passed = all(400 <= s < 500 for s in past.values()) and at == 200 and after_past == after_at == 200
    return {"passed": passed, "bound": top, "past_bound_pins": past, "request_after_past_pins": after_past,
            "pin_at_bound": at, "request_after_pin_at_bound": after_at}


def name_flood(r: Run, form: dict) -> dict:
    """Two dense pins, then more agent names (and namespaces, slots) than any table holds, the admin routes
    and ``/metrics`` read, a pin-and-unpin flood of names, and the two pinned agents served again."""
    salt, xkey = r.watch.secret("salt"), r.watch.secret("extra_key")
    text = r.doc()
    victim, judge = f"victim-{r.tag}", f"judge-{r.tag}"
    first = r.generate("flood", victim, text, salt=salt, extra_key=xkey)
    pins = {"victim": r.pin(scope_of(first) or victim, "dense").status, "judge": r.pin(judge, "dense").status}
    salts = [r.watch.secret("salt") for _ in range(form["flood_namespaces"])]
    xkeys = [r.watch.secret("extra_key") for _ in range(8)]
    flood_text = r.doc()

    def one(i: int) -> int:
        ids, cp = r.request(f"fl{i}-{r.tag}", flood_text, slot=f"slot-{i}-{r.tag}",
                            system="You are one of many agents.")
        served = i % form["served_every"] == 0
        body = generate_body(ids, custom_params=cp, max_new_tokens=1 if served else -1,
                             salt=salts[(i // form["served_every"]) % len(salts)])
        if i % 5 == 0:
            body["extra_key"] = xkeys[i % len(xkeys)]
        return r.ep.call("flood", "POST", "/generate", body=body).status

    def slots(i: int) -> int:
        names = [f"sl{i}-{j}-{r.tag}" for j in range(62)]
        head = r.tok("<|im_start|>system\nYou hold many slots.<|im_end|>\n", add_special_tokens=False).input_ids
        ids = head + (4 * r.tok(flood_text, add_special_tokens=False).input_ids)[:2 * len(names)]
        raw = json.dumps(many_slots(f"slots{i}-{r.tag}", len(head), len(ids), names))
        return r.ep.call("flood", "POST", "/generate", body=generate_body(
            ids, custom_params={"kvshare": raw}, max_new_tokens=1, salt=salts[0])).status

    with ThreadPoolExecutor(SEVERAL) as pool:
        statuses = list(pool.map(one, range(form["flood_names"]))) + list(pool.map(slots, range(form["slot_requests"])))
    for path in ("/kvshare/stats", "/kvshare/fidelity", "/kvshare/pools"):
        r.admin("admin_read", "GET", path)
    metrics_before = r.ep.call("metrics", "GET", "/metrics")
    pin_flood = [(r.pin(f"pf{i}-{r.tag}", "head8").status, r.pin(f"pf{i}-{r.tag}", None).status)
                 for i in range(form["pin_flood"])]
    for path in ("/kvshare/stats", "/kvshare/fidelity", "/kvshare/pools"):
        r.admin("admin_read", "GET", path)
    metrics = r.ep.call("metrics", "GET", "/metrics")
    series = _guard_series(metrics.body if isinstance(metrics.body, str) else "", r.tag)
    early = _guard_series(metrics_before.body if isinstance(metrics_before.body, str) else "", r.tag)
    # The pinned agents again: the victim on a text a source of its namespace has just read (a control agent
    # unpinned is aligned from it, the victim must not be), the judge once.
    after = r.doc()
    r.generate("flood", f"src-{r.tag}", after, salt=salt, extra_key=xkey, warm_head=True, tokens=1)
    control = r.generate("flood", f"ctrl-{r.tag}", after, salt=salt, extra_key=xkey, warm_head=True)
    again = r.generate("flood", victim, after, salt=salt, extra_key=xkey, warm_head=True)
    judged = r.generate("flood", judge, r.doc())
    snap = r.fidelity().get("per_scope") or {}
    survive = {"victim": {"status": again.status, "setting": (again.report.get("guard") or {}).get("setting"),
                          "approximated_tokens": approximated(again),
                          "listed": (snap.get(scope_of(again) or "") or {}).get("setting")},
               "judge": {"status": judged.status, "setting": (judged.report.get("guard") or {}).get("setting"),
                         "approximated_tokens": approximated(judged), "listed": (snap.get(judge) or {}).get("setting")}}
    # NOTE: the judge has no salt: a server that serves unsalted requests as stock (salt-required) gives it no
    # report; its pin must still be listed.
    pins_ok = pins == {"victim": 200, "judge": 200} and all(
        v["status"] == 200 and v["listed"] == "dense" and v["approximated_tokens"] == 0
        and v["setting"] in ("dense", None if name == "judge" else "dense") for name, v in survive.items())
    exported = sum(a == 200 for a, _ in pin_flood)
    cap = _series_cap()
    return {"flood_requests": len(statuses), "flood_statuses": {str(k): statuses.count(k) for k in set(statuses)},
            "flood_namespaces": len(salts), "slot_names": 62 * form["slot_requests"],
            "pin_flood": {"pins": len(pin_flood), "pinned_200": exported,
                          "unpinned_200": sum(b == 200 for _, b in pin_flood)},
            "pins": pins, "survive": survive, "victim_control_approximated": approximated(control),
            "pins_survive_flood": pins_ok, "series_cap": cap, "series_after_display_flood": early,
            "series": series,
            "metrics_bounded": metrics.status == 200 and series["scopes"] <= cap and not series["agent_names"]
            and not early["agent_names"]}


def _series_cap() -> int:
    from sglang_kvshare.guard import metrics

    return int(getattr(metrics, "MAX_SCOPE_LABELS", 32))


def _guard_series(text: str, tag: str) -> dict:
    """The guard's series on ``/metrics``: sample lines, distinct per-scope label sets (every label but the
    fixed-set ones: bound, event, reason) and the label values naming an agent of this run."""
    every = [ln for ln in text.splitlines() if ln.startswith("sglang_kvshare_") and "{" in ln]
    lines = [ln for ln in every if ln.startswith("sglang_kvshare_guard_")]
    scopes, named = set(), set()
    for ln in every:  # no kvshare series (guard or slot) may name an agent or a slot of this run
        inside = ln.split("{", 1)[1].rsplit("}", 1)[0]
        labels = dict(pair.split("=", 1) for pair in re.findall(r'(\w+="[^"]*")', inside))
        own = tuple(sorted((k, v) for k, v in labels.items() if k not in FIXED_LABELS))
        if own and ln in lines:
            scopes.add(own)
        named |= {v.strip('"') for v in labels.values() if tag in v}
    return {"lines": len(lines), "scopes": len(scopes), "agent_names": sorted(named)[:5]}
