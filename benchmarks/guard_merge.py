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

# Arguments that say which part of the run a part measured, or where it wrote: free to differ between parts.
PART_ARGS = frozenset({"task", "out_dir", "no_progress", "no_overhead", "merge"})
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
        meta={**first["meta"], "command": command, "date": dates[-1]},
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
