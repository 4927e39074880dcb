"""Piece-wise chat rendering and chat annotations, on the real model's tokenizer (no server)."""

from __future__ import annotations

import pytest

from sglang_kvshare.chat.annotation import (
    AUTO_SLOT, GLUE_SLOT, auto_agent, auto_candidates, auto_slot, build_annotation, parse_chat_kvshare)
from sglang_kvshare.chat.outputs import OutputMemory
from sglang_kvshare.protocol import generated_ids_for_text
from sglang_kvshare.chat.render import (
    TemplateSplitError, align_to_stock, render_pieces, safe_messages, split_rendered)
from sglang_kvshare.protocol import AnnotationError, parse_annotation

# Contents as agents write them, and the awkward starts that a BPE can merge with the role header.
CONTENTS = [
    "Plan: 1. read the task. 2. add the numbers.", "A train leaves at 3 pm and travels 120 km.",
    "```python\ndef f(x):\n    return x + 1\n```", "émoji 🙂 and ünïcode", "(a parenthesis first)",
    "42 is the answer", "\tA tab first", " One leading space", "Ends with a newline\n", "Ends with a space ",
]
AWKWARD = ["\n\nTwo newlines first", "  two spaces first", " ", "\n"]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _fns(tokenizer):
    """The server's ``render`` and (batched) ``tokenize`` for a request without tools or template options."""
    from sglang_kvshare.chat.hooks import template_fns

    return template_fns(tokenizer, {})


def _ids(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _stock(tokenizer, messages):
    """What SGLang encodes for a text-only chat: the rendered template, encoded as a whole."""
    render, _ = _fns(tokenizer)
    return list(tokenizer(render(messages), add_special_tokens=False).input_ids)


def _chat(content, role="user"):
    return [{"role": "system", "content": "You check plans."}, {"role": "user", "content": "Task: add 2 and 3."},
            {"role": role, "content": content}]


@pytest.mark.parametrize("role", ["user", "assistant"])
def test_piecewise_ids_equal_stock_for_ordinary_contents(tokenizer, role):
    render, tokenize = _fns(tokenizer)
    for content in CONTENTS:
        messages = _chat(content, role)
        prompt, same = align_to_stock(render_pieces(render, tokenize, messages), _stock(tokenizer, messages))
        assert same, content
        assert prompt.content_messages() == {0, 1, 2}


def test_awkward_starts_are_detected_and_left_to_the_template(tokenizer):
    """Leading whitespace runs merge with the header's newline: those messages are not cut (auto mode)."""
    render, tokenize = _fns(tokenizer)
    for content in AWKWARD:
        messages = _chat(content)
        whole = render_pieces(render, tokenize, messages)
        _, same_whole = align_to_stock(whole, _stock(tokenizer, messages))
        assert not same_whole, content  # cutting everywhere changes the ids ...
        safe = safe_messages(tokenize, whole.pieces)
        assert 2 not in safe and {0, 1} <= safe
        prompt, same = align_to_stock(render_pieces(render, tokenize, messages, cut=safe),
                                      _stock(tokenizer, messages))
        assert same, content  # ... cutting only at safe messages does not


def test_a_message_content_gets_the_same_ids_behind_any_agent(tokenizer):
    render, tokenize = _fns(tokenizer)
    task = "Task: a farmer has 17 sheep and buys 5 more. How many?"
    ids = []
    for system in ("You plan.", "You are a meticulous solver who shows every step."):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        prompt = render_pieces(render, tokenize, messages)
        ids.append([p_ids for p, p_ids in zip(prompt.pieces, prompt.piece_ids) if p.message == 1][0])
    assert ids[0] == ids[1] == tuple(_ids(tokenizer, task))


def test_a_template_that_rewrites_content_is_refused():
    def trimming(messages):
        return "".join(f"<{m['role']}>{m['content'].strip()}</{m['role']}>" for m in messages)

    with pytest.raises(TemplateSplitError, match="verbatim"):
        split_rendered(trimming, [{"role": "user", "content": "  padded  "}])
    # Content the template does not render at all stays template text.
    pieces = split_rendered(lambda ms: "<hdr>" + ms[-1]["content"], [{"role": "system", "content": "hidden"},
                                                                    {"role": "user", "content": "shown"}])
    assert [(p.text, p.message) for p in pieces] == [("<hdr>", None), ("shown", 1)]


def test_explicit_annotation_shapes_and_covers_the_prompt(tokenizer):
    render, tokenize = _fns(tokenizer)
    messages = [{"role": "system", "content": "You solve."}, {"role": "user", "content": "Task: 2 + 3."},
                {"role": "assistant", "content": "Plan: add them."}]
    prompt = render_pieces(render, tokenize, messages, cut={1, 2})
    ids, ann = build_annotation(prompt, {1: "query", 2: "out:planner"}, "solver", "out:solver")
    assert ids == _stock(tokenizer, messages)
    kinds = [(s.kind, s.slot) for s in ann.segments]
    assert kinds == [("private", None), ("shared", "query"), ("shared", GLUE_SLOT), ("shared", "out:planner"),
                     ("shared", GLUE_SLOT)]
    assert parse_annotation(ann.to_custom_params(), len(ids)) == ann  # what the server's validation accepts
    task = ann.segments[1]
    assert ids[task.start:task.end] == _ids(tokenizer, "Task: 2 + 3.")
    # Nothing shared and no output slot: no annotation at all.
    assert build_annotation(prompt, {}, "solver", None) is None
    _, only_output = build_annotation(prompt, {}, "solver", "out:solver")
    assert [(s.kind, s.start, s.end) for s in only_output.segments] == [("private", 0, len(ids))]


@pytest.mark.parametrize("raw, message", [
    ("critic", "must be an object"),
    ({"shared": []}, "kvshare.agent: Field required"),
    ({"agent": "", "shared": []}, "kvshare.agent"),
    ({"agent": "a", "shared": [{"message": 5, "slot": "q"}]}, "has 3 messages"),
    ({"agent": "a", "shared": [{"message": 1, "slot": "q"}, {"message": 1, "slot": "r"}]}, "listed twice"),
    ({"agent": "a", "shared": [{"message": -1, "slot": "q"}]}, "kvshare.shared.0.message"),
    ({"agent": "a", "shared": [{"message": 1}]}, "kvshare.shared.0.slot"),
    ({"agent": "a", "shared": [{"message": 1, "slot": "x" * 129}]}, "kvshare.shared.0.slot"),
    ({"agent": "a", "shared": [], "colour": "red"}, "kvshare.colour"),
])
def test_malformed_fields_say_what_to_fix(raw, message):
    with pytest.raises(AnnotationError, match=message):
        parse_chat_kvshare(raw, num_messages=3, max_segments=64)


def test_too_many_shared_messages_for_the_segment_limit():
    raw = {"agent": "a", "shared": [{"message": i, "slot": f"s{i}"} for i in range(40)]}
    with pytest.raises(AnnotationError, match="at most 31"):
        parse_chat_kvshare(raw, num_messages=40, max_segments=64)


def test_auto_policy():
    messages = [{"role": "system", "content": "You plan."}, {"role": "user", "content": "Task"},
                {"role": "assistant", "content": "Plan"}, {"role": "tool", "content": ""}]
    assert auto_candidates(messages) == {1, 2}
    assert auto_slot("assistant") == auto_slot("user") == AUTO_SLOT
    a = auto_agent(messages, None)
    assert a == auto_agent(messages[:2], None)  # the agent is its system prompt, not the conversation
    assert a != auto_agent([{"role": "system", "content": "You critique."}], None)
    assert a != auto_agent(messages, "tenant-user-7")
    assert a.startswith("auto-") and "plan" not in a.lower()


def test_output_memory_matches_text_per_namespace_and_counts_retokenization(tokenizer):
    text = "The sum is 5."
    generated = _ids(tokenizer, text) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids = generated_ids_for_text(tokenizer, text, generated)
    assert ids == tuple(_ids(tokenizer, text))
    memory = OutputMemory(capacity=2)
    memory.remember(("salt-a",), text, ids, "out:solver")
    assert memory.lookup(("salt-b",), text, ids) is None  # another tenant never sees it
    assert memory.lookup(("salt-a",), text, ids, slot="out:other") is None
    rec, equal = memory.lookup(("salt-a",), text, ids)
    assert equal and rec.slot == "out:solver"
    _, equal = memory.lookup(("salt-a",), text, ids[:-1])
    assert not equal
    assert memory.stats()["retokenized_equal_ratio"] == 0.5
    memory.remember(("salt-a",), "b", (1,), "s")
    memory.remember(("salt-a",), "c", (2,), "s")
    assert memory.stats()["size"] == 2  # bounded


def test_explicit_plan_substitutes_an_answers_generated_ids_and_says_so(tokenizer, monkeypatch):
    from sglang_kvshare.chat import hooks as chat_hooks
    from sglang_kvshare.chat.annotation import ChatKVShare

    render, tokenize = _fns(tokenizer)
    memory = OutputMemory()
    monkeypatch.setattr(chat_hooks, "outputs", memory)
    answer = "The sum is 5."
    generated = tuple(_ids(tokenizer, "The s") + _ids(tokenizer, "um is 5."))  # spells the same text, other ids
    assert generated != tuple(_ids(tokenizer, answer)) and tokenizer.decode(generated) == answer
    memory.remember(("ns",), answer, generated, "out:solver")
    messages = [{"role": "system", "content": "You check."}, {"role": "user", "content": "Task: 2 + 3."},
                {"role": "assistant", "content": answer}]
    spec = ChatKVShare(agent="checker", shared=({"message": 1, "slot": "task"}, {"message": 2, "slot": "out:solver"}))
    plan = chat_hooks._explicit_plan(spec, messages, render, tokenize, _stock(tokenizer, messages), ("ns",), None)
    seg = [s for s in plan.annotation.segments if s.slot == "out:solver"][0]
    assert tuple(plan.input_ids[seg.start:seg.end]) == generated and not plan.same_as_stock
    assert plan.messages[1].source == "output" and plan.messages[1].retokenized_equal is False
    # Another namespace does not see the answer: its own re-tokenization, identical to stock.
    plan = chat_hooks._explicit_plan(spec, messages, render, tokenize, _stock(tokenizer, messages), ("other",),
                                     None)
    assert plan.same_as_stock and plan.messages[1].source == "content"


def test_auto_plan_never_changes_the_prompt(tokenizer, monkeypatch):
    from sglang_kvshare.chat import hooks as chat_hooks

    render, tokenize = _fns(tokenizer)
    memory = OutputMemory()
    monkeypatch.setattr(chat_hooks, "outputs", memory)
    answer = "The sum is 5."
    memory.remember(("ns",), answer, tuple(_ids(tokenizer, "The s") + _ids(tokenizer, "um is 5.")), AUTO_SLOT)
    for last in ("Is it right?", "\n\nIs it right?"):  # the second starts with a whitespace run
        messages = [{"role": "system", "content": "You grade."}, {"role": "user", "content": "Task: 2 + 3."},
                    {"role": "assistant", "content": answer}, {"role": "user", "content": last}]
        plan = chat_hooks._auto_plan(messages, render, tokenize, _stock(tokenizer, messages), ("ns",), None)
        assert plan.same_as_stock and plan.input_ids == _stock(tokenizer, messages)
        by_index = {m.index: m for m in plan.messages}
        assert by_index[2].source == "output" and by_index[2].retokenized_equal is False  # not reused as output
        if 3 in by_index:  # the user's last message is offered to later requests, never reused by this one
            last = [s for s in plan.annotation.segments if s.kind == "shared"][-1]
            assert not last.reuse
        assert all(s.slot in (AUTO_SLOT, GLUE_SLOT) for s in plan.annotation.segments if s.kind == "shared")


def test_auto_plan_prefills_a_users_last_message_and_the_generation_prompt(tokenizer):
    from sglang_kvshare.chat import hooks as chat_hooks

    render, tokenize = _fns(tokenizer)
    question = "What did the planner propose?"
    messages = [{"role": "system", "content": "You grade."}, {"role": "user", "content": "Task: 2 + 3."},
                {"role": "assistant", "content": "Plan: add them."}, {"role": "user", "content": question}]
    plan = chat_hooks._auto_plan(messages, render, tokenize, _stock(tokenizer, messages), ("ns",), "alice")
    *_, asked, tail = plan.annotation.segments
    assert asked.kind == "shared" and not asked.reuse  # prefilled here, offered to the requests after it
    assert plan.input_ids[asked.start:asked.end] == _ids(tokenizer, question)
    assert tail.kind == "private"  # the generation prompt: the cache always prefills a last private segment
    assert tokenizer.decode(plan.input_ids[tail.start:tail.end]).endswith("<|im_start|>assistant\n")
    assert all(s.reuse for s in plan.annotation.segments[:-2])
    assert plan.annotation.workflow == "alice"  # the OpenAI user is the reuse scope


def test_auto_plan_keeps_a_long_chat_within_the_segment_limit(tokenizer, monkeypatch):
    """A 40-message tool loop: 81 segments uncapped; the oldest messages become private text instead of a 400."""
    from sglang_kvshare.chat import hooks as chat_hooks
    from sglang_kvshare.config import KVShareConfig

    monkeypatch.setattr(chat_hooks, "live_config", lambda: KVShareConfig(mode="fullshared", auto=True))
    render, tokenize = _fns(tokenizer)
    messages = [{"role": "system", "content": "You use tools."}]
    for i in range(40):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"Step {i}: result {i * 7}."})
    plan = chat_hooks._auto_plan(messages, render, tokenize, _stock(tokenizer, messages), ("ns",), None)
    assert plan.input_ids == _stock(tokenizer, messages)
    assert len(plan.annotation.segments) <= 64
    assert parse_annotation(plan.annotation.to_custom_params(), len(plan.input_ids), 64) == plan.annotation
    shared = {m.index for m in plan.messages if m.slot is not None}
    assert {39, 40} <= shared and 1 not in shared  # the newest messages stay shared, the oldest became private


def test_a_message_holding_the_sentinel_text_renders_like_any_other(tokenizer):
    render, tokenize = _fns(tokenizer)
    messages = [{"role": "system", "content": "You check."},
                {"role": "user", "content": "Look: \ue000kvshare-999\ue001 and \ue000kvshare-1\ue001 here."},
                {"role": "assistant", "content": "Seen."}]
    for cut in ({1, 2}, {2}, None):
        pieces = split_rendered(render, messages, cut)  # no IndexError, nothing mistaken for a cut
        assert "".join(p.text for p in pieces) == render(messages)
    prompt, same = align_to_stock(render_pieces(render, tokenize, messages, {2}), _stock(tokenizer, messages))
    assert same and 2 in prompt.content_messages()


def test_the_auto_agent_name_is_keyed():
    import hashlib
    import json

    messages = [{"role": "system", "content": "You plan."}, {"role": "user", "content": "Task"}]
    identity = [[m.get("role"), m.get("name"), m.get("content")] for m in messages if m["role"] == "system"]
    unkeyed = "auto-" + hashlib.blake2b(json.dumps([identity, None], sort_keys=True).encode(),
                                        digest_size=8).hexdigest()
    assert auto_agent(messages, None) != unkeyed  # a guessed system prompt cannot be confirmed offline
    assert auto_agent(messages, None, key=b"k" * 16) != auto_agent(messages, None, key=b"j" * 16)


def test_verify_false_travels_in_the_annotation_and_the_default_adds_nothing(tokenizer):
    """A replay opts out of the guard's samples with ``verify: false``; a request that says nothing sends the
    same custom params as before the field existed."""
    from sglang_kvshare.chat import hooks as chat_hooks
    from sglang_kvshare.chat.annotation import ChatKVShare

    raw = {"agent": "judge", "segments": [{"kind": "private", "start": 0, "end": 3},
                                          {"kind": "shared", "start": 3, "end": 9, "slot": "doc"}]}
    plain = parse_annotation({"kvshare": raw}, 9)
    assert plain.verify and "verify" not in plain.to_custom_params()["kvshare"]
    opted = parse_annotation({"kvshare": {**raw, "verify": False}}, 9)
    assert not opted.verify and parse_annotation(opted.to_custom_params(), 9) == opted
    with pytest.raises(AnnotationError, match="verify"):
        parse_annotation({"kvshare": {**raw, "verify": "sometimes"}}, 9)
    # The chat field carries it into the request's annotation.
    render, tokenize = _fns(tokenizer)
    messages = _chat("Plan: add them.")
    for verify in (True, False):
        spec = ChatKVShare(agent="checker", shared=({"message": 1, "slot": "task"},), verify=verify)
        plan = chat_hooks._explicit_plan(spec, messages, render, tokenize, _stock(tokenizer, messages), ("ns",),
                                         None)
        assert plan.annotation.verify is verify


def _reference_capped(prompt, slots, agent, output_slot, max_segments, **kwargs):
    """The cap's meaning, one message at a time: drop the oldest droppable shared message until it fits."""
    keep = dict(slots)
    order = [i for i in sorted(keep) if i not in kwargs.get("no_reuse", ())]
    while True:
        built = build_annotation(prompt, keep, agent, output_slot, **kwargs)
        if built is None or len(built[1].segments) <= max_segments or not order:
            return built, keep
        del keep[order.pop(0)]


def test_the_segment_cap_keeps_exactly_the_newest_messages_that_fit():
    """Against the drop-one-at-a-time meaning, on random chats: template pieces, contents (some with no ids,
    some adjacent), a BOS piece, a last message prefilled here, with and without a shared tail."""
    import random

    from sglang_kvshare.chat.annotation import build_capped
    from sglang_kvshare.chat.render import Piece, RenderedPrompt

    rng = random.Random(7)
    for _ in range(300):
        pieces, piece_ids, message = [], [], 0
        if rng.random() < 0.3:
            pieces.append(Piece(""))
            piece_ids.append((1,))
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.8:
                pieces.append(Piece("<hdr>"))
                piece_ids.append((2, 3))
            pieces.append(Piece(f"m{message}", message))
            piece_ids.append(tuple(range(10, 10 + rng.choice((0, 1, 3)))))
            message += 1
        if rng.random() < 0.7:
            pieces.append(Piece("<gen>"))
            piece_ids.append((4,))
        prompt = RenderedPrompt(tuple(pieces), tuple(piece_ids))
        slots = {i: AUTO_SLOT for i in range(message) if rng.random() < 0.8}
        kwargs = {"share_tail": rng.random() < 0.5, "workflow": None,
                  "no_reuse": frozenset({message - 1}) & frozenset(slots) if rng.random() < 0.5 else frozenset()}
        output_slot = rng.choice((None, AUTO_SLOT))
        max_segments = rng.randint(1, 20)
        assert (build_capped(prompt, slots, "a", output_slot, max_segments, **kwargs)
                == _reference_capped(prompt, slots, "a", output_slot, max_segments, **kwargs))


def test_the_auto_plan_of_a_long_chat_costs_about_what_stock_spends(tokenizer, monkeypatch):
    """A 2,000-message chat (``m<i>``): one batched tokenizer call, two renderings, and at most the issue's
    bound of 2x stock's render + encode plus 1 s (about 2x plus 50 ms is what ``tests.chat.plan_timing``
    measures). Rebuilding the annotation per dropped message took a minute here. Timed in this process's CPU
    seconds, not wall seconds: the suite runs it while servers start beside it, and waiting for a core is not cost."""
    import time

    from sglang_kvshare.chat import hooks as chat_hooks
    from sglang_kvshare.config import KVShareConfig
    from tests.chat.plan_timing import long_chat

    monkeypatch.setattr(chat_hooks, "live_config", lambda: KVShareConfig(mode="fullshared", auto=True))
    monkeypatch.setattr(chat_hooks, "outputs", OutputMemory())
    render, tokenize = _fns(tokenizer)
    calls = {"render": 0, "tokenize": 0, "texts": 0}

    def counted_render(messages):
        calls["render"] += 1
        return render(messages)

    def counted_tokenize(texts):
        calls["tokenize"] += 1
        calls["texts"] += len(texts)
        return tokenize(texts)

    messages = long_chat(2000)
    t0 = time.process_time()
    stock = _ids(tokenizer, render(messages))
    stock_s = time.process_time() - t0
    t0 = time.process_time()
    plan = chat_hooks._auto_plan(messages, counted_render, counted_tokenize, stock, ("ns",), None)
    plan_s = time.process_time() - t0
    assert plan.input_ids == stock and len(plan.annotation.segments) <= 64
    assert calls["render"] == 2 and calls["tokenize"] == 1 and calls["texts"] <= len(messages) + 10
    assert plan_s <= 2 * stock_s + 1.0, (plan_s, stock_s)
    # A newest message that merges with its role header: its boundaries are probed, all in one more call.
    messages[-2]["content"] = "\n\nTwo newlines first"
    stock = _ids(tokenizer, render(messages))
    calls.update(render=0, tokenize=0)
    plan = chat_hooks._auto_plan(messages, counted_render, counted_tokenize, stock, ("ns",), None)
    assert plan.input_ids == stock and calls["render"] == 4 and calls["tokenize"] == 3
    shared = {m.index for m in plan.messages if m.slot is not None}
    assert len(messages) - 2 not in shared and len(messages) - 3 in shared
