"""``python -m sglang_kvshare.demo``: the main job in one command.

Starts a real SGLang server with kvshare on (the shipped SmolLM2 model on this
machine's CPU unless ``--model-path`` says otherwise), sends a pair of
requests that share a long prefix, and prints what the server reports
(cached tokens, time to first token), then stops the server.
"""

from __future__ import annotations

import argparse
import json
import time

from sglang_kvshare.server_process import ServerProcess

SHARED = (
    "<|im_start|>system\nYou are a careful analyst. Read the report and answer in one sentence.<|im_end|>\n"
    "<|im_start|>user\nReport: "
    + " ".join(f"In quarter {i} the mill produced {100 + 7 * i} tonnes of flour and hired {3 + i % 4} workers."
               for i in range(1, 25))
)
QUESTIONS = ("Which quarter produced the most flour?", "How many workers were hired in quarter 3?")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_kvshare.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="local model folder (default: the shipped SmolLM2-135M)")
    parser.add_argument("--kvshare-mode", default="kvcmas", choices=("off", "fullshared", "kvcmas"))
    parser.add_argument("--out", default=None, help="also write the measurements as JSON here")
    args = parser.parse_args(argv)
    if args.model_path is None:
        from sglang_kvshare.models import prepare

        args.model_path = str(prepare("smollm2-135m"))

    results = []
    print(f"starting a server with --kvshare-mode {args.kvshare_mode} ...", flush=True)
    with ServerProcess(model_path=args.model_path, kvshare_args=["--kvshare-mode", args.kvshare_mode]) as server:
        backend = server.server_info().get("radix_cache_backend")
        print(f"server up at {server.url}, radix cache backend: {backend}")
        for question in QUESTIONS:
            prompt = f"{SHARED}\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n"
            t0 = time.perf_counter()
            out = server.generate(prompt, max_new_tokens=1)
            ttft = time.perf_counter() - t0
            meta = out["meta_info"]
            row = {"question": question, "prompt_tokens": meta["prompt_tokens"],
                   "cached_tokens": meta["cached_tokens"], "ttft_s": round(ttft, 3)}
            results.append(row)
            print(f"  prompt {row['prompt_tokens']} tokens, cached {row['cached_tokens']}, "
                  f"TTFT {row['ttft_s']} s  <- {question}")
    print(json.dumps({"radix_cache_backend": backend, "requests": results}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"radix_cache_backend": backend, "requests": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
