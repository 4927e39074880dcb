"""The request annotation protocol: which agent speaks and where its segments lie.

A request declares its agent and segments in ``sampling_params.custom_params``
under the key ``"kvshare"``, as a JSON string (SGLang requires custom params to
be flat JSON values; a dict is accepted too)::

    {"sampling_params": {"custom_params": {"kvshare": json.dumps({
        "agent": "solver",
        "segments": [
            {"kind": "private", "start": 0,   "end": 37},
            {"kind": "shared",  "start": 37,  "end": 420, "slot": "query"},
            {"kind": "private", "start": 420, "end": 431}],
        "output_slot": "out:solver"})}}}

* ``start``/``end`` are token offsets into the request's ``input_ids``
  (end exclusive). Segments are in order, contiguous, and cover the whole
  prompt: ``0 = s0.start < s0.end = s1.start < ... < sN.end = len(input_ids)``.
* ``private`` (PF in the papers): text only this agent puts there (its system
  prompt, glue, its question). ``shared`` (PH): text many agents see (a
  question, retrieved passages, another agent's answer), with a ``slot`` name
  that says what role the text plays (``query``, ``out:analyst``). One slot
  holds different content on every request; the server learns per slot.
* ``workflow`` (optional): the reuse scope (one multi-agent workflow, or one
  user). Approximate KV crosses only between requests of the same workflow,
  ``cache_salt`` and LoRA adapter; requests that name none share the anonymous
  scope, as they share SGLang's exact prefix cache. (An operator may widen the
  scope to the whole ``cache_salt`` with ``--kvshare-reuse-scope salt``.)
* ``recompute_head`` (optional): at least this many first tokens of every
  reused segment are prefilled in the request's own context (the server's share,
  ``--kvshare-recompute-ratio``, applies when it gives more rows).
* ``reuse`` (optional, shared segments, default true): false means this
  request prefills the segment in its own context; its copy still serves later
  requests (what the automatic chat mode does for a last message it did not generate).
* ``output_slot`` (optional): the slot under which this request's own generated
  tokens are shared with later agents. A consumer that puts the same output ids
  in a shared segment of that slot reuses the producer's KV (the producer's
  copy covers every output token whose KV was computed, i.e. all but the last).
* A request without the key is served exactly as stock SGLang serves it.

Violations raise ``AnnotationError``; the HTTP server turns it into a 400 with
the message, and nothing else changes. This module has no SGLang imports: the
frontend uses it to build annotations and the server to check them.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CUSTOM_PARAMS_KEY = "kvshare"
# The radix tree's estimate namespace: a client's extra_key may not start with it (400).
RESERVED_EXTRA_KEY_PREFIX = "kvshare-est:"
MAX_NAME_CHARS = 128
# The longest recomputed head a request may ask for; the guard's pins and its file are held to the same bound, so
# no setting it applies can make a request fail validation.
MAX_RECOMPUTE_HEAD = 65536
DEFAULT_MAX_SEGMENTS = 64


class AnnotationError(ValueError):
    """A malformed kvshare annotation; the message says what to fix."""


class Segment(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["private", "shared"]
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    slot: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    reuse: bool = True
    """False on a shared segment: this request prefills it in its own context, and its copy still serves
    later requests (the automatic chat mode marks a last message it did not generate so)."""

    @model_validator(mode="after")
    def _check(self) -> "Segment":
        if self.end <= self.start:
            raise ValueError(f"segment [{self.start}, {self.end}) is empty or reversed")
        if self.kind == "shared" and self.slot is None:
            raise ValueError("a shared segment needs a slot name")
        if self.kind == "private" and self.slot is not None:
            raise ValueError("a private segment takes no slot name")
        if self.kind == "private" and not self.reuse:
            raise ValueError("reuse applies to shared segments only (a private segment's last copy is the agent's own)")
        return self

    @property
    def length(self) -> int:
        return self.end - self.start


class Annotation(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    agent: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    segments: tuple[Segment, ...] = Field(min_length=1)
    output_slot: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    """Slot under which this request's generated tokens become shared input of later
    agents (e.g. ``out:solver``): the consumer that passes the same output ids in a
    shared segment of that slot can reuse the producer's KV."""
    recompute_head: Optional[int] = Field(default=None, ge=0, le=MAX_RECOMPUTE_HEAD)
    """Prefill at least this many first tokens of every reused segment in the request's own context (the
    server's ``--kvshare-recompute-ratio`` share when it gives more): a request may ask for more fidelity, never less. The
    fidelity guard sets it for the scopes it tightens."""
    workflow: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    """The reuse scope this request belongs to (one multi-agent workflow, or one user):
    approximate KV is reused only between requests of the same workflow (and the same
    ``cache_salt`` and LoRA). Requests that name none share the anonymous scope."""
    verify: bool = True
    """False keeps this request out of the fidelity guard's samples: it is still served under its scope's
    setting, but never judged. For evaluation and replay traffic (teacher-forced scoring, warm-ups) whose
    answers are not the agent's own, and which would otherwise count as evidence about the scope."""

    def to_custom_params(self) -> dict[str, str]:
        return {CUSTOM_PARAMS_KEY: self.model_dump_json(exclude_none=True, exclude_defaults=True)}


def _first_error(exc: ValidationError) -> str:
    errs = exc.errors()
    parts = []
    for e in errs[:3]:
        loc = ".".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts)


def parse_annotation(custom_params: Any, num_tokens: int,
                     max_segments: int = DEFAULT_MAX_SEGMENTS) -> Optional[Annotation]:
    """The request's annotation, or None when it carries none.

    Raises ``AnnotationError`` when the annotation is present but malformed or
    does not match ``num_tokens`` (the length of the request's input_ids).
    """
    if not isinstance(custom_params, dict) or CUSTOM_PARAMS_KEY not in custom_params:
        return None
    raw = custom_params[CUSTOM_PARAMS_KEY]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise AnnotationError(f"kvshare annotation is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AnnotationError("kvshare annotation must be a JSON object with 'agent' and 'segments'")
    segments = raw.get("segments")
    if isinstance(segments, list) and len(segments) > max_segments:
        raise AnnotationError(f"kvshare annotation declares {len(segments)} segments; at most {max_segments} allowed")
    try:
        ann = Annotation.model_validate(raw)
    except ValidationError as exc:
        raise AnnotationError(f"malformed kvshare annotation: {_first_error(exc)}") from None
    expected = 0
    for i, seg in enumerate(ann.segments):
        if seg.start != expected:
            what = "overlaps the previous one" if seg.start < expected else "leaves a gap after the previous one"
            raise AnnotationError(f"kvshare segment {i} starts at {seg.start} and {what} (expected start {expected})")
        expected = seg.end
    if expected != num_tokens:
        raise AnnotationError(
            f"kvshare segments cover [0, {expected}) but the request has {num_tokens} input tokens; "
            "segments must cover the whole prompt")
    return ann


def check_extra_key(extra_key: Any) -> None:
    """Raise ``AnnotationError`` for an ``extra_key`` inside the estimate namespace kvshare reserves.

    Why: SGLang keys the radix tree by ``extra_key``; a request that chose a
    reserved one could match KV kvshare assembled for other requests, which a
    request without an annotation must never see.
    """
    if isinstance(extra_key, str) and extra_key.startswith(RESERVED_EXTRA_KEY_PREFIX):
        raise AnnotationError(f"extra_key may not start with {RESERVED_EXTRA_KEY_PREFIX!r}: kvshare reserves "
                              "that prefix for the radix tree's estimate namespace; choose another extra_key")


def generated_ids_for_text(tokenizer: Any, text: str, output_ids: Optional[Sequence[int]]) -> Optional[tuple[int, ...]]:
    """The generated ids that spell exactly ``text`` (trailing EOS / stop tokens dropped), or None.

    The server returns ``text`` without special tokens and without a matched
    stop string, while ``output_ids`` may still end with them.
    """
    if not text or not output_ids:
        return None
    ids = [int(t) for t in output_ids]
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    while ids and ids[-1] in special:
        ids.pop()
    for _ in range(4):  # a stop string may trail the returned text
        if not ids:
            return None
        # NOTE: decode with special tokens kept, so the ids never carry a token the text lacks.
        if tokenizer.decode(ids, skip_special_tokens=False) == text:
            return tuple(ids)
        ids.pop()
    return None
