"""Run a background thread's torch ops on that one thread: no OpenMP team, no MKL threads.

Why: GNU libgomp gives every thread that runs a parallel region a team of
worker threads, and once a process holds more OpenMP threads than cores it
stops spinning at barriers, so every parallel region of the scheduler's
forward pays for sleeping and waking its threads (docs/research/PROFILE.md, findings
1b-1d). A learner thread whose ops run single-threaded starts no team, so the
scheduler's threads keep spinning and keep the cores, and the learner (at
the lowest priority) gets what the forward leaves, about half as fast. Measured
on this project's 2-core CPU (``benchmarks/results/idle_torch_thread.json``,
PROFILE finding 1d): a small op mix on the main thread took 243 us alone,
708 us beside a thread computing with torch's defaults and 259 us beside one
computing single-threaded (medians of 5). Used only with
``learn_single_thread``: the slower learning cost serving reuse.

``torch.set_num_threads`` is process-wide, so this sets the calling thread's
own counts: OpenMP's in the libgomp torch loaded and MKL's thread-local one
(LAPACK and BLAS calls thread on their own). Order matters: ATen sets each
thread's OpenMP count from its global one on that thread's first parallel op,
so that runs first (``torch.get_num_threads()`` does it), then ours.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional


@functools.lru_cache(maxsize=1)
def torch_libgomp() -> Optional[ctypes.CDLL]:
    """torch's GNU OpenMP runtime, as mapped in this process (Linux); None elsewhere or when absent."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def _mkl_set_local() -> Optional[ctypes._CFuncPtr]:
    """MKL's C ``MKL_Set_Num_Threads_Local(int)`` as linked into torch, or None."""
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        # NOTE: the mixed-case name is the C entry point (by value); the lower-case one is
        # the Fortran one (by reference) in this build.
        return ctypes.CDLL(path).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None


def single_threaded_torch() -> bool:
    """Make the calling thread's torch ops run on it alone; True when OpenMP took it (MKL: when present)."""
    import torch

    lib = torch_libgomp()
    if lib is None:
        return False
    torch.get_num_threads()  # ATen's per-thread OpenMP setup runs now, not at the first real op
    lib.omp_set_num_threads(1)
    mkl = _mkl_set_local()
    if mkl is not None:
        mkl(1)
    return int(lib.omp_get_max_threads()) == 1
