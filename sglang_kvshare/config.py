"""The one configuration object of kvshare, read once per process.

Why a single frozen dataclass: the launcher parses ``--kvshare-*`` flags in the
HTTP process, but the cache lives in SGLang's scheduler process, which SGLang
spawns. The launcher serializes this object to JSON in the environment
variable ``SGLANG_KVSHARE_CONFIG``; spawned processes inherit it and call
``KVShareConfig.from_env()``. No other environment switch is read anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

from sglang_kvshare.guard.target import DEFAULT_BAND, FidelityTarget

Mode = Literal["off", "fullshared", "kvcmas"]
MODES: tuple[str, ...] = ("off", "fullshared", "kvcmas")
# What POST /kvshare/config may change on a running server.
RUNTIME_FIELDS: tuple[str, ...] = ("tau", "capacity", "rank", "edge_anchors", "mode", "recompute_head",
                                   "recompute_ratio", "sparse_extend", "staged", "verify_rate",
                                   "fidelity_target", "fidelity_min_samples", "fidelity_band", "verify_burst")
ReuseScope = Literal["workflow", "salt", "salt-required"]
REUSE_SCOPES: tuple[str, ...] = ("workflow", "salt", "salt-required")
ENV_VAR = "SGLANG_KVSHARE_CONFIG"
BACKEND_NAME = "kvshare"  # our tree cache in SGLang's registry: --radix-cache-backend kvshare

# Option groups, in the order --help and docs/CONFIGURATION.md show them.
GROUP_MAIN = "kvshare"
GROUP_LIMITS = "kvshare limits"
GROUP_ADVANCED = "kvshare advanced"
GROUPS: dict[str, str] = {
    GROUP_MAIN: "cross-agent KV reuse: the options most users set",
    GROUP_LIMITS: "bounds of everything kvshare keeps (each table evicts, never grows)",
    GROUP_ADVANCED: "tuning of the gate, the anchors, staging and the learner (the defaults suit most servers)",
}


def _option(default, group: str, help: str):
    """A config field with its ``--help`` text and option group (the CLI and the docs read both)."""
    return field(default=default, metadata={"help": help, "group": group})


@dataclass(frozen=True)
class KVShareConfig:
    """Settings of cross-agent KV reuse (defaults from ALGORITHM.md)."""

    # --- what most users set
    mode: Mode = _option("kvcmas", GROUP_MAIN, "off = stock radix cache; fullshared = re-align only; kvcmas = re-align and correct with chained low-rank anchors learned online (KVCOMM's full-dimension anchors are an offline baseline: python -m benchmarks.fidelity).")
    auto: bool = _option(False, GROUP_MAIN, "Annotate /v1/chat/completions requests that carry no kvshare field: agent = digest of the system messages, every other message's content and every answer shared under the slot auto:message (docs/USAGE.md). Off by default: with it on, every chat request may receive estimated KV.")
    recompute_head: int = _option(0, GROUP_MAIN, "K: the first K tokens of every reused segment are prefilled densely in the request's own context (EPIC-style boundary recompute); only the rest is re-aligned (and corrected). 0 = reuse whole segments.")
    recompute_ratio: float = _option(0.0, GROUP_MAIN, "r: the first ceil(r x n) rows of every reused segment of n rows are recomputed (as with --kvshare-recompute-head; the larger of the two counts). It scales with the segment, where K does not. 0 = off.")
    sparse_extend: bool = _option(True, GROUP_MAIN, "Recompute the heads inside the request's one prefill forward (a sparse extend: the recomputed rows and the request's own tokens in one forward, each at its true position), where the attention backend supports it (torch_native; triton, as a custom mask); elsewhere, or false, each head costs a stage: one more scheduling round and forward (docs/STAGED_PREFILL.md). The KV is the same either way.")
    reuse_scope: ReuseScope = _option("workflow", GROUP_MAIN, "Who may be served KV another request computed: workflow = requests of the same workflow (the annotation's workflow field; on the chat API the kvshare field's workflow, else the request's user) and the same cache_salt and LoRA adapter; requests that name none share the anonymous scope, as they share SGLang's exact prefix cache. salt = every request of the same cache_salt and LoRA adapter, across workflows and users. salt-required = as salt, and a request without a cache_salt is served as stock SGLang serves it (exact prefix only, no report): it is never served KV another request computed, and nothing it computes is offered to another; for servers shared by tenants, whose gateway sets each tenant's cache_salt (the workflow and user are labels any client may choose; docs/OPERATIONS.md, Tenants). Reports never name an agent of another workflow.")
    admin_open: bool = _option(False, GROUP_MAIN, "Allow the kvshare admin writes (POST /kvshare/config, /kvshare/reset, /kvshare/pools/{slot}/reset) on a server started without --admin-api-key and --api-key. Off: those writes answer 403 there; with a key they follow SGLang's key rules.")
    tau: float = _option(0.3, GROUP_MAIN, "Gate threshold on the normalized entropy: accept a correction when H <= tau (0 never accepts).")
    staged: bool = _option(True, GROUP_MAIN, "Staged prefill: after a dense stretch (an unseen segment, or a recomputed head) resume reuse for the segments behind it, within the same request. false = stop reusing at the first segment that needs prefill.")
    verify_rate: float = _option(0.05, GROUP_MAIN, "Share of the requests served approximated KV that the fidelity guard verifies: after the answer, a dense reference of the same prompt and answer is prefilled at low priority (never before or beside the user's request) and the request's own next-token distributions are compared with it (docs/FIDELITY.md); 0 = off.")
    fidelity_target: Optional[str] = _option(None, GROUP_MAIN, "The fidelity the guard keeps per scope (a reuse scope and an agent), e.g. top1>=0.99 or kl<=0.01: a scope whose 95 % interval misses it gets a longer recomputed head (as many steps as the miss asks for), then dense; met with margin, it relaxes. None = measure only.")
    # --- bounds of what kvshare keeps
    pool_budget_mb: float = _option(512.0, GROUP_LIMITS, "Upper bound on the memory all anchor pools hold together (MiB); past it the least recently used pool's oldest anchors are evicted.")
    max_pools: int = _option(1024, GROUP_LIMITS, "Most anchor pools (one per slot and namespace); past it the least recently used pool is dropped.")
    max_namespaces: int = _option(64, GROUP_LIMITS, "Most (LoRA id, cache salt) namespaces whose copy records are kept; least recently used dropped first.")
    max_slots: int = _option(256, GROUP_LIMITS, "Most slot names whose copy records are kept per namespace; least recently used dropped first.")
    max_segments: int = _option(64, GROUP_LIMITS, "Most segments one request may declare.")
    learn_queue_max: int = _option(16, GROUP_LIMITS, "Most dense-prefill observations waiting to be learned; a full queue drops new ones (counted).")
    learn_queue_mb: float = _option(1024.0, GROUP_LIMITS, "Most memory (MiB) the K/V copies of waiting observations may hold (a 4K-token observation of a 135M model holds about 190 MiB in float16, a 1K one 47 MiB: 1024 lets a chain's burst of 4K observations wait instead of being dropped).")
    chat_memory_mb: float = _option(64.0, GROUP_LIMITS, "Most memory (MiB) the HTTP process keeps for answers remembered so that they can come back as shared chat messages (at most 4096 answers); least recently used dropped first.")
    # --- tuning: the defaults suit most servers
    capacity: Optional[int] = _option(None, GROUP_ADVANCED, "Anchors per slot pool (V); default 10.")
    rank: Optional[int] = _option(32, GROUP_ADVANCED, "Rank r of the factors of new anchors; 0 means full dimension.")
    evict_window: int = _option(5, GROUP_ADVANCED, "W: evict the least-activated among the W oldest anchors.")
    gate_max_tokens: Optional[int] = _option(128, GROUP_ADVANCED, "Cap on the comparison length k of the gate; 0 = the whole segment. With --kvshare-min-anchor-len 0 the gate only considers anchors at least k tokens long, so without a cap a new content longer than every earlier one always falls back.")
    cold_pool_align: bool = _option(True, GROUP_ADVANCED, "kvcmas: while a slot's pool cannot correct an edge yet (too_few_anchors, no_edge: fewer than --kvshare-edge-anchors contents learned or queued), align the copies of the contents that do not teach the pool (as fullshared, with the recompute head) instead of prefilling them (not with tau 0); false = prefill densely until the anchors are learned.")
    edge_anchors: int = _option(8, GROUP_ADVANCED, "kvcmas corrects an edge (source agent -> target agent of a slot) once its pool holds anchors of this many contents for it; until then the edge's requests are aligned (as fullshared, with the recompute head), and about every other new content is prefilled densely to teach the pool. Why more than the gate's two: a correction weighs the anchors row by row, and with few anchors the rows of a new document get other contents' deltas; on retrieval lookups eight anchors measured a lower KL than two in every check, though not always below alignment's (docs/ALGORITHM.md, section 7). Capped at the pool capacity.")
    min_anchor_len: int = _option(16, GROUP_ADVANCED, "Anchors of at least this many tokens (holding the edge) help a segment: the gate compares on their common prefix and rows past every anchor stay aligned only; 0 = an anchor must cover the whole comparison length (the papers' rule; it leaves short single contents with too few anchors).")
    learn_cpu_share: float = _option(0.5, GROUP_ADVANCED, "Most share of wall time the learning thread may be busy: after learning for t seconds it sleeps t*(1/share-1), scaled by the learning queue's free share (a burst is learned, not dropped). On a machine with few cores the learner's SVDs compete with the forward; 1 = no pause.")
    learn_yield_s: float = _option(10.0, GROUP_ADVANCED, "Learning yields to serving, at most this many seconds per observation: with --kvshare-learn-on-idle each step waits for the scheduler to take it (idle, or in front of a decode batch) and runs beside it once the budget is spent; without, the learning thread waits until no prefill is in flight (and none ended in the last 0.2 s). Under steady load it learns after the wait anyway, so pools fill. 0 = never wait.")
    learn_single_thread: bool = _option(False, GROUP_ADVANCED, "Run each learning step on its thread alone (no OpenMP team, no MKL threads), so a CPU forward keeps its threads spinning while the learner computes: requests beside learning lose no speed, but learning takes about twice as long and pools fill later. For CPU servers whose dense requests must not slow down while learning.")
    learn_on_idle: bool = _option(True, GROUP_ADVANCED, "Offer the learner's steps (its factorizations) to the scheduler's own thread, which runs them only while fully idle (nothing running, nothing waiting), so they never share the cores with a forward; a request that arrives meanwhile waits at most one step. A step the scheduler does not take within the observation's --kvshare-learn-yield-s budget (steady load) runs beside it on a low-priority thread, as with false.")
    learn_before_decode: bool = _option(True, GROUP_ADVANCED, "With --kvshare-learn-on-idle: the scheduler also runs one waiting learner step in front of a decode batch when no request waits for a prefill. Under serving load the scheduler is rarely fully idle but decodes most of the time; such a step delays one decode iteration instead of sharing the cores with a prefill.")
    learn_step_layers: int = _option(10, GROUP_ADVANCED, "Layers per learning step: each factorization of an observation runs this many layers at a time, so a step on the idle scheduler is shorter and a request that arrives during it waits less (the factors are the same); 0 = all layers in one step.")
    learn_slot_interval_s: float = _option(0.0, GROUP_ADVANCED, "Observe one slot at most once per this many seconds (0 = no limit). Observations of a (content, edge) the pool already holds are always skipped.")
    min_stage_tokens: int = _option(32, GROUP_ADVANCED, "Staged prefill resumes reuse after a dense stretch only for a segment with at least this many reusable tokens: a stage costs one more forward, and a short private tail (the instruction before the answer) is cheaper, and more faithful, prefilled.")
    learn_async: bool = _option(True, GROUP_ADVANCED, "Record anchors from dense prefills on a background thread (keeps the SVD out of the scheduler loop); false records them inside the scheduler step, deterministic (always so at --tp-size > 1, where every rank must hold the same anchors).")
    verify_top_k: int = _option(5, GROUP_ADVANCED, "Tokens per position the guard compares (top-k of both distributions); at most 20.")
    verify_queue_max: int = _option(16, GROUP_ADVANCED, "Most verified requests waiting for their dense reference; a full queue drops new ones (counted).")
    verify_burst: bool = _option(True, GROUP_ADVANCED, "With a fidelity target: verify every approximated request of a scope until its current setting has --kvshare-fidelity-min-samples verified (or waiting) requests, then sample at --kvshare-verify-rate. A new scope, and one the guard has just moved, gets its verdict after min-samples requests instead of min-samples / verify-rate; it costs at most min-samples references per scope and change. false = sample at the rate only.")
    fidelity_min_samples: int = _option(20, GROUP_ADVANCED, "Verified requests a scope needs before the guard changes its setting (twice as many to relax).")
    fidelity_band: float = _option(DEFAULT_BAND, GROUP_ADVANCED, "Share of the allowed error the guard keeps in hand for a scope whose interval still holds the target's bound: it tightens such a scope until its mean clears the target moved this far towards the ideal (top1>=0.99 at 0.6: a mean of 0.996), so that what it serves next meets the target, not only the few answers it judged. 0 = hold the mean to the bound itself (more reuse, the target missed about half the time at the bound); below 1.")
    pool_file: Optional[str] = _option(None, GROUP_ADVANCED, "kvcmas: a file the anchor pools are loaded from at launch and saved to by POST /kvshare/save, so a restarted server corrects from its first requests instead of learning every edge again (docs/OPERATIONS.md). The file names the model it was learned on (architecture, RoPE, a digest of the weight files), its format version and rank; a file that does not match this server is a launch error, a missing one starts with empty pools. With --tp-size or --dp-size above 1 each scheduler uses PATH.dp<d>.tp<t>. It holds low-rank factors of the prompts' KV: keep it as private as the prompts. None = pools live in memory only.")
    pool_save_interval_s: float = _option(0.0, GROUP_ADVANCED, "With --kvshare-pool-file: also save the pools while the scheduler is idle, at most once per this many seconds and only when they changed since the last save, so an unplanned restart loses at most that much learning (a save holds the scheduler while the file is written). Not at --tp-size above 1, where every rank must write at the same point: save with POST /kvshare/save there. 0 = only POST /kvshare/save.")
    fidelity_file: Optional[str] = _option(None, GROUP_ADVANCED, "A file the fidelity guard keeps each scope's setting and pin in: read at launch, rewritten on every change, so a restarted server serves each agent under the setting the guard had reached and keeps the operator's pins (docs/FIDELITY.md). Scopes are stored by agent name and a keyed digest of their namespace, never the cache salt; keep it as private as the prompts. Settings learned under another target or --kvshare-recompute-head are dropped, pins kept. A file that is not a guard file is a launch error; a missing one starts empty. None = in memory only.")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"kvshare mode must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= self.verify_rate <= 1.0:
            raise ValueError(f"verify_rate must lie in [0, 1], got {self.verify_rate}")
        if self.fidelity_target is not None:
            FidelityTarget.parse(self.fidelity_target)  # raises ValueError saying the accepted forms
        if not 1 <= self.verify_top_k <= 20:
            raise ValueError(f"verify_top_k must lie in [1, 20], got {self.verify_top_k}")
        if not 0.0 <= self.fidelity_band < 1.0:
            raise ValueError(f"fidelity_band must lie in [0, 1), got {self.fidelity_band}")
        if self.verify_queue_max < 1 or self.fidelity_min_samples < 2:
            raise ValueError("verify_queue_max must be >= 1 and fidelity_min_samples >= 2")
        if self.pool_file is not None and not str(self.pool_file).strip():
            raise ValueError("pool_file must be a file path (or unset)")
        if self.fidelity_file is not None and not str(self.fidelity_file).strip():
            raise ValueError("fidelity_file must be a file path (or unset)")
        if self.pool_save_interval_s < 0:
            raise ValueError(f"pool_save_interval_s must be >= 0 (0 = save only on POST /kvshare/save), "
                             f"got {self.pool_save_interval_s}")
        if self.reuse_scope not in REUSE_SCOPES:
            raise ValueError(f"reuse_scope must be one of {REUSE_SCOPES}, got {self.reuse_scope!r}")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must lie in [0, 1], got {self.tau}")
        if self.capacity is not None and self.capacity < 2:
            raise ValueError(f"capacity must be at least 2 (the gate needs two anchors), got {self.capacity}")
        if self.edge_anchors < 2:
            raise ValueError(f"edge_anchors must be >= 2 (the gate weighs at least two anchors), got {self.edge_anchors}")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"rank must be >= 0 (0 = full dimension), got {self.rank}")
        if self.evict_window < 1:
            raise ValueError(f"evict_window must be >= 1, got {self.evict_window}")
        if self.min_stage_tokens < 1:
            raise ValueError(f"min_stage_tokens must be >= 1, got {self.min_stage_tokens}")
        if self.recompute_head < 0:
            raise ValueError(f"recompute_head must be >= 0, got {self.recompute_head}")
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must lie in [0, 1], got {self.recompute_ratio}")
        if self.learn_step_layers < 0:
            raise ValueError(f"learn_step_layers must be >= 0 (0 = all layers in one step), got {self.learn_step_layers}")
        if self.min_anchor_len < 0:
            raise ValueError(f"min_anchor_len must be >= 0 (0 = anchors cover the comparison), got {self.min_anchor_len}")
        if self.gate_max_tokens is not None and self.gate_max_tokens < 0:
            raise ValueError("gate_max_tokens must be >= 0 (0 = whole segment)")
        if not 0.0 < self.learn_cpu_share <= 1.0:
            raise ValueError(f"learn_cpu_share must lie in (0, 1], got {self.learn_cpu_share}")
        if self.learn_yield_s < 0:
            raise ValueError(f"learn_yield_s must be >= 0, got {self.learn_yield_s}")
        if self.learn_slot_interval_s < 0:
            raise ValueError(f"learn_slot_interval_s must be >= 0, got {self.learn_slot_interval_s}")
        if self.pool_budget_mb <= 0 or self.learn_queue_mb <= 0 or self.chat_memory_mb <= 0:
            raise ValueError("pool_budget_mb, learn_queue_mb and chat_memory_mb must be positive")
        for name in ("max_pools", "max_namespaces", "max_slots", "learn_queue_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def effective_capacity(self) -> int:
        return self.capacity if self.capacity is not None else 10

    @property
    def effective_edge_anchors(self) -> int:
        """An edge holds at most the pool's anchors."""
        return min(self.edge_anchors, self.effective_capacity)

    @property
    def effective_rank(self) -> Optional[int]:
        """None means full dimension."""
        return self.rank or None

    def replace(self, **changes) -> "KVShareConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "KVShareConfig":
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown kvshare settings: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_env(cls) -> "KVShareConfig":
        """The config the launcher exported; ``off`` when none was (plain sglang launch)."""
        text = os.environ.get(ENV_VAR)
        if not text:
            return cls(mode="off")
        return cls.from_json(text)

    def export_env(self) -> None:
        os.environ[ENV_VAR] = self.to_json()


_live: Optional[KVShareConfig] = None


def live_config() -> KVShareConfig:
    """The config in force in this process.

    The scheduler holds its own copy (the cache's); in the HTTP process this is
    the launcher's config, then each runtime change the admin routes applied
    (``set_live_config``), so the chat layer and the request validation follow a
    ``POST /kvshare/config`` mode switch.
    """
    global _live
    if _live is None:
        _live = KVShareConfig.from_env()
    return _live


def set_live_config(config: KVShareConfig) -> None:
    global _live
    _live = config
