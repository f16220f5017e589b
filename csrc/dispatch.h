// Dtype dispatch helpers for the bindings: the activation dtype picks T, and
// each aux tensor is either T or float32 (see op_args.h::as_aux).
#pragma once

#include <ATen/ATen.h>

namespace dflash2 {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<float>) when t is float32, else f(TypeTag<T>).
template <typename T, typename F>
inline void with_aux_type(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(TypeTag<float>{});
  } else {
    f(TypeTag<T>{});
  }
}

}  // namespace dflash2

// float32 / float16 / bfloat16 only (AT_DISPATCH_FLOATING_TYPES would add double).
#define DFLASH2_DISPATCH_FLOAT(TYPE, NAME, ...)                                     \
  [&] {                                                                             \
    switch (TYPE) {                                                                 \
      case at::kFloat: {                                                            \
        using scalar_t = float;                                                     \
        return __VA_ARGS__();                                                       \
      }                                                                             \
      case at::kHalf: {                                                             \
        using scalar_t = at::Half;                                                  \
        return __VA_ARGS__();                                                       \
      }                                                                             \
      case at::kBFloat16: {                                                         \
        using scalar_t = at::BFloat16;                                              \
        return __VA_ARGS__();                                                       \
      }                                                                             \
      default:                                                                      \
        TORCH_CHECK(false, NAME, ": expected float32/float16/bfloat16, got ", TYPE); \
    }                                                                               \
  }()
