// Grouped dynamic convolution inside blocks (ops/reference.py::grouped_conv_ref):
//   out[r, c] = sum_{t < T} 1[r % B >= t] * (base[t, c] + delta[r, t, c / gs]) * x[r - t, c]
// float32 accumulation; elements are converted with convert.h (to_float / from_float).
// Strides are in elements; the channel (last) dim of every tensor is contiguous.
#pragma once

#include "common.h"
#include "convert.h"

namespace dflash2 {

struct ConvShape {
  int64_t rows;        // N
  int64_t hidden;      // H
  int taps;            // T
  int64_t groups;      // G = H / group_size
  int64_t group_size;  // gs
  int64_t block_size;  // B
};

struct ConvStrides {
  int64_t x_row;      // x / z
  int64_t delta_row;  // projection (prepare) or coef1 (finish)
  int64_t delta_tap;  // distance between taps t and t+1 of one row
  int64_t base_tap;   // base0 / base1
  int64_t out_row;
};

// One output element; used by the CUDA kernel (and handy for tests of the math).
template <typename T, typename D, typename W>
DFLASH2_HD float conv_element(const T* x, const D* delta, const W* base, const ConvShape& s,
                              const ConvStrides& st, int64_t r, int64_t c) {
  const int64_t pos = r % s.block_size;
  const int64_t g = c / s.group_size;
  float acc = 0.0f;
  for (int t = 0; t < s.taps && t <= pos; ++t) {
    const float coef = to_float(base[t * st.base_tap + c]) +
                       to_float(delta[r * st.delta_row + t * st.delta_tap + g]);
    const float term = coef * to_float(x[(r - t) * st.x_row + c]);
    acc = t == 0 ? term : acc + term;
  }
  return acc;
}

// Rows [r0, r1) on the CPU. `scratch` is caller memory of taps * H floats.
// Each row first broadcasts its per-group deltas to per-channel floats, so
// the main loop runs over all H channels with no division and no short inner
// trip counts, and the compiler vectorizes it (one alias check per row).
template <typename T, typename D, typename W>
inline void conv_rows_cpu(const T* x, const D* delta, const W* base, T* out, const ConvShape& s,
                          const ConvStrides& st, int64_t r0, int64_t r1, float* scratch) {
  const int64_t gs = s.group_size, h = s.hidden;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t pos = r % s.block_size;
    const int taps = pos + 1 < s.taps ? static_cast<int>(pos + 1) : s.taps;
    for (int t = 0; t < taps; ++t) {
      const D* dr = delta + r * st.delta_row + t * st.delta_tap;
      float* de = scratch + t * h;
      for (int64_t g = 0; g < s.groups; ++g) {
        const float d = to_float(dr[g]);
        for (int64_t j = 0; j < gs; ++j) de[g * gs + j] = d;
      }
    }
    const T* __restrict__ x0 = x + r * st.x_row;
    const W* __restrict__ b0 = base;
    const float* __restrict__ d0 = scratch;
    T* __restrict__ o = out + r * st.out_row;
    if (taps == 1) {
      for (int64_t c = 0; c < h; ++c)
        o[c] = from_float<T>((to_float(b0[c]) + d0[c]) * to_float(x0[c]));
    } else if (taps == 2) {
      const T* __restrict__ x1 = x0 - st.x_row;
      const W* __restrict__ b1 = base + st.base_tap;
      const float* __restrict__ d1 = scratch + h;
      for (int64_t c = 0; c < h; ++c) {
        const float a = (to_float(b0[c]) + d0[c]) * to_float(x0[c]);
        o[c] = from_float<T>(a + (to_float(b1[c]) + d1[c]) * to_float(x1[c]));
      }
    } else {
      // Rare (T > 2): accumulate in place of the first tap's deltas.
      float* __restrict__ acc = scratch;
      for (int64_t c = 0; c < h; ++c) acc[c] = (to_float(b0[c]) + acc[c]) * to_float(x0[c]);
      for (int t = 1; t < taps; ++t) {
        const T* __restrict__ xt = x0 - t * st.x_row;
        const W* __restrict__ bt = base + t * st.base_tap;
        const float* __restrict__ dt = scratch + t * h;
        for (int64_t c = 0; c < h; ++c) acc[c] += (to_float(bt[c]) + dt[c]) * to_float(xt[c]);
      }
      for (int64_t c = 0; c < h; ++c) o[c] = from_float<T>(acc[c]);
    }
  }
}

// Copies the second-side coefficients projection[r, 1, :, :] -> coef1[r] (float32).
template <typename D>
DFLASH2_HD void copy_coef1_row(const D* projection_row, int64_t taps_x_groups, float* coef1_row) {
  for (int64_t i = 0; i < taps_x_groups; ++i)
    coef1_row[i] = to_float(projection_row[taps_x_groups + i]);
}

}  // namespace dflash2
