"""Shared serving-benchmark harness: servers per mode, streamed requests, stats, output.

Why one module: every serving benchmark must start the same real server the
same way (one mode at a time on this 2-core machine), time requests the same
way (TTFT = time to the first streamed chunk), and write JSON that says with
which command, on which machine, when and from which code it was measured
(``run_meta``, the ``meta`` key of every results file).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

import requests

from benchmarks.serving_digest import serving_digest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
"""The canonical results, one file per benchmark (``benchmarks.report`` lists them and writes docs/RESULTS.md)."""
SCRATCH = ROOT / "tmp"
"""Where smoke runs (``--quick``) write by default: git-ignored, so they never sit beside the canonical results."""


def mode_args(mode: str, extra: Sequence[str] = ()) -> list[str]:
    args = ["--kvshare-mode", mode]
    if mode == "kvcmas":
        args += ["--kvshare-learn-async", "true"]
    return args + list(extra)


@dataclass
class Timed:
    ttft: float
    e2e: float
    output_ids: list[int]
    meta: dict

    @property
    def report(self) -> dict:
        rep = self.meta.get("kvshare")
        return rep[0] if rep else {}


def stream_generate(url: str, input_ids: list[int], *, custom_params: Optional[dict] = None,
                    max_new_tokens: int = 128, ignore_eos: bool = False, timeout: float = 600) -> Timed:
    """Greedy generation, streamed; TTFT is the arrival of the first chunk with output."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
    if custom_params:
        sampling["custom_params"] = custom_params
    body = {"input_ids": input_ids, "sampling_params": sampling, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    last = None
    with requests.post(url + "/generate", json=body, stream=True, timeout=timeout) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line or not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = chunk
    e2e = time.perf_counter() - t0
    if last is None:
        raise RuntimeError("the server streamed no output")
    return Timed(ttft=ttft, e2e=e2e, output_ids=list(last.get("output_ids") or []), meta=last["meta_info"])


def prefilled_tokens(meta: dict) -> int:
    """Prompt tokens the server prefilled: the prompt minus SGLang's exact cache hits (``cached_tokens``) minus
    what kvshare served approximately (aligned, corrected, an earlier estimate; listed in the report)."""
    report = (meta.get("kvshare") or [{}])[0] or {}
    approx = sum(int(report.get(k) or 0) for k in ("tokens_aligned", "tokens_corrected", "tokens_estimate_hit"))
    return int(meta["prompt_tokens"]) - int(meta.get("cached_tokens") or 0) - approx


def wait_learning(url: str, timeout: float = 300.0) -> float:
    """Wait until the server's learner has no observation pending (at most ``timeout``); seconds waited.

    Why: a benchmark that measures "once pools are warm" must not start while
    the warm-up's observations still wait to be learned. A server without
    kvshare endpoints (stock SGLang) returns at once.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            resp = requests.get(url + "/kvshare/stats", timeout=30)
            if not resp.ok or not resp.json().get("pending_observations"):
                break
        except (requests.RequestException, ValueError):
            break
        time.sleep(0.5)
    return time.monotonic() - t0


VERIFICATION_ENDS = ("verified", "verify_empty", "verify_errors", "verify_timeouts")


def verifications_settled(snap: dict) -> bool:
    """Whether every verification the guard queued has ended (``GET /kvshare/fidelity``'s snapshot).

    Why not the queue's length alone: a job taken off the queue is in flight until it ends as verified, empty,
    an error or a timeout, and under load its reference can take seconds. A caller also waits for two equal
    polls, since a request's verification is queued just after its answer is sent."""
    counters = snap.get("counters") or {}
    done = sum(counters.get(k, 0) for k in VERIFICATION_ENDS)
    return (snap.get("queue") or {}).get("jobs", 1) == 0 and done >= counters.get("queued", 0)


def percentile(values: Sequence[float], q: float) -> float:
    data = sorted(values)
    if not data:
        return float("nan")
    k = (len(data) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def summary(values: Sequence[float]) -> dict:
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0}
    return {"n": len(vals), "p50": percentile(vals, 0.5), "p90": percentile(vals, 0.9),
            "mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        info["gpu"] = None
    return info


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """This process's command as typed: ``python -m <module> <args>`` (``argv`` default: ``sys.argv[1:]``).

    Why from ``sys.argv[0]``: under ``python -m`` it is the module's file, so the
    module name is its path below the repository root.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    if script is not None and script.suffix == ".py" and script.is_relative_to(ROOT):
        module = ".".join(script.relative_to(ROOT).with_suffix("").parts)
        head = f"python -m {module}"
    else:
        head = "python " + (sys.argv[0] if sys.argv and sys.argv[0] else "-c")
    return " ".join([head, shlex.join(args)]) if args else head


def run_meta(command: Optional[str] = None) -> dict:
    """The ``meta`` of a results JSON: command, machine, UTC date-time, git revision, whether the checkout was dirty,
    and the serving code's digest.

    ``command``: the command line that produced the results (default: this
    process's, ``command_line()``). ``git_revision`` is ``git rev-parse HEAD``
    of this checkout (None outside git); ``git_dirty`` is True when tracked
    files differ from it, so the revision alone does not name the code that ran.
    ``serving_digest`` (``benchmarks.serving_digest``) names the serving code of
    the working tree as it ran, uncommitted edits included: ``benchmarks.report``
    compares it with the tree's to mark a result stale, with no git history.
    """
    rev = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"command": command if command is not None else command_line(),
            "machine": machine(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "git_revision": rev.strip() if rev else None,
            "git_dirty": bool(status.strip()) if status is not None else None,
            "serving_digest": serving_digest(ROOT)}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _process_tree(pid: int) -> list:
    """A server's process and its children (scheduler, detokenizer), as ``psutil`` processes."""
    import psutil

    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a server and its children have used so far; exited children count 0."""
    import psutil

    total = 0.0
    for proc in _process_tree(pid):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total
