"""How much does the correction cost next to the prefill it replaces? (kernels benchmark)

    python -m benchmarks.kernels                       # CPU: torch reference path, writes benchmarks/results/kernels_cpu.json
    python -m benchmarks.kernels --out $OUT/kernels_gpu.json   # on a CUDA machine: the Triton kernels

For each segment length L it times, on the device it runs on:
* ``align_correct`` (fused path through the dispatcher: Triton on CUDA, the
  torch path on CPU, fp32, batched over layers) for K and V of every layer,
  Vn anchors of rank r;
* ``align_only`` (Vn = 0, the "fullshared" alignment);
* ``align_correct_torch_unfused``: the same result with separate torch ops
  (gather, materialize every anchor delta, weight, sum, rotate, add, scatter);
* ``gate_sq_distances`` and ``token_distances`` (fused) and their unfused
  torch versions that reconstruct every anchor densely.
``bytes_moved`` is the compulsory traffic of the fused op (each input read
once, each output written once); ``gbps`` = bytes_moved / seconds; ``peak_gbps``
is a measured large tensor copy on the same device (2 x bytes / time).
``ratio_to_prefill`` divides the time by a measured dense prefill of L tokens of
the real model (SmolLM2-135M through transformers) on the same device.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, run_meta
from sglang_kvshare.kernels import align_correct_scatter_layers, gate_sq_distances, token_distances
from sglang_kvshare.kernels.dispatch import _use_triton

DEFAULT_OUT = RESULTS / "kernels_cpu.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn, device: torch.device, repeats: int, warmup: int = 1) -> dict:
    """Median, min, max and relative spread of ``repeats`` timed calls (after ``warmup`` untimed ones)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"seconds": med, "seconds_min": min(times), "seconds_max": max(times),
            "spread": (max(times) - min(times)) / med if med > 0 else 0.0, "repeats": repeats}


def measure_copy_gbps(device: torch.device, mib: int = 256, repeats: int = 5) -> float:
    """Achievable memory bandwidth: a large tensor copy reads and writes ``mib`` MiB each."""
    n = mib * 2**20 // 4
    a = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)
    t = time_it(lambda: b.copy_(a), device, repeats)
    return 2 * a.numel() * 4 / t["seconds_min"] / 1e9


# SmolLM2-135M-Instruct's architecture: used when the prepared weights are not on this machine
# (a fresh GPU box without network). Prefill time depends on the shapes, not on the weights.
SMOLLM2_135M_CONFIG = dict(
    architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu",
)


def load_model_config(name: str, random_weights: bool):
    """(config, model path or None, description): the prepared model, else its architecture with random weights."""
    from transformers import AutoConfig, LlamaConfig

    if not random_weights:
        try:
            from devtools.models import prepare

            path = str(prepare(name))
            return AutoConfig.from_pretrained(path), path, f"{name} (prepared weights, {path})"
        except Exception as exc:  # noqa: BLE001 - no weights here (no network): time the same architecture instead
            print(f"cannot prepare {name} ({exc}); timing its architecture with random weights", file=sys.stderr)
    if name != "smollm2-135m":
        raise SystemExit(f"no built-in architecture for {name}; prepare the model first")
    return LlamaConfig(**SMOLLM2_135M_CONFIG), None, "smollm2-135m architecture, random weights (same shapes, same time)"


def model_shapes(cfg) -> dict:
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads, "head_dim": head_dim,
            "rope_theta": float(theta)}


def measure_prefill(cfg, model_path: str | None, lengths: list[int], device: torch.device, dtype: torch.dtype,
                    repeats: int) -> dict[int, dict]:
    """Dense prefill (one forward over L tokens, building the KV cache) of the model, per length."""
    from transformers import AutoModelForCausalLM

    if model_path is not None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model = model.to(device).eval()
    gen = torch.Generator().manual_seed(0)
    out = {}
    for L in lengths:
        ids = torch.randint(100, model.config.vocab_size - 100, (1, L), generator=gen).to(device)

        def run():
            with torch.inference_mode():
                model(input_ids=ids, use_cache=True)

        out[L] = time_it(run, device, repeats)
    del model
    return out


def unfused_align_correct(k_src, v_src, src_idx, dst_idx, *, src_start, dst_start, inv_freq, k_w, v_w,
                          k_A, k_B, v_A, v_B, covered):
    """What the cache would do without the kernel: separate torch ops, every anchor delta materialized."""
    half = inv_freq.numel()

    def rot(x, shift):  # rotate_half over the whole head (the benchmark model has full rotary)
        ang = shift * inv_freq.to(torch.float64)
        cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
        cos, sin = torch.cat([cos, cos]), torch.cat([sin, sin])
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    for layer in range(len(k_src)):
        for pool, w, A, B, is_key in ((k_src[layer], k_w, k_A[layer], k_B[layer], True),
                                      (v_src[layer], v_w, v_A[layer], v_B[layer], False)):
            x = pool[src_idx].float()  # [L, H, Dh]
            heads, head_dim = x.shape[1:]
            deltas = torch.bmm(A[:, :covered].float(), B.float())  # [Vn, Lc, D]
            corr = (deltas * w[:covered].t()[:, :, None]).sum(0).view(covered, heads, head_dim)
            if is_key:
                x = rot(x, dst_start - src_start)
                corr = rot(corr, dst_start)
            x[:covered] = x[:covered] + corr
            pool[dst_idx] = x.to(pool.dtype)


def unfused_gate(X, A, B):
    return ((X.float().unsqueeze(0) - A.float() @ B.float()) ** 2).sum(dim=(1, 2, 3))


def unfused_token(X, A, B):
    return (X.float().unsqueeze(0) - A.float() @ B.float()).abs().mean(dim=(1, 3)).t()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024], help="segment lengths L")
    ap.add_argument("--anchors", type=int, default=10, help="Vn, accepted anchors (kvcmas capacity 10)")
    ap.add_argument("--rank", type=int, default=32, help="rank r of the anchor factors")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="pool dtype (default fp32 on CPU, bf16 on CUDA)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads for everything timed (default 1 on CPU: stable on a shared machine)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--random-weights", action="store_true",
                    help="time the prefill of the model's architecture with random weights (no model files needed)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    threads_before = torch.get_num_threads()
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    try:
        return _run(args, device, dtype, argv)
    finally:
        torch.set_num_threads(threads_before)


def _run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, argv: list[str] | None) -> dict:
    fused_backend = "triton" if _use_triton("auto", device) else "torch-reference"
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    cfg, model_path, model_desc = load_model_config(args.model, args.random_weights)
    shp = model_shapes(cfg)
    layers, heads, head_dim = shp["layers"], shp["kv_heads"], shp["head_dim"]
    D = heads * head_dim
    inv_freq = (1.0 / shp["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float().to(device)
    elt = torch.empty((), dtype=dtype).element_size()
    vn, r = args.anchors, args.rank

    print(f"device {device_name}; fused path = {fused_backend}; measuring copy bandwidth ...", file=sys.stderr)
    peak = measure_copy_gbps(device)
    print(f"prefill of {args.lengths} tokens on {args.model} ...", file=sys.stderr)
    prefill = measure_prefill(cfg, model_path, args.lengths, device, dtype, args.prefill_repeats)

    rows = []
    gen = torch.Generator().manual_seed(0)
    for L in args.lengths:
        pool_size = 2 * L + 16
        mk = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen)).to(device)  # noqa: E731
        k_pool = [mk(pool_size, heads, head_dim).to(dtype) for _ in range(layers)]
        v_pool = [mk(pool_size, heads, head_dim).to(dtype) for _ in range(layers)]
        perm = torch.randperm(pool_size, generator=gen).to(device)
        src_idx, dst_idx = perm[:L], perm[L:2 * L]
        fac = dict(k_A=mk(layers, vn, L, r, scale=0.1), k_B=mk(layers, vn, r, D, scale=0.1),
                   v_A=mk(layers, vn, L, r, scale=0.1), v_B=mk(layers, vn, r, D, scale=0.1))
        w = dict(k_w=torch.softmax(mk(L, vn), 1), v_w=torch.softmax(mk(L, vn), 1))
        rot = dict(src_start=37, dst_start=37 + 4096, inv_freq=inv_freq)
        fac_elt = fac["k_A"].element_size()
        idx_bytes = 2 * L * 8
        align_bytes = layers * 2 * (2 * L * D * elt + idx_bytes)
        corr_bytes = layers * 2 * (vn * (L * r + r * D) * fac_elt) + 2 * L * vn * 4
        shape = {"L": L, "layers": layers, "kv_heads": heads, "head_dim": head_dim, "anchors": vn, "rank": r,
                 "dtype": str(dtype).removeprefix("torch.")}

        def row(kernel, path, t, nbytes):
            rows.append({"kernel": kernel, "path": path, "device": device_name, **t, "bytes_moved": nbytes,
                         "gbps": nbytes / t["seconds"] / 1e9, "peak_gbps": peak,
                         "fraction_of_peak": nbytes / t["seconds"] / 1e9 / peak,
                         "prefill_seconds": prefill[L]["seconds"],
                         "ratio_to_prefill": t["seconds"] / prefill[L]["seconds"], **shape})
            print(f"L={L:5d} {kernel:32s} {t['seconds'] * 1e3:9.2f} ms  {rows[-1]['gbps']:7.2f} GB/s  "
                  f"ratio_to_prefill {rows[-1]['ratio_to_prefill']:.4f}", file=sys.stderr)

        t = time_it(lambda: align_correct_scatter_layers(k_pool, v_pool, src_idx, dst_idx, covered=L, **rot, **w, **fac),
                    device, args.repeats)
        row("align_correct", fused_backend, t, align_bytes + corr_bytes)
        t = time_it(lambda: align_correct_scatter_layers(k_pool, v_pool, src_idx, dst_idx, **rot), device, args.repeats)
        row("align_only", fused_backend, t, align_bytes)
        t = time_it(lambda: unfused_align_correct(k_pool, v_pool, src_idx, dst_idx, covered=L, **rot, **w, **fac),
                    device, args.repeats)
        row("align_correct_torch_unfused", "torch-unfused", t, align_bytes + corr_bytes)

        X = torch.stack([v[src_idx].reshape(L, D) for v in v_pool])  # [layers, k, D], the gate's input
        A, B = fac["v_A"].transpose(0, 1).contiguous(), fac["v_B"].transpose(0, 1).contiguous()
        gate_bytes = layers * L * D * elt + vn * layers * (L * r + r * D) * fac_elt
        t = time_it(lambda: gate_sq_distances(X, A, B), device, args.repeats)
        row("gate_sq_distances", fused_backend, t, gate_bytes + vn * 4)
        t = time_it(lambda: unfused_gate(X, A, B), device, args.repeats)
        row("gate_sq_distances_torch_unfused", "torch-unfused", t, gate_bytes + vn * 4)
        t = time_it(lambda: token_distances(X, A, B), device, args.repeats)
        row("token_distances", fused_backend, t, gate_bytes + L * vn * 4)
        t = time_it(lambda: unfused_token(X, A, B), device, args.repeats)
        row("token_distances_torch_unfused", "torch-unfused", t, gate_bytes + L * vn * 4)
        del k_pool, v_pool, fac, X, A, B

    command = "python -m benchmarks.kernels " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "meta": {
            **run_meta(command.strip()),
            "question": "cost of the correction and the gate next to the dense prefill they replace",
            "device": device_name,
            "device_type": device.type,
            "fused_path": fused_backend,
            "note": ("CPU run: the 'fused' rows are the torch path (the reference computing in fp32, batched over "
                     "layers: what a CPU server runs), not a Triton kernel; "
                     "Triton kernels were not timed (the interpreter's speed means nothing)."
                     if fused_backend != "triton" else "fused rows are the Triton kernels"),
            "peak_gbps": peak,
            "peak_source": "measured: torch copy of 256 MiB fp32 on this device, 2 x bytes / best time",
            "bytes_moved": "compulsory traffic of the fused op: inputs read once, outputs written once",
            "model": args.model,
            "prefill_model": model_desc,
            "model_shapes": shp,
            "prefill": {str(L): v for L, v in prefill.items()},
            "torch": torch.__version__,
            "triton": _triton_version(),
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return result


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
