"""Head (boundary) recompute and plan variants for the offline fidelity harness.

Why a module of its own: ``benchmarks.fidelity`` runs the arms; this module
holds what is specific to the head-recompute and plan-variant arms, so the harness stays one job.

Head recompute (docs/ALGORITHM.md, Head recompute; EPIC's "LegoLink"): of a reused segment
``[s, e)`` the first ``K`` tokens are prefilled densely behind the consumer's
own prefix, the rest come from the re-aligned (and, in kvcmas, corrected)
source. Causal attention makes a dense prefill of ``ids[:K]`` behind the
prefix equal to the first ``K`` rows of the consumer's exact cache, so the
harness splices those rows in (``tests/benchmarks/test_fidelity_head.py``
checks the equality on a real forward). Reuse counts only ``[s + K, e)``.

Plan variants are pure ``CorrectionPlan -> CorrectionPlan``
maps (keys only, first N rows, a subset of layers), so a variant is served
through the same ``materialize`` as every other arm.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterable

import torch

from sglang_kvshare.correction import CorrectionPlan, Factors

HEAD_KS = [4, 8, 16, 32]
"""Head lengths of the new arms (K = 0 is the plain mode's own arm)."""
HEAD_MODES = ["fullshared", "kvcmas"]
COARSE_BUCKETS = [(0, 4), (4, 16), (16, 64), (64, 100000)]
"""Token-position buckets of the per-position error evidence (0-4, 5-16, 17-64, 64+)."""

PlanVariant = Callable[[CorrectionPlan], CorrectionPlan]


def head_label(mode: str, k: int) -> str:
    return mode if k == 0 else f"{mode}+head{k}"


def splice_head(k: torch.Tensor, v: torch.Tensor, exact_k: torch.Tensor, exact_v: torch.Tensor,
                head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[0, head)`` from the consumer's dense prefill, the rest as served (new tensors)."""
    if head <= 0:
        return k, v
    h = min(head, k.shape[1])
    k, v = k.clone(), v.clone()
    k[:, :h], v[:, :h] = exact_k[:, :h], exact_v[:, :h]
    return k, v


# ------------------------------------------------------------ plan variants
def keys_only(plan: CorrectionPlan) -> CorrectionPlan:
    """Correct keys, leave values aligned (zero value weights: the kernel adds nothing to V)."""
    return replace(plan, weights_v=torch.zeros_like(plan.weights_v))


def first_rows(n: int) -> PlanVariant:
    """Correct only rows ``[0, n)`` of the segment; the rest aligned."""
    def apply(plan: CorrectionPlan) -> CorrectionPlan:
        c = min(plan.covered, n)
        return replace(plan, weights_k=plan.weights_k[:c], weights_v=plan.weights_v[:c], covered=c)
    apply.__name__ = f"first_rows_{n}"
    return apply


def _mask_layers(f: Factors, keep: torch.Tensor) -> Factors:
    """The same stack with the layers not in ``keep`` (bool [layers]) zeroed."""
    if f.full is not None:
        return Factors(None, None, f.full * keep[:, None, None].to(f.full.dtype), f.head_shape)
    return Factors(f.a * keep[:, None, None].to(f.a.dtype), f.b, None, f.head_shape)


def layers_only(layers_k: Iterable[int], layers_v: Iterable[int], num_layers: int) -> PlanVariant:
    """Correct keys only in ``layers_k`` and values only in ``layers_v``; other layers aligned."""
    mk = torch.zeros(num_layers, dtype=torch.bool)
    mv = torch.zeros(num_layers, dtype=torch.bool)
    mk[list(layers_k)] = True
    mv[list(layers_v)] = True

    def apply(plan: CorrectionPlan) -> CorrectionPlan:
        return replace(plan, deltas_k=[_mask_layers(f, mk) for f in plan.deltas_k],
                       deltas_v=[_mask_layers(f, mv) for f in plan.deltas_v])
    return apply


def compose(*variants: PlanVariant) -> PlanVariant:
    def apply(plan: CorrectionPlan) -> CorrectionPlan:
        for fn in variants:
            plan = fn(plan)
        return plan
    return apply


# ------------------------------------------------------------- evidence
def coarse_errors(k: torch.Tensor, v: torch.Tensor, exact_k: torch.Tensor, exact_v: torch.Tensor) -> list:
    """Relative K / V error of a served segment per coarse position bucket (None past its length)."""
    dk, dv = (k - exact_k).float(), (v - exact_v).float()
    row = []
    for lo, hi in COARSE_BUCKETS:
        if lo >= k.shape[1]:
            row.append(None)
            continue
        row.append([(dk[:, lo:hi].norm() / exact_k[:, lo:hi].float().norm()).item(),
                    (dv[:, lo:hi].norm() / exact_v[:, lo:hi].float().norm()).item()])
    return row


def coarse_summary(rows: list) -> dict:
    out = {}
    for b, (lo, hi) in enumerate(COARSE_BUCKETS):
        vals = [r[b] for r in rows if r[b] is not None]
        if vals:
            name = f"{lo}-{hi}" if hi < 100000 else f"{lo}+"
            out[name] = {"k": sum(x[0] for x in vals) / len(vals), "v": sum(x[1] for x in vals) / len(vals)}
    return out


def head_frontier(result: dict, min_reuse: float = 0.85, target_kl: float = 0.003) -> dict:
    """Per head mode the (K, reuse, KL) curve, the best arm at reuse >= ``min_reuse`` and the target verdict."""
    rows = {**{m: result[m] for m in HEAD_MODES if m in result}, **result.get("head_recompute", {})}
    curves = {}
    for mode in HEAD_MODES:
        pts = sorted((r.get("head", 0), label) for label, r in rows.items() if r["mode"] == mode
                     and (label == mode or label.startswith(mode + "+head")))
        curves[mode] = [{"K": k, "label": label, "reuse_ratio": rows[label]["reuse_ratio"],
                         "kl_mean": rows[label]["kl_mean"], "kl_p90": rows[label]["kl_p90"],
                         "top1": rows[label]["top1"], "greedy_match": rows[label]["greedy_match"]}
                        for k, label in pts]
    ok = [(r["kl_mean"], label) for label, r in rows.items() if r["reuse_ratio"] >= min_reuse]
    best = min(ok)[1] if ok else None
    out = {"curves": curves, "min_reuse": min_reuse, "target_kl": target_kl, "best_arm": best}
    if best is not None:
        b = rows[best]
        out.update(best_kl_mean=b["kl_mean"], best_reuse=b["reuse_ratio"], target_met=b["kl_mean"] <= target_kl,
                   best_rel_err_by_position=b.get("rel_err_by_position_coarse"),
                   best_rel_err_k_per_layer=b.get("rel_err_k_per_layer"),
                   best_rel_err_v_per_layer=b.get("rel_err_v_per_layer"),
                   fullshared_rel_err_by_position=result.get("fullshared", {}).get("rel_err_by_position_coarse"))
    return out


def plot_heads(ax, result: dict) -> None:
    """Head-recompute curves (K = 0 .. 32) on the fidelity plot."""
    for mode, color in (("fullshared", "C6"), ("kvcmas", "C7")):
        pts = head_frontier(result)["curves"][mode]
        if len(pts) < 2:
            continue
        ax.plot([p["reuse_ratio"] for p in pts], [max(p["kl_mean"], 1e-6) for p in pts], color=color, marker="o",
                ms=4, lw=1.2, label=f"{mode} + head recompute K")
        for p in pts:
            ax.annotate(f"K={p['K']}", (p["reuse_ratio"], max(p["kl_mean"], 1e-6)), fontsize=6, color=color,
                        xytext=(-14, -9), textcoords="offset points")
