"""``python -m benchmarks.research.guard_sim RUN.json``: replay the guard's controller, offline, on the answers a run measured.

Why: one held-out guard run takes hours here and scores each task on ten to sixty samples, so it says little about
how often a controller rule keeps its target, and nothing about a rule it did not run. A run's fixed-head arms
record every answer's teacher-forced top-1 per agent and sample (``teacher_forced_per_agent``: the same samples at
every head) and each agent's reuse per head (``reuse_per_agent``). This replays the real ``Controller`` on them:
a replicate draws warm-up workflows and scored workflows from the run's samples, serves each consumer under the
setting its scope has (a probe for a dense scope), verifies at the rate plus the burst, feeds the verified answers
to the controller after each round of ``--concurrency`` workflows (the guard's queue drains between rounds, as in
the benchmark), and scores the scored workflows as the benchmark does: position-weighted top-1, and reuse, over
the consumers. The same scored workflows give each fixed head's top-1 and reuse, so the best fixed head of a
replicate is chosen as the benchmark chooses it, in hindsight on the scored samples.

Assumption: the guard judges an answer along its own continuation, the benchmark along ``off``'s; the two agree in
mean (``docs/FIDELITY.md``), so a replicate uses one value for both. Dense answers agree by construction.

Use it on development runs only: a rule chosen here is then measured once on held-out samples by
``benchmarks.guard``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from sglang_kvshare.guard.controller import DENSE, Controller, ladder
from sglang_kvshare.guard.measure import RequestFidelity
from sglang_kvshare.guard.target import DEFAULT_BAND, FidelityTarget

Answer = tuple[float, float, int]  # top-1, KL, positions


@dataclass(frozen=True)
class AgentAnswers:
    """One consumer agent of a task: its answers per head and sample, and its reuse per head."""

    answers: Mapping[int, Mapping[int, Answer]]  # head -> sample index -> answer
    reuse: Mapping[int, float]  # head -> reuse ratio of its shared tokens
    shared: float  # shared tokens per request (its weight in the workflow's reuse)


def task_answers(task: Mapping) -> dict[str, AgentAnswers]:
    """The consumer agents of one ``guard.json`` task, from its fixed-head arms; only samples every head answered.

    Raises ``ValueError`` when the run did not record answers per agent (a file written before they were kept).
    """
    heads = sorted(int(name.removeprefix("fullshared_k")) for name in task["arms"] if name.startswith("fullshared_k"))
    out = {}
    first = task["arms"][f"fullshared_k{heads[0]}"]
    if "teacher_forced_per_agent" not in first or "reuse_per_agent" not in first:
        raise ValueError("the run does not record teacher-forced answers and reuse per agent: re-run benchmarks.guard")
    for agent, reuse in first["reuse_per_agent"].items():
        if not reuse.get("shared"):
            continue  # a producer: nothing of it is reused
        per_head = {}
        for k in heads:
            arm = task["arms"][f"fullshared_k{k}"]
            rows = arm["teacher_forced_per_agent"].get(agent, {}).get("per_answer", [])
            per_head[k] = {int(s): (float(t), float(kl), int(p)) for s, t, kl, p in rows}
        common = set.intersection(*(set(v) for v in per_head.values()))
        n_requests = max(1, len(per_head[heads[0]]))
        out[agent] = AgentAnswers({k: {s: v[s] for s in sorted(common)} for k, v in per_head.items()},
                                  {k: task["arms"][f"fullshared_k{k}"]["reuse_per_agent"][agent]["ratio"] or 0.0
                                   for k in heads},
                                  reuse["shared"] / n_requests)
    return out


def _score(rows: Sequence[tuple[str, int, Answer]], agents: Mapping[str, AgentAnswers]) -> dict:
    """Position-weighted top-1 and shared-token-weighted reuse over ``(agent, head, answer)`` rows."""
    positions = sum(a[2] for _, _, a in rows)
    shared = sum(agents[name].shared for name, _, _ in rows)
    reused = sum(agents[name].shared * (0.0 if head == DENSE else agents[name].reuse[head]) for name, head, _ in rows)
    return {"top1": sum(a[0] * a[2] for _, _, a in rows) / positions if positions else None,
            "reuse": reused / shared if shared else None}


def replicate(agents: Mapping[str, AgentAnswers], make: Callable[[], Controller], rng: random.Random, *,
              rate: float, warmup: int, scored: int, concurrency: int, bound: float) -> dict:
    """One guarded arm and the fixed heads on the same drawn scored workflows."""
    controller = make()
    heads = sorted(next(iter(agents.values())).answers)
    pool = sorted(set.intersection(*(set(a.answers[heads[0]]) for a in agents.values())))
    if not pool:
        raise ValueError("no sample was answered by every consumer at every head")
    workflows = [rng.choice(pool) for _ in range(warmup + scored)]
    served_rows: list[tuple[str, int, Answer]] = []
    for start in range(0, len(workflows), concurrency):
        pending, waiting = [], {name: 0 for name in agents}
        for i in range(start, min(start + concurrency, len(workflows))):
            for name, agent in agents.items():
                draw = rng.random() < rate
                burst = not draw and controller.wants_evidence(name, waiting[name])
                probe = controller.probe_setting(name) if draw else None
                head = probe if probe is not None else controller.setting(name)
                answer = (1.0, 0.0, agent.answers[heads[0]][workflows[i]][2]) if head == DENSE \
                    else agent.answers[head][workflows[i]]
                if (draw or burst) and head != DENSE:  # a dense answer is exact: nothing to verify
                    waiting[name] += 1
                    pending.append((name, head, answer))
                if i >= warmup:
                    served_rows.append((name, head, answer))
        for name, head, (top1, kl, positions) in pending:  # the queue drains after the round
            controller.observe(name, head, RequestFidelity(positions, top1, kl))
    guarded = _score(served_rows, agents)
    fixed = {k: _score([(name, k, agent.answers[k][s]) for s in workflows[warmup:] for name, agent in agents.items()],
                       agents) for k in heads}
    meeting = [k for k in heads if fixed[k]["top1"] is not None and fixed[k]["top1"] >= bound]
    best = max(meeting, key=lambda k: (fixed[k]["reuse"], -k)) if meeting else None
    best_reuse = fixed[best]["reuse"] if best is not None else 0.0
    return {"guarded": guarded, "fixed": fixed, "best_k": best,
            "meets": guarded["top1"] is not None and guarded["top1"] >= bound,
            "reuse_at_least_best": guarded["reuse"] is not None and guarded["reuse"] >= best_reuse - 1e-12,
            "settings_at_end": {name: controller.setting(name) for name in agents}}


def summarize(reps: Sequence[dict]) -> dict:
    """Shares over replicates: target met, reuse at least the best fixed head's, both; medians and spreads."""
    def spread(values: Sequence[float]) -> dict:
        q = statistics.quantiles(values, n=10) if len(values) > 1 else [values[0]] * 9
        return {"median": statistics.median(values), "p10": q[0], "p90": q[-1]}

    both = [r["meets"] and r["reuse_at_least_best"] for r in reps]
    return {"replicates": len(reps), "p_meets": statistics.fmean(r["meets"] for r in reps),
            "p_reuse_at_least_best": statistics.fmean(r["reuse_at_least_best"] for r in reps),
            "p_both": statistics.fmean(both),
            "guarded_top1": spread([r["guarded"]["top1"] for r in reps]),
            "guarded_reuse": spread([r["guarded"]["reuse"] for r in reps]),
            "best_k": {str(k): sum(r["best_k"] == k for r in reps) for k in sorted({r["best_k"] for r in reps},
                                                                                    key=lambda k: (k is None, k))}}


def simulate(task: Mapping, target: str, *, rate: float, min_samples: int, warmup: int, scored: int,
             concurrency: int = 4, replicates: int = 200, seed: int = 0,
             controller: Optional[Callable[[FidelityTarget, int], Controller]] = None) -> dict:
    """``replicates`` replays of one task's guarded arm; ``controller`` builds the rule to replay (default: the
    server's ``Controller`` from head 0)."""
    agents = task_answers(task)
    parsed = FidelityTarget.parse(target)
    build = controller or (lambda t, m: Controller(t, ladder(0), min_samples=m))
    rng = random.Random(seed)
    reps = [replicate(agents, lambda: build(parsed, min_samples), rng, rate=rate, warmup=warmup, scored=scored,
                      concurrency=concurrency, bound=parsed.bound) for _ in range(replicates)]
    return summarize(reps)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.research.guard_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a guard.json, or a benchmarks.frontier file, whose fixed-head arms record answers "
                                "per agent (a development run)")
    ap.add_argument("--target", default=None, help="default: the guard run's, else top1>=0.99")
    ap.add_argument("--rate", type=float, default=None, help="default: the guard run's verify rate, else 0.1")
    ap.add_argument("--min-samples", type=int, default=None,
                    help="default: the guard run's chosen min_samples per task, else 20")
    ap.add_argument("--warmup", type=int, default=None, help="default: the guard run's controlled warm-up, else 40")
    ap.add_argument("--scored", type=int, default=None, help="default: the run's scored samples per task")
    ap.add_argument("--band", type=float, nargs="+", default=[DEFAULT_BAND],
                    help="the controller's fidelity_band; several values: one replay each, keyed by band")
    ap.add_argument("--replicates", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    run = json.loads(Path(args.run).read_text())
    tasks = run["tasks"] if "tasks" in run else {run.get("task", "task"): run}
    out: dict = {}
    for name, task in tasks.items():
        try:
            out[name] = {f"band={band:g}": simulate(
                task, args.target or run.get("target") or "top1>=0.99",
                rate=args.rate if args.rate is not None else run.get("verify_rate", 0.1),
                min_samples=args.min_samples or (task.get("min_samples") or {}).get("chosen") or 20,
                warmup=(args.warmup if args.warmup is not None
                        else (task.get("sizes") or {}).get("controlled_warmup", 40)),
                scored=args.scored or task.get("samples") or 10, concurrency=run.get("concurrency", 4),
                replicates=args.replicates, seed=args.seed,
                controller=lambda t, m, band=band: Controller(t, ladder(0), min_samples=m, band=band))
                for band in args.band}
        except ValueError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
