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
// once, then scores, softmax and value sums for the G query heads that share them. Scores
// L keys at a time (each key's products summed lane-wise, then the L sums of L vectors by
// one butterfly: about 3 instructions a key, where a horizontal sum per key took 8); value
// sums for up to kHeadsPerPass heads at once, so that each value row is loaded once.

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

// One butterfly stage of lane_sums: vector i and vector i + COUNT / 2 give their blocks of 2H
// lanes as blocks of H (each lane the sum of a lane and the one H after it), side by side
template <int H, int COUNT>
inline void halve_blocks(vf* x) {
  const vi lane = iota(), block = lane / H;
  const vi lo = (block & 1) * L + (block >> 1) * (2 * H) + lane % H, hi = lo + H;
  for (int i = 0; i < COUNT / 2; ++i) {
    const vf a = x[i], b = x[i + COUNT / 2];
    x[i] = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
  }
  if constexpr (H > 1) halve_blocks<H / 2, COUNT / 2>(x);
}

// lane j of the result = the sum of x[j]'s lanes, for L vectors x (overwritten): log2(L)
// stages of halve_blocks, the blocks in vector order at the end
inline vf lane_sums(vf* x) {
  halve_blocks<L / 2, L>(x);
  return x[0];
}

// sc[j] = scale q . k_j + bias[j] for keys j in [0, n) over NC L channels (the query's
// vectors in registers; rows of k ld floats apart), or sc[j] += scale q . k_j without bias;
// sc holds round_up(n) floats, the lanes past n junk
template <int NC>
void channel_scores(const float* q, const float* k, int64_t ld, int n, float scale,
                    const float* bias, float* sc) {
  vf qv[NC];
  for (int u = 0; u < NC; ++u) qv[u] = loadf(q + u * L);
  for (int j0 = 0; j0 < n; j0 += L) {
    vf part[L];
    for (int jj = 0; jj < L; ++jj) {
      const float* row = k + (j0 + std::min(jj, n - 1 - j0)) * ld;  // past n: a real row
      vf a = qv[0] * loadf(row), b = vf{};  // two chains of multiply-adds
      for (int u = 1; u < NC; ++u) (u % 2 ? b : a) += qv[u] * loadf(row + u * L);
      part[jj] = a + b;
    }
    storef(sc + j0, lane_sums(part) * scale + loadf(bias ? bias + j0 : sc + j0));
  }
}

// channel_scores over all D channels (a multiple of L), at most 8 vectors at a time
inline void key_scores(const float* q, const float* k, int n, int64_t D, float scale,
                       const float* bias, float* sc) {
  for (int64_t c = 0; c < D; c += 8 * L, bias = nullptr) {
    switch (std::min<int64_t>(8, (D - c) / L)) {
      case 1: channel_scores<1>(q + c, k + c, D, n, scale, bias, sc); break;
      case 2: channel_scores<2>(q + c, k + c, D, n, scale, bias, sc); break;
      case 3: channel_scores<3>(q + c, k + c, D, n, scale, bias, sc); break;
      case 4: channel_scores<4>(q + c, k + c, D, n, scale, bias, sc); break;
      case 5: channel_scores<5>(q + c, k + c, D, n, scale, bias, sc); break;
      case 6: channel_scores<6>(q + c, k + c, D, n, scale, bias, sc); break;
      case 7: channel_scores<7>(q + c, k + c, D, n, scale, bias, sc); break;
      default: channel_scores<8>(q + c, k + c, D, n, scale, bias, sc);
    }
  }
}

constexpr int kHeadsPerPass = 4;

// o_g[c0, c0 + NV L) = inv[g] sum_j p_g[j] v[j * D + c0 + (0, NV L)] for GB heads g (p_g at
// p + g ldp): the GB NV sums in registers, every value vector loaded once for all GB heads
template <int NV, int GB>
void value_sums(const float* p, int64_t ldp, int n, const float* v, int64_t D, int64_t c0,
                const float* inv, float* const* o) {
  vf a[GB][NV] = {};
  for (int j = 0; j < n; ++j) {
    vf x[NV];
    for (int u = 0; u < NV; ++u) x[u] = loadf(v + j * D + c0 + u * L);
    for (int g = 0; g < GB; ++g) {
      const vf pj = splat(p[g * ldp + j]);
      for (int u = 0; u < NV; ++u) a[g][u] += pj * x[u];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int u = 0; u < NV; ++u) storef(o[g] + c0 + u * L, a[g][u] * inv[g]);
}

template <int NV>
void value_sums_heads(const float* p, int64_t ldp, int G, int n, const float* v, int64_t D,
                      int64_t c0, const float* inv, float* const* o) {
  for (int g = 0; g < G; g += kHeadsPerPass) {
    const float* pg = p + g * ldp;
    switch (std::min(kHeadsPerPass, G - g)) {
      case 1: value_sums<NV, 1>(pg, ldp, n, v, D, c0, inv + g, o + g); break;
      case 2: value_sums<NV, 2>(pg, ldp, n, v, D, c0, inv + g, o + g); break;
      case 3: value_sums<NV, 3>(pg, ldp, n, v, D, c0, inv + g, o + g); break;
      default: value_sums<NV, 4>(pg, ldp, n, v, D, c0, inv + g, o + g);
    }
  }
}

// o_g[0, D) = inv[g] sum_j p_g[j] v[j * D + (0, D)] for the G heads: value_sums_heads over
// the channels, at most 4 vectors at a time
void output_rows(const float* p, int64_t ldp, int G, int n, const float* v, int64_t D,
                 const float* inv, float* const* o) {
  for (int64_t c0 = 0; c0 < D; c0 += 4 * L) {
    switch (std::min<int64_t>(4, (D - c0) / L)) {
      case 1: value_sums_heads<1>(p, ldp, G, n, v, D, c0, inv, o); break;
      case 2: value_sums_heads<2>(p, ldp, G, n, v, D, c0, inv, o); break;
      case 3: value_sums_heads<3>(p, ldp, G, n, v, D, c0, inv, o); break;
      default: value_sums_heads<4>(p, ldp, G, n, v, D, c0, inv, o);
    }
  }
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
    const size_t keys = size_t(E), width = size_t(D), padded = size_t(round_up(int(E)));
    std::vector<float> krows(keys * width), vrows(keys * width), q(size_t(G) * width);
    std::vector<float> live_bias(padded), sc(size_t(G) * padded);
    std::vector<float> mrun(G), lsum(G), corr(G), inv(G);
    std::vector<int> ends(G);
    std::vector<float*> o(G);
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
      for (int64_t g = 0; g < G; ++g) {
        const int64_t qh = h * G + g;
        float* qv = q.data() + g * D;
        q_in.row(row, qh, 0, 0, D, 1.f, qv);
        if (live) key_scores(qv, krows.data(), live, D, float(scale), live_bias.data(),
                             sc.data() + g * padded);
        mrun[g] = kNoKey;
        lsum[g] = 0.f;
        ends[g] = live;
        o[g] = out_p + (row * Hq + qh) * D;
      }
      softmax_rows(sc.data(), int(G), int64_t(padded), round_up(live), 0, ends.data(), 1.f,
                   mrun.data(), lsum.data(), nullptr, 0, corr.data());
      for (int64_t g = 0; g < G; ++g) {
        inv[g] = lsum[g] > 0.f ? 1.f / lsum[g] : 0.f;
        lse_p[row * Hq + h * G + g] = lsum[g] > 0.f ? mrun[g] + std::log(lsum[g]) : kNoKey;
      }
      output_rows(sc.data(), padded, int(G), live, vrows.data(), D, inv.data(), o.data());
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
