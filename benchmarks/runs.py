"""Results measured in parts, joined: the one run/merge layer of the long live benchmarks (frontier, guard).

Why parts: one run of every arm (frontier) or every task (guard) takes longer than a sitting on a small CPU
machine, and a stopped run keeps what it finished (each benchmark rewrites its file after each arm or task). Parts
join only when they are one measurement cut in pieces; every join records where each piece came from
(``commands``, ``parts_meta``: a part that is itself a join brings its own lists) and sets its own ``meta``.

* ``merge_arms``: frontier parts on the same samples, each with its own ``off``, joined arm by arm.
* ``pool_arms``: frontier runs of the same arms on other seeds, every item and position pooled.
* ``merge_tasks``: guard parts that measured some of the tasks (and the overhead), each exactly once.

Each raises ``MergeError`` (a ``ValueError``) naming what differs; ``join`` is the CLI step around them.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from benchmarks import frontier_metrics as fm
from benchmarks.serving_digest import common_digest


class MergeError(ValueError):
    """Parts that are not pieces of one measurement."""


# ------------------------------------------------------------------ the shared steps
def provenance(parts: Sequence[Mapping]) -> dict:
    """``commands`` and ``parts_meta`` of a join of ``parts``, in order (a join's own lists carried over)."""
    return {"commands": [c for p in parts for c in (p["commands"] if "commands" in p else [p.get("command")])],
            "parts_meta": [m for p in parts for m in (p["parts_meta"] if "parts_meta" in p else [p.get("meta")])]}


def require_same(parts: Sequence[Mapping], keys: Iterable[str], what: str = "runs") -> None:
    """Every part equal to the first in ``keys``."""
    first = parts[0]
    for p in parts[1:]:
        for key in keys:
            if p.get(key) != first.get(key):
                raise MergeError(f"{what} differ in {key}: {first.get(key)!r} vs {p.get(key)!r}")


def union(maps: Sequence[Mapping], *, latest: Iterable[str] = (), once: str = "") -> dict:
    """The entries of ``maps`` in order of first appearance: each the first map's that has it, or the last's for
    keys in ``latest``. ``once`` (what the entries are): a key in two maps raises instead."""
    latest = set(latest)
    out: dict = {}
    for m in maps:
        for key, value in m.items():
            if once and key in out:
                raise MergeError(f"{once} {key!r} was measured by more than one part")
            if key in latest or key not in out:
                out[key] = value
    return out


def committed_revision(meta: Mapping) -> str:
    """The git revision a part ran on; raises when it ran on uncommitted code (the revision does not name it)."""
    if meta.get("git_dirty") or not meta.get("git_revision"):
        raise MergeError(f"{meta.get('command')!r} ran on uncommitted code: its revision does not name what ran")
    return meta["git_revision"]


def joined_meta(command: str, parts_meta: Sequence[Mapping]) -> dict:
    """A joined file's own ``meta``: this command, and the serving digest its parts share (None when they differ:
    no one serving code measured the whole)."""
    from benchmarks.harness import run_meta

    return {**run_meta(command), "serving_digest": common_digest(parts_meta)}


def join(label: str, paths: Sequence[str], build: Callable[[list[dict]], dict], save: Callable[[dict], None]) -> int:
    """The CLI step: read the parts' files, ``build`` the joined results, ``save`` them; 2 with the reason on
    stderr when a file is unreadable or the parts do not join."""
    try:
        out = build([json.loads(Path(p).read_text()) for p in paths])
    except (OSError, ValueError, KeyError) as exc:  # MergeError is a ValueError
        print(f"cannot {label}: {exc}", file=sys.stderr)
        return 2
    save(out)
    print(f"{label}: {len(paths)} parts joined; complete {out.get('complete')}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------ frontier: arms
def merge_arms(runs: Sequence[dict], remeasured: Sequence[str] = (),
               planned: Callable[[str], set[str]] = lambda command: set()) -> dict:
    """One frontier results dict holding the arms of several finished runs of the same samples.

    Parts are comparable only if they scored the same items and ``off`` answered them alike: then every arm was
    measured against the same reference, and one random-mix line serves all of them. The first part's ``off``
    (and any arm's first occurrence, except the arms in ``remeasured``: their last) is kept. ``planned(command)``:
    the arms a part's command runs (``frontier.planned_arms``), so that a stopped part made whole by a later one
    counts as complete.
    """
    if not runs:
        raise MergeError("nothing to merge")
    if any("off" not in run["arms"] for run in runs):
        raise MergeError("every run to merge needs its off arm (the reference its arms were measured against)")
    if "off" in remeasured:
        raise MergeError("--remeasured names off: off is every part's reference and cannot be re-measured")
    require_same(runs, ("task", "samples", "seed", "max_tokens"))
    first_off = runs[0]["arms"]["off"]
    for run in runs[1:]:
        off = run["arms"]["off"]
        if [it["answer"] for it in off["per_item"]] != [it["answer"] for it in first_off["per_item"]]:
            raise MergeError("off answered differently in two runs: their arms are not measured against the "
                             "same reference and cannot share one line")
        if off.get("teacher_forced_positions") != first_off.get("teacher_forced_positions"):
            raise MergeError("off's continuations differ between runs (teacher-forced positions)")

    def own(run: dict) -> dict:
        # Seconds move between runs of a shared machine: an arm keeps the off TTFT of the run it was measured
        # in (a part that is itself a merge no longer knows it for the arms of its later parts).
        off_ttft = None if "commands" in run else (run["arms"]["off"].get("ttft_agents_2_4_s") or {}).get("median")
        return {name: arm if off_ttft is None or name == "off" else
                {**arm, "off_ttft_agents_2_4_median_same_run": off_ttft} for name, arm in run["arms"].items()}

    arms = union([own(run) for run in runs], latest=remeasured)
    unknown = sorted(set(remeasured) - set(arms))
    if unknown:
        raise MergeError(f"--remeasured names {unknown}, which no run to merge has")
    merged = {k: v for k, v in runs[0].items() if k not in ("meta", "command", "arms")}
    merged.update(provenance(runs), arms=arms,
                  remeasured=sorted(set(remeasured).union(*(run.get("remeasured", ()) for run in runs))),
                  complete=all(run.get("complete") or ("command" in run and planned(run["command"]) <= set(arms))
                               for run in runs))
    fm.add_line_gaps(arms)
    return merged


# Fields of an arm that are sums over runs, and those kept from the first run (the arm's definition).
_SUMMED = ("shared_tokens", "shared_tokens_reused", "tokens_head_recomputed", "teacher_forced_positions",
           "scored_items", "run_s")
_DEFINITION = ("arm", "mode", "recompute_head", "random_mix_p", "policy", "recompute_ratio")


def _weighted(parts: Sequence[Mapping], key: str, weight: str) -> Any:
    total = sum(p[weight] for p in parts)
    if not total or any(p.get(key) is None for p in parts):
        return None
    return sum(p[key] * p[weight] for p in parts) / total


def pool_arms(runs: Sequence[dict]) -> dict:
    """One frontier results dict over runs of the same arms on different samples (other seeds).

    Why: an accuracy difference of a point needs more lookups than one run of reasonable length holds on a CPU.
    Every figure that is a mean over items or positions is recomputed over the union (each run's arm against its
    own run's ``off``): agreement and the paired accuracy difference from the per-item answers, teacher-forced
    top-1 and KL weighted by positions, reuse from the token counts. Medians do not pool: TTFT stays per run
    (``ttft_agents_2_4_s_per_run``).
    """
    if len(runs) < 2:
        raise MergeError("pooling needs at least two runs")
    if any(run.get("pooled") for run in runs):
        raise MergeError("a results file is itself pooled: pool the runs' own files (its commands name them)")
    seeds = [run.get("seed") for run in runs]
    if len(set(seeds)) != len(seeds):
        raise MergeError(f"runs share a seed ({seeds}): pooled runs must score different samples")
    require_same(runs, ("task", "max_tokens", "top_k"))
    if len({tuple(run["arms"]) for run in runs}) > 1:
        raise MergeError(f"runs differ in arms: {[list(run['arms']) for run in runs]}")
    if "off" not in runs[0]["arms"]:
        raise MergeError("every run to pool needs its off arm (the reference its arms were measured against)")
    ref = [it for run in runs for it in run["arms"]["off"]["per_item"]]
    arms: dict[str, dict] = {}
    for name in runs[0]["arms"]:
        parts = [run["arms"][name] for run in runs]
        for key in _DEFINITION:
            if len({json.dumps(p.get(key)) for p in parts}) > 1:
                raise MergeError(f"arm {name} differs in {key} between runs")
        a = {key: parts[0].get(key) for key in _DEFINITION}
        a.update({key: sum(p.get(key) or 0 for p in parts) for key in _SUMMED})
        a["reuse_ratio"] = 0.0 if a["mode"] == "off" else (
            a["shared_tokens_reused"] / a["shared_tokens"] if a["shared_tokens"] else None)
        a["fallback_reasons"] = {}
        for p in parts:
            for reason, count in (p.get("fallback_reasons") or {}).items():
                a["fallback_reasons"][reason] = a["fallback_reasons"].get(reason, 0) + count
        items = [it for p in parts for it in p["per_item"]]
        acc = [1.0 if it["correct"] else 0.0 for it in items]
        a.update(agreement_final=statistics.fmean(float(x["answer"] == r["answer"]) for x, r in zip(items, ref)),
                 identical_text=_weighted(parts, "identical_text", "scored_items"),
                 teacher_forced_top1=_weighted(parts, "teacher_forced_top1", "teacher_forced_positions"),
                 teacher_forced_kl=_weighted(parts, "teacher_forced_kl", "teacher_forced_positions"),
                 forwards_per_request=_weighted(parts, "forwards_per_request", "scored_items"),
                 accuracy=statistics.fmean(acc),
                 accuracy_vs_off_paired=fm.paired_bootstrap(acc, [1.0 if it["correct"] else 0.0 for it in ref]),
                 accuracy_vs_off_paired_per_run=[p.get("accuracy_vs_off_paired") for p in parts],
                 ttft_agents_2_4_s=None, ttft_agents_2_4_s_per_run=[p["ttft_agents_2_4_s"] for p in parts],
                 per_item=items)
        arms[name] = a
    pooled = {k: v for k, v in runs[0].items() if k not in ("meta", "command", "arms", "commands", "parts_meta")}
    pooled.update(seed=seeds, pooled=True, samples=sum(run["samples"] for run in runs),
                  scored_items=sum(run["scored_items"] for run in runs), **provenance(runs),
                  complete=all(run.get("complete") for run in runs), arms=arms)
    fm.add_line_gaps(arms)
    return pooled


# ------------------------------------------------------------------ guard: tasks and the overhead
# Arguments that say which part of the run a part measured, or where it wrote: free to differ between parts.
PART_ARGS = frozenset({"task", "out_dir", "no_progress", "no_overhead", "merge"})
# Fields a part measured (the rest of a part describes the run and must be equal across parts).
MEASURED = frozenset({"meta", "command", "complete", "tasks", "overhead", "overhead_ttft_ratio",
                      "overhead_throughput_ratio", "guard_queue", "wall_s", "commands", "parts_meta",
                      "parts_measured"})
OVERHEAD_FIELDS = ("overhead", "overhead_ttft_ratio", "overhead_throughput_ratio")


def part_arguments(command: str, parse: Callable[[Sequence[str]], Any], module: str = "benchmarks.guard") -> dict:
    """A part's arguments, parsed as the benchmark parses them, less those that only pick its share of the run."""
    words = shlex.split(command)
    if words[:3] != ["python", "-m", module]:
        raise MergeError(f"not a {module} command: {command!r}")
    return {k: v for k, v in vars(parse(words[3:])).items() if k not in PART_ARGS}


def merge_tasks(parts: Sequence[Mapping], command: str, parse: Callable[[Sequence[str]], Any],
                tasks: Sequence[str]) -> dict:
    """One guard results dict from ``parts`` (each a ``guard.json``): the same arguments apart from which
    ``tasks`` they ran, the same committed code, each task and the overhead measured exactly once; ``complete``
    when every task and the overhead are in."""
    if len(parts) < 2:
        raise MergeError("--merge needs at least two parts")
    first = parts[0]
    want = part_arguments(first["command"], parse)
    revision = committed_revision(first["meta"])
    for p in parts:
        if committed_revision(p["meta"]) != revision:
            raise MergeError(f"parts ran on different code: {revision} and {p['meta']['git_revision']}")
        if part_arguments(p["command"], parse) != want:
            raise MergeError(f"{p['command']!r} is not the same run as {first['command']!r}")
        differ = sorted(k for k in set(first) | set(p) if k not in MEASURED and first.get(k) != p.get(k))
        if differ:
            raise MergeError(f"{p['command']!r} differs from {first['command']!r} in {', '.join(differ)}")
    measured = union([p.get("tasks", {}) for p in parts], once="task")
    with_overhead = [p for p in parts if "overhead" in p]
    if len(with_overhead) > 1:
        raise MergeError("the overhead was measured by more than one part")
    overhead = with_overhead[0] if with_overhead else None
    merged = {k: v for k, v in first.items() if k not in MEASURED}
    merged.update(meta={**first["meta"], "command": command, "date": max(p["meta"]["date"] for p in parts),
                        "serving_digest": common_digest([p["meta"] for p in parts])},
                  command=command, commands=[p["command"] for p in parts], parts_meta=[p["meta"] for p in parts],
                  parts_measured=[list(p.get("tasks", {})) + (["overhead"] if "overhead" in p else []) for p in parts],
                  tasks={name: measured[name] for name in tasks if name in measured})
    if overhead is not None:
        merged.update({k: overhead[k] for k in OVERHEAD_FIELDS})
    queues = [p["guard_queue"] for p in parts if p.get("guard_queue")]
    if queues:  # only a part that ran to its end recorded its queue's peak
        merged["guard_queue"] = {"peak_approx_bytes": max(q["peak_approx_bytes"] for q in queues),
                                 "peak_jobs": max(q["peak_jobs"] for q in queues),
                                 "limits": queues[-1].get("limits"), "usage_at_end": queues[-1].get("usage_at_end"),
                                 "parts_recorded": len(queues)}
    walls = [p.get("wall_s") for p in parts]
    merged["wall_s"] = round(sum(walls), 1) if all(w is not None for w in walls) else None
    merged["complete"] = set(tasks) <= set(merged["tasks"]) and overhead is not None
    return merged
