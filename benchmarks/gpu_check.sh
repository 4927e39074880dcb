#!/usr/bin/env bash
# GPU check of the kernels, for a CUDA machine; about 2-3 minutes in all.
#   1. tests/kernels with the compiled Triton kernels (no interpreter) against the torch references;
#   2. python -m benchmarks.kernels on the GPU (Triton fused path vs unfused torch ops, bandwidth vs a
#      measured copy, ratio to a measured SmolLM2-135M prefill).
# Writes everything to $OUT (default ./gpu_check_out): gpu.txt, kernels_tests.{log,xml},
# kernels_gpu.json, kernels_bench.log. Run from the repository root:  OUT=/some/dir bash benchmarks/gpu_check.sh
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
[ -x "$REPO/.venv/bin/python" ] && PY="$REPO/.venv/bin/python"
export TRITON_INTERPRET=0 PYTHONDONTWRITEBYTECODE=1
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
timeout 110 "$PY" -m pytest "$REPO/tests/kernels" -q -x -p no:cacheprovider --rootdir "$REPO" \
  --junitxml="$OUT/kernels_tests.xml" 2>&1 | tee "$OUT/kernels_tests.log"
echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/kernels_tests.log"

# 2. Benchmark. Use the prepared model if it is here, else its architecture with random weights
#    (prefill time depends on shapes only); never reach for the network.
EXTRA=()
MODEL_DIR=$("$PY" -m devtools.models path smollm2-135m 2>/dev/null | tail -1)
[ -n "$MODEL_DIR" ] && [ -f "$MODEL_DIR/config.json" ] || EXTRA+=(--random-weights)
timeout 150 "$PY" -m benchmarks.kernels --lengths 1024 4096 --repeats 20 --prefill-repeats 5 \
  --out "$OUT/kernels_gpu.json" "${EXTRA[@]}" 2>&1 | tee "$OUT/kernels_bench.log"
echo "benchmark exit: ${PIPESTATUS[0]}" | tee -a "$OUT/kernels_bench.log"
