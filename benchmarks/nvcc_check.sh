#!/usr/bin/env bash
# Compile-only check of every CUDA source with the local nvcc, for sm_80 and sm_90.
#
#   bash benchmarks/nvcc_check.sh        (NVCC=/path/to/nvcc to override)
#
# 1. Each torch-free header under csrc/include/dflash2 compiles on its own.
# 2. csrc/cuda/launchers.cu (every kernel, every dtype instantiation; no torch)
#    compiles for each arch.
# 3. csrc/cuda/torch_bindings.cu needs torch's CUDA headers. A CPU-only torch
#    ships them except one CMake-generated file (c10/cuda/impl/cuda_cmake_macros.h);
#    we then supply a one-line stub of it so the bindings are still type-checked.
#    Without torch at all, step 3 is skipped with a message.
# Exits non-zero on any compile error. Takes about a minute.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${NVCC:-nvcc}"
PYTHON="${PYTHON:-python}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

ARCHS=(80 90)
GENCODE=()
for a in "${ARCHS[@]}"; do GENCODE+=(-gencode "arch=compute_${a},code=sm_${a}"); done
# The flags torch's CUDAExtension adds: kernels must not rely on implicit half conversions.
TORCH_LIKE=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
            -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)

command -v "$NVCC" >/dev/null || { echo "nvcc_check: '$NVCC' not found" >&2; exit 1; }
"$NVCC" --version | tail -1

echo "== torch-free headers, standalone"
for h in "$ROOT"/csrc/include/dflash2/*.h "$ROOT"/csrc/include/dflash2/*.cuh; do
  name="$(basename "$h")"
  printf '#include "dflash2/%s"\n' "$name" > "$TMP/hdr_${name}.cu"
  "$NVCC" -std=c++17 "${TORCH_LIKE[@]}" -I"$ROOT/csrc/include" -arch=sm_80 \
    -c "$TMP/hdr_${name}.cu" -o "$TMP/hdr_${name}.o"
  echo "  ok  $name"
done

echo "== kernels (csrc/cuda/launchers.cu)"
for a in "${ARCHS[@]}"; do
  "$NVCC" -std=c++17 -O3 "${TORCH_LIKE[@]}" -gencode "arch=compute_${a},code=sm_${a}" \
    -c "$ROOT/csrc/cuda/launchers.cu" -o "$TMP/launchers_sm${a}.o"
  echo "  ok  sm_${a}"
done

echo "== torch bindings (csrc/cuda/torch_bindings.cu)"
if ! TORCH_INC="$("$PYTHON" -c 'import torch.utils.cpp_extension as c; print(" ".join(c.include_paths()))' 2>/dev/null)"; then
  echo "  skipped: no importable torch for its headers"
  exit 0
fi
PY_INC="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
INCS=()
for d in $TORCH_INC; do INCS+=(-I"$d"); done
first_inc="${TORCH_INC%% *}"
if [ ! -f "$first_inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  echo "  (CPU torch: stubbing c10/cuda/impl/cuda_cmake_macros.h)"
  mkdir -p "$TMP/stub/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$TMP/stub/c10/cuda/impl/cuda_cmake_macros.h"
  INCS=(-I"$TMP/stub" "${INCS[@]}")
fi
# No kernels live in this file, so one pass covers both archs.
# --expt-relaxed-constexpr: torch's CUDAExtension passes it too (c10 half types need it).
"$NVCC" -std=c++20 -O1 "${TORCH_LIKE[@]}" "${GENCODE[@]}" --expt-relaxed-constexpr "${INCS[@]}" -I"$PY_INC" -I"$ROOT/csrc" \
  -c "$ROOT/csrc/cuda/torch_bindings.cu" -o "$TMP/torch_bindings.o"
echo "  ok  sm_$(IFS=,; echo "${ARCHS[*]}")"
echo "nvcc_check: all CUDA sources compiled"
