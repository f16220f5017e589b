// CPU kernels of grouped_conv_prepare / grouped_conv_finish.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../dispatch.h"
#include "../op_args.h"

namespace dflash2 {
namespace {

// Rows per task: enough work to amortize a thread wake-up (~32K MACs).
int64_t conv_grain(const ConvShape& s) {
  const int64_t per_row = static_cast<int64_t>(s.taps) * s.hidden;
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, per_row));
}

template <typename T>
void conv_cpu(const ConvArgs& a, at::Tensor& out, float* coef1) {
  with_aux_type<T>(a.delta, [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    with_aux_type<T>(a.base, [&](auto btag) {
      using W = typename decltype(btag)::type;
      const T* x = a.x.data_ptr<T>();
      const D* delta = a.delta.data_ptr<D>();
      const W* base = a.base.data_ptr<W>();
      T* o = out.data_ptr<T>();
      const int64_t tg = static_cast<int64_t>(a.shape.taps) * a.shape.groups;
      at::parallel_for(0, a.shape.rows, conv_grain(a.shape), [&](int64_t r0, int64_t r1) {
        std::vector<float> scratch(static_cast<size_t>(a.shape.taps) * a.shape.hidden);
        conv_rows_cpu(x, delta, base, o, a.shape, a.strides, r0, r1, scratch.data());
        if (coef1 != nullptr) {
          for (int64_t r = r0; r < r1; ++r)
            copy_coef1_row(delta + r * a.strides.delta_row, tg, coef1 + r * tg);
        }
      });
    });
  });
}

std::tuple<at::Tensor, at::Tensor> grouped_conv_prepare_cpu(const at::Tensor& x,
                                                            const at::Tensor& projection,
                                                            const at::Tensor& base0,
                                                            int64_t block_size,
                                                            int64_t group_size) {
  ConvArgs a = conv_args(x, projection, base0, block_size, group_size, /*prepare=*/true);
  at::Tensor y = at::empty({a.shape.rows, a.shape.hidden}, x.options());
  at::Tensor coef1 =
      at::empty({a.shape.rows, a.shape.taps, a.shape.groups}, x.options().dtype(at::kFloat));
  DFLASH2_DISPATCH_FLOAT(x.scalar_type(), "grouped_conv_prepare_cpu",
                         [&] { conv_cpu<scalar_t>(a, y, coef1.data_ptr<float>()); });
  return {y, coef1};
}

at::Tensor grouped_conv_finish_cpu(const at::Tensor& z, const at::Tensor& coef1,
                                   const at::Tensor& base1, int64_t block_size,
                                   int64_t group_size) {
  ConvArgs a = conv_args(z, coef1, base1, block_size, group_size, /*prepare=*/false);
  at::Tensor y = at::empty({a.shape.rows, a.shape.hidden}, z.options());
  DFLASH2_DISPATCH_FLOAT(z.scalar_type(), "grouped_conv_finish_cpu",
                         [&] { conv_cpu<scalar_t>(a, y, nullptr); });
  return y;
}

}  // namespace
}  // namespace dflash2

TORCH_LIBRARY_IMPL(vllm_dflash2, CPU, m) {
  m.impl("grouped_conv_prepare", &dflash2::grouped_conv_prepare_cpu);
  m.impl("grouped_conv_finish", &dflash2::grouped_conv_finish_cpu);
}
