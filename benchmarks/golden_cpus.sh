#!/usr/bin/env bash
# The golden cases (tests/support/golden.py) under emulated CPUs: qemu-x86_64 -cpu MODEL presents another processor
# (vendor, ISA, cache sizes) to every library's kernel dispatch, so a run there computes as that CPU would.
#   bash benchmarks/golden_cpus.sh [MODEL ...]        default: EPYC-Rome Haswell (qemu-x86_64 -cpu help lists more)
#   KERNELS=native bash benchmarks/golden_cpus.sh ...  the CPU's own kernels instead of reproducibility: portable's
#   ONLY="toy/fedavg toy/hfedf" bash benchmarks/golden_cpus.sh ...  those cases only (about 75 s a model for five toy cases)
# qemu computes every IEEE operation exactly and the approximate rsqrtps/rcpps exactly too, where real CPUs differ
# (MKL's vector math, behind torch.sqrt and the default Adam, builds on them: feddg takes neither, feddg/numerics.py);
# a case that agrees natively and here ran through no such instruction (docs/reliability.md); where one does not,
# benchmarks/op_trace.py names the first op that parts.
# Prints, per model, whether every case matches tests/fixtures/golden_*.json bit for bit. Needs qemu-user
# (apt-get install qemu-user; 2026-11-27: 10.0 from bookworm-backports); TCG emulation is ~30-60x slower than
# native: about 24 min a model (19 cases), one core each.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
command -v qemu-x86_64 >/dev/null || { echo "golden_cpus: qemu-x86_64 not found (apt-get install qemu-user)"; exit 2; }
KERNELS=${KERNELS:-portable}
out=$(mktemp -d)
for model in "${@:-EPYC-Rome Haswell}"; do
  for m in $model; do
    if [ "$KERNELS" = portable ]; then
      # set here: a re-execution inside the emulator would leave it (the binary runs natively after execve)
      eval "$("$PY" -m feddg env portable)"
    fi
    start=$(date +%s)
    qemu-x86_64 -cpu "$m" "$PY" tests/support/golden.py --kernels "$KERNELS" ${ONLY:+--only $ONLY} >"$out/$m.json" 2>"$out/$m.err" \
      || { echo "$m: failed (log: $out/$m.err)"; continue; }
    "$PY" - "$out/$m.json" "$m" "$(( $(date +%s) - start ))" <<'PYEOF'
import json, sys
got, model, secs = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
toy = json.load(open("tests/fixtures/golden_toy.json"))
digits = json.load(open("tests/fixtures/golden_digits.json"))["cases"]
bad = [f"toy/{k}" for k in got["toy"] if got["toy"][k] != toy[k]]
bad += [f"digits/{k}" for k in got["digits"] if got["digits"][k] != digits[k]]
n = len(got["toy"]) + len(got["digits"])
print(f"{model}: {n - len(bad)} of {n} cases match the recorded bits ({secs} s)" + (f"; differ: {bad}" if bad else ""))
PYEOF
  done
done
