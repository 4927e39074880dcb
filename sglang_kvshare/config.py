"""The one configuration object of kvshare, read once per process, and the one model that validates it.

Why a single frozen dataclass: the launcher parses ``--kvshare-*`` flags (and the
``--kvshare-config`` file) in the HTTP process, but the cache lives in SGLang's
scheduler process, which SGLang spawns. The launcher serializes this object to
JSON in the environment variable ``SGLANG_KVSHARE_CONFIG``; spawned processes
inherit it and call ``KVShareConfig.from_env()``. No other environment switch is
read anywhere.

Why one pydantic model (``SETTINGS``, built from the fields below): a setting
reaches the server from a flag, from the config file or from ``POST
/kvshare/config``, and each path builds a ``KVShareConfig``, whose construction
validates every value against that model. A bad value is therefore refused with
the same message (``ConfigError``, naming the key) whichever way it came.

Each field says, in its metadata, its component (the section of the config file,
and the option group of ``--help``), whether it is also a flag (few are: the rest
live in the file) and whether ``POST /kvshare/config`` may change it at runtime.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package, where installed
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal, Mapping, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model

from sglang_kvshare.guard.target import DEFAULT_BAND, FidelityTarget
from sglang_kvshare.protocol import MAX_RECOMPUTE_HEAD

Mode = Literal["off", "fullshared", "kvcmas"]
MODES: tuple[str, ...] = ("off", "fullshared", "kvcmas")
ReuseScope = Literal["workflow", "salt", "salt-required"]
REUSE_SCOPES: tuple[str, ...] = ("workflow", "salt", "salt-required")
RetentionPolicy = Literal["workflow", "sglang"]
ENV_VAR = "SGLANG_KVSHARE_CONFIG"
BACKEND_NAME = "kvshare"  # our tree cache in SGLang's registry: --radix-cache-backend kvshare
MAX_CAPACITY = 4096  # upper bounds that keep runtime values inside SGLang's msgpack IPC (int64)
MAX_RANK = 65536
MAX_MIN_SAMPLES = 100_000
MAX_FILE_BYTES = 64 * 1024
# Shared segments shorter than this are prefilled (chosen on the development roles: docs/research/DEFAULTS.md).
MIN_REUSE_TOKENS = 256  # a --kvshare-config file is a few hundred bytes; a larger one is a mistake

# Components, in the order --help and docs/CONFIGURATION.md show them. Each is a section of the
# --kvshare-config file ([guard], ...; the main component's keys sit at the file's top level), and
# its flags form the option group "kvshare <component>" of --help.
GROUP_MAIN = "main"
GROUP_PREFILL = "prefill"
GROUP_GUARD = "guard"
GROUP_KVCMAS = "kvcmas"
GROUP_LEARNER = "learner"
GROUP_LIMITS = "limits"
GROUPS: dict[str, str] = {
    GROUP_MAIN: "cross-agent KV reuse: the options most users set",
    GROUP_PREFILL: "how recomputed rows and dense stretches are prefilled (the defaults suit every server)",
    GROUP_GUARD: "the fidelity guard: how often it verifies, the target it keeps, its file (docs/FIDELITY.md)",
    GROUP_KVCMAS: "the learned correction of kvcmas: its gate, anchor pools and pool file",
    GROUP_LEARNER: "when the kvcmas learner runs beside serving (the defaults suit most servers)",
    GROUP_LIMITS: "bounds of everything kvshare keeps (each table evicts, never grows)",
}


# Names that look like settings but are not, with what to use: an operator who sets one gets this, not a bare
# "unknown key" (CLI, config file and POST /kvshare/config alike).
NOT_SETTINGS: dict[str, str] = {
    "recompute_head": "recompute_head is a request's annotation field (a floor in rows for that request), not a "
                      "server setting: the server's share is recompute_ratio (docs/CONFIGURATION.md)",
}


class ConfigError(ValueError):
    """A setting refused: the message names the key and says what is accepted."""


def _fidelity_target(value: Optional[str]) -> Optional[str]:
    if value is not None:
        FidelityTarget.parse(value)  # raises ValueError saying the accepted forms
    return value


def _path(value: Optional[str]) -> Optional[str]:
    if value is not None and not value.strip():
        raise ValueError("must be a file path (or unset)")
    return value


def _option(default: Any, group: str, help: str, *, flag: bool = False, runtime: bool = False,
            check: Optional[Callable[[Any], Any]] = None, **bounds: Any):
    """A config field with its help text, component, flag and runtime marks, and the bounds its value must keep.

    ``bounds`` are pydantic ``Field`` constraints (``ge``, ``le``, ``gt``, ``lt``, ``max_length``); ``check``
    a further validator that raises ``ValueError``. The CLI, the docs and ``SETTINGS`` read them all.
    """
    return field(default=default, metadata={"help": help, "group": group, "flag": flag, "runtime": runtime,
                                            "check": check, "bounds": bounds})


@dataclass(frozen=True)
class KVShareConfig:
    """Settings of cross-agent KV reuse (defaults from ALGORITHM.md)."""

    # Each field names its component (its config-file section and --help group); this order is the docs'.
    mode: Mode = _option("fullshared", GROUP_MAIN, "fullshared = re-align a shared segment's KV to its new position (an exact RoPE rotation) and recompute a share of it in the request's own context (the measured best); kvcmas = re-align and correct with chained low-rank anchors learned online (KVCOMM / KVCMAS; pays where the same edges recur, docs/USAGE.md); off = stock radix cache.", flag=True, runtime=True)
    auto: bool = _option(False, GROUP_MAIN, "Annotate /v1/chat/completions requests that carry no kvshare field: agent = digest of the system messages, every other message's content and every answer shared under the slot auto:message (docs/USAGE.md). Off by default: with it on, every chat request may receive estimated KV.", flag=True)
    recompute_ratio: float = _option(0.15, GROUP_MAIN, "r: the first ceil(r x n) rows of every reused segment of n rows are recomputed in the request's own context (EPIC-style boundary recompute, inside the request's one prefill forward); only the rest is re-aligned (and corrected). A request's annotation (or the fidelity guard) may ask for a longer head in rows (recompute_head). 0 = reuse whole segments.", flag=True, runtime=True, ge=0.0, le=1.0)
    min_reuse_tokens: int = _option(MIN_REUSE_TOKENS, GROUP_MAIN, "A shared segment shorter than this many tokens is prefilled densely (fallback reason short_segment): on segments of a few hundred tokens re-alignment with the recomputed share measured no better than prefilling whole segments at random, and buys little time (docs/USAGE.md). 0 = reuse segments of any length.", flag=True, runtime=True, ge=0, le=MAX_RECOMPUTE_HEAD)
    sparse_extend: bool = _option(True, GROUP_PREFILL, "Recompute the heads inside the request's one prefill forward (a sparse extend: the recomputed rows and the request's own tokens in one forward, each at its true position), where the attention backend supports it (torch_native; triton, as a custom mask); elsewhere, or false, each head costs a stage: one more scheduling round and forward (docs/ALGORITHM.md, Head recompute). The KV is the same either way.", runtime=True)
    reuse_scope: ReuseScope = _option("workflow", GROUP_MAIN, "Who may be served KV another request computed: workflow = requests of the same workflow (the annotation's workflow field; on the chat API the kvshare field's workflow, else the request's user) and the same cache_salt and LoRA adapter; requests that name none share the anonymous scope, as they share SGLang's exact prefix cache. salt = every request of the same cache_salt and LoRA adapter, across workflows and users. salt-required = as salt, and a request without a cache_salt is served as stock SGLang serves it (SGLang's exact prefix cache only, no report): it is never served KV kvshare assembled or estimated, and nothing it computes is offered to kvshare's reuse; for servers shared by tenants, whose gateway sets each tenant's cache_salt (the workflow and user are labels any client may choose; docs/OPERATIONS.md, Tenants). Reports never name an agent of another workflow.", flag=True)
    admin_open: bool = _option(False, GROUP_MAIN, "Allow the kvshare admin writes (POST /kvshare/config, /kvshare/reset, /kvshare/pools/{slot}/reset) on a server started without --admin-api-key and --api-key. Off: those writes answer 403 there; with a key they follow SGLang's key rules.", flag=True)
    tau: float = _option(0.3, GROUP_KVCMAS, "Gate threshold on the normalized entropy: accept a correction when H <= tau (0 never accepts).", flag=True, runtime=True, ge=0.0, le=1.0)
    staged: bool = _option(True, GROUP_PREFILL, "Staged prefill: after a dense stretch (an unseen segment, or a recomputed head) resume reuse for the segments behind it, within the same request. false = stop reusing at the first segment that needs prefill.", runtime=True)
    verify_rate: float = _option(0.05, GROUP_GUARD, "Share of the requests served approximated KV that the fidelity guard verifies: after the answer, a dense reference of the same prompt and answer is prefilled at low priority (never before or beside the user's request) and the request's own next-token distributions are compared with it (docs/FIDELITY.md); 0 = off.", flag=True, runtime=True, ge=0.0, le=1.0)
    fidelity_target: Optional[str] = _option(None, GROUP_GUARD, "The fidelity the guard keeps per scope (a reuse scope and an agent), e.g. top1>=0.99 or kl<=0.01: a scope whose 95 % interval misses it gets a longer recomputed head (as many steps as the miss asks for), then dense; met with margin, it relaxes. None = measure only.", flag=True, runtime=True, max_length=64, check=_fidelity_target)
    pool_budget_mb: float = _option(512.0, GROUP_LIMITS, "Upper bound on the memory all anchor pools hold together (MiB); past it the least recently used pool's oldest anchors are evicted.", gt=0.0)
    max_pools: int = _option(1024, GROUP_LIMITS, "Most anchor pools (one per slot and namespace); past it the least recently used pool is dropped.", ge=1)
    max_namespaces: Optional[int] = _option(None, GROUP_LIMITS, "Most namespaces (a LoRA id, a cache salt and, with --kvshare-reuse-scope workflow, a workflow) whose copy records are kept; least recently used dropped first. Unset: sized to the KV pool like the other record tables (docs/OPERATIONS.md, Bounds and memory).", ge=1)
    max_slots: int = _option(256, GROUP_LIMITS, "Most slot names whose copy records are kept per namespace; least recently used dropped first.", ge=1)
    retention: RetentionPolicy = _option("workflow", GROUP_LIMITS, "Which KV the radix tree evicts first when the KV pool is full. workflow: first what finished workflows left and the tails (private suffix and answer) of agents' earlier requests that their next request did not extend; then the rest; last the source (latest copy) of each shared content that an agent of its slot in a live workflow has not read yet. A workflow is finished when none of its requests is in flight and the server has released, since its last one, 4x as many requests as its longest pause between requests (counted in requests the server released, at least 32, at most 4096: every tensor-parallel rank then evicts alike). It only orders eviction, never pins (counters.evicted_kept_tokens: kept sources the pool had to give up). Under either, a source that reuse reads is marked used along its path, as SGLang's prefix match marks what it serves. sglang: SGLang's --radix-eviction-policy alone. /kvshare/stats names the order in force under retention (workflow, or SGLang's policy). --enable-hierarchical-cache is refused with the kvshare backend (its host tier is another tree class, HiRadixCache); with a host tier, eviction would demote leaves to host memory instead of dropping them, a demoted source could be loaded back for its reader instead of source_evicted, this order would rank the host tier's eviction too, and a live workflow's unread sources would be the first to prefetch back to the device.", runtime=True)
    max_segments: int = _option(64, GROUP_LIMITS, "Most segments one request may declare.", ge=1)
    learn_queue_max: int = _option(16, GROUP_LIMITS, "Most dense-prefill observations waiting to be learned; a full queue drops new ones (counted).", ge=1)
    learn_queue_mb: float = _option(1024.0, GROUP_LIMITS, "Most memory (MiB) the K/V copies of waiting observations may hold (a 4K-token observation of a 135M model holds about 190 MiB in float16, a 1K one 47 MiB: 1024 lets a chain's burst of 4K observations wait instead of being dropped).", gt=0.0)
    chat_memory_mb: float = _option(64.0, GROUP_LIMITS, "Most memory (MiB) the HTTP process keeps for answers remembered so that they can come back as shared chat messages (at most 4096 answers); least recently used dropped first.", gt=0.0)
    capacity: Optional[int] = _option(None, GROUP_KVCMAS, "Anchors per slot pool (V); default 10.", flag=True, runtime=True, ge=2, le=MAX_CAPACITY)
    rank: Optional[int] = _option(32, GROUP_KVCMAS, "Rank r of the factors of new anchors; 0 means full dimension.", flag=True, runtime=True, ge=0, le=MAX_RANK)
    evict_window: int = _option(5, GROUP_KVCMAS, "W: evict the least-activated among the W oldest anchors.", ge=1)
    gate_max_tokens: Optional[int] = _option(128, GROUP_KVCMAS, "Cap on the comparison length k of the gate; 0 = the whole segment. With min_anchor_len 0 the gate only considers anchors at least k tokens long, so without a cap a new content longer than every earlier one always falls back.", ge=0)
    cold_pool_align: bool = _option(True, GROUP_KVCMAS, "kvcmas: while a slot's pool cannot correct an edge yet (too_few_anchors, no_edge: fewer than --kvshare-edge-anchors contents learned or queued), align the copies of the contents that do not teach the pool (as fullshared, with the recompute head) instead of prefilling them (not with tau 0); false = prefill densely until the anchors are learned.")
    edge_anchors: int = _option(8, GROUP_KVCMAS, "kvcmas corrects an edge (source agent -> target agent of a slot) once its pool holds anchors of this many contents for it; until then the edge's requests are aligned (as fullshared, with the recompute head), and about every other new content is prefilled densely to teach the pool. Why more than the gate's two: a correction weighs the anchors row by row, and with few anchors the rows of a new document get other contents' deltas; on retrieval lookups eight anchors measured a lower KL than two in every check, though not always below alignment's (docs/research/ALGORITHM_STUDY.md). Capped at the pool capacity.", flag=True, runtime=True, ge=2, le=MAX_CAPACITY)
    min_anchor_len: int = _option(16, GROUP_KVCMAS, "Anchors of at least this many tokens (holding the edge) help a segment: the gate compares on their common prefix and rows past every anchor stay aligned only; 0 = an anchor must cover the whole comparison length (the papers' rule; it leaves short single contents with too few anchors).", ge=0)
    learn_cpu_share: float = _option(0.5, GROUP_LEARNER, "Most share of wall time the learning thread may be busy: after learning for t seconds it sleeps t*(1/share-1), scaled by the learning queue's free share (a burst is learned, not dropped). On a machine with few cores the learner's SVDs compete with the forward; 1 = no pause.", gt=0.0, le=1.0)
    learn_yield_s: float = _option(10.0, GROUP_LEARNER, "Learning yields to serving, at most this many seconds per observation: with learn_on_idle each step waits for the scheduler to take it (idle, or in front of a decode batch) and runs beside it once the budget is spent; without, the learning thread waits until no prefill is in flight (and none ended in the last 0.2 s). Under steady load it learns after the wait anyway, so pools fill. 0 = never wait.", ge=0.0)
    learn_single_thread: bool = _option(False, GROUP_LEARNER, "Run each learning step on its thread alone (no OpenMP team, no MKL threads), so a CPU forward keeps its threads spinning while the learner computes: requests beside learning lose no speed, but learning takes about twice as long and pools fill later. For CPU servers whose dense requests must not slow down while learning.")
    learn_on_idle: bool = _option(True, GROUP_LEARNER, "Offer the learner's steps (its factorizations) to the scheduler's own thread, which runs them only while fully idle (nothing running, nothing waiting), so they never share the cores with a forward; a request that arrives meanwhile waits at most one step. A step the scheduler does not take within the observation's learn_yield_s budget (steady load) runs beside it on a low-priority thread, as with false.")
    learn_before_decode: bool = _option(True, GROUP_LEARNER, "With learn_on_idle: the scheduler also runs one waiting learner step in front of a decode batch when no request waits for a prefill. Under serving load the scheduler is rarely fully idle but decodes most of the time; such a step delays one decode iteration instead of sharing the cores with a prefill.")
    learn_step_layers: int = _option(10, GROUP_LEARNER, "Layers per learning step: each factorization of an observation runs this many layers at a time, so a step on the idle scheduler is shorter and a request that arrives during it waits less (the factors are the same); 0 = all layers in one step.", ge=0)
    learn_slot_interval_s: float = _option(0.0, GROUP_LEARNER, "Observe one slot at most once per this many seconds (0 = no limit). Observations of a (content, edge) the pool already holds are always skipped.", ge=0.0)
    min_stage_tokens: int = _option(32, GROUP_PREFILL, "Staged prefill resumes reuse after a dense stretch only for a segment with at least this many reusable tokens: a stage costs one more forward, and a short private tail (the instruction before the answer) is cheaper, and more faithful, prefilled.", ge=1)
    learn_async: bool = _option(True, GROUP_KVCMAS, "Record anchors from dense prefills on a background thread (keeps the SVD out of the scheduler loop); false records them inside the scheduler step, deterministic (always so at --tp-size > 1, where every rank must hold the same anchors).", flag=True)
    verify_top_k: int = _option(5, GROUP_GUARD, "Tokens per position the guard compares (top-k of both distributions); at most 20.", ge=1, le=20)
    verify_queue_max: int = _option(16, GROUP_GUARD, "Most verified requests waiting for their dense reference; a full queue drops new ones (counted).", ge=1)
    verify_burst: bool = _option(True, GROUP_GUARD, "With a fidelity target: verify every approximated request of a scope until its current setting has fidelity_min_samples verified (or waiting) requests, then sample at --kvshare-verify-rate. A new scope, and one the guard has just moved, gets its verdict after min-samples requests instead of min-samples / verify-rate; it costs at most min-samples references per scope and change. false = sample at the rate only.", runtime=True)
    fidelity_min_samples: int = _option(20, GROUP_GUARD, "Verified requests a scope needs before the guard changes its setting (twice as many to relax).", runtime=True, ge=2, le=MAX_MIN_SAMPLES)
    fidelity_band: float = _option(DEFAULT_BAND, GROUP_GUARD, "Share of the allowed error the guard keeps in hand for a scope whose interval still holds the target's bound: it tightens such a scope until its mean clears the target moved this far towards the ideal (top1>=0.99 at 0.6: a mean of 0.996), so that what it serves next meets the target, not only the few answers it judged. 0 = hold the mean to the bound itself (more reuse, the target missed about half the time at the bound); below 1.", runtime=True, ge=0.0, lt=1.0)
    pool_file: Optional[str] = _option(None, GROUP_KVCMAS, "kvcmas: a file the anchor pools are loaded from at launch and saved to by POST /kvshare/save, so a restarted server corrects from its first requests instead of learning every edge again (docs/OPERATIONS.md). The file names the model it was learned on (architecture, RoPE, a digest of the weight files), its format version and rank; a file that does not match this server is a launch error, a missing one starts with empty pools. With --tp-size or --dp-size above 1 each scheduler uses PATH.dp<d>.tp<t>. It holds low-rank factors of the prompts' KV: keep it as private as the prompts. None = pools live in memory only.", flag=True, check=_path)
    pool_save_interval_s: float = _option(0.0, GROUP_KVCMAS, "With --kvshare-pool-file: also save the pools while the scheduler is idle, at most once per this many seconds and only when they changed since the last save, so an unplanned restart loses at most that much learning (a save holds the scheduler while the file is written). Not at --tp-size above 1, where every rank must write at the same point: save with POST /kvshare/save there. 0 = only POST /kvshare/save.", flag=True, ge=0.0)
    fidelity_file: Optional[str] = _option(None, GROUP_GUARD, "A file the fidelity guard keeps each scope's setting and pin in: read at launch, rewritten on every change, so a restarted server serves each agent under the setting the guard had reached and keeps the operator's pins (docs/FIDELITY.md). Scopes are stored by agent name and a keyed digest of their namespace, never the cache salt; keep it as private as the prompts. Settings learned under another target are dropped, pins kept. A file that is not a guard file is a launch error; a missing one starts empty. None = in memory only.", flag=True, check=_path)

    def __post_init__(self) -> None:
        """Validate every value against ``SETTINGS`` (the one model); raises ``ConfigError`` naming the key."""
        try:
            valid = SETTINGS.model_validate({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        except ValidationError as exc:
            raise ConfigError(describe(exc)) from None
        for name, value in valid:  # the canonical value (an int given for a float field becomes a float)
            object.__setattr__(self, name, value)

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
        """The config the launcher exported; the defaults when none was (``sglang.launch_server
        --radix-cache-backend kvshare``: selecting the backend is asking for kvshare)."""
        text = os.environ.get(ENV_VAR)
        if not text:
            return cls()
        return cls.from_json(text)

    def export_env(self) -> None:
        os.environ[ENV_VAR] = self.to_json()


def _settings_model() -> type[BaseModel]:
    """The pydantic model of every setting, from ``KVShareConfig``'s annotations and field metadata.

    Strict: a flag's text is converted by the launcher before it gets here, and neither a JSON body nor a
    TOML file needs coercion (an int is accepted where a float is expected, a bool never as a number).
    """
    hints = typing.get_type_hints(KVShareConfig)
    fields = {}
    for f in dataclasses.fields(KVShareConfig):
        hint = hints[f.name]
        if f.metadata["check"] is not None:
            hint = Annotated[hint, AfterValidator(f.metadata["check"])]
        fields[f.name] = (hint, Field(f.default, description=f.metadata["help"], **f.metadata["bounds"]))
    return create_model("KVShareSettings", __config__=ConfigDict(extra="forbid", strict=True, allow_inf_nan=False),
                        **fields)


SETTINGS: type[BaseModel] = _settings_model()
# What POST /kvshare/config may change on a running server (the fields marked runtime).
RUNTIME_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KVShareConfig) if f.metadata["runtime"])
# The settings that are also --kvshare-* flags; the others are set in the --kvshare-config file only.
FLAG_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KVShareConfig) if f.metadata["flag"])
_FIELDS = {f.name: f for f in dataclasses.fields(KVShareConfig)}
FIELD_NAMES: frozenset[str] = frozenset(_FIELDS)


def describe(exc: ValidationError) -> str:
    """One line per refused value: the key, what is accepted, the value given."""
    parts = []
    for e in exc.errors():
        key = ".".join(str(p) for p in e["loc"]) or "settings"
        msg = e["msg"].removeprefix("Value error, ")
        given = repr(e["input"])
        parts.append(f"{key}: {msg} (got {given if len(given) <= 80 else given[:77] + '...'})")
    return "invalid kvshare setting " + "; ".join(parts)


def runtime_update(config: KVShareConfig, changes: Mapping[str, Any]) -> KVShareConfig:
    """``config`` with a ``POST /kvshare/config`` body applied: runtime keys only, None keeps a value,
    an empty string clears an optional text setting; raises ``ConfigError`` naming the key."""
    unknown = [k for k in changes if k not in RUNTIME_FIELDS]
    if unknown and unknown[0] in NOT_SETTINGS:
        raise ConfigError(NOT_SETTINGS[unknown[0]])
    if unknown:
        kind = "cannot change at runtime" if unknown[0] in _FIELDS else "is not a kvshare setting"
        raise ConfigError(f"{unknown[0]!r} {kind}; the runtime settings are {', '.join(RUNTIME_FIELDS)} "
                          "(docs/CONFIGURATION.md#runtime-settings)")
    given = {k: (None if v == "" else v) for k, v in changes.items() if v is not None}
    if not given:
        raise ConfigError(f"nothing to change: give at least one of {', '.join(RUNTIME_FIELDS)}")
    return config.replace(**given)


# ------------------------------------------------------------ the --kvshare-config file
def read_config_file(path: str) -> dict[str, Any]:
    """The settings of a ``--kvshare-config`` TOML file, flat (``{"tau": 0.3, ...}``), not yet validated.

    Strict, so that a typo is an error rather than a default silently kept: a key must be a setting of
    the section it sits in (the main component's at the top level), a section one of ``GROUPS``. The
    file itself must be a regular file, not a symbolic link (the operator names the file that is read,
    not whatever a link points to now), of at most ``MAX_FILE_BYTES``. Raises ``ConfigError`` naming
    the file and the key.
    """
    where = f"--kvshare-config {path}"
    try:
        # NOTE: O_NONBLOCK so that a FIFO cannot hold the launch; O_NOFOLLOW refuses a link.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{where}: is a symbolic link; name the file itself") from None
        raise ConfigError(f"{where}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{where}: not a regular file")
        raw = b""
        while len(raw) <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_FILE_BYTES // 1024} KiB; a config file holds settings only")
    if tomllib is None:
        raise ConfigError(f"{where}: reading a config file needs Python 3.11+ or the tomli package "
                          "(pip install tomli)")
    try:
        document = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{where}: not a TOML file ({exc})") from None
    settings: dict[str, Any] = {}
    for key, value in document.items():
        if key in GROUPS and key != GROUP_MAIN:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key} must be a section ([{key}])")
            for name, item in value.items():
                settings[_file_key(where, key, name)] = item
        else:
            settings[_file_key(where, GROUP_MAIN, key)] = value
    return settings


def _file_key(where: str, section: str, name: str) -> str:
    """``name`` when it is a setting of ``section``; else a ``ConfigError`` saying where it belongs."""
    place = "the top level" if section == GROUP_MAIN else f"[{section}]"
    f = _FIELDS.get(name)
    if f is None and name in NOT_SETTINGS:
        raise ConfigError(f"{where}: {NOT_SETTINGS[name]}")
    if f is None:
        sections = ", ".join(f"[{g}]" for g in GROUPS if g != GROUP_MAIN)
        raise ConfigError(f"{where}: unknown key {name!r} at {place} (sections: {sections}; "
                          "keys: docs/CONFIGURATION.md)")
    if f.metadata["group"] != section:
        home = "the top level" if f.metadata["group"] == GROUP_MAIN else f"[{f.metadata['group']}]"
        raise ConfigError(f"{where}: key {name!r} belongs at {home}, not at {place}")
    return name


def config_from_file(path: str, **flags: Any) -> KVShareConfig:
    """The config of a ``--kvshare-config`` file, with ``flags`` (given on the command line) over it."""
    settings = read_config_file(path)
    try:
        KVShareConfig(**settings)
    except ConfigError as exc:
        raise ConfigError(f"--kvshare-config {path}: {exc}") from None
    return KVShareConfig(**{**settings, **flags})


def from_text(name: str, text: str) -> Any:
    """``text`` (a flag's value) as setting ``name``'s type where it reads as one, else ``text`` itself.

    Why not refuse here: a value that does not read as the type is then refused by ``SETTINGS``, with the
    same message as in the config file and ``POST /kvshare/config``.
    """
    kind = str(_FIELDS[name].type)
    lowered = text.strip().lower()
    try:
        if kind == "bool":
            return {"1": True, "true": True, "yes": True, "on": True,
                    "0": False, "false": False, "no": False, "off": False}.get(lowered, text)
        if "int" in kind:
            return int(text)
        if "float" in kind:
            return float(text)
    except ValueError:
        return text
    return text


def config_file_text(settings: Mapping[str, Any]) -> str:
    """A ``--kvshare-config`` file (TOML) holding ``settings`` (key -> value), each key in its section."""
    def value(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else json.dumps(v)

    lines = []
    for group in GROUPS:
        items = [(k, v) for k, v in settings.items() if _FIELDS[k].metadata["group"] == group and v is not None]
        if not items:
            continue
        if group != GROUP_MAIN:
            lines += ["", f"[{group}]"]
        lines += [f"{k} = {value(v)}" for k, v in items]
    return "\n".join(lines).strip() + "\n"


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
