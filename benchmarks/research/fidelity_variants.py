"""Correction variants on top of head recompute, chosen on the warm set only.

Question: once the first K tokens of each reused segment are prefilled densely
(head recompute), does any form of the anchor correction still lower the KL
of FullShared + the same head? Candidates, all plan transforms served through
``materialize`` (below): the full kvcmas plan, keys
only, the first N rows only (N = 4, 16, 64), keys on the first 16 rows, and a
per-layer choice (correct K / V only in the layers where the correction lowers
the cache error on the warm set).

Protocol (no held-out content is looked at before the choice):

1. **Warm study, leave-one-content-out.** For every warm content x of a slot,
   the pools hold dense observations of the *other* warm contents of that slot
   (the same observations ``benchmarks.fidelity`` warms with), and x is served
   online through the chain for every variant and head K. The per-layer set of
   a content is chosen from the other half of the warm contents (cross-fitted).
2. **The choice**, by a rule fixed in this file: per K the variant with the
   lowest mean warm KL; it *beats head recompute alone* only if its mean KL is
   below 0.95 x FullShared + head K's and it is lower on more than half of the
   warm instances.
3. **One held-out check**: the pools warmed with all warm contents, the
   held-out contents of ``benchmarks.fidelity`` served online (reject -> dense
   prefill + new anchor) for FullShared + head K, kvcmas + head K and the
   chosen variant + head K.

The short-content study that chose the served ``min_anchor_len`` (anchors compared on their common prefix) is
recorded in ``benchmarks/results/fidelity_variants.json`` (``short_contents``, ``long_enough_blocking``).

    python -m benchmarks.research.fidelity_variants            # writes benchmarks/results/fidelity_variants.json
    python -m benchmarks.research.fidelity_variants --quick --out v.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Iterable

import torch
from tqdm import tqdm

from benchmarks.baselines import make_estimator
from sglang_kvshare.correction import CorrectionPlan, Factors, FullShared, RopeSpec, SegmentCache, materialize

from benchmarks import fidelity as F
from benchmarks.common import load_model, prefill, set_threads
from benchmarks.harness import RESULTS, SCRATCH, run_meta


# ------------------------------------------------------------ plan variants: CorrectionPlan -> CorrectionPlan
def keys_only(plan: CorrectionPlan) -> CorrectionPlan:
    """Correct keys, leave values aligned (zero value weights: the kernel adds nothing to V)."""
    return replace(plan, weights_v=torch.zeros_like(plan.weights_v))


def first_rows(n: int) -> F.PlanVariant:
    """Correct only rows ``[0, n)`` of the segment; the rest aligned."""
    def apply(plan: CorrectionPlan) -> CorrectionPlan:
        c = min(plan.covered, n)
        return replace(plan, weights_k=plan.weights_k[:c], weights_v=plan.weights_v[:c], covered=c)
    return apply


def _mask_layers(f: Factors, keep: torch.Tensor) -> Factors:
    """The same stack with the layers not in ``keep`` (bool [layers]) zeroed."""
    if f.full is not None:
        return Factors(None, None, f.full * keep[:, None, None].to(f.full.dtype), f.head_shape)
    return Factors(f.a * keep[:, None, None].to(f.a.dtype), f.b, None, f.head_shape)


def layers_only(layers_k: Iterable[int], layers_v: Iterable[int], num_layers: int) -> F.PlanVariant:
    """Correct keys only in ``layers_k`` and values only in ``layers_v``; other layers aligned."""
    mk, mv = torch.zeros(num_layers, dtype=torch.bool), torch.zeros(num_layers, dtype=torch.bool)
    mk[list(layers_k)], mv[list(layers_v)] = True, True
    return lambda plan: replace(plan, deltas_k=[_mask_layers(f, mk) for f in plan.deltas_k],
                                deltas_v=[_mask_layers(f, mv) for f in plan.deltas_v])


def compose(*variants: F.PlanVariant) -> F.PlanVariant:
    def apply(plan: CorrectionPlan) -> CorrectionPlan:
        for fn in variants:
            plan = fn(plan)
        return plan
    return apply


ROW_EDGES = [0, 8, 32, 100000]
"""Row buckets of the per-layer error sums (head K in {0, 8, 32} sums the buckets from K on)."""
VARIANTS = {
    "fullshared": None,
    "kvcmas": lambda nl: None,
    "keys_only": lambda nl: keys_only,
    "first4": lambda nl: first_rows(4),
    "first16": lambda nl: first_rows(16),
    "first64": lambda nl: first_rows(64),
    "keys_first16": lambda nl: compose(keys_only, first_rows(16)),
}
WIN_FACTOR = 0.95
"""A variant beats head recompute alone when its KL is below WIN_FACTOR x the random-mix line through
FullShared + the same head (at the variant's reuse) and it is lower on more than half of the instances it served."""


def _kvcmas(spec, args, **extra):
    return make_estimator("kvcmas", spec, **F._anchor_cfg("kvcmas", args.tau, args.rank, args.gate_len), **extra)


def _exact(model, ids, prefix_kv) -> dict:
    out = {}
    for name in F.CHAIN:
        kv, _ = prefill(model, ids, prefix_kv[name])
        out[name] = SegmentCache(kv.k, kv.v, prefix_kv[name].length, name)
    return out


def _prepare(est, slot, key, exact) -> list:
    """Dense observations of every chain edge (source = previous agent's exact cache), as the warm phase makes."""
    preps, prev = [], exact[F.CHAIN[0]]
    for i, name in enumerate(F.CHAIN[1:]):
        preps.append(est.prepare_observation(slot, prev, exact[name], content_key=key, with_base=i == 0))
        prev = exact[name]
    return preps


def _pool(spec, args, preps_by_key: dict, keys, **extra) -> object:
    est = _kvcmas(spec, args, **extra)
    for k in keys:
        for p in preps_by_key[k]:
            est.commit_observation(p)
    return est


def _layer_stats(est, slot, exact, nl) -> dict:
    """Per layer and row bucket, squared error of corrected and aligned K / V (same source, full plan)."""
    z = lambda: torch.zeros(nl, len(ROW_EDGES) - 1, dtype=torch.float64)  # noqa: E731
    st = {n: z() for n in ("ck", "ak", "cv", "av")}
    prev = exact[F.CHAIN[0]]
    for name in F.CHAIN[1:]:
        target = exact[name]
        res = est.estimate(slot, prev, name, target.start_pos)
        if not (res.accepted and res.plan is not None):
            prev = target
            continue
        ck, cv = materialize(prev.k, prev.v, prev.start_pos, target.start_pos, res.plan, est.spec)
        ak, av = materialize(prev.k, prev.v, prev.start_pos, target.start_pos, None, est.spec)
        for b in range(len(ROW_EDGES) - 1):
            lo, hi = ROW_EDGES[b], ROW_EDGES[b + 1]
            for tag, x, ex in (("ck", ck, target.k), ("ak", ak, target.k), ("cv", cv, target.v), ("av", av, target.v)):
                st[tag][:, b] += (x[:, lo:hi] - ex[:, lo:hi]).double().pow(2).flatten(1).sum(1)
        prev = SegmentCache(ck, cv, target.start_pos, name, exact=False)
    return st


def choose_layers(stats: list[dict], head: int) -> tuple[list[int], list[int]]:
    """Layers where the correction lowers the summed squared error on rows >= head (K and V separately)."""
    if not stats:
        return [], []
    b0 = ROW_EDGES.index(head)
    tot = {t: sum(s[t][:, b0:].sum(1) for s in stats) for t in ("ck", "ak", "cv", "av")}
    return ((tot["ck"] < tot["ak"]).nonzero().flatten().tolist(), (tot["cv"] < tot["av"]).nonzero().flatten().tolist())


def _arms(spec, args, names, heads, nl, greedy) -> list:
    arms = []
    for name in names:
        for k in heads:
            mode = "fullshared" if name == "fullshared" else "kvcmas"
            est = FullShared(spec) if mode == "fullshared" else _kvcmas(spec, args)
            variant = None if VARIANTS.get(name) is None else VARIANTS[name](nl)
            arms.append(F.Arm(f"{name}@K{k}", mode, args.tau if mode == "kvcmas" else None,
                              args.rank if mode == "kvcmas" else None, greedy, est, head=k, variant=variant))
    return arms


def _row(arm) -> dict:
    return {"mode": arm.mode, "head": arm.head, "kl_mean": F._mean(arm.kl), "kl_p90": F._p90(arm.kl),
            "top1": F._mean(arm.top1), "greedy_match": F._mean(arm.greedy_same) if arm.greedy else None,
            "reuse_ratio": arm.accepted_tokens / max(arm.consumer_tokens, 1),
            "fallback_rate": arm.fallbacks / max(arm.decisions, 1), "reasons": arm.reasons,
            "instance_kl": arm.inst_kl, "instance_accepted": arm.inst_accepted}


def _wins(row: dict, base: dict) -> float:
    """Share of the instances ``row`` served from the cache (accepted) where its KL is below ``base``'s."""
    pairs = [(x, y) for x, y, acc in zip(row["instance_kl"], base["instance_kl"], row["instance_accepted"]) if acc]
    return sum(x < y for x, y in pairs) / len(pairs) if pairs else 0.0


def line_ratio(row: dict, base: dict) -> float:
    """KL of ``row`` over the random-mix line through ``base`` at ``row``'s reuse (docs/research/ALGORITHM_STUDY.md):
    a dense prefill of a random share of segments scales ``base``'s KL with the reuse kept. < 1: above the line."""
    if row["reuse_ratio"] <= 0 or not base["kl_mean"]:
        return float("inf")
    return row["kl_mean"] / (base["kl_mean"] * row["reuse_ratio"] / base["reuse_ratio"])


def run(args) -> dict:
    set_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, tok, _ = load_model(args.model)
    spec = RopeSpec.from_hf_config(model.config)
    nl = model.config.num_hidden_layers
    parts = {a.name: F.agent_token_parts(tok, a) for a in F.AGENTS}
    prefix_kv = {name: prefill(model, pre)[0] for name, (pre, _) in parts.items()}
    warm, held = F.contents(tok, args)
    command = "python -m benchmarks.research.fidelity_variants " + " ".join(getattr(args, "argv", sys.argv[1:]))
    out = {"meta": run_meta(command.strip()), "command": command, "quick": args.quick,
           "heads": args.heads, "tau": args.tau, "rank": args.rank, "gate_len": args.gate_len,
           "n_warm": len(warm), "n_heldout": len(held), "win_rule": f"mean KL < {WIN_FACTOR} x the random-mix line through "
           "fullshared@K at the variant's reuse, and lower KL on > 50 % of the warm instances it served"}

    # ---- 1. warm study: leave one content out, every variant and head K
    proto = _kvcmas(spec, args)
    exact_w, preps = {}, {}
    for slot, key, ids in tqdm(warm, desc="warm prefill", file=sys.stderr):
        exact_w[key] = _exact(model, ids, prefix_kv)
        preps[key] = _prepare(proto, slot, key, exact_w[key])
    names = [n for n in VARIANTS]
    arms = _arms(spec, args, names, args.heads, nl, greedy=False)
    layer_arms = _arms(spec, args, ["per_layer"], args.heads, nl, greedy=False)
    stats = {}
    for slot, key, ids in tqdm(warm, desc="warm study", file=sys.stderr):
        others = [k for s, k, _ in warm if s == slot and k != key]
        stats[key] = _layer_stats(_pool(spec, args, preps, others), slot, exact_w[key], nl)
        for arm in arms:
            if arm.mode == "kvcmas":
                arm.est = _pool(spec, args, preps, others)
        served = {a.label: F.serve_chain(model, a, slot, key, ids, exact_w[key], None, prefix_kv, "eval") for a in arms}
        F.evaluate(model, arms, served, exact_w[key], prefix_kv, parts, slot, len(ids), 0)
    half = {key: int(key.rsplit(":", 1)[1]) % 2 for _, key, _ in warm}
    layer_sets = {}
    for slot, key, ids in tqdm(warm, desc="warm per-layer", file=sys.stderr):
        others = [k for s, k, _ in warm if s == slot and k != key]
        fit = [stats[k] for k in stats if half[k] != half[key]]  # cross-fitted: chosen on the other half
        for arm in layer_arms:
            lk, lv = choose_layers(fit, arm.head)
            layer_sets.setdefault(arm.label, {})[f"half{1 - half[key]}"] = {"k": lk, "v": lv}
            arm.variant = layers_only(lk, lv, nl)
            arm.est = _pool(spec, args, preps, others)
        served = {a.label: F.serve_chain(model, a, slot, key, ids, exact_w[key], None, prefix_kv, "eval")
                  for a in layer_arms}
        F.evaluate(model, layer_arms, served, exact_w[key], prefix_kv, parts, slot, len(ids), 0)
    warm_rows = {a.label: _row(a) for a in arms + layer_arms}
    out["warm"] = {"rows": warm_rows, "per_layer_sets_by_fit_half": layer_sets}

    # ---- 2. the choice (warm only)
    choice = {}
    for k in args.heads:
        fs = warm_rows[f"fullshared@K{k}"]
        cands = {n: warm_rows[f"{n}@K{k}"] for n in names + ["per_layer"] if n != "fullshared"}
        best = min(cands, key=lambda n: line_ratio(cands[n], fs))
        b = cands[best]
        win_rate = _wins(b, fs)
        beats = line_ratio(b, fs) < WIN_FACTOR and win_rate > 0.5
        choice[f"K{k}"] = {"best_variant": best, "kl_mean": b["kl_mean"], "reuse_ratio": b["reuse_ratio"],
                           "fullshared_kl_mean": fs["kl_mean"], "fullshared_reuse_ratio": fs["reuse_ratio"],
                           "ratio_to_random_mix_line": line_ratio(b, fs),
                           "line_ratio_by_variant": {n: line_ratio(c, fs) for n, c in cands.items()},
                           "win_rate_vs_fullshared": win_rate,
                           "beats_head_recompute_alone": beats,
                           "all_layers": choose_layers(list(stats.values()), k)}
    out["choice"] = choice
    del exact_w
    if args.no_heldout:
        out["wall_seconds"] = time.perf_counter() - t0
        return out

    # ---- 3. one held-out check: pools warmed with every warm content, held-out contents served online
    check = []
    for k in args.heads:
        c = choice[f"K{k}"]
        check += _arms(spec, args, ["fullshared", "kvcmas"], [k], nl, greedy=True)
        if c["best_variant"] != "kvcmas":
            arm = _arms(spec, args, [c["best_variant"] if c["best_variant"] in VARIANTS else "kvcmas"], [k], nl,
                        greedy=True)[0]
            if c["best_variant"] == "per_layer":
                arm.label, arm.variant = f"per_layer@K{k}", layers_only(*c["all_layers"], nl)
            check.append(arm)
    for arm in check:
        if arm.mode == "kvcmas":
            arm.est = _pool(spec, args, preps, [k for _, k, _ in warm])
    for slot, key, ids in tqdm(held, desc="held-out check", file=sys.stderr):
        exact = _exact(model, ids, prefix_kv)
        served = {a.label: F.serve_chain(model, a, slot, key, ids, exact, None, prefix_kv, "eval") for a in check}
        F.evaluate(model, check, served, exact, prefix_kv, parts, slot, len(ids), args.greedy_tokens)
    out["heldout"] = {a.label: _row(a) for a in check}
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    F.add_study_args(ap, "fidelity_variants", "2 warm + 1 held-out content per source, 256 tokens")
    ap.add_argument("--heads", type=int, nargs="+", default=[0, 8, 32], choices=ROW_EDGES[:-1])
    ap.add_argument("--no-heldout", action="store_true", help="warm study and choice only")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    # NOTE: the same contents as benchmarks.fidelity (same seeds, counts and lengths)
    args.warm, args.eval, args.lengths = (2, 1, [256]) if args.quick else (4, 3, [256, 512, 768, 384])
    out = args.out or (SCRATCH / "fidelity_variants_quick.json" if args.quick else RESULTS / "fidelity_variants.json")
    result = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    print(json.dumps({"choice": result["choice"],
                      "warm": {k: round(v["kl_mean"], 5) for k, v in result["warm"]["rows"].items()},
                      "heldout": {k: {m: v[m] for m in ("kl_mean", "reuse_ratio", "top1", "greedy_match")}
                                  for k, v in result.get("heldout", {}).items()}}, indent=1))


if __name__ == "__main__":
    main()
