// What both packed CPU linears (packed_linear.cpp, packed_linear_bf16.cpp) do around their
// kernel: x [..., K] as [m, K] rows, y [..., N] in x's dtype, the bias as float32, and the
// inputs with nothing to multiply (no rows, no columns, K = 0).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace dflash2 {

struct LinearIO {
  std::vector<int64_t> out_shape;  // x's shape with N last
  int64_t m = 0;                   // rows: the product of x's leading dims
  at::Tensor x2;                   // [m, K], contiguous
  at::Tensor y;                    // [m, N], in x's dtype
  at::Tensor bias;                 // float32 [N], contiguous; undefined without a bias
  const float* b = nullptr;        // bias's data, or nullptr
  bool done = false;               // y is final: nothing to multiply (bias or zeros)

  at::Tensor out() const { return y.view(out_shape); }
};

// `bias`, when given, has N values (checked by the caller, with its own message).
inline LinearIO linear_io(const at::Tensor& x, int64_t n, int64_t k,
                          const c10::optional<at::Tensor>& bias) {
  LinearIO io;
  if (bias.has_value() && bias->defined()) {
    io.bias = bias->to(at::kFloat).contiguous();
    io.b = io.bias.data_ptr<float>();
  }
  io.out_shape.assign(x.sizes().begin(), x.sizes().end());
  io.out_shape.back() = n;
  // Rows = product of the leading dims (reshape(-1, 0) would be ambiguous for K = 0).
  io.m = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  io.x2 = x.reshape({io.m, k}).contiguous();
  io.y = at::empty({io.m, n}, x.options());
  if (io.m == 0 || n == 0) {
    io.done = true;
  } else if (k == 0) {
    if (io.b != nullptr) {
      io.y.copy_(io.bias.view({1, n}).expand({io.m, n}));
    } else {
      io.y.zero_();
    }
    io.done = true;
  }
  return io;
}

}  // namespace dflash2
