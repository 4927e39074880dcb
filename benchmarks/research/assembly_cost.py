"""``python -m benchmarks.research.assembly_cost``: CPU time of assembling one corrected segment, by phase.

Why this exists: the target is that a kvcmas consumer's assembly cost at most
8 % of the dense prefill it replaces, and the server's counters
(``read_source``, ``gate_estimate``, ``write``) mix that work with whatever
else the two cores do (the learner, the next forward). This times the same
calls the server makes for one segment, on the 135M model's shapes (30
layers, 3 KV heads, head_dim 64, a 16384-row float32 pool), alone:

* ``read``: ``read_segment`` (the source's K/V out of the pool);
* ``estimate``: ``AnchorPool.estimate`` (gate, token weights, the plan);
* ``plan_args``: ``plan_kernel_args`` (the plan as the kernels' arguments);
* ``write``: ``align_correct_scatter_layers`` (rotate, correct, scatter);
* ``align_only``: the write of a fullshared segment (no correction), for scale.

Anchors are learned from synthetic K/V (``benchmarks.research.learn_cost.synthetic_kv``)
with the server's settings (rank 32, Gram factorization); tau 1 so the gate
always accepts (a rejection would skip the work being timed). Median and
min-max over ``--repeats``, at torch's thread count (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
import torch

from benchmarks.harness import RESULTS, write_op_timings
from benchmarks.research.learn_cost import HEAD_DIM, KV_HEADS, LAYERS, synthetic_kv
from sglang_kvshare.cache.kv_pool_io import read_segment
from sglang_kvshare.correction.anchor_pool import AnchorPool, PoolConfig
from sglang_kvshare.correction.apply import plan_kernel_args
from sglang_kvshare.correction.rope import RopeSpec
from sglang_kvshare.kernels import align_correct_scatter_layers

POOL_ROWS = 16384
PHASES = ("read", "estimate", "plan_args", "write", "align_only")


class SyntheticPool:
    """The two methods of SGLang's KV pool that ``read_segment`` uses, over per-layer buffers."""

    def __init__(self, rows: int, gen: torch.Generator) -> None:
        self.layer_num, self.start_layer = LAYERS, 0
        self.k = [torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
        self.v = [torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]


def measure(length: int, anchors: int, repeats: int, gen: torch.Generator) -> dict:
    """Phase times of one ``length``-token segment corrected from ``anchors`` anchors."""
    spec = RopeSpec.default(HEAD_DIM, theta=100000.0)
    pool = AnchorPool(spec, PoolConfig(rank=32, svd_method="gram", tau=1.0))
    for i in range(anchors):
        sk, sv, tk, tv = (synthetic_kv(length, gen) for _ in range(4))
        pool.add_observation(sk, sv, 40, tk, tv, 90, edge="e", content_key=f"c{i}")
    kv = SyntheticPool(POOL_ROWS, gen)
    src_idx = torch.arange(100, 100 + length)
    dst_idx = torch.arange(POOL_ROWS // 2, POOL_ROWS // 2 + length)
    rope = dict(src_start=40, dst_start=90, inv_freq=spec.inv_freq, rotary_dim=spec.rotary_dim, layout=spec.layout)
    est = pool.estimate(*read_segment(kv, src_idx), 40, 90, "e")
    if not est.accepted:
        raise RuntimeError(f"the gate refused ({est.reason}); the benchmark needs an accepted plan")
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    for i in range(repeats + 1):  # the first round warms up and is not counted
        # NOTE: the phases run in the server's order, one segment after the other, so each
        # meets the allocator as the previous one left it (timed apart, in loops of one
        # phase, freed blocks of the same size come back at once and hide page faults).
        clock = time.perf_counter()
        k, v = read_segment(kv, src_idx)
        lap = {"read": time.perf_counter() - clock}
        clock = time.perf_counter()
        est = pool.estimate(k, v, 40, 90, "e")
        lap["estimate"] = time.perf_counter() - clock
        clock = time.perf_counter()
        args = plan_kernel_args(est.plan, 0, length, torch.float32)
        lap["plan_args"] = time.perf_counter() - clock
        clock = time.perf_counter()
        align_correct_scatter_layers(kv.k, kv.v, src_idx, dst_idx, backend="torch", **rope, **args)
        lap["write"] = time.perf_counter() - clock
        del k, v, est, args
        clock = time.perf_counter()
        align_correct_scatter_layers(kv.k, kv.v, src_idx, dst_idx, backend="torch", **rope)
        lap["align_only"] = time.perf_counter() - clock
        if i:
            for phase, t in lap.items():
                times[phase].append(t)
    row: dict = {"length": length, "anchors": anchors}
    for phase in PHASES:
        t = times[phase]
        row[phase] = {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
    row["corrected_total_s"] = sum(row[p]["median_s"] for p in ("read", "estimate", "plan_args", "write"))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.research.assembly_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096])
    ap.add_argument("--anchors", type=int, nargs="+", default=[3, 6, 10])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "assembly_cost.json"))
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lengths:
        for anchors in args.anchors:
            row = measure(length, anchors, args.repeats, gen)
            rows.append(row)
            print(f"L={length:5d} anchors={anchors:2d} " + " ".join(
                f"{p} {row[p]['median_s'] * 1e3:6.1f} ms" for p in PHASES)
                  + f"  corrected total {row['corrected_total_s'] * 1e3:6.1f} ms", flush=True)
    write_op_timings(Path(args.out), "benchmarks.research.assembly_cost", argv,
                     {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "rank": 32,
                      "pool_rows": POOL_ROWS}, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
