"""``python -m benchmarks.research.idle_torch_thread``: does an idle thread that once ran torch ops slow the main thread?

Why this exists: a kvcmas server's dense prefills can run 8-28 % slower after
its learner has finished learning, while its thread stays alive. The cause is GNU libgomp, not
our code: every thread that runs an OpenMP parallel region keeps its own team
of OpenMP threads for as long as it lives, and once a process holds more
OpenMP threads than cores libgomp stops spinning at barriers, so each of the
main thread's parallel regions pays for putting threads to sleep and waking
them. This measures one small op mix (a 64 x 576 matmul, SiLU, add: the shape
of a decode step of the 135M model) on the main thread in three states:

* ``before``: only the main thread has run torch ops;
* ``idle_side_thread``: a second thread ran one randomized SVD (the learner's
  op) and now sleeps, still alive;
* ``busy_side_thread``: that thread computes (Gram products, as the learner's
  factorizations) at the lowest priority while the main thread is timed;
* ``single_idle`` / ``single_busy``: the same with the side thread's torch ops
  on that thread alone (``cache.single_thread.single_threaded_torch``: its own
  OpenMP count and MKL's thread-local one), as the learner's steps run with
  ``learn_single_thread``;
* ``after_exit``: the side threads have exited.

Medians and min-max over ``--repeats``; one process, so the ratios are within
one run of this machine. The learner therefore learns each step of an
observation on a thread that ends with it, single-threaded when asked
(``sglang_kvshare/learning/learner.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import queue
import statistics
import threading
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, machine, run_meta, write_json
from sglang_kvshare.learning.single_thread import single_threaded_torch


def op_time_us(iterations: int) -> float:
    x, w = torch.randn(64, 576), torch.randn(576, 576)
    start = time.perf_counter()
    for _ in range(iterations):
        torch.nn.functional.silu(x @ w) + x
    return (time.perf_counter() - start) / iterations * 1e6


def side_state(iterations: int, single: bool, busy: bool) -> float:
    """The main thread's op time while a side thread that ran an SVD sleeps or computes."""
    release: "queue.Queue[None]" = queue.Queue()
    ready: "queue.Queue[None]" = queue.Queue()

    def side() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # as the learner's steps
        except (AttributeError, OSError):
            pass
        if single:
            single_threaded_torch()
        m = torch.randn(30, 1024, 192)
        torch.svd_lowrank(m, q=40, niter=2)
        ready.put(None)
        while busy and release.empty():
            m.transpose(-1, -2) @ m
        release.get()  # alive until released

    thread = threading.Thread(target=side)
    thread.start()
    ready.get()
    time.sleep(0.2)
    took = op_time_us(iterations)
    release.put(None)
    thread.join()
    time.sleep(0.2)
    return took


STATES = {"idle_side_thread": (False, False), "busy_side_thread": (False, True),
          "single_idle": (True, False), "single_busy": (True, True)}


def one_repeat(iterations: int) -> dict:
    op_time_us(iterations // 4)  # warm
    row = {"before": op_time_us(iterations)}
    for name, (single, busy) in STATES.items():
        row[name] = side_state(iterations, single, busy)
    row["after_exit"] = op_time_us(iterations)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.research.idle_torch_thread", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--out", default=str(RESULTS / "idle_torch_thread.json"))
    args = ap.parse_args(argv)
    rows = [one_repeat(args.iterations) for _ in range(args.repeats)]
    summary = {}
    for key in ("before", *STATES, "after_exit"):
        values = [r[key] for r in rows]
        summary[key] = {"median_us": statistics.median(values), "min_us": min(values), "max_us": max(values)}
    ratios = {f"{name}_over_before": [r[name] / r["before"] for r in rows] for name in STATES}
    command = "python -m benchmarks.research.idle_torch_thread " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"meta": run_meta(command.strip()), "command": command, "machine": machine(),
              "torch_threads": torch.get_num_threads(), "op": "silu(x @ w) + x, x 64x576, w 576x576, float32",
              "side_thread_work": "one torch.svd_lowrank of 30x1024x192, then (busy) Gram products, at nice 19",
              "repeats": rows, "summary": summary,
              **{k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratios.items()}}
    write_json(Path(args.out), result)
    for key, cell in summary.items():
        print(f"{key:18s} {cell['median_us']:7.1f} us ({cell['min_us']:.1f}-{cell['max_us']:.1f})")
    print(" ".join(f"{k} {result[k]['median']:.2f}x" for k in ratios) + f"; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
