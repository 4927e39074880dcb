"""``python -m benchmarks.research.profile_scheduler``: where a kvshare server's CPU time goes under the chain workload.

Why a launcher and not ``py-spy record --pid``: in this sandbox py-spy cannot
attach to a process it did not start (it fails to read the target's memory),
but it can profile a command it launches, children included
(``--subprocesses``). So the server runs under py-spy; the 4-agent chain of
``benchmarks.chain_ttft`` runs against it (``--chains`` contents, each sent
twice so the exact-hit floor is in the profile too); then py-spy is stopped
with SIGINT, which makes it write its samples, and the samples are grouped:

* per process (the scheduler is the one that runs ``event_loop``);
* in the scheduler: samples by thread (event loop, kvshare's learner, start-up),
  and in the event loop self time by function (the leaf frame) and inclusive
  time of every ``sglang_kvshare`` function, so the cost of match, assembly, gate,
  estimate, write and insert stands next to the forward pass.

Results: ``benchmarks/results/profile_<mode>.json`` (and py-spy's raw folded
stacks beside it). Sampling at ``--rate`` Hz slows the server a little; read
the shares, not the seconds.
"""

from __future__ import annotations

import argparse
import sys
import collections
import os
import re
import signal
import time
from pathlib import Path

from benchmarks.chain_ttft import run_chain
from benchmarks.harness import RESULTS, machine, mode_args, run_meta, wait_learning, write_json
from benchmarks.texts import context_tokens
from devtools.server_process import ServerProcess

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse_folded(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw format: ``frame;frame;...;frame count`` per line, root first."""
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def short(frame: str) -> str:
    """``func (path/to/file.py:12)`` -> ``func (file.py)``: one name per function, lines merged."""
    m = FRAME.match(frame)
    if not m:
        return frame
    return f"{m['func']} ({os.path.basename(m['file'])})"


def split_process(frames: list[str]) -> tuple[str, list[str]]:
    """(pid, frames inside it): py-spy marks each process with a ``process PID:"cmdline"`` frame.

    A cmdline holding ``;`` spills into the next frames; those are skipped up to
    the first frame that looks like ``func (file)``."""
    pid, body = "?", frames
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].startswith("process "):
            pid = frames[i].split(":", 1)[0].removeprefix("process ")
            body = frames[i + 1:]
            while body and not FRAME.match(body[0]):
                body = body[1:]
            break
    return pid, body


THREADS = (("event_loop", "run_event_loop"), ("learner", "Learner."), ("startup", "<module>"))


def summarize(stacks: list[tuple[list[str], int]], top: int = 25) -> dict:
    by_pid: dict[str, list] = collections.defaultdict(list)
    for frames, count in stacks:
        pid, body = split_process(frames)
        by_pid[pid].append((body, count))
    sched_pid = next((pid for pid, s in by_pid.items()
                      if any("run_event_loop" in f for frames, _ in s for f in frames)), None)
    out: dict = {"samples_by_process": {pid: sum(c for _, c in s) for pid, s in by_pid.items()},
                 "scheduler_pid": sched_pid}
    if sched_pid is None:
        return out
    sched = by_pid[sched_pid]
    total = sum(c for _, c in sched)
    share = lambda c: round(c / total, 4)  # noqa: E731
    threads: collections.Counter = collections.Counter()
    self_time: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    kvshare_names: set[str] = set()
    for frames, count in sched:
        kind = next((k for k, marker in THREADS if any(marker in f for f in frames)), "other")
        threads[kind] += count
        if kind != "event_loop":
            continue
        if frames:
            self_time[short(frames[-1])] += count
        seen = set()
        for f in frames:
            name = short(f)
            if "sglang_kvshare" in f:
                kvshare_names.add(name)
            if name not in seen:
                seen.add(name)
                inclusive[name] += count
    loop = threads["event_loop"] or 1
    of_loop = lambda c: round(c / loop, 4)  # noqa: E731
    out.update({
        "scheduler_samples": total,
        "scheduler_threads_share": {k: share(c) for k, c in threads.most_common()},
        "event_loop_self_top": [{"function": n, "share_of_loop": of_loop(c)} for n, c in self_time.most_common(top)],
        "event_loop_inclusive_top": [{"function": n, "share_of_loop": of_loop(c)}
                                     for n, c in inclusive.most_common(top)],
        "event_loop_inclusive_kvshare": [{"function": n, "share_of_loop": of_loop(c)}
                                         for n, c in inclusive.most_common() if n in kvshare_names][:top],
    })
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.research.profile_scheduler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="kvcmas", help="kvshare mode, or MODE:K for a recompute head")
    ap.add_argument("--length", type=int, default=1024, help="shared context tokens")
    ap.add_argument("--chains", type=int, default=6)
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from devtools.models import prepare

    model_path = str(prepare("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(model_path)
    out = Path(args.out or RESULTS / f"profile_{args.mode.replace(':', '_k')}.json")
    raw = out.with_suffix(".folded.txt")
    mode, _, head = args.mode.partition(":")
    spy = [str(Path(os.sys.executable).with_name("py-spy")), "record", "--subprocesses", "--format", "raw",
           "--rate", str(args.rate), "--output", str(raw), "--"]
    server = ServerProcess(model_path=model_path, wrapper=spy,
                           kvshare_args=mode_args(mode, ["--kvshare-recompute-head", head] if head else []))
    t0 = time.perf_counter()
    server.start()
    try:
        for i in range(args.chains):
            run_chain(server.url, tok, context_tokens(tok, args.length, seed=500 + i), floor=True)
        if mode == "kvcmas":
            wait_learning(server.url)
        load_s = time.perf_counter() - t0
    finally:
        os.kill(server.proc.pid, signal.SIGINT)  # py-spy writes its samples on SIGINT
        try:
            server.proc.wait(timeout=120)
        finally:
            server.stop()
    command = "python -m benchmarks.research.profile_scheduler " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"meta": run_meta(command.strip()), "command": command, "machine": machine(),
              "mode": args.mode, "length": args.length, "chains": args.chains, "rate_hz": args.rate,
              "wall_s_incl_startup": round(load_s, 1), "raw": raw.name,
              "note": "startup (model load, warm-up) is in the samples; shares are of scheduler samples, "
                      "idle threads excluded (py-spy default)",
              **summarize(parse_folded(raw))}
    write_json(out, result)
    print("scheduler threads:", result.get("scheduler_threads_share"))
    for row in result.get("event_loop_inclusive_kvshare", [])[:15]:
        print(f"{row['share_of_loop']:.3f}  {row['function']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
