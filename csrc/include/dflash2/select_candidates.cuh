// CUDA kernel of the fused candidate selection (torch-free): one thread block
// per request, walking sequentially over L. Per step the block forms
// w = pred[prev] * hidden[l] in shared memory, each warp scores candidates
// (dot over the rank, warp-shuffle reduction), then thread 0 runs the same
// walk_step as the CPU kernel (greedy argmax or counter-RNG inverse CDF).
#pragma once

#include <cuda_runtime.h>

#include "select_candidates.h"

namespace dflash2 {

template <typename CB, typename A>
struct SelectParams {
  const int64_t* cand;
  const A* unary;
  const A* hidden;
  const int64_t* anchor;
  const CB* pred;
  const CB* succ;
  const float* temperature;
  const int64_t* seeds;
  const int64_t* top_k;  // nullable
  const float* top_p;    // nullable
  int64_t* tokens;       // [Bq, L]
  float* q;              // [Bq, L, k]
  int64_t cand_b, unary_b, hidden_b;  // per-request strides
  SelectShape shape;
  SelectStrides st;
};

constexpr int kSelectThreads = 256;

template <typename CB, typename A>
__global__ void __launch_bounds__(kSelectThreads)
    select_candidates_kernel(SelectParams<CB, A> p) {
  __shared__ float w[kMaxRank];
  __shared__ float s[kMaxTopK];
  __shared__ int64_t prev_token;
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int nwarps = blockDim.x / 32;
  const int k = p.shape.k, rank = p.shape.rank;
  const int64_t* cand = p.cand + b * p.cand_b;
  const A* unary = p.unary + b * p.unary_b;
  const A* hidden = p.hidden + b * p.hidden_b;
  const float temperature = p.temperature[b];
  const StepFilter filter{p.top_k != nullptr || p.top_p != nullptr, p.top_k ? p.top_k[b] : 0,
                          p.top_p ? p.top_p[b] : INFINITY};
  if (tid == 0) prev_token = p.anchor[b];
  __syncthreads();
  for (int64_t l = 0; l < p.shape.length; ++l) {
    const CB* pr = p.pred + prev_token * p.st.pred_row;
    const A* h = hidden + l * p.st.hidden_step;
    for (int i = tid; i < rank; i += blockDim.x) w[i] = to_float(pr[i]) * to_float(h[i]);
    __syncthreads();
    const int64_t* cl = cand + l * p.st.cand_step;
    for (int c = warp; c < k; c += nwarps) {
      const CB* row = p.succ + cl[c] * p.st.succ_row;
      float dot = 0.0f;
      for (int i = lane; i < rank; i += 32) dot += w[i] * to_float(row[i]);
      for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      if (lane == 0) s[c] = to_float(unary[l * p.st.unary_step + c]) + dot;
    }
    __syncthreads();
    if (tid == 0) {
      const float u = temperature > 0.0f ? counter_uniform(p.seeds[b], l) : 0.0f;
      float* q = p.q + (b * p.shape.length + l) * k;
      const int choice = walk_step(s, k, temperature, u, filter, q);
      prev_token = cl[choice];
      p.tokens[b * p.shape.length + l] = prev_token;
    }
    __syncthreads();
  }
}

}  // namespace dflash2
