// float32 linear layer on AVX2 + FMA over a weight packed once at load time
// (bfloat16 weights: packed_linear_bf16.cpp, on AVX512-BF16).
//
// Why: vLLM's CPU linear (oneDNN, prepacked) takes 1.29x this kernel's time at
// one row over the target's weights, and the 8 rows of a K = 7 verification cost
// it ~1.35x its own one-row time (benchmarks/bench_cpu_gemm.py).
// Decode-sized GEMMs are weight-streaming problems: this kernel reads each weight
// from memory once per call (later 4-row blocks find its K chunk in L2), from a
// layout made for it, with the accumulators of 4 rows x 24 columns in registers.
//
// Packed layout: [N / 8][K][8], i.e. 8 output columns at a time, K-major, so a
// micro-kernel step loads one 8-float row per column block and broadcasts one
// input value per row. Reference twin: torch.nn.functional.linear on the
// unpacked weight (vllm_dflash2/ops/reference.py::packed_linear_ref).
#include <ATen/ATen.h>

#include "group_parallel.h"
#include "linear_io.h"
#include "packed_linear_bf16.h"
#include <torch/library.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>

namespace dflash2 {
namespace {

constexpr int64_t kCols = 8;     // floats per AVX2 register
constexpr int64_t kMaxRows = 4;  // rows per micro-kernel
constexpr int64_t kMaxVecs = 3;  // column blocks per micro-kernel: 4 x 3 accumulators
// K is walked in chunks so that one group's weight slice (24 columns x 512 x 4 B
// = 48 KB) stays in L2 while every row block of the batch reuses it.
constexpr int64_t kChunk = 512;

// One micro-kernel instance (see micro below): x, ldx, w, block_stride, kc, y, ldy, bias, first.
using Micro = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                       const float*, bool);

#if defined(__x86_64__)
bool cpu_has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// y[r, 0 : 8 NV] (+)= x[r, k0 : k0 + kc] . W-blocks, for r < MR. `w` points at
// row k0 of the first column block; the next block is `block_stride` floats on.
// first: start from the bias (or 0) instead of the partial sums already in y.
template <int MR, int NV>
__attribute__((target("avx2,fma"))) void micro(const float* x, int64_t ldx, const float* w,
                                                int64_t block_stride, int64_t kc, float* y,
                                                int64_t ldy, const float* bias, bool first) {
  __m256 acc[MR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) {
      if (!first) {
        acc[r][v] = _mm256_loadu_ps(y + r * ldy + v * kCols);
      } else if (bias != nullptr) {
        acc[r][v] = _mm256_loadu_ps(bias + v * kCols);
      } else {
        acc[r][v] = _mm256_setzero_ps();
      }
    }
  }
  // Fully unrolled over rows and blocks, or GCC keeps the accumulators in memory.
  for (int64_t k = 0; k < kc; ++k) {
    __m256 wv[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) wv[v] = _mm256_loadu_ps(w + v * block_stride + k * kCols);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(b, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(y + r * ldy + v * kCols, acc[r][v]);
  }
}

template <int MR>
Micro pick_vecs(int64_t nv) {
  switch (nv) {
    case 1: return &micro<MR, 1>;
    case 2: return &micro<MR, 2>;
    default: return &micro<MR, 3>;
  }
}

Micro pick(int64_t rows, int64_t nv) {
  switch (rows) {
    case 1: return pick_vecs<1>(nv);
    case 2: return pick_vecs<2>(nv);
    case 3: return pick_vecs<3>(nv);
    default: return pick_vecs<4>(nv);
  }
}
#else
// Other architectures: the op exists but refuses to run (Python never routes to it there).
bool cpu_has_avx2_fma() { return false; }
Micro pick(int64_t, int64_t) { return nullptr; }
#endif

at::Tensor pack_linear_weight_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: weight must be [N, K], got ",
              weight.sizes());
  if (weight.scalar_type() == at::kBFloat16) return pack_linear_weight_bf16(weight);
  TORCH_CHECK(weight.scalar_type() == at::kFloat,
              "pack_linear_weight: weight must be float32 or bfloat16, got ",
              weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kCols == 0, "pack_linear_weight: weight.size(0)=", n,
              " must be a multiple of ", kCols);
  return weight.reshape({n / kCols, kCols, k}).transpose(1, 2).contiguous();
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias) {
  if (packed.scalar_type() == at::kBFloat16) return packed_linear_bf16(x, packed, bias);
  TORCH_CHECK(cpu_has_avx2_fma(), "packed_linear: needs an x86-64 CPU with AVX2 and FMA");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "packed_linear: packed must come from pack_linear_weight, got ",
              packed.sizes(), " ", packed.scalar_type());
  const int64_t n = packed.size(0) * kCols, k = packed.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_linear: x must be float32, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "packed_linear: x.size(-1) must be ", k,
              ", got ", x.sizes());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat,
                "packed_linear: bias must be float32 [", n, "], got ", bias->sizes(), " ",
                bias->scalar_type());
  }
  const LinearIO io = linear_io(x, n, k, bias);
  if (io.done) return io.out();
  const int64_t m = io.m;
  const float* b = io.b;
  const float* xp = io.x2.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = io.y.data_ptr<float>();
  const int64_t blocks = n / kCols;
  const int64_t groups = (blocks + kMaxVecs - 1) / kMaxVecs;
  const int64_t block_stride = k * kCols;
  auto run_group = [&](int64_t g) {
    const int64_t blk = g * kMaxVecs;
    const int64_t nv = std::min(kMaxVecs, blocks - blk);
    const float* wg = wp + blk * block_stride;
    const float* bg = b == nullptr ? nullptr : b + blk * kCols;
    for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
      const int64_t kc = std::min(kChunk, k - k0);
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, m - r0);
        pick(rows, nv)(xp + r0 * k + k0, k, wg + k0 * kCols, block_stride, kc,
                       yp + r0 * n + blk * kCols, n, bg, k0 == 0);
      }
    }
  };
  for_each_group(groups, m * k * n, run_group);
  return io.out();
}

}  // namespace
}  // namespace dflash2

TORCH_LIBRARY_IMPL(vllm_dflash2, CPU, m) {
  m.impl("pack_linear_weight", &dflash2::pack_linear_weight_cpu);
  m.impl("packed_linear", &dflash2::packed_linear_cpu);
}
