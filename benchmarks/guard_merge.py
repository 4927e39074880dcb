"""Joining ``benchmarks.guard`` runs that each measured some of the tasks into one ``guard.json``.

Why: the full run (three tasks and the overhead) takes longer than one sitting on a small CPU machine, and a run
stopped part way keeps every task it finished (``guard.json`` is rewritten after each task). A later run of the
same command with ``--task`` measures what is missing; ``python -m benchmarks.guard --merge A.json B.json``
joins them. Parts are joined only when they are the same measurement cut in pieces: the same arguments apart
from which tasks they ran, the same committed code, each task and the overhead measured exactly once.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Callable, Mapping, Sequence

from benchmarks import frontier as fr
from benchmarks.serving_digest import common_digest

# Arguments that say which part of the run a part measured, or where it wrote: free to differ between parts.
PART_ARGS = frozenset({"task", "out_dir", "no_progress", "no_overhead", "overhead_only", "merge"})
# Fields a part measured (the rest of a part describes the run and must be equal across parts).
MEASURED = frozenset({"meta", "command", "complete", "tasks", "overhead", "overhead_ttft_ratio",
                      "overhead_throughput_ratio", "guard_queue", "wall_s", "commands", "parts_meta",
                      "parts_measured"})


class MergeError(ValueError):
    """Parts that are not pieces of one measurement."""


def part_arguments(command: str, parse: Callable[[Sequence[str]], argparse.Namespace]) -> dict:
    """A part's arguments, parsed as the benchmark parses them, less those that only pick its share of the run."""
    words = shlex.split(command)
    if words[:3] != ["python", "-m", "benchmarks.guard"]:
        raise MergeError(f"not a benchmarks.guard command: {command!r}")
    return {k: v for k, v in vars(parse(words[3:])).items() if k not in PART_ARGS}


def merge_parts(parts: Sequence[Mapping], command: str,
                parse: Callable[[Sequence[str]], argparse.Namespace]) -> dict:
    """One results dict from ``parts`` (each a ``guard.json``), with ``commands`` and ``parts_meta`` saying where
    each piece came from; ``complete`` when every task and the overhead are in.

    Raises ``MergeError`` when the parts differ in arguments, run description or code (revision, uncommitted
    changes), or measured a task or the overhead twice.
    """
    if len(parts) < 2:
        raise MergeError("--merge needs at least two parts")
    first = parts[0]
    want = part_arguments(first["command"], parse)
    revision = first["meta"].get("git_revision")
    for p in parts:
        if p["meta"].get("git_dirty") or not p["meta"].get("git_revision"):
            raise MergeError(f"{p['command']!r} ran on uncommitted code: its revision does not name what ran")
        if p["meta"]["git_revision"] != revision:
            raise MergeError(f"parts ran on different code: {revision} and {p['meta']['git_revision']}")
        if part_arguments(p["command"], parse) != want:
            raise MergeError(f"{p['command']!r} is not the same run as {first['command']!r}")
        differ = sorted(k for k in set(first) | set(p) if k not in MEASURED and first.get(k) != p.get(k))
        if differ:
            raise MergeError(f"{p['command']!r} differs from {first['command']!r} in {', '.join(differ)}")
    merged = {k: v for k, v in first.items() if k not in MEASURED}
    tasks: dict = {}
    overhead = None
    for p in parts:
        for name, task in p.get("tasks", {}).items():
            if name in tasks:
                raise MergeError(f"task {name!r} was measured by more than one part")
            tasks[name] = task
        if "overhead" in p:
            if overhead is not None:
                raise MergeError("the overhead was measured by more than one part")
            overhead = p
    queues = [p["guard_queue"] for p in parts if p.get("guard_queue")]
    dates = sorted(p["meta"]["date"] for p in parts)
    merged.update(
        meta={**first["meta"], "command": command, "date": dates[-1],
              "serving_digest": common_digest(p["meta"] for p in parts)},
        command=command, commands=[p["command"] for p in parts], parts_meta=[p["meta"] for p in parts],
        parts_measured=[list(p.get("tasks", {})) + (["overhead"] if "overhead" in p else []) for p in parts],
        tasks={name: tasks[name] for name in fr.TASKS if name in tasks})
    if overhead is not None:
        merged.update({k: overhead[k] for k in ("overhead", "overhead_ttft_ratio", "overhead_throughput_ratio")})
    if queues:  # only a part that ran to its end recorded its queue's peak
        merged["guard_queue"] = {"peak_approx_bytes": max(q["peak_approx_bytes"] for q in queues),
                                 "peak_jobs": max(q["peak_jobs"] for q in queues),
                                 "limits": queues[-1].get("limits"), "usage_at_end": queues[-1].get("usage_at_end"),
                                 "parts_recorded": len(queues)}
    walls = [p.get("wall_s") for p in parts]
    merged["wall_s"] = round(sum(walls), 1) if all(w is not None for w in walls) else None
    merged["complete"] = set(fr.TASKS) <= set(merged["tasks"]) and overhead is not None
    return merged


# The code a server runs: the guard, the cache, the kernels, the launcher. A benchmark's own code may change
# between two measurements of one run (a new flag) without changing what they measured on the server.
SERVING_PATHS = ("sglang_kvshare", "kernels", "frontend", "devtools", "pyproject.toml")
OVERHEAD_FIELDS = ("overhead", "overhead_ttft_ratio", "overhead_throughput_ratio")


def check_overhead_source(whole: Mapping, meta: Mapping, model: str,
                          serving_diff: Callable[[str, str], Sequence[str]]) -> list[str]:
    """The revisions of ``whole``'s tasks, when an overhead measured on ``meta``'s code with ``model`` may join them.

    Raises ``MergeError`` when it ran on uncommitted code, another model, or serving code other than the tasks'.
    """
    if meta.get("git_dirty") or not meta.get("git_revision"):
        raise MergeError(f"{meta.get('command')!r} ran on uncommitted code: its revision does not name what ran")
    if model != whole.get("model"):
        raise MergeError(f"the overhead ran on {model!r}, the tasks on {whole.get('model')!r}")
    revisions = sorted({m["git_revision"] for m in whole.get("parts_meta") or [whole["meta"]]})
    for rev in revisions:
        differ = list(serving_diff(rev, meta["git_revision"]))
        if differ:
            raise MergeError(f"the serving code differs between {rev[:12]} and {meta['git_revision'][:12]}: "
                             + ", ".join(differ[:5]))
    return revisions


def replace_overhead(whole: Mapping, part: Mapping, serving_diff: Callable[[str, str], Sequence[str]]) -> dict:
    """``whole`` (a run's ``guard.json``) with its overhead taken from ``part`` (a ``--overhead-only`` run).

    Why: the overhead's interval narrows only with more paired rounds, which do not need the tasks measured again.
    The earlier overhead's verdicts are kept under ``overhead_replaced``; ``overhead_source`` names the part's
    command and code. ``serving_diff(a, b)`` lists the serving files that differ between revisions ``a`` and ``b``.
    Raises ``MergeError`` as ``check_overhead_source`` does, or when the part measured no overhead.
    """
    if "overhead" not in part:
        raise MergeError(f"{part.get('command')!r} measured no overhead")
    revisions = check_overhead_source(whole, part["meta"], part.get("model"), serving_diff)
    out = dict(whole)
    out["meta"] = {**whole["meta"], "serving_digest": common_digest([whole["meta"], part["meta"]])}
    if "overhead" in whole:
        old = whole["overhead"]
        out["overhead_replaced"] = {"ttft": old["ttft"]["verdict"], "throughput": old["throughput"]["verdict"]}
    out.update({k: part[k] for k in OVERHEAD_FIELDS})
    out["overhead_source"] = {"command": part["command"], "meta": part["meta"], "serving_code_same_as": revisions,
                              "wall_s": part.get("wall_s")}
    queue = part.get("guard_queue")
    if queue:
        before = whole.get("guard_queue") or {}
        out["guard_queue"] = {**queue,
                              "peak_approx_bytes": max(queue["peak_approx_bytes"], before.get("peak_approx_bytes", 0)),
                              "peak_jobs": max(queue["peak_jobs"], before.get("peak_jobs", 0)),
                              "parts_recorded": before.get("parts_recorded", 1 if before else 0) + 1}
    out["complete"] = set(fr.TASKS) <= set(whole.get("tasks", {}))
    return out


def git_serving_diff(rev_a: str, rev_b: str) -> list[str]:
    """The files under ``SERVING_PATHS`` that differ between two commits of this checkout."""
    import subprocess

    from benchmarks.harness import ROOT

    done = subprocess.run(["git", "diff", "--name-only", rev_a, rev_b, "--", *SERVING_PATHS],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise MergeError(f"git cannot compare {rev_a[:12]} and {rev_b[:12]}: {done.stderr.strip()}")
    return [line for line in done.stdout.splitlines() if line]
