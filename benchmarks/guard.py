"""``python -m benchmarks.guard``: does the fidelity guard measure what reuse changes, keep its target, catch a bad
scope, and what does it cost?

    python -m benchmarks.guard --quick                 # retrieval only, small sizes: under 10 minutes here
    python -m benchmarks.guard --seed 13 --offset 700  # both tasks: 1-3 hours here

A run stopped part way keeps the tasks it finished; the same command with ``--task`` for each missing one, then
``--merge`` on the parts' files, gives the whole run's ``guard.json`` (``benchmarks.runs``).

Per task (the frontier's workflows, ``benchmarks.frontier``: task specs, programs, ``Runner``, ``run_arm``,
teacher-forced scoring against ``off``, ``summarize_arm``):

* **calibration** (``calibration_within_ci``): the guard at ``--verify-rate`` with no target (measure only). The
  benchmark itself asks every request for its top-5 distributions and replays *every* request served approximated
  KV densely (the guard's own reference: prompt + output ids, ``max_new_tokens`` 0, input top-5 from the last
  prompt token on), scored with the guard's ``measure.compare``. Per scope (agent) the mean over all its requests
  is the truth the guard's sample estimates; ``calibration_within_ci`` is the share of scopes whose truth lies
  inside the guard's reported 95 % interval (scopes with at least two verified requests; with fewer the interval
  is the metric's whole range and decides nothing).
* **controlled** (``controlled_reuse``, ``controlled_top1``): fullshared K=0 with the guard at ``--verify-rate`` and
  ``--target`` (and the server's verify burst: a new or just-moved scope's first ``min_samples`` approximated
  requests are verified, up to 3 x that while its interval straddles the target); its own unscored warm-up
  (``--controlled-warmup``, in rounds of ``--concurrency`` samples with the guard's queue drained after each) lets
  the controller act before the scored samples. Reuse and teacher-forced top-1 (along ``off``'s continuation, the
  frontier's metric) over the scored samples, TTFT of agents 2-4.
* **fixed K** (``best_global_k``): fullshared with one recomputed head of K rows for every agent, guard off;
  the best is the highest reuse among those whose teacher-forced top-1 meets the target's bound (None if none).
* **detection** (``detection_samples``): the task's shared input slot served noise (renamed into
  ``devtools.fault_injection``'s ``fault:`` slots, which this benchmark's server perturbs), the
  guard at ``--detect-rate`` with the target. Each sample runs with a *control twin* (another sample's workflow,
  agents and slots renamed: intact). Verified samples of each victim scope (the consumers of the perturbed slot)
  until it went dense; whether the control scopes stayed off dense and were still served reuse afterwards.

``min_samples`` of the controlled and detection arms is chosen on warm data only (``choose_min_samples``): the
calibration's warm-up requests give each scope's per-request spread and its distance to the bound; the choice
is the number of verified requests that resolves the closest scope, no more than the controlled warm-up can
supply, within [``MIN_SAMPLES_FLOOR``, ``--max-min-samples``]. No scored sample enters the choice.

Task-independent (top level): **overhead** (``overhead_ttft_ratio``, ``overhead_throughput_ratio``): two servers up
at once, fullshared, one with the guard at ``--overhead-rate`` and one at 0, the same annotated two-agent requests
(the second agent reuses the first's context, so there are approximated requests to verify) in ABBA order as
``benchmarks.stock_vs_off`` does; halfway the two servers swap roles (a runtime config change), so a difference
between the two processes cancels too. After each request of the guarded server the benchmark waits for its
guard queue to drain, so its dense references never run beside the other server's measured request on this
shared CPU: the ratios are the on-path cost; ``drain_s`` (those waits) bounds the off-path compute. And the
guard's queue (``GET /kvshare/stats`` -> ``fidelity``): peak ``approx_bytes`` and jobs seen, limits.

Servers: one kvshare server serves every arm of every task, reconfigured at runtime (``POST /kvshare/config``:
mode, head, verify rate, target and min samples are all runtime settings) and emptied before each
arm (``/kvshare/reset`` and ``/flush_cache``, the guard's queue drained, its estimates started afresh): a server
start costs about 40 s here. The overhead adds a second server.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence

import requests
from tqdm import tqdm

from benchmarks import frontier as fr
from benchmarks.chain_ttft import AGENTS, SUFFIX, system
from benchmarks import runs
from benchmarks.guard_metrics import (CONTROL, actions_since, approximated, best_global_k, choose_min_samples,
                                      counter_diff, detection_counts, pairs, reuse_ratio, score_calibration,
                                      fault_program, settings, twin_program)
from benchmarks.harness import (RESULTS, VERIFICATION_ENDS, command_line, machine, run_meta, stream_generate,
                                verifications_settled, write_json)
from benchmarks.stock_vs_off import verdict
from benchmarks.texts import context_tokens
from devtools.fault_injection import FAULT_PREFIX
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part
from sglang_kvshare.guard.controller import ladder, rule
from sglang_kvshare.guard.measure import compare
from sglang_kvshare.guard.target import FidelityTarget

COST_TOLERANCE = 0.05  # the guard's cost target: user TTFT and throughput within 5 % of the guard off
TOP_K = 5  # the guard's default verify_top_k: the benchmark's replay compares what the guard compares
VICTIM_SLOTS = {"retrieval": "doc", "gsm8k": "query"}  # read by every consumer


# ------------------------------------------------------------------ the server
@dataclass(frozen=True)
class GuardedArm(fr.Arm):
    """A frontier arm plus the guard's runtime settings (all ``POST /kvshare/config`` fields)."""

    verify_rate: float = 0.0
    target: Optional[str] = None
    min_samples: int = 20

    def config(self) -> dict:
        """The server's settings (a fixed head K travels in each request's annotation, ``frontier.build``)."""
        return {"mode": self.mode, "recompute_ratio": self.recompute_ratio, "min_reuse_tokens": self.min_reuse,
                "verify_rate": self.verify_rate,
                "fidelity_target": self.target or "", "fidelity_min_samples": self.min_samples}


def guarded(arm: fr.Arm) -> GuardedArm:
    """A plain frontier arm as a ``GuardedArm`` with the guard off."""
    return arm if isinstance(arm, GuardedArm) else GuardedArm(arm.name, arm.mode, arm.recompute_head, arm.mix_p,
                                                              arm.recompute_ratio)


class GuardServer:
    """One kvshare server driven through its admin routes: arms are runtime configurations of it."""

    def __init__(self, model_path: str) -> None:
        from devtools.server_process import ServerProcess

        self.key = secrets.token_hex(16)
        self.headers = {"Authorization": f"Bearer {self.key}"}
        self.process = ServerProcess(model_path=model_path,
                                     kvshare_args=["--kvshare-mode", "fullshared", "--kvshare-verify-rate", "0"],
                                     extra_args=["--admin-api-key", self.key, "--sleep-on-idle"],
                                     fault_injection=True)  # only the detection arm names fault: slots
        self.peak = {"approx_bytes": 0, "jobs": 0}

    @property
    def url(self) -> str:
        return self.process.url

    def start(self) -> "GuardServer":
        self.process.start()
        fr._ACTIVE.append(self.process)  # the frontier's SIGTERM handler stops it
        return self

    def stop(self) -> None:
        self.process.stop()
        if self.process in fr._ACTIVE:
            fr._ACTIVE.remove(self.process)

    def post(self, path: str, body: Optional[dict] = None) -> dict:
        resp = requests.post(self.url + path, json=body, headers=self.headers, timeout=300)
        if resp.status_code != 200:
            raise RuntimeError(f"POST {path} {body}: {resp.status_code} {resp.text[:300]}")
        try:
            return resp.json()
        except ValueError:  # /flush_cache answers in plain text
            return {"text": resp.text}

    def get(self, path: str) -> dict:
        resp = requests.get(self.url + path, headers=self.headers, timeout=300)
        resp.raise_for_status()
        return resp.json()

    def fidelity(self) -> dict:
        snap = self.get("/kvshare/fidelity")
        self.peak["approx_bytes"] = max(self.peak["approx_bytes"], snap["queue"]["approx_bytes"])
        self.peak["jobs"] = max(self.peak["jobs"], snap["queue"]["jobs"])
        return snap

    def drain(self, timeout: float = 600.0) -> dict:
        """Wait until every queued verification is done (verified, empty or failed); the guard's snapshot."""
        deadline, last = time.monotonic() + timeout, None
        while True:
            snap = self.fidelity()
            c = snap["counters"]
            state = (c.get("queued", 0), sum(c.get(k, 0) for k in VERIFICATION_ENDS))
            if verifications_settled(snap) and state == last:
                return snap
            if time.monotonic() > deadline:
                raise RuntimeError(f"the guard's queue did not drain in {timeout} s: {snap['queue']}, {c}")
            last = state
            time.sleep(0.3)

    def apply(self, arm: GuardedArm) -> None:
        """``arm``'s settings, empty caches and pools, and the guard started afresh (``POST /kvshare/fidelity/reset``:
        every scope's estimates, settings and pins, its counters and actions)."""
        self.drain()
        self.post("/kvshare/config", {**arm.config(), "verify_rate": 0.0})
        self.post("/kvshare/fidelity/reset")
        self.post("/kvshare/reset")
        self.post("/flush_cache")
        self.post("/kvshare/config", arm.config())
        self.fidelity()

    def stats(self) -> dict:
        return self.get("/kvshare/stats").get("fidelity") or {}


class Bench:
    """What every phase of one run shares: the server, the tokenizer, the arguments."""

    def __init__(self, server: GuardServer, tok: Any, args: argparse.Namespace) -> None:
        self.server, self.tok, self.args = server, tok, args
        self.after_warmup: dict[str, dict] = {}

    def enc(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def arm_server(self, spec: Optional[fr.TaskSpec] = None, warm: Sequence = (), max_tokens: int = 8
                   ) -> fr.ArmServer:
        """A frontier ``ArmServer``: the one server set to the arm, after ``warm`` samples run on it first.

        Why the warm-up here and not in ``run_arm``: the guard's state right after it (what the controller did
        before any scored sample) is read between the two."""
        @contextmanager
        def serve(arm: fr.Arm, _model_path: str) -> Iterator[str]:
            arm = guarded(arm)
            self.server.apply(arm)
            t0, counters = time.time(), self.server.fidelity()["counters"]
            runner = fr.Runner(self.server.url, arm, self.args.seed, self.tok.eos_token_id)
            step = self.args.concurrency
            for i in tqdm(range(0, len(warm), step), desc=f"{spec.name}/{arm.name} warm-up",
                          disable=self.args.no_progress or not warm):
                # A round of samples, then the guard's references: under a load that never pauses a reference
                # waits IDLE_WAIT_S for its turn, and the unscored traffic stands for earlier traffic with gaps.
                self.run_samples(runner, spec, warm[i:i + step], max_tokens, "", progress=False)
                self.server.drain()
            snap = self.server.drain()
            self.after_warmup[arm.name] = {"t0": t0, "t1": time.time(), "counters": counters, "snapshot": snap}
            yield self.server.url
            self.server.drain()
        return serve

    def run_samples(self, runner: fr.Runner, spec: fr.TaskSpec, samples: Sequence, max_tokens: int, desc: str,
                    after: Optional[Callable[[list[dict]], Any]] = None, progress: bool = True) -> list:
        """Each sample's workflow (``after`` on its rows, in the same worker), ``--concurrency`` at once."""
        def one(smp) -> Any:
            rows = runner.sample(spec.program(smp, self.enc, max_tokens), smp.id)
            return after(rows) if after else rows

        with ThreadPoolExecutor(self.args.concurrency) as pool:
            return list(tqdm(pool.map(one, samples), total=len(samples), desc=desc,
                             disable=self.args.no_progress or not progress))

    def run_arm(self, arm: GuardedArm, spec: fr.TaskSpec, samples, warm, off: Optional[dict], max_tokens: int,
                server_warm: Sequence = ()) -> dict:
        """``frontier.run_arm`` on this server (``server_warm``: unscored samples before the guard is read)."""
        args = argparse.Namespace(**{**vars(self.args), "arm_server": self.arm_server(spec, server_warm, max_tokens)})
        return fr.run_arm(arm, spec, samples, warm, self.tok, args, off, max_tokens)


# ------------------------------------------------------------------ calibration
class LogprobRunner(fr.Runner):
    """A frontier ``Runner`` whose calls also bring back their own top-k distributions (not streamed: no TTFT)."""

    def call(self, call: fr.Call, sample_id: str) -> dict:
        built = fr.build(call, self.arm, sample_id, self.seed, output_slot=call.output_slot)
        body = {"input_ids": built.input_ids, "return_logprob": True, "top_logprobs_num": TOP_K,
                "sampling_params": {"max_new_tokens": call.max_tokens, "temperature": 0.0,
                                    "custom_params": built.annotation.to_custom_params()}}
        resp = requests.post(self.url + "/generate", json=body, timeout=900)
        if resp.status_code != 200:
            raise RuntimeError(f"a calibration request failed ({resp.status_code}): {resp.text[:300]}")
        data = resp.json()
        meta, out = data["meta_info"], list(data.get("output_ids") or [])
        if call.output_slot and out and out[-1] != self.eos:
            self._commit_output(built, out)
        return {"agent": call.agent, "position": call.position, "call": call, "prompt": list(built.input_ids),
                "output_ids": out, "served": meta.get("output_top_logprobs") or [],
                "report": (meta.get("kvshare") or [{}])[0] or {}}


def dense_reference(url: str, prompt: list[int], output: list[int]) -> list:
    """The guard's reference, sent by the benchmark: a plain prefill of prompt + output, the input top-k from the
    last prompt token on, the first entry dropped (it predicts the prompt's last token)."""
    body = {"input_ids": prompt + output, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
            "top_logprobs_num": TOP_K, "sampling_params": {"max_new_tokens": 0}}
    resp = requests.post(url + "/generate", json=body, timeout=900)
    if resp.status_code != 200:
        raise RuntimeError(f"a dense replay failed ({resp.status_code}): {resp.text[:300]}")
    return (resp.json()["meta_info"].get("input_top_logprobs") or [])[1:]


def replay_rows(url: str, rows: list[dict], phase: str) -> list[dict]:
    """One record per row served approximated KV: its fidelity against the dense replay, as the guard scores."""
    records = []
    for row in rows:
        rep = row["report"]
        if not approximated(rep) or not row["output_ids"]:
            continue
        fid = compare(pairs(row["served"]), pairs(dense_reference(url, row["prompt"], row["output_ids"])))
        if fid is None:
            continue
        guard = rep.get("guard") or {}
        records.append({"scope": guard.get("scope", row["agent"]), "phase": phase, "top1": fid.top1, "kl": fid.kl,
                        "positions": fid.positions, "verified": bool(guard.get("verified"))})
    return records


def run_calibration(bench: Bench, spec: fr.TaskSpec, samples, warm, max_tokens: int) -> dict:
    """The guard measuring only; every approximated request replayed densely; its estimates against the truth."""
    args = bench.args
    arm = GuardedArm("calibration", "fullshared", 0, verify_rate=args.verify_rate)
    bench.server.apply(arm)
    before = dict(bench.server.fidelity()["counters"])
    runner = LogprobRunner(bench.server.url, arm, args.seed, bench.tok.eos_token_id)
    records: list[dict] = []
    for phase, group in (("warm", warm), ("scored", samples)):
        done = bench.run_samples(runner, spec, group, max_tokens, f"{spec.name}/calibration {phase}",
                                 after=lambda rows, p=phase: replay_rows(bench.server.url, rows, p))
        records += [r for part in done for r in part]
    snap = bench.server.drain()
    out = score_calibration(records, snap["per_scope"])
    out.update({"verify_rate": args.verify_rate, "approximated_requests": len(records),
                "guard_counters": counter_diff(before, snap["counters"]),
                "records": records})
    return out


def warm_values(records: Sequence[Mapping]) -> dict[str, list[float]]:
    by: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r["phase"] == "warm":
            by[r["scope"]].append(r["top1"])
    return dict(by)


# ------------------------------------------------------------------ detection
def run_detection(bench: Bench, spec: fr.TaskSpec, samples: Sequence, controls_from: Sequence, max_tokens: int,
                  min_samples: int) -> dict:
    """Perturb the task's shared input slot; sample by sample (drained), until every victim scope is dense.

    Each victim sample is followed by the control twin of another sample (``controls_from``, same index): other
    tokens, so it never meets the victims' rows in the cache (an exact or estimate hit of the same tokens would
    hide its own reuse, or bring it the perturbed rows). The last pair of samples is kept for ``served_after``."""
    args = bench.args
    slot = FAULT_PREFIX + VICTIM_SLOTS[spec.name]
    arm = GuardedArm("detection", "fullshared", 0, verify_rate=args.detect_rate, target=args.target,
                     min_samples=min_samples)
    bench.server.apply(arm)
    t0, before = time.time(), bench.server.fidelity()["counters"]
    runner = fr.Runner(bench.server.url, arm, args.seed, bench.tok.eos_token_id)
    victims: set[str] = set()
    controls: set[str] = set()
    polls, rows, control_reports = [], [], []
    for smp, other in tqdm(list(zip(samples[:-1], controls_from[:-1])), desc=f"{spec.name}/detection",
                           disable=args.no_progress):
        rows = runner.sample(fault_program(spec.program(smp, bench.enc, max_tokens), VICTIM_SLOTS[spec.name]),
                             smp.id)
        rows += runner.sample(twin_program(spec.program(other, bench.enc, max_tokens)), other.id + CONTROL)
        for row in rows:
            if row["position"] > 1 and row["report"].get("guard"):
                reads = {p.slot for p in row["call"].pieces if p.kind == "shared"}
                (victims if slot in reads else controls).add(row["report"]["guard"]["scope"])
        control_reports += [r["report"] for r in rows if r["position"] > 1 and r["agent"].endswith(CONTROL)]
        snap = bench.server.drain()
        polls.append({s: {"setting": v["setting"], "samples": v["samples"]} for s, v in snap["per_scope"].items()})
        if victims and all((polls[-1].get(v) or {}).get("setting") == "dense" for v in victims):
            break
    out = detection_counts(polls, sorted(victims), sorted(controls))
    snap = bench.server.fidelity()
    out.update({"slot": slot, "verify_rate": args.detect_rate, "target": args.target, "min_samples": min_samples,
                "samples_run": len(polls), "control_reuse_ratio": reuse_ratio(control_reports),
                "recent_actions": actions_since(snap["recent_actions"], t0), "final": settings(snap["per_scope"]),
                "guard_counters": counter_diff(before, snap["counters"])})
    out["after"] = served_after(bench, runner, spec, samples[len(polls)], controls_from[len(polls)], max_tokens)
    out["others_kept_reuse"] = bool(out["others_not_dense"] and out["after"]["control_reuse_min"] > 0) \
        if controls else None
    return out


def served_after(bench: Bench, runner: fr.Runner, spec: fr.TaskSpec, smp: Any, other: Any, max_tokens: int) -> dict:
    """One more victim sample and control twin, unverified: what each scope is served now.

    Unverified because a verified request of a dense scope is a probe, served under the next looser setting."""
    bench.server.post("/kvshare/config", {"verify_rate": 0.0})  # keeps the guard's estimates and settings
    rows = runner.sample(fault_program(spec.program(smp, bench.enc, max_tokens), VICTIM_SLOTS[spec.name]), smp.id)
    rows += runner.sample(twin_program(spec.program(other, bench.enc, max_tokens)), other.id + CONTROL)
    cons = [r for r in rows if r["position"] > 1]
    victim = [r["report"] for r in cons if not r["agent"].endswith(CONTROL)]
    control = [r["report"] for r in cons if r["agent"].endswith(CONTROL)]
    guards = [(r["report"].get("guard") or {}, r["agent"]) for r in cons]
    return {"victim_reuse_ratio": reuse_ratio(victim), "control_reuse_ratio": reuse_ratio(control),
            "control_reuse_min": min((r.get("shared_tokens_reused", 0) for r in control), default=0),
            "served": {gd.get("scope", agent): gd.get("setting") for gd, agent in guards}}


# ------------------------------------------------------------------ one task
class Sizes(NamedTuple):
    """How much of a task a run measures."""

    limit: int  # scored samples of every frontier arm
    warmup: int  # unscored samples before each arm (and the warm data of the min-samples choice)
    calibration: int  # samples of the calibration run after its warm-up
    controlled_warmup: int  # unscored samples the guarded arm runs before it is read and scored
    max_tokens: int


def task_sizes(name: str, args: argparse.Namespace) -> Sizes:
    """The sizes of ``name``: the options where given, else the defaults (``--quick``: small ones)."""
    q, retrieval = args.quick, name == "retrieval"
    limit = args.limit or ((8 if q else 60) if retrieval else (3 if q else 10))
    return Sizes(limit=limit,
                 warmup=args.warmup if args.warmup is not None else (12 if q else 4),
                 calibration=max(limit, (40 if q else 120) if retrieval else (4 if q else 50)),
                 controlled_warmup=args.controlled_warmup if args.controlled_warmup is not None else (
                     (24 if q else 80) if retrieval else (4 if q else 40)),
                 max_tokens=args.max_tokens or (8 if retrieval else (32 if q else 48)))


def arm_cell(a: dict) -> dict:
    """What guard.json keeps of a ``summarize_arm`` result."""
    keys = ("reuse_ratio", "teacher_forced_top1", "teacher_forced_kl", "teacher_forced_positions",
            "teacher_forced_reuse_ratio", "teacher_forced_per_agent", "reuse_per_agent", "agreement_final",
            "accuracy", "scored_items", "ttft_agents_2_4_s", "fallback_reasons", "run_s")
    return {k: a.get(k) for k in keys}


def run_fixed(bench: Bench, spec: fr.TaskSpec, samples, warm, size: Sizes) -> tuple[dict, dict]:
    """``off`` (the reference run) and fullshared with each fixed head, guard off; (off's run, summaries)."""
    off = bench.run_arm(GuardedArm("off", "off"), spec, samples, warm, None, size.max_tokens)
    arms = {"off": fr.summarize_arm(off, off, spec, samples, bench.decode)}
    for k in bench.args.heads:
        arm = GuardedArm(f"fullshared_k{k}", "fullshared", k)
        run = bench.run_arm(arm, spec, samples, warm, off, size.max_tokens)
        arms[arm.name] = fr.summarize_arm(run, off, spec, samples, bench.decode)
    return off, arms


def run_controlled(bench: Bench, spec: fr.TaskSpec, samples, off: dict, size: Sizes, min_samples: int
                   ) -> tuple[dict, dict]:
    """The guarded arm: its own warm-up (the controller may act), then the scored samples; (summary, guard's view)."""
    args = bench.args
    arm = GuardedArm("guarded", "fullshared", 0, verify_rate=args.verify_rate, target=args.target,
                     min_samples=min_samples)
    warm = fr.load_warmup(spec, args.offset + size.limit, size.controlled_warmup)
    run = bench.run_arm(arm, spec, samples, [], off, size.max_tokens, server_warm=warm)
    summary = fr.summarize_arm(run, off, spec, samples, bench.decode)
    after, end = bench.after_warmup[arm.name], bench.server.fidelity()
    return summary, {"verify_rate": args.verify_rate, "target": args.target, "min_samples": min_samples,
                     "ttft_agents_2_4_s": summary["ttft_agents_2_4_s"],
                     "actions_in_warmup": actions_since(after["snapshot"]["recent_actions"], after["t0"]),
                     "actions_in_scored": actions_since(end["recent_actions"], after["t1"]),
                     "settings_after_warmup": settings(after["snapshot"]["per_scope"]),
                     "settings_at_end": settings(end["per_scope"]), "per_scope_at_end": end["per_scope"],
                     "guard_counters": counter_diff(after["counters"], end["counters"])}


def run_task(name: str, bench: Bench) -> dict:
    """Every per-task measurement, in an order that tunes nothing on scored samples (see the module docstring)."""
    args = bench.args
    spec = fr.task_spec(name, args.seed)
    size = task_sizes(name, args)
    offset = args.offset
    samples = spec.load(size.limit, offset)
    warm = fr.load_warmup(spec, offset + size.limit, size.warmup)
    bound = FidelityTarget.parse(args.target).bound
    out: dict = {"samples": len(samples), "warmup_samples": len(warm), "sizes": size._asdict(), "offset": offset}

    calibration = run_calibration(bench, spec, spec.load(size.calibration, offset), warm, size.max_tokens)
    budget = controlled_budget(args.verify_rate, size.controlled_warmup)
    choice = choose_min_samples(warm_values(calibration["records"]), bound, budget, ceiling=args.max_min_samples)
    out.update({"calibration_within_ci": calibration["within_ci"], "calibration": calibration, "min_samples": choice})

    off, arms = run_fixed(bench, spec, samples, warm, size)
    best = best_global_k({k: arms[f"fullshared_k{k}"] for k in args.heads}, bound)
    out.update({"best_global_k": best["k"], "best_global_k_reuse": best["reuse"], "best_global_k_top1": best["top1"]})

    arms["guarded"], out["controlled"] = run_controlled(bench, spec, samples, off, size, choice["chosen"])
    out.update({"controlled_reuse": arms["guarded"]["reuse_ratio"],
                "controlled_top1": arms["guarded"]["teacher_forced_top1"],
                "arms": {n: arm_cell(a) for n, a in arms.items()}})

    n = 2 * choice["chosen"] + 4  # enough for a victim caught at the minimum, with room for a slower one
    both = spec.load(2 * (n + 1), offset)  # + 1: the sample served after the loop
    out["detection"] = run_detection(bench, spec, both[:n + 1], both[n + 1:], size.max_tokens, choice["chosen"])
    out["detection_samples"] = out["detection"]["detection_samples"]
    return out


def controlled_budget(rate: float, warmup: int) -> int:
    """Verified requests per scope and setting that the controlled warm-up can supply: at the rate alone
    ``rate * warmup``; with the server's burst (``verify_burst``, on by default) every setting gets its
    minimum at once, so a minimum of ``warmup / steps`` still lets a scope climb the whole ladder (five steps from
    head 0 to dense) before the scored samples."""
    steps = len(ladder(0)) - 1
    return max(int(rate * warmup), warmup // steps)


# ------------------------------------------------------------------ overhead
def agent_request(tok: Any, agent: str, ctx: list[int], slot: str) -> tuple[list[int], dict]:
    """The chain benchmark's request of ``agent`` over ``ctx``, with the shared context under ``slot``."""
    return build_request(tok, agent, [private_part(system(agent)), shared_part(ctx, slot), private_part(SUFFIX)])


ROLES = ("guard", "plain")
PRODUCER, CONSUMER = list(AGENTS)[:2]


def overhead_order(i: int) -> tuple[str, str]:
    """ABBA: the guarded server first on even pairs, the plain one on odd ones."""
    return ROLES if i % 2 == 0 else ROLES[::-1]


def _consumer(url: str, tok: Any, ctx: list[int], slot: str, tokens: int) -> Any:
    """Producer (untimed), then the consumer that reuses its context; the consumer's timed stream."""
    ids, cp = agent_request(tok, PRODUCER, ctx, slot)
    stream_generate(url, ids, custom_params=cp, max_new_tokens=1)
    ids, cp = agent_request(tok, CONSUMER, ctx, slot)
    return stream_generate(url, ids, custom_params=cp, max_new_tokens=tokens)


class Overhead:
    """Paired guarded / plain measurements on two servers; ``roles`` says which server is guarded."""

    def __init__(self, tok: Any, args: argparse.Namespace) -> None:
        self.tok, self.args = tok, args
        self.roles: dict[str, GuardServer] = {}
        self.drain_s = 0.0

    def settle(self, role: str) -> None:
        """After a guarded request: its references done before anything else runs (timed: the off-path cost,
        plus at least two polls of the queue)."""
        if role == "guard":
            t0 = time.perf_counter()
            self.roles[role].drain()
            self.drain_s += time.perf_counter() - t0

    def ttft_pair(self, i: int) -> dict:
        ctx = context_tokens(self.tok, OVERHEAD_LENGTH, seed=170_000 + i)
        row: dict = {"order": list(overhead_order(i))}
        for role in overhead_order(i):
            timed = _consumer(self.roles[role].url, self.tok, ctx, f"ctx{i}", OVERHEAD_TOKENS)
            row[role] = timed.ttft
            row[f"{role}_approximated"] = approximated(timed.report)
            self.settle(role)
        row["ratio"] = row["guard"] / row["plain"]
        return row

    def throughput_round(self, r: int) -> dict:
        ctxs = [context_tokens(self.tok, OVERHEAD_LENGTH // 2, seed=190_000 + 100 * r + j)
                for j in range(OVERHEAD_BATCH)]
        row: dict = {"order": list(overhead_order(r))}
        for role in overhead_order(r):
            url = self.roles[role].url
            for j, ctx in enumerate(ctxs):  # producers first, untimed
                ids, cp = agent_request(self.tok, PRODUCER, ctx, f"b{r}-{j}")
                stream_generate(url, ids, custom_params=cp, max_new_tokens=1)
            reqs = [agent_request(self.tok, CONSUMER, ctx, f"b{r}-{j}") for j, ctx in enumerate(ctxs)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(reqs)) as pool:
                done = list(pool.map(lambda q: stream_generate(url, q[0], custom_params=q[1], ignore_eos=True,
                                                               max_new_tokens=OVERHEAD_TOKENS), reqs))
            wall = time.perf_counter() - t0
            tokens = sum(len(q[0]) for q in reqs) + sum(len(t.output_ids) for t in done)
            row[role] = {"wall_s": wall, "tokens_per_s": tokens / wall,
                         "approximated": sum(1 for t in done if approximated(t.report))}
            self.settle(role)
        row["ratio"] = row["guard"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        return row


def halves(n: int) -> tuple[range, range]:
    """Indices ``0..n-1`` cut in two: the first half's pairs run with one server guarded, the second's the other."""
    return range(0, n // 2), range(n // 2, n)


def run_overhead(main_server: GuardServer, tok: Any, args: argparse.Namespace) -> dict:
    """Guard at ``--overhead-rate`` against 0 on two servers; the servers swap roles halfway."""
    other = GuardServer(main_server.process.model_path).start()
    try:
        servers = {"a": main_server, "b": other}
        bench = Overhead(tok, args)
        ttft, rounds, counters, drain_s = [], [], {}, 0.0
        for h, (g, p) in enumerate((("a", "b"), ("b", "a"))):
            bench.roles = {"guard": servers[g], "plain": servers[p]}
            servers[g].apply(GuardedArm("overhead_guard", "fullshared", 0, verify_rate=args.overhead_rate))
            servers[p].apply(GuardedArm("overhead_plain", "fullshared", 0, verify_rate=0.0))
            bench.ttft_pair(-1 - h)  # unrecorded: each server's first requests after a switch pay one-off costs
            before, drain0 = servers[g].fidelity()["counters"], bench.drain_s
            ttft += [dict(bench.ttft_pair(i), guarded_server=g)
                     for i in tqdm(halves(args.overhead_pairs)[h], desc=f"overhead ttft ({h + 1}/2)",
                                   disable=args.no_progress)]
            rounds += [dict(bench.throughput_round(r), guarded_server=g)
                       for r in tqdm(halves(args.overhead_rounds)[h], desc=f"overhead throughput ({h + 1}/2)",
                                     disable=args.no_progress)]
            counters[g] = counter_diff(before, servers[g].drain()["counters"])
            drain_s += bench.drain_s - drain0
    finally:
        other.stop()
        for key, value in other.peak.items():  # one record of the queue's peak over every server of the run
            main_server.peak[key] = max(main_server.peak[key], value)
    return {"verify_rate": args.overhead_rate, "length": OVERHEAD_LENGTH, "output_tokens": OVERHEAD_TOKENS,
            "batch": OVERHEAD_BATCH, "ratio": "guarded / plain, per pair (same requests, ABBA order)",
            "ttft": {"pairs": ttft, "verdict": verdict([r["ratio"] for r in ttft], COST_TOLERANCE)},
            "throughput": {"pairs": rounds, "verdict": verdict([r["ratio"] for r in rounds], COST_TOLERANCE)},
            "verified_requests": sum(c.get("verified", 0) for c in counters.values()),
            "drain_s": round(drain_s, 2), "guard_counters": counters}


# ------------------------------------------------------------------ plot
def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(25, 4.6))
    tasks = out.get("tasks", {})
    ax = axes[0]
    labels = []
    for name, t in tasks.items():
        for scope, row in t["calibration"]["per_scope"].items():
            x, c = len(labels), row["top1"]
            labels.append(f"{name}/{scope} (n={c['guard_n']})")
            if c["inside"] is not None:  # an interval of fewer than two samples is the whole range: not drawn
                ax.plot([x, x], c["ci95"], color="tab:blue", lw=3, alpha=0.5)
            if c["guard_mean"] is not None:
                ax.plot(x, c["guard_mean"], "o", color="tab:blue" if c["inside"] is not None else "lightgray")
            ax.plot(x, c["true_mean"], "x", color="black", ms=9)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("top-1 agreement with dense, per request")
    ax.set_title("calibration: guard's estimate + 95 % interval (blue; gray: n < 2)\n"
                 "vs mean over every request (x)", fontsize=9)
    ax = axes[1]
    for name, t in tasks.items():
        ks = [k for k in out["heads"] if f"fullshared_k{k}" in t["arms"]]
        xs = [t["arms"][f"fullshared_k{k}"]["reuse_ratio"] or 0.0 for k in ks]
        ys = [t["arms"][f"fullshared_k{k}"]["teacher_forced_top1"] for k in ks]
        line, = ax.plot(xs, ys, "o-", label=f"{name}: fixed K")
        for k, x, y in zip(ks, xs, ys):
            ax.annotate(f"K{k}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        if t.get("controlled_reuse") is not None:
            ax.plot(t["controlled_reuse"], t["controlled_top1"], "*", ms=14, color=line.get_color(),
                    label=f"{name}: guarded")
    ax.axhline(out["target_bound"], color="tab:green", ls="--", lw=1, label=f"target {out['target']}")
    ax.set_xlabel("reuse ratio (consumers)")
    ax.set_ylabel("teacher-forced top-1 vs off")
    ax.set_title("controlled vs one global K", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[2]
    for name, t in tasks.items():
        ks = [k for k in out["heads"] if f"fullshared_k{k}" in t["arms"]]
        cells = [t["arms"][f"fullshared_k{k}"] for k in ks]
        line, = ax.plot([c["reuse_ratio"] or 0.0 for c in cells],
                        [(c.get("ttft_agents_2_4_s") or {}).get("median") for c in cells], "o-",
                        label=f"{name}: fixed K")
        guarded, off = t["arms"].get("guarded") or {}, t["arms"].get("off") or {}
        if guarded:
            ax.plot(guarded["reuse_ratio"] or 0.0, (guarded.get("ttft_agents_2_4_s") or {}).get("median"), "*",
                    ms=14, color=line.get_color(), label=f"{name}: guarded")
        if off:
            ax.plot(0.0, (off.get("ttft_agents_2_4_s") or {}).get("median"), "s", color=line.get_color(),
                    label=f"{name}: off")
    ax.set_xlabel("reuse ratio (consumers)")
    ax.set_ylabel("TTFT of agents 2-4, median (s)")
    ax.set_title("what the reuse buys: TTFT", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[3]
    names = list(tasks)
    det = [tasks[n].get("detection_samples") or 0 for n in names]
    ax.bar(range(len(names)), det, color=["tab:red" if tasks[n].get("detection_samples") else "lightgray"
                                          for n in names])
    ax.scatter(range(len(names)), [tasks[n]["detection"]["min_samples"] for n in names], marker="_", s=600,
               color="black", label="min_samples", zorder=3)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("verified samples until dense")
    ax.set_title("detection of a perturbed slot (gray: not caught)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[4]
    ov = out.get("overhead")
    if ov:
        for x, key in enumerate(("ttft", "throughput")):
            rs = [r["ratio"] for r in ov[key]["pairs"]]
            ax.plot([x] * len(rs), rs, "o", ms=3, alpha=0.5, color="gray")
            v = ov[key]["verdict"]
            ax.errorbar(x, v["median"], yerr=[[v["median"] - v["ci95"][0]], [v["ci95"][1] - v["median"]]],
                        fmt="s", color="tab:blue", capsize=5)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([0, 1], ["TTFT (>1 slower)", "throughput (<1 slower)"])
        ax.set_title(f"overhead, guard at {ov['verify_rate']} / at 0: median, 95 % interval", fontsize=9)
    fig.suptitle(f"fidelity guard: {', '.join(names) or 'no task'}; verify rate {out['verify_rate']}, "
                 f"target {out['target']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.guard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="retrieval only (unless --task), small sizes, heads 0 32 64, min samples at most 6")
    ap.add_argument("--task", choices=fr.TASKS + ("all",), default=None, help="default: all (--quick: retrieval)")
    ap.add_argument("--limit", type=int, default=None,
                    help="scored samples (default retrieval 60, gsm8k 10; --quick 8 / 3)")
    ap.add_argument("--warmup", type=int, default=None, help="unscored samples before each arm (default 4; quick 12)")
    ap.add_argument("--controlled-warmup", type=int, default=None,
                    help="unscored samples the guarded arm runs first, so the controller can act before scoring "
                         "(default retrieval 80, others 40; --quick 24 / 4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default retrieval 8, others 48 (--quick 32)")
    ap.add_argument("--heads", type=int, nargs="+", default=None,
                    help="fixed K arms (default 0 8 16 32 64; --quick 0 32 64)")
    ap.add_argument("--verify-rate", type=float, default=0.1, help="the guard's rate in calibration and control")
    ap.add_argument("--target", default="top1>=0.99")
    ap.add_argument("--max-min-samples", type=int, default=None, help="ceiling of the chosen min_samples (20; quick 6)")
    ap.add_argument("--detect-rate", type=float, default=1.0)
    ap.add_argument("--overhead-rate", type=float, default=0.05)
    ap.add_argument("--overhead-pairs", type=int, default=None, help="paired TTFT requests (default 40; quick 12)")
    ap.add_argument("--overhead-rounds", type=int, default=None, help="paired batches (default 12; quick 4)")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="retrieval: which generated documents (a new seed, new ones)")
    ap.add_argument("--offset", type=int, default=0,
                    help="index of the first scored, calibration and detection sample: held-out samples that an "
                         "earlier run, read while designing, did not score")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--merge", nargs="+", default=None, metavar="PART",
                    help="join the guard.json files of one run measured in parts (the same command, each with "
                         "--task for what the others lack) into OUT_DIR/guard.json; measures nothing")
    args = ap.parse_args(argv)
    q = args.quick
    args.task = args.task or ("retrieval" if q else "all")
    args.heads = args.heads or ([0, 32, 64] if q else [0, 8, 16, 32, 64])
    args.max_min_samples = args.max_min_samples or (6 if q else 20)
    args.overhead_pairs = args.overhead_pairs or (12 if q else 40)
    args.overhead_rounds = args.overhead_rounds or (4 if q else 12)
    if args.overhead_pairs < 4 or args.overhead_rounds < 4:
        ap.error("--overhead-pairs and --overhead-rounds need at least 4 (two paired ratios per half)")
    FidelityTarget.parse(args.target)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    import signal

    args = parse_args(argv)
    if args.merge:
        command = command_line(argv)
        return runs.join("merge", args.merge, lambda parts: runs.merge_tasks(parts, command, parse_args, fr.TASKS),
                         lambda out: save(out, Path(args.out_dir)))
    signal.signal(signal.SIGTERM, fr._on_sigterm)
    from transformers import AutoTokenizer

    from devtools.models import prepare

    args.model_path = str(prepare(args.model))
    tok = AutoTokenizer.from_pretrained(args.model_path)
    command = command_line(argv)
    out_dir = Path(args.out_dir)
    out: dict = {"meta": run_meta(command), "command": command, "machine": machine(), "model": args.model,
                 "quick": args.quick, "verify_rate": args.verify_rate, "target": args.target,
                 "target_bound": FidelityTarget.parse(args.target).bound, "heads": args.heads, "top_k": TOP_K,
                 "seed": args.seed, "offset": args.offset,
                 "concurrency": args.concurrency, "controller": rule(),
                 "complete": False,
                 "tasks": {}}
    t0 = time.monotonic()
    server = GuardServer(args.model_path).start()
    try:
        bench = Bench(server, tok, args)
        for name in (fr.TASKS if args.task == "all" else (args.task,)):
            out["tasks"][name] = run_task(name, bench)
            save(out, out_dir)
            t = out["tasks"][name]
            print(f"[{name}] calibration within CI {t['calibration_within_ci']} "
                  f"({t['calibration']['scopes_judged']} scopes judged); controlled reuse {t['controlled_reuse']} "
                  f"top1 {t['controlled_top1']}; best K {t['best_global_k']} reuse {t['best_global_k_reuse']} "
                  f"top1 {t['best_global_k_top1']}; detection {t['detection_samples']} samples "
                  f"(min {t['min_samples']['chosen']})", file=sys.stderr, flush=True)
        if not args.no_overhead:
            out["overhead"] = run_overhead(server, tok, args)
            out["overhead_ttft_ratio"] = out["overhead"]["ttft"]["verdict"]
            out["overhead_throughput_ratio"] = out["overhead"]["throughput"]["verdict"]
        out["guard_queue"] = queue_record(server)
    finally:
        server.stop()
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["complete"] = True
    save(out, out_dir)
    return 0


def queue_record(server: GuardServer) -> dict:
    """The guard queue's peak over the run and its limits and usage now (``guard_queue`` of the results)."""
    stats = server.stats()
    return {"peak_approx_bytes": server.peak["approx_bytes"], "peak_jobs": server.peak["jobs"],
            "limits": stats.get("limits"), "usage_at_end": stats.get("usage")}


def save(out: dict, out_dir: Path) -> None:
    """``guard.json`` and ``guard.png`` in ``out_dir`` (rewritten after every task: a stopped run keeps its tasks)."""
    write_json(out_dir / "guard.json", out)
    plot(out, out_dir / "guard.png")


if __name__ == "__main__":
    raise SystemExit(main())
