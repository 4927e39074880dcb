"""``/generate`` traffic of the soak: team rounds, plain repeats, leak and salt probes, slot floods, malformed
and fuzzed annotations, bad sampling, early closes and reused ``rid``s."""

from __future__ import annotations

import json
import threading
import time

from benchmarks.soak.client import (REQUEST_TIMEOUT_S, SALTS, SUFFIX, TEAM, Client, Outcome, estimated_tokens,
                                    generate_body, system_part)
from benchmarks.soak.faults import Case, adversarial_name, catalogue, expected_status, fuzzed, many_slots
from sglang_kvshare.protocol import MAX_NAME_CHARS


def team(c: Client) -> None:
    """A chain of 2 to 4 agents on one working text, under no salt or one of the two."""
    text = c.s.working_text(c.rng)
    # Mostly unsalted: pools are per namespace, and kvcmas corrects only once a pool holds anchors.
    salt = c.rng.choice((None, None, None, *SALTS))
    for agent in TEAM[:c.rng.randint(2, 4)]:
        c.annotated("team", agent, text, salt)


def plain(c: Client) -> None:
    """A plain request whose prompt equals a recent annotated one (same salt)."""
    if not c.s.recent:
        return team(c)
    recent = list(c.s.recent)
    assembled = [r for r in recent if r[2]]
    ids, salt, estimated = c.rng.choice(assembled if assembled and c.rng.random() < 0.7 else recent)
    c.plain("plain", ids, salt, "plain_after_estimate" if estimated else "plain")


def leak_probe(c: Client) -> None:
    """solver then analyst on a fresh text (the analyst is assembled from the solver's copy), then a plain
    request with the analyst's exact prompt; sometimes with the server switched to ``off`` for it.

    When the analyst was not assembled (in kvcmas, a pool without two anchors on the edge), the
    coder reads the text under ``fullshared`` (switched for it, then back), which aligns whenever a
    source exists, and the plain request takes the coder's prompt: the probe always leaves estimates."""
    text = c.s.probe_text()
    salt = c.rng.choice((None, None, SALTS[0]))
    c.annotated("leak_probe", "solver", text, salt)
    ids, out = c.annotated("leak_probe", "analyst", text, salt)
    if out.status != 200:
        return
    estimated = estimated_tokens(out.report)
    with c.s.admin_lock:
        if not estimated and c.s.mode != "fullshared":
            c.admin("/kvshare/config", {"mode": "fullshared"})
            ids, out = c.annotated("leak_probe", "coder", text, salt)
            c.admin("/kvshare/config", {"mode": c.s.mode, "tau": c.s.tau})
            if out.status != 200:
                return
            estimated = estimated_tokens(out.report)
        if c.rng.random() < 0.3:
            c.admin("/kvshare/config", {"mode": "off"})
            c.plain("leak_probe", ids, salt, "leak_probe_off" if estimated else "probe_off_unassembled")
            c.admin("/kvshare/config", {"mode": c.s.mode, "tau": c.s.tau})
        else:
            c.plain("leak_probe", ids, salt, "leak_probe" if estimated else "probe_unassembled")


def salt_probe(c: Client) -> None:
    """A fresh text and a fresh private suffix, seen by the solver under salt A only, then the solver
    again or the analyst under salt B: nothing of B's request may be aligned or corrected (B's agent has
    seen neither the text nor the suffix in its own namespace; its system prompt is an exact hit)."""
    text = c.s.probe_text()
    suffix = SUFFIX.replace("briefly", f"briefly (case {c.rng.getrandbits(32):x})")
    first, second = (SALTS if c.rng.random() < 0.5 else SALTS[::-1])
    reader = c.rng.choice(("solver", "analyst"))
    c.annotated("salt_probe", "solver", text, first, suffix=suffix)
    _, out = c.annotated("salt_probe", reader, text, second, suffix=suffix)
    if out.status != 200:
        return
    rep = out.report
    probe = {"salts": [first, second], "agents": ["solver", reader], "aligned": int(rep.get("tokens_aligned", 0) or 0),
             "corrected": int(rep.get("tokens_corrected", 0) or 0), "has_report": bool(rep),
             "shared_resolved_by": [s.get("resolved_by") for s in rep.get("segments") or []
                                    if s.get("kind", "shared") == "shared"]}
    c.s.rec.keep("salt_probes", probe)
    if estimated_tokens(rep):
        c.s.rec.find("zero_cross_salt_reuse", probe)


def slot_flood(c: Client) -> None:
    """A valid request with up to 63 shared segments, each under a new hostile slot name,
    from an agent with a hostile name."""
    k = min(c.s.max_segments - 1, max(1, c.s.slot_name_target - c.s.turns["name"]))
    agent = adversarial_name(c.rng, c.rng.choice([5, MAX_NAME_CHARS]))
    head = c.s.tokenizer(system_part("judge"), add_special_tokens=False).input_ids
    body_ids = c.s.tokenizer(c.s.working_text(c.rng), add_special_tokens=False).input_ids
    while len(body_ids) < 2 * k:
        body_ids = body_ids + body_ids
    ids = list(head) + list(body_ids[:2 * k])
    names = c.s.names(k)
    raw = json.dumps(many_slots(agent, len(head), len(ids), names), ensure_ascii=False)
    with c.s.rec.lock:
        c.s.rec.faults["slot_flood_requests"] += 1
        c.s.rec.slot_names.update(names)
    out = c.s.endpoint.generate("slot_flood", ids, custom_params={"kvshare": raw}, max_new_tokens=1,
                                salt=c.rng.choice((None, *SALTS)))
    c.s.rec.refused(out, request="slot_flood")


def _send_case(c: Client, label: str, case: Case, ids: list[int]) -> None:
    expected = expected_status(case.raw, len(ids), c.s.max_segments)
    out = c.s.endpoint.generate(label, ids, custom_params=case.custom_params(), max_new_tokens=2)
    with c.s.rec.lock:
        c.s.rec.faults[case.kind] += 1
        m, bad = c.s.rec.malformed, expected == 400
        m["sent" if bad else "valid_after_fuzz"] += 1
        m["got_4xx" if bad else "valid_got_200"] += int(400 <= out.status < 500 if bad else out.status == 200)
    if expected == 400 and not 400 <= out.status < 500:
        c.s.rec.find("malformed_get_4xx", {"kind": case.kind, "raw": str(case.raw)[:200],
                                           "status": out.status, "body": str(out.body)[:200]})
    elif expected == 200 and out.status != 200:
        c.s.rec.find("valid_requests_served", {"kind": case.kind, "raw": str(case.raw)[:200],
                                               "status": out.status, "body": str(out.body)[:200]})


def _long_prompt(c: Client) -> list[int]:
    ids, _ = c.s.request(c.rng.choice(TEAM), c.s.working_text(c.rng))
    while len(ids) < c.s.max_segments + 2:
        ids = ids + ids
    return ids


def malformed(c: Client) -> None:
    ids = _long_prompt(c)
    _send_case(c, "malformed", c.rng.choice(catalogue(len(ids), c.s.max_segments)), ids)


def fuzzed_op(c: Client) -> None:
    ids = _long_prompt(c)
    _send_case(c, "fuzzed", fuzzed(len(ids), c.rng), ids)


def bad_sampling(c: Client) -> None:
    """Bad parameters SGLang itself validates (not kvshare): it answers 4xx."""
    ids = _long_prompt(c)[:40]
    kind, sampling = c.rng.choice([("negative_max_new_tokens", {"max_new_tokens": -1}),
                                   ("negative_temperature", {"temperature": -1.0}),
                                   ("top_p_zero", {"top_p": 0.0})])
    out = c.s.endpoint.generate("bad_sampling", ids, sampling=sampling)
    c.s.rec.fault(kind)
    if not 400 <= out.status < 500:
        c.s.rec.find("bad_sampling_get_4xx", {"kind": kind, "status": out.status, "body": str(out.body)[:200]})


def abort(c: Client) -> None:
    """An annotated (or plain) stream closed after 0 to 3 chunks."""
    ids, cp = c.s.request(c.rng.choice(TEAM), c.s.working_text(c.rng))
    chunks = c.rng.choice([0, 1, 3])
    body = generate_body(ids, custom_params=cp if c.rng.random() < 0.7 else None, max_new_tokens=64,
                         salt=c.rng.choice((None, *SALTS)))
    c.s.rec.fault(f"abort_after_{chunks}_chunks")
    c.s.endpoint.stream_and_close("abort", body, chunks)


def rid_reuse(c: Client) -> None:
    """The same client-chosen rid twice: after completion, after an abort (then a plain request with the
    aborted prompt), or two at once."""
    rid = f"soak-{c.i}-{c.rng.getrandbits(40):x}"
    ids_a, cp_a = c.s.request("coder", c.s.working_text(c.rng))
    ids_b, cp_b = c.s.request("judge", c.s.fresh_text())
    variant = c.rng.choice(["after_completion", "after_abort", "concurrent"])
    c.s.rec.fault(f"rid_reuse_{variant}")
    ep = c.s.endpoint
    if variant == "after_completion":
        ep.generate("rid_reuse", ids_a, custom_params=cp_a, rid=rid)
        _expect_rid(c, ep.generate("rid_reuse", ids_b, custom_params=cp_b, rid=rid), variant)
    elif variant == "after_abort":
        ep.stream_and_close("rid_reuse", generate_body(ids_a, custom_params=cp_a, max_new_tokens=64, rid=rid),
                            c.rng.choice([0, 1]))
        for _ in range(8):  # SGLang answers 400 "Duplicate request ID" until the abort is processed
            out = ep.generate("rid_reuse", ids_b, custom_params=cp_b, rid=rid)
            if out.status != 400:
                break
            time.sleep(0.5)
        _expect_rid(c, out, variant)
        c.plain("rid_reuse", ids_a, None, "after_rid_reuse")
    else:
        outs: list[Outcome] = []
        t = threading.Thread(target=lambda: outs.append(
            ep.generate("rid_reuse", ids_a, custom_params=cp_a, rid=rid)))
        t.start()
        outs.append(ep.generate("rid_reuse", ids_b, custom_params=cp_b, rid=rid))
        t.join(REQUEST_TIMEOUT_S + 5)
        for out in outs:
            _expect_rid(c, out, variant)


def _expect_rid(c: Client, out: Outcome, variant: str) -> None:
    ok = out.status == 200 or (out.status == 400 and "Duplicate request ID" in str(out.body))
    if not ok and 0 < out.status < 500:
        c.s.rec.find("rid_reuse_answered", {"variant": variant, "status": out.status, "body": str(out.body)[:200]})


OPS = {"team": team, "plain": plain, "leak_probe": leak_probe, "salt_probe": salt_probe, "slot_flood": slot_flood,
       "malformed": malformed, "fuzzed": fuzzed_op, "bad_sampling": bad_sampling, "abort": abort,
       "rid_reuse": rid_reuse}
