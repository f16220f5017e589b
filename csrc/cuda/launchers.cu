// Dtype dispatch and launch configuration of the CUDA kernels (torch-free).
#include "../include/dflash2/grouped_conv.cuh"
#include "../include/dflash2/select_candidates.cuh"
#include "launchers.h"

namespace dflash2 {
namespace {

template <typename F>
cudaError_t with_type(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat16:
      return f(__half{});
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// Aux tensors are either the activation type or float32 (see csrc/op_args.h).
template <typename T, typename F>
cudaError_t with_aux_type(DType t, F&& f) {
  return t == DType::kFloat32 ? f(float{}) : f(T{});
}

constexpr int kConvThreads = 256;
constexpr int64_t kConvMaxBlocks = 8192;  // grid-stride beyond this

}  // namespace

cudaError_t launch_grouped_conv(DType x_type, DType delta_type, DType base_type, const void* x,
                                const void* delta, const void* base, void* out, float* coef1,
                                const ConvShape& shape, const ConvStrides& strides,
                                cudaStream_t stream) {
  const int64_t work = shape.rows * (shape.hidden > 2 * shape.taps * shape.groups
                                         ? shape.hidden
                                         : 2 * shape.taps * shape.groups);
  if (work == 0) return cudaSuccess;
  int64_t blocks = (work + kConvThreads - 1) / kConvThreads;
  blocks = blocks < kConvMaxBlocks ? blocks : kConvMaxBlocks;
  return with_type(x_type, [&](auto xt) {
    using T = decltype(xt);
    return with_aux_type<T>(delta_type, [&](auto dt) {
      using D = decltype(dt);
      return with_aux_type<T>(base_type, [&](auto bt) {
        using W = decltype(bt);
        grouped_conv_kernel<T, D, W><<<static_cast<unsigned>(blocks), kConvThreads, 0, stream>>>(
            static_cast<const T*>(x), static_cast<const D*>(delta), static_cast<const W*>(base),
            static_cast<T*>(out), coef1, shape, strides);
        return cudaGetLastError();
      });
    });
  });
}

cudaError_t launch_select_candidates(DType codebook_type, DType act_type, int64_t batch,
                                     const SelectPointers& ptr, const SelectShape& shape,
                                     const SelectStrides& strides, cudaStream_t stream) {
  if (batch == 0 || shape.length == 0) return cudaSuccess;
  return with_type(codebook_type, [&](auto cbt) {
    using CB = decltype(cbt);
    return with_type(act_type, [&](auto at) {
      using A = decltype(at);
      SelectParams<CB, A> p{ptr.cand,
                            static_cast<const A*>(ptr.unary),
                            static_cast<const A*>(ptr.hidden),
                            ptr.anchor,
                            static_cast<const CB*>(ptr.pred),
                            static_cast<const CB*>(ptr.succ),
                            ptr.temperature,
                            ptr.seeds,
                            ptr.top_k,
                            ptr.top_p,
                            ptr.tokens,
                            ptr.q,
                            ptr.cand_b,
                            ptr.unary_b,
                            ptr.hidden_b,
                            shape,
                            strides};
      select_candidates_kernel<CB, A>
          <<<static_cast<unsigned>(batch), kSelectThreads, 0, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

}  // namespace dflash2
