// CUDA kernel of the grouped dynamic convolution (torch-free). One thread per
// output element, grid-stride; the op is memory bound (reads x twice, from
// rows r and r-1, mostly out of L2), so plain coalesced loads suffice.
#pragma once

#include <cuda_runtime.h>

#include "grouped_conv.h"

namespace dflash2 {

template <typename T, typename D, typename W>
__global__ void grouped_conv_kernel(const T* __restrict__ x, const D* __restrict__ delta,
                                    const W* __restrict__ base, T* __restrict__ out,
                                    float* __restrict__ coef1, ConvShape s, ConvStrides st) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = s.rows * s.hidden;
  for (int64_t i = first; i < total; i += step) {
    const int64_t r = i / s.hidden;
    const int64_t c = i - r * s.hidden;
    out[r * st.out_row + c] = from_float<T>(conv_element(x, delta, base, s, st, r, c));
  }
  if (coef1 != nullptr) {
    // prepare only: coef1[r] = projection[r, 1] (the second side's taps), float32.
    const int64_t tg = static_cast<int64_t>(s.taps) * s.groups;
    for (int64_t i = first; i < s.rows * tg; i += step) {
      const int64_t r = i / tg;
      coef1[i] = to_float(delta[r * st.delta_row + tg + (i - r * tg)]);
    }
  }
}

}  // namespace dflash2
