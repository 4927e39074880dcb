"""The sections of docs/RESULTS.md: number formats, one ``render_*`` per canonical results file, and the plots.

Each renderer takes a results file's parsed JSON and returns its section's body (an opening note, then its key
table), reading the JSON alone; ``benchmarks.report`` registers them (``REGISTRY``) and raises ``ReportError``
naming the file when one cannot read what it expects.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable, Optional

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


def started(meta: dict) -> str:
    return str(meta.get("date", "-"))[:16].replace("T", " ") + " UTC"


def paired(v: dict, label: str, tolerance: bool = True) -> str:
    """A paired ratio's verdict: median [95 % interval] (pairs, verdict and tolerance)."""
    return (f"{label} {num(v['median'], '.3f')} {interval(v['ci95'], '.3f')} ({v['n']} pairs, {v['verdict']}"
            + (f" {v['tolerance']:.0%})" if tolerance else ")"))


def meta_line(meta: dict) -> str:
    """Where, when, from which code and with which command a file was measured."""
    rev = meta.get("git_revision") or "-"
    dirty = " (uncommitted changes)" if meta.get("git_dirty") else ""
    digest = meta.get("serving_digest")
    code = f"serving digest `{digest[:12]}`" if digest else "no serving digest"
    how = (" Date and revision: the commit that recorded the file." if meta.get("backfilled") else "")
    return (f"Measured on {hardware(meta)}, {date_of(meta)}, revision `{rev[:10]}`{dirty}, {code}, by "
            f"`{meta.get('command', '-')}`.{how}")


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
    return ("Median (min-max) over the repeats; each repeat is a new content. Each arm runs the server's "
            "defaults (the first 15 % of each reused segment recomputed inside the one prefill forward) unless "
            "it says otherwise: `@recompute-ratio=r` recomputes the first share r, `@sparse-extend=false` stages "
            "each head (one more forward).\n\n" + table(header, rows))


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


def render_agent_traffic(d: dict) -> str:
    """Per cell: speed against stock's cell at the same pool and rate, reuse, fallbacks, agreement, errors; then the
    default arm by source agents per request (where its time went), long teams per position, the guard's top-1."""
    stock, rows = {(c["pool"], c["rate"]): c for c in d["cells"] if c["arm"] == "stock"}, []
    for c in d["cells"]:
        base, agree = stock.get((c["pool"], c["rate"])) or {}, c.get("agreement_with_stock") or {}
        vs = (f"{base['ttft_p50_s'] / c['ttft_p50_s']:.2f}x / {base['ttft_p99_s'] / c['ttft_p99_s']:.2f}x"
              if c is not base and base.get("ttft_p50_s") and c.get("ttft_p50_s") else "-")
        rows.append([f"`{c['arm']}`", f"{c['pool']} ({c['max_total_tokens']})", f"{c['rate']:g}", c["retention"],
                     num(c["ttft_p50_s"], ".2f", " s"), num(c["ttft_p99_s"], ".2f", " s"), vs,
                     num(c["team_latency_p50_s"], ".1f", " s"), num(c["teams_per_min"], ".2f"),
                     num(c["throughput_tok_s"], ".1f"), num(c["reuse_ratio"]), fallbacks(c["fallbacks"]),
                     f"{agree['equal']}/{agree['n']} {interval(agree.get('ci95'), '.2f')}" if agree else "-",
                     f"{c['errors_5xx']} / {c['lost']}"])
    kv = [c for c in d["cells"] if c["arm"] not in ("stock", "off")]  # the arms that reuse
    by_team = [f"{c['arm']} {c['pool']} {c['rate']:g}/min {c['retention']}: " + ", ".join(
        f"{team} {num(r)}" for team, r in c["reuse_by_team"].items()) for c in kv if c.get("reuse_by_team")]
    by_sources = [[f"`{c['arm']}`", c["pool"], f"{c['rate']:g}", c["retention"], n, str(b["requests"]), num(b["ttft_p50_s"], ".2f", " s"),
                   num(b["assembly_s"] * 1000, ".1f", " ms"), num(b["aligned"], ".0f"), num(b["recomputed"], ".0f")]
                  for c in kv for n, b in c["by_sources"].items()]
    guard = [f"{c['arm']} {c['pool']} {c['rate']:g}/min {c['retention']}: " + ", ".join(
        f"{num(v['top1'].get('mean'), '.3f')} (n {v['top1'].get('n')})" for v in c["guard_top1"].values()
        if v.get("top1")) for c in kv if c.get("guard_top1")]
    low, p = min(c["rate"] for c in d["cells"]), d["plan"]
    turns = [f"* `{c['arm']}` {team}: " + " ".join(num(t, ".1f") for t in ttft) for c in d["cells"]
             if c["pool"] == "large" and c["rate"] == low and c["arm"] != "off"
             for team, ttft in sorted(c["ttft_s_per_turn"].items()) if p["teams"].get(team, 0) >= 8]
    return (f"Teams {', '.join(p['teams'])}; working set {p['working_set_tokens']} tokens; run "
            f"{num(d.get('wall_s'), '.0f')} s. TTFT: turns 2.. of every team (a team's first has nothing to reuse).\n\n"
            + table(["arm", "pool (tokens)", "rate /min", "retention", "TTFT p50", "TTFT p99", "stock / arm p50 / p99",
                     "team p50", "teams/min done", "out tok/s", "reuse", "fallbacks", "answers = stock [95 %]",
                     "5xx / lost"], rows)
            + "\n\nReuse per team: " + ("; ".join(by_team) or "none") + "."
            + "\n\nBy source agents a request reused (mean per request):\n\n"
            + table(["arm", "pool", "rate /min", "retention", "sources", "requests", "TTFT p50", "assembly", "aligned tok",
                     "recomputed tok"], by_sources)
            + f"\n\nTTFT (s) per position in teams of 8 and more, large pool, {low:g} teams/min: "
            + ("\n\n" + "\n".join(turns) if turns else "none in this run.")
            + "\n\nThe guard's top-1 per agent: " + ("; ".join(guard) or "none verified") + "."
            + _idle_part(d.get("idle") or {}) + _fidelity_part(d.get("fidelity")))


def _idle_part(idle: dict) -> str:
    """The idle replay: each arm's floor, p50s, prefill forwards and answers, and its turns against stock's."""
    if not idle:
        return ""
    rows = [[f"`{arm}`", num(c["floor_ttft_s"], ".2f", " s"), num(c["ttft_p50_s"], ".2f", " s"),
             f"{c['reused_requests']} / {num(c['reused_ttft_p50_s'], '.2f', ' s')}", num(c["dense_ttft_p50_s"], ".2f", " s"),
             ", ".join(f"{k}: {v}" for k, v in sorted(c["prefill_forwards"].items(), key=lambda kv: int(kv[0])))
             or "-",
             f"{a['equal']}/{a['n']} {interval(a.get('ci95'), '.2f')}" if (a := c.get("agreement_with_stock")) else "-",
             f"{c['errors_5xx']} / {c['lost']}"] for arm, c in idle.items()]
    stock = {(t["team"], t["turn"]): t["ttft_s"] for t in (idle.get("stock") or {}).get("turns", [])}
    ratios = []
    for arm, c in idle.items():
        paired = {kind: [stock[k] / t["ttft_s"] for t in c["turns"] if arm != "stock"
                         and (k := (t["team"], t["turn"])) in stock and t["ttft_s"] and (t["reused"] > 0) == reused]
                  for kind, reused in (("with reused tokens", True), ("without", False))}
        ratios += [f"`{arm}` {kind}: median {num(statistics.median(v), '.2f')}x over {len(v)} turns "
                   f"({num(min(v), '.2f')}-{num(max(v), '.2f')}x)" for kind, v in paired.items() if v]
    return ("\n\nThe short-message teams one at a time on an idle server (large pool; floor: the TTFT of a one-line "
            "request, which no reuse removes):\n\n"
            + table(["arm", "floor TTFT", "TTFT p50", "reused requests / their p50", "p50 without reuse",
                     "prefill forwards: requests", "answers = stock, turns 2.. [95 %]", "5xx / lost"], rows)
            + "\n\nStock's TTFT over the arm's, same team and turn: " + ("; ".join(ratios) or "none paired") + ".")


def _fidelity_part(f: Optional[dict]) -> str:
    """The guard's top-1 per agent in the fidelity replay (every approximated request verified)."""
    if not f:
        return ""
    agents = [f"{a['team']} agent {a['position']}: {num(a['top1'].get('mean'), '.3f')} "
              f"{interval(a['top1'].get('ci95'), '.3f')} ({a['samples']} verified of {a['reused_requests']} reused)"
              for a in f["per_agent"] if a["reused_requests"]]
    rate = "could not be set: the server's own rate" if f["verify_rate"] is None else num(f["verify_rate"], "g")
    return (f"\n\nThe guard's top-1 per agent, teams {', '.join(f['teams'])} one at a time (verify rate {rate}; "
            f"{f['verified']} verified; 5xx / lost {f['errors_5xx']} / {f['lost']}): "
            + ("; ".join(agents) or "no request reused") + ".")


def render_demo(d: dict) -> str:
    s, sm = d["settings"], d["summary"]
    rows = []
    for arm, a in d["arms"].items():
        c, t = a["config"], a["totals"]
        setting = "stock radix cache" if c.get("mode") == "off" else (
            f"`{c.get('mode')}`, recompute {c.get('recompute_ratio')}, min {c.get('min_reuse_tokens')} tokens")
        rows.append([f"`{arm}`", setting, str(t["requests"]), str(t["prompt_tokens"]), str(t["prefill_tokens"]),
                     str(t["reused_tokens"]), num(t["reuse_ratio"]), num(t["ttft_s_mean_agent_1"], ".2f", " s"),
                     num(t["ttft_s_mean_agents_2_4"], ".2f", " s"),
                     ", ".join(f"{k} {v}" for k, v in sorted(t["fallback_requests_by_reason"].items())) or "-"])
    return (f"{s['questions']} GSM8K question{'' if s['questions'] == 1 else 's'}, a {s['sheet_tokens']}-token shared "
            f"reference sheet, {s['max_new_tokens']} tokens per answer, one request in flight, each arm on a fresh "
            f"server. Agents 2-4's mean TTFT {sm['ttft_speedup_agents_2_4']:.2f}x `off`'s; the judge's final number "
            f"equals `off`'s on {sm['judge_final_number_equal_to_off']} of {sm['judged_questions']} questions.\n\n"
            + table(["arm", "setting", "requests", "prompt tokens", "prefilled", "reused", "reuse ratio",
                     "TTFT agent 1", "TTFT agents 2-4", "requests with a fallback, by reason"], rows))


def render_roles_study(d: dict) -> str:
    rows = []
    for task, f in d["tasks"].items():
        seg = f["segment_tokens"]
        for name, a in f["arms"].items():
            gap = a.get("teacher_forced_line_gap_ci95") or {}
            rows.append([task, f"{seg['median']:.0f} ({seg['p10']:.0f}-{seg['p90']:.0f})", f"`{name}`",
                         num(a["reuse_ratio"]), num(a["teacher_forced_top1"], ".4f"),
                         num(a.get("random_mix_top1_at_same_reuse"), ".4f"), interval(gap.get("top1_above")),
                         num(a["teacher_forced_kl"], ".4f"), num(a.get("random_mix_kl_at_same_reuse"), ".4f"),
                         interval(gap.get("kl_below"), "+.4f"), num(a["agreement_final"]),
                         num(a["ttft_agents_2_4_s"]["median"], ".2f", " s"),
                         ", ".join(f"{k} {v}" for k, v in sorted((a.get("fallback_reasons") or {}).items())) or "-"])
    return (f"Roles: `{d['roles']}` (`benchmarks.workloads.role_set`), {next(iter(d['tasks'].values()))['samples']} "
            "samples a task; parts: " + "; ".join(f"`{c}`" for c in d["meta"].get("parts", {}).values()) + "\n\n"
            + table(["task", "segment tokens: median (p10-p90)", "arm", "reuse", "top-1", "line top-1",
                     "top-1 above line (95 %)", "KL", "line KL", "KL below line (95 %)", "final answer = off's",
                     "TTFT agents 2-4", "fallbacks"], rows))


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
    header = ["arm", "reuse ratio", "final-answer agreement", "vs random-mix line [95% CI]", "identical text",
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
    ctl = d.get("controller")
    notes = [f"Controller: tightens {ctl['tighten']}; relaxes {ctl['relax']}."] if ctl else []
    if d.get("commands"):
        n = len(d["commands"])
        notes.append("The run was measured in parts on the same revision, joined with `--merge` (which refuses "
                     "parts that differ in arguments or code, or measure a task twice): " + "; ".join(
                         f"`{c}` (started {started(m)}): {', '.join(w) or '-'}"
                         for c, m, w in zip(d["commands"], d.get("parts_meta") or [{}] * n,
                                            d.get("parts_measured") or [[]] * n)) + ".")
    ov = d.get("overhead")
    if ov:
        cells = [paired(ov[key]["verdict"], label) for key, label in (("ttft", "TTFT"), ("throughput", "throughput"))]
        notes += [f"Overhead, guard at {ov['verify_rate']:g} against 0 (guarded / plain, median [95 % bootstrap "
                      f"interval]): {'; '.join(cells)}; {ov['verified_requests']} requests verified; waiting for "
                      f"the guarded server's queue after its requests (its references, off the request path, and "
                      f"the polls) took {num(ov['drain_s'], '.1f')} s in all."]
        src, old = d.get("overhead_source"), d.get("overhead_replaced")
        if src:
            rev = str(src["meta"].get("git_revision") or "-")[:7]
            text = (f"The overhead was measured again, on its own, by `{src['command']}` (revision {rev}, started "
                    f"{started(src['meta'])}; the serving code is the tasks' run's, checked with `git diff`)")
            if old:
                text += "; the run's own overhead, which it replaced: " + "; ".join(
                    paired(old[key], label, tolerance=False) for key, label in (("ttft", "TTFT"),
                                                                                ("throughput", "throughput")))
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


def run_outcome(d: dict, setup: str, findings: str) -> str:
    """A soak-like run (``passed``, ``totals``, ``verdicts``): its setup, the verdict and request totals, what it
    found, and how many verdicts passed, naming each one that failed or was not checked."""
    t, verdicts = d["totals"], d["verdicts"]
    failed = [f"`{k}`" for k, v in verdicts.items() if v is not True and v != "not checked"]
    unchecked = [f"`{k}`" for k, v in verdicts.items() if v == "not checked"]
    return (f"{setup} Passed: **{'yes' if d['passed'] else 'no'}**. Requests {t['requests']}: 2xx {t['ok_2xx']}, "
            f"4xx {t['client_4xx']}, 5xx {t['server_5xx']}, lost {t['lost']}; {findings} Verdicts: "
            f"{sum(1 for v in verdicts.values() if v is True)} of {len(verdicts)} pass"
            + (f"; **FAIL**: {', '.join(failed)}" if failed else "")
            + (f"; not checked: {', '.join(unchecked)}" if unchecked else "") + ".")


def render_soak(d: dict) -> str:
    s, rep = d["settings"], d["replay"]
    return run_outcome(d, f"Mode `{s['mode']}`, tau {s['tau']}, {s['clients']} clients for {s['minutes']} min, KV "
                          f"pool {s['max_total_tokens']} tokens, {s['slot_names']} slot names; wall {d['wall_s']} s.",
                       f"faults injected {d['faults_injected_total']}; plain requests replayed against `off`: "
                       f"{rep['same']} of {rep['n']} identical.")


def render_adversary(d: dict) -> str:
    flood = d["attacks"].get("name_flood") or {}
    chats = (d["attacks"].get("long_chats") or {}).get("sizes") or {}
    sizes = ", ".join(f"{n} messages: {c['auto_status']} in {num(c['auto_s'])} s (stock {c['stock_status']}), "
                      f"short chat delayed {num(c['short_delay_s'])} s" for n, c in chats.items())
    return run_outcome(d, f"Form `{d['form']}`, {d['server_s']} s against the server.",
                       f"{d['secrets']['count']} secrets looked for in {d['secrets']['answers_scanned']} answers, "
                       f"{len(d['secrets']['leaks'])} found; name flood {flood.get('flood_requests', '-')} agents, "
                       f"guard scope series {(flood.get('series') or {}).get('scopes', '-')} (cap "
                       f"{flood.get('series_cap', '-')}). Long chats: {sizes or '-'}.")


# ------------------------------------------------------------------ plots
def plot_from(module: str, function: str) -> Callable[[Any, Path], None]:
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
