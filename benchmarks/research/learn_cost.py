"""``python -m benchmarks.research.learn_cost``: CPU time of learning one observation, per SVD method and length.

Why this exists: on a CPU server the learner's factorizations share the cores
with the forward, and at 4K shared tokens a slow factorization beside
back-to-back prefills can keep a kvcmas pool from ever getting warm (its
observations wait, then drop from a full queue). This times the learner's own work,
``prepare_observation`` (canonical frame, deltas, four rank-32 factorizations:
base K/V and delta K/V), on the 135M model's shapes (30 layers, 3 KV heads,
head_dim 64) for each method ``factorize`` offers, with the base
(``with_base``: first observation of a content) and without it (a known
content on a new edge), and reports how far each method's reconstruction
residual is from the exact truncated SVD's (``residual_over_svd``, 1.0 = optimal).

Inputs are synthetic K/V with a decaying spectrum (a rank-48 signal plus
noise), seeded; the timings do not depend on the values. Median and min-max
over ``--repeats``, in one process, at torch's thread count (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, write_op_timings
from sglang_kvshare.correction.anchor_pool import PoolConfig, prepare_observation
from sglang_kvshare.correction.low_rank import factorize
from sglang_kvshare.correction.rope import RopeSpec

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
METHODS = ("svd", "randomized", "gram")


def synthetic_kv(length: int, gen: torch.Generator) -> torch.Tensor:
    """``[layers, L, heads, dim]`` float32 with a decaying spectrum."""
    d = KV_HEADS * HEAD_DIM
    u = torch.randn(LAYERS, length, 48, generator=gen)
    scale = torch.logspace(0, -2, 48)
    v = torch.randn(LAYERS, 48, d, generator=gen) / d ** 0.5
    x = (u * scale) @ v + 0.01 * torch.randn(LAYERS, length, d, generator=gen)
    return x.view(LAYERS, length, KV_HEADS, HEAD_DIM)


def residual(x: torch.Tensor, method: str) -> float:
    f = factorize(x, 32, method)
    return float((f.reconstruct() - x).pow(2).sum())


def time_prepare(spec: RopeSpec, length: int, method: str, with_base: bool, repeats: int,
                 gen: torch.Generator) -> list[float]:
    config = PoolConfig(rank=32, svd_method=method)
    sk, sv, tk, tv = (synthetic_kv(length, gen) for _ in range(4))
    prepare_observation(spec, config, sk, sv, 40, tk, tv, 90, edge="e", content_key="c", with_base=True)  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        prepare_observation(spec, config, sk, sv, 40, tk, tv, 90, edge="e", content_key="c", with_base=with_base)
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.research.learn_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "learn_cost.json"))
    args = ap.parse_args(argv)
    spec = RopeSpec.default(HEAD_DIM, theta=100000.0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lengths:
        x = synthetic_kv(length, gen)
        exact = residual(x, "svd")
        for method in args.methods:
            row = {"length": length, "method": method, "residual_over_svd": residual(x, method) / exact}
            for with_base in (True, False):
                t = time_prepare(spec, length, method, with_base, args.repeats, gen)
                row["with_base" if with_base else "deltas_only"] = {
                    "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
            rows.append(row)
            print(f"L={length:5d} {method:10s} with base {row['with_base']['median_s']:6.3f} s "
                  f"({row['with_base']['min_s']:.3f}-{row['with_base']['max_s']:.3f}), deltas only "
                  f"{row['deltas_only']['median_s']:6.3f} s, residual/svd {row['residual_over_svd']:.4f}", flush=True)
    write_op_timings(Path(args.out), "benchmarks.research.learn_cost", argv,
                     {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "rank": 32}, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
