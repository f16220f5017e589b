// Torch-free host launchers of the CUDA kernels. The torch bindings
// (torch_bindings.cu) pass raw pointers and the current stream; this split
// lets benchmarks/nvcc_check.sh compile every kernel without torch's CUDA headers.
#pragma once

#include <cuda_runtime.h>

#include "../include/dflash2/grouped_conv.h"
#include "../include/dflash2/select_candidates.h"

namespace dflash2 {

enum class DType { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// out [N, H] (x's dtype, row stride st.out_row); coef1 (nullable: finish) [N, T, G] float32.
cudaError_t launch_grouped_conv(DType x_type, DType delta_type, DType base_type, const void* x,
                                const void* delta, const void* base, void* out, float* coef1,
                                const ConvShape& shape, const ConvStrides& strides,
                                cudaStream_t stream);

struct SelectPointers {
  const int64_t* cand;
  const void* unary;   // act_type
  const void* hidden;  // act_type
  const int64_t* anchor;
  const void* pred;  // codebook_type
  const void* succ;  // codebook_type
  const float* temperature;
  const int64_t* seeds;
  const int64_t* top_k;  // nullable
  const float* top_p;    // nullable
  int64_t* tokens;
  float* q;
  int64_t cand_b, unary_b, hidden_b;
};

cudaError_t launch_select_candidates(DType codebook_type, DType act_type, int64_t batch,
                                     const SelectPointers& ptr, const SelectShape& shape,
                                     const SelectStrides& strides, cudaStream_t stream);

}  // namespace dflash2
