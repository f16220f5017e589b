// Shared macros and limits for the torch-free DFlash2 kernels.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DFLASH2_HD __host__ __device__ __forceinline__
#else
#define DFLASH2_HD inline
#endif

namespace dflash2 {

// Candidate lists and selector rank are walked with fixed-size per-request
// scratch (registers / stack / shared memory), so both are bounded.
constexpr int kMaxTopK = 64;
constexpr int kMaxRank = 512;
constexpr int kMaxTaps = 8;

}  // namespace dflash2
