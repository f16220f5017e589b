// How the packed CPU linears (packed_linear.cpp, packed_linear_bf16.cpp) spread their
// column groups over threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace dflash2 {

// run_group(g) for g in [0, groups). `work` (multiply-adds) too small to pay for waking
// threads (~128K each): inline. Otherwise threads take groups from a shared counter
// instead of fixed halves: the engine's other processes share these cores, and a fixed
// split waits for whichever thread was descheduled. Small chunks (~8 per thread) keep
// that wait short.
template <class F>
void for_each_group(int64_t groups, int64_t work, const F& run_group) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), groups);
  if (threads <= 1 || work < threads * (int64_t{1} << 17) || at::in_parallel_region()) {
    for (int64_t g = 0; g < groups; ++g) run_group(g);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, groups / (threads * 8));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t g0 = next.fetch_add(chunk); g0 < groups; g0 = next.fetch_add(chunk)) {
      const int64_t g1 = std::min(groups, g0 + chunk);
      for (int64_t g = g0; g < g1; ++g) run_group(g);
    }
  });
}

}  // namespace dflash2
