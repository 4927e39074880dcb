"""Chat traffic of the soak (``/v1/chat/completions``): chained agents of four tenants, hostile chats, scope
probes across users, salts and workflows, and bursts of decodes that over-commit the KV pool."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Optional

from benchmarks.soak.client import (REQUEST_TIMEOUT_S, SUFFIX, TEAM, Client, Outcome, chat_report, error_message,
                                    system_part)
from benchmarks.soak.faults import ChatCase, chat_hostile, cross_scope_signs, source_found
from sglang_kvshare.frontend.builder import build_request, private_part


# The chat tenants: two OpenAI users and two cache salts, each with its own system prompts, all reading
# the same documents. A tenant is a reuse scope: (cache_salt, workflow), the workflow being the user.
CHAT_TENANTS = {
    "alice": {"user": "alice", "who": "Alice's study group"},
    "bob": {"user": "bob", "who": "Bob's tutoring service"},
    "salt-x": {"cache_salt": "chat-x", "who": "school X"},
    "salt-y": {"cache_salt": "chat-y", "who": "school Y"},
}
CHAT_ROLES = {"planner": "You plan how to solve the problem, step by step.",
              "checker": "You check every number in the problem and say which ones matter.",
              "writer": "You write the final answer in one sentence."}
# op_chat's variants in turn (shared counter): (mode, streamed, 40-message conversation)
CHAT_VARIANTS = (("auto", False, False), ("explicit", True, False), ("auto", True, True), ("opt_out", False, False),
                 ("explicit", False, True), ("auto", True, False), ("opt_out", True, False), ("auto", False, True))
LONG_CHAT_MESSAGES = 40
CHAT_MAX_TOKENS = 8
HOSTILE_PER_OP = 8
SCOPE_VARIANTS = ("user", "salt", "workflow")
# Retraction bursts: N concurrent decodes of about BURST_PROMPT prompt tokens (plus system prompt and
# template), 3 in 4 decoding BURST_LONG tokens and the others BURST_SHORT (min = max new tokens, so EOS ends
# none early; ignore_eos would make SGLang reserve every remaining token). SGLang admits a new request against
# the running ones' remaining tokens times its new-token ratio (0.7 after idle) and tries again only when one
# finishes: when a short one does, queued ones fill that estimate, the long ones then outgrow it and the
# scheduler retracts ("KV cache pool is full. Retract requests."). Sized for the 3072-token pool: 15 to 30 s
# here beside the other client; whether it retracts depends on that client's traffic, so it is counted,
# not required.
BURST_PROMPT, BURST_LONG, BURST_SHORT = 90, 48, 4


def burst_lengths(n: int) -> list[int]:
    """New tokens of a burst's requests, in the order they are sent (see ``BURST_PROMPT``)."""
    return [BURST_SHORT if i % 4 == 1 else BURST_LONG for i in range(n)]


def chat_system(tenant: str, role: str) -> str:
    return f"You work for {CHAT_TENANTS[tenant]['who']}. {CHAT_ROLES[role]}"


def tenant_fields(tenant: str) -> dict:
    return {k: v for k, v in CHAT_TENANTS[tenant].items() if k in ("user", "cache_salt")}


def chat_body(tenant: str, role: str, doc: str, *, ack: Optional[str] = "Noted.", ask: str = "Answer briefly.",
              **fields) -> dict:
    """A greedy chat of ``tenant``'s agent ``role`` reading ``doc`` (``ack``: the assistant's turn after it)."""
    messages = [{"role": "system", "content": chat_system(tenant, role)},
                {"role": "user", "content": f"Context:\n{doc}"},
                *([{"role": "assistant", "content": ack}] if ack else []), {"role": "user", "content": ask}]
    return {"model": "default", "messages": messages, "temperature": 0.0, **tenant_fields(tenant), **fields}


def with_workflow(custom_params: dict, workflow: str) -> dict:
    """``custom_params`` of ``build_request`` with the annotation's ``workflow`` set."""
    ann = json.loads(custom_params["kvshare"])
    return {"kvshare": json.dumps({**ann, "workflow": workflow})}


def _answer_text(out: Outcome) -> str:
    if out.status != 200 or not isinstance(out.body, dict):
        return ""
    message = ((out.body.get("choices") or [{}])[0] or {}).get("message") or {}
    return str((out.body.get("text") if out.body.get("stream") else message.get("content")) or "")


def _history(c: Client, n: int) -> list[dict]:
    """``n`` earlier turns of a long conversation: GSM8K snippets, user and assistant in turn."""
    turns = []
    for j in range(n):
        snippet = c.s.texts[c.rng.randrange(len(c.s.texts))][:90]
        turns.append({"role": "user" if j % 2 == 0 else "assistant", "content": f"Earlier note {j}: {snippet}"})
    return turns


def chat(c: Client) -> None:
    """Agents of one tenant in a chain on a working document (a later agent reads the previous answer),
    the variant in turn: automatic, explicit or opted out; streamed or not; 40 messages or a few."""
    turn = c.s.turn("chat")
    mode, stream, long = CHAT_VARIANTS[turn % len(CHAT_VARIANTS)]
    tenant = list(CHAT_TENANTS)[(turn + turn // len(CHAT_VARIANTS)) % len(CHAT_TENANTS)]
    with c.s.rec.lock:
        c.s.rec.chat[f"{mode}{' streamed' if stream else ''}{' long' if long else ''}"] += 1
        c.s.rec.chat[f"tenant {tenant}"] += 1
    if mode == "opt_out":
        return _chat_opt_out(c, tenant, stream)
    text = c.s.working_text(c.rng)
    history = _history(c, LONG_CHAT_MESSAGES - 4) if long else []
    prev: Optional[tuple[str, str]] = None  # (role, answer)
    for role in c.rng.sample(list(CHAT_ROLES), 1 if long else c.rng.randint(2, 3)):
        messages = [{"role": "system", "content": chat_system(tenant, role)}, *history,
                    {"role": "user", "content": f"Context:\n{text}"}]
        if prev:
            messages.append({"role": "assistant", "content": prev[1]})
        messages.append({"role": "user", "content": "Answer briefly."})
        body = {"model": "default", "messages": messages, "max_tokens": CHAT_MAX_TOKENS, "temperature": 0.0,
                "stream": stream, **tenant_fields(tenant)}
        if mode == "explicit":
            ctx = 1 + len(history)
            shared = [{"message": 1 + j, "slot": "history"} for j in range(0, len(history), 4)]
            shared.append({"message": ctx, "slot": "query"})
            if prev:
                shared.append({"message": ctx + 1, "slot": f"out:{prev[0]}"})
            body["kvshare"] = {"agent": f"{role}@{tenant}", "shared": shared, "output_slot": f"out:{role}"}
        out = c.chat("chat", body, report=True)
        if mode == "auto" and out.status == 200:
            c.s.recent_chats.append(body)
        answer = _answer_text(out)
        prev = (role, answer) if answer.strip() else None


def _chat_opt_out(c: Client, tenant: str, stream: bool) -> None:
    """``"kvshare": false``: an earlier automatic chat repeated word for word (its prompt was assembled),
    which must be served as stock: no report, and no estimate among its cached tokens."""
    recent = list(c.s.recent_chats)
    if recent:
        body = dict(c.rng.choice(recent))
    else:
        role = c.rng.choice(list(CHAT_ROLES))
        body = chat_body(tenant, role, c.s.working_text(c.rng), ack=None, max_tokens=CHAT_MAX_TOKENS)
    body.update(stream=stream, kvshare=False)
    c.chat("chat", body, report=False)


def hostile_chats(c: Client) -> None:
    """The next ``HOSTILE_PER_OP`` cases of the hostile chat catalogue (in turn over the run) for one tenant."""
    turn = c.s.turn("chat_hostile")
    tenant = list(CHAT_TENANTS)[turn % len(CHAT_TENANTS)]
    role = c.rng.choice(list(CHAT_ROLES))
    cases = chat_hostile(chat_system(tenant, role), c.s.clip(c.s.working_text(c.rng), 80), c.rng)
    for k in range(HOSTILE_PER_OP):
        case: ChatCase = cases[(turn * HOSTILE_PER_OP + k) % len(cases)]
        body = {"model": "default", "max_tokens": 4, "temperature": 0.0, **tenant_fields(tenant), **case.body}
        out = c.s.endpoint.chat("chat_hostile", body)
        rep = chat_report(out)
        c.s.rec.chat_answer("chat_hostile", body, rep)
        streamed = out.status == 200 and isinstance(out.body, dict) and out.body.get("stream") is True
        row = {"kind": case.kind, "auto": case.auto, "fix": case.fix, "refuse": case.refuse, "status": out.status,
               "message": error_message(out.body)[:300] if out.status != 200 else "",
               "stream_errors": out.body["errors"][:3] if streamed else [], "report": rep is not None}
        if out.status != 200 and case.auto:
            row["body"] = body  # replayed on the off reference: does stock SGLang answer the same?
        c.s.rec.keep("hostile", row)
        c.s.rec.fault(f"chat_{case.kind}")


def scope_probe(c: Client) -> None:
    """Content only tenant A has sent (a fresh document and a nonce): a second agent of A reads it (the
    control: it finds A's copy), then an agent of tenant B, another user or another cache salt, reads it
    (automatic or explicit); or the same on ``/generate`` with annotations of two workflows. Nothing of
    B's request may be aligned, corrected, or even find a copy of A's."""
    turn = c.s.turn("scope_probe")
    variant = SCOPE_VARIANTS[turn % len(SCOPE_VARIANTS)]
    doc = c.s.clip(c.s.probe_text(), 120)
    nonce = f"{c.rng.getrandbits(32):x}"
    explicit = variant == "workflow" or c.rng.random() < 0.5
    with c.s.admin_lock:  # no mode switch in the middle
        if variant == "workflow":
            scopes = [f"wf-{nonce}-a", f"wf-{nonce}-a", f"wf-{nonce}-b"]
            reps = _workflow_probe(c, doc, nonce, scopes)
        else:
            pair = ["alice", "bob"] if variant == "user" else ["salt-x", "salt-y"]
            c.rng.shuffle(pair)
            scopes = [pair[0], pair[0], pair[1]]
            reps = []
            for tenant, role in zip(scopes, c.rng.sample(list(CHAT_ROLES), 3)):
                body = chat_body(tenant, role, doc, ack=f"Noted (case {nonce}).", ask=f"Answer briefly (case {nonce}).",
                                 max_tokens=2)
                if explicit:
                    body["kvshare"] = {"agent": f"{role}@{tenant}", "shared": [{"message": 1, "slot": "query"}]}
                out = c.chat("scope_probe", body, report=True)
                reps.append(chat_report(out) if out.status == 200 else None)
    if reps[2] is None:
        return  # the failed request is a finding already
    signs = cross_scope_signs(reps[2])
    probe = {"variant": variant, "explicit": explicit, "scopes": [scopes[0], scopes[2]],
             "control_found_a_copy": source_found(reps[1]), "reached": signs["reached"] > 0,
             "reused_tokens": signs["reused_tokens"], "found": signs["found"],
             "tokens_aligned": int(reps[2].get("tokens_aligned") or 0),
             "tokens_corrected": int(reps[2].get("tokens_corrected") or 0)}
    c.s.rec.keep("scope_probes", probe)
    if signs["reused_tokens"] or signs["found"]:
        c.s.rec.find("zero_cross_scope_reuse", probe)


def _workflow_probe(c: Client, doc: str, nonce: str, workflows: list[str]) -> list[Optional[dict]]:
    """solver and analyst of workflow A, then coder of workflow B, on ``/generate`` (no salt)."""
    suffix = SUFFIX.replace("briefly", f"briefly (case {nonce})")
    reps: list[Optional[dict]] = []
    for i, (agent, wf) in enumerate(zip(("solver", "analyst", "coder"), workflows)):
        if i:  # its private prefix in the tree, so that the cache reaches the shared text
            head, cp = build_request(c.s.tokenizer, agent, [private_part(system_part(agent))])
            c.s.endpoint.generate("scope_probe", head, custom_params=with_workflow(cp, wf), max_new_tokens=1)
        ids, cp = c.s.request(agent, doc, suffix=suffix)
        out = c.s.endpoint.generate("scope_probe", ids, custom_params=with_workflow(cp, wf), max_new_tokens=2)
        if out.status == 200:
            c.s.rec.annotated(out)
        else:
            c.s.rec.refused(out, request="scope_probe")
        reps.append(out.report if out.status == 200 else None)
    return reps


def retract_burst(c: Client) -> None:
    """``burst_size`` concurrent decodes of staggered lengths (annotated and plain ``/generate``, automatic
    chats streamed and not) over-committing the KV pool, so that SGLang retracts some; every one must
    still come back whole (min = max new tokens). One burst at a time; else a chat round."""
    if c.s.burst_size <= 0 or not c.s.burst_lock.acquire(blocking=False):
        return chat(c)
    try:
        _burst(c)
    finally:
        c.s.burst_lock.release()


def _burst(c: Client) -> None:
    n = c.s.burst_size
    docs = [c.s.clip(c.s.probe_text(), BURST_PROMPT) for _ in range((n + 1) // 2)]
    kinds = ("annotated", "chat", "plain", "chat_stream")
    lengths = burst_lengths(n)
    results: dict[int, dict] = {}
    ep = c.s.endpoint

    def one(i: int) -> None:
        m = lengths[i]
        kind = kinds[(i + i // 4) % 4]
        doc = docs[i // 2]
        got = None
        if kind in ("annotated", "plain"):
            ids, cp = c.s.request(TEAM[i % len(TEAM)], doc)
            out = ep.generate("retract_burst", ids, custom_params=cp if kind == "annotated" else None,
                              max_new_tokens=m, sampling={"min_new_tokens": m})
            if out.status == 200:
                got = out.body.get("meta_info", {}).get("completion_tokens")
                if kind == "annotated":
                    c.s.rec.annotated(out)
            else:
                c.s.rec.refused(out, request="retract_burst")
        else:
            tenant = list(CHAT_TENANTS)[i % len(CHAT_TENANTS)]
            role = list(CHAT_ROLES)[i % len(CHAT_ROLES)]
            body = chat_body(tenant, role, doc, max_tokens=m, min_tokens=m, stream=kind == "chat_stream")
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            out = c.chat("retract_burst", body, report=True)
            if out.status == 200 and isinstance(out.body, dict):
                got = (out.body.get("usage") or {}).get("completion_tokens")
        results[i] = {"kind": kind, "max_new_tokens": m, "status": out.status, "completion_tokens": got}

    t0 = time.monotonic()
    threads = []
    for i in range(n):  # in order: the long and short ones interleave in the queue as planned
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
        time.sleep(0.01)
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 30)
    rows = [results.get(i, {"status": None}) for i in range(n)]
    short = [r for r in rows if r.get("status") == 200 and r.get("completion_tokens") != r.get("max_new_tokens")]
    for r in short:
        c.s.rec.find("nothing_lost", {"request": "retract_burst", "cut_short": r})
    c.s.rec.keep("bursts", {"requests": n, "seconds": round(time.monotonic() - t0, 1),
                            "answered_200": sum(r.get("status") == 200 for r in rows),
                            "complete": sum(r.get("status") == 200 and r not in short for r in rows),
                            "by_kind": dict(Counter(r.get("kind") for r in rows))})


OPS = {"chat": chat, "chat_hostile": hostile_chats, "scope_probe": scope_probe, "retract_burst": retract_burst}
