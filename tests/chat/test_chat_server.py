"""kvshare through ``/v1/chat/completions`` with the ``openai`` SDK, against a real server.

One server (``fullshared``, ``--kvshare-auto true``) serves both modes: a request
with the ``kvshare`` field is explicit, one without is annotated by the server.
"""

from __future__ import annotations

import time

import pytest
import requests

from tests.servers import clean, shared_server

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

TASK = ("Task: a farmer has 17 sheep. He buys 5 more and then sells 8. How many sheep does he have now? "
        "Answer in two short sentences.")
LONG_TASK = TASK.replace("Answer in two short sentences.", "Explain every step in detail.")


@pytest.fixture(scope="module")
def server(server_pool):
    return shared_server(server_pool)  # fullshared with --kvshare-auto true


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def _ask(client, system, messages, kvshare=None, *, stream=False, max_tokens=24, **extra):
    body = dict(extra)
    if kvshare is not None:
        body["kvshare"] = kvshare
    msgs = [{"role": "system", "content": system}, *messages]
    if not stream:
        resp = client.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=max_tokens,
                                              extra_body=body or None)
        return resp.choices[0].message.content, (resp.model_extra or {}).get("kvshare"), resp
    text, report, chunks = "", None, []
    for chunk in client.chat.completions.create(model="default", messages=msgs, temperature=0,
                                                max_tokens=max_tokens, extra_body=body or None, stream=True):
        chunks.append(chunk)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if (chunk.model_extra or {}).get("kvshare"):
            report = chunk.model_extra["kvshare"]
    return text, report, chunks


def _reused(report) -> int:
    return report["tokens_aligned"] + report["tokens_corrected"]


def _slot(report, slot):
    return [s for s in report["segments"] if s.get("slot") == slot]


def test_explicit_annotation_reuses_marked_messages_and_answers(client, server):
    clean(server)  # the same in any test order: no glue or answer seen before
    kv = {"agent": "planner", "shared": [{"message": 1, "slot": "task"}], "output_slot": "out:planner"}
    # The plan must be long enough (min_stage_tokens, 32) for reuse to resume after the template
    # glue in front of it, which no earlier request had and is prefilled: a task asking for detail.
    plan, report, resp = _ask(client, "You write a short plan.", [{"role": "user", "content": LONG_TASK}], kv,
                              max_tokens=48)
    assert plan and report["chat"]["mode"] == "explicit" and report["chat"]["same_as_stock"]
    assert report["chat"]["segments"][-1]["end"] == resp.usage.prompt_tokens  # the annotation covers the prompt
    assert _slot(report, "task")[0]["resolved_by"] == "dense"  # nobody had the task before

    kv = {"agent": "solver", "shared": [{"message": 1, "slot": "task"}, {"message": 2, "slot": "out:planner"}],
          "output_slot": "out:solver"}
    solution, report, _ = _ask(client, "You solve problems step by step.",
                               [{"role": "user", "content": LONG_TASK}, {"role": "assistant", "content": plan}], kv,
                               max_tokens=48)
    assert solution and report["chat"]["warmed"]  # a new agent: its prefix is prefilled first
    assert report["segments"][0]["resolved_by"] == "hit"
    task = _slot(report, "task")[0]
    assert task["resolved_by"] == "alignment" and task["source_agent"] == "planner"
    answer = [m for m in report["chat"]["messages"] if m["index"] == 2][0]
    assert answer["source"] == "output" and answer["retokenized_equal"]
    # The planner's answer: its KV computed while generating (all but its last, unfed token).
    out = _slot(report, "out:planner")[0]
    assert out["resolved_by"] == "alignment" and out["resolved_tokens"] >= out["tokens"] - 1

    # A third agent, streamed: the report arrives in the final chunk (the one with the finish reason).
    kv = {"agent": "critic", "shared": [{"message": 1, "slot": "task"}, {"message": 2, "slot": "out:planner"},
                                        {"message": 3, "slot": "out:solver"}]}
    critique, report, chunks = _ask(client, "You critique solutions.",
                                    [{"role": "user", "content": LONG_TASK}, {"role": "assistant", "content": plan},
                                     {"role": "assistant", "content": solution}], kv, stream=True)
    assert critique and report is not None
    carrier = [c for c in chunks if (c.model_extra or {}).get("kvshare")]
    assert len(carrier) == 1 and carrier[0].choices and carrier[0].choices[0].finish_reason is not None
    assert all(c.choices for c in chunks)  # no extra chunk: clients that read choices[0] are safe
    # Every marked message is reused (but for an answer's unfed last token); only template glue
    # that no earlier request had is prefilled.
    marked = [s for s in report["segments"] if s["kind"] == "shared" and s["slot"] != "chat:glue"]
    assert all(s["resolved_by"] == "alignment" for s in marked), report["segments"]
    assert _reused(report) >= sum(s["tokens"] for s in marked) - 2, report


def test_explicit_ids_match_what_sglang_renders(client, model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    messages = [{"role": "system", "content": "You check arithmetic."}, {"role": "user", "content": TASK},
                {"role": "user", "content": "(1) 17 + 5 = 22\n(2) 22 - 8 = 14"}]
    kv = {"agent": "checker", "shared": [{"message": 1, "slot": "task"}, {"message": 2, "slot": "steps"}]}
    _, report, resp = _ask(client, messages[0]["content"], messages[1:], kv)
    stock = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert report["chat"]["same_as_stock"] and resp.usage.prompt_tokens == len(stock)


@pytest.mark.parametrize("field, message", [
    ({"agent": "a", "shared": [{"message": 7, "slot": "q"}]}, "has 2 messages"),
    ({"agent": "a", "shared": [{"message": 1}]}, "kvshare.shared.0.slot"),
    ({"shared": []}, "kvshare.agent"),
    ("critic", "must be an object"),
    ({"agent": "a", "shared": [{"message": 0, "slot": "q"}], "output": "x"}, "kvshare.output"),
])
def test_malformed_field_is_a_400_and_changes_nothing(client, server, field, message):
    before = requests.get(server.url + "/kvshare/chat", timeout=30).json()["requests"]
    with pytest.raises(openai.BadRequestError) as err:
        _ask(client, "You plan.", [{"role": "user", "content": TASK}], field)
    assert message in str(err.value)
    assert requests.get(server.url + "/kvshare/chat", timeout=30).json()["requests"] == before
    text, _, _ = _ask(client, "You plan.", [{"role": "user", "content": "Say hi."}], max_tokens=4)
    assert text  # still serving


def test_a_message_the_template_does_not_render_verbatim_is_a_400(client):
    # An empty content cannot be a shared segment; the message names it.
    with pytest.raises(openai.BadRequestError, match="cannot share message 2"):
        _ask(client, "You plan.", [{"role": "user", "content": TASK}, {"role": "user", "content": ""}],
             {"agent": "a", "shared": [{"message": 2, "slot": "q"}]})


def test_auto_mode_reuses_the_shared_task_across_agents(client, server):
    def stats():
        return requests.get(server.url + "/kvshare/stats", timeout=30).json()["slots"].get("auto:message", {})

    task = TASK + " (asked of every agent in the automatic test)"
    before = stats()
    reports = []
    for k, system in enumerate(["You are agent one; answer briefly.", "You are agent two, a careful checker.",
                                "You are agent three, a terse summarizer."]):
        # The task, then each agent's own instruction: the last message is always prefilled.
        text, report, chunks = _ask(client, system, [{"role": "user", "content": task},
                                                     {"role": "user", "content": f"Agent {k + 1}, go ahead."}],
                                    stream=(k == 2))
        assert text and report["chat"]["mode"] == "auto" and report["chat"]["same_as_stock"]
        assert report["agent"].startswith("auto-") and report["segments"][-1]["kind"] == "private"
        if k == 2:  # a stream carries the report in its final chunk, and no extra chunk
            assert all(c.choices for c in chunks)
        reports.append(report)
    assert _slot(reports[0], "auto:message")[0]["resolved_by"] == "dense"
    task_seg = _slot(reports[1], "auto:message")[0]
    assert task_seg["resolved_by"] == "alignment" and task_seg["resolved_tokens"] == task_seg["tokens"]
    after = stats()
    reused = after["resolved_alignment"] + after["resolved_correction"] - (
        before.get("resolved_alignment", 0) + before.get("resolved_correction", 0))
    assert reused >= 2 * task_seg["tokens"]  # agents two and three (the stream) both reused the task


def test_auto_mode_reuses_an_answer_that_comes_back_as_a_message(client, server):
    question = "Name three primary colours, comma separated."
    answer, _, _ = _ask(client, "You answer questions.", [{"role": "user", "content": question}], max_tokens=16)
    _, report, _ = _ask(client, "You grade answers.",
                        [{"role": "user", "content": question}, {"role": "assistant", "content": answer},
                         {"role": "user", "content": "Is this answer right? Say yes or no."}], max_tokens=4)
    back = [m for m in report["chat"]["messages"] if m["index"] == 2][0]
    assert back["source"] == "output" and back["retokenized_equal"]
    seg = [s for s in report["segments"] if s["index"] == 3][0]  # private, task, glue, answer, ...
    assert seg["resolved_by"] == "alignment" and seg["source_agent"] == report["segments"][1]["source_agent"]
    # The answer as the last message (a group chat's next turn): reused too, not prefilled.
    _, report, _ = _ask(client, "You summarize answers.",
                        [{"role": "user", "content": question}, {"role": "user", "content": answer}], max_tokens=1)
    last = [s for s in report["chat"]["segments"] if s.get("slot") == "auto:message"][-1]
    assert last.get("reuse", True) and report["segments"][3]["resolved_by"] == "alignment", report["segments"]
    counts = requests.get(server.url + "/kvshare/chat", timeout=30).json()["outputs"]
    assert counts["seen_again"] >= 1 and counts["retokenized_equal"] >= 1


def _with_turn(task):
    return [{"role": "user", "content": task}, {"role": "user", "content": "Your turn."}]


def test_auto_mode_never_reuses_across_cache_salts(client):
    task = TASK + " (namespace test)"
    _, first, _ = _ask(client, "You are tenant A's agent.", _with_turn(task), cache_salt="tenant-a")
    _, other, _ = _ask(client, "You are tenant B's agent.", _with_turn(task), cache_salt="tenant-b")
    _, same, _ = _ask(client, "You are tenant A's second agent.", _with_turn(task), cache_salt="tenant-a")
    assert _reused(other) == 0 and all("source_agent" not in s for s in other["segments"])
    assert _reused(same) > 0  # the same text within tenant A is reused


def test_auto_mode_never_reuses_across_users(client):
    document = "Quarterly memo for the reuse-scope test: " + " ".join(f"item {i} costs {3 * i} euros." for i in range(40))
    _, alice, _ = _ask(client, "You are alice's summarizer.", _with_turn(document), user="alice")
    _, bob, _ = _ask(client, "You are bob's auditor.", _with_turn(document), user="bob")
    _, alice2, _ = _ask(client, "You are alice's auditor.", _with_turn(document), user="alice")
    assert _reused(bob) == 0  # bob is never served KV computed behind alice's system prompt
    assert all("source_agent" not in s for s in bob["segments"])
    assert _reused(alice2) > 0 and bob["agent"] != alice2["agent"]  # a second agent of alice reuses


def test_auto_mode_answers_long_chats_and_hostile_content_like_stock(client):
    messages = []
    for i in range(40):  # an agent's tool loop: 40 messages would need 81 segments unmerged
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"Step {i}: the tool said {i * 11}."})
    text, report, _ = _ask(client, "You run tools.", messages, max_tokens=4)
    assert text is not None and len(report["segments"]) <= 64
    hostile = [{"role": "user", "content": "Echo this: \ue000kvshare-999\ue001 and \ue000kvshare-0\ue001."},
               {"role": "user", "content": "Now answer."}]
    text, report, _ = _ask(client, "You echo.", hostile, max_tokens=4)  # a 200, like stock
    assert text is not None
    text, report, _ = _ask(client, "You echo.", hostile, {"agent": "echo", "shared": [{"message": 1, "slot": "q"}]},
                           max_tokens=4)
    assert text is not None and report["chat"]["mode"] == "explicit"


def test_a_chat_past_the_context_length_gets_stocks_own_error_at_once(server):
    """A 4,000-message chat (about 40k tokens, past the 8k context): the 400 stock answers, as fast as stock
    answers it, the request handed to stock unplanned (planning it took minutes on the HTTP process)."""
    from tests.chat.plan_timing import long_chat

    url = server.url + "/v1/chat/completions"
    body = {"model": "default", "messages": long_chat(4000), "max_tokens": 4, "temperature": 0}
    before = requests.get(server.url + "/kvshare/chat", timeout=30).json()["requests"]
    stock = requests.post(url, json={**body, "kvshare": False}, timeout=120)  # served exactly as stock
    t0 = time.monotonic()
    auto = requests.post(url, json=body, timeout=120)
    elapsed = time.monotonic() - t0
    after = requests.get(server.url + "/kvshare/chat", timeout=30).json()["requests"]
    assert stock.status_code == 400 and "context length" in stock.json()["message"]
    assert (auto.status_code, auto.json()) == (stock.status_code, stock.json())
    assert after["over_context"] == before["over_context"] + 1 and after["auto"] == before["auto"]
    assert elapsed < 2.0  # the bound


def test_a_request_can_opt_out(client, server):
    before = requests.get(server.url + "/kvshare/chat", timeout=30).json()["requests"]
    text, report, resp = _ask(client, "You answer.", _with_turn(TASK), False, max_tokens=4)
    after = requests.get(server.url + "/kvshare/chat", timeout=30).json()["requests"]
    assert text is not None and report is None  # served exactly as stock SGLang serves it
    assert after["opted_out"] == before["opted_out"] + 1 and after["auto"] == before["auto"]


def test_cached_tokens_count_exact_hits_only(server, model_path):
    from transformers import AutoTokenizer

    from sglang_kvshare.frontend.builder import build_request, private_part, shared_part

    tok = AutoTokenizer.from_pretrained(model_path)
    doc = "Cached-token test document. " + " ".join(f"Row {i}: value {i * 13}." for i in range(30))
    for agent in ("writer", "reader"):
        system = f"<|im_start|>system\nYou are the {agent}.<|im_end|>\n<|im_start|>user\n"
        ids, custom = build_request(tok, agent, [private_part(system), shared_part(doc, slot="doc"),
                                                 private_part("<|im_end|>\n<|im_start|>assistant\n")])
        server.generate(input_ids=ids[:len(tok(system, add_special_tokens=False).input_ids)] + [1], max_new_tokens=0)
        meta = server.generate(input_ids=ids, custom_params=custom, max_new_tokens=1)["meta_info"]
    report = meta["kvshare"][0]
    assert report["tokens_aligned"] > 0  # the reader's document was aligned ...
    assert meta["cached_tokens"] == report["tokens_exact_hit"]  # ... and cached_tokens counts exact hits only


def test_a_reserved_extra_key_is_a_400(server):
    r = requests.post(server.url + "/generate", timeout=60, json={
        "text": "Hello", "extra_key": "kvshare-est:0:-:", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "kvshare-est:" in r.text


def test_auto_mode_serves_tools_list_contents_several_choices_and_logprobs(server):
    """Shapes agent frameworks send: each answered 200 with valid JSON, as stock answers them."""
    url = server.url + "/v1/chat/completions"
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
    bodies = [
        {"messages": [{"role": "system", "content": "You use tools."}, {"role": "user", "content": "Add 2 and 3."},
                      {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "5"}], "tools": tools},
        {"messages": [{"role": "system", "content": "You read."},
                      {"role": "user", "content": [{"type": "text", "text": "A list-valued content."}]}]},
        {"messages": [{"role": "system", "content": "You answer."}, {"role": "user", "content": TASK}], "n": 2},
        {"messages": [{"role": "system", "content": "You answer."}, {"role": "user", "content": TASK}],
         "logprobs": True, "top_logprobs": 2},
    ]
    for body in bodies:
        r = requests.post(url, timeout=300, json={"model": "default", "max_tokens": 3, "temperature": 0, **body})
        assert r.status_code == 200, (body, r.text)
        answer = r.json()  # strict JSON: no NaN / Infinity
        assert answer["choices"] and len(answer["choices"]) == body.get("n", 1)
        if body.get("logprobs"):
            assert answer["choices"][0]["logprobs"]["content"]


def test_the_http_process_follows_a_runtime_mode_switch(client, server):
    from tests.servers import reconfigured

    def warmups():
        return requests.get(server.url + "/kvshare/chat", timeout=30).json()["requests"]["warmups"]

    kv = {"agent": "switch-test", "shared": [{"message": 1, "slot": "query"}]}
    with reconfigured(server, mode="off"):
        before = warmups()
        _ask(client, "You are the mode-switch agent, off.", _with_turn(TASK), kv, max_tokens=2)
        assert warmups() == before  # off: the chat layer no longer warms agent prefixes
    before = warmups()
    _ask(client, "You are the mode-switch agent, on again.", _with_turn(TASK), kv, max_tokens=2)
    assert warmups() == before + 1
