"""How the chat layer decorates SGLang's answers: byte-faithful JSON, the report in a stream's final
chunk, SGLang's meaning of cached_tokens, output tracking that costs what a chunk adds (no server)."""

from __future__ import annotations

import json

from sglang.srt.entrypoints.openai.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice,
                                                     ChatCompletionTokenLogprob, ChatMessage, ChoiceLogprobs,
                                                     UsageInfo)
from sglang.srt.utils.json_response import model_json_response

from sglang_kvshare.chat import hooks


def _response() -> ChatCompletionResponse:
    token = ChatCompletionTokenLogprob(token="x", bytes=[120], logprob=float("-inf"), top_logprobs=[])
    choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="hi"),
                                          logprobs=ChoiceLogprobs(content=[token]), finish_reason="stop")
    return ChatCompletionResponse(id="c1", created=1, model="m", choices=[choice],
                                  usage=UsageInfo(prompt_tokens=3, total_tokens=4, completion_tokens=1))


def test_the_decorated_answer_is_stocks_bytes_plus_the_report():
    response = _response()
    stock = model_json_response(response).body.decode()  # what SGLang sends for this answer
    decorated = hooks.with_field(response.model_dump_json(by_alias=True), "kvshare", {"tokens_aligned": 2,
                                                                                   "entropy": float("nan")})
    body = json.loads(decorated)  # valid JSON: no -Infinity, no NaN
    assert body["choices"][0]["logprobs"]["content"][0]["logprob"] is None  # -inf -> null, as stock writes it
    assert body["kvshare"] == {"tokens_aligned": 2, "entropy": None}
    assert decorated.startswith(stock[:-1]) and json.loads(stock) == {k: v for k, v in body.items() if k != "kvshare"}


def test_the_report_rides_in_the_final_chunk_of_a_stream():
    content = 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    final = 'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    assert not hooks._is_final_chunk(content) and not hooks._is_final_chunk("data: [DONE]\n\n")
    assert hooks._is_final_chunk(final)
    chunk = hooks._with_report_chunk(final, {"tokens_aligned": 5})
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    payload = json.loads(chunk[len("data: "):])
    assert payload["kvshare"] == {"tokens_aligned": 5} and payload["choices"][0]["finish_reason"] == "stop"


def test_cached_tokens_keep_sglangs_meaning():
    meta = {"cached_tokens": 120, "kvshare": [{"tokens_exact_hit": 20, "tokens_aligned": 60, "tokens_corrected": 30,
                                               "tokens_estimate_hit": 10}]}
    hooks.exact_cached_tokens(meta)
    assert meta["cached_tokens"] == 20  # exact prefix-cache hits only; the approximations are in the report
    plain = {"cached_tokens": 7}
    hooks.exact_cached_tokens(plain)
    assert plain == {"cached_tokens": 7}


def test_output_tracking_keeps_references_not_copies():
    from sglang_kvshare.chat.annotation import ChatPlan
    from sglang_kvshare.protocol import Annotation, Segment

    plan = ChatPlan([1, 2], Annotation(agent="a", segments=(Segment(kind="private", start=0, end=2),)), True, "auto")
    cumulative = hooks._Track(plan, ("ns",), explicit=False)
    ids: list[int] = []
    for step in range(2000):  # a long cumulative stream: each chunk carries every id so far
        ids = ids + [step]
        cumulative.observe({"output_ids": ids, "text": "x" * (step + 1), "meta_info": {}}, incremental=False)
        assert len(cumulative._ids) == 1 and len(cumulative._texts) == 1  # one reference, not a growing copy
    cumulative.observe({"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"}}}, incremental=False)
    assert cumulative.finished and cumulative.output_ids == list(range(2000)) and len(cumulative.text) == 2000
    deltas = hooks._Track(plan, ("ns",), explicit=False)
    for step in range(3):
        deltas.observe({"output_ids": [step], "text": str(step), "meta_info": {}}, incremental=True)
    assert deltas.output_ids == [0, 1, 2] and deltas.text == "012"
