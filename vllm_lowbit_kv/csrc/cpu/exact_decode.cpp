// The exact part of decode rows (vllm_lowbit_kv/paged/attention.py, exact_attention): each
// request's one fresh row attends to its exact keys where they live, with no gathered copy:
// its sink tokens (the sink area of its first block, model dtype), the staged run of its
// context (staging slots, model dtype or int8 with a float32 scale per token and head) and
// its own fresh token. Key position e of request b (E = sinks + tail + 1 positions, as the
// read plan lays them out: sinks, then the staged run, then the fresh token) counts where
// bias[b, e] is finite (0 in every plan; -inf: a position the request does not have).
//
// out[row, q] = sum_e softmax_e(scale q . k_e + bias_e) v_e and lse[row, q] its log-sum-exp,
// float32 throughout (float32 attention up to summation order); query head q reads KV head
// q / G. One work item per (request, KV head): its live keys and values widened to float32
// once, then scores, softmax and value sums for the G query heads that share them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "dtypes.h"
#include "vectors.h"

namespace lowbit_kv {
namespace {

constexpr float kNoKey = -std::numeric_limits<float>::infinity();

struct Staged {  // one staged tensor [S, T, H, D] and its scales [S, T, H, 1] (int8) or none
  View data, scale;
  // token `off` of slot `slot`, KV head h -> dst [D]
  void row(int64_t slot, int64_t off, int64_t h, int64_t D, float* dst) const {
    const float s = scale.base ? *reinterpret_cast<const float*>(scale.at(slot, off, h)) : 1.f;
    data.row(slot, off, h, 0, D, s, dst);
  }
};

// o[0, NV L) = inv * sum_j p[j] v[j * D + (0, NV L)]: NV vectors of sums kept in registers
template <int NV>
void value_sums(const float* p, int n, const float* v, int64_t D, float inv, float* o) {
  vf a[NV] = {};
  for (int j = 0; j < n; ++j) {
    const vf pj = splat(p[j]);
    for (int u = 0; u < NV; ++u) a[u] += pj * loadf(v + j * D + u * L);
  }
  for (int u = 0; u < NV; ++u) storef(o + u * L, a[u] * inv);
}

}  // namespace

void exact_decode_attention(const at::Tensor& query, const at::Tensor& rows,
                            const at::Tensor& bias, const at::Tensor& sink_kv,
                            const at::Tensor& sink_blocks, int64_t sinks,
                            const at::Tensor& staged_k, const at::Tensor& staged_k_scale,
                            const at::Tensor& staged_v, const at::Tensor& staged_v_scale,
                            const at::Tensor& tail_slots, const at::Tensor& key,
                            const at::Tensor& value, double scale, const at::Tensor& out,
                            const at::Tensor& lse) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(),
              "query [n, Hq, D], key and value [n, H, D]");
  const int64_t n = query.size(0), Hq = query.size(1), D = query.size(2), H = key.size(1);
  TORCH_CHECK(key.size(0) == n && key.size(2) == D && D % L == 0 && H > 0 && Hq % H == 0,
              "key/value rows and head_dim as the query's (a multiple of ", L,
              "), query heads a multiple of the KV heads");
  for (const at::Tensor* t : {&query, &key, &value, &staged_k, &staged_v})
    TORCH_CHECK(t->stride(-1) == 1, "query, key, value and staging: unit stride in the last dim");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16 ||
                    t->scalar_type() == at::kHalf,
                "query, key, value: float32, bfloat16 or float16");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "rows: int64 contiguous [B]");
  const int64_t B = rows.size(0);
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.dim() == 2 &&
                  bias.size(0) == B,
              "bias: float32 contiguous [B, E]");
  const int64_t E = bias.size(1), tail = E - 1 - sinks;
  TORCH_CHECK(sinks >= 0 && tail >= 0, "bias: sinks + tail + 1 positions per request");
  if (sinks) {
    TORCH_CHECK(sink_kv.dim() == 5 && sink_kv.size(1) == 2 && sink_kv.size(2) >= sinks &&
                    sink_kv.size(3) == H && sink_kv.size(4) == D && sink_kv.stride(4) == 1 &&
                    sink_blocks.scalar_type() == at::kLong && sink_blocks.numel() == B &&
                    sink_blocks.is_contiguous(),
                "sink_kv [num_blocks, 2, sink_tokens, H, D], sink_blocks int64 contiguous [B]");
  }
  if (tail) {
    for (const at::Tensor* t : {&staged_k, &staged_v})
      TORCH_CHECK(t->dim() == 4 && t->size(2) == H && t->size(3) == D,
                  "staging [slots, T, H, D]");
    for (const at::Tensor* t : {&staged_k_scale, &staged_v_scale})
      TORCH_CHECK(t->numel() == 0 || (t->scalar_type() == at::kFloat && t->dim() == 4),
                  "staging scales: float32 [slots, T, H, 1], or empty (model-dtype staging)");
    TORCH_CHECK(tail_slots.scalar_type() == at::kLong && tail_slots.dim() == 2 &&
                    tail_slots.is_contiguous() && tail_slots.size(0) == B &&
                    tail_slots.size(1) * staged_k.size(1) >= tail,
                "tail_slots: int64 contiguous [B, slots] holding tail tokens");
  }
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.sizes() == query.sizes(),
              "out: float32 contiguous [n, Hq, D]");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == n * Hq,
              "lse: float32 contiguous [n, Hq]");
  const int64_t* row_of = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(row_of[b] >= 0 && row_of[b] < n, "rows[", b, "] outside the query's rows");
  const int64_t G = Hq / H, T = tail ? staged_k.size(1) : 1;
  const float* bias_p = bias.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  const Staged k_run{View(staged_k), View(staged_k_scale)};
  const Staged v_run{View(staged_v), View(staged_v_scale)};
  const View sink(sink_kv), q_in(query), k_in(key), v_in(value);
  const int64_t* blocks = sinks ? sink_blocks.data_ptr<int64_t>() : nullptr;
  const int64_t* slots = tail ? tail_slots.data_ptr<int64_t>() : nullptr;
  const int64_t slots_per_request = tail ? tail_slots.size(1) : 0;
  for (int64_t b = 0; sinks && b < B; ++b)
    TORCH_CHECK(blocks[b] >= 0 && blocks[b] < sink_kv.size(0), "sink_blocks[", b,
                "] outside the cache's blocks");
  for (int64_t i = 0; i < B * slots_per_request; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < staged_k.size(0) && slots[i] < staged_v.size(0),
                "tail_slots: slot ", slots[i], " outside the staging buffers");

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    const size_t keys = size_t(E), width = size_t(D);
    std::vector<float> krows(keys * width), vrows(keys * width), q(size_t(G) * width);
    const size_t padded = size_t(round_up(int(E)));
    std::vector<float> live_bias(keys), sc(padded);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / H, h = it % H, row = row_of[b];
      // the live keys and values, widened; live bias kept beside them
      int live = 0;
      for (int64_t e = 0; e < E; ++e) {
        const float bias_e = bias_p[b * E + e];
        if (bias_e == kNoKey) continue;
        float* kd = krows.data() + size_t(live) * D;
        float* vd = vrows.data() + size_t(live) * D;
        if (e < sinks) {
          sink.row(blocks[b], 0, e, h, D, 1.f, kd);
          sink.row(blocks[b], 1, e, h, D, 1.f, vd);
        } else if (e < sinks + tail) {
          const int64_t j = e - sinks, slot = slots[b * slots_per_request + j / T];
          k_run.row(slot, j % T, h, D, kd);
          v_run.row(slot, j % T, h, D, vd);
        } else {
          k_in.row(row, h, 0, 0, D, 1.f, kd);
          v_in.row(row, h, 0, 0, D, 1.f, vd);
        }
        live_bias[live++] = bias_e;
      }
      const float score_scale = float(scale);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t qh = h * G + g;
        float* qv = q.data() + g * D;
        q_in.row(row, qh, 0, 0, D, 1.f, qv);
        for (int j = 0; j < live; ++j)
          sc[j] = score_scale * dot(qv, krows.data() + size_t(j) * D, int(D)) + live_bias[j];
        float mrun = kNoKey, lsum = 0.f, corr;
        softmax_rows(sc.data(), 1, 0, round_up(live), 0, &live, 1.f, &mrun, &lsum, nullptr, 0,
                     &corr);
        const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
        float* o = out_p + (row * Hq + qh) * D;
        for (int64_t c0 = 0; c0 < D; c0 += 4 * L) {
          switch (std::min<int64_t>(4, (D - c0) / L)) {
            case 1: value_sums<1>(sc.data(), live, vrows.data() + c0, D, inv, o + c0); break;
            case 2: value_sums<2>(sc.data(), live, vrows.data() + c0, D, inv, o + c0); break;
            case 3: value_sums<3>(sc.data(), live, vrows.data() + c0, D, inv, o + c0); break;
            default: value_sums<4>(sc.data(), live, vrows.data() + c0, D, inv, o + c0);
          }
        }
        lse_p[row * Hq + qh] = lsum > 0.f ? mrun + std::log(lsum) : kNoKey;
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(lowbit_kv, m) {
  m.def(
      "exact_decode_attention(Tensor query, Tensor rows, Tensor bias, Tensor sink_kv, "
      "Tensor sink_blocks, int sinks, Tensor staged_k, Tensor staged_k_scale, Tensor staged_v, "
      "Tensor staged_v_scale, Tensor tail_slots, Tensor key, Tensor value, float scale, "
      "Tensor(a!) out, Tensor(b!) lse) -> ()");
}

TORCH_LIBRARY_IMPL(lowbit_kv, CPU, m) {
  m.impl("exact_decode_attention", &exact_decode_attention);
}

}  // namespace lowbit_kv
