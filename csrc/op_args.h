// Argument validation shared by the CPU and CUDA bindings: checks shapes,
// dtypes and devices with messages that name the argument, and normalizes
// inputs to what the torch-free kernels take (contiguous last dim, aux
// tensors in the activation dtype or float32).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include "include/dflash2/common.h"
#include "include/dflash2/grouped_conv.h"
#include "include/dflash2/select_candidates.h"

namespace dflash2 {

inline bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// Aux tensors (projection, coefficients, base taps) either share the
// activation dtype or are read as float32 (lossless widening).
inline at::Tensor as_aux(const at::Tensor& t, at::ScalarType act, const char* name) {
  TORCH_CHECK(is_float_type(t.scalar_type()), name,
              " must be float32/float16/bfloat16, got ", t.scalar_type());
  const at::Tensor u = t.scalar_type() == act ? t : t.to(at::kFloat);
  return last_dim_contiguous(u);
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.device() == b.device(), name, " must be on ", a.device(), ", got ", b.device());
}

struct ConvArgs {
  at::Tensor x, delta, base;
  ConvShape shape;
  ConvStrides strides;
};

// `delta` is the projection [N, 2*T*G] (prepare) or coef1 [N, T, G] (finish).
inline ConvArgs conv_args(const at::Tensor& x_in, const at::Tensor& delta_in,
                          const at::Tensor& base_in, int64_t block_size, int64_t group_size,
                          bool prepare) {
  const char* xname = prepare ? "x" : "z";
  const char* dname = prepare ? "projection" : "coef1";
  const char* bname = prepare ? "base0" : "base1";
  TORCH_CHECK(x_in.dim() == 2, xname, " must be [N, H], got shape ", x_in.sizes());
  TORCH_CHECK(is_float_type(x_in.scalar_type()), xname,
              " must be float32/float16/bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1, got ", block_size);
  TORCH_CHECK(group_size >= 1, "group_size must be >= 1, got ", group_size);
  const int64_t n = x_in.size(0), h = x_in.size(1);
  TORCH_CHECK(h % group_size == 0, xname, ".size(1) = ", h, " must be a multiple of group_size = ",
              group_size);
  const int64_t g = h / group_size;
  TORCH_CHECK(base_in.dim() == 2 && base_in.size(1) == h, bname, " must be [T, ", h,
              "], got shape ", base_in.sizes());
  const int64_t taps = base_in.size(0);
  TORCH_CHECK(taps >= 1 && taps <= kMaxTaps, bname, ".size(0) (taps) must be in [1, ", kMaxTaps,
              "], got ", taps);
  if (prepare) {
    TORCH_CHECK(delta_in.dim() == 2 && delta_in.size(0) == n && delta_in.size(1) == 2 * taps * g,
                "projection must be [", n, ", ", 2 * taps * g, "] (N, 2*T*G), got shape ",
                delta_in.sizes());
  } else {
    TORCH_CHECK(delta_in.dim() == 3 && delta_in.size(0) == n && delta_in.size(1) == taps &&
                    delta_in.size(2) == g,
                "coef1 must be [", n, ", ", taps, ", ", g, "] (N, T, G), got shape ",
                delta_in.sizes());
  }
  check_same_device(x_in, delta_in, dname);
  check_same_device(x_in, base_in, bname);

  ConvArgs a;
  a.x = last_dim_contiguous(x_in);
  a.delta = as_aux(delta_in, x_in.scalar_type(), dname);
  a.base = as_aux(base_in, x_in.scalar_type(), bname);
  a.shape = ConvShape{n, h, static_cast<int>(taps), g, group_size, block_size};
  a.strides.x_row = a.x.stride(0);
  a.strides.delta_row = a.delta.stride(0);
  if (prepare) {
    a.strides.delta_tap = g;
  } else {
    // A size-1 tap dim can carry any stride; it is never stepped over.
    a.strides.delta_tap = taps > 1 ? a.delta.stride(1) : g;
    TORCH_CHECK(g <= 1 || a.delta.stride(2) == 1, "coef1 must have a contiguous last dim");
  }
  a.strides.base_tap = a.base.stride(0);
  a.strides.out_row = h;
  return a;
}

struct SelectArgs {
  at::Tensor cand, unary, hidden, anchor, pred, succ, temperature, seeds, top_k, top_p;
  bool has_top_k = false, has_top_p = false;
  int64_t batch = 0, vocab = 0;
  SelectShape shape;
};

inline SelectArgs select_args(const at::Tensor& candidate_ids, const at::Tensor& unary,
                              const at::Tensor& hidden, const at::Tensor& anchor_ids,
                              const at::Tensor& predecessor_codebook,
                              const at::Tensor& successor_codebook,
                              const at::Tensor& temperature, const at::Tensor& seeds,
                              const c10::optional<at::Tensor>& top_k,
                              const c10::optional<at::Tensor>& top_p) {
  TORCH_CHECK(candidate_ids.dim() == 3, "candidate_ids must be [Bq, L, k], got shape ",
              candidate_ids.sizes());
  TORCH_CHECK(candidate_ids.scalar_type() == at::kLong, "candidate_ids must be int64, got ",
              candidate_ids.scalar_type());
  const int64_t bq = candidate_ids.size(0), len = candidate_ids.size(1),
                k = candidate_ids.size(2);
  TORCH_CHECK(k >= 1 && k <= kMaxTopK, "candidate_ids.size(2) (top-k) must be in [1, ", kMaxTopK,
              "], got ", k);
  TORCH_CHECK(unary.sizes() == candidate_ids.sizes(), "unary must be [", bq, ", ", len, ", ", k,
              "] like candidate_ids, got shape ", unary.sizes());
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == bq && hidden.size(1) == len,
              "hidden must be [", bq, ", ", len, ", r], got shape ", hidden.sizes());
  const int64_t rank = hidden.size(2);
  TORCH_CHECK(rank >= 1 && rank <= kMaxRank, "hidden.size(2) (selector rank) must be in [1, ",
              kMaxRank, "], got ", rank);
  TORCH_CHECK(predecessor_codebook.dim() == 2 && predecessor_codebook.size(1) == rank,
              "predecessor_codebook must be [V, ", rank, "], got shape ",
              predecessor_codebook.sizes());
  TORCH_CHECK(successor_codebook.sizes() == predecessor_codebook.sizes(),
              "successor_codebook must be ", predecessor_codebook.sizes(),
              " like predecessor_codebook, got shape ", successor_codebook.sizes());
  TORCH_CHECK(anchor_ids.dim() == 1 && anchor_ids.size(0) == bq, "anchor_ids must be [", bq,
              "], got shape ", anchor_ids.sizes());
  TORCH_CHECK(!at::isFloatingType(anchor_ids.scalar_type()) &&
                  anchor_ids.scalar_type() != at::kBool,
              "anchor_ids must be an integer tensor, got ", anchor_ids.scalar_type());
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == bq, "temperature must be [", bq,
              "], got shape ", temperature.sizes());
  TORCH_CHECK(seeds.dim() == 1 && seeds.size(0) == bq, "seeds must be [", bq, "], got shape ",
              seeds.sizes());
  TORCH_CHECK(seeds.scalar_type() == at::kLong, "seeds must be int64, got ", seeds.scalar_type());
  const at::Tensor* tensors[] = {&unary,       &hidden, &anchor_ids, &predecessor_codebook,
                                 &successor_codebook, &temperature, &seeds};
  const char* names[] = {"unary",       "hidden", "anchor_ids", "predecessor_codebook",
                         "successor_codebook", "temperature", "seeds"};
  for (int i = 0; i < 7; ++i) check_same_device(candidate_ids, *tensors[i], names[i]);

  SelectArgs a;
  a.batch = bq;
  a.vocab = predecessor_codebook.size(0);
  a.shape = SelectShape{len, static_cast<int>(k), static_cast<int>(rank)};
  a.cand = last_dim_contiguous(candidate_ids);
  // unary and hidden share one dtype in the kernel; mixed inputs widen to float32.
  TORCH_CHECK(is_float_type(unary.scalar_type()) && is_float_type(hidden.scalar_type()),
              "unary and hidden must be float32/float16/bfloat16, got ", unary.scalar_type(),
              " and ", hidden.scalar_type());
  const bool same_act = unary.scalar_type() == hidden.scalar_type();
  a.unary = last_dim_contiguous(same_act ? unary : unary.to(at::kFloat));
  a.hidden = last_dim_contiguous(same_act ? hidden : hidden.to(at::kFloat));
  TORCH_CHECK(is_float_type(predecessor_codebook.scalar_type()) &&
                  is_float_type(successor_codebook.scalar_type()),
              "codebooks must be float32/float16/bfloat16, got ",
              predecessor_codebook.scalar_type(), " and ", successor_codebook.scalar_type());
  const bool same_cb = predecessor_codebook.scalar_type() == successor_codebook.scalar_type();
  a.pred = last_dim_contiguous(same_cb ? predecessor_codebook : predecessor_codebook.to(at::kFloat));
  a.succ = last_dim_contiguous(same_cb ? successor_codebook : successor_codebook.to(at::kFloat));
  a.anchor = anchor_ids.to(at::kLong).contiguous();
  a.temperature = temperature.to(at::kFloat).contiguous();
  a.seeds = seeds.contiguous();
  if (top_k.has_value()) {
    TORCH_CHECK(top_k->dim() == 1 && top_k->size(0) == bq, "top_k must be [", bq,
                "], got shape ", top_k->sizes());
    check_same_device(candidate_ids, *top_k, "top_k");
    a.top_k = top_k->to(at::kLong).contiguous();
    a.has_top_k = true;
  }
  if (top_p.has_value()) {
    TORCH_CHECK(top_p->dim() == 1 && top_p->size(0) == bq, "top_p must be [", bq,
                "], got shape ", top_p->sizes());
    check_same_device(candidate_ids, *top_p, "top_p");
    a.top_p = top_p->to(at::kFloat).contiguous();
    a.has_top_p = true;
  }
  return a;
}

inline SelectStrides select_strides(const SelectArgs& a) {
  return SelectStrides{a.cand.stride(1), a.unary.stride(1), a.hidden.stride(1), a.pred.stride(0),
                       a.succ.stride(0)};
}

}  // namespace dflash2
