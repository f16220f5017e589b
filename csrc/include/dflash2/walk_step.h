// One walk step of the candidate selector, given the score row of the chosen
// predecessor: greedy argmax or inverse-CDF sampling from the realized
// proposal (softmax / temperature, then optional top-k / top-p, renormalized).
// Mirrors ops/reference.py::walk_ref + proposal_probs_ref. Runs on one thread
// (CPU request loop, or thread 0 of a CUDA block): k <= kMaxTopK is small.
#pragma once

#include <math.h>

#include "common.h"

namespace dflash2 {

struct StepFilter {
  bool active;     // a top_k or top_p tensor was given (reference renormalizes)
  int64_t top_k;   // <= 0: off
  float top_p;     // >= 1 (or +inf): off
};

// Writes the proposal to q[0..k) and returns the chosen candidate index.
DFLASH2_HD int walk_step(const float* s, int k, float temperature, float u,
                         StepFilter filter, float* q) {
  if (!(temperature > 0.0f)) {
    // Greedy: first index on ties (torch.argmax), q one-hot.
    int best = 0;
    float best_v = s[0];
    for (int c = 1; c < k; ++c) {
      if (s[c] > best_v) {
        best_v = s[c];
        best = c;
      }
    }
    for (int c = 0; c < k; ++c) q[c] = c == best ? 1.0f : 0.0f;
    return best;
  }

  float m = -INFINITY;
  for (int c = 0; c < k; ++c) {
    q[c] = s[c] / temperature;
    m = fmaxf(m, q[c]);
  }
  float sum = 0.0f;
  for (int c = 0; c < k; ++c) {
    q[c] = expf(q[c] - m);
    sum += q[c];
  }
  for (int c = 0; c < k; ++c) q[c] = q[c] / sum;

  if (filter.active) {
    // Rank by probability (stable insertion sort: ties keep index order).
    int order[kMaxTopK];
    for (int i = 0; i < k; ++i) {
      int j = i;
      while (j > 0 && q[order[j - 1]] < q[i]) {
        order[j] = order[j - 1];
        --j;
      }
      order[j] = i;
    }
    const int64_t kk = filter.top_k > 0 && filter.top_k < k ? filter.top_k : k;
    float cum = 0.0f;
    for (int i = 0; i < k; ++i) {
      const float p = q[order[i]];
      cum += p;
      const float before = cum - p;  // the reference's cumsum - sorted_p
      const bool keep = i < kk && before < filter.top_p;
      if (!keep) q[order[i]] = 0.0f;
    }
    float total = 0.0f;
    for (int c = 0; c < k; ++c) total += q[c];
    for (int c = 0; c < k; ++c) q[c] = q[c] / total;
  }

  // Inverse CDF: count of cdf entries below u, clamped to the last nonzero entry.
  float cdf = 0.0f;
  int below = 0;
  int last_nonzero = 0;
  for (int c = 0; c < k; ++c) {
    cdf += q[c];
    below += cdf < u ? 1 : 0;
    if (q[c] > 0.0f) last_nonzero = c;
  }
  int choice = below < k - 1 ? below : k - 1;
  return choice < last_nonzero ? choice : last_nonzero;
}

}  // namespace dflash2
