// The staging buffers' writes (vllm_lowbit_kv/paged/write.py, StagedTokens.store): fresh
// tokens of groups still incomplete go to their staging slots, in the model dtype or as
// int8 codes with a float32 scale per (token, KV head). The int8 codes are
// codecs/quant.py's absmax_int8 bit for bit on finite rows: scale = max |x| / 127 (1 for
// an all-zero row), code = x / scale rounded to nearest even, clamped to [-127, 127].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"

namespace lowbit_kv {

// x [n, H, D] rows tok[i] -> data[slot[i], off[i], h] (and scale[slot[i], off[i], h] for
// int8 data; scale empty for model-dtype data)
void stage_rows(const at::Tensor& x, const at::Tensor& tok, const at::Tensor& slot,
                const at::Tensor& off, const at::Tensor& data, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x: [n, H, D] with unit stride in the last dim");
  const auto xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf,
              "x: float32, bfloat16 or float16");
  const int64_t H = x.size(1), D = x.size(2), m = tok.numel();
  for (const at::Tensor* t : {&tok, &slot, &off})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == m,
                "tok, slot, off: int64 contiguous, one per staged token");
  TORCH_CHECK(data.dim() == 4 && data.size(2) == H && data.size(3) == D && data.stride(3) == 1,
              "data: [slots, T, H, D] with unit stride in the last dim");
  const auto dt = data.scalar_type();
  const bool int8 = dt == at::kChar;
  TORCH_CHECK(int8 || dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "data: int8 or a float dtype");
  TORCH_CHECK(!int8 || (scale.scalar_type() == at::kFloat && scale.dim() == 4 &&
                        scale.size(0) == data.size(0) && scale.size(1) == data.size(1) &&
                        scale.size(2) == H),
              "scale: float32 [slots, T, H, 1] beside int8 data");
  const int64_t* tp = tok.data_ptr<int64_t>();
  const int64_t* sp = slot.data_ptr<int64_t>();
  const int64_t* op = off.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < x.size(0) && sp[i] >= 0 && sp[i] < data.size(0) &&
                    op[i] >= 0 && op[i] < data.size(1),
                "staged token ", i, ": row, slot or offset out of range");
  const View xv(x);
  const MutableView dv(data), sv(int8 ? scale : at::Tensor());
  at::parallel_for(0, m * H, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(D));
    for (int64_t it = begin; it < end; ++it) {
      const int64_t i = it / H, h = it % H;
      uint8_t* dst = dv.at(sp[i], op[i], h);
      xv.row(tp[i], h, 0, 0, D, 1.f, row.data());
      if (!int8) {
        narrow(row.data(), D, dt, dst);
        continue;
      }
      float amax = 0.f;
      for (int64_t c = 0; c < D; ++c) amax = std::max(amax, std::fabs(row[c]));
      float s = amax / 127.f;
      if (!(s > 0.f)) s = 1.f;
      int8_t* codes = reinterpret_cast<int8_t*>(dst);
      for (int64_t c = 0; c < D; ++c)
        codes[c] = int8_t(std::clamp(std::nearbyint(row[c] / s), -127.f, 127.f));
      std::memcpy(sv.at(sp[i], op[i], h), &s, sizeof s);
    }
  });
}

TORCH_LIBRARY_FRAGMENT(lowbit_kv, m) {
  m.def("stage_rows(Tensor x, Tensor tok, Tensor slot, Tensor off, Tensor(a!) data, "
        "Tensor(b!) scale) -> ()");
}

TORCH_LIBRARY_IMPL(lowbit_kv, CPU, m) { m.impl("stage_rows", &stage_rows); }

}  // namespace lowbit_kv
