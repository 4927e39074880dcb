"""Every SGLang internal kvshare wraps, overrides or calls privately: the upgrade checklist.

Why one module: SGLang's ``HookRegistry`` only logs a target it cannot find
and carries on, so a renamed SGLang method would silently turn a kvshare
feature off. Here each target is named once, as a string, with the leading
parameters kvshare passes or reads (callables) or the fields it reads
(classes). ``check_targets`` resolves them against the installed SGLang;
the plugin runs it before it installs any hook and refuses to start on a
mismatch, and ``tests/server/test_sglang_targets.py`` runs it on every
target, so an SGLang upgrade that breaks one fails loudly, by name.

Hooks are grouped by the process they run in. ``HTTP_HOOKS`` go into the
HTTP server process when it serves kvshare; ``SCHEDULER_HOOKS`` into the
scheduler process when SGLang builds the kvshare cache (``plugin``). A plain
``sglang.launch_server`` gets none of them.

This module imports nothing from SGLang or from the rest of kvshare, so it is
cheap to import and reads as a list; ``docs/UPGRADE.md`` prints it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

SGLANG_VERSION = "0.5.23"

HookKind = Literal["before", "after", "around"]
Process = Literal["http", "scheduler"]


@dataclass(frozen=True)
class Target:
    """One SGLang name kvshare depends on.

    ``params``: the leading parameters of a callable, in order, as kvshare
    calls or receives them (a hook receives exactly these). ``attrs``: the
    fields or attributes of a class that kvshare reads or sets.
    """

    path: str
    why: str
    params: Optional[tuple[str, ...]] = None
    attrs: tuple[str, ...] = ()
    positional: bool = False  # kvshare builds the class positionally: ``attrs`` are its leading fields, in order
    classmethod: bool = False  # a classmethod: ``params`` leave out ``cls``, which a hook receives first


@dataclass(frozen=True)
class Hook:
    """A kvshare function installed around an SGLang target (``module:function`` of ours)."""

    target: Target
    kind: HookKind
    hook: str
    process: Process


_SERVING = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
_TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_RADIX = "sglang.srt.mem_cache.radix_cache.RadixCache"
_BASE_CACHE = "sglang.srt.mem_cache.base_prefix_cache"
_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
_TRITON = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend"

# ------------------------------------------------------------------ hooks
SETUP_HTTP_SERVER = Target(
    "sglang.srt.entrypoints.http_server._setup_and_run_http_server",
    "runs only in the process that serves HTTP, with the tokenizer manager and IPC names, before the "
    "API-key middleware and uvicorn start: the admin and chat-stats routes are mounted here",
    params=("server_args", "tokenizer_manager", "template_manager", "port_args"))

HTTP_HOOKS: tuple[Hook, ...] = (
    Hook(Target(f"{_TOKENIZER}._validate_one_request",
                "after tokenization; a ValueError here is SGLang's own path to an HTTP 400",
                params=("self", "obj", "input_ids")),
         "after", "sglang_kvshare.server.request_validation:validate_annotation_after", "http"),
    Hook(Target(f"{_SERVING}.handle_request", "reads the chat request's kvshare field from the raw body",
                params=("self", "request", "raw_request")),
         "around", "sglang_kvshare.chat.hooks:around_handle_request", "http"),
    Hook(Target(f"{_SERVING}._render_and_encode_chat_template",
                "records the messages, tools and template options SGLang renders, and the ids",
                params=("self", "messages", "tools", "template_kwargs")),
         "around", "sglang_kvshare.chat.hooks:around_render", "http"),
    Hook(Target(f"{_SERVING}._convert_to_internal_request",
                "replaces the ids by the piece-wise rendering and adds the annotation",
                params=("self", "request", "raw_request")),
         "around", "sglang_kvshare.chat.hooks:around_convert", "http"),
    Hook(Target(f"{_SERVING}._handle_non_streaming_request", "warm-up and the report in the response",
                params=("self", "adapted_request", "request", "raw_request")),
         "around", "sglang_kvshare.chat.hooks:around_non_streaming", "http"),
    Hook(Target(f"{_SERVING}._handle_streaming_request", "warm-up and the report chunk of a stream",
                params=("self", "adapted_request", "request", "raw_request")),
         "around", "sglang_kvshare.chat.hooks:around_streaming", "http"),
    Hook(Target(f"{_TOKENIZER}.generate_request", "the outputs of annotated requests: the fidelity guard, "
                "cached_tokens, the chat layer's answers",
                params=("self", "obj", "request")),
         "around", "sglang_kvshare.server.outputs:around_generate", "http"),
    Hook(SETUP_HTTP_SERVER, "before", "sglang_kvshare.server.http_routes:before_setup_http_server", "http"),
)

SCHEDULER_HOOKS: tuple[Hook, ...] = (
    Hook(Target("sglang.srt.managers.scheduler_components.internal_state."
                "SchedulerInternalStateController.get_internal_state",
                "GetInternalStateReq, fanned out to every DP rank: carries the kvshare snapshot and "
                "(--dp-size > 1) the admin ops",
                params=("self", "recv_req")),
         "after", "sglang_kvshare.admin.scheduler_hooks:after_get_internal_state", "scheduler"),
    Hook(Target(f"{_SCHEDULER}.handle_rpc_request",
                "RpcReqInput on the scheduler's RPC socket: the admin writes and pool reads",
                params=("self", "recv_req")),
         "around", "sglang_kvshare.admin.scheduler_hooks:around_handle_rpc_request", "scheduler"),
    Hook(Target(f"{_SCHEDULER}.on_idle", "refreshes the Prometheus metrics while idle", params=("self",)),
         "after", "sglang_kvshare.admin.scheduler_hooks:after_on_idle", "scheduler"),
    Hook(Target("sglang.srt.managers.scheduler_components.metrics_reporter."
                "SchedulerMetricsReporter.report_prefill_stats",
                "refreshes the Prometheus metrics after prefill batches", params=("self", "batch")),
         "after", "sglang_kvshare.admin.scheduler_hooks:after_prefill_report", "scheduler"),
    Hook(Target(f"{_ADDER}._select_prefill_admission",
                "staged prefill: ends a new request's first chunk where reuse can resume",
                params=("self", "req", "total_tokens")),
         "around", "sglang_kvshare.server.staged_prefill:around_select_prefill_admission", "scheduler"),
    Hook(Target(f"{_ADDER}.add_chunked_req",
                "staged prefill: resumes reuse between two chunks, then caps the next chunk",
                params=("self", "req")),
         "around", "sglang_kvshare.server.staged_prefill:around_add_chunked_req", "scheduler"),
    Hook(Target(f"{_FORWARD_BATCH}.init_new",
                "the sparse extend: owed head rows folded into a prefill forward",
                params=("batch", "model_runner"), classmethod=True),
         "around", "sglang_kvshare.server.sparse_extend:around_init_new", "scheduler"),
    Hook(Target(f"{_TORCH_NATIVE}.init_forward_metadata",
                "the sparse extend: whether a forward's queries moved, once per forward",
                params=("self", "forward_batch")),
         "after", "sglang_kvshare.server.sparse_extend:after_init_forward_metadata", "scheduler"),
    Hook(Target(f"{_TORCH_NATIVE}.forward_extend", "the sparse extend: queries at their true positions",
                params=("self", "q", "k", "v", "layer", "forward_batch")),
         "around", "sglang_kvshare.server.sparse_extend:around_torch_native_forward_extend", "scheduler"),
)

# Installed only where the prefill attention backend is triton (GPU): the sparse extend as a custom mask.
TRITON_SPARSE_HOOKS: tuple[Hook, ...] = (
    Hook(Target(f"{_TRITON}.init_forward_metadata",
                "the sparse extend on the triton backend: the folded rows as a custom mask over the whole prefix",
                params=("self", "forward_batch")),
         "after", "sglang_kvshare.server.sparse_extend_triton:after_triton_init_forward_metadata", "scheduler"),
    Hook(Target(f"{_TRITON}.forward_extend",
                "the sparse extend on the triton backend: the mask applied to the prefix keys too",
                params=("self", "q", "k", "v", "layer", "forward_batch")),
         "around", "sglang_kvshare.server.sparse_extend_triton:around_triton_forward_extend", "scheduler"),
)

# Installed only with learn_on_idle (and --kvshare-learn-async): learning steps on the
# scheduler's own thread; the second one also with learn_before_decode. The first one also with
# --kvshare-pool-save-interval-s: the pools are saved on idle time.
IDLE_LEARNING_HOOK = Hook(
    Target(f"{_SCHEDULER}.maybe_sleep_on_idle", "called only when nothing runs and nothing waits",
           params=("self",)),
    "before", "sglang_kvshare.server.idle_learning:before_sleep_on_idle", "scheduler")
DECODE_LEARNING_HOOK = Hook(
    Target(f"{_SCHEDULER}.run_batch", "one learning step in front of a decode batch",
           params=("self", "batch")),
    "before", "sglang_kvshare.server.idle_learning:before_run_batch", "scheduler")

# ------------------------------------------------------------------ overrides (KVShareRadixCache)
OVERRIDES: tuple[Target, ...] = (
    Target(f"{_RADIX}.__init__", "the kvshare cache is SGLang's Python RadixCache", params=("self", "params")),
    Target(f"{_RADIX}.match_prefix", "the exact match, then assembly of shared segments",
           params=("self", "params")),
    Target(f"{_RADIX}.checkpoint", "rows past est_start go to the estimate namespace; learning",
           params=("self", "req", "up_to")),
    Target(f"{_RADIX}.on_release", "closes the request's serving activity", params=("self", "req", "checkpointed")),
    Target(f"{_RADIX}.reset", "forgets the copy records with the tree", params=("self",)),
    Target(f"{_RADIX}._delete_leaf", "marks evicted nodes dead for the copy records; counts evictions by rank",
           params=("self", "node")),
)

# ------------------------------------------------------------------ other internals kvshare uses
CALLS: tuple[Target, ...] = (
    Target("sglang.srt.mem_cache.registry.register_radix_cache_backend",
           "registers --radix-cache-backend kvshare", params=("name", "factory")),
    Target("sglang.srt.mem_cache.registry.registered_radix_cache_backends", "idempotent registration",
           params=()),
    Target(f"{_RADIX}._match_prefix_helper", "walks into the estimate namespace below a node",
           params=("self", "node", "key")),
    Target(f"{_RADIX}._insert_helper", "inserts assembled rows below a node",
           params=("self", "node", "key", "value", "priority", "inserted_len")),
    Target(f"{_RADIX}.insert", "inserts a request's exact rows", params=("self", "params")),
    Target(f"{_RADIX}.path_device_indices", "the pool slots of a path", params=("self", "node")),
    Target(f"{_RADIX}.inc_lock_ref", "locks a source while it is read", params=("self", "node")),
    Target(f"{_RADIX}.dec_lock_ref", "unlocks it", params=("self", "node")),
    Target(f"{_RADIX}.lock", "locks a request's last node", params=("self", "node")),
    Target(f"{_RADIX}.unlock", "unlocks it", params=("self", "lock")),
    Target(f"{_RADIX}.evict", "frees room for assembled rows; heaps leaves by eviction_strategy.get_priority(node)",
           params=("self", "params")),
    Target(f"{_RADIX}.evictable_size", "admin stats", params=("self",)),
    Target(f"{_RADIX}.protected_size", "admin stats", params=("self",)),
    Target("sglang.srt.mem_cache.radix_cache.RadixKey", "keys of the estimate namespace",
           attrs=("extra_key", "cache_salt")),
    Target("sglang.srt.mem_cache.radix_cache.TreeNode", "walks parent chains; a reused source is touched",
           attrs=("parent", "key", "value", "children", "last_access_time")),
    Target(_RADIX, "the retention policy wraps the eviction strategy SGLang built",
           attrs=("eviction_strategy", "eviction_policy", "root_node")),
    Target(f"{_BASE_CACHE}.MatchPrefixParams", "match_prefix's argument", attrs=("key", "req")),
    Target(f"{_BASE_CACHE}.MatchResult", "match_prefix's result",
           attrs=("device_prefix_len", "last_device_node", "last_host_node", "best_match_node")),
    Target(f"{_BASE_CACHE}.EvictParams", "evict's argument", attrs=("num_tokens",)),
    Target(f"{_BASE_CACHE}.InsertParams", "insert's argument", attrs=("key", "value", "inserted_len", "priority")),
    Target("sglang.srt.mem_cache.cache_init_params.CacheInitParams", "the cache factory's argument",
           attrs=("page_size",)),
    Target("sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len",
           "where staged prefill may resume reuse", params=("self", "input_len")),
    Target("sglang.srt.managers.schedule_batch.ReqKvInfo", "a resumed stage hands its rows to the request",
           attrs=("req_pool_idx", "cache_protected_len", "cache_inserted_len", "kv_allocated_len",
                  "kv_committed_len")),
    Target("sglang.srt.managers.schedule_policy._PrefillAdmission",
           "a staged admission is rebuilt positionally with these fields, in this order",
           attrs=("prefix_len", "extend_len", "max_new_tokens", "is_chunked", "replay_len"), positional=True),
    Target("sglang.srt.managers.schedule_policy.AddReqResult", "a staged request waits a round",
           attrs=("CONTINUE",)),
    Target(f"{_TORCH_NATIVE}._run_sdpa_forward_extend", "the sparse extend stands in for it, same arguments",
           params=("self", "query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "seq_lens",
                   "extend_prefix_lens", "extend_seq_lens", "encoder_lens", "scaling", "enable_gqa", "causal",
                   "is_cross_attn", "sliding_window_size")),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch", "the sparse extend folds rows into a copy",
           attrs=("forward_mode", "reqs", "prefix_lens", "extend_lens", "input_ids", "prefill_input_ids_cpu",
                  "out_cache_loc", "req_pool_indices", "req_pool_indices_cpu", "extend_num_tokens",
                  "extend_logprob_start_lens")),
    Target("sglang.srt.managers.schedule_batch.Req", "the sparse extend reads the owed rows' tokens",
           attrs=("full_untruncated_fill_ids",)),
    Target(_FORWARD_BATCH, "the sparse extend sets the true positions", attrs=("positions",)),
    Target("sglang.srt.model_executor.forward_batch_info.ForwardMode", "only plain prefill forwards fold rows",
           attrs=("EXTEND",)),
    Target("sglang.srt.runtime_context.attention_backends", "whether the sparse extend is supported", params=()),
    Target(_TRITON, "the sparse extend swaps the kernel for one call, replaces the metadata, reads the rows",
           attrs=("extend_attention_fwd", "forward_metadata", "req_to_token")),
    Target("sglang.kernels.ops.attention.extend_attention.extend_attention_fwd",
           "the triton extend kernel: a custom mask over prefix and extend keys",
           params=("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr",
                   "kv_indptr", "kv_indices", "custom_mask", "is_causal", "mask_indptr", "max_len_extend",
                   "k_scale", "v_scale", "sm_scale", "logit_cap", "skip_prefix_custom_mask")),
    Target("sglang.srt.layers.attention.triton_backend.ForwardMetadata", "the sparse extend replaces four fields",
           attrs=("kv_indptr", "kv_indices", "custom_mask", "mask_indptr")),
    Target("sglang.srt.runtime_context.get_exec", "whether prefills replay a CUDA graph (no sparse mask there)",
           params=()),
    Target("sglang.srt.model_executor.cuda_graph_config.CudaGraphConfig", "the prefill phase's graph backend",
           attrs=("prefill",)),
    Target("sglang.srt.runtime_context.get_server_args", "speculative decoding, mixed chunks, DP attention",
           params=()),
    Target(f"{_TOKENIZER}.get_internal_state", "the admin read channel", params=("self",)),
    Target(_TOKENIZER, "the admin writes with --dp-size > 1 ride its fan-out",
           attrs=("auto_create_handle_loop",)),
    Target("sglang.srt.managers.io_struct.GetInternalStateReq", "carries a fanned-out admin op", attrs=("rid",)),
    Target("sglang.srt.distributed.parallel_state.get_tp_group", "kvcmas under TP: the gate's CPU group", params=()),
    Target("sglang.srt.runtime_context.get_parallel", "a scheduler's DP rank in the admin answers", params=()),
    Target(_TOKENIZER, "the fidelity guard sends its references only while no request is in flight, and "
           "exports its metrics where SGLang does", attrs=("rid_to_state", "enable_metrics")),
    Target("sglang.srt.managers.io_struct.GenerateReqInput", "the guard's reference and its logprobs",
           attrs=("return_logprob", "logprob_start_len", "top_logprobs_num")),
    Target("sglang.srt.managers.io_struct.RpcReqInput", "the admin write channel",
           attrs=("method", "parameters", "rid")),
    Target("sglang.srt.managers.io_struct.RpcReqOutput", "its answer", attrs=("success", "message", "rid")),
    Target("sglang.srt.managers.io_struct.GenerateReqInput", "the chat warm-up request",
           attrs=("input_ids", "sampling_params", "lora_path", "extra_key", "cache_salt")),
    Target("sglang.srt.managers.io_struct.async_sock_send", "the admin write channel", params=("socket", "obj")),
    Target("sglang.srt.managers.io_struct.async_sock_recv", "the admin write channel", params=("socket",)),
    Target("sglang.srt.utils.network.get_zmq_socket", "binds the RPC socket",
           params=("context", "socket_type", "endpoint", "bind")),
    Target("sglang.srt.utils.auth.auth_level", "admin routes use SGLang's key levels", params=("level",)),
    Target("sglang.srt.utils.auth.AuthLevel", "admin routes use SGLang's key levels", attrs=("ADMIN_OPTIONAL",)),
    Target("sglang.srt.entrypoints.openai.protocol.ChatCompletionRequest", "the chat request",
           attrs=("messages", "n", "user", "model")),
    Target("sglang.srt.entrypoints.http_server.app", "the FastAPI app the routes are mounted on"),
    Target("sglang.srt.server_args.ServerArgs.add_cli_args", "the launcher's --help", params=("parser",)),
    Target("sglang.srt.server_args.prepare_server_args", "the launcher", params=("argv",)),
    Target("sglang.launch_server.run_server", "the launcher", params=("server_args",)),
    Target("sglang.srt.utils.kill_process_tree", "the launcher", params=("parent_pid", "include_parent")),
    Target("sglang.srt.plugins.load_plugins", "the launcher registers the backend before parsing", params=()),
    Target("sglang.srt.plugins.hook_registry.HookRegistry", "hook installation",
           attrs=("register", "apply_hooks", "_patched")),
)


ALL_HOOKS: tuple[Hook, ...] = (HTTP_HOOKS + SCHEDULER_HOOKS + TRITON_SPARSE_HOOKS
                                + (IDLE_LEARNING_HOOK, DECODE_LEARNING_HOOK))  # every hook some server installs


def hook_targets() -> tuple[Target, ...]:
    """Every target some kvshare hook wraps."""
    return tuple(h.target for h in ALL_HOOKS)


def all_targets() -> tuple[Target, ...]:
    """Every SGLang name kvshare depends on (hooked, overridden or called)."""
    return hook_targets() + OVERRIDES + CALLS


class IncompatibleSGLangError(RuntimeError):
    """The installed SGLang lacks a name kvshare needs, or its signature changed."""


def _has_attr(cls: type, name: str) -> bool:
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    for source in ("model_fields", "__struct_fields__", "_fields"):
        if name in (getattr(cls, source, None) or ()):
            return True
    if any(name in getattr(klass, "__annotations__", {}) for klass in inspect.getmro(cls)):
        return True
    if hasattr(cls, name):
        return True
    try:  # an attribute a method of the class sets (TreeNode in __init__, TokenizerManager in its init helpers)
        return re.search(rf"self\.{re.escape(name)}\s*[:=]", inspect.getsource(cls)) is not None
    except (OSError, TypeError):
        return False


def _field_order(cls: type) -> Optional[list[str]]:
    """The positional field order of a dataclass or named tuple, else None."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    fields = getattr(cls, "_fields", None)
    return list(fields) if fields is not None else None


def check_target(target: Target) -> Optional[str]:
    """What is wrong with ``target`` in the installed SGLang, or None when it matches."""
    try:
        obj = pkgutil.resolve_name(target.path)
    except (ImportError, AttributeError, ValueError) as exc:
        return f"{target.path} is missing ({type(exc).__name__}: {exc})"
    if target.params is not None:
        try:
            params = list(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            return f"{target.path} is not a callable with a signature"
        want = list(target.params)
        if params[: len(want)] != want:
            return f"{target.path} takes ({', '.join(params)}); kvshare expects it to start with ({', '.join(want)})"
    if target.attrs:
        if not inspect.isclass(obj):
            return f"{target.path} is not a class"
        missing = [a for a in target.attrs if not _has_attr(obj, a)]
        if missing:
            return f"{target.path} has no {', '.join(missing)}"
        order = _field_order(obj) if target.positional else None
        if target.positional and (order is None or order[: len(target.attrs)] != list(target.attrs)):
            return (f"{target.path} fields are ({', '.join(order or ())}); kvshare builds it positionally "
                    f"from ({', '.join(target.attrs)})")
    return None


def check_targets(targets: Iterable[Target]) -> None:
    """Raise ``IncompatibleSGLangError`` naming every target that does not match the installed SGLang."""
    problems = [p for p in (check_target(t) for t in targets) if p is not None]
    if problems:
        listed = "\n  - ".join(problems)
        raise IncompatibleSGLangError(
            f"sglang-kvshare is built for SGLang {SGLANG_VERSION}; the installed SGLang differs:\n  - {listed}\n"
            f"Install it (pip install 'sglang=={SGLANG_VERSION}'), or update "
            "sglang_kvshare/server/sglang_targets.py and the code that uses these names.")


def resolve_hook(hook: Hook) -> Any:
    """The kvshare function of ``hook`` (imported on demand)."""
    module, _, name = hook.hook.partition(":")
    return getattr(importlib.import_module(module), name)
