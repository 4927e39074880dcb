"""``python -m benchmarks.roles_study``: the defaults on roles no benchmark was tuned with.

    python -m benchmarks.roles_study --split dev       # where the defaults were chosen
    python -m benchmarks.roles_study --split heldout   # run once, to check them; never to choose
    python -m benchmarks.roles_study --split heldout --combine-only   # the parts already written

Runs the live fidelity frontier (``benchmarks.frontier``) on the agents of one
half of ``benchmarks.workloads.role_set``, on three tasks whose shared segments
differ in length: lookups in a ~1K-token document (68 facts), in a ~160-token
one (12 facts), and the GSM8K ``refer`` workflow (questions of 30-110 tokens,
64-token answers). Each task runs ``off``, ``fullshared`` without recompute (the
random-mix line's two ends: ``off`` is p=1, ``fullshared_k0`` p=0),
on development roles ``fullshared`` with the 15 % share and no minimum length
(``fullshared_r0.15``), on held-out roles the plain launch (``default``) on the
long document and GSM8K (8 samples there; time on this machine). Writes one file per split,
``frontier_roles_<split>.json``, holding each task's frontier output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import frontier
from benchmarks.harness import RESULTS, run_meta, write_json
from benchmarks.serving_digest import common_digest

TASKS: dict[str, list[str]] = {
    "retrieval_1k": ["--task", "retrieval", "--facts", "68"],
    "retrieval_short": ["--task", "retrieval", "--facts", "12"],
    "gsm8k": ["--task", "gsm8k", "--max-tokens", "64"],
}
# Development roles: where the share without the length rule lies; held-out roles: where the default lies.
ARMS = {"dev": "off,fullshared_k0,fullshared_r0.15", "heldout": "off,fullshared_k0,default"}


def part_path(parts: Path, task: str, split: str) -> Path:
    name, facts = TASKS[task][1], dict(zip(TASKS[task][::2], TASKS[task][1::2])).get("--facts")
    return parts / f"frontier_{name}_{split}{f'_f{facts}' if facts else ''}.json"


def part_argv(task: str, split: str, parts: Path, limit: int) -> list[str]:
    arms = ARMS[split]
    if task == "gsm8k" and split == "heldout":
        limit //= 2  # a GSM8K sample (four 64-token answers) costs this machine about 4x a lookup
    facts = dict(zip(TASKS[task][::2], TASKS[task][1::2])).get("--facts")
    return [*TASKS[task], "--roles", split, "--limit", str(limit), "--warmup", "4", "--heads", "0", "--mix",
            "--ratios", "0.15", "--arms", arms, "--tag", f"_{split}{f'_f{facts}' if facts else ''}",
            "--out-dir", str(parts), "--no-progress"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.roles_study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=("dev", "heldout"), required=True)
    ap.add_argument("--limit", type=int, default=16, help="scored samples per task")
    ap.add_argument("--parts", default="tmp/roles", help="where each task's frontier output is written")
    ap.add_argument("--combine-only", action="store_true", help="combine the parts already in --parts")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    parts = Path(args.parts)
    names = [task for task in TASKS if args.split == "dev" or task != "retrieval_short"]
    if not args.combine_only:
        for task in names:
            frontier.main(part_argv(task, args.split, parts, args.limit))
    tasks = {task: json.loads(part_path(parts, task, args.split).read_text()) for task in names}
    meta = run_meta("python -m benchmarks.roles_study --split " + args.split)
    meta["serving_digest"] = common_digest([t["meta"] for t in tasks.values()])
    meta["parts"] = {task: t["meta"].get("command") for task, t in tasks.items()}
    write_json(Path(args.out_dir) / f"frontier_roles_{args.split}.json",
               {"meta": meta, "roles": args.split, "tasks": tasks})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
