"""``python -m benchmarks.frontier``: the fidelity frontier, reuse against agreement with ``off``.

    python -m benchmarks.frontier --task retrieval --limit 100
    python -m benchmarks.frontier --task gsm8k --limit 50 --max-tokens 128
    python -m benchmarks.frontier --merge OUT PART.json...   # arms run in parts on the same samples
    python -m benchmarks.frontier --pool OUT SEED_A.json...  # the same arms on other seeds, pooled

For each task the arms are ``off``; ``fullshared`` and ``kvcmas`` with a head
of K rows (each request's annotation ``recompute_head``) for K in ``--heads``, and with
``--kvshare-recompute-ratio r`` for r in ``--ratios``; and the *random-mix
baseline*: fullshared with a share ``p`` of the consumers' shared segments
prefilled densely (for this baseline only, client-side: such a segment gets a
slot name no producer used, so the server finds no source and staged prefill
resumes reuse after it). The sweep runs p in ``--mix`` and uses ``fullshared``
K=0 as p=0 and ``off`` as p=1; the line through those points is what a coin
buys at each reuse ratio. An arm adds value only above that line.

Every arm runs the same samples (seeded) on a fresh server (one at a time),
after ``--warmup`` unscored samples. Right after each sample, on the same
server (while its sources are still in the pool), every consumer request is
*teacher-forced*: ``off``'s prompt + ``off``'s continuation,
annotated like the real request, with ``return_logprob`` and the top-20 of
every continuation position; compared with ``off``'s own teacher-forced
top-20 (top-1 agreement, mean KL over the top-k support; see
``benchmarks.frontier_metrics``).

Workflows, built directly on ``/generate`` (so the teacher-forced replay is
the same request, token for token): ``retrieval`` (``benchmarks.workloads.retrieval``:
four agents, one lookup each in a shared 12-fact document) and the ``refer``
workflow of GSM8K with the roles and instructions of
``benchmarks.workloads`` (three role agents read the shared query, the final
agent reads the query and their answers; the first role agent is the producer).

Numbers per arm (``consumer`` = agents 2-4, where reuse can happen):
``reuse_ratio`` = shared tokens served by alignment or correction / shared
tokens, over consumer requests, from the server reports (a recomputed head
counts as prefilled); ``agreement_final`` = the final answer equals off's
(retrieval: each consumer lookup's value; GSM8K: the final agent's number);
``identical_text``; ``teacher_forced_top1`` and
``teacher_forced_kl``; ``accuracy`` (retrieval: consumer lookups right;
otherwise the final answer) with the paired difference to off and its 95 %
bootstrap interval; ``ttft_agents_2_4_s`` (client-side, streamed: request
sent -> first chunk; with ``--concurrency`` > 1 it includes queueing).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import Callable, ContextManager, Generator, Iterator, Optional, Sequence

import requests
from tqdm import tqdm

from benchmarks import frontier_metrics as fm
from benchmarks import runs
from benchmarks.harness import RESULTS, machine, run_meta, stream_generate, write_json
from benchmarks.workloads.role_set import draw
from sglang_kvshare.protocol import Segment
from sglang_kvshare.frontend.builder import BuiltRequest, Piece, assemble

TASKS = ("retrieval", "gsm8k")
TOP_K = 20
END_USER = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Arm:
    name: str
    mode: str
    recompute_head: int = 0
    mix_p: Optional[float] = None  # random-mix share of consumer shared segments prefilled densely
    recompute_ratio: float = 0.0  # --kvshare-recompute-ratio: the share of each reused segment recomputed
    min_reuse: int = 0  # --kvshare-min-reuse-tokens: shorter shared segments are prefilled
    plain: bool = False  # a launch with no kvshare option: the server's defaults (``default_arm``)

    @property
    def policy(self) -> str:
        """Which rows of a reused segment the server recomputes: its first ones (EPIC's head), or none."""
        return "head" if self.recompute_head or self.recompute_ratio else "none"

    def server_args(self) -> list[str]:
        """The arm's launch options; ``recompute_head`` goes in each request's annotation (a per-request floor)."""
        if self.plain:
            return []
        if self.mode == "off":
            return ["--kvshare-mode", "off"]
        return ["--kvshare-mode", self.mode, "--kvshare-recompute-ratio", str(self.recompute_ratio),
                "--kvshare-min-reuse-tokens", str(self.min_reuse)]


def default_arm() -> Arm:
    """The plain launch: what a user who sets nothing gets (its values recorded from the config's defaults)."""
    from sglang_kvshare.config import KVShareConfig

    d = KVShareConfig()
    return Arm("default", d.mode, 0, None, d.recompute_ratio, d.min_reuse_tokens, plain=True)


def default_arms(heads: Sequence[int], mix: Sequence[float], ratios: Sequence[float] = ()) -> list[Arm]:
    """Off first (every arm is compared with it), then the random-mix line, then the modes under test
    (heads of K rows, then heads of a share r of each segment)."""
    arms = [Arm("off", "off")]
    if 0 in heads:
        arms.append(Arm("fullshared_k0", "fullshared", 0))  # the line's p=0 end
    arms += [Arm(f"mix_p{p:g}", "fullshared", 0, p) for p in mix]
    arms += [Arm(f"kvcmas_k{k}", "kvcmas", k) for k in heads]
    arms += [Arm(f"fullshared_k{k}", "fullshared", k) for k in heads if k != 0]
    arms += [Arm(f"{mode}_r{r:g}", mode, 0, None, r) for mode in ("fullshared", "kvcmas") for r in ratios]
    arms.append(default_arm())
    return arms


@dataclass(frozen=True)
class Call:
    """One agent request of a workflow: ordered pieces, and where its output goes."""

    agent: str
    position: int  # 1-based order inside the sample; position 1 is the producer
    pieces: tuple[Piece, ...]
    max_tokens: int
    output_slot: Optional[str] = None


# A program yields Calls and receives each call's output ids (trailing EOS stripped).
Program = Generator[Call, list, None]


def system_header(system: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"


def retrieval_program(sample, enc, max_tokens: int, roles: Optional[str] = None) -> Program:
    """Four agents look up one key each in the shared document; ``roles``: a split of
    ``workloads.role_set`` drawn per sample, or None for the task's own roles."""
    from benchmarks.workloads.retrieval import ROLES, answer_prefix, question

    doc = enc(sample.document)
    agents = ROLES if roles is None else draw(roles, sample.id, len(ROLES))
    for i, (role, lookup) in enumerate(zip(agents, sample.lookups)):
        yield Call(role.name, i + 1, (
            Piece("private", None, enc(system_header(role.system))),
            Piece("shared", "doc", doc),
            Piece("private", None, enc(question(lookup.key) + END_USER + answer_prefix(lookup.key))),
        ), max_tokens)


def refer_program(task, sample, enc, max_tokens: int, roles: Optional[str] = None) -> Program:
    """GSM8K ``refer``: the roles read the query; the final agent reads query + answers.
    ``roles``: a split of ``workloads.role_set`` drawn per sample (the final agent too), or None."""
    query = enc(sample.query)
    answers = []
    agents = (*task.roles, task.final) if roles is None else draw(roles, sample.id, len(task.roles) + 1)
    workers, final = agents[:-1], agents[-1]
    for i, role in enumerate(workers):
        out = yield Call(role.name, i + 1, (
            Piece("private", None, enc(system_header(role.system))),
            Piece("shared", "query", query),
            Piece("private", None, enc(f"\n\n{task.instruction}{END_USER}")),
        ), max_tokens, output_slot=f"out:{role.name}")
        answers.append((role, out))
    pieces = [Piece("private", None, enc(system_header(final.system))), Piece("shared", "query", query)]
    for role, out in answers:
        pieces += [Piece("private", None, enc(f"\n\n{role.title} said:\n")), Piece("shared", f"out:{role.name}", out)]
    pieces.append(Piece("private", None, enc(f"\n\n{task.final_instruction}{END_USER}")))
    yield Call(final.name, len(workers) + 1, tuple(pieces), max_tokens)


def mixed(call: Call, arm: Arm, sample_id: str, seed: int) -> tuple[Piece, ...]:
    """The call's pieces in ``arm``: the random mix renames the shared slots it prefills densely."""
    if arm.mix_p is None or call.position == 1:
        return call.pieces
    return tuple(Piece(p.kind, fm.fresh_slot(p.slot, sample_id, call.agent), p.ids)
                 if p.kind == "shared" and fm.dense_in_mix(arm.mix_p, seed, sample_id, call.agent, p.slot) else p
                 for p in call.pieces)


def build(call: Call, arm: Arm, sample_id: str, seed: int, tail: Sequence[Piece] = (),
          output_slot: Optional[str] = None) -> BuiltRequest:
    """The request of ``call`` in ``arm`` (its mixed pieces, then ``tail``), the random mix's dense segments
    marked ``reuse: false``.

    Why both the fresh name and the mark: the fresh name keeps every other
    consumer on the copy it reads in ``fullshared`` K=0 (nobody reads this one),
    and the mark keeps the server from starting an estimate inside the segment
    (another content's assembly with the same first tokens behind the same
    agent), so a coin's dense segment is exact KV, as the line's ``p`` says."""
    built = assemble(call.agent, (*mixed(call, arm, sample_id, seed), *tail), output_slot)
    segments = tuple(s.model_copy(update={"reuse": False}) if s.kind == "shared" and fm.is_fresh_slot(s.slot) else s
                     for s in built.annotation.segments)
    update: dict = {"segments": segments, **({"recompute_head": arm.recompute_head} if arm.recompute_head else {})}
    return BuiltRequest(built.input_ids, built.annotation.model_copy(update=update))


class Runner:
    """Runs one arm's workflows against one server URL."""

    def __init__(self, url: str, arm: Arm, seed: int, eos: int):
        self.url, self.arm, self.seed, self.eos = url, arm, seed, eos

    def call(self, call: Call, sample_id: str) -> dict:
        built = build(call, self.arm, sample_id, self.seed, output_slot=call.output_slot)
        timed = stream_generate(self.url, built.input_ids, custom_params=built.annotation.to_custom_params(),
                                max_new_tokens=call.max_tokens)
        out = list(timed.output_ids)
        if call.output_slot and out and out[-1] != self.eos:
            self._commit_output(built, out)
        return {"agent": call.agent, "position": call.position, "call": call, "prompt_len": len(built.input_ids),
                "output_ids": out, "ttft_s": timed.ttft, "report": timed.report,
                "cached_tokens": timed.meta.get("cached_tokens")}

    def _commit_output(self, built, ids: list[int]) -> None:
        """Prefill a cut answer's last token, as ``KVShareEndpoint`` does, so consumers reuse all of it.

        A generation cut by ``max_tokens`` ends with a token whose KV was never
        computed; the same prompt plus the answer as a shared segment of the
        output slot (``max_new_tokens=0``) computes it and registers the answer."""
        ann = built.annotation
        start = len(built.input_ids)
        ann = ann.model_copy(update={"output_slot": None, "segments": (
            *ann.segments, Segment(kind="shared", start=start, end=start + len(ids), slot=ann.output_slot))})
        resp = requests.post(self.url + "/generate", timeout=900, json={
            "input_ids": [*built.input_ids, *ids],
            "sampling_params": {"max_new_tokens": 0, "custom_params": ann.to_custom_params()}})
        if resp.status_code != 200:
            raise RuntimeError(f"committing an output failed ({resp.status_code}): {resp.text[:300]}")

    def sample(self, program: Program, sample_id: str) -> list[dict]:
        rows: list[dict] = []
        try:
            call = next(program)
            while True:
                row = self.call(call, sample_id)
                rows.append(row)
                ids = row["output_ids"]
                call = program.send(ids[:-1] if ids and ids[-1] == self.eos else ids)
        except StopIteration:
            return rows

    def teacher_forced(self, call: Call, sample_id: str, continuation: list[int]) -> dict:
        """Top-k logprobs at every continuation position of ``call``'s prompt + ``continuation``."""
        built = build(call, self.arm, sample_id, self.seed, (Piece("private", None, continuation),))
        prompt_len = len(built.input_ids) - len(continuation)
        # A replay is the benchmark's measurement, not an agent's request: kept out of the guard's evidence.
        annotation = built.annotation.model_copy(update={"verify": False})
        body = {"input_ids": built.input_ids, "return_logprob": True, "top_logprobs_num": TOP_K,
                "logprob_start_len": prompt_len - 1,
                "sampling_params": {"max_new_tokens": TF_MAX_NEW_TOKENS, "temperature": 0.0,
                                    "custom_params": annotation.to_custom_params()}}
        resp = requests.post(self.url + "/generate", json=body, timeout=900)
        if resp.status_code == 400 and "max_new_tokens" in resp.text and TF_MAX_NEW_TOKENS == 0:
            body["sampling_params"]["max_new_tokens"] = 1  # a server that refuses 0: one token, ignored
            resp = requests.post(self.url + "/generate", json=body, timeout=900)
        if resp.status_code != 200:
            raise RuntimeError(f"teacher-forced request failed ({resp.status_code}): {resp.text[:300]}")
        meta = resp.json()["meta_info"]
        tops = [fm.top_entries(e) for e in meta["input_top_logprobs"]]
        # Entry i is the distribution that predicted input token prompt_len - 1 + i: entry 0 predicts
        # the prompt's last token, entries 1.. the continuation.
        positions = tops[1:1 + len(continuation)]
        rep = (meta.get("kvshare") or [None])[0] or {}
        return {"tops": positions, "report": rep}


# One generated token, ignored: with 0 SGLang 0.5.23 answers prefill-only requests without the
# request's customized_info, so the kvshare report (reuse of the teacher-forced pass) would be lost.
TF_MAX_NEW_TOKENS = 1


# ------------------------------------------------------------------ tasks
@dataclass
class TaskSpec:
    name: str
    load: Callable[[int, int], list]
    program: Callable[..., Program]
    score_rows: Callable[[object, list[dict], Callable], list[dict]]  # one scored item per final answer


def _retrieval_spec(seed: int, roles: Optional[str] = None, facts: Optional[int] = None) -> TaskSpec:
    from benchmarks.workloads import retrieval as rt

    def score_rows(sample, rows, decode):
        items = []
        for row, lookup in zip(rows, sample.lookups):
            text = decode(row["output_ids"])
            ans = rt.extract_value(text)
            items.append({"id": f"{sample.id}/{row['agent']}", "position": row["position"], "text": text,
                          "answer": ans, "correct": rt.score(ans, lookup), "gold": lookup.value,
                          "consumer": row["position"] > 1})
        return items

    return TaskSpec("retrieval", lambda limit, offset: rt.load(limit, offset, seed, facts or rt.FACTS),
                    lambda smp, enc, mt: retrieval_program(smp, enc, mt, roles), score_rows)


def _refer_spec(name: str, roles: Optional[str] = None) -> TaskSpec:
    from benchmarks.workloads.tasks import TASKS as WTASKS

    task = WTASKS[name]

    def score_rows(sample, rows, decode):
        text = decode(rows[-1]["output_ids"])
        ans = task.extract(text, sample)
        return [{"id": sample.id, "position": rows[-1]["position"], "text": text, "answer": ans,
                 "correct": bool(task.score(ans, sample)), "consumer": True}]

    return TaskSpec(name, lambda limit, offset: task.load(limit, offset),
                    lambda smp, enc, mt: refer_program(task, smp, enc, mt, roles), score_rows)


# Warm-up samples sit this far past the scored ones in a task's own order (GSM8K: 550-557 for
# 50 scored questions), so a run's warm-up is the same whatever the scored count up to 500.
WARMUP_GAP = 500
# Retrieval documents are generated from their index: warm-up ones far from any scored index.
RETRIEVAL_WARMUP_OFFSET = 100_000


def load_warmup(spec: TaskSpec, limit: int, warmup: int) -> list:
    """``warmup`` unscored samples that share nothing with the ``limit`` scored ones.

    Why a function: a fixed offset past the scored samples (``limit + WARMUP_GAP``) runs
    past the end of a small set and would give no warm-up at
    all, silently. A set too short for the gap gives its last ``warmup`` samples; one too
    short for any raises instead of warming up on scored items.
    """
    if warmup <= 0:
        return []
    if spec.name == "retrieval":
        return spec.load(warmup, RETRIEVAL_WARMUP_OFFSET)
    rest = spec.load(10**9, limit)  # everything after the scored samples (small files)
    if len(rest) < warmup:
        raise ValueError(f"--warmup {warmup}: the {spec.name} set has only {len(rest)} samples after the "
                         f"{limit} scored ones")
    if len(rest) >= WARMUP_GAP + warmup:
        return rest[WARMUP_GAP:WARMUP_GAP + warmup]
    return rest[-warmup:]


def task_spec(name: str, seed: int, roles: Optional[str] = None, facts: Optional[int] = None) -> TaskSpec:
    """The task's samples, program and scoring; ``roles``: a ``role_set`` split instead of the task's own
    roles; ``facts``: the retrieval document's length in facts."""
    if name == "retrieval":
        return _retrieval_spec(seed, roles, facts)
    if name == "gsm8k":
        return _refer_spec(name, roles)
    raise ValueError(f"unknown task {name!r}; choose from {TASKS}")


# ------------------------------------------------------------------ one arm
_ACTIVE: list = []


def _on_sigterm(*_) -> None:
    import os

    for server in list(_ACTIVE):
        server.stop()
    os._exit(143)


@contextmanager
def fresh_server(arm: Arm, model_path: str) -> Iterator[str]:
    """The benchmark's servers: a new one per arm, launched with the arm's flags; yields its URL."""
    from devtools.server_process import ServerProcess

    with ServerProcess(model_path=model_path, kvshare_args=arm.server_args()) as server:
        _ACTIVE.append(server)
        try:
            yield server.url
        finally:
            _ACTIVE.remove(server)


ArmServer = Callable[[Arm, str], ContextManager[str]]
"""``(arm, model_path) -> context manager yielding a server URL`` with the arm's settings and cold caches."""


def run_arm(arm: Arm, spec: TaskSpec, samples, warm, tok, args, off_raw: Optional[dict], max_tokens: int) -> dict:
    """Get a server for ``arm``, run warm-up and scored samples, each followed by its teacher-forced replays."""
    enc = _encoder(tok)
    t0 = time.perf_counter()
    with args.arm_server(arm, args.model_path) as url:
        runner = Runner(url, arm, args.seed, tok.eos_token_id)

        def one(smp) -> list[dict]:
            return runner.sample(spec.program(smp, enc, max_tokens), smp.id)

        def scored(si: int) -> tuple[list[dict], dict]:
            """One sample, then at once its teacher-forced replays, while its sources are in the pool.

            (Replaying after all samples would find most sources evicted from
            this CPU server's small KV pool: the replay would measure dense
            prefill, not the arm.)"""
            rows = one(samples[si])
            ref = rows if off_raw is None else off_raw["raw"][si]
            tfs = {(si, ri): runner.teacher_forced(row["call"], samples[si].id, row["output_ids"])
                   for ri, row in enumerate(ref) if row["position"] > 1}
            return rows, tfs

        for smp in warm:  # unscored: pools and caches see other contents first
            one(smp)
        with ThreadPoolExecutor(args.concurrency) as pool:
            done = list(tqdm(pool.map(scored, range(len(samples))), total=len(samples),
                             desc=f"{spec.name}/{arm.name}", disable=args.no_progress))
        raw = [rows for rows, _ in done]
        tf = {job: t for _, tfs in done for job, t in tfs.items()}
        run_s = time.perf_counter() - t0
    return {"arm": arm, "raw": raw, "tf": tf, "run_s": run_s,
            "wall_s": time.perf_counter() - t0}


def _encoder(tok):
    def enc(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False).input_ids)

    return enc


# ------------------------------------------------------------------ summary
def summarize_arm(run: dict, off: dict, spec: TaskSpec, samples, decode) -> dict:
    arm: Arm = run["arm"]
    items = [it for smp, rows in zip(samples, run["raw"]) for it in spec.score_rows(smp, rows, decode)]
    if "items" not in off:  # scored once
        off["items"] = [it for smp, rows in zip(samples, off["raw"]) for it in spec.score_rows(smp, rows, decode)]
    off_items = off["items"] if run is not off else items
    cons = [(a, b) for a, b in zip(items, off_items) if a["consumer"]]
    reuse = _reuse(run["raw"], consumers_only=True)
    if arm.mode == "off":  # an off server sends no kvshare report: nothing is reused by construction
        reuse["ratio"] = 0.0
    tf_rows = [fm.compare_positions(off["tf"][job]["tops"], run["tf"][job]["tops"]) for job in run["tf"]]
    tf = fm.pooled(tf_rows)
    per_sample = [[0, 0.0, 0.0] for _ in samples]  # (positions, top-1 hits, KL sum) per sample: line intervals
    for job, row in zip(run["tf"], tf_rows):
        if row["positions"]:
            acc_ = per_sample[job[0]]
            acc_[0] += row["positions"]
            acc_[1] += row["top1"] * row["positions"]
            acc_[2] += row["kl"] * row["positions"]
    tf_jobs = [(off["raw"][job[0]][job[1]]["agent"], job[0]) for job in run["tf"]]
    # Self-check of the reference: off's teacher-forced top-1 against its own greedy continuation.
    greedy = [fm.argmax(top) == tok_id for job, t in run["tf"].items()
              for top, tok_id in zip(t["tops"], off["raw"][job[0]][job[1]]["output_ids"]) if top]
    tf_shared = sum(t["report"].get("shared_tokens", 0) for t in run["tf"].values())
    tf_reused = sum(t["report"].get("shared_tokens_reused", 0) for t in run["tf"].values())
    ttft = [row["ttft_s"] for rows in run["raw"] for row in rows if row["position"] > 1]
    acc = [1.0 if a["correct"] else 0.0 for a, _ in cons]
    acc_off = [1.0 if b["correct"] else 0.0 for _, b in cons]
    return {
        "arm": arm.name, "mode": arm.mode, "recompute_head": arm.recompute_head, "random_mix_p": arm.mix_p,
        "policy": arm.policy, "recompute_ratio": arm.recompute_ratio, "min_reuse_tokens": arm.min_reuse,
        "forwards_per_request": _forwards_per_request(run["raw"]),
        "reuse_ratio": reuse["ratio"], "shared_tokens": reuse["shared"], "shared_tokens_reused": reuse["reused"],
        "tokens_head_recomputed": reuse["head"],
        "reuse_ratio_all_requests": _reuse(run["raw"], consumers_only=False)["ratio"],
        "fallback_reasons": reuse["reasons"],
        "agreement_final": fm.statistics.fmean(1.0 if a["answer"] == b["answer"] else 0.0 for a, b in cons),
        "identical_text": fm.statistics.fmean(1.0 if a["text"] == b["text"] else 0.0 for a, b in cons),
        "teacher_forced_top1": tf["top1"], "teacher_forced_kl": tf["kl"], "teacher_forced_positions": tf["positions"],
        "teacher_forced_per_sample": per_sample,
        "teacher_forced_per_agent": per_agent(tf_jobs, tf_rows),
        "reuse_per_agent": reuse_per_agent(run["raw"]),
        "teacher_forced_reuse_ratio": tf_reused / tf_shared if tf_shared else (0.0 if arm.mode == "off" else None),
        "teacher_forced_top1_vs_off_greedy_tokens": fm.statistics.fmean(greedy) if greedy else None,
        "accuracy": fm.statistics.fmean(acc) if acc else None,
        "accuracy_all_items": fm.statistics.fmean(1.0 if a["correct"] else 0.0 for a in items),
        "accuracy_vs_off_paired": fm.paired_bootstrap(acc, acc_off),
        "scored_items": len(cons),
        "ttft_agents_2_4_s": fm.spread(ttft),
        "run_s": round(run["run_s"], 1), "wall_s": round(run["wall_s"], 1),
        "per_item": [{"id": a["id"], "answer": a["answer"], "correct": a["correct"]} for a, _ in cons],
    }


def per_agent(jobs: Sequence[tuple[str, int]], rows: Sequence[dict]) -> dict[str, dict]:
    """Teacher-forced top-1 and KL pooled per agent (``fm.pooled``), and each answer's own values as
    ``[sample index, top-1, KL, positions]`` (``jobs``: each row's agent and sample index).

    Why: the workflow's mean hides an agent far from it (a judge reading every other answer), and a controller
    that keeps a target per agent is judged agent by agent; the per-answer values, paired across arms by sample,
    give the spread between answers that an estimate built from a sample of them has to live with
    (``benchmarks.research.guard_sim`` replays a controller on them).
    """
    grouped: dict[str, list[tuple[int, dict]]] = {}
    for (agent, sample), row in zip(jobs, rows):
        grouped.setdefault(agent, []).append((sample, row))
    return {agent: {**fm.pooled([r for _, r in group]), "answers": len(group),
                    "per_answer": [[sample, round(r["top1"], 4), round(r["kl"], 6), r["positions"]]
                                   for sample, r in sorted(group, key=lambda x: x[0]) if r["positions"]]}
            for agent, group in sorted(grouped.items())}


def reuse_per_agent(raw: list[list[dict]]) -> dict[str, dict]:
    """Per agent, its consumer requests' shared tokens, those reused and their ratio (None for a producer)."""
    agents = sorted({row["agent"] for rows in raw for row in rows})
    out = {}
    for agent in agents:
        reuse = _reuse([[row for rows in raw for row in rows if row["agent"] == agent]], consumers_only=True)
        out[agent] = {k: reuse[k] for k in ("ratio", "shared", "reused")}
    return out


def _reuse(raw: list[list[dict]], consumers_only: bool) -> dict:
    shared = reused = head = 0
    reasons: dict[str, int] = {}
    for rows in raw:
        for row in rows:
            if consumers_only and row["position"] == 1:
                continue
            rep = row["report"] or {}
            shared += rep.get("shared_tokens", 0)
            reused += rep.get("shared_tokens_reused", 0)
            head += rep.get("tokens_head_recomputed", 0)
            kinds = {seg.get("index"): seg.get("kind") for seg in rep.get("segments", [])}
            for fb in rep.get("fallbacks", []):  # shared segments only (private copies fall back too)
                if kinds.get(fb.get("segment")) == "shared":
                    reasons[fb.get("reason")] = reasons.get(fb.get("reason"), 0) + 1
    return {"ratio": reused / shared if shared else None, "shared": shared, "reused": reused, "head": head,
            "reasons": reasons}


def _forwards_per_request(raw: list[list[dict]]) -> Optional[float]:
    """Mean prefill forwards of the consumer requests (server reports; a staged head or segment adds one)."""
    counts = [row["report"]["prefill_forwards"] for rows in raw for row in rows
              if row["position"] > 1 and (row["report"] or {}).get("prefill_forwards") is not None]
    return fm.statistics.fmean(counts) if counts else None


def planned_arms(command: str) -> set[str]:
    """The names of the arms a run's recorded command runs, ``off`` included.

    Why from the command: a stopped run records only the arms it finished, and the
    results files carry their command line, not a plan. The command goes through
    this module's own parser and arm selection, so the plan is the one the run had.
    """
    words = shlex.split(command)
    args = parse_args(words[words.index("benchmarks.frontier") + 1:])
    return {arm.name for arm in selected_arms(args)}


# ------------------------------------------------------------------ plot
TARGET_REUSE = 0.7
TARGET_TOP1 = 0.99


def ttft_bars(out: dict) -> list[tuple[str, str, dict]]:
    """(label, arm, TTFT spread) per bar: one per arm, or one per arm and run when the runs were pooled."""
    if not out.get("pooled"):
        return [(name, name, a["ttft_agents_2_4_s"]) for name, a in out["arms"].items()]
    return [(f"{name} (seed {seed})", name, t) for name, a in out["arms"].items()
            for seed, t in zip(out["seed"], a["ttft_agents_2_4_s_per_run"])]


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = out["arms"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    line = fm.random_mix_line(arms)
    colors = {"off": "black", "fullshared": "tab:red", "kvcmas": "tab:blue"}
    for ax, key, label in ((axes[0], "agreement_final", "final-answer agreement with off"),
                           (axes[1], "teacher_forced_top1", "teacher-forced top-1 agreement with off")):
        lx = [arms[n]["reuse_ratio"] or 0.0 for _, _, n in line]
        ly = [arms[n][key] for _, _, n in line]
        ax.plot(lx, ly, "--", color="gray", label="random mix (fullshared, share p dense)")
        for name, a in arms.items():
            if a["random_mix_p"] is not None:
                ax.plot(a["reuse_ratio"], a[key], "s", color="gray")
                ax.annotate(f"p={a['random_mix_p']:g}", (a["reuse_ratio"], a[key]), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
                continue
            ax.plot(a["reuse_ratio"] or 0.0, a[key], "o", color=colors[a["mode"]])
            ax.annotate(name, (a["reuse_ratio"] or 0.0, a[key]), fontsize=7, textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("reuse ratio (consumer shared tokens not prefilled)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    # The distribution target: reuse >= 0.7 and top-1 >= 0.99 (its KL half, <= 0.3x fullshared K=0's: the table).
    top1_ymin = axes[1].get_ylim()[0]
    axes[1].fill_between([TARGET_REUSE, 1.0], TARGET_TOP1, 1.0, color="tab:green", alpha=0.12, zorder=0,
                         label=f"target: reuse >= {TARGET_REUSE}, top-1 >= {TARGET_TOP1}")
    axes[1].set_ylim(bottom=min(top1_ymin, TARGET_TOP1 - 0.001))
    axes[1].legend(fontsize=7, loc="lower left")
    axes[0].legend(fontsize=7, loc="lower left")
    bars = ttft_bars(out)
    med = [t["median"] for _, _, t in bars]
    lo = [m - t["p10"] for m, (_, _, t) in zip(med, bars)]
    hi = [t["p90"] - m for m, (_, _, t) in zip(med, bars)]
    axes[2].bar(range(len(bars)), med, yerr=[lo, hi], capsize=3,
                color=[colors.get(arms[n]["mode"], "gray") if arms[n]["random_mix_p"] is None else "lightgray"
                       for _, n, _ in bars])
    axes[2].set_xticks(range(len(bars)), [label for label, _, _ in bars], rotation=60, ha="right", fontsize=7)
    axes[2].set_ylabel("TTFT agents 2-4 (s): median, p10-p90")
    fig.suptitle(f"fidelity frontier: {out['task']}, {out['samples']} samples ({out['scored_items']} scored items)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ main
def save(out: dict, path: Path) -> None:
    """The results JSON at ``path`` and its plot beside it (same name, ``.png``)."""
    write_json(path, out)
    plot(out, path.with_suffix(".png"))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.frontier", description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=TASKS + ("all",), default="all")
    ap.add_argument("--limit", type=int, default=None,
                    help="scored samples (default: retrieval 100 = 300 consumer lookups; gsm8k 50)")
    ap.add_argument("--warmup", type=int, default=8, help="unscored samples each server sees first")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: retrieval 8, gsm8k 128")
    ap.add_argument("--heads", type=int, nargs="+", default=[0, 8, 32])
    ap.add_argument("--mix", type=float, nargs="*", default=[0.25, 0.5, 0.75])
    ap.add_argument("--ratios", type=float, nargs="*", default=[],
                    help="arms recomputing a share r of each reused segment: fullshared_r<r> and kvcmas_r<r> its "
                         "first rows")
    ap.add_argument("--arms", default=None, help="comma-separated subset of arm names (off is always run)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--roles", choices=("project", "dev", "heldout"), default="project",
                    help="the task's own roles, or a split of benchmarks.workloads.role_set drawn per sample "
                         "(choose settings on dev, check them once on heldout)")
    ap.add_argument("--facts", type=int, default=None,
                    help="retrieval: facts in the shared document (about 10 tokens each; default 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--tag", default="", help="suffix of the output names (frontier_<task><tag>.json)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--merge", nargs="+", metavar=("OUT", "JSON"), default=None,
                    help="start no server: OUT = the arms of the finished results files JSON... (same task and "
                         "samples, off's answers identical in every file), with line gaps and a plot")
    ap.add_argument("--remeasured", default=None, metavar="ARMS",
                    help="with --merge: comma-separated arms to take from the last run that has them (measured "
                         "again in a later part), not the first")
    ap.add_argument("--pool", nargs="+", metavar=("OUT", "JSON"), default=None,
                    help="start no server: OUT = the same arms over the finished results files JSON... of "
                         "different seeds, every item and position pooled (TTFT per run), with a plot")
    return ap.parse_args(argv)


def selected_arms(args: argparse.Namespace) -> list[Arm]:
    """The arms a run goes through: the defaults of ``--heads``/``--mix``, cut to ``--arms`` (off always)."""
    arms = default_arms(args.heads, args.mix, args.ratios)
    if args.arms:
        keep = {"off", *(name.strip() for name in args.arms.split(",") if name.strip())}
        unknown = sorted(keep - {a.name for a in arms})
        if unknown:
            raise SystemExit(f"--arms: no arm named {unknown} with these --heads/--mix/--ratios; "
                             f"the arms are {[a.name for a in arms]}")
        arms = [a for a in arms if a.name in keep]
    return arms


def run_task(name: str, args, tok, argv_used: Sequence[str]) -> dict:
    spec = task_spec(name, args.seed, None if args.roles == "project" else args.roles, args.facts)
    limit = args.limit or (100 if name == "retrieval" else 50)
    max_tokens = args.max_tokens or (8 if name == "retrieval" else 128)
    samples = spec.load(limit, 0)
    warm = load_warmup(spec, limit, args.warmup)
    arms = selected_arms(args)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    command = "python -m benchmarks.frontier " + " ".join(shlex.quote(a) for a in argv_used)
    out = {"meta": run_meta(command), "command": command, "machine": machine(), "model": args.model,
           "model_path": args.model_path, "task": name,
           "workflow": "retrieval: 4 agents, one lookup each" if name == "retrieval" else "refer, 3 roles + final",
           "samples": len(samples), "warmup_samples": len(warm), "max_tokens": max_tokens,
           "concurrency": args.concurrency, "seed": args.seed, "top_k": TOP_K, "roles": args.roles,
           "facts": args.facts if name == "retrieval" else None,
           "random_mix": {"p": args.mix, "endpoints": "p=0 is fullshared_k0, p=1 is off",
                          "how": "client-side: a dense segment gets a fresh slot name (no source), marked reuse: false"},
           "definitions": {
               "reuse_ratio": "consumer requests (agents 2-4): shared_tokens_reused / shared_tokens (server reports)",
               "agreement_final": ("each consumer lookup's value equals off's" if name == "retrieval" else
                                   "final agent's extracted answer equals off's"),
               "teacher_forced": "off's prompt + off's continuation on the arm's server, top-20 per position; "
                                 "KL over off's top-20 support, renormalized; missing tokens get the arm's 20th logprob",
               "ttft": "client-side streamed, request sent -> first chunk; includes queueing at concurrency > 1"},
           "complete": False, "arms": {}}
    path = Path(args.out_dir) / f"frontier_{name}{args.tag}.json"
    off = None
    for arm in arms:
        run = run_arm(arm, spec, samples, warm, tok, args, off, max_tokens)
        if arm.name == "off":
            off = run
        out["arms"][arm.name] = summarize_arm(run, off, spec, samples, decode)
        if arm.mode != "off" and "segment_tokens" not in out:  # what the length rule sees (an off server reports none)
            lengths = [s["tokens"] for rows in run["raw"] for row in rows if row["position"] > 1
                       for s in (row["report"] or {}).get("segments", []) if s.get("kind") == "shared"]
            out["segment_tokens"] = fm.spread(lengths)
        out["scored_items"] = out["arms"]["off"]["scored_items"]
        fm.add_line_gaps(out["arms"])
        save(out, path)
        a = out["arms"][arm.name]
        print(f"[{name}] {arm.name}: reuse {a['reuse_ratio']} agreement {a['agreement_final']:.3f} "
              f"top1 {a['teacher_forced_top1']} kl {a['teacher_forced_kl']} acc {a['accuracy']:.3f} "
              f"ttft {a['ttft_agents_2_4_s']['median']:.3f}s ({a['run_s']}s)", file=sys.stderr, flush=True)
    out["complete"] = True
    save(out, path)
    return out


def main(argv=None, *, arm_server: Optional[ArmServer] = None) -> int:
    """``arm_server`` replaces the fresh server per arm (the test suite passes its shared servers)."""
    args = parse_args(argv)
    joined = args.merge or args.pool
    if joined:
        if len(joined) < 3:
            raise SystemExit("--merge / --pool need OUT and at least two results files")
        remeasured = [a.strip() for a in (args.remeasured or "").split(",") if a.strip()]
        build = ((lambda parts: runs.merge_arms(parts, remeasured, planned_arms)) if args.merge else runs.pool_arms)
        words = sys.argv[1:] if argv is None else argv
        command = "python -m benchmarks.frontier " + " ".join(shlex.quote(a) for a in words)
        return runs.join("merge" if args.merge else "pool", joined[1:], build,
                         lambda out: save({"meta": runs.joined_meta(command, out["parts_meta"]), **out},
                                          Path(joined[0])))
    args.arm_server = arm_server or fresh_server
    signal.signal(signal.SIGTERM, _on_sigterm)
    from transformers import AutoTokenizer

    from devtools.models import prepare

    args.model_path = str(prepare(args.model))
    tok = AutoTokenizer.from_pretrained(args.model_path)
    argv_used = sys.argv[1:] if argv is None else list(argv)
    for name in (TASKS if args.task == "all" else (args.task,)):
        run_task(name, args, tok, argv_used)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
