#!/usr/bin/env bash
# CUDA check of the native kernels: build, CUDA tests, kernel benchmark (< 8 min).
#
#   bash benchmarks/device_check.sh --prepare     # here, where vLLM is installed: copies
#                                                 # vLLM's Triton kernels to benchmarks/_vllm_triton/
#   bash benchmarks/device_check.sh [OUTDIR]      # on the CUDA machine (OUTDIR defaults to $OUT)
#
# The CUDA machine has torch (with CUDA) and Triton but no vLLM: run --prepare
# first and carry benchmarks/_vllm_triton (git-ignored) along. Without it the
# benchmark still runs, minus the vLLM Triton comparison.
# Writes to OUTDIR: build.log, tests.log, tests.xml, bench.log, kernels_cuda.json, summary.txt.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python}"

if [ "${1:-}" = "--prepare" ]; then
  exec "$PYTHON" benchmarks/bench_kernels.py --extract-vllm-triton benchmarks/_vllm_triton
fi

OUTDIR="${1:-${OUT:-}}"
[ -n "$OUTDIR" ] || { echo "usage: $0 OUTDIR (or set \$OUT)" >&2; exit 2; }
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
status=0
step() { echo "== $1 ($(date -u +%H:%M:%S))" | tee -a "$OUTDIR/summary.txt"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$OUTDIR/summary.txt"
"$PYTHON" - <<'PY' 2>&1 | tee -a "$OUTDIR/summary.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
assert torch.cuda.is_available(), "no CUDA device visible to torch"
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "no CUDA: nothing to check" | tee -a "$OUTDIR/summary.txt"; exit 1; }

step "build (in place, this GPU's arch only)"
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST="$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
  export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
rm -f vllm_dflash2/_C*.so
# build_ext --inplace needs neither pip nor vLLM; the tests import from the repo root.
timeout 300 "$PYTHON" setup.py build_ext --inplace >"$OUTDIR/build.log" 2>&1
rc=$?
tail -3 "$OUTDIR/build.log" | tee -a "$OUTDIR/summary.txt"
if [ $rc -ne 0 ]; then echo "build failed (rc=$rc)" | tee -a "$OUTDIR/summary.txt"; exit 1; fi
"$PYTHON" -c 'from vllm_dflash2 import ops; print("native devices:", sorted(ops.NATIVE_DEVICES)); assert "cuda" in ops.NATIVE_DEVICES' \
  2>&1 | tee -a "$OUTDIR/summary.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "CUDA kernels not registered" | tee -a "$OUTDIR/summary.txt"; exit 1; }

step "kernel tests (CPU and CUDA)"
# --confcutdir keeps tests/conftest.py (engine fixtures) out: this machine has no vLLM.
timeout 240 "$PYTHON" -m pytest -q tests/kernels --confcutdir=tests/kernels -p no:cacheprovider \
  --junitxml="$OUTDIR/tests.xml" >"$OUTDIR/tests.log" 2>&1
rc=$?
tail -3 "$OUTDIR/tests.log" | tee -a "$OUTDIR/summary.txt"
[ $rc -eq 0 ] || { echo "tests failed (rc=$rc)" | tee -a "$OUTDIR/summary.txt"; status=1; }

step "benchmark"
timeout 180 "$PYTHON" benchmarks/bench_kernels.py --device cuda --budget 0.05 --runs 30 \
  --out "$OUTDIR/kernels_cuda.json" >"$OUTDIR/bench.log" 2>&1
rc=$?
tail -3 "$OUTDIR/bench.log" | tee -a "$OUTDIR/summary.txt"
[ $rc -eq 0 ] || { echo "benchmark failed (rc=$rc)" | tee -a "$OUTDIR/summary.txt"; status=1; }

step "done (status $status)"
exit $status
