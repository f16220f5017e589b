// bfloat16 twin of the packed float32 CPU linear (packed_linear_bf16.cpp); the ops in
// packed_linear.cpp dispatch to it on the weight's dtype.
#pragma once

#include <ATen/ATen.h>

namespace dflash2 {

// Whether this CPU runs the bf16 kernel (AVX512-F, -BW and -BF16).
bool packed_linear_bf16_supported();
// [N, K] bf16 (N % 16 == 0, K even) -> [N / 16, K / 2, 32] bf16.
at::Tensor pack_linear_weight_bf16(const at::Tensor& weight);
at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias);

}  // namespace dflash2
