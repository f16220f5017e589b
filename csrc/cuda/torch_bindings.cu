// CUDA implementations of the vllm_dflash2 ops: validate (op_args.h), allocate,
// and launch on the current stream behind a device guard.
// c10/cuda/CUDAStream.h is what ATen/cuda/CUDAContext.h re-exports as
// at::cuda::getCurrentCUDAStream, without pulling in cuBLAS/cuSPARSE headers.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../op_args.h"
#include "launchers.h"

namespace dflash2 {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "expected float32/float16/bfloat16, got ", t.scalar_type());
  }
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> grouped_conv_prepare_cuda(const at::Tensor& x,
                                                             const at::Tensor& projection,
                                                             const at::Tensor& base0,
                                                             int64_t block_size,
                                                             int64_t group_size) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", x.device());
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  ConvArgs a = conv_args(x, projection, base0, block_size, group_size, /*prepare=*/true);
  at::Tensor y = at::empty({a.shape.rows, a.shape.hidden}, x.options());
  at::Tensor coef1 =
      at::empty({a.shape.rows, a.shape.taps, a.shape.groups}, x.options().dtype(at::kFloat));
  check_launch(launch_grouped_conv(dtype_of(a.x), dtype_of(a.delta), dtype_of(a.base),
                                   a.x.data_ptr(), a.delta.data_ptr(), a.base.data_ptr(),
                                   y.data_ptr(), coef1.data_ptr<float>(), a.shape, a.strides,
                                   c10::cuda::getCurrentCUDAStream()),
               "grouped_conv_prepare");
  return {y, coef1};
}

at::Tensor grouped_conv_finish_cuda(const at::Tensor& z, const at::Tensor& coef1,
                                    const at::Tensor& base1, int64_t block_size,
                                    int64_t group_size) {
  TORCH_CHECK(z.is_cuda(), "z must be a CUDA tensor, got ", z.device());
  const c10::cuda::OptionalCUDAGuard guard(z.device());
  ConvArgs a = conv_args(z, coef1, base1, block_size, group_size, /*prepare=*/false);
  at::Tensor y = at::empty({a.shape.rows, a.shape.hidden}, z.options());
  check_launch(launch_grouped_conv(dtype_of(a.x), dtype_of(a.delta), dtype_of(a.base),
                                   a.x.data_ptr(), a.delta.data_ptr(), a.base.data_ptr(),
                                   y.data_ptr(), nullptr, a.shape, a.strides,
                                   c10::cuda::getCurrentCUDAStream()),
               "grouped_conv_finish");
  return y;
}

std::tuple<at::Tensor, at::Tensor> select_candidates_cuda(
    const at::Tensor& candidate_ids, const at::Tensor& unary, const at::Tensor& hidden,
    const at::Tensor& anchor_ids, const at::Tensor& predecessor_codebook,
    const at::Tensor& successor_codebook, const at::Tensor& temperature, const at::Tensor& seeds,
    const c10::optional<at::Tensor>& top_k, const c10::optional<at::Tensor>& top_p) {
  TORCH_CHECK(candidate_ids.is_cuda(), "candidate_ids must be a CUDA tensor, got ",
              candidate_ids.device());
  const c10::cuda::OptionalCUDAGuard guard(candidate_ids.device());
  // Ids are not range-checked here (that would need a device sync); the CPU op checks them.
  SelectArgs a = select_args(candidate_ids, unary, hidden, anchor_ids, predecessor_codebook,
                             successor_codebook, temperature, seeds, top_k, top_p);
  at::Tensor tokens = at::empty({a.batch, a.shape.length}, candidate_ids.options());
  at::Tensor q = at::empty({a.batch, a.shape.length, a.shape.k},
                           candidate_ids.options().dtype(at::kFloat));
  SelectPointers ptr{a.cand.data_ptr<int64_t>(),
                     a.unary.data_ptr(),
                     a.hidden.data_ptr(),
                     a.anchor.data_ptr<int64_t>(),
                     a.pred.data_ptr(),
                     a.succ.data_ptr(),
                     a.temperature.data_ptr<float>(),
                     a.seeds.data_ptr<int64_t>(),
                     a.has_top_k ? a.top_k.data_ptr<int64_t>() : nullptr,
                     a.has_top_p ? a.top_p.data_ptr<float>() : nullptr,
                     tokens.data_ptr<int64_t>(),
                     q.data_ptr<float>(),
                     a.cand.stride(0),
                     a.unary.stride(0),
                     a.hidden.stride(0)};
  check_launch(launch_select_candidates(dtype_of(a.pred), dtype_of(a.hidden), a.batch, ptr,
                                        a.shape, select_strides(a),
                                        c10::cuda::getCurrentCUDAStream()),
               "select_candidates");
  return {tokens, q};
}

}  // namespace
}  // namespace dflash2

TORCH_LIBRARY_IMPL(vllm_dflash2, CUDA, m) {
  m.impl("grouped_conv_prepare", &dflash2::grouped_conv_prepare_cuda);
  m.impl("grouped_conv_finish", &dflash2::grouped_conv_finish_cuda);
  m.impl("select_candidates", &dflash2::select_candidates_cuda);
}
