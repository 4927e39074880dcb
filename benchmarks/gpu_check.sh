#!/usr/bin/env bash
# GPU check for a CUDA machine; about 8-10 minutes in all.
#   1. tests/kernels with the compiled Triton kernels (no interpreter) against the torch references;
#   2. python -m benchmarks.kernels on the GPU (Triton fused path vs unfused torch ops, bandwidth vs a
#      measured copy, ratio to a measured SmolLM2-135M prefill);
#   3. serving: a random-weight model of Llama-3-8B's shape (--load-format dummy), stock against the default
#      kvshare setting on the quick agent-traffic teams (python -m benchmarks.agent_traffic), within 6 minutes.
# Writes everything to $OUT (default ./gpu_check_out): gpu.txt, kernels_tests.{log,xml}, kernels_gpu.json,
# kernels_bench.log, agent_traffic_gpu.{json,png,log}. Run from the repository root:
#   OUT=/some/dir bash benchmarks/gpu_check.sh
# STEPS picks steps (default "kernels bench serving"); DRY_RUN=1 makes step 3 print its plan (agent_traffic_plan.json)
# and start nothing, so a CPU machine can check it.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
[ -x "$REPO/.venv/bin/python" ] && PY="$REPO/.venv/bin/python"
export TRITON_INTERPRET=0 PYTHONDONTWRITEBYTECODE=1
STEPS=${STEPS:-kernels bench serving}
cd "$REPO"

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" 2>&1
} | tee "$OUT/gpu.txt"

# sglang_kvshare.kernels is the top-level kernels/ folder, mapped by pyproject's package-dir. Without an
# install, build a throwaway package view (links) and run from outside the repository so it wins on sys.path.
RUN_DIR=$REPO
if ! "$PY" -c "import sglang_kvshare.kernels.dispatch" 2>/dev/null; then
  SHIM=$(mktemp -d)
  mkdir -p "$SHIM/sglang_kvshare"
  for f in "$REPO"/sglang_kvshare/*; do ln -s "$f" "$SHIM/sglang_kvshare/"; done
  ln -s "$REPO/kernels" "$SHIM/sglang_kvshare/kernels"
  ln -s "$REPO/benchmarks" "$SHIM/benchmarks"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  RUN_DIR=$SHIM
  echo "using package view $SHIM" | tee -a "$OUT/gpu.txt"
fi
cd "$RUN_DIR"

# 1. Kernel tests, compiled (the conftest only turns the interpreter on when CUDA is absent).
if [[ " $STEPS " == *" kernels "* ]]; then
  timeout 110 "$PY" -m pytest "$REPO/tests/kernels" -q -x -p no:cacheprovider --rootdir "$REPO" \
    --junitxml="$OUT/kernels_tests.xml" 2>&1 | tee "$OUT/kernels_tests.log"
  echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/kernels_tests.log"
fi

# 2. Benchmark. Use the prepared model if it is here, else its architecture with random weights
#    (prefill time depends on shapes only); never reach for the network.
EXTRA=()
MODEL_DIR=$("$PY" -m devtools.models path smollm2-135m 2>/dev/null | tail -1)
[ -n "$MODEL_DIR" ] && [ -f "$MODEL_DIR/config.json" ] || EXTRA+=(--random-weights)
if [[ " $STEPS " == *" bench "* ]]; then
  timeout 150 "$PY" -m benchmarks.kernels --lengths 1024 4096 --repeats 20 --prefill-repeats 5 \
    --out "$OUT/kernels_gpu.json" "${EXTRA[@]}" 2>&1 | tee "$OUT/kernels_bench.log"
  echo "benchmark exit: ${PIPESTATUS[0]}" | tee -a "$OUT/kernels_bench.log"
fi

# 3. Serving: the same flags for both arms; one pool large enough for the teams, two rates. The tokenizer (and
#    chat template) comes from TOKENIZER (default: the prepared SmolLM2 folder; a folder carried along works).
if [[ " $STEPS " == *" serving "* ]]; then
  SERVE=(-m benchmarks.agent_traffic --quick --arms stock default --pools large --rates 20 120 --device cuda
         --model "${TOKENIZER:-smollm2-135m}" --write-model "$OUT/llama8b-dummy" --server-args "--load-format dummy"
         --out "$OUT/agent_traffic_gpu.json")
  if [ -n "${DRY_RUN:-}" ]; then
    "$PY" "${SERVE[@]}" --dry-run > "$OUT/agent_traffic_plan.json"
  else
    timeout 360 "$PY" "${SERVE[@]}" 2>&1 | tee "$OUT/agent_traffic_gpu.log"
    echo "serving exit: ${PIPESTATUS[0]}" | tee -a "$OUT/agent_traffic_gpu.log"
  fi
fi
