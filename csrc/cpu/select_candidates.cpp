// CPU kernel of select_candidates: one task per request, walking over L.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "../dispatch.h"
#include "../op_args.h"

namespace dflash2 {
namespace {

template <typename CB, typename A>
void select_cpu(const SelectArgs& a, at::Tensor& tokens, at::Tensor& q) {
  const SelectShape sh = a.shape;
  const SelectStrides st = select_strides(a);
  const int64_t* cand = a.cand.data_ptr<int64_t>();
  const A* unary = a.unary.data_ptr<A>();
  const A* hidden = a.hidden.data_ptr<A>();
  const int64_t* anchor = a.anchor.data_ptr<int64_t>();
  const CB* pred = a.pred.data_ptr<CB>();
  const CB* succ = a.succ.data_ptr<CB>();
  const float* temp = a.temperature.data_ptr<float>();
  const int64_t* seeds = a.seeds.data_ptr<int64_t>();
  const int64_t* top_k = a.has_top_k ? a.top_k.data_ptr<int64_t>() : nullptr;
  const float* top_p = a.has_top_p ? a.top_p.data_ptr<float>() : nullptr;
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  const int64_t cand_b = a.cand.stride(0), unary_b = a.unary.stride(0),
                hidden_b = a.hidden.stride(0);
  const int64_t per_req = std::max<int64_t>(1, sh.length * sh.k * sh.rank);
  std::atomic<int64_t> bad_id{-1};

  at::parallel_for(0, a.batch, std::max<int64_t>(1, 32768 / per_req), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t* cb = cand + b * cand_b;
      // Out-of-range ids would read outside the codebooks: refuse them.
      bool ok = anchor[b] >= 0 && anchor[b] < a.vocab;
      for (int64_t l = 0; ok && l < sh.length; ++l)
        for (int c = 0; c < sh.k; ++c) {
          const int64_t v = cb[l * st.cand_step + c];
          ok = ok && v >= 0 && v < a.vocab;
        }
      if (!ok) {
        bad_id.store(b);
        continue;
      }
      StepFilter f{top_k != nullptr || top_p != nullptr, top_k ? top_k[b] : 0,
                   top_p ? top_p[b] : INFINITY};
      select_request_cpu(cb, unary + b * unary_b, hidden + b * hidden_b, anchor[b], pred, succ,
                         temp[b], seeds[b], f, sh, st, tok + b * sh.length,
                         qp + b * sh.length * sh.k);
    }
  });
  TORCH_CHECK(bad_id.load() < 0, "select_candidates: request ", bad_id.load(),
              " has an anchor or candidate id outside [0, ", a.vocab, ") (codebook rows)");
}

std::tuple<at::Tensor, at::Tensor> select_candidates_cpu(
    const at::Tensor& candidate_ids, const at::Tensor& unary, const at::Tensor& hidden,
    const at::Tensor& anchor_ids, const at::Tensor& predecessor_codebook,
    const at::Tensor& successor_codebook, const at::Tensor& temperature, const at::Tensor& seeds,
    const c10::optional<at::Tensor>& top_k, const c10::optional<at::Tensor>& top_p) {
  SelectArgs a = select_args(candidate_ids, unary, hidden, anchor_ids, predecessor_codebook,
                             successor_codebook, temperature, seeds, top_k, top_p);
  at::Tensor tokens = at::empty({a.batch, a.shape.length}, candidate_ids.options());
  at::Tensor q = at::empty({a.batch, a.shape.length, a.shape.k},
                           candidate_ids.options().dtype(at::kFloat));
  DFLASH2_DISPATCH_FLOAT(a.pred.scalar_type(), "select_candidates_cpu_codebook", [&] {
    using CB = scalar_t;
    DFLASH2_DISPATCH_FLOAT(a.hidden.scalar_type(), "select_candidates_cpu_act",
                           [&] { select_cpu<CB, scalar_t>(a, tokens, q); });
  });
  return {tokens, q};
}

}  // namespace
}  // namespace dflash2

TORCH_LIBRARY_IMPL(vllm_dflash2, CPU, m) {
  m.impl("select_candidates", &dflash2::select_candidates_cpu);
}
