"""``python -m benchmarks.research.diagnose_dense_consumers [N] [CONCURRENCY] [P]``: do dense consumers equal ``off``?

Why: in the retrieval frontier's random-mix arm (p=0.5) the consumers whose
document was prefilled densely agreed with ``off`` on only 136 of 146 lookups,
while a second ``off`` server (same history) agreed on all 300. This runs ``off``
and the mix arm on N samples and, for every dense consumer, compares the output,
the servers' own ``cached_tokens`` (where the extend starts) and the first
token's top-5 logprobs from a plain request sent right after the sample.

Finding (``12 1 0.5``, ``benchmarks/results/diagnose_dense_consumers.txt``): with the
first-token requests sent after each sample, all 23 dense consumers gave ``off``'s
output and their first-token logprobs were within 2.1e-5 of ``off``'s (top-2 gaps of
3.9 or more). Without those requests (another cache history), 2 of 23 differed at the
same cached-prefix length, at concurrency 1: float32 rounding from which earlier
request computed the cached rows, not wrong KV.

The first line of the output is ``# meta: {...}`` (``benchmarks.harness.run_meta``:
command, machine, date, git revision), so a saved output records its run.
"""
import json
import sys
import requests
from concurrent.futures import ThreadPoolExecutor
from transformers import AutoTokenizer
from benchmarks import frontier as fr
from devtools.models import prepare
from benchmarks.harness import run_meta
from devtools.server_process import ServerProcess

print("# meta: " + json.dumps(run_meta()), flush=True)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 16
CONC = int(sys.argv[2]) if len(sys.argv) > 2 else 4
P = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
mp = str(prepare("smollm2-135m")); tok = AutoTokenizer.from_pretrained(mp)
spec = fr.task_spec("retrieval", 0); samples = spec.load(N, 0); warm = spec.load(4, 100_000)[:4]
enc = fr._encoder(tok)
def first_token_top(url, ids):
    """The top-5 logprobs of the first generated token, from a plain request (exact KV only)."""
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    top = requests.post(url + "/generate", json=body, timeout=600).json()["meta_info"]["output_top_logprobs"][0]
    return [(float(lp), int(t)) for lp, t, *_ in top]


def run(arm):
    with ServerProcess(model_path=mp, kvshare_args=arm.server_args()) as s:
        r = fr.Runner(s.url, arm, 0, tok.eos_token_id)
        def one(smp):
            rows = r.sample(spec.program(smp, enc, 8), smp.id)
            for row in rows:  # right away, while the prompt is in the tree: its cached rows decide
                row["first_top"] = first_token_top(s.url, fr.build(row["call"], arm, smp.id, 0).input_ids)
            return rows
        for w in warm: one(w)
        with ThreadPoolExecutor(CONC) as pool:
            return list(pool.map(one, samples))
off = run(fr.Arm("off", "off"))
dense = run(fr.Arm(f"mix_p{P:g}", "fullshared", 0, P))
# Tally dense consumers by whether their extend starts where off's does: a different start
# is a different CPU GEMM, so it had to be ruled out before suspecting the KV rows.
tally = {}  # same split? -> [agree, n]
for smp, rows, orows in zip(samples, dense, off):
    for row, orow in zip(rows, orows):
        if row["position"] == 1:
            continue
        if not fr.fm.dense_in_mix(P, 0, smp.id, row["agent"], "doc"):
            continue  # only consumers whose document was prefilled densely
        rep = row["report"]
        hit = row["cached_tokens"]  # the server's own count: the radix match, partial segments included
        same_split = hit == orow["cached_tokens"]
        same = row["output_ids"] == orow["output_ids"]
        a, b = dict((t, lp) for lp, t in row["first_top"]), dict((t, lp) for lp, t in orow["first_top"])
        gap = max(abs(a[t] - b[t]) for t in a.keys() & b.keys())
        print("first token: max |logprob diff| %.2e, top-2 gap in off %.3f, %s" % (
            gap, orow["first_top"][0][0] - orow["first_top"][1][0], "same" if same else "DIFF"), flush=True)
        cell = tally.setdefault(same_split, [0, 0])
        cell[0] += same; cell[1] += 1
        if not same:
            print("DIFF", row["agent"], tok.decode(row["output_ids"]), "| off:", tok.decode(orow["output_ids"]),
                  "| kvshare cached", hit, "off cached", orow["cached_tokens"],
                  [(sg.get("kind"), sg.get("resolved_by"), sg.get("tokens"), sg.get("reason"))
                   for sg in rep.get("segments", [])], flush=True)
for same_split, (agree, n) in sorted(tally.items()):
    print(f"{'same' if same_split else 'different'} prefix split: agree {agree} of {n}", flush=True)
