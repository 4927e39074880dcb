"""``python -m benchmarks.stock_vs_off``: is ``--kvshare-mode off`` free against stock SGLang, to 2 %?

The target: ``off`` costs nothing against ``sglang.launch_server`` with its
default cache, TTFT and throughput within 2 %. Separate runs of the two
servers cannot resolve 2 % on this shared machine: its speed drifts by
10-20 % between minutes (per-repeat ratios of 0.87-1.42 between two servers
run one after the other). So both servers run *at once* and the same requests go to one,
then the other, in ABBA order (stock first on even pairs, ``off`` first on odd
ones): the drift hits both sides of a pair alike and cancels in the paired
ratio ``off / stock``. Only one request (or one batch) is in flight at a time.

Both servers get ``--sleep-on-idle`` (SGLang's own flag: the scheduler waits
on its sockets instead of spinning a core), so the idle one does not slow the
busy one; ``idle_cpu_share`` in the results checks that it does not.

* ``ttft``: ``--pairs`` single requests, a new ``--length``-token content
  each, sent as the chain benchmark's first agent (kvshare annotation
  included, so ``off`` also parses its segments), 1-token greedy generation;
  TTFT is the first streamed chunk.
* ``throughput``: ``--rounds`` rounds of ``--batch`` concurrent requests per
  server (new contents of ``--batch-length`` tokens, ``--batch-tokens``
  output tokens each, EOS ignored); prompt + output tokens per second of wall.

The verdict per metric: the median paired ratio, and a 95 % bootstrap interval
of it; "within 2 %" when the whole interval lies in [0.98, 1.02].
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from benchmarks.chain_ttft import AGENTS, request
from benchmarks.harness import (RESULTS, machine, mode_args, prefilled_tokens, process_tree_cpu_s, run_meta,
                                stream_generate, write_json)
from benchmarks.texts import context_tokens
from devtools.server_process import ServerProcess

ARMS = ("stock", "off")
TOLERANCE = 0.02
FIRST_AGENT = list(AGENTS)[0]


def pair_order(i: int) -> tuple[str, str]:
    """ABBA: stock first on even pairs, ``off`` first on odd ones, so a drift within a pair cancels too."""
    return ARMS if i % 2 == 0 else ARMS[::-1]


def bootstrap_median_ci(ratios: Sequence[float], *, level: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``ratios`` (seeded, so reruns of the analysis agree)."""
    if len(ratios) < 2:
        raise ValueError("a bootstrap interval needs at least two paired ratios")
    rng = random.Random(seed)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    lo = medians[int((1 - level) / 2 * resamples)]
    hi = medians[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return lo, hi


def verdict(ratios: Sequence[float], tolerance: float = TOLERANCE) -> dict:
    """The paired ratios ``off / stock`` summed up, and what they decide about ``within tolerance``.

    ``within``: the whole interval inside ``1 +- tolerance``; ``outside``: the
    whole interval beyond it (on either side); else ``unresolved`` (more pairs
    needed). For TTFT a ratio above 1 means ``off`` is slower; for throughput
    below 1 means it is slower.
    """
    lo, hi = bootstrap_median_ci(ratios)
    if 1 - tolerance <= lo and hi <= 1 + tolerance:
        decided = "within"
    elif hi < 1 - tolerance or lo > 1 + tolerance:
        decided = "outside"
    else:
        decided = "unresolved"
    return {"n": len(ratios), "median": statistics.median(ratios), "ci95": [lo, hi],
            "min": min(ratios), "max": max(ratios), "tolerance": tolerance, "verdict": decided}


def start_both(model_path: str) -> dict[str, ServerProcess]:
    """Both servers, launched side by side (one start each: it is the paired requests that are compared)."""
    idle = ["--sleep-on-idle"]
    servers = {"stock": ServerProcess(model_path=model_path, stock=True, extra_args=idle),
               "off": ServerProcess(model_path=model_path, kvshare_args=mode_args("off"), extra_args=idle)}
    try:
        for server in servers.values():
            server.start()  # one after the other: two model loads at once only slow each other
    except Exception:
        for server in servers.values():
            server.stop()
        raise
    return servers


def idle_cpu_share(servers: dict[str, ServerProcess], seconds: float = 5.0) -> dict[str, float]:
    """CPU seconds per wall second each idle server's process tree burns (0: asleep; 1: a spinning core)."""
    before = {arm: process_tree_cpu_s(s.proc.pid) for arm, s in servers.items()}
    time.sleep(seconds)
    return {arm: (process_tree_cpu_s(s.proc.pid) - before[arm]) / seconds for arm, s in servers.items()}


def ttft_pair(urls: dict[str, str], tok, length: int, i: int) -> dict:
    ids, cp = request(tok, FIRST_AGENT, context_tokens(tok, length, seed=70_000 + i))
    row: dict = {"order": list(pair_order(i))}
    for arm in pair_order(i):
        timed = stream_generate(urls[arm], ids, custom_params=cp, max_new_tokens=1)
        row[arm] = timed.ttft
        row[f"{arm}_prefill_tokens"] = prefilled_tokens(timed.meta)
    row["ratio"] = row["off"] / row["stock"]
    return row


def batch_throughput(url: str, prompts: list[list[int]], out_tokens: int) -> dict:
    """``len(prompts)`` concurrent requests; tokens (prompt + output) per second of wall."""
    def one(ids: list[int]):
        return stream_generate(url, ids, max_new_tokens=out_tokens, ignore_eos=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        done = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    prompt = sum(len(p) for p in prompts)
    output = sum(len(t.output_ids) for t in done)
    return {"wall_s": wall, "prompt_tokens": prompt, "output_tokens": output,
            "tokens_per_s": (prompt + output) / wall, "output_tokens_per_s": output / wall}


def throughput_round(urls: dict[str, str], tok, batch: int, length: int, out_tokens: int, r: int) -> dict:
    prompts = [context_tokens(tok, length, seed=90_000 + 100 * r + j) for j in range(batch)]
    row: dict = {"order": list(pair_order(r))}
    for arm in pair_order(r):
        row[arm] = batch_throughput(urls[arm], prompts, out_tokens)
    row["ratio"] = row["off"]["tokens_per_s"] / row["stock"]["tokens_per_s"]
    return row


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    titles = {"ttft": "TTFT, off / stock (above 1: off slower)",
              "throughput": "throughput, off / stock (below 1: off slower)"}
    for ax, (key, title) in zip(axes, titles.items()):
        rows = results[key]["pairs"]
        ax.plot(range(len(rows)), [r["ratio"] for r in rows], "o", ms=4)
        v = results[key]["verdict"]
        ax.axhspan(1 - TOLERANCE, 1 + TOLERANCE, color="tab:green", alpha=0.15, label="within 2 %")
        ax.axhline(v["median"], color="tab:blue", lw=1, label=f"median {v['median']:.3f}")
        ax.axhspan(*v["ci95"], color="tab:blue", alpha=0.2, label="95 % interval of the median")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("pair (ABBA order)")
        ax.legend(fontsize=8)
    fig.suptitle("kvshare --kvshare-mode off against stock SGLang, both servers up, paired requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stock_vs_off", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=40, help="paired single requests (TTFT)")
    ap.add_argument("--length", type=int, default=1024, help="shared context tokens of a TTFT request")
    ap.add_argument("--rounds", type=int, default=12, help="paired concurrent batches (throughput)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-length", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=32, help="output tokens per batch request")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.pairs < 2 or args.rounds < 2:
        ap.error("--pairs and --rounds need at least 2 (a paired interval needs two ratios)")

    from transformers import AutoTokenizer

    from devtools.models import prepare

    model_path = str(prepare("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(model_path)
    out_dir = Path(args.out_dir)
    command = "python -m benchmarks.stock_vs_off " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict = {"meta": run_meta(command.strip()), "command": command, "machine": machine(),
                     "model": "SmolLM2-135M-Instruct",
                     "server_flags_both": ["--sleep-on-idle"], "ratio": "off / stock, per pair",
                     "ttft_definition": "time to the first streamed chunk of a 1-token greedy generation"}
    t0 = time.monotonic()
    servers = start_both(model_path)
    try:
        urls = {arm: s.url for arm, s in servers.items()}
        for arm in ARMS:  # one warm-up each: the first request of a server pays one-off costs
            ids, cp = request(tok, FIRST_AGENT, context_tokens(tok, args.length, seed=69_999))
            stream_generate(urls[arm], ids, custom_params=cp, max_new_tokens=1)
            batch_throughput(urls[arm], [context_tokens(tok, args.batch_length, seed=89_999)], args.batch_tokens)
        results["idle_cpu_share"] = idle_cpu_share(servers)
        pairs = [ttft_pair(urls, tok, args.length, i) for i in tqdm(range(args.pairs), desc="ttft pairs")]
        rounds = [throughput_round(urls, tok, args.batch, args.batch_length, args.batch_tokens, r)
                  for r in tqdm(range(args.rounds), desc="throughput rounds")]
        results["idle_cpu_share_after"] = idle_cpu_share(servers)
    finally:
        for server in servers.values():
            server.terminate()
        for server in servers.values():
            server.stop()
    results["ttft"] = {"length": args.length, "pairs": pairs,
                       "stock_median_s": statistics.median(r["stock"] for r in pairs),
                       "off_median_s": statistics.median(r["off"] for r in pairs),
                       "verdict": verdict([r["ratio"] for r in pairs])}
    results["throughput"] = {"batch": args.batch, "batch_length": args.batch_length,
                             "output_tokens": args.batch_tokens, "pairs": rounds,
                             "stock_median_tokens_per_s": statistics.median(r["stock"]["tokens_per_s"] for r in rounds),
                             "off_median_tokens_per_s": statistics.median(r["off"]["tokens_per_s"] for r in rounds),
                             "verdict": verdict([r["ratio"] for r in rounds])}
    results["wall_s"] = time.monotonic() - t0
    write_json(out_dir / "stock_vs_off.json", results)
    plot(results, out_dir / "stock_vs_off.png")
    for key in ("ttft", "throughput"):
        v = results[key]["verdict"]
        print(f"{key}: off/stock median {v['median']:.3f}, 95 % interval [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}], "
              f"range {v['min']:.3f}-{v['max']:.3f}, n={v['n']}: {v['verdict']} 2 %")
    print(f"idle CPU share (cores): {results['idle_cpu_share']} -> {results['idle_cpu_share_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
