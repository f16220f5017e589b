// Element <-> float32 conversions for the kernel templates. Generic types
// (float, c10::Half, c10::BFloat16) use static_cast; CUDA's native half types
// use their intrinsics, because torch builds .cu files with
// -D__CUDA_NO_HALF_CONVERSIONS__ / -D__CUDA_NO_BFLOAT16_CONVERSIONS__.
#pragma once

#include "common.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace dflash2 {

template <typename T>
DFLASH2_HD float to_float(T v) {
  return static_cast<float>(v);
}

template <typename T>
DFLASH2_HD T from_float(float v) {
  return static_cast<T>(v);
}

#if defined(__CUDACC__)
DFLASH2_HD float to_float(__half v) { return __half2float(v); }
DFLASH2_HD float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
DFLASH2_HD __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
DFLASH2_HD __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
#endif

}  // namespace dflash2
