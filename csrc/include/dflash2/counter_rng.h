// Counter-based RNG, bit for bit the same as ops/reference.py::counter_uniform.
#pragma once

#include "common.h"

namespace dflash2 {

constexpr uint32_t kStepStride = 0x9E3779B1u;

// MurmurHash3 finalizer.
DFLASH2_HD uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Uniform in (0, 1) from (seed, step): 24 random bits centred in their bucket.
// The float add rounds exactly like the reference's float32 tensor add.
DFLASH2_HD float counter_uniform(int64_t seed, int64_t step) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t lo = static_cast<uint32_t>(s);
  const uint32_t hi = static_cast<uint32_t>(s >> 32);
  // Only the low 32 bits of (step + 1) * stride matter after the mask.
  const uint32_t ctr = static_cast<uint32_t>(step + 1) * kStepStride;
  const uint32_t h = fmix32(lo ^ fmix32(hi ^ fmix32(ctr)));
  const float bits = static_cast<float>(h >> 8);
  return (bits + 0.5f) * (1.0f / 16777216.0f);
}

}  // namespace dflash2
