"""The first step of a request's path: its plan, built once from the annotation and kept on the request.

Why on the request (``req.kvshare_plan``) and not in a table keyed by ``rid``:
a request aborted while it waits never reaches ``on_release``, and clients
choose their own ``rid``s, so a table outlives its requests and hands one
request's plan to the next that reuses the name. On the request, the state
dies with it and a new request always starts clean.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sglang_kvshare.cache.outcome import SegmentOutcome
from sglang_kvshare.cache.registry import ContentHasher, Namespace
from sglang_kvshare.cache.tree_paths import TreeNamespace, est_extra_key
from sglang_kvshare.counters import Counters
from sglang_kvshare.protocol import CUSTOM_PARAMS_KEY, Annotation, AnnotationError, parse_annotation

logger = logging.getLogger(__name__)

PLAN_ATTR = "kvshare_plan"
UNSALTED_ATTR = "kvshare_unsalted"  # counted once as served plain (a waiting request is matched every round)


@dataclass
class RequestState:
    """What changes while one annotated request runs, from its first match to its release.

    ``est_start`` is the first prompt position whose KV is an estimate (assembled),
    or None while the request holds exact KV only. Everything from there on,
    including what the model computes on top of it, is kept in the tree's
    estimate namespace and never counts as exact. ``outcomes``: how each
    segment is served (the report's segments).
    """

    outcomes: list[SegmentOutcome]
    exact_len: int = 0  # prompt tokens the latest match found exactly in the tree (SGLang's cached_tokens)
    estimate_len: int = 0  # prompt tokens it found in the estimate namespace (an earlier request's assembly)
    assembled_end: int = 0  # prefix length after assembly
    est_start: Optional[int] = None
    next_stage: Optional[int] = None  # where staged prefill resumes reuse (None: prefill the rest)
    learned: set[int] = field(default_factory=set)
    counted: bool = False
    attempted: bool = False  # assembly ran once; a repeat only re-runs if its nodes were evicted
    released: bool = False  # its KV was released unfinished (retraction): the next match plans afresh
    in_workflow: bool = False  # counted among its workflow's requests in flight (``retention.Retention``)
    assembly_seconds: float = 0.0
    # The sparse extend (``server.sparse_extend``): positions of assembled rows the next prefill forward
    # recomputes, the registry they are owed in, and what the forwards did.
    sparse_rows: list[int] = field(default_factory=list)
    adopted: int = 0  # of those, rows of the estimate match another request still owed (not an estimate hit)
    owed: Optional[Any] = None  # recompute.PendingRecompute of the cache
    sparse_recomputed: int = 0  # rows recomputed inside prefill forwards
    prefill_forwards: int = 0  # prefill forwards the request took (chunks, stages)
    recompute_via: Optional[str] = None  # sparse | staged: how its heads were recomputed (None: no head)
    sparse_fallback: Optional[str] = None  # why the heads were staged although the sparse extend is on

    def exact_before(self, end: int) -> bool:
        """True when rows ``[0, end)`` of this request hold exact KV only."""
        return self.est_start is None or end <= self.est_start


@dataclass(frozen=True)
class RequestPlan:
    """What planning decided for one annotated request: frozen, read by every step.

    Everything that changes while the request runs is its ``state``
    (``RequestState``), one object the steps share.
    """

    annotation: Annotation
    tokens: tuple[int, ...]
    hashes: tuple[str, ...]
    namespace: Namespace  # (extra_key, cache_salt, reuse scope): the copy records and pools it may use
    tree_ns: TreeNamespace  # where its rows live in the radix tree
    agent_id: str
    state: RequestState

    @property
    def agent(self) -> str:
        return self.annotation.agent

    @property
    def workflow(self) -> Optional[str]:
        """Who the request belongs to (its annotation's workflow); reports name only this workflow's agents."""
        return self.annotation.workflow

    def may_approximate_from(self, row: int) -> bool:
        """True when an estimate may start at prompt row ``row``: inside a shared segment this request lets
        reuse serve.

        Why: an earlier request with the same tokens may have left estimates at that row, and matching them
        serves what assembling would have served, but only if this request would assemble there too. Rows of
        the agent's own text, and a shared segment marked ``reuse: false`` (the guard's dense setting, the
        automatic chat mode's last message when nobody generated it here), are prefilled in the request's own
        context; an estimate that starts there would hand approximate KV to rows the request asked to have
        exact, even when no segment of it is reused at all. (Behind the first row it approximates, everything a request computes rests
        on approximate KV, so only where estimates start is checked.) Which rows of a reused segment are
        recomputed is the request's recompute rule, part of the estimate key (``plan_request``'s ``setting``):
        the estimates it can match were made under the same rule.
        """
        return any(s.kind == "shared" and s.reuse and s.start <= row < s.end for s in self.annotation.segments)


def plan_of(req: Any) -> Optional[RequestPlan]:
    return getattr(req, PLAN_ATTR, None)


def drop_plan(req: Any) -> None:
    """Forget the request's plan: its next match plans afresh."""
    if hasattr(req, PLAN_ATTR):
        delattr(req, PLAN_ATTR)


def plan_request(req: Any, hasher: ContentHasher, max_segments: int, counters: Counters, *,
                 reuse_scope: str = "workflow", epoch: int = 0,
                 setting: Callable[[Annotation], str] = lambda ann: "") -> Optional[RequestPlan]:
    """The request's plan (made once, then kept on the request), or None for a request served without one.

    ``reuse_scope`` (``--kvshare-reuse-scope``): with ``workflow`` the
    annotation's ``workflow`` is part of the namespace; with ``salt-required``
    a request without a ``cache_salt`` gets no plan, so it is served exactly as
    an unannotated request (exact prefix only) and nothing it computes is
    recorded for another request. ``epoch`` names the estimates valid under the
    settings in force (``CorrectionState.epoch``); ``setting(annotation)`` the
    request's recompute rule (``recompute.RecomputeRule.key``): both are part of the
    estimate namespace's key. A malformed annotation reaching the scheduler (the
    HTTP process answers it with a 400; the Engine API does not check) is
    logged, counted and served as no annotation at all.
    """
    plan = plan_of(req)
    if plan is not None:
        return plan
    custom = getattr(req.sampling_params, "custom_params", None)
    if reuse_scope == "salt-required" and not getattr(req, "cache_salt", None):
        if isinstance(custom, dict) and CUSTOM_PARAMS_KEY in custom and not getattr(req, UNSALTED_ATTR, False):
            setattr(req, UNSALTED_ATTR, True)
            counters.add("unsalted_served_plain")
        return None
    tokens = tuple(int(t) for t in req.origin_input_ids)
    try:
        ann = parse_annotation(custom, len(tokens), max_segments)
    except AnnotationError as exc:
        logger.warning("sglang-kvshare: ignoring a malformed annotation: %s", exc)
        counters.add("malformed_annotations")
        return None
    if ann is None:
        return None
    extra_key, salt = req.extra_key, getattr(req, "cache_salt", None)
    scope = ann.workflow if reuse_scope == "workflow" else None
    namespace = (extra_key, salt, scope)
    scope_digest = hasher((), "scope", scope)[:16] if scope is not None else "-"
    first = ann.segments[0]
    own_prefix = tokens[first.start:first.end] if first.kind == "private" else ()
    plan = RequestPlan(
        annotation=ann, tokens=tokens, namespace=namespace,
        tree_ns=TreeNamespace(extra_key, salt, est_extra_key(extra_key, scope_digest, epoch, setting(ann))),
        # NOTE: an agent is its name *and* its private prefix, so a client that
        # borrows a name cannot feed corrections into another agent's edges.
        agent_id=hasher(own_prefix, "agent", namespace, ann.agent),
        hashes=tuple(hasher(tokens[s.start:s.end]) for s in ann.segments),
        state=RequestState([SegmentOutcome(i, s.kind, s.slot, s.length) for i, s in enumerate(ann.segments)]),
    )
    setattr(req, PLAN_ATTR, plan)
    return plan
