"""kvshare on ``/v1/chat/completions`` (HTTP process): the hook functions.

``server/sglang_targets.py`` names their targets and ``server/plugin.py``
installs them. Why these hooks (all on ``OpenAIServingChat`` unless named):

* AROUND ``handle_request`` (async): reads the ``kvshare`` field from the raw
  JSON body (SGLang's pydantic request drops unknown fields), validates it and
  answers a malformed one with a 400 *before* anything is converted or
  queued, so nothing else changes. In automatic mode it marks every request.
* AROUND ``_render_and_encode_chat_template``: records exactly the messages,
  tools and template options SGLang renders, and the ids it encodes, so our
  piece-wise rendering starts from the same input and can be compared with it.
* AROUND ``_convert_to_internal_request`` (runs on an executor thread): after
  SGLang built its ``GenerateReqInput``, replaces its ids with the piece-wise
  rendering and adds the annotation to ``sampling_params.custom_params``, the
  same thing an annotated ``/generate`` carries. A ``ValueError`` there is
  SGLang's own path to a 400.
* AROUND ``_handle_non_streaming_request`` / ``_handle_streaming_request``:
  warm the agent's private prefix once (a ``max_new_tokens=0`` request, as the
  frontend does: the cache places shared segments only behind a prefix it
  holds), then add the report to the response (top-level ``kvshare``; for a
  stream, its final chunk) and remember the answer's generated ids (``chat.outputs``).
* The outputs of our requests (report, output ids, text) are read as they pass
  by ``_Track.observe``, called from the one ``generate_request`` hook
  (``server/outputs.py``).

What is never changed: requests without the field when ``--kvshare-auto`` is
off; ``lora_path``, ``extra_key`` and ``cache_salt`` (passed through, also to the
warm-up request, so the cache keeps its namespaces); requests whose template or
options this module cannot reproduce (automatic mode serves them as stock;
explicit mode answers 400 saying why); requests whose prompt reaches the
context length (both modes: stock answers them, unplanned, with its own error).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_kvshare.chat.annotation import (
    AUTO_SLOT, REQUEST_KEY, ChatKVShare, ChatPlan, MessageOutcome, auto_agent, auto_candidates,
    auto_slot, build_annotation, build_capped, parse_chat_kvshare)
from sglang_kvshare.chat.outputs import OutputMemory
from sglang_kvshare.chat.render import (
    Render, TemplateSplitError, Tokenize, align_to_stock, render_pieces, safe_messages)
from sglang_kvshare.config import live_config
from sglang_kvshare import routing
from sglang_kvshare.protocol import CUSTOM_PARAMS_KEY, AnnotationError, generated_ids_for_text

logger = logging.getLogger(__name__)

STATS_ROUTE = "/kvshare/chat"
MAX_WARMED = 4096

_local = threading.local()
_pending: dict[int, "_Pending"] = {}  # id(ChatCompletionRequest) -> pending, during handle_request
_tracks: dict[int, "_Track"] = {}  # id(GenerateReqInput) -> track, from conversion to response
_warmed: "OrderedDict[tuple, None]" = OrderedDict()
outputs = OutputMemory()
counters: dict[str, int] = {"explicit": 0, "auto": 0, "auto_stock": 0, "same_as_stock": 0, "warmups": 0,
                            "opted_out": 0, "over_context": 0, "internal_errors": 0}


@dataclass
class _Pending:
    spec: Optional[ChatKVShare]  # None: automatic mode
    adapted_id: Optional[int] = None
    routed_workflow: Optional[str] = None  # the router's key: the workflow of a request that names none


@dataclass
class _Capture:
    """What SGLang rendered (set by the render hook on the converting thread)."""

    messages: Optional[list] = None
    kwargs: dict = field(default_factory=dict)
    stock_ids: Optional[list[int]] = None
    over_context: bool = False  # the prompt reaches the context length: nothing else is recorded


@dataclass
class _Track:
    """What the answer of one annotated chat request carried, gathered as its outputs pass.

    Each output costs time proportional to what it adds, never to the whole
    answer: a cumulative output (SGLang's default) replaces the kept
    reference; a delta (incremental streaming) is appended. The ids and text
    are joined once, when the answer is finished (``output_ids``, ``text``).
    """

    plan: ChatPlan
    namespace: tuple
    explicit: bool
    report: Optional[dict] = None
    finished: bool = False
    warmed: bool = False
    _ids: list = field(default_factory=list)  # cumulative: [the latest list]; incremental: the deltas
    _texts: list = field(default_factory=list)

    def observe(self, out: dict, incremental: bool) -> None:
        meta = out.get("meta_info") or {}
        reports = meta.get("kvshare")
        if reports:
            self.report = reports[0]
        for parts, value in ((self._ids, out.get("output_ids")), (self._texts, out.get("text"))):
            if value is not None:
                if incremental:
                    parts.append(value)  # a delta
                else:
                    parts[:] = [value]  # everything so far: keep the reference, copy nothing
        if meta.get("finish_reason") is not None:
            self.finished = True

    @property
    def output_ids(self) -> list[int]:
        return [int(t) for part in self._ids for t in part]

    @property
    def text(self) -> str:
        return "".join(self._texts)

    def kvshare_report(self) -> dict:
        return {**(self.report or {}), "chat": {**self.plan.report(), "warmed": self.warmed}}


# ---------------------------------------------------------------- request side

async def around_handle_request(original, self, request, raw_request=None):
    """Validate the ``kvshare`` field (400 on error) and mark the request for conversion."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    if not isinstance(request, ChatCompletionRequest):
        return await original(self, request, raw_request)
    raw = None
    if raw_request is not None:
        try:
            raw = routing.chat_field(await raw_request.json())  # the field, or where the router keeps it
        except Exception:  # noqa: BLE001 - SGLang already parsed this body; nothing to add
            raw = None
    if raw is False:  # the client opted out: served exactly as stock SGLang serves it
        counters["opted_out"] += 1
        return await original(self, request, raw_request)
    if raw is None and not live_config().auto:
        return await original(self, request, raw_request)
    spec = None
    if raw is not None:
        try:
            spec = parse_chat_kvshare(raw, len(request.messages), live_config().max_segments)
        except AnnotationError as exc:
            return self.create_error_response(str(exc), err_type="BadRequest", status_code=400)
    pending = _Pending(spec, routed_workflow=routing.routing_key(raw_request))
    _pending[id(request)] = pending
    try:
        return await original(self, request, raw_request)
    finally:
        _pending.pop(id(request), None)
        if pending.adapted_id is not None:
            _tracks.pop(pending.adapted_id, None)


def around_render(original, self, messages, *args, **kwargs):
    """Record what SGLang renders for a marked request (same thread as the conversion)."""
    result = original(self, messages, *args, **kwargs)
    capture = getattr(_local, "capture", None)
    if capture is not None:
        capture.stock_ids = [int(t) for t in result[0]]
        capture.over_context = _over_context(self.tokenizer_manager, capture.stock_ids)
        if not capture.over_context:  # a copy of a long chat alone costs what stock's rendering costs
            capture.messages = copy.deepcopy(messages)
            capture.kwargs = dict(kwargs)
    return result


def around_convert(original, self, request, raw_request=None):
    """Replace a marked request's ids by the piece-wise rendering and annotate it."""
    pending = _pending.get(id(request))
    if pending is None:
        return original(self, request, raw_request)
    capture = _Capture()
    _local.capture = capture
    try:
        adapted, processed = original(self, request, raw_request)
    finally:
        _local.capture = None
    plan = _plan(self, request, adapted, capture, pending.spec, pending.routed_workflow)
    if plan is not None:
        adapted.input_ids = plan.input_ids
        adapted.text = None
        sampling = adapted.sampling_params if isinstance(adapted.sampling_params, dict) else {}
        sampling["custom_params"] = {**(sampling.get("custom_params") or {}),
                                     **plan.annotation.to_custom_params()}
        adapted.sampling_params = sampling
        pending.adapted_id = id(adapted)
        _tracks[id(adapted)] = _Track(plan, _namespace(adapted, plan.annotation.workflow),
                                      explicit=pending.spec is not None)
        counters[plan.mode] += 1
        counters["same_as_stock"] += int(plan.same_as_stock)
    return adapted, processed


def _namespace(adapted, workflow: Optional[str]) -> Optional[tuple]:
    """Where the chat layer keeps a request's answers and warm-ups: its cache namespace and reuse scope; None
    for a request that shares nothing (``--kvshare-reuse-scope salt-required`` and no ``cache_salt``)."""
    reuse_scope = live_config().reuse_scope
    if reuse_scope == "salt-required" and not getattr(adapted, "cache_salt", None):
        return None
    scope = workflow if reuse_scope == "workflow" else None
    return tuple(json.dumps(getattr(adapted, name, None), sort_keys=True, default=str)
                 for name in ("cache_salt", "extra_key", "lora_path")) + (scope,)


def _refuse(spec: Optional[ChatKVShare], why: str) -> None:
    """Explicit mode: a 400 that says why; automatic mode: serve the request as stock SGLang does."""
    if spec is not None:
        raise ValueError(f"kvshare cannot annotate this request: {why}")
    counters["auto_stock"] += 1
    return None


def _plan(serving, request, adapted, capture: _Capture, spec: Optional[ChatKVShare],
          routed_workflow: Optional[str] = None) -> Optional[ChatPlan]:
    """The request's plan, or None to serve it as stock SGLang does.

    Explicit mode answers what it cannot honour with a 400 that says why (a
    ``ValueError``); automatic mode never changes what stock would answer. An
    unexpected error serves the request as stock in both modes (logged, counted).
    """
    try:
        return _plan_or_raise(serving, request, adapted, capture, spec, routed_workflow)
    except ValueError:
        if spec is not None:
            raise
        logger.exception("sglang-kvshare: automatic annotation failed; serving as stock")
    except Exception:  # noqa: BLE001 - never a 500 because of kvshare
        logger.exception("sglang-kvshare: chat annotation failed; serving as stock")
    counters["internal_errors"] += 1
    return None


def _plan_or_raise(serving, request, adapted, capture: _Capture, spec: Optional[ChatKVShare],
                   routed_workflow: Optional[str] = None) -> Optional[ChatPlan]:
    custom = (adapted.sampling_params or {}).get("custom_params") if isinstance(adapted.sampling_params, dict) else None
    if isinstance(custom, dict) and CUSTOM_PARAMS_KEY in custom:
        if spec is not None:
            raise ValueError("pass either the chat-level kvshare field or custom_params.kvshare (token spans), "
                             "not both")
        return None  # the client annotated token spans itself
    if capture.over_context:
        counters["over_context"] += 1
        return None  # stock answers it (its own context-length error, or its truncation), unplanned
    if (request.n or 1) != 1:
        return _refuse(spec, "it asks for n > 1 choices; send one request per choice")
    if capture.messages is None or capture.stock_ids is None:
        return _refuse(spec, "the prompt is not rendered by the model's Jinja chat template here (input_ids, "
                             "a conversation template or a custom encoder are in use)")
    if list(adapted.input_ids or ()) != capture.stock_ids or len(capture.messages) != len(request.messages):
        return _refuse(spec, "the rendered messages are changed after the template (continue_final_message "
                             "or reordered tool results)")
    render, tokenize = template_fns(serving.tokenizer_manager.tokenizer, capture.kwargs)
    messages = capture.messages
    user = getattr(request, "user", None) or None
    workflow = (spec.workflow if spec is not None else None) or user or routed_workflow
    namespace = _namespace(adapted, workflow)
    if namespace is None:
        return None  # served as stock: no answer of another request looked up, none of its own remembered
    try:
        if spec is not None:
            return _explicit_plan(spec, messages, render, tokenize, capture.stock_ids, namespace, workflow)
        return _auto_plan(messages, render, tokenize, capture.stock_ids, namespace, user, workflow)
    except TemplateSplitError as exc:
        return _refuse(spec, str(exc))


def template_fns(tokenizer, render_kwargs: dict) -> tuple[Render, Tokenize]:
    """``render`` and ``tokenize`` (``chat.render``) for SGLang's tokenizer and the options SGLang rendered with."""
    template_kwargs = dict(render_kwargs.get("template_kwargs") or {})

    def render(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, tools=render_kwargs.get("tools"),
                                             return_dict=False,
                                             add_generation_prompt=render_kwargs.get("add_generation_prompt", True),
                                             **template_kwargs)

    def tokenize(texts):
        batch = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)
        return [[int(t) for t in ids] for ids in batch["input_ids"]]

    return render, tokenize


def _over_context(tokenizer_manager, stock_ids: list[int]) -> bool:
    """The prompt reaches the context length: SGLang refuses it (or truncates it) whatever kvshare plans.

    Why check first: planning costs time on the HTTP process, and such a
    request must get stock's answer as fast as stock gives it.
    """
    context_len = getattr(tokenizer_manager, "context_len", None)
    reserved = getattr(tokenizer_manager, "num_reserved_tokens", 0) or 0
    return isinstance(context_len, int) and len(stock_ids) + reserved >= context_len


def _explicit_plan(spec, messages, render, tokenize, stock_ids, namespace, workflow: Optional[str]) -> ChatPlan:
    marked = {m.message: m.slot for m in spec.shared}
    prompt = render_pieces(render, tokenize, messages, cut=set(marked))
    missing = sorted(set(marked) - prompt.content_messages())
    if missing:
        raise ValueError(f"kvshare cannot share message {missing[0]}: its content must be non-empty text that "
                         "the chat template renders verbatim, once")
    prompt, same = align_to_stock(prompt, stock_ids)
    ids_for, outcomes = {}, []
    for piece, ids in zip(prompt.pieces, prompt.piece_ids):
        if piece.message is None or piece.message not in marked:
            continue
        slot = marked[piece.message]
        outcome = MessageOutcome(piece.message, messages[piece.message].get("role"), slot, len(ids))
        hit = outputs.lookup(namespace, piece.text, ids, slot=slot)
        if hit is not None:
            rec, equal = hit
            outcome.source, outcome.retokenized_equal = "output", equal
            if not equal:  # the answer's own ids: the KV computed while generating it matches them
                ids_for[piece.message] = rec.ids
                outcome.tokens = len(rec.ids)
                same = False
        outcomes.append(outcome)
    built = build_annotation(prompt, marked, spec.agent, spec.output_slot, ids_for, workflow=workflow)
    if built is None:
        raise ValueError("kvshare marks no message and sets no output_slot; mark a message in 'shared' or "
                         "drop the field")
    input_ids, annotation = built
    if not spec.verify:
        annotation = annotation.model_copy(update={"verify": False})
    return ChatPlan(input_ids, annotation, same, "explicit", outcomes)


def _auto_plan(messages, render, tokenize, stock_ids, namespace, user: Optional[str],
               workflow: Optional[str] = None) -> Optional[ChatPlan]:
    # Cut at every candidate; only when the ids then differ from stock's, cut only where the tokenizer cuts
    # anyway (a content that starts with a whitespace run merges with its role header's newline).
    cut_all = render_pieces(render, tokenize, messages, cut=auto_candidates(messages))
    prompt, same = align_to_stock(cut_all, stock_ids)
    if not same:
        safe = safe_messages(tokenize, cut_all.pieces)
        if safe != cut_all.content_messages():
            prompt, same = align_to_stock(render_pieces(render, tokenize, messages, cut=safe), stock_ids)
    if not same:  # never change what the model reads without being asked to
        return _refuse(None, "piece-wise ids differ from the stock encoding")
    slots, outcomes = {}, []
    for piece, ids in zip(prompt.pieces, prompt.piece_ids):
        if piece.message is None:
            continue
        role = messages[piece.message].get("role") or "user"
        slot = auto_slot(role)
        outcome = MessageOutcome(piece.message, role, slot, len(ids))
        hit = outputs.lookup(namespace, piece.text, ids)
        if hit is not None:
            rec, equal = hit
            outcome.source, outcome.retokenized_equal = "output", equal
            if equal:
                slot = outcome.slot = rec.slot
        slots[piece.message] = slot
        outcomes.append(outcome)
    agent = auto_agent(messages, user)
    # The generation prompt stays private; a long chat keeps its newest shared messages within the segment limit.
    built, kept = build_capped(prompt, slots, agent, AUTO_SLOT, live_config().max_segments, share_tail=False,
                               workflow=workflow or user, no_reuse=_prefilled_last(outcomes, len(messages) - 1))
    for outcome in outcomes:
        if outcome.index not in kept:
            outcome.slot = None  # merged into the agent's private text
    if built is None:
        return None
    input_ids, annotation = built
    return ChatPlan(input_ids, annotation, same, "auto", outcomes)


def _prefilled_last(outcomes: list[MessageOutcome], last: int) -> frozenset[int]:
    """The last message when this request prefills it in its own context (``reuse: false``), else nothing.

    Why: a message nobody produced here (what the user just sent, a tool result) has no copy in the pool,
    and it is what the model reads right before answering; it is prefilled, and offered to the requests after
    it. An answer this server generated, whose text re-tokenizes to its generated ids (in a group chat the
    message just sent is usually the previous agent's answer), has its KV in the pool already: it is reused
    like any shared message, under the guard's scope and the cache's rules (``min_reuse_tokens``).
    """
    for outcome in outcomes:
        if outcome.index == last:
            generated = outcome.source == "output" and bool(outcome.retokenized_equal)
            return frozenset() if generated else frozenset({last})
    return frozenset()


# ---------------------------------------------------------------- serving side

async def _warm(serving, track: _Track, adapted) -> None:
    """Prefill the agent's private prefix once, so its shared segments can be placed behind it."""
    ids = track.plan.first_private_ids
    if not ids or live_config().mode == "off":
        return
    key = (track.namespace, hashlib.blake2b(json.dumps(ids).encode(), digest_size=16).hexdigest())
    if key in _warmed:
        _warmed.move_to_end(key)
        return
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=list(ids), sampling_params={"max_new_tokens": 0},
                           lora_path=adapted.lora_path, extra_key=adapted.extra_key, cache_salt=adapted.cache_salt)
    try:
        async for _ in serving.tokenizer_manager.generate_request(obj, None):
            pass
    except Exception as exc:  # noqa: BLE001 - a failed warm-up only costs reuse
        logger.warning("sglang-kvshare: warming an agent prefix failed: %s", exc)
        return
    track.warmed = True
    counters["warmups"] += 1
    _warmed[key] = None
    while len(_warmed) > MAX_WARMED:
        _warmed.popitem(last=False)


def _finish(serving, track: _Track) -> None:
    """After the answer: forget a lost warm-up, remember the answer's ids for later consumers."""
    segments = (track.report or {}).get("segments") or []
    if segments and segments[0].get("resolved_by") == "dense":
        ids = track.plan.first_private_ids
        if ids:
            key = (track.namespace, hashlib.blake2b(json.dumps(ids).encode(), digest_size=16).hexdigest())
            _warmed.pop(key, None)  # the tree lost the prefix: warm again next time
    slot = track.plan.annotation.output_slot
    if slot and track.finished and track.text:
        ids = generated_ids_for_text(serving.tokenizer_manager.tokenizer, track.text, track.output_ids)
        if ids is not None:
            outputs.remember(track.namespace, track.text, ids, slot)


async def _respond(original, serving, adapted, request, raw_request) -> tuple[Optional[_Track], Any]:
    """SGLang's response to ``adapted``, the agent's prefix warmed first when kvshare annotated it."""
    track = _tracks.get(id(adapted))
    if track is not None:
        await _warm(serving, track, adapted)
    return track, await original(serving, adapted, request, raw_request)


async def around_non_streaming(original, self, adapted, request, raw_request=None):
    track, response = await _respond(original, self, adapted, request, raw_request)
    if track is None:
        return response
    _finish(self, track)
    from fastapi.responses import Response
    from pydantic import BaseModel

    if not isinstance(response, BaseModel) or not hasattr(response, "choices"):
        return response  # an error response: unchanged
    # NOTE: serialized exactly as SGLang serializes it (sglang.srt.utils.json_response.model_json_response:
    # a -inf logprob becomes null), then the report is spliced in; the body is never parsed again.
    body = with_field(response.model_dump_json(by_alias=True), REQUEST_KEY, track.kvshare_report())
    return Response(content=body, media_type="application/json")


async def around_streaming(original, self, adapted, request, raw_request=None):
    track, response = await _respond(original, self, adapted, request, raw_request)
    if track is None:
        return response
    body = getattr(response, "body_iterator", None)
    if body is None:
        return response  # an error response: unchanged

    async def with_report():
        reported = False
        async for chunk in body:
            if not reported and _is_final_chunk(chunk):
                chunk, reported = _with_report_chunk(chunk, track.kvshare_report()), True
            elif not reported and isinstance(chunk, str) and chunk.startswith("data: [DONE]"):
                # No chunk carried a finish reason (the stream ended early): the report travels alone.
                extra = {"id": f"kvshare-{id(track):x}", "object": "chat.completion.chunk", "choices": [],
                         "created": int(time.time()), "model": request.model}
                yield f"data: {with_field(json.dumps(extra), REQUEST_KEY, track.kvshare_report())}\n\n"
                reported = True
            yield chunk
        _finish(self, track)

    response.body_iterator = with_report()
    return response


def with_field(json_object: str, key: str, value: Any) -> str:
    """``json_object`` (the text of a JSON object) with ``"key": value`` added last, the rest byte for byte.

    Non-finite floats in ``value`` become null, as SGLang writes them.
    """
    text = json_object.rstrip()
    if not text.endswith("}"):
        raise ValueError("not the text of a JSON object")
    head = text[:-1].rstrip()
    sep = "" if head.endswith("{") else ","
    return f"{head}{sep}{json.dumps(key)}:{json.dumps(_finite(value), separators=(',', ':'))}}}"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _chunk_payload(chunk: Any) -> Optional[str]:
    """The JSON text of a server-sent ``data: {...}`` chunk, else None."""
    if not isinstance(chunk, str) or not chunk.startswith("data: {"):
        return None
    return chunk[len("data: "):].rstrip("\n")


def _is_final_chunk(chunk: Any) -> bool:
    """A chunk whose choices carry a finish reason: the stream's last content chunk."""
    payload = _chunk_payload(chunk)
    if payload is None or '"finish_reason"' not in payload:
        return False
    try:
        choices = json.loads(payload).get("choices") or []
    except ValueError:
        return False
    return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def _with_report_chunk(chunk: str, report: dict) -> str:
    return f"data: {with_field(_chunk_payload(chunk), REQUEST_KEY, report)}\n\n"


def track_for(obj: Any) -> Optional[_Track]:
    """The chat layer's track of an internal request it annotated, else None."""
    return _tracks.get(id(obj))


def annotated(obj: Any) -> bool:
    """The request carries a kvshare annotation (a chat request kvshare annotated, or an annotated ``/generate``)."""
    sampling = getattr(obj, "sampling_params", None)
    custom = sampling.get("custom_params") if isinstance(sampling, dict) else None
    return isinstance(custom, dict) and CUSTOM_PARAMS_KEY in custom


def exact_cached_tokens(meta: dict) -> None:
    """Keep ``meta_info["cached_tokens"]`` SGLang's meaning: prompt tokens served from the prefix cache, exact.

    SGLang counts every prompt token it did not prefill, and the KV kvshare
    assembled (aligned, corrected, or an earlier request's estimate) is among
    them; those tokens are approximations, which the report lists apart
    (``tokens_aligned``, ``tokens_corrected``, ``tokens_estimate_hit``).
    Mutates ``meta``; the chat API's ``usage.prompt_tokens_details`` follows it.
    """
    reports = meta.get("kvshare")
    cached = meta.get("cached_tokens")
    if not reports or not isinstance(reports[0], dict) or not isinstance(cached, int):
        return
    report = reports[0]
    # Rows the sparse extend recomputed sat in SGLang's prefix too, but the forward computed them.
    approx = sum(int(report.get(k) or 0) for k in ("tokens_aligned", "tokens_corrected", "tokens_estimate_hit",
                                                    "tokens_sparse_recomputed"))
    meta["cached_tokens"] = max(0, cached - approx)


# ---------------------------------------------------------------- stats route

async def chat_stats():
    """``GET /kvshare/chat``: the chat layer's counters and the answers' re-tokenization agreement."""
    return {"auto": live_config().auto, "requests": dict(counters), "outputs": outputs.stats()}


def mount_stats_route(app: Any) -> None:
    """Add ``GET /kvshare/chat`` to SGLang's app (idempotent; ``server.http_routes`` calls it)."""
    if STATS_ROUTE not in {getattr(r, "path", None) for r in app.router.routes}:
        app.add_api_route(STATS_ROUTE, chat_stats, methods=["GET"], name="kvshare_chat_stats")
