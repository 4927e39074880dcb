"""``python -m benchmarks.report``: docs/RESULTS.md and its plots, generated from the canonical results.

Every benchmark keeps one canonical results file in ``benchmarks/results/``
(``REGISTRY`` below: its name, its file, the command that writes it, the
question it answers and how to read it). This module reads those files and
writes ``docs/RESULTS.md``: an index, the headline figures, and one section
per benchmark whose tables come from the JSON alone, each with the hardware,
date, git revision and command recorded in the file's ``meta``
(``benchmarks.harness.run_meta``). Plots go to ``docs/results/`` through the
benchmarks' own plot functions.

    python -m benchmarks.report               # write docs/RESULTS.md, docs/results/*.png, README's headline block
    python -m benchmarks.report --no-plots    # docs/RESULTS.md only
    python -m benchmarks.report --check       # exit 1 (and a diff) if docs/RESULTS.md is not what the JSON gives

Why generated: a table typed by hand drifts from the file it quotes, and a
reader cannot tell which run a number came from. The output is deterministic
(same JSON in, byte-identical markdown out: stable order, fixed float formats,
no generation time), so ``--check`` and the test suite can hold docs/RESULTS.md
to the committed JSON. A missing or malformed canonical file raises
``ReportError`` naming the file; an entry marked ``optional`` (a benchmark not
measured yet) is left out of the document while its file is missing.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.serving_digest import serving_digest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "RESULTS.md"
PLOTS = ROOT / "docs" / "results"
DETAIL = ROOT / "docs" / "research" / "RESULTS_DETAIL.md"
TEXT_META = "# meta: "


class ReportError(RuntimeError):
    """A canonical results file is missing or does not hold what its section reads."""


# ------------------------------------------------------------------ formatting
def num(x: Any, fmt: str = ".2f", unit: str = "") -> str:
    """``x`` formatted (``-`` for a missing value)."""
    if x is None:
        return "-"
    if isinstance(x, float) and x != x:
        return "-"
    return f"{format(x, fmt)}{unit}"


def spread(cell: Optional[dict], fmt: str = ".2f", unit: str = "", *, mid: str = "median",
           lo: str = "min", hi: str = "max") -> str:
    """``median (min-max)`` of a summary dict."""
    if not cell or cell.get(mid) is None:
        return "-"
    return f"{num(cell[mid], fmt)}{unit} ({num(cell.get(lo), fmt)}-{num(cell.get(hi), fmt)})"


def interval(ci: Optional[list], fmt: str = "+.3f") -> str:
    return f"[{num(ci[0], fmt)}, {num(ci[1], fmt)}]" if ci else "-"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fallbacks(reasons: Optional[dict]) -> str:
    """``reason count`` pairs, most frequent first (ties by name)."""
    if not reasons:
        return "-"
    return ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))


def hardware(meta: dict) -> str:
    m = meta.get("machine") or {}
    if m.get("description"):
        return m["description"]
    cores = m.get("cpu_count")
    gpu = m.get("gpu")
    return f"{cores} CPU cores, " + (f"GPU {gpu}" if gpu else "no GPU")


def date_of(meta: dict) -> str:
    return str(meta.get("date", "-"))[:10]


def meta_line(meta: dict) -> str:
    """Where, when, from which code and with which command a file was measured."""
    rev = meta.get("git_revision") or "-"
    dirty = " (uncommitted changes)" if meta.get("git_dirty") else ""
    digest = meta.get("serving_digest")
    code = f"serving digest `{digest[:12]}`" if digest else "no serving digest"
    how = (" Date and revision: the commit that recorded the file." if meta.get("backfilled") else "")
    return (f"Measured on {hardware(meta)}, {date_of(meta)}, revision `{rev[:10]}`{dirty}, {code}, by "
            f"`{meta.get('command', '-')}`.{how}")


# ------------------------------------------------------------------ freshness
CHANGED = "serving code changed since"
NO_DIGEST = "measured before digests were recorded"
PARTS_DIFFER = "parts measured on different serving code"
MARK = re.compile(r"(?: - )?\*\*stale\*\* \((?:" + "|".join(map(re.escape, (CHANGED, NO_DIGEST, PARTS_DIFFER)))
                  + r")\)|(?<=\| )fresh(?= \|)")
"""Every freshness mark the report writes (``cell_mark``, ``header_mark``): ``--check`` compares the documents
with them taken out, so a change of the serving code alone does not fail it (``--check-fresh`` does that)."""
LEGEND = (f"Code: `fresh` = measured on the serving code of this tree (`benchmarks/serving_digest.py`); **stale** = "
          f"{CHANGED}, {NO_DIGEST}, or {PARTS_DIFFER} (a merged or pooled file); "
          "`python -m benchmarks.report --check-fresh` names the commands that measure a stale row again.")


def freshness(data: dict, tree: str) -> Optional[str]:
    """None when ``data`` was measured on the serving code whose digest is ``tree``; else why it is stale.

    A merged or pooled file (``parts_meta``; a guard overhead taken from another run, ``overhead_source``) is
    fresh only when every part recorded the tree's digest. Reads the files alone: the same files and tree give the
    same answer on a fresh clone (no git call)."""
    metas = [data["meta"], *(data.get("parts_meta") or [])]
    if data.get("overhead_source"):
        metas.append(data["overhead_source"].get("meta"))
    digests = [(m or {}).get("serving_digest") for m in metas]
    if len({d for d in digests if d}) > 1:
        return PARTS_DIFFER
    if not all(digests):
        return NO_DIGEST
    return None if digests[0] == tree else CHANGED


def cell_mark(stale: Optional[str]) -> str:
    return "fresh" if stale is None else f"**stale** ({stale})"


def header_mark(stale: Optional[str]) -> str:
    return "" if stale is None else f" - **stale** ({stale})"


def without_marks(text: str) -> str:
    return MARK.sub("", text)


# ------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its canonical file in ``benchmarks/results/``, the command that writes it, what it asks,
    how to read it, and how its section (and plot, if any) is drawn from the file."""

    name: str
    file: str
    command: str
    question: str
    reading: str
    render: Callable[[Any], str]
    plot: Optional[Callable[[Any, Path], None]] = None
    results_png: bool = False  # the benchmark itself draws ``<file stem>.png`` beside its JSON
    optional: bool = False  # not measured yet: the report leaves it out while its file is missing

    @property
    def detail(self) -> bool:
        """A research benchmark: its tables go to docs/research/RESULTS_DETAIL.md, its section links them."""
        return "benchmarks.research." in self.command

    @property
    def is_json(self) -> bool:
        return self.file.endswith(".json")


def load(entry: Benchmark, results: Path = RESULTS) -> Any:
    """The canonical file of ``entry``: the parsed JSON, or for a script's saved output ``{"meta", "text"}``.

    Raises ``ReportError`` naming the file when it is missing, not parseable, or lacks ``meta``'s
    command, machine, date or git revision.
    """
    path = results / entry.file
    if not path.is_file():
        raise ReportError(f"{path}: the canonical results file of benchmark {entry.name!r} is missing "
                          f"(written by: {entry.command})")
    text = path.read_text()
    try:
        if entry.is_json:
            data = json.loads(text)
        else:  # a script's saved output: its first line is ``# meta: {...}``
            first, _, rest = text.partition("\n")
            if not first.startswith(TEXT_META):
                raise ReportError(f"{path}: the first line must be '{TEXT_META}{{...}}' (benchmarks.harness.run_meta)")
            data = {"meta": json.loads(first[len(TEXT_META):]), "text": rest}
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ReportError(f"{path}: a results JSON must be an object")
    meta = data.get("meta")
    missing = [k for k in ("command", "machine", "date", "git_revision") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ReportError(f"{path}: meta lacks {', '.join(missing)} (benchmarks.harness.run_meta writes it)")
    return data


# ------------------------------------------------------------------ sections
def render_chain(d: dict) -> str:
    header = ["arm", "shared tokens", "reuse ratio (agents 2-4)", "TTFT agents 2-4", "exact-hit floor",
              "reuse / floor", "speedup vs off", "agent 1 vs off", "assembly / dense prefill",
              "dense probe while learning / off", "n"]
    rows = []
    for arm, per_len in d["arms"].items():
        for length, c in per_len.items():
            n = c["ttft_agents_2_4_s"]["n"]
            probes = c.get("while_learning_vs_off", {}).get("n")
            rows.append([f"`{arm}`", length, num(c["reuse_ratio"]), spread(c["ttft_agents_2_4_s"], ".2f", " s"),
                         spread(c["floor_agents_2_4_s"], ".2f", " s"), spread(c["reuse_over_floor"]),
                         spread(c.get("speedup_vs_off_agents_2_4")), spread(c.get("agent1_vs_off")),
                         spread(c.get("assembly_over_dense_prefill"), ".3f"),
                         spread(c.get("while_learning_vs_off")),
                         f"{n} repeats" + (f", {probes} probes" if probes else "")])
    return ("Median (min-max) over the repeats; each repeat is a new content. "
            "`MODE:K` is `--kvshare-recompute-head K`, recomputed inside the one prefill forward (the sparse "
            "extend); `@sparse-extend=false` stages each head (one more forward); `@recompute-ratio=r` recomputes "
            "the first share r of each reused segment.\n\n" + table(header, rows))


def render_stock_vs_off(d: dict) -> str:
    t, tp = d["ttft"], d["throughput"]
    rows = []
    for label, cell, stock, off, fmt in (
            (f"TTFT, {t['length']} tokens", t, t["stock_median_s"], t["off_median_s"], ".3f"),
            (f"throughput, {tp['batch']} x ({tp['batch_length']} + {tp['output_tokens']}) tokens", tp,
             tp["stock_median_tokens_per_s"], tp["off_median_tokens_per_s"], ".0f")):
        v = cell["verdict"]
        unit = " s" if label.startswith("TTFT") else " tok/s"
        rows.append([label, num(stock, fmt, unit), num(off, fmt, unit),
                     f"{num(v['median'], '.3f')} {interval(v['ci95'], '.3f')} ({num(v['min'], '.3f')}-"
                     f"{num(v['max'], '.3f')})", str(v["n"]), f"{v['verdict']} {v['tolerance']:.0%}"])
    idle = d.get("idle_cpu_share") or {}
    return (table(["metric", "stock (median)", "`off` (median)",
                   "paired ratio off / stock: median [95 % bootstrap interval] (min-max)", "pairs", "verdict"], rows)
            + f"\n\nIdle CPU of each server while the other one was measured (cores): "
              f"stock {num(idle.get('stock'), '.3f')}, `off` {num(idle.get('off'), '.3f')}.")


def render_serving(d: dict) -> str:
    s = d["settings"]
    header = ["mode", "context", "rate (wf/s)", "TTFT p50", "TTFT p90", "e2e p50", "reuse ratio",
              "speedup p50 vs off: median of repeats (each repeat)", "bound 1/(1-rho)", "n requests", "fallbacks"]
    rows = []
    for mode, info in d["modes"].items():
        for length, per_rate in info["cells"].items():
            for rate, c in per_rate.items():
                per = c.get("speedup_p50_vs_off_per_repeat") or []
                sp = (f"{statistics.median(per):.2f} ({', '.join(f'{x:.2f}' for x in per)})" if per else "-")
                n = sum(r["n_requests"] for r in c["per_repeat"])
                rows.append([f"`{mode}`", length, rate, num(c["ttft_p50"], ".2f", " s"),
                             num(c["ttft_p90"], ".2f", " s"), num(c["e2e_p50"], ".2f", " s"), num(c["reuse_ratio"]), sp, num(c.get("bound")),
                             str(n), ", ".join(c.get("fallbacks") or []) or "-"])
    rss = ", ".join(f"`{m}` {info['peak_rss_mb'] / 1024:.2f} GB" for m, info in d["modes"].items())
    return (f"{s['workflows']} workflows per cell and repeat, {s['repeats']} repeats, {s['output_tokens']} output "
            f"tokens per agent, {s['warm']} warm-up workflows per length. Speedup: `off`'s TTFT p50 over the mode's, "
            f"per repeat. p50/p90 pool every request of a cell.\n\n" + table(header, rows)
            + f"\n\nPeak server memory (RSS, all processes): {rss}.")


def render_workflow(d: dict) -> str:
    agree = d.get("agreement_with_off", {})
    header = ["mode", "accuracy", "agrees with `off`: final answer / identical final text", "reuse ratio",
              "of which corrected", "dense-fallback rate", "mean TTFT agents 2-4", "median TTFT agents 2 / 3 / 4",
              "mean TTFT agent 1", "wall", "n samples"]
    rows, reasons = [], []
    for mode, r in d["runs"].items():
        a = agree.get(mode)
        pos = r.get("ttft_s_by_position", {})
        meds = " / ".join(num(pos.get(str(i), {}).get("p50")) for i in (2, 3, 4)) + " s"
        rows.append([f"`{mode}`", num(r["accuracy"]),
                     "1 / 1 (reference)" if mode == "off" else
                     (f"{num(a['final_answer_agreement'])} / {num(a['identical_final_text'])}" if a else "-"),
                     num(r.get("reuse_ratio")), num(r.get("shared_corrected_ratio")), num(r.get("dense_fallback_rate")),
                     num(r["ttft_s_mean_agents_2_on"], ".2f", " s"), meds, num(r["ttft_s_mean_agent_1"], ".2f", " s"),
                     num(r["wall_s"] / 60, ".1f", " min"), str(r["samples"])])
        if r.get("fallback_reasons"):
            reasons.append(f"`{mode}`: {fallbacks(r['fallback_reasons'])}")
    note = f"\n\nRecorded with the run: {d['note']}" if d.get("note") else ""
    return (f"{d['task']} `{d['topology']}` workflow, {d['agents']} agents, {d['samples']} samples, "
            f"{d['max_tokens']} tokens per agent, {d['concurrency']} samples in flight.\n\n" + table(header, rows)
            + ("\n\nShared-segment fallbacks: " + "; ".join(reasons) + "." if reasons else "") + note)


def render_demo(d: dict) -> str:
    s, t = d["settings"], d["totals"]
    rows = []
    for agent in dict.fromkeys(r["agent"] for r in d["requests"]):
        mine = [r for r in d["requests"] if r["agent"] == agent]
        shared = sum(r["shared_tokens"] for r in mine)
        reused = sum(r["tokens_aligned"] + r["tokens_corrected"] for r in mine)
        rows.append([f"{mine[0]['position']}: {agent}", str(len(mine)), str(sum(r["prompt_tokens"] for r in mine)),
                     str(sum(r["prefill_tokens"] for r in mine)), str(reused), num(reused / shared if shared else None),
                     num(statistics.fmean(r["ttft_s"] for r in mine), ".2f", " s")])
    rows.append(["all", str(t["requests"]), str(t["prompt_tokens"]), str(t["prefill_tokens"]), str(t["reused_tokens"]),
                 num(t["reuse_ratio"]), "-"])
    return (f"Mode `{s['kvshare_mode']}`, recompute ratio {s['recompute_ratio']:g}, {s['questions']} GSM8K questions, "
            f"{s['max_new_tokens']} tokens per answer, one request in flight.\n\n"
            + table(["agent", "requests", "prompt tokens", "prefilled", "reused (aligned + corrected)",
                     "reuse ratio of shared tokens", "mean TTFT"], rows))


def render_frontier_heldout(d: dict) -> str:
    return (f"Roles: `{d['roles']}`; shared segments of {d['segment_tokens']} tokens. " + render_frontier(d))


def _ttft_cell(a: dict) -> str:
    """Median (p10-p90); runs pooled over seeds keep one per run (medians do not pool)."""
    spreads = [a["ttft_agents_2_4_s"]] if a.get("ttft_agents_2_4_s") else a.get("ttft_agents_2_4_s_per_run") or []
    cells = [f"{num(t['median'], '.2f')} s ({num(t['p10'], '.2f')}-{num(t['p90'], '.2f')})" for t in spreads]
    if not cells:
        return "-"
    return " / ".join(cells) + (" (per run)" if len(cells) > 1 else "")


def frontier_rows(d: dict) -> tuple[list[str], list[list[str]]]:
    arms = d["arms"]
    base_kl = (arms.get("fullshared_k0") or {}).get("teacher_forced_kl")
    agreement = "pass/fail agreement" if d["task"] == "humaneval" else "final-answer agreement"
    header = ["arm", "reuse ratio", agreement, "vs random-mix line [95% CI]", "identical text",
              "teacher-forced top-1 (vs line)", "teacher-forced KL (x fullshared K=0)", "TF reuse",
              "accuracy (paired diff vs off [95% CI])", "TTFT agents 2-4 median (p10-p90)", "shared-segment fallbacks"]
    rows = []
    for name, a in arms.items():
        kl = a.get("teacher_forced_kl")
        ratio = f" ({kl / base_kl:.2f})" if kl is not None and base_kl else ""
        paired = a.get("accuracy_vs_off_paired") or {}
        gap = a.get("above_random_mix")
        rows.append([f"`{name}`", num(a.get("reuse_ratio")), num(a.get("agreement_final"), ".3f"),
                     f"{num(gap, '+.3f')} {interval(a.get('above_random_mix_ci95'))}" if name != "off" else "-",
                     num(a.get("identical_text"), ".3f"),
                     f"{num(a.get('teacher_forced_top1'), '.4f')} ({num(a.get('top1_above_random_mix'), '+.4f')})",
                     f"{num(kl, '.5f')}{ratio}", num(a.get("teacher_forced_reuse_ratio")),
                     f"{num(a.get('accuracy'), '.3f')} ({num(paired.get('mean'), '+.3f')} "
                     f"{interval(paired.get('ci95'))})" if name != "off" else num(a.get("accuracy"), ".3f"),
                     _ttft_cell(a),
                     fallbacks(a.get("fallback_reasons"))])
    return header, rows


def render_frontier(d: dict) -> str:
    header, rows = frontier_rows(d)
    off = d["arms"]["off"]
    parts = ""
    seeds = ", ".join(map(str, d["seed"])) if d.get("pooled") else d["seed"]
    if d.get("pooled"):
        parts = ("\n\nPooled over runs on different seeds (different contents), each arm against its own run's "
                 "`off`: agreement, accuracy and its paired interval over every item, teacher-forced metrics over "
                 "every position; TTFT per run, in seed order. Paired accuracy difference per run: "
                 + "; ".join(f"`{name}` " + ", ".join(
                     f"seed {seed} {num(r.get('mean'), '+.3f')} {interval(r.get('ci95'))}"
                     for seed, r in zip(d["seed"], a.get("accuracy_vs_off_paired_per_run") or []))
                     for name, a in d["arms"].items() if name != "off")
                 + ". Runs: " + "; ".join(f"`{c}`" for c in d["commands"]) + ".")
    elif d.get("commands"):
        parts = ("\n\nThe arms ran in parts, each with its own `off` server, joined with `--merge` (which refuses "
                 "parts whose `off` answered differently); TTFT is compared with the first part's `off`. Parts: "
                 + "; ".join(f"`{c}`" for c in d["commands"]) + ".")
        if d.get("remeasured"):
            parts += (" Measured again in a later part, which replaced the earlier measurement: "
                      + ", ".join(f"`{a}`" for a in d["remeasured"]) + ".")
    return (f"{d['samples']} samples ({d['scored_items']} scored items; {d.get('warmup_samples', 0)} unscored "
            f"warm-up samples per server), {off.get('teacher_forced_positions')} teacher-forced positions per arm, "
            f"{d['max_tokens']} tokens per answer, concurrency {d['concurrency']}, "
            f"seed{'s' if d.get('pooled') else ''} {seeds}. "
            f"Complete: {'yes' if d.get('complete') else 'no'}.\n\n" + table(header, rows) + parts)


def _guard_row(name: str, t: dict) -> list[str]:
    cal, det, ctl = t["calibration"], t["detection"], t["controlled"]
    if t.get("best_global_k") is None:  # say how close the fixed heads came
        fixed = [a["teacher_forced_top1"] for n, a in t["arms"].items() if n.startswith("fullshared_k")]
        best = f"none meets it (best top-1 {num(max(fixed), '.4f')})" if fixed else "-"
    else:
        best = f"K={t['best_global_k']}: {num(t['best_global_k_reuse'])} / {num(t['best_global_k_top1'], '.4f')}"
    kept = {True: "yes", False: "no", None: "-"}
    moved = len(ctl.get("actions_in_warmup") or []) + len(ctl.get("actions_in_scored") or [])
    return [name, f"{num(t['calibration_within_ci'])} ({cal['scopes_judged']} of {cal['scopes']} scopes judged, "
                  f"{cal['approximated_requests']} requests)",
            str(t["min_samples"]["chosen"]),
            f"{num(t['controlled_reuse'])} / {num(t['controlled_top1'], '.4f')} ({moved} setting changes)",
            " / ".join(num((t["arms"].get(a) or {}).get("ttft_agents_2_4_s", {}).get("median"), ".2f")
                       for a in ("guarded", "fullshared_k0", "off")) + " s", best,
            f"{num(t['detection_samples'], 'd')} ({det['victims_dense']} of {det['victims']} victim scopes dense; "
            f"min_samples {det['min_samples']}, rate {det['verify_rate']:g})",
            kept[det.get("others_kept_reuse")]]


# What a guard.json that does not record its controller was measured with.
OLD_GUARD_RULE = {"tighten": "one step per decision (straight to dense when missed by far); on the mean once "
                             "3 x min_samples verified requests leave the interval straddling the target",
                  "relax": "one step, the whole interval past the target by the margin, 2 x min_samples"}


def render_guard(d: dict) -> str:
    header = ["task", "truth inside the guard's 95 % interval (share of scopes)", "min_samples (warm data)",
              "guarded: reuse / teacher-forced top-1", "TTFT agents 2-4 median: guarded / K=0 / `off`",
              "best one global K: reuse / top-1", "perturbed slot caught after (verified samples)",
              "other scopes kept reuse (not dense, still served reuse)"]
    rows = [_guard_row(name, t) for name, t in d["tasks"].items()]
    parts = [f"Verify rate {d['verify_rate']:g}, target `{d['target']}`, fixed heads "
             f"{', '.join(map(str, d['heads']))}; samples per task: "
             + ", ".join(f"{n} {t['samples']} scored from index {t.get('offset', d.get('offset', 0))} + "
                         f"{t['warmup_samples']} warm-up, calibration "
                         f"{t['sizes']['calibration']} + warm-up, guarded arm {t['sizes']['controlled_warmup']} "
                         f"warm-up" for n, t in d["tasks"].items())
             + f"; seed {d.get('seed', 0)}. "
               f"Complete: {'yes' if d.get('complete') else 'no'}.", "", table(header, rows)]
    ctl = d.get("controller") or OLD_GUARD_RULE
    notes = [f"Controller: tightens {ctl['tighten']}; relaxes {ctl['relax']}."]
    if d.get("commands"):
        n = len(d["commands"])
        notes.append("The run was measured in parts on the same revision, joined with `--merge` (which refuses "
                     "parts that differ in arguments or code, or measure a task twice): " + "; ".join(
                         f"`{c}` (started {str(m.get('date', '-'))[:16].replace('T', ' ')} UTC): {', '.join(w) or '-'}"
                         for c, m, w in zip(d["commands"], d.get("parts_meta") or [{}] * n,
                                            d.get("parts_measured") or [[]] * n)) + ".")
    ov = d.get("overhead")
    if ov:
        cells = []
        for key, label in (("ttft", "TTFT"), ("throughput", "throughput")):
            v = ov[key]["verdict"]
            cells.append(f"{label} {num(v['median'], '.3f')} {interval(v['ci95'], '.3f')} ({v['n']} pairs, "
                         f"{v['verdict']} {v['tolerance']:.0%})")
        notes += [f"Overhead, guard at {ov['verify_rate']:g} against 0 (guarded / plain, median [95 % bootstrap "
                      f"interval]): {'; '.join(cells)}; {ov['verified_requests']} requests verified; waiting for "
                      f"the guarded server's queue after its requests (its references, off the request path, and "
                      f"the polls) took {num(ov['drain_s'], '.1f')} s in all."]
        src, old = d.get("overhead_source"), d.get("overhead_replaced")
        if src:
            rev = str(src["meta"].get("git_revision") or "-")[:7]
            text = (f"The overhead was measured again, on its own, by `{src['command']}` (revision {rev}, started "
                    f"{str(src['meta'].get('date', '-'))[:16].replace('T', ' ')} UTC; the serving code is the tasks' "
                    f"run's, checked with `git diff`)")
            if old:
                replaced = [f"{label} {num(old[key]['median'], '.3f')} {interval(old[key]['ci95'], '.3f')} "
                            f"({old[key]['n']} pairs, {old[key]['verdict']})"
                            for key, label in (("ttft", "TTFT"), ("throughput", "throughput"))]
                text += "; the run's own overhead, which it replaced: " + "; ".join(replaced)
            notes.append(text + ".")
    q = d.get("guard_queue")
    if q:
        limits = q.get("limits") or {}
        notes += [f"Guard queue: peak {q['peak_jobs']} jobs, {q['peak_approx_bytes']} bytes (approx.); limits "
                      f"{limits.get('queue_jobs', '-')} jobs, {limits.get('scopes', '-')} scopes."]
    return "\n".join(parts + ["", " ".join(notes)])


FIDELITY_COLUMNS = ["arm", "mode", "tau", "rank", "head K", "KL mean", "KL p90", "top-1", "greedy 32 equal", "reuse",
                    "fallback", "anchor memory", "n segments"]


def _fidelity_row(label: str, r: dict) -> list[str]:
    mib = r.get("anchor_bytes")
    return [f"`{label}`", r["mode"], num(r.get("tau"), "g"), "full" if r.get("rank") is None else str(r["rank"]),
            str(r.get("head") or 0), num(r["kl_mean"], ".4f"), num(r["kl_p90"], ".4f"), num(r["top1"], ".3f"),
            num(r.get("greedy_match")), num(r["reuse_ratio"]), num(r["fallback_rate"]),
            f"{mib / 2**20:.0f} MiB" if mib else "0", str(r.get("decisions", "-"))]


def render_fidelity(d: dict) -> str:
    rows = [_fidelity_row(m, d[m]) for m in d["modes"] if m in d]
    rows += [_fidelity_row(k, r) for k, r in d.get("head_recompute", {}).items()]
    more = len(d.get("sweep", {})) + len(d.get("selective_recompute", {}))
    hf = d.get("head_frontier") or {}
    target = ""
    if hf:
        target = (f"\n\nTarget KL <= {hf['target_kl']} at reuse >= {hf['min_reuse']}: "
                  f"{'met' if hf['target_met'] else 'missed'}; the best arm there is `{hf['best_arm']}`, "
                  f"KL {num(hf['best_kl_mean'], '.4f')} at reuse {num(hf['best_reuse'])}.")
    return (f"{d['model']}; {d['n_eval_samples']} held-out contents x {d['consumers_per_sample']} consumers "
            f"(pools warmed on {d['n_warm_samples']} other contents); sources {', '.join(d['sources'])}; "
            f"segment lengths {', '.join(map(str, d['content_lengths']))} tokens. Every number is against NonShared "
            f"(exact dense prefill, the reference `off` serves) over the consumer's suffix. Dense prefill cost "
            f"{d['dense_prefill_seconds_per_token'] * 1e3:.1f} ms per token here."
            + (f" The file holds {more} more arms (tau and rank sweeps, selective recompute) in the same form."
               if more else "")
            + "\n\n"
            + table(FIDELITY_COLUMNS, rows) + target)


def render_fidelity_variants(d: dict) -> str:
    rows = []
    for k, c in d["choice"].items():
        rows.append([k, f"`{c['best_variant']}`", num(c["kl_mean"], ".5f"), num(c["fullshared_kl_mean"], ".5f"),
                     num(c["ratio_to_random_mix_line"], ".3f"), num(c["win_rate_vs_fullshared"]),
                     "yes" if c["beats_head_recompute_alone"] else "no"])
    held = [[f"`{k}`", num(v["kl_mean"], ".5f"), num(v.get("kl_p90"), ".5f"), num(v.get("top1"), ".4f"),
             num(v.get("greedy_match")), num(v["reuse_ratio"]), num(v.get("fallback_rate"))]
            for k, v in d.get("heldout", {}).items()]
    return (f"{d['n_warm']} warm and {d['n_heldout']} held-out contents, tau {d['tau']}, rank {d['rank']}. "
            f"Rule: {d['win_rule']}.\n\nWarm study (leave one content out), the best variant per head length:\n\n"
            + table(["head K", "best variant", "warm KL mean", "fullshared + head KL mean",
                     "x the random-mix line", "lower KL than fullshared + head (share of instances)",
                     "beats head recompute alone"], rows)
            + "\n\nHeld-out check:\n\n"
            + table(["arm", "KL mean", "KL p90", "top-1", "greedy 32 equal", "reuse", "fallback"], held))


KERNEL_LABELS = {"align_only": "align only (gather, re-rotate, scatter)", "align_correct": "align + correct",
                 "gate_sq_distances": "gate distances (all L rows)", "token_distances": "token distances"}


def render_kernels(d: dict) -> str:
    m = d["meta"]
    rows_by = {(r["kernel"], r["L"]): r for r in d["rows"]}
    rows = []
    for (kernel, length), r in rows_by.items():
        if kernel not in KERNEL_LABELS:
            continue
        unfused = rows_by.get((f"{kernel}_torch_unfused", length))
        rows.append([KERNEL_LABELS[kernel], str(length),
                     f"{r['seconds'] * 1e3:.1f} ({r['seconds_min'] * 1e3:.1f}-{r['seconds_max'] * 1e3:.1f}) ms",
                     num(r["ratio_to_prefill"], ".3f"), f"{unfused['seconds'] * 1e3:.1f} ms" if unfused else "-",
                     str(r["repeats"])])
    prefill = ", ".join(f"{num(v['seconds'], '.2f')} s ({length} tokens)" for length, v in m["prefill"].items())
    return (f"Device: {m['device']}; path of the fused rows: {m['fused_path']}. {m['note']} Shapes: "
            f"{m['model_shapes']['layers']} layers, {m['model_shapes']['kv_heads']} KV heads x "
            f"{m['model_shapes']['head_dim']}; {d['rows'][0]['anchors']} anchors of rank {d['rows'][0]['rank']}, "
            f"{d['rows'][0]['dtype']} pool. Dense prefill of the same model on the same thread: {prefill}.\n\n"
            + table(["op", "L", "time: median (min-max)", "/ dense prefill", "torch, unfused (every anchor "
                     "reconstructed)", "repeats"], rows))


def verdicts_line(verdicts: dict) -> str:
    """How many verdicts passed, naming each one that failed or was not checked."""
    passed = sum(1 for v in verdicts.values() if v is True)
    failed = [f"`{k}`" for k, v in verdicts.items() if v is not True and v != "not checked"]
    unchecked = [f"`{k}`" for k, v in verdicts.items() if v == "not checked"]
    return (f"Verdicts: {passed} of {len(verdicts)} pass"
            + (f"; **FAIL**: {', '.join(failed)}" if failed else "")
            + (f"; not checked: {', '.join(unchecked)}" if unchecked else "") + ".")


def passed_and_requests(d: dict) -> str:
    """The verdict and the request totals of a soak-like run (``passed``, ``totals``)."""
    t = d["totals"]
    return (f"Passed: **{'yes' if d['passed'] else 'no'}**. Requests {t['requests']}: 2xx {t['ok_2xx']}, 4xx "
            f"{t['client_4xx']}, 5xx {t['server_5xx']}, lost {t['lost']}")


def render_soak(d: dict) -> str:
    s = d["settings"]
    rep = d["replay"]
    return (f"Mode `{s['mode']}`, tau {s['tau']}, {s['clients']} clients for {s['minutes']} min, KV pool "
            f"{s['max_total_tokens']} tokens, {s['slot_names']} slot names; wall {d['wall_s']} s. "
            f"{passed_and_requests(d)}; faults injected "
            f"{d['faults_injected_total']}; plain requests replayed against `off`: {rep['same']} of {rep['n']} "
            f"identical. " + verdicts_line(d["verdicts"]))


def render_adversary(d: dict) -> str:
    flood = d["attacks"].get("name_flood") or {}
    chats = (d["attacks"].get("long_chats") or {}).get("sizes") or {}
    sizes = ", ".join(f"{n} messages: {c['auto_status']} in {num(c['auto_s'])} s (stock {c['stock_status']}), "
                      f"short chat delayed {num(c['short_delay_s'])} s" for n, c in chats.items())
    return (f"Form `{d['form']}`, {d['server_s']} s against the server. {passed_and_requests(d)}; "
            f"{d['secrets']['count']} secrets looked for in {d['secrets']['answers_scanned']} answers, "
            f"{len(d['secrets']['leaks'])} found; name flood {flood.get('flood_requests', '-')} agents, guard scope "
            f"series {(flood.get('series') or {}).get('scopes', '-')} (cap {flood.get('series_cap', '-')}). "
            f"Long chats: {sizes or '-'}. " + verdicts_line(d["verdicts"]))


def render_langgraph(d: dict) -> str:
    rows = []
    for mode, r in d["summary"].items():
        agents = ", ".join(f"{k} {num(v)}" for k, v in (r.get("agreement_text") or {}).items())
        rows.append([f"`{mode}`", num(r["seconds"], ".1f", " s"), str(r["message_tokens"]),
                     num(r.get("reuse_ratio_repeated")), num(r.get("agreement_final_number")), agents])
    return (f"{len(d['questions'])} questions, {d['max_tokens']} tokens per answer, greedy.\n\n"
            + table(["mode", "wall", "message tokens", "reuse of repeated message tokens",
                     "final number equals `off`'s", "answer text equals `off`'s, per agent"], rows))


def render_scaleout(d: dict) -> str:
    rows = []
    for arm, r in d["arms"].items():
        spread = ", ".join(f"{w['shared_tokens_seen']}" for w in r["workers"])
        rows.append([f"`{arm}`", num(r["reuse_ratio"]), num(r.get("reuse_gap_to_one_worker")),
                     num(r.get("same_answers_as_one_worker")), spread, num(r["ttft_s_mean_agents_2_on"], ".2f", " s")])
    return (f"GSM8K `refer` workflow, {d['samples']} samples (one workflow each), {d['agents']} agents, "
            f"{d['max_tokens']} tokens per answer, mode `{d['mode']}`, {d['concurrency']} workflows in flight. "
            f"Target: the affinity arms' reuse within {d['target_gap']} of `one_worker`'s.\n\n"
            + table(["arm", "reuse", "gap to one worker", "final answers equal one worker's",
                     "shared tokens seen per worker", "TTFT agents 2-4 (mean)"], rows))


def render_tp_kvcmas(d: dict) -> str:
    rows = []
    for tp, r in d["sizes"].items():
        vs = r.get("vs_tp1") or {}
        digests = "-" if r.get("digests_equal") is None else ("equal" if r["digests_equal"] else "**differ**")
        rows.append([tp, str(r["requests"]), num(r["reuse_ratio"]), str(r["tokens_corrected"]),
                     num(r["top1_agents_2_4"], ".4f"), num(r["kl_agents_2_4"], ".5f"), num(vs.get("reuse_ratio")),
                     num(vs.get("top1_difference"), "+.4f"),
                     "-" if not vs else ("yes" if vs.get("agent1_greedy_identical") else "no"), digests])
    soaks = [f"TP={tp}: {r['soak']['sent']} more requests over new contexts, {r['soak']['ok']} answered, "
             f"{r['soak']['aborted']} aborted mid-answer, {r['soak']['failed']} failed, {r['soak']['mode_switches']} "
             f"mode switches; rank digests {'equal' if r['soak']['digests_equal'] else '**differ**'} after it "
             f"({r['soak']['tp_ranks'][0]['gate_decisions']} decisions each)."
             for tp, r in d["sizes"].items() if r.get("soak")]
    return (f"{d['chains']} chains of {d['agents']} agents over {d['length']} shared tokens, {d['max_tokens']} "
            "answer tokens per agent; top-1 and KL of agents 2-4 against `off` at the same TP size.\n\n"
            + table(["TP", "requests", "reuse", "tokens corrected", "top-1", "KL", "reuse / TP=1's",
                     "top-1 - TP=1's", "agent 1 greedy = TP=1's", "rank digests"], rows)
            + "".join(f"\n\nSoak, {line}" for line in soaks))


def render_warm_start(d: dict) -> str:
    rows = []
    for arm in ("cold", "warm", "fullshared"):
        r = d.get(arm)
        if not r:
            continue
        served = ", ".join(f"{n} {how}" for how, n in sorted(r["served_as"].items(), key=lambda kv: -kv[1]))
        t = r["b_ttft_s"]
        total = sum(q["b_ttft_s"] for q in r["requests"])
        rows.append([arm, str(r["anchors_loaded"]), served, num(r["reuse"]), num(r["corrected_share"]),
                     f"{num(t['median'], '.3f')} ({num(t['min'], '.3f')}-{num(t['max'], '.3f')}) s",
                     num(total, ".1f", " s"), num(r["b_over_a_ttft"]), num(r["top1"], ".4f"), num(r["kl"], ".5f"),
                     str(r["positions"])])
    saved = d["saved"]
    return (f"{d['eval']} new documents of {d['length']} tokens, each read by agent `{d['agents'][0]}` (dense) and "
            f"then by `{d['agents'][1]}` behind its own system prompt, on one fresh server per arm. The pool file "
            f"came from a server that read {d['teach']} other documents with the same agents: "
            f"{saved['anchors']} anchors of {saved['slots']} slot(s), {saved['bytes'] / 2**20:.0f} MiB. Top-1 and "
            f"KL: B's own {d['max_tokens']}-token answer teacher-forced through an exact prefill of the same "
            "prompt.\n\n"
            + table(["arm", "anchors loaded", "B's document served as", "reuse", "corrected", "B TTFT, median (min-max)",
                     "B TTFT, all requests", "B / A TTFT (median)", "top-1", "KL", "positions"], rows))


def _phase(cell: dict, unit: float = 1e3, fmt: str = ".1f") -> str:
    return (f"{format(cell['median_s'] * unit, fmt)} ({format(cell['min_s'] * unit, fmt)}-"
            f"{format(cell['max_s'] * unit, fmt)})")


def render_assembly_cost(d: dict) -> str:
    rows = [[str(r["length"]), str(r["anchors"]), _phase(r["read"]), _phase(r["estimate"]), _phase(r["plan_args"]),
             _phase(r["write"]), f"{r['corrected_total_s'] * 1e3:.1f}", _phase(r["align_only"])] for r in d["rows"]]
    return (f"{d['torch_threads']} torch threads; pool of {d['shapes']['pool_rows']} rows, rank "
            f"{d['shapes']['rank']}. Milliseconds, median (min-max).\n\n"
            + table(["tokens", "anchors", "read", "estimate", "plan args", "write", "corrected total",
                     "align only (fullshared)"], rows))


def render_learn_cost(d: dict) -> str:
    rows = [[str(r["length"]), r["method"], num(r["residual_over_svd"], ".5f"), _phase(r["with_base"], 1, ".3f"),
             _phase(r["deltas_only"], 1, ".3f")] for r in d["rows"]]
    return (f"{d['torch_threads']} torch threads; rank {d['shapes']['rank']}. Seconds, median (min-max).\n\n"
            + table(["tokens", "method", "residual / exact SVD's", "with base (first observation of a content)",
                     "deltas only (a known content)"], rows))


def render_idle_thread(d: dict) -> str:
    rows = []
    for state, c in d["summary"].items():
        ratio = d.get(f"{state}_over_before")
        rows.append([f"`{state}`", f"{c['median_us']:.0f} ({c['min_us']:.0f}-{c['max_us']:.0f})",
                     spread(ratio) if ratio else "1.00"])
    return (f"Op: {d['op']}; side thread: {d['side_thread_work']}; {d['torch_threads']} torch threads, "
            f"{len(d['repeats'])} repeats.\n\n"
            + table(["state", "main thread op time, us: median (min-max)", "x `before`"], rows))


def render_profile(d: dict) -> str:
    threads = ", ".join(f"{k} {v:.2f}" for k, v in d["scheduler_threads_share"].items())
    top = [[f"`{r['function']}`", f"{r['share_of_loop']:.3f}"] for r in d["event_loop_self_top"][:5]]
    kv = [[f"`{r['function']}`", f"{r['share_of_loop']:.3f}"] for r in d["event_loop_inclusive_kvshare"][:5]]
    return (f"Mode `{d['mode']}`, {d['length']} shared tokens, {d['chains']} chains, py-spy at {d['rate_hz']} Hz. "
            f"{d['note']}. Scheduler samples {d['scheduler_samples']}; share by thread: {threads}.\n\n"
            "Event loop, self time (top 5):\n\n" + table(["function", "share of loop"], top)
            + "\n\nEvent loop, inclusive time of kvshare functions (top 5):\n\n" + table(["function", "share of loop"], kv))


TEXT_TAIL = 4


def render_text(d: dict) -> str:
    """The last lines of a script's saved output (the whole of it is the linked file)."""
    lines = d["text"].rstrip("\n").splitlines()
    head = (f"The last {TEXT_TAIL} of the script's {len(lines)} output lines:" if len(lines) > TEXT_TAIL
            else "The script's output:")
    return head + "\n\n```\n" + "\n".join(lines[-TEXT_TAIL:]) + "\n```"


# ------------------------------------------------------------------ plots
def _plot_from(module: str, function: str) -> Callable[[Any, Path], None]:
    """A benchmark module's own plot function, imported only when plots are drawn (the imports are heavy)."""
    def draw(data: Any, path: Path) -> None:
        import importlib

        getattr(importlib.import_module(module), function)(data, path)
    return draw


def plot_chain(d: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({int(length) for per_len in d["arms"].values() for length in per_len})
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.2), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        arms = [a for a, per_len in d["arms"].items() if str(length) in per_len]
        cells = [d["arms"][a][str(length)] for a in arms]
        med = [c["ttft_agents_2_4_s"]["median"] for c in cells]
        err = [[m - c["ttft_agents_2_4_s"]["min"] for m, c in zip(med, cells)],
               [c["ttft_agents_2_4_s"]["max"] - m for m, c in zip(med, cells)]]
        xs = list(range(len(arms)))
        ax.bar(xs, med, yerr=err, capsize=3, color="tab:blue", alpha=0.8, label="TTFT agents 2-4 (median, min-max)")
        ax.scatter(xs, [c["floor_agents_2_4_s"]["median"] for c in cells], marker="_", s=600, color="black",
                   label="exact-hit floor", zorder=3)
        ax.set_xticks(xs, arms, rotation=30, ha="right")
        ax.set_ylabel("seconds")
        ax.set_title(f"shared context {length} tokens")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(f"4-agent chain, {hardware(d['meta'])}, {date_of(d['meta'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ the registry
FRONTIER_READING = (
    "Per arm: `reuse ratio` = consumer shared tokens served by alignment or correction (a recomputed head counts as "
    "prefilled); agreement with `off`'s final answers; the gap to the random-mix line (`fullshared` with a random "
    "share of segments prefilled densely: what a coin buys at that reuse; an arm adds value only above it) with a "
    "95 % interval; teacher-forced top-1 and KL against `off` on `off`'s own continuation (KL over `off`'s top-20 "
    "support: a lower bound of the full KL); accuracy with its paired difference to `off`. The target region is "
    "reuse >= 0.7 with top-1 >= 0.99 and KL <= 0.3x `fullshared` K=0's.")

REGISTRY: list[Benchmark] = [
    Benchmark(
        "chain_ttft", "chain_ttft.json",
        "python -m benchmarks.chain_ttft --lengths 1024 4096 --repeats 3 "
        "--arms stock off fullshared kvcmas fullshared:8 kvcmas:8 fullshared:8@sparse-extend=false "
        "fullshared@recompute-ratio=0.15",
        "How much faster do agents 2-4 of a 4-agent chain get their first token when the shared context is reused, "
        "and how close is that to an exact prefix hit?",
        "Four agents read the same context of real text, each behind its own system prompt, one fresh server per arm. "
        "`floor` is the same request sent again at once (an exact radix hit, the engine's own per-request cost); "
        "`reuse / floor` near 1 means reuse costs little more than a hit. `assembly / dense prefill` is the server's "
        "assembly time against the dense prefill it replaces. `dense probe while learning` times requests of new "
        "contents while a kvcmas learner still has observations queued. Speed only: the fidelity of these modes is "
        "in the frontier and fidelity sections.",
        render_chain, plot_chain),
    Benchmark(
        "demo", "demo.json", "python -m benchmarks.demo --out benchmarks/results/demo.json",
        "What does the shipped demo, a 4-agent GSM8K team on one kvshare server in the recommended setting, prefill "
        "and reuse per request, and how soon does each agent get its first token?",
        "Each agent reads the question and the previous agent's answer as shared segments behind its own system "
        "prompt. `prefilled` counts what the server computed (a recomputed share of a reused segment included); "
        "`reused` what it served aligned or corrected. Speed and reuse only: fidelity is in the frontier sections.",
        render_demo, optional=True),
    Benchmark(
        "frontier_heldout", "frontier_heldout.json",
        "python -m benchmarks.frontier --roles heldout (the section names the exact command)",
        "On role prompts no setting was chosen on, which mode keeps `off`'s answers and distributions at which "
        "reuse?",
        FRONTIER_READING, render_frontier_heldout, _plot_from("benchmarks.frontier", "plot"), results_png=True,
        optional=True),
    Benchmark(
        "stock_vs_off", "stock_vs_off.json", "python -m benchmarks.stock_vs_off",
        "Does `--kvshare-mode off` cost anything against stock SGLang, to 2 %?",
        "Both servers run at once and the same request goes to one, then the other, in ABBA order, one in flight at "
        "a time, so the machine's drift cancels in the paired ratio `off / stock`. \"within\" means the whole 95 % "
        "interval of the median ratio lies inside 1 +- 2 %.",
        render_stock_vs_off, _plot_from("benchmarks.stock_vs_off", "plot"), results_png=True),
    Benchmark(
        "serving", "serving.json",
        "python -m benchmarks.serving --lengths 512 1024 --rates 0.1 0.2 --output-tokens 32 --repeats 3",
        "What TTFT does a 4-agent team see under load (Poisson arrivals of workflows), per mode?",
        "Each workflow is a chain planner -> researcher -> coder -> reviewer; every agent reads the shared context "
        "and the previous agent's output as shared segments. A repeat is 3 workflows (12 requests), so a single "
        "repeat's ratio moves with how the arrivals overlap: read the median of the repeats. `bound` is the "
        "arithmetic ceiling 1/(1-rho) for the share rho of prefill tokens saved. Speed only.",
        render_serving, _plot_from("benchmarks.serving", "make_plot"), results_png=True),
    Benchmark(
        "workflow_gsm8k", "workflow_gsm8k.json",
        "python -m benchmarks.workflow --task gsm8k --topology refer --agents 4 --limit 50 --max-tokens 128 "
        "--concurrency 8 --mode off,kvcmas --compare off",
        "On the GSM8K `refer` workflow (3 role agents answer, a final agent reads all three answers), how fast are "
        "agents 2-4 and how many final answers stay those of `off`?",
        "Agreement with `off` is the fidelity measure (the 135M model solves almost none of the questions, so "
        "accuracy moves by single samples). TTFT includes queueing behind the other samples in flight.",
        render_workflow),
    Benchmark(
        "workflow_humaneval", "workflow_humaneval.json",
        "python -m benchmarks.workflow --task humaneval --topology refer --agents 4 --limit 50 --max-tokens 128 "
        "--concurrency 8 --mode off,fullshared,kvcmas --compare off",
        "On the HumanEval `refer` workflow, how much is reused and how many final programs stay those of `off`?",
        "Pass/fail agreement is high in every mode because the model fails most problems either way; identical "
        "final text is the sharper measure. Read this file's note before comparing TTFT.",
        render_workflow),
    Benchmark(
        "frontier_retrieval", "frontier_retrieval.json",
        "python -m benchmarks.frontier --task retrieval --limit 100 --warmup 8 --heads 0 8 32 --mix 0.5 "
        "--arms off,fullshared_k0,mix_p0.5,kvcmas_k0,kvcmas_k8,fullshared_k8,kvcmas_k32,fullshared_k32",
        "On a synthetic 12-fact lookup task shared by four agents, which mode keeps `off`'s answers at which reuse, "
        "and is it better than a coin?",
        FRONTIER_READING, render_frontier, _plot_from("benchmarks.frontier", "plot"), results_png=True),
    Benchmark(
        "frontier_retrieval_1000", "frontier_retrieval_1000.json",
        "python -m benchmarks.frontier --task retrieval --limit 334 --seed S --warmup 8 --heads 0 --mix "
        "--ratios 0.15 --arms off,fullshared_r0.15 --tag _1000 for S = 1 and 9, then --pool OUT RUN1 RUN9",
        "Does the recommended setting (`fullshared`, 15 % of each reused segment recomputed) keep retrieval "
        "accuracy within 1 point of `off` over paired lookups on contents no other run used (seeds 1 and 9, 1002 "
        "lookups each, pooled)?",
        FRONTIER_READING + " Only `off` and the recommended arm ran here (no random-mix points), so the line gaps "
        "are not defined.",
        render_frontier, _plot_from("benchmarks.frontier", "plot"), results_png=True, optional=True),
    Benchmark(
        "frontier_gsm8k", "frontier_gsm8k.json",
        "python -m benchmarks.frontier --task gsm8k --limit 50 --max-tokens 128 --concurrency 8 --heads 0 8 16 32 "
        "--mix 0.5",
        "On the GSM8K `refer` workflow, which mode keeps `off`'s answers and distributions at which reuse?",
        FRONTIER_READING, render_frontier, _plot_from("benchmarks.frontier", "plot"), results_png=True),
    Benchmark(
        "frontier_humaneval", "frontier_humaneval.json",
        "python -m benchmarks.frontier --task humaneval --limit 50 --max-tokens 128 --concurrency 8 --heads 0 8 32 "
        "--mix 0.5",
        "On the HumanEval `refer` workflow, which mode keeps `off`'s programs and distributions at which reuse?",
        FRONTIER_READING, render_frontier, _plot_from("benchmarks.frontier", "plot"), results_png=True),
    Benchmark(
        "fidelity", "fidelity.json", "python -m benchmarks.fidelity",
        "Offline, on the real model and contents it has never seen: how far is each reuse mode's next-token "
        "distribution from NonShared (exact dense prefill), at what reuse and anchor memory?",
        "KL(NonShared || mode) over the consumer's suffix tokens, top-1 agreement and a 32-token greedy continuation, "
        "per consumer segment; `head K` prefills the first K tokens of each reused segment densely. The oracle row "
        "(the content's own exact delta) is not deployable: it bounds what a correction could do.",
        render_fidelity, _plot_from("benchmarks.fidelity", "plot"), results_png=True),
    Benchmark(
        "kernels", "kernels_cpu.json", "python -m benchmarks.kernels",
        "What do the gate, the token weights and the correction cost next to the dense prefill they replace?",
        "One CPU thread, the model's shapes; the fused rows are the torch path a CPU server runs. A served correction "
        "runs the gate on at most 128 rows, token distances twice (K and V) and align + correct once.",
        render_kernels),
    Benchmark(
        "soak", "soak_quick.json", "python -m benchmarks.soak --quick",
        "Does a kvshare server survive concurrent clients, malformed and adversarial annotations and admin calls "
        "with no crash, no 5xx, no lost request and exact answers for plain requests?",
        "Each verdict is a check over the whole run; plain requests are replayed against an `off` server and must "
        "give the same tokens.",
        render_soak),
    Benchmark(
        "adversary", "adversary.json", "python -m benchmarks.adversary",
        "Do hostile clients and hostile launch files (long chats, floods of agent names, pins past the bounds, "
        "verification with n > 1, streams, logprobs and constrained sampling, forged workflow labels) leave the "
        "server answering, its tenants apart and its secrets unseen?",
        "One server, every attack in turn; each verdict is one attack's check. Secrets: the run's random cache salts, "
        "extra keys and the guard file's key, looked for in every answer, admin route and `/metrics`.",
        render_adversary, optional=True),
    Benchmark(
        "guard", "guard.json", "python -m benchmarks.guard --seed 13 --offset 700 --task-offset humaneval=110",
        "Does the fidelity guard's estimate hold the truth, does it keep a target at more reuse than one global "
        "recomputed head, does it catch a bad scope, and what does it cost?",
        "Calibration: every request served approximated KV is replayed densely by the benchmark; each agent's mean "
        "over all of them should lie inside the interval the guard reports from its sample. Guarded: fullshared K=0 "
        "with the guard keeping the target per agent (verify burst on; the controller's rule is given below the "
        "table), against fixed heads for every agent (best: the most reuse whose teacher-forced top-1 against "
        "`off` meets the bound). Detection: noise in one shared slot's KV; the verified samples until its readers "
        "were served dense, while renamed twins of the workflow on intact slots "
        "keep their reuse. Overhead: two servers up, paired requests in ABBA order, roles swapped halfway.",
        render_guard, _plot_from("benchmarks.guard", "plot"), results_png=True, optional=True),
    Benchmark(
        "langgraph_reuse", "langgraph_reuse.json", "python -m benchmarks.langgraph_reuse",
        "Pointed at a `--kvshare-auto` server, how much of the text an unchanged LangGraph team sends more than "
        "once is reused, and do its answers stay those of a stock server?",
        "`reuse of repeated message tokens`: message tokens reused by alignment over those not new to the server.",
        render_langgraph),
    Benchmark(
        "scaleout", "scaleout.json", "python -m benchmarks.scaleout --limit 16",
        "On two workers (`--dp-size 2`, or two servers behind SGLang's router), does a workflow keep the reuse it "
        "gets on one, with affinity, and how much does it lose without?",
        "Fresh servers per arm, one core per worker. `reuse` = a workflow's shared tokens served without prefill "
        "over its shared tokens; `dp2_none` names no workflow (SGLang's round robin), `router_none` sends no routing "
        "header (the router's random choice; the annotation still arrives).",
        render_scaleout, optional=True),
    Benchmark(
        "tp_kvcmas", "tp_kvcmas.json", "python -m benchmarks.tp_kvcmas --chains 12 --soak 200",
        "Does `kvcmas` at tensor-parallel size 3 (each rank learning its own KV heads, the gate reduced over the "
        "ranks) reuse and keep `off`'s distributions as it does at size 1?",
        "One server per TP size; its `off` references come from the same server (mode switched at runtime), so each "
        "size is scored against its own dense numerics. Targets: reuse >= 0.9x TP=1's, top-1 within 0.005, agent 1's "
        "greedy answers identical, every rank's gate digest equal.",
        render_tp_kvcmas, optional=True),
    Benchmark(
        "warm_start", "warm_start.json", "python -m benchmarks.warm_start",
        "How does a new kvcmas server serve its first requests, with empty pools and with pools saved by an earlier "
        "server of the same agents (`--kvshare-pool-file`), and how does that compare with `fullshared`?",
        "`cold`: empty pools (a new edge is aligned, and about every other new document prefilled densely, while "
        "it learns); `warm`: the same server launched with the saved file. One run of this machine; the arms "
        "ran one after another on the same documents.",
        render_warm_start, optional=True),
    Benchmark(
        "assembly_cost", "assembly_cost.json",
        "python -m benchmarks.research.assembly_cost --lengths 512 1024 4096 --anchors 3 6 10 --repeats 7",
        "What does assembling one corrected segment cost, by phase, with the server's own calls?",
        "The same calls the server makes (read the source, estimate, plan, write), alone on the CPU.",
        render_assembly_cost),
    Benchmark(
        "learn_cost", "learn_cost.json", "python -m benchmarks.research.learn_cost --repeats 3",
        "What does learning one observation cost per factorization method, and is each method exact?",
        "`residual / exact SVD's` = 1.0 is the optimal rank-32 truncation.",
        render_learn_cost),
    Benchmark(
        "idle_torch_thread", "idle_torch_thread.json",
        "python -m benchmarks.research.idle_torch_thread --repeats 5 --iterations 2000",
        "Does a thread that once ran torch ops slow the main thread's ops while it idles or computes?",
        "One process, so the ratios to `before` are within one run. `single_*`: the side thread's ops run on that "
        "thread alone.",
        render_idle_thread),
    Benchmark(
        "profile_scheduler", "profile_kvcmas.json", "python -m benchmarks.research.profile_scheduler",
        "Where does a kvcmas server's scheduler spend its CPU time under the chain workload?",
        "py-spy samples of the scheduler process; read the shares, not the seconds (sampling slows the server).",
        render_profile),
    Benchmark(
        "fidelity_variants", "fidelity_variants.json", "python -m benchmarks.research.fidelity_variants",
        "Does any form of the correction lower the KL of `fullshared` + the same recomputed head?",
        "Variants are chosen on the warm contents only (leave one out) by a rule fixed before the run, then checked "
        "once on the held-out contents of the fidelity benchmark.",
        render_fidelity_variants),
    Benchmark(
        "diagnose_dense_consumers", "diagnose_dense_consumers.txt",
        "python -m benchmarks.research.diagnose_dense_consumers 12 1 0.5 > "
        "benchmarks/results/diagnose_dense_consumers.txt",
        "Do consumers that were prefilled densely in a reusing server give `off`'s answers?",
        "A dense consumer's cached rows are exact up to float32 rounding, which depends on which earlier request "
        "computed them: the first-token logprobs of every dense consumer within about 2e-5 of `off`'s.",
        render_text),
]
BY_NAME = {b.name: b for b in REGISTRY}


def present(results: Path = RESULTS) -> list[Benchmark]:
    """The entries the report covers: every required one (missing, ``load`` raises) and the optional ones whose
    file is there."""
    return [b for b in REGISTRY if not b.optional or (results / b.file).is_file()]


def canonical_files(results: Path = RESULTS) -> set[str]:
    """Every file ``results`` may hold: the covered entries' files and the plots their benchmarks draw."""
    entries = present(results)
    files = {b.file for b in entries}
    files |= {Path(b.file).with_suffix(".png").name for b in entries if b.results_png}
    return files


# ------------------------------------------------------------------ headline
def _frontier_headline(d: dict) -> tuple[str, str, str]:
    """The arm with the highest teacher-forced top-1 at reuse >= 0.7 (lowest KL on a tie; at any reuse when no arm
    reaches 0.7), with its fidelity and its TTFT against `off`'s."""
    arms = d["arms"]
    cands = [(n, a) for n, a in arms.items() if n != "off" and a.get("random_mix_p") is None
             and a.get("teacher_forced_top1") is not None]
    high = [(n, a) for n, a in cands if (a.get("reuse_ratio") or 0) >= 0.7]
    name, a = max(high or cands, key=lambda na: (na[1]["teacher_forced_top1"], -na[1]["teacher_forced_kl"]))
    base = (arms.get("fullshared_k0") or {}).get("teacher_forced_kl")
    paired = a.get("accuracy_vs_off_paired") or {}
    what = "pass/fail agreement" if d["task"] == "humaneval" else "final-answer agreement"
    fidelity = (f"reuse {a['reuse_ratio']:.2f}; teacher-forced top-1 {a['teacher_forced_top1']:.4f}, KL "
                f"{a['teacher_forced_kl']:.5f}" + (f" ({a['teacher_forced_kl'] / base:.2f}x `fullshared` K=0)"
                                                   if base else "")
                + f"; {what} {a['agreement_final']:.2f}; accuracy {paired.get('mean', 0):+.3f} "
                  f"{interval(paired.get('ci95'))} vs `off` ({d['scored_items']} items)")
    t = (a.get("ttft_agents_2_4_s") or {}).get("median")
    off_t = (arms["off"].get("ttft_agents_2_4_s") or {}).get("median")
    own_off = a.get("off_ttft_agents_2_4_median_same_run")
    if t is None:  # pooled runs: medians do not pool
        speed = "TTFT per run in the section"
    elif d.get("commands") and own_off:  # merged parts: the ratio within the arm's own part
        speed = (f"TTFT agents 2-4 median {t:.2f} s against its own part's `off` {own_off:.2f} s "
                 f"({own_off / t:.2f}x)")
    elif d.get("commands"):  # merged parts: each part had its own off, so no ratio across parts
        speed = (f"TTFT agents 2-4 median {t:.2f} s (`off` {off_t:.2f} s; the arms ran in parts, each with its "
                 f"own `off`)")
    else:
        speed = f"TTFT agents 2-4 median {t:.2f} s against `off`'s {off_t:.2f} s ({off_t / t:.2f}x)"
    figure = f"best top-1{' at reuse >= 0.7' if high else ''}: `{name}`; {speed}"
    return f"Fidelity frontier, {d['task']}", figure, fidelity


def _chain_headline(d: dict) -> tuple[str, str, str]:
    """Each plain mode's (no ``:K`` or ``@setting``) speedup against `off` and ratio to the exact hit, per length."""
    figs = []
    for arm, per_len in d["arms"].items():
        if arm in ("off", "stock") or ":" in arm or "@" in arm:
            continue
        for length, cell in per_len.items():
            figs.append(f"`{arm}` {int(length) / 1024:g}K: {cell['speedup_vs_off_agents_2_4']['median']:.2f}x "
                        f"`off`, {cell['reuse_over_floor']['median']:.2f}x the exact hit")
    repeats = {c["ttft_agents_2_4_s"]["n"] for per_len in d["arms"].values() for c in per_len.values()}
    return (f"4-agent chain, agents 2-4 TTFT (median of {'/'.join(map(str, sorted(repeats)))} repeats)",
            "; ".join(figs), "not measured here (speed only; see the frontier rows)")


def _demo_headline(d: dict) -> tuple[str, str, str]:
    t, s = d["totals"], d["settings"]
    ttft = ""
    if t.get("ttft_s_mean_agents_2_4") is not None:
        ttft = (f"; mean TTFT agents 2-4 {t['ttft_s_mean_agents_2_4']:.2f} s (agent 1 "
                f"{t['ttft_s_mean_agent_1']:.2f} s)")
    return (f"Demo: 4-agent GSM8K team, `{s['kvshare_mode']}` recompute {s['recompute_ratio']:g}, "
            f"{t['requests']} requests",
            f"{t['prompt_tokens']} prompt tokens, {t['prefill_tokens']} prefilled, {t['reused_tokens']} reused: reuse "
            f"ratio {t['reuse_ratio']:.2f} of {t['shared_tokens']} shared tokens{ttft}",
            "not measured here (see the frontier rows)")


def _stock_headline(d: dict) -> tuple[str, str, str]:
    t, tp = d["ttft"]["verdict"], d["throughput"]["verdict"]
    return ("`off` against stock SGLang (paired ABBA requests)",
            f"TTFT ratio {t['median']:.3f} {interval(t['ci95'], '.3f')}, throughput {tp['median']:.3f} "
            f"{interval(tp['ci95'], '.3f')} (median [95 % interval])", "`off` serves exact KV only")


def _heldout_headline(d: dict) -> tuple[str, str, str]:
    title, figure, fidelity = _frontier_headline(d)
    return f"{title}, held-out roles, {d['segment_tokens']}-token segments", figure, fidelity


HEADLINE: dict[str, Callable[[dict], tuple[str, str, str]]] = {
    "chain_ttft": _chain_headline, "demo": _demo_headline, "frontier_heldout": _heldout_headline,
    "stock_vs_off": _stock_headline}
"""The headline rows, in order: (result, figure, fidelity) from a canonical file. A row whose file is an optional
entry's and missing is left out."""


def headline_entries(results: Path = RESULTS) -> list[Benchmark]:
    covered = {b.name for b in present(results)}
    return [BY_NAME[name] for name in HEADLINE if name in covered]


def headline_rows(results: Path = RESULTS, link: str = "", tree: Optional[str] = None) -> list[list[str]]:
    tree = serving_digest() if tree is None else tree
    rows = []
    for entry in headline_entries(results):
        data = load(entry, results)
        try:
            result, figure, fidelity = HEADLINE[entry.name](data)
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
            raise ReportError(f"headline: {results / entry.file} lacks a field the headline reads ({exc!r})") from exc
        meta = data["meta"]
        rows.append([result, figure, fidelity, hardware(meta), date_of(meta), cell_mark(freshness(data, tree)),
                     f"[{entry.name}]({link}#{entry.name})"])
    return rows


def headline_markdown(results: Path = RESULTS, link: str = "", tree: Optional[str] = None) -> str:
    """The headline table and its legend; ``link`` prefixes its section links (README's copy points into
    RESULTS.md)."""
    return (table(["result", "figure", "fidelity against `off`", "measured on", "date", "code", "section"],
                  headline_rows(results, link, tree)) + "\n\n" + LEGEND)


def stale_headline(results: Path = RESULTS, tree: Optional[str] = None) -> list[tuple[str, str, list[str]]]:
    """(name, why stale, the commands that measure it again) of every stale headline row, in table order.

    A merged or pooled file names its parts' commands, then its own (the merge)."""
    tree = serving_digest() if tree is None else tree
    out = []
    for entry in headline_entries(results):
        data = load(entry, results)
        why = freshness(data, tree)
        if why is not None:
            out.append((entry.name, why, [*(data.get("commands") or []), data["meta"]["command"]]))
    return out


README = ROOT / "README.md"
README_BEGIN, README_END = "<!-- headline-results:begin -->", "<!-- headline-results:end -->"


def readme_with_headline(text: str, results: Path = RESULTS, tree: Optional[str] = None) -> str:
    """README's text with the generated headline table between its markers."""
    if README_BEGIN not in text or README_END not in text:
        raise ReportError(f"README.md lacks the markers {README_BEGIN} ... {README_END}")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    block = ["<!-- generated by `python -m benchmarks.report` from benchmarks/results/; do not edit -->", "",
             headline_markdown(results, link="docs/RESULTS.md", tree=tree), ""]
    return head + README_BEGIN + "\n" + "\n".join(block) + README_END + tail


# ------------------------------------------------------------------ the document
def body_of(entry: Benchmark, data: Any, results: Path) -> str:
    try:
        return entry.render(data)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as exc:
        raise ReportError(f"{results / entry.file}: malformed for benchmark {entry.name!r} "
                          f"(its section cannot read {exc!r})") from exc


def section(entry: Benchmark, data: Any, results: Path, stale: Optional[str] = None) -> str:
    """One benchmark's short section: a paragraph (question, reading, file, plot, measurement, the body's opening
    note) and its key table; a research benchmark's tables stand in RESULTS_DETAIL.md, linked."""
    body = body_of(entry, data, results)
    meta = data["meta"]
    recipe = "" if meta.get("command") == entry.command else f" Recipe: `{entry.command}`."
    plot = f", plot [`{entry.name}.png`](results/{entry.name}.png)" if entry.plot is not None else ""
    if entry.detail:
        body = f"Tables: [research/RESULTS_DETAIL.md](research/RESULTS_DETAIL.md#{entry.name})."
    note, _, rest = body.partition("\n\n")
    if note.startswith(("|", "```")):
        note, rest = "", body
    out = [f'## <a id="{entry.name}"></a>{entry.name}{header_mark(stale)}', "",
           f"**Question.** {entry.question} **Reading.** {entry.reading} File "
           f"[`benchmarks/results/{entry.file}`](../benchmarks/results/{entry.file}){plot}. {meta_line(meta)}"
           f"{recipe}" + (f" {note}" if note else ""), ""]
    return "\n".join(out + ([rest, ""] if rest else []))


def render_detail(results: Path = RESULTS) -> str:
    """docs/research/RESULTS_DETAIL.md's text: the tables of the research benchmarks (``detail`` entries)."""
    parts = ["# Results: research benchmarks' tables", "",
             "<!-- Generated by `python -m benchmarks.report` from benchmarks/results/. Do not edit by hand. -->", "",
             "The tables of the research benchmarks (`benchmarks/research/`); what each asks, how it was measured "
             "and whether its serving code is this tree's: [docs/RESULTS.md](../RESULTS.md).", ""]
    for entry in present(results):
        if entry.detail:
            parts += [f"## {entry.name}", "", body_of(entry, load(entry, results), results), ""]
    return "\n".join(parts).rstrip("\n") + "\n"


def render(results: Path = RESULTS, tree: Optional[str] = None) -> str:
    """docs/RESULTS.md's text from the canonical files in ``results``, marked against the serving code whose digest
    is ``tree`` (default: this working tree's)."""
    tree = serving_digest() if tree is None else tree
    entries = present(results)
    data = {b.name: load(b, results) for b in entries}
    stale = {b.name: freshness(data[b.name], tree) for b in entries}
    index = table(["benchmark", "question", "code"],
                  [[f"[{b.name}](#{b.name})", b.question, cell_mark(stale[b.name])] for b in entries])
    parts = [
        "# Results",
        "",
        "<!-- Generated by `python -m benchmarks.report` from benchmarks/results/. Do not edit by hand. -->",
        "",
        "Generated by `python -m benchmarks.report` from the canonical results files in `benchmarks/results/` (one "
        "per benchmark): re-run a benchmark's command, then the report. `--check` fails when this file differs from "
        "what the files give; `--check-fresh` when a headline row was measured on other serving code. Each section "
        "names the hardware, date, revision, serving digest and command of its measurement. Ratios against `off` "
        "are taken within one run; seconds move between runs of a shared machine.",
        "",
        "## Index",
        "",
        index,
        "",
        "## Headline results",
        "",
        "Speed next to fidelity against `off` (exact prefill) wherever the same run measured it.",
        "",
        headline_markdown(results, tree=tree),
        "",
    ]
    parts += [section(b, data[b.name], results, stale[b.name]) for b in entries]
    return "\n".join(parts).rstrip("\n") + "\n"


def write_plots(results: Path = RESULTS, out_dir: Path = PLOTS) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for b in present(results):
        if b.plot is None:
            continue
        path = out_dir / f"{b.name}.png"
        b.plot(load(b, results), path)
        written.append(path)
    return written


def check(doc: Path = DOC, results: Path = RESULTS, readme: Optional[Path] = README,
          tree: Optional[str] = None, detail: Optional[Path] = DETAIL) -> tuple[bool, str]:
    """Whether ``doc`` (and README's headline block, and ``detail``) is what the results give: (ok, what to say).

    Freshness marks are left out of the comparison: a change of the serving code turns results stale without
    making the documents wrong about what the files hold (``--check-fresh`` fails on that). When only the marks
    differ, ok is True and the message says so; otherwise the message is a short unified diff."""
    tree = serving_digest() if tree is None else tree
    pairs = [(doc, render(results, tree))]
    if readme is not None:
        pairs.append((readme, readme_with_headline(readme.read_text(), results, tree)))
    if detail is not None:
        pairs.append((detail, render_detail(results)))
    diff: list[str] = []
    marks = []
    for path, want in pairs:
        have = path.read_text() if path.is_file() else ""
        if have == want:
            continue
        if without_marks(have) == without_marks(want):
            marks.append(str(path))
            continue
        diff += list(difflib.unified_diff(have.splitlines(), want.splitlines(), str(path), "generated",
                                          lineterm="", n=1))
    if diff:
        return False, "\n".join(diff[:60]) + ("\n..." if len(diff) > 60 else "")
    if marks:
        return True, (f"note: the stale marks of {', '.join(marks)} are not this tree's (its serving code changed); "
                      "python -m benchmarks.report updates them")
    return True, ""


def check_fresh(results: Path = RESULTS, tree: Optional[str] = None) -> tuple[bool, str]:
    """Whether every headline row was measured on the serving code of this tree: (ok, what to say), naming each
    stale row and the commands that measure it again."""
    stale = stale_headline(results, tree)
    if not stale:
        return True, "every headline row was measured on this tree's serving code"
    lines = [f"{len(stale)} headline row(s) measured on other serving code; measure them again:"]
    for name, why, commands in stale:
        lines.append(f"  {name} ({why}):")
        lines += [f"    {c}" for c in commands]
    return False, "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 with a diff when docs/RESULTS.md differs from what the JSON gives "
                         "(freshness marks aside)")
    ap.add_argument("--check-fresh", action="store_true",
                    help="write nothing; exit 1 naming each headline row measured on other serving code than this "
                         "tree's, with the commands that measure it again")
    ap.add_argument("--no-plots", action="store_true", help="write docs/RESULTS.md only")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the canonical results files")
    ap.add_argument("--out", type=Path, default=DOC, help="the markdown file (default docs/RESULTS.md)")
    args = ap.parse_args(argv)
    try:
        if args.check or args.check_fresh:
            status = 0
            if args.check:
                default = args.out == DOC
                ok, message = check(args.out, args.results, README if default else None,
                                    detail=DETAIL if default else None)
                if not ok:
                    print(f"{args.out} differs from what the results give; run python -m benchmarks.report\n"
                          f"{message}", file=sys.stderr)
                    status = 1
                else:
                    print(f"{args.out} is up to date" + (f"\n{message}" if message else ""))
            if args.check_fresh:
                ok, message = check_fresh(args.results)
                print(message, file=sys.stdout if ok else sys.stderr)
                status = status or (0 if ok else 1)
            return status
        text = render(args.results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
        if args.out == DOC:
            README.write_text(readme_with_headline(README.read_text(), args.results))
            print(f"wrote the headline block of {README}")
            DETAIL.parent.mkdir(parents=True, exist_ok=True)
            DETAIL.write_text(render_detail(args.results))
            print(f"wrote {DETAIL}")
        if not args.no_plots:
            for path in write_plots(args.results, PLOTS if args.out == DOC else args.out.parent / "results"):
                print(f"wrote {path}")
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
