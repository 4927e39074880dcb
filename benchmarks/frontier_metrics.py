"""The frontier's pure parts: teacher-forced fidelity, the random-mix baseline, paired intervals.

Kept apart from ``benchmarks.frontier`` (which starts servers) so each piece is
tested without a server (``tests/benchmarks/test_frontier_metrics.py``).

Teacher-forced KL, how: at every position of ``off``'s continuation, ``P`` is
off's top-k next-token distribution and ``Q`` the arm's top-k, both
teacher-forced on the same prompt + continuation. The KL is taken over P's
top-k support, both renormalized on it; a token of P's support missing from
Q's top-k gets Q's k-th logprob (the largest it can have, so the KL is a
lower bound of what a full-vocabulary KL would give there).
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
from typing import Iterable, Mapping, Optional, Sequence

TopK = dict[int, float]  # token id -> logprob


def top_entries(raw: Optional[Sequence]) -> TopK:
    """SGLang's top-logprob entry (a list of ``[logprob, token_id, text]``) as ``{token_id: logprob}``."""
    if not raw:
        return {}
    return {int(e[1]): float(e[0]) for e in raw if e is not None and e[0] is not None}


def kl_topk(p: TopK, q: TopK) -> float:
    """KL(P || Q) over P's support, both renormalized there; missing Q entries get Q's smallest logprob."""
    if not p:
        raise ValueError("P has no entries: teacher forcing returned no top logprobs for this position")
    if not q:
        raise ValueError("Q has no entries: teacher forcing returned no top logprobs for this position")
    floor = min(q.values())
    support = list(p)
    lp = [p[t] for t in support]
    lq = [q.get(t, floor) for t in support]
    zp = _logsumexp(lp)
    zq = _logsumexp(lq)
    return max(0.0, sum(math.exp(a - zp) * ((a - zp) - (b - zq)) for a, b in zip(lp, lq)))


def _logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def argmax(d: TopK) -> int:
    """The most likely token; ties go to the smaller id so both sides break them the same way."""
    return min(d, key=lambda t: (-d[t], t))


def compare_positions(ref: Sequence[TopK], arm: Sequence[TopK]) -> dict:
    """Top-1 agreement and mean top-k KL along one continuation (position by position)."""
    if len(ref) != len(arm):
        raise ValueError(f"the two teacher-forced passes cover {len(ref)} and {len(arm)} positions; "
                         "they must be run on the same prompt + continuation")
    pairs = [(p, q) for p, q in zip(ref, arm) if p and q]
    if not pairs:
        return {"positions": 0, "top1": None, "kl": None}
    return {"positions": len(pairs),
            "top1": statistics.fmean(1.0 if argmax(p) == argmax(q) else 0.0 for p, q in pairs),
            "kl": statistics.fmean(kl_topk(p, q) for p, q in pairs)}


def pooled(per_request: Iterable[dict]) -> dict:
    """Position-weighted means over requests (each row from ``compare_positions``)."""
    rows = [r for r in per_request if r["positions"]]
    n = sum(r["positions"] for r in rows)
    if not n:
        return {"positions": 0, "top1": None, "kl": None}
    return {"positions": n,
            "top1": sum(r["top1"] * r["positions"] for r in rows) / n,
            "kl": sum(r["kl"] * r["positions"] for r in rows) / n}


# ------------------------------------------------------------------ random mix
def unit_draw(seed: int, *key: object) -> float:
    """A uniform draw in [0, 1) fixed by ``seed`` and ``key`` (independent of call order and process)."""
    digest = hashlib.sha256(repr((seed, key)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def dense_in_mix(p: float, seed: int, *key: object) -> bool:
    """Whether the random mix prefills the segment named by ``key`` densely at share ``p``.

    Nested in ``p``: a segment dense at p stays dense at every larger p, so the
    sweep's points differ only by the segments added."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"the random-mix share must be in [0, 1], got {p}")
    return unit_draw(seed, *key) < p


FRESH_MARK = "#mix-dense:"


def fresh_slot(slot: str, *key: object) -> str:
    """A slot name no producer ever used, so the server finds no source and prefills it densely."""
    return f"{slot}{FRESH_MARK}" + ":".join(str(k) for k in key)


def is_fresh_slot(slot: Optional[str]) -> bool:
    """Whether ``slot`` is one the random mix made with ``fresh_slot``."""
    return slot is not None and FRESH_MARK in slot


def interpolate(points: Sequence[tuple[float, float]], x: float) -> Optional[float]:
    """Piecewise-linear y at ``x`` through ``points`` (x, y), sorted by x; None outside their range."""
    pts = sorted(points)
    if not pts or x < pts[0][0] - 1e-12 or x > pts[-1][0] + 1e-12:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 - 1e-12 <= x <= x1 + 1e-12:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1]


# ------------------------------------------------------------------ paired differences
def paired_bootstrap(arm: Sequence[float], ref: Sequence[float], reps: int = 4000, seed: int = 0) -> dict:
    """Mean of ``arm - ref`` (same items, same order) and its 95 % percentile-bootstrap interval."""
    if len(arm) != len(ref):
        raise ValueError(f"paired samples differ in length ({len(arm)} vs {len(ref)}): "
                         "both arms must score the same items")
    if not arm:
        return {"n": 0, "mean": None, "ci95": None}
    d = [a - b for a, b in zip(arm, ref)]
    rng = random.Random(seed)
    n = len(d)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(reps))
    return {"n": n, "mean": sum(d) / n,
            "ci95": [means[int(0.025 * (reps - 1))], means[int(round(0.975 * (reps - 1)))]],
            "discordant": {"arm_only_right": sum(1 for x in d if x > 0), "ref_only_right": sum(1 for x in d if x < 0)}}


def line_gap_intervals(agree: Mapping[str, Sequence[float]], reuse: Mapping[str, float], line: Sequence[str],
                       reps: int = 2000, seed: int = 0) -> dict[str, Optional[list[float]]]:
    """95 % interval of each arm's agreement minus the random-mix line at the arm's reuse.

    ``agree[arm]``: one 0/1 per scored item, the same items in the same order
    in every arm; ``line``: the arms that make the line (off, the mix sweep,
    fullshared K=0). Why the items are resampled jointly for all arms: the line
    is made of arms scored on the same items, so an item that every arm finds
    hard moves an arm and the line together; one draw of items per replicate
    keeps that pairing, as ``paired_bootstrap`` does for two arms. Reuse ratios
    stay fixed (token counts over the whole run). None for an arm outside the
    line's reuse range or when no item was scored.
    """
    if len({len(v) for v in agree.values()}) > 1:
        raise ValueError("every arm must score the same items: agreement lists differ in length")
    per_item = {name: [(1, v, 0.0) for v in values] for name, values in agree.items()}  # one "position" an item
    return {name: ci and ci["top1_above"] for name, ci in tf_line_gap_intervals(per_item, reuse, line, reps, seed).items()}


def tf_line_gap_intervals(per_sample: Mapping[str, Sequence[Sequence[float]]], reuse: Mapping[str, float],
                          line: Sequence[str], reps: int = 1000, seed: int = 0) -> dict[str, Optional[dict]]:
    """95 % intervals of each arm's teacher-forced gap to the random-mix line: top-1 above it, KL below it.

    ``per_sample[arm][i]`` = (positions, top-1 hits, KL sum) of sample ``i``, the same samples in every arm.
    Samples (not positions) are resampled, jointly for all arms, since the positions of one sample move
    together; as in ``line_gap_intervals`` the reuse ratios stay fixed. None outside the line's range.
    """
    names = list(per_sample)
    n = len(next(iter(per_sample.values()), []))
    if any(len(v) != n for v in per_sample.values()):
        raise ValueError("every arm must cover the same samples")
    if n == 0 or not line:
        return {name: None for name in names}
    rng = random.Random(seed)
    gaps: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        top1, kl = {}, {}
        for name in names:
            pos = sum(per_sample[name][i][0] for i in idx) or 1
            top1[name] = sum(per_sample[name][i][1] for i in idx) / pos
            kl[name] = sum(per_sample[name][i][2] for i in idx) / pos
        t_line = [(reuse[m], top1[m]) for m in line]
        k_line = [(reuse[m], kl[m]) for m in line]
        for name in names:
            ty, ky = interpolate(t_line, reuse[name]), interpolate(k_line, reuse[name])
            if ty is not None and ky is not None:
                gaps[name][0].append(top1[name] - ty)
                gaps[name][1].append(ky - kl[name])

    def ci(g: list[float]) -> list[float]:
        g = sorted(g)
        return [g[int(0.025 * (len(g) - 1))], g[int(round(0.975 * (len(g) - 1)))]]

    return {name: ({"top1_above": ci(gaps[name][0]), "kl_below": ci(gaps[name][1])} if gaps[name][0] else None)
            for name in names}


def spread(values: Sequence[float]) -> dict:
    """Median and the 10th / 90th percentiles (nearest rank)."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"n": 0, "median": None, "p10": None, "p90": None}

    def q(f: float) -> float:
        return vals[min(len(vals) - 1, int(round(f * (len(vals) - 1))))]

    return {"n": len(vals), "median": statistics.median(vals), "p10": q(0.1), "p90": q(0.9)}


def on_mix_line(name: str, a: dict) -> bool:
    """The random-mix line's points: off (p=1), the mix sweep, fullshared K=0 (p=0)."""
    return name == "off" or a["random_mix_p"] is not None or (
        a["mode"] == "fullshared" and a["recompute_head"] == 0 and not a.get("recompute_ratio"))


def random_mix_line(arms: dict) -> list[tuple[float, float, str]]:
    """(reuse, agreement, arm) points of the random-mix baseline: off (p=1), the mix sweep, fullshared K=0 (p=0)."""
    pts = []
    for name, a in arms.items():
        if on_mix_line(name, a):
            pts.append((a["reuse_ratio"] or 0.0, a["agreement_final"], name))
    return sorted(pts)


def add_line_gaps(arms: dict) -> None:
    """Each arm's gap to the random-mix line: agreement and teacher-forced top-1, and the agreement gap's
    95 % interval (``above_random_mix_ci95``, items resampled jointly for all arms) when items are recorded."""
    pts = [(x, y) for x, y, _ in random_mix_line(arms)]
    tpts = [(a["reuse_ratio"] or 0.0, a["teacher_forced_top1"]) for name, a in arms.items() if on_mix_line(name, a)]
    for a in arms.values():
        line = interpolate(pts, a["reuse_ratio"] or 0.0)
        a["random_mix_agreement_at_same_reuse"] = line
        a["above_random_mix"] = None if line is None else a["agreement_final"] - line
        tline = interpolate(tpts, a["reuse_ratio"] or 0.0) if all(y is not None for _, y in tpts) else None
        a["random_mix_top1_at_same_reuse"] = tline
        a["top1_above_random_mix"] = None if tline is None or a["teacher_forced_top1"] is None \
            else a["teacher_forced_top1"] - tline
        kpts = [(x["reuse_ratio"] or 0.0, x.get("teacher_forced_kl")) for name, x in arms.items() if on_mix_line(name, x)]
        kline = interpolate(kpts, a["reuse_ratio"] or 0.0) if all(y is not None for _, y in kpts) else None
        a["random_mix_kl_at_same_reuse"] = kline
        a["kl_below_random_mix"] = None if kline is None or a.get("teacher_forced_kl") is None \
            else kline - a["teacher_forced_kl"]
    if all("teacher_forced_per_sample" in a for a in arms.values()):
        tf_ci = tf_line_gap_intervals({name: a["teacher_forced_per_sample"] for name, a in arms.items()},
                                      {name: a["reuse_ratio"] or 0.0 for name, a in arms.items()},
                                      [name for name, a in arms.items() if on_mix_line(name, a)])
        for name, a in arms.items():
            a["teacher_forced_line_gap_ci95"] = tf_ci[name]
    off = arms.get("off")
    if off is None or "per_item" not in off or any("per_item" not in a for a in arms.values()):
        return
    ref = [it["answer"] for it in off["per_item"]]
    agree = {name: [1.0 if it["answer"] == r else 0.0 for it, r in zip(a["per_item"], ref)]
             for name, a in arms.items()}
    reuse = {name: a["reuse_ratio"] or 0.0 for name, a in arms.items()}
    ci = line_gap_intervals(agree, reuse, [name for name, a in arms.items() if on_mix_line(name, a)])
    for name, a in arms.items():
        a["above_random_mix_ci95"] = ci[name]
