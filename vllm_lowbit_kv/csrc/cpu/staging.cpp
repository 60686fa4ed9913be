// The copies of a step's writes (vllm_lowbit_kv/paged/write.py). stage_rows
// (StagedTokens.store): fresh tokens of groups still incomplete go to their staging slots,
// in the model dtype or as int8 codes with a float32 scale per (token, KV head). The int8
// codes are codecs/quant.py's absmax_int8 bit for bit on finite rows: scale = max |x| / 127
// (1 for an all-zero row), code = x / scale rounded to nearest even, clamped to [-127,
// 127]. read_staged (StagedTokens.read_run): runs of staged tokens back, widened (int8
// codes times their scale). write_states (encode_groups): encoded group states into their
// pages, as PageFormat.write_states puts them.

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

// the first n tokens of each run of slots (slot after slot): out[b, t, h] = data[slots[b,
// t / T], t % T, h] (times scale[...] for int8 data; scale empty for model-dtype data), out
// float32 contiguous [B, n, H, D]
void read_staged(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& slots,
                 const at::Tensor& out) {
  TORCH_CHECK(data.dim() == 4 && data.stride(3) == 1,
              "data: [slots, T, H, D] with unit stride in the last dim");
  const int64_t T = data.size(1), H = data.size(2), D = data.size(3);
  const bool int8 = data.scalar_type() == at::kChar;
  TORCH_CHECK(!int8 || (scale.scalar_type() == at::kFloat && scale.dim() == 4 &&
                        scale.size(0) == data.size(0) && scale.size(1) == T && scale.size(2) == H),
              "scale: float32 [slots, T, H, 1] beside int8 data");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2,
              "slots: int64 contiguous [B, S]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 4 &&
                  out.size(0) == slots.size(0) && out.size(2) == H && out.size(3) == D,
              "out: float32 contiguous [B, n, H, D]");
  const int64_t B = slots.size(0), S = slots.size(1), n = out.size(1);
  TORCH_CHECK(n <= S * T, "out: n = ", n, " tokens, more than the ", S, " slots hold");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * S; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < data.size(0), "slots[", i, "] = ", sp[i],
                " outside the ", data.size(0), " staging slots");
  const View dv(data), sv(int8 ? scale : at::Tensor());
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, B * n * H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / (n * H), t = it / H % n, h = it % H;
      const int64_t slot = sp[b * S + t / T], at = t % T;
      float s = 1.f;
      if (int8) std::memcpy(&s, sv.at(slot, at, h), sizeof s);
      dv.row(slot, at, h, 0, D, s, dst + it * D);
    }
  });
}

// states [E, H, C] -> pages [blocks, H, P]: group gids[e] is group gids[e] % N of block
// gids[e] / N, at byte sink_bytes + (gids[e] % N) C of each head's page bytes. One thread:
// a few groups a step, where torch's indexed put ran element by element across the pool.
void write_states(const at::Tensor& states, const at::Tensor& gids, int64_t N,
                  int64_t sink_bytes, const at::Tensor& pages) {
  TORCH_CHECK(states.scalar_type() == at::kByte && states.dim() == 3 && states.is_contiguous(),
              "states: uint8 contiguous [E, H, C]");
  TORCH_CHECK(pages.scalar_type() == at::kByte && pages.dim() == 3 && pages.stride(2) == 1 &&
                  pages.size(1) == states.size(1),
              "pages: uint8 [blocks, H, P] with unit stride in the last dim, H as the states'");
  const int64_t E = states.size(0), H = states.size(1), C = states.size(2);
  TORCH_CHECK(N > 0 && sink_bytes >= 0 && sink_bytes + N * C <= pages.size(2),
              "groups_per_block and sink_bytes: N groups of the states' bytes after the sinks "
              "within a page");
  TORCH_CHECK(gids.scalar_type() == at::kLong && gids.is_contiguous() && gids.numel() == E,
              "gids: int64 contiguous, one per state");
  const int64_t* g = gids.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(g[e] >= 0 && g[e] < pages.size(0) * N, "gids[", e, "] = ", g[e],
                ": outside the pages' ", pages.size(0) * N, " groups");
  const uint8_t* src = states.data_ptr<uint8_t>();
  uint8_t* base = pages.data_ptr<uint8_t>();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(base + g[e] / N * pages.stride(0) + h * pages.stride(1) + sink_bytes +
                      g[e] % N * C,
                  src + (e * H + h) * C, size_t(C));
}

TORCH_LIBRARY_FRAGMENT(lowbit_kv, m) {
  m.def("stage_rows(Tensor x, Tensor tok, Tensor slot, Tensor off, Tensor(a!) data, "
        "Tensor(b!) scale) -> ()");
  m.def("read_staged(Tensor data, Tensor scale, Tensor slots, Tensor(a!) out) -> ()");
  m.def("write_states(Tensor states, Tensor gids, int groups_per_block, int sink_bytes, "
        "Tensor(a!) pages) -> ()");
}

TORCH_LIBRARY_IMPL(lowbit_kv, CPU, m) {
  m.impl("stage_rows", &stage_rows);
  m.impl("read_staged", &read_staged);
  m.impl("write_states", &write_states);
}

}  // namespace lowbit_kv
