"""``python -m benchmarks.report``: docs/RESULTS.md and its plots, generated from the canonical results.

Every benchmark keeps one canonical results file in ``benchmarks/results/``
(``REGISTRY`` below: its name, its file, the command that writes it, the
question it answers and how to read it). This module reads those files and
writes ``docs/RESULTS.md``: an index, the headline table, and one short
section per benchmark (question, reading, the hardware, date, revision, serving
digest and command recorded in the file's ``meta`` by
``benchmarks.harness.run_meta``, and its key table). Plots go to ``docs/results/``
through the benchmarks' own plot functions.

    python -m benchmarks.report               # write docs/RESULTS.md, the plots, README's headline block
    python -m benchmarks.report --no-plots    # the documents only
    python -m benchmarks.report --check       # exit 1 (and a diff) if the documents are not what the files give
    python -m benchmarks.report --check-fresh # exit 1 if a headline row was measured on other serving code

Why generated: a table typed by hand drifts from the file it quotes, and a
reader cannot tell which run a number came from. The output is deterministic
(same files and working tree in, byte-identical markdown out: stable order,
fixed float formats, no generation time, no git call), so ``--check`` and the
test suite can hold the documents to the committed files. A result whose
``serving_digest`` is not the tree's (``benchmarks/serving_digest.py``) is
marked stale in its section header, the index and the headline; ``--check``
ignores those marks (a change of the serving code alone does not make the
documents wrong about the files), ``--check-fresh`` fails on them. A missing
or malformed canonical file raises ``ReportError`` naming the file; an entry
marked ``optional`` (a benchmark not measured yet) is left out of the
documents, headline included, while its file is missing.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.report_sections import (date_of, hardware, interval, meta_line, plot_chain, plot_from, render_adversary,
                                        render_agent_traffic,
                                        render_chain, render_demo, render_fidelity, render_frontier, render_guard,
                                        render_kernels, render_roles_study, render_soak,
                                        render_stock_vs_off, table)
from benchmarks.serving_digest import serving_digest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "RESULTS.md"
PLOTS = ROOT / "docs" / "results"


class ReportError(RuntimeError):
    """A canonical results file is missing or does not hold what its section reads."""


# ------------------------------------------------------------------ freshness
CHANGED = "serving code changed since"
NO_DIGEST = "measured before digests were recorded"
PARTS_DIFFER = "parts measured on different serving code"
MARK = re.compile(r"(?: - )?\*\*stale\*\* \((?:" + "|".join(map(re.escape, (CHANGED, NO_DIGEST, PARTS_DIFFER)))
                  + r")\)|(?<=\| )fresh(?= \|)")
"""Every freshness mark the report writes (``cell_mark``, a section header's): ``--check`` compares the documents
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


def load(entry: Benchmark, results: Path = RESULTS) -> Any:
    """The canonical file of ``entry``, parsed.

    Raises ``ReportError`` naming the file when it is missing, not parseable, or lacks ``meta``'s
    command, machine, date or git revision.
    """
    path = results / entry.file
    if not path.is_file():
        raise ReportError(f"{path}: the canonical results file of benchmark {entry.name!r} is missing "
                          f"(written by: {entry.command})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ReportError(f"{path}: a results JSON must be an object")
    meta = data.get("meta")
    missing = [k for k in ("command", "machine", "date", "git_revision") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ReportError(f"{path}: meta lacks {', '.join(missing)} (benchmarks.harness.run_meta writes it)")
    return data


# ------------------------------------------------------------------ the registry
FRONTIER_READING = (
    "Per arm: `reuse ratio` = consumer shared tokens served by alignment or correction (a recomputed head counts as "
    "prefilled); agreement with `off`'s final answers; the gap to the random-mix line (`fullshared` with a random "
    "share of segments prefilled densely: what a coin buys at that reuse; an arm adds value only above it) with a "
    "95 % interval; teacher-forced top-1 and KL against `off` on `off`'s own continuation (KL over `off`'s top-20 "
    "support: a lower bound of the full KL); accuracy with its paired difference to `off`. The target region is "
    "reuse >= 0.7 with top-1 >= 0.99 and KL <= 0.3x `fullshared` K=0's.")

ROLES_READING = (
    "Per task and arm, on agents drawn per sample from one half of 24 role prompts: the teacher-forced top-1 and KL "
    "against `off` on `off`'s continuation, beside the random-mix line at the arm's reuse (the line through `off` "
    "and `fullshared` without recompute: what prefilling a random share of segments buys), and the gaps' 95 % "
    "intervals (samples resampled jointly for all arms). The default adds value where it lies above the line; where "
    "a task's segments are shorter than the minimum reusable length it reuses nothing (reason `short_segment`) and "
    "sits at the line's `off` end. `fullshared_r0.15` is the share without the length rule.")

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
        "What does the shipped demo, a 4-agent GSM8K team on a plain kvshare launch (the defaults) and on `off`, "
        "prefill and reuse per request, and how soon do agents 2-4 get their first token?",
        "Each agent reads the question's retrieved 1K-token sheet, the question and the previous agent's answer as "
        "shared segments behind its own system prompt; the question and the answers are shorter than the minimum "
        "reusable length and are prefilled (`short_segment`). `prefilled` counts what the server computed (the "
        "recomputed share included); `reused` what it served aligned or corrected.",
        render_demo, optional=True),
    Benchmark(
        "frontier_roles_heldout", "frontier_roles_heldout.json", "python -m benchmarks.roles_study --split heldout",
        "On role prompts no setting was chosen on, does the default keep more of `off`'s distributions than a coin "
        "at the same reuse, on long and on short shared segments?",
        ROLES_READING, render_roles_study, optional=True),
    Benchmark(
        "frontier_roles_dev", "frontier_roles_dev.json", "python -m benchmarks.roles_study --split dev",
        "Where were the defaults (the 15 % share, the minimum segment length) chosen: the development roles.",
        ROLES_READING, render_roles_study, optional=True),
    Benchmark(
        "stock_vs_off", "stock_vs_off.json", "python -m benchmarks.stock_vs_off",
        "Does `--kvshare-mode off` cost anything against stock SGLang, to 2 %?",
        "Both servers run at once and the same request goes to one, then the other, in ABBA order, one in flight at "
        "a time, so the machine's drift cancels in the paired ratio `off / stock`. \"within\" means the whole 95 % "
        "interval of the median ratio lies inside 1 +- 2 %.",
        render_stock_vs_off, plot_from("benchmarks.stock_vs_off", "plot"), results_png=True),
    Benchmark(
        "agent_traffic", "agent_traffic.json", "python -m benchmarks.agent_traffic --quick",
        "Recorded agent teams (group chats, supervisors, retrieval teams of 4-16 agents) arriving together through "
        "the chat API: how much faster are turns 2.. than on stock SGLang, and how much reuse survives a full pool?",
        "One server per arm and pool (the working set, or half of it), the same flags in each; teams arrive by a "
        "Poisson process, each request a plain streamed chat call whose history holds this server's answers. `reuse` "
        "= shared tokens served from another agent's KV; fallbacks from the responses' reports; greedy answers "
        "compared with stock's at the same pool and rate. Then, on the large pool, one team at a time: the "
        "short-message teams on stock and the default (after a floor probe, a one-line request), and the retrieval "
        "teams on the default with the guard verifying every reused request. The plot: pool occupancy and evicted "
        "tokens over time.",
        render_agent_traffic, plot_from("benchmarks.agent_traffic", "plot"), results_png=True, optional=True),
    Benchmark(
        "agent_traffic_long", "agent_traffic_long.json",
        "python -m benchmarks.agent_traffic --teams groupchat-8 groupchat-16 retrieval-8 --arms stock default "
        "--pools large --rates 6 --out benchmarks/results/agent_traffic_long.json",
        "Teams of 8 and 16 agents reading one growing history: what does each position wait for its first token, "
        "and where does the time go as a request reads more agents' KV?",
        "As the agent-traffic run above, one pool that holds the working set, one rate; the per-position lists are "
        "each team's turns in order (2 rounds: position 9 of a team of 8 is agent 1's second turn).",
        render_agent_traffic, plot_from("benchmarks.agent_traffic", "plot"), results_png=True, optional=True),
    Benchmark(
        "agent_traffic_short", "agent_traffic_short.json",
        "python -m benchmarks.agent_traffic --teams groupchat-4 supervisor-4 groupchat-8 supervisor-8 --arms stock "
        "any_length --pools large --rates 4 --out benchmarks/results/agent_traffic_short.json",
        "Group chats and supervisor teams exchange short messages, which the default prefills (`short_segment`). "
        "What would reusing them give: how much sooner the first token, and do the answers stay stock's?",
        "As the agent-traffic run above, at one rate stock is not saturated at, then one team at a time on an idle "
        "server. `any_length` is the default with `--kvshare-min-reuse-tokens 0`, a study arm, never the served "
        "default.",
        render_agent_traffic, plot_from("benchmarks.agent_traffic", "plot"), results_png=True, optional=True),
    Benchmark(
        "frontier_retrieval", "frontier_retrieval.json",
        "python -m benchmarks.frontier --task retrieval --limit 100 --warmup 8 --heads 0 8 32 --mix 0.5 "
        "--arms off,fullshared_k0,mix_p0.5,kvcmas_k0,kvcmas_k8,fullshared_k8,kvcmas_k32,fullshared_k32",
        "On a synthetic 12-fact lookup task shared by four agents, which mode keeps `off`'s answers at which reuse, "
        "and is it better than a coin?",
        FRONTIER_READING, render_frontier, plot_from("benchmarks.frontier", "plot"), results_png=True),
    Benchmark(
        "frontier_retrieval_1000", "frontier_retrieval_1000.json",
        "python -m benchmarks.frontier --task retrieval --limit 334 --seed S --warmup 8 --heads 0 --mix "
        "--ratios 0.15 --arms off,fullshared_r0.15 --tag _1000 for S = 1 and 9, then --pool OUT RUN1 RUN9",
        "Does the recommended setting (`fullshared`, 15 % of each reused segment recomputed) keep retrieval "
        "accuracy within 1 point of `off` over paired lookups on contents no other run used (seeds 1 and 9, 1002 "
        "lookups each, pooled)?",
        FRONTIER_READING + " Only `off` and the recommended arm ran here (no random-mix points), so the line gaps "
        "are not defined.",
        render_frontier, plot_from("benchmarks.frontier", "plot"), results_png=True, optional=True),
    Benchmark(
        "frontier_gsm8k", "frontier_gsm8k.json",
        "python -m benchmarks.frontier --task gsm8k --limit 50 --max-tokens 128 --concurrency 8 --heads 0 8 16 32 "
        "--mix 0.5",
        "On the GSM8K `refer` workflow, which mode keeps `off`'s answers and distributions at which reuse?",
        FRONTIER_READING, render_frontier, plot_from("benchmarks.frontier", "plot"), results_png=True),
    Benchmark(
        "fidelity", "fidelity.json", "python -m benchmarks.fidelity",
        "Offline, on the real model and contents it has never seen: how far is each reuse mode's next-token "
        "distribution from NonShared (exact dense prefill), at what reuse and anchor memory?",
        "KL(NonShared || mode) over the consumer's suffix tokens, top-1 agreement and a 32-token greedy continuation, "
        "per consumer segment; `head K` prefills the first K tokens of each reused segment densely. The oracle row "
        "(the content's own exact delta) is not deployable: it bounds what a correction could do.",
        render_fidelity, plot_from("benchmarks.fidelity", "plot"), results_png=True),
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
        "guard", "guard.json", "python -m benchmarks.guard --seed 13 --offset 700",
        "Does the fidelity guard's estimate hold the truth, does it keep a target at more reuse than one global "
        "recomputed head, does it catch a bad scope, and what does it cost?",
        "Calibration: every request served approximated KV is replayed densely by the benchmark; each agent's mean "
        "over all of them should lie inside the interval the guard reports from its sample. Guarded: fullshared K=0 "
        "with the guard keeping the target per agent (verify burst on; the controller's rule is given below the "
        "table), against fixed heads for every agent (best: the most reuse whose teacher-forced top-1 against "
        "`off` meets the bound). Detection: noise in one shared slot's KV; the verified samples until its readers "
        "were served dense, while renamed twins of the workflow on intact slots "
        "keep their reuse. Overhead: two servers up, paired requests in ABBA order, roles swapped halfway.",
        render_guard, plot_from("benchmarks.guard", "plot"), results_png=True, optional=True),
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
def _chain_headline(d: dict) -> tuple[str, str, str]:
    """Each plain mode's (no ``:K`` or ``@setting``) speedup against `off` and ratio to the exact hit, per length."""
    figs = []
    for arm, per_len in d["arms"].items():
        if arm in ("off", "stock") or ":" in arm or "@" in arm:
            continue
        for length, cell in per_len.items():
            dense = ""
            if "chain_reuse" in cell and arm.startswith("kvcmas"):  # a fresh kvcmas server prefills while it learns
                dense = (f" ({cell['contents_dense']} of its first {len(cell['chain_reuse'])} contents prefilled "
                         f"densely while its pools learned)")
            figs.append(f"`{arm}` {int(length) / 1024:g}K: {cell['speedup_vs_off_agents_2_4']['median']:.2f}x "
                        f"`off`, {cell['reuse_over_floor']['median']:.2f}x the exact hit, reuse "
                        f"{cell['reuse_ratio']:.2f}{dense}")
    repeats = {c["ttft_agents_2_4_s"]["n"] for per_len in d["arms"].values() for c in per_len.values()}
    return (f"4-agent chain, agents 2-4 TTFT (median of {'/'.join(map(str, sorted(repeats)))} repeats)",
            "; ".join(figs), "not measured here (speed only; see the frontier rows)")


def _demo_headline(d: dict) -> tuple[str, str, str]:
    s, sm = d["settings"], d["summary"]
    kv, off = d["arms"]["kvshare"]["totals"], d["arms"]["off"]["totals"]
    return (f"Demo: 4-agent GSM8K team reading a {s['sheet_tokens']}-token shared sheet, the defaults against `off`",
            f"agents 2-4 TTFT {kv['ttft_s_mean_agents_2_4']:.2f} s against `off`'s {off['ttft_s_mean_agents_2_4']:.2f} s "
            f"({sm['ttft_speedup_agents_2_4']:.2f}x); reuse {kv['reuse_ratio']:.2f} of {kv['shared_tokens']} shared "
            f"tokens",
            f"judge's final number equal to `off`'s on {sm['judge_final_number_equal_to_off']} of "
            f"{sm['judged_questions']} questions")


def _roles_headline(d: dict) -> tuple[str, str, str]:
    speed, fidelity = [], []
    for task, f in d["tasks"].items():
        a, off = f["arms"]["default"], f["arms"]["off"]
        head = f"{task} ({f['segment_tokens']['median']:.0f}-token segments, {f['samples']} samples)"
        if not a["reuse_ratio"]:
            reasons = ", ".join(sorted(a.get("fallback_reasons") or {})) or "none"
            fidelity.append(f"{head}: nothing reused (reason {reasons}), `off`'s KV")
            continue
        gap = a.get("teacher_forced_line_gap_ci95") or {}
        speed.append(f"{task}: TTFT agents 2-4 {off['ttft_agents_2_4_s']['median'] / a['ttft_agents_2_4_s']['median']:.2f}x "
                     f"`off` at reuse {a['reuse_ratio']:.2f}")
        fidelity.append(f"{head}: top-1 {a['teacher_forced_top1']:.3f} (line {a['random_mix_top1_at_same_reuse']:.3f}, "
                        f"gap {interval(gap.get('top1_above'))}), KL {a['teacher_forced_kl']:.4f} (line "
                        f"{a['random_mix_kl_at_same_reuse']:.4f}, below it by {interval(gap.get('kl_below'), '+.4f')})")
    return ("The defaults on held-out roles, against the random-mix line", "; ".join(speed) or "-", "; ".join(fidelity))


def _traffic_headline(d: dict) -> tuple[str, str, str]:
    """The default arm against stock at each pool's lowest and highest rate: TTFT p50 / p99 and output throughput
    ratios, reuse (and SGLang's eviction order alone on the half pool), answers equal to stock's."""
    cells = {(c["arm"], c["pool"], c["rate"], c["retention"]): c for c in d["cells"]}
    stock = {(c["pool"], c["rate"]): c for c in d["cells"] if c["arm"] == "stock"}
    figs, agree = [], []
    for (arm, pool, rate, order), c in cells.items():
        base = stock.get((pool, rate))
        if arm == "off" and base is not None and c.get("ttft_p50_s"):  # the control: the same code, no reuse
            figs.append(f"control `off` ({pool} pool, {rate:g} teams/min): TTFT p50 "
                        f"{base['ttft_p50_s'] / c['ttft_p50_s']:.2f}x / p99 "
                        f"{base['ttft_p99_s'] / c['ttft_p99_s']:.2f}x stock's (arrival order alone)")
        if arm != "default" or base is None or not c.get("ttft_p50_s"):
            continue
        label = f"{pool} pool, {rate:g} teams/min" + ("" if order == "workflow" else
                                                      f", SGLang's eviction order `{order}`")
        output = c["throughput_tok_s"] / base["throughput_tok_s"]
        figs.append(f"{label}: TTFT p50 {base['ttft_p50_s'] / c['ttft_p50_s']:.2f}x / p99 "
                    f"{base['ttft_p99_s'] / c['ttft_p99_s']:.2f}x stock's, output {output:.2f}x, "
                    f"reuse {c['reuse_ratio']:.2f}")
        a = c.get("agreement_with_stock") or {}
        if a.get("n"):
            agree.append(f"{label}: {a['equal']}/{a['n']} {interval(a.get('ci95'), '.2f')}")
    agents = [a for a in (d.get("fidelity") or {}).get("per_agent", []) if a["reused_requests"]]
    verified = [a["top1"]["mean"] for a in agents if a["samples"] and a["top1"].get("mean") is not None]
    guard = (f"; the guard's top-1 per agent ({sum(min(a['samples'], a['reused_requests']) for a in agents)} of "
             f"{sum(a['reused_requests'] for a in agents)} reused requests verified): "
             f"{min(verified):.3f}-{max(verified):.3f} over {len(verified)} agents" if verified else "")
    return (f"Agent traffic: teams {', '.join(d['plan']['teams'])} through the chat API, auto mode against stock "
            f"SGLang, turns 2..", "; ".join(figs) or "-",
            "greedy answers equal to stock's: " + ("; ".join(agree) or "-") + guard)


HEADLINE: dict[str, Callable[[dict], tuple[str, str, str]]] = {
    "chain_ttft": _chain_headline, "demo": _demo_headline, "frontier_roles_heldout": _roles_headline,
    "agent_traffic": _traffic_headline}
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
def section(entry: Benchmark, data: Any, results: Path, stale: Optional[str] = None) -> str:
    """One benchmark's short section: a paragraph (question, reading, file, plot, measurement, the body's opening
    note) and its key table."""
    try:
        body = entry.render(data)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as exc:
        raise ReportError(f"{results / entry.file}: malformed for benchmark {entry.name!r} "
                          f"(its section cannot read {exc!r})") from exc
    meta = data["meta"]
    recipe = "" if meta.get("command") == entry.command else f" Recipe: `{entry.command}`."
    plot = f", plot [`{entry.name}.png`](results/{entry.name}.png)" if entry.plot is not None else ""
    note, _, rest = body.partition("\n\n")
    if note.startswith(("|", "```")):
        note, rest = "", body
    mark = "" if stale is None else f" - **stale** ({stale})"
    out = [f'## <a id="{entry.name}"></a>{entry.name}{mark}', "",
           f"**Question.** {entry.question} **Reading.** {entry.reading} File "
           f"[`benchmarks/results/{entry.file}`](../benchmarks/results/{entry.file}){plot}. {meta_line(meta)}"
           f"{recipe}" + (f" {note}" if note else ""), ""]
    return "\n".join(out + ([rest, ""] if rest else []))


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
          tree: Optional[str] = None) -> tuple[bool, str]:
    """Whether ``doc`` (and README's headline block) is what the results give: (ok, what to say).

    Freshness marks are left out of the comparison: a change of the serving code turns results stale without
    making the documents wrong about what the files hold (``--check-fresh`` fails on that). When only the marks
    differ, ok is True and the message says so; otherwise the message is a short unified diff."""
    tree = serving_digest() if tree is None else tree
    pairs = [(doc, render(results, tree))]
    if readme is not None:
        pairs.append((readme, readme_with_headline(readme.read_text(), results, tree)))
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
    stale row, in table order, and the commands that measure it again (a merged or pooled file: its parts'
    commands, then its own, the merge)."""
    tree = serving_digest() if tree is None else tree
    stale = []
    for entry in headline_entries(results):
        data = load(entry, results)
        why = freshness(data, tree)
        if why is not None:
            stale.append((entry.name, why, [*(data.get("commands") or []), data["meta"]["command"]]))
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
                ok, message = check(args.out, args.results, README if args.out == DOC else None)
                print(f"{args.out} is up to date" + (f"\n{message}" if message else "") if ok else
                      f"{args.out} differs from what the results give; run python -m benchmarks.report\n{message}",
                      file=sys.stdout if ok else sys.stderr)
                status = 0 if ok else 1
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
        if not args.no_plots:
            for path in write_plots(args.results, PLOTS if args.out == DOC else args.out.parent / "results"):
                print(f"wrote {path}")
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
