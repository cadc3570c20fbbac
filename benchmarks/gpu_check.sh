#!/usr/bin/env bash
# The GPU check (docs/benchmarks.md, "GPU check"): every method and station merge for one round on CUDA under
# amp off and bf16, then W1 and M1 against the same work on the CPU, one table. Not a test: run it where a GPU is.
#   bash benchmarks/gpu_check.sh [--amps off,bf16] [--w1-images 2000] [--m1-stations 10] [--repeats 2]
# Works from a checkout without installing feddg (PYTHONPATH=src), with whichever python has torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False with $PY); nothing was run"
  exit 2
fi
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" benchmarks/gpu_check.py "$@"
