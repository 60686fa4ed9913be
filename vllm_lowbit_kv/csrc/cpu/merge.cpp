// The last step of a layer's attention (vllm_lowbit_kv/paged/forward.py): the packed part
// and the exact part, each normalized with its log-sum-exp, merged by log-sum-exp
// (ops/reference.py, merge_attention) and written straight into the layer's output in its
// dtype: one pass instead of a dozen small tensor operations and a copy per layer.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "dtypes.h"

namespace lowbit_kv {

// dst[i, h] = (e^(la - l) a[i, h] + e^(lb - l) b[i, h]), l = log(e^la + e^lb); 0 where l
// is -inf (neither part has keys)
void merge_attention_into(const at::Tensor& out_a, const at::Tensor& lse_a,
                          const at::Tensor& out_b, const at::Tensor& lse_b,
                          const at::Tensor& dst) {
  TORCH_CHECK(out_a.dim() == 3 && out_a.sizes() == out_b.sizes() && out_a.sizes() == dst.sizes(),
              "out_a, out_b, dst: [n, Hq, D] of one shape");
  for (const at::Tensor* t : {&out_a, &out_b, &lse_a, &lse_b})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "out_a, out_b, lse_a, lse_b: float32 contiguous");
  const int64_t n = out_a.size(0), Hq = out_a.size(1), D = out_a.size(2);
  TORCH_CHECK(lse_a.numel() == n * Hq && lse_b.numel() == n * Hq, "lse_a, lse_b: [n, Hq]");
  const auto dt = dst.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && dst.stride(2) == 1,
              "dst: float32, bfloat16 or float16 with unit stride in the last dim");
  const float* a = out_a.data_ptr<float>();
  const float* b = out_b.data_ptr<float>();
  const float* la = lse_a.data_ptr<float>();
  const float* lb = lse_b.data_ptr<float>();
  const MutableView to(dst);
  at::parallel_for(0, n * Hq, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(D));
    for (int64_t i = begin; i < end; ++i) {
      const float hi = std::max(la[i], lb[i]);
      float wa = 0.f, wb = 0.f;
      if (hi != -std::numeric_limits<float>::infinity()) {
        const float l = hi + std::log1p(std::exp(std::min(la[i], lb[i]) - hi));
        wa = std::exp(la[i] - l);
        wb = std::exp(lb[i] - l);
      }
      const float* ai = a + i * D;
      const float* bi = b + i * D;
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) row[c] = wa * ai[c] + wb * bi[c];
      narrow(row.data(), D, dt, to.at(i / Hq, i % Hq));
    }
  });
}

TORCH_LIBRARY_FRAGMENT(lowbit_kv, m) {
  m.def("merge_attention_into(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, "
        "Tensor(a!) dst) -> ()");
}

TORCH_LIBRARY_IMPL(lowbit_kv, CPU, m) {
  m.impl("merge_attention_into", &merge_attention_into);
}

}  // namespace lowbit_kv
