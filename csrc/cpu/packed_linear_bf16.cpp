// bfloat16 linear layer on AVX512-BF16 over a weight packed once at load time.
//
// Why: at decode sizes a linear layer is a weight-streaming problem, and vLLM's CPU
// GEMM for bf16 (oneDNN, prepacked) streams the target's weights in about the same time
// for 1 and 4 rows but takes 1.25-1.4x that for the 8 rows of a K = 7 verification
// (2 cores, AVX-512 bf16, weights not in cache: benchmarks/bench_cpu_gemm.py). That
// extra is paid by speculation alone. This kernel reads each weight once per call for
// up to 8 rows, with the accumulators of 8 rows x 48 columns in registers, so its cost
// is that of the stream until the multiply-adds catch up. Measured there: 0.92x oneDNN's
// time at one row, the same from 4 rows on; at 8 rows 1.37x its own one-row time, so on
// 2 cores the multiply-adds, not oneDNN, set a verification's extra cost. Opt-in
// (VLLM_DFLASH2_CPU_GEMM=1), as it speeds up plain decoding, not speculation.
//
// Packed layout: [N / 16][K / 2][16][2] bf16 (K even), i.e. 16 output columns at a
// time, pairs of K inside: one 64-byte load is the operand of VDPBF16PS, which adds
// x[2p] w[n, 2p] + x[2p + 1] w[n, 2p + 1] into a float32 lane per column. Each output
// is summed in float32 in the same order whatever the number of rows, so a row's
// result does not depend on the batch it came in (a verification row equals the plain
// decode row). Rounded to bf16 once, at the end (round to nearest even, as torch).
// Reference twin: torch.nn.functional.linear in float32 on the unpacked weight,
// rounded to bf16 (vllm_dflash2/ops/reference.py::packed_linear_ref).
#include "group_parallel.h"
#include "linear_io.h"
#include "packed_linear_bf16.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace dflash2 {
namespace {

constexpr int64_t kCols = 16;    // float32 lanes of a 512-bit register
constexpr int64_t kMaxRows = 8;  // rows per micro-kernel
constexpr int64_t kMaxVecs = 3;  // column blocks per micro-kernel: 8 x 3 accumulators

// One micro-kernel: x, ldx, w, block_stride, pairs, y, ldy, bias.
using MicroBf16 = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t,
                           uint16_t*, int64_t, const float*);

#if defined(__x86_64__)
bool cpu_has_avx512_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
}

// y[r, 0 : 16 NV] = bias + x[r, :] . W-blocks, for r < MR, over `pairs` pairs of K.
// `w` points at the first column block; the next block is `block_stride` bf16 on.
template <int MR, int NV>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void micro_bf16(
    const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t block_stride, int64_t pairs,
    uint16_t* y, int64_t ldy, const float* bias) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  // Fully unrolled over rows and blocks, or GCC keeps the accumulators in memory.
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wv[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) {
      wv[v] = _mm512_loadu_si512(reinterpret_cast<const void*>(w + v * block_stride + p * 32));
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
      const __m512i b = _mm512_set1_epi32(pair);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) {
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)b, (__m512bh)wv[v]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) {
      __m512 out = acc[r][v];
      if (bias != nullptr) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + v * kCols));
      const __m256bh h = _mm512_cvtneps_pbh(out);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + v * kCols), (__m256i)h);
    }
  }
}

template <int MR>
MicroBf16 pick_vecs(int64_t nv) {
  switch (nv) {
    case 1: return &micro_bf16<MR, 1>;
    case 2: return &micro_bf16<MR, 2>;
    default: return &micro_bf16<MR, 3>;
  }
}

MicroBf16 pick(int64_t rows, int64_t nv) {
  switch (rows) {
    case 1: return pick_vecs<1>(nv);
    case 2: return pick_vecs<2>(nv);
    case 3: return pick_vecs<3>(nv);
    case 4: return pick_vecs<4>(nv);
    case 5: return pick_vecs<5>(nv);
    case 6: return pick_vecs<6>(nv);
    case 7: return pick_vecs<7>(nv);
    default: return pick_vecs<8>(nv);
  }
}
#else
bool cpu_has_avx512_bf16() { return false; }
MicroBf16 pick(int64_t, int64_t) { return nullptr; }
#endif

}  // namespace

bool packed_linear_bf16_supported() { return cpu_has_avx512_bf16(); }

at::Tensor pack_linear_weight_bf16(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kCols == 0, "pack_linear_weight: a bfloat16 weight.size(0)=", n,
              " must be a multiple of ", kCols);
  TORCH_CHECK(k % 2 == 0, "pack_linear_weight: a bfloat16 weight.size(1)=", k,
              " must be even");
  // [N, K] -> [N / 16, 16, K / 2, 2] -> [N / 16, K / 2, 16, 2]
  return weight.reshape({n / kCols, kCols, k / 2, 2})
      .permute({0, 2, 1, 3})
      .contiguous()
      .view({n / kCols, k / 2, 2 * kCols});
}

at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(cpu_has_avx512_bf16(),
              "packed_linear: a bfloat16 weight needs an x86-64 CPU with AVX512-BF16");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * kCols && packed.is_contiguous(),
              "packed_linear: a bfloat16 packed weight must come from pack_linear_weight, got ",
              packed.sizes());
  const int64_t n = packed.size(0) * kCols, pairs = packed.size(1), k = 2 * pairs;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16,
              "packed_linear: x must be bfloat16 for a bfloat16 weight, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "packed_linear: x.size(-1) must be ", k,
              ", got ", x.sizes());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "packed_linear: bias must have ", n, " values, got ",
                bias->sizes());
  }
  const LinearIO io = linear_io(x, n, k, bias);
  if (io.done) return io.out();
  const int64_t m = io.m;
  const float* b = io.b;
  const auto* xp = reinterpret_cast<const uint16_t*>(io.x2.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(io.y.data_ptr<at::BFloat16>());
  const int64_t blocks = n / kCols;
  const int64_t groups = (blocks + kMaxVecs - 1) / kMaxVecs;
  const int64_t block_stride = pairs * 2 * kCols;
  // A group's weight slice (48 columns x K) stays in L2 while every 8-row block of a
  // larger batch reuses it (K = 1536: 144 KB).
  auto run_group = [&](int64_t g) {
    const int64_t blk = g * kMaxVecs;
    const int64_t nv = std::min(kMaxVecs, blocks - blk);
    const uint16_t* wg = wp + blk * block_stride;
    const float* bg = b == nullptr ? nullptr : b + blk * kCols;
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, m - r0);
      pick(rows, nv)(xp + r0 * k, k, wg, block_stride, pairs, yp + r0 * n + blk * kCols, n, bg);
    }
  };
  for_each_group(groups, m * k * n, run_group);
  return io.out();
}

}  // namespace dflash2
