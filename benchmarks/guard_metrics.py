"""The pure parts of ``benchmarks.guard``: scoring the calibration, choosing min_samples on warm data, the best
global head, detection counts, the detection twin. No server, no I/O: tested in ``tests/benchmarks/test_guard_bench.py``.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import replace
from typing import Callable, Mapping, Optional, Sequence

from benchmarks import frontier as fr
from sglang_kvshare.frontend.builder import Piece
from sglang_kvshare.guard.estimate import Z95

APPROXIMATED = ("tokens_aligned", "tokens_corrected", "tokens_estimate_hit")
CONTROL = "~control"  # suffix of the detection twin's agents and slots
MIN_SAMPLES_FLOOR = 5  # fewer equal values give a zero-width interval: a scope could move on two requests


def approximated(report: Optional[Mapping]) -> int:
    """Tokens of a request served approximated KV (aligned, corrected, an estimate hit): what the guard verifies."""
    return sum(int((report or {}).get(k) or 0) for k in APPROXIMATED)


def pairs(rows: Optional[Sequence]) -> list:
    """SGLang's top-logprob rows ``[[logprob, id, text], ...]`` per position as ``[(logprob, id), ...]``."""
    return [[(e[0], e[1]) for e in pos if e is not None] if pos else [] for pos in (rows or [])]


def score_calibration(records: Sequence[Mapping], per_scope: Mapping[str, Mapping]) -> dict:
    """Per scope, the mean over every approximated request against the guard's estimate and its 95 % interval.

    ``records``: one per approximated request, ``{"scope", "top1", "kl", "verified"}`` (the benchmark's own dense
    replay; ``verified``: the request's report says the guard verified it). ``per_scope``: ``GET
    /kvshare/fidelity``'s. A scope is judged when the guard has at least two samples of it (below that its
    interval is the metric's whole range); ``within_ci`` is the share of judged scopes whose top-1 truth lies
    inside (None when none is judged).
    """
    by_scope: dict[str, list[Mapping]] = defaultdict(list)
    for r in records:
        by_scope[r["scope"]].append(r)
    rows = {}
    for scope in sorted(by_scope):
        rs, guard = by_scope[scope], per_scope.get(scope) or {}
        rows[scope] = {"n_all": len(rs), "n_flagged_verified": sum(1 for r in rs if r.get("verified")),
                       "setting": guard.get("setting"), "guard_samples": guard.get("samples", 0)}
        for metric in ("top1", "kl"):
            est = guard.get(metric) or {}
            truth = statistics.fmean(r[metric] for r in rs)
            ci, n = est.get("ci95"), est.get("n", 0)
            judged = n >= 2 and ci is not None and None not in ci
            rows[scope][metric] = {"true_mean": truth, "guard_n": n, "guard_mean": est.get("mean"), "ci95": ci,
                                   "inside": (ci[0] - 1e-12 <= truth <= ci[1] + 1e-12) if judged else None}
    judged = [r["top1"]["inside"] for r in rows.values() if r["top1"]["inside"] is not None]
    return {"within_ci": statistics.fmean(judged) if judged else None, "scopes_judged": len(judged),
            "scopes": len(rows), "per_scope": rows}


def choose_min_samples(warm: Mapping[str, Sequence[float]], bound: float, budget: int, *,
                       floor: int = MIN_SAMPLES_FLOOR, ceiling: int = 20) -> dict:
    """The controller's ``min_samples``, from warm per-request top-1 values per scope only.

    Why this rule: the interval's half-width after n requests is ``Z95 * sigma / sqrt(n)``, so the scope whose
    warm mean lies closest to ``bound`` (gap g, spread sigma) is resolved, either way, after
    ``ceil((Z95 * sigma / g) ** 2)`` requests; fewer leave it undecided, more only delay the controller. It is
    capped by ``budget`` (the verified requests per scope the controlled warm-up can supply: a larger minimum
    would keep the controller silent until the scored samples) and kept in ``[floor, ceiling]``.
    """
    stats = {s: (statistics.fmean(v), statistics.stdev(v)) for s, v in warm.items() if len(v) >= 2}
    if not stats:
        return {"chosen": ceiling, "why": "no warm scope with two values: the ceiling", "n_resolve": None,
                "budget": budget, "closest_scope": None, "gap": None, "sigma": None, "floor": floor,
                "ceiling": ceiling}
    scope = min(stats, key=lambda s: (abs(stats[s][0] - bound), s))
    mean, sigma = stats[scope]
    gap = abs(mean - bound)
    n_resolve = math.inf if gap == 0 else math.ceil((Z95 * sigma / gap) ** 2)
    chosen = int(max(floor, min(n_resolve, budget, ceiling)))
    return {"chosen": chosen, "why": "max(floor, min(n_resolve, budget, ceiling))",
            "n_resolve": None if math.isinf(n_resolve) else n_resolve, "budget": budget, "closest_scope": scope,
            "warm_mean": mean, "gap": gap, "sigma": sigma, "floor": floor, "ceiling": ceiling}


def best_global_k(fixed: Mapping[int, Mapping], bound: float) -> dict:
    """Among fixed heads ``{K: {"reuse_ratio", "teacher_forced_top1"}}``, the highest reuse with top-1 >= ``bound``.

    Ties on reuse go to the smaller K (less recomputation). None when no head meets the bound.
    """
    ok = [(a["reuse_ratio"] or 0.0, -k, k) for k, a in fixed.items()
          if a.get("teacher_forced_top1") is not None and a["teacher_forced_top1"] >= bound]
    if not ok:
        return {"k": None, "reuse": None, "top1": None}
    _, _, k = max(ok)
    return {"k": k, "reuse": fixed[k]["reuse_ratio"], "top1": fixed[k]["teacher_forced_top1"]}


def detection_counts(polls: Sequence[Mapping], victims: Sequence[str], controls: Sequence[str],
                     base: str = "head0") -> dict:
    """Verified samples each victim scope needed to go dense, and whether the control scopes stayed off dense.

    ``polls``: the guard's ``per_scope`` after each drained sample, in order. A victim's count is its ``samples``
    at the first poll that shows it ``dense`` (None if none does); ``detection_samples`` is the largest count
    (the sample at which every victim had been caught; None if one never was). ``first_action``: the same at the
    first poll that shows it off ``base`` (a victim the noise moves only a little takes a longer head, not dense).
    ``others_not_dense``: no control scope ``dense`` in the last poll (None without control scopes). A control may
    still take a longer head: at a high verify rate the guard also sees an intact scope that misses the target by
    a little, and acts on it.
    """
    def first(victim: str, moved: Callable[[str], bool]) -> Optional[int]:
        return next((p[victim]["samples"] for p in polls if victim in p and moved(p[victim]["setting"])), None)

    caught = {v: first(v, lambda s: s == "dense") for v in victims}
    last = polls[-1] if polls else {}
    per_control = {c: (last.get(c) or {}).get("setting") for c in controls}
    counts = list(caught.values())
    return {"per_victim": caught, "first_action": {v: first(v, lambda s: s != base) for v in victims},
            "victims_dense": sum(c is not None for c in counts), "victims": len(counts),
            "detection_samples": max(counts) if counts and None not in counts else None,
            "others_not_dense": all(s != "dense" for s in per_control.values()) if per_control else None,
            "per_control": per_control}


def twin(call: fr.Call, suffix: str = CONTROL) -> fr.Call:
    """``call`` with its agent and every slot renamed: the same tokens, another scope, other sources."""
    pieces = tuple(Piece(p.kind, p.slot + suffix if p.slot else p.slot, p.ids) for p in call.pieces)
    return replace(call, agent=call.agent + suffix, pieces=pieces,
                   output_slot=call.output_slot + suffix if call.output_slot else None)


def twin_program(program: fr.Program, suffix: str = CONTROL) -> fr.Program:
    """The program with every call ``twin``-renamed; outputs are passed through unchanged."""
    try:
        call = next(program)
        while True:
            out = yield twin(call, suffix)
            call = program.send(out)
    except StopIteration:
        return


def fault_program(program: fr.Program, slot: str) -> fr.Program:
    """The program with ``slot`` renamed into a ``fault:`` slot (``devtools.fault_injection``): every reuse of
    it is served noise; agents, other slots and outputs unchanged."""
    from devtools.fault_injection import FAULT_PREFIX

    def rename(s: Optional[str]) -> Optional[str]:
        return FAULT_PREFIX + s if s == slot else s

    try:
        call = next(program)
        while True:
            pieces = tuple(Piece(p.kind, rename(p.slot), p.ids) for p in call.pieces)
            out = yield replace(call, pieces=pieces, output_slot=rename(call.output_slot))
            call = program.send(out)
    except StopIteration:
        return


def actions_since(actions: Sequence[Mapping], t0: float, t1: float = math.inf) -> list[dict]:
    """The guard's recent actions stamped in ``[t0, t1)`` (the server shares this machine's clock)."""
    return [dict(a) for a in actions if t0 <= a.get("at", 0.0) < t1]


def settings(per_scope: Mapping[str, Mapping]) -> dict[str, str]:
    return {scope: s.get("setting") for scope, s in sorted(per_scope.items())}


def counter_diff(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """What the guard counted between two snapshots (its counters run for the server's life)."""
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v != before.get(k, 0)}


def reuse_ratio(reports: Sequence[Mapping]) -> Optional[float]:
    """Shared tokens served by reuse over shared tokens, over the reports (None without shared tokens)."""
    shared = sum(r.get("shared_tokens", 0) for r in reports)
    return sum(r.get("shared_tokens_reused", 0) for r in reports) / shared if shared else None
