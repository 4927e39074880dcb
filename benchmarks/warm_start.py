"""``python -m benchmarks.warm_start``: the first requests of a new kvcmas server, cold or loaded from saved pools.

The question a new deployment asks: agent B reads documents agent A has just
read, behind its own system prompt; how are B's first requests served, how fast,
and how far from a dense prefill, (a) on a fresh server, whose pools are empty,
and (b) on a fresh server launched with ``--kvshare-pool-file`` from an earlier
run of the same agents (other documents)?

Three servers, one at a time, each kvcmas with the defaults (edge anchors 8):

1. ``teach``: A then B read ``--teach`` documents; once learned, ``POST
   /kvshare/save`` writes the pools. Not scored.
2. ``cold``: a new server without the file; A then B read ``--eval`` new documents.
3. ``warm``: a new server with the file; the same ``--eval`` documents.
4. ``fullshared``: a new fullshared server (alignment only, no pools); the same documents.

Per B request: TTFT (streamed, 1 token), how its document was served
(``resolved_by`` / ``gate_fallback``), and fidelity: B's own greedy answer
(``--max-tokens``, annotated again: the estimate in the tree serves it) is
teacher-forced through a plain request (exact KV only) and compared position by
position (top-1 agreement, top-5 KL; ``frontier_metrics``). A's TTFT (a dense
prefill of the same document behind A's prompt) is the dense reference.
Documents are ``benchmarks.texts.context_tokens`` of ``--length`` tokens.
Writes ``benchmarks/results/warm_start.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks import frontier_metrics as fm
from benchmarks.chain_ttft import SUFFIX, summary, system
from benchmarks.harness import (RESULTS, machine, post_generate, run_meta, stream_generate, wait_learning,
                                write_json)
from benchmarks.texts import context_tokens
from devtools.server_process import ServerProcess
from sglang_kvshare.frontend.builder import build_request, private_part, shared_part

A, B = "planner", "solver"
TOP_K = 5
TEACH_SEED, EVAL_SEED = 70_000, 80_000  # contents no other benchmark draws
# (name, mode, launched with the saved pool file): the same documents on each, one fresh server at a time.
ARMS = (("cold", "kvcmas", False), ("warm", "kvcmas", True), ("fullshared", "fullshared", False))


def request(tok, agent: str, doc: list[int], continuation: tuple[int, ...] = ()):
    parts = [private_part(system(agent)), shared_part(doc, "context"), private_part(SUFFIX)]
    if continuation:
        parts.append(private_part(list(continuation)))
    return build_request(tok, agent, parts)


def fidelity(url: str, tok, doc: list[int], max_tokens: int) -> dict:
    """B's own answer (annotated: served from the estimate), teacher-forced through a plain exact request."""
    ids, cp = request(tok, B, doc)
    out = post_generate(url, {"input_ids": ids, "return_logprob": True, "top_logprobs_num": TOP_K,
                      "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "custom_params": cp}})
    meta = out["meta_info"]
    answer = [int(e[1]) for e in meta["output_token_logprobs"]]
    served = [fm.top_entries(e) for e in meta["output_top_logprobs"]]
    # NOTE: plain (no annotation): SGLang's exact prefix cache only, never an estimate.
    ref = post_generate(url, {"input_ids": ids + answer, "return_logprob": True, "top_logprobs_num": TOP_K,
                      "logprob_start_len": len(ids) - 1, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    # Entry i predicts input token len(ids) - 1 + i: entry 0 the prompt's last token, entries 1.. the answer.
    exact = [fm.top_entries(e) for e in ref["meta_info"]["input_top_logprobs"]][1:1 + len(answer)]
    return fm.compare_positions(exact, served)


def read_by_a_then_b(url: str, tok, doc: list[int], max_tokens: int = 0) -> dict:
    """A reads ``doc`` (dense), then B; B's TTFT, report and (``max_tokens`` > 0) fidelity, and A's TTFT."""
    ids, cp = request(tok, A, doc)
    a = stream_generate(url, ids, custom_params=cp, max_new_tokens=1)
    ids, cp = request(tok, B, doc)
    b = stream_generate(url, ids, custom_params=cp, max_new_tokens=1)
    seg = (b.report.get("segments") or [{}, {}])[1]
    row = {"a_ttft_s": a.ttft, "b_ttft_s": b.ttft, "resolved_by": seg.get("resolved_by"),
           "gate_fallback": seg.get("gate_fallback") or seg.get("reason"),
           "tokens_corrected": int(b.report.get("tokens_corrected") or 0),
           "tokens_aligned": int(b.report.get("tokens_aligned") or 0), "shared_tokens": len(doc)}
    if max_tokens:
        row.update(fidelity(url, tok, doc, max_tokens))
    return row


def serve(model_path: str, pool_file: Path | None, mode: str = "kvcmas") -> ServerProcess:
    args = ["--kvshare-mode", mode, "--kvshare-verify-rate", "0", "--kvshare-admin-open", "true"]
    if pool_file is not None:
        args += ["--kvshare-pool-file", str(pool_file)]
    return ServerProcess(model_path=model_path, kvshare_args=args)


def warm_prompts(url: str, tok) -> None:
    """Each agent's system prompt alone, so every later request finds it in the tree (as a running team would)."""
    for agent in (A, B):
        ids, cp = build_request(tok, agent, [private_part(system(agent))])
        stream_generate(url, ids, custom_params=cp, max_new_tokens=1)


def summarize(rows: list[dict]) -> dict:
    b, a = [r["b_ttft_s"] for r in rows], [r["a_ttft_s"] for r in rows]
    shared = sum(r["shared_tokens"] for r in rows)
    served = {}
    for r in rows:
        key = f"{r['resolved_by']} ({r['gate_fallback']})" if r["gate_fallback"] else str(r["resolved_by"])
        served[key] = served.get(key, 0) + 1
    return {"b_ttft_s": summary(b), "a_ttft_s": summary(a),
            "b_over_a_ttft": statistics.median(x / y for x, y in zip(b, a)),
            "reuse": sum(r["tokens_corrected"] + r["tokens_aligned"] for r in rows) / shared,
            "corrected_share": sum(r["tokens_corrected"] for r in rows) / shared, "served_as": served,
            **fm.pooled(rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teach", type=int, default=24, help="documents of the run whose pools are saved (the edge "
                    "needs 8 learned; while it learns about every other new content is prefilled densely)")
    ap.add_argument("--eval", type=int, default=10, help="new documents read on each arm's server")
    ap.add_argument("--length", type=int, default=1024, help="tokens per document")
    ap.add_argument("--max-tokens", type=int, default=32, help="answer tokens scored per B request")
    ap.add_argument("--out", type=Path, default=RESULTS / "warm_start.json")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from devtools.models import prepare

    model_path = str(prepare("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(model_path)
    teach_docs = [context_tokens(tok, args.length, TEACH_SEED + i) for i in range(args.teach)]
    eval_docs = [context_tokens(tok, args.length, EVAL_SEED + i) for i in range(args.eval)]
    quiet = args.no_progress
    result = {"meta": run_meta(), "machine": machine(), "agents": [A, B], "length": args.length,
              "teach": args.teach, "eval": args.eval, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        pool_file = Path(tmp) / "pools.pt"
        with serve(model_path, pool_file) as server:
            warm_prompts(server.url, tok)
            for doc in tqdm(teach_docs, desc="teach", file=sys.stderr, disable=quiet):
                read_by_a_then_b(server.url, tok, doc)
            waited = wait_learning(server.url, timeout=600)
            saved = requests.post(server.url + "/kvshare/save", timeout=300)
            saved.raise_for_status()
            pools = requests.get(server.url + "/kvshare/pools", timeout=60).json()["pools"]
            result["saved"] = {**saved.json()["saved"], "learn_wait_s": waited,
                               "anchors_per_slot": {s: len(p) for s, p in pools.items()}}
            del result["saved"]["path"]  # a temporary directory
        for arm, mode, file in ARMS:
            with serve(model_path, pool_file if file else None, mode) as server:
                loaded = requests.get(server.url + "/kvshare/stats", timeout=60).json()["counters"]
                warm_prompts(server.url, tok)
                rows = [read_by_a_then_b(server.url, tok, doc, args.max_tokens)
                        for doc in tqdm(eval_docs, desc=arm, file=sys.stderr, disable=quiet)]
                result[arm] = {"anchors_loaded": int(loaded.get("pool_file_anchors_loaded", 0)), "requests": rows,
                               **summarize(rows)}
    write_json(args.out, result)
    for arm, _, _ in ARMS:
        r = result[arm]
        print(f"{arm}: B TTFT {r['b_ttft_s']['median']:.3f} s ({r['b_over_a_ttft']:.2f}x A's dense), reuse "
              f"{r['reuse']:.2f}, corrected {r['corrected_share']:.2f}, served {r['served_as']}, top-1 {r['top1']}, "
              f"KL {r['kl']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
