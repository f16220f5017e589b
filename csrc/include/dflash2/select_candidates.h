// Fused edge scoring + walk for one request on the CPU
// (ops/reference.py::select_candidates_ref). Only the score row of the chosen
// predecessor is computed at each step: L * k * r multiply-adds instead of
// L * k * k * r.
#pragma once

#include "common.h"
#include "convert.h"
#include "counter_rng.h"
#include "walk_step.h"

namespace dflash2 {

struct SelectShape {
  int64_t length;  // L
  int k;           // candidates per step
  int rank;        // r
};

// Element strides of one request's slices; last dims are contiguous.
struct SelectStrides {
  int64_t cand_step;    // candidate_ids[b, l, :]
  int64_t unary_step;   // unary[b, l, :]
  int64_t hidden_step;  // hidden[b, l, :]
  int64_t pred_row;     // predecessor_codebook[v, :]
  int64_t succ_row;     // successor_codebook[v, :]
};

// Score row of one step: s[c] = unary[c] + sum_r w[r] * succ[cand[c], r],
// where w = pred[prev] * hidden (already formed by the caller).
inline void prefetch_read(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

template <typename CB, typename A>
inline void score_row_cpu(const int64_t* cand, const A* unary, const float* w, const CB* succ,
                          int64_t succ_row, int k, int rank, float* s) {
  for (int c = 0; c < k; ++c) {
    const CB* row = succ + cand[c] * succ_row;
    // Independent lanes so the compiler vectorizes without reassociating.
    constexpr int kLanes = 16;
    float lane[kLanes] = {};
    int i = 0;
    for (; i + kLanes <= rank; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lane[j] += w[i + j] * to_float(row[i + j]);
    for (int j = 0; i + j < rank; ++j) lane[j] += w[i + j] * to_float(row[i + j]);
    float dot = 0.0f;
    for (int j = 0; j < kLanes; ++j) dot += lane[j];
    s[c] = to_float(unary[c]) + dot;
  }
}

template <typename CB, typename A>
inline void select_request_cpu(const int64_t* cand, const A* unary, const A* hidden, int64_t anchor,
                               const CB* pred, const CB* succ, float temperature, int64_t seed,
                               StepFilter filter, const SelectShape& sh, const SelectStrides& st,
                               int64_t* tokens, float* q) {
  float w[kMaxRank];
  float s[kMaxTopK];
  int64_t prev_token = anchor;
  for (int64_t l = 0; l < sh.length; ++l) {
    const CB* p = pred + prev_token * st.pred_row;
    const A* h = hidden + l * st.hidden_step;
    for (int i = 0; i < sh.rank; ++i) w[i] = to_float(p[i]) * to_float(h[i]);
    const int64_t* cl = cand + l * st.cand_step;
    // Successor rows are random codebook rows (cache misses): request all of
    // this step's lines up front so the misses overlap.
    for (int c = 0; c < sh.k; ++c) {
      const char* row = reinterpret_cast<const char*>(succ + cl[c] * st.succ_row);
      for (int64_t off = 0; off < static_cast<int64_t>(sh.rank * sizeof(CB)); off += 64)
        prefetch_read(row + off);
    }
    score_row_cpu(cl, unary + l * st.unary_step, w, succ, st.succ_row, sh.k, sh.rank, s);
    const float u = temperature > 0.0f ? counter_uniform(seed, l) : 0.0f;
    const int c = walk_step(s, sh.k, temperature, u, filter, q + l * sh.k);
    prev_token = cl[c];
    tokens[l] = prev_token;
  }
}

}  // namespace dflash2
