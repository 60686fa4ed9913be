// Dense attention over bfloat16 K/V with AVX-512 BF16 dot products: the exact part of a
// prefill chunk (its own tokens, causally), which torch's fused CPU attention computes in
// float32 at a fraction of the rate this ISA multiplies bf16 pairs.
//
// out[i, q] = sum_j softmax_j(scale * q_i . k_j) v_j over the keys j that row i sees
// (causal: j <= i + causal_offset; else all S), lse[i, q] the log-sum-exp of the scaled
// scores; query head q reads KV head q / G (G = Hq / H). Scores, softmax and sums are
// float32: VDPBF16PS multiplies bf16 pairs exactly and adds in float32; the probabilities
// are rounded to bf16 for the value sum (as flash attention does on GPUs). A flash loop:
// keys in blocks of 16, a running max and sum per query vector, rows in blocks so that a
// block of keys is laid out once for all the query vectors that read it.
//
// Built only where the compiler targets AVX-512 BF16 (-march=native on such a CPU);
// dense_attention_available() says whether it was, and Python falls back to torch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vectors.h"

namespace lowbit_kv {

bool dense_attention_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
namespace {

constexpr int KB = 16;  // keys per block: one score per lane
constexpr int RB = 32;  // query rows per work item
constexpr int kMaxD = 256;

struct Args {
  const uint16_t *q, *k, *v;          // bf16 bits
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;  // strides (elements) of dims 0 and 1
  int64_t n, S, Hq, H, D, offset;
  bool causal;
  float scale;
  float *out, *lse;
};

// rows [i0, i1) of KV head h: M = rows * G query vectors
void run_item(const Args& a, int64_t h, int64_t i0, int64_t i1) {
  const int64_t G = a.Hq / a.H, D = a.D, P = D / 2, M = (i1 - i0) * G;
  std::vector<uint32_t> qp(M * P), kt(P * KB), vt((KB / 2) * D);
  std::vector<float> acc(M * D, 0.f), mrun(M, -std::numeric_limits<float>::infinity()),
      lsum(M, 0.f);
  std::vector<int64_t> limit(M);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = i0 + m / G, hq = h * G + m % G;
    std::memcpy(&qp[m * P], a.q + i * a.qs0 + hq * a.qs1, D * sizeof(uint16_t));
    limit[m] = a.causal ? std::min(a.S, i + a.offset + 1) : a.S;  // keys [0, limit)
  }
  const int64_t jmax = *std::max_element(limit.begin(), limit.end());
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < jmax; j0 += KB) {
    const int nt = int(std::min<int64_t>(KB, jmax - j0));
    // keys: kt[p * KB + t] = channels (2p, 2p + 1) of key j0 + t; values: vt[pp * D + c] =
    // channel c of keys j0 + 2pp and j0 + 2pp + 1 (absent keys: 0)
    std::fill(kt.begin(), kt.end(), 0u);
    std::fill(vt.begin(), vt.end(), 0u);
    for (int t = 0; t < nt; ++t) {
      uint32_t kr[kMaxD / 2];
      std::memcpy(kr, a.k + (j0 + t) * a.ks0 + h * a.ks1, D * sizeof(uint16_t));
      for (int64_t p = 0; p < P; ++p) kt[p * KB + t] = kr[p];
      const uint16_t* vr = a.v + (j0 + t) * a.vs0 + h * a.vs1;
      uint16_t* dst = reinterpret_cast<uint16_t*>(vt.data() + (t / 2) * D) + (t % 2);
      for (int64_t c = 0; c < D; ++c) dst[2 * c] = vr[c];
    }
    for (int64_t m = 0; m < M; ++m) {
      const int64_t visible = std::min<int64_t>(nt, limit[m] - j0);
      if (visible <= 0) continue;
      // scores: four independent sums over the channel pairs (P = D / 2 is a multiple of
      // 8): one chain would wait on its own adds
      __m512 s4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                      _mm512_setzero_ps()};
      for (int64_t p = 0; p < P; p += 4)
        for (int u = 0; u < 4; ++u)
          s4[u] = _mm512_dpbf16_ps(s4[u], (__m512bh)_mm512_loadu_si512(&kt[(p + u) * KB]),
                                   (__m512bh)_mm512_set1_epi32(int(qp[m * P + p + u])));
      const __m512 s = _mm512_mask_mov_ps(
          neg_inf, __mmask16((1u << visible) - 1),
          _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(s4[0], s4[1]), _mm512_add_ps(s4[2], s4[3])),
                        _mm512_set1_ps(a.scale)));
      const float m_new = std::max(mrun[m], _mm512_reduce_max_ps(s));
      const float alpha = std::exp(mrun[m] - m_new);  // 0 for the first block
      const __m512 pr = (__m512)vexp((vf)_mm512_sub_ps(s, _mm512_set1_ps(m_new)));
      lsum[m] = lsum[m] * alpha + _mm512_reduce_add_ps(pr);
      mrun[m] = m_new;
      alignas(64) uint16_t pb[KB];
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb), (__m256i)_mm512_cvtneps_pbh(pr));
      // values: the D / 16 channel chunks are independent sums, key pairs in the outer loop
      float* am = &acc[m * D];
      const int64_t C = D / 16;
      __m512 o[kMaxD / 16];
      for (int64_t c = 0; c < C; ++c)
        o[c] = _mm512_mul_ps(_mm512_loadu_ps(am + 16 * c), _mm512_set1_ps(alpha));
      for (int pp = 0; pp < (nt + 1) / 2; ++pp) {
        uint32_t pair;
        std::memcpy(&pair, pb + 2 * pp, sizeof pair);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pair));
        for (int64_t c = 0; c < C; ++c)
          o[c] = _mm512_dpbf16_ps(o[c], (__m512bh)_mm512_loadu_si512(&vt[pp * D + 16 * c]), w);
      }
      for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(am + 16 * c, o[c]);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = i0 + m / G, hq = h * G + m % G;
    float* o = a.out + (i * a.Hq + hq) * D;
    const float inv = lsum[m] > 0.f ? 1.f / lsum[m] : 0.f;
    for (int64_t c = 0; c < D; ++c) o[c] = acc[m * D + c] * inv;
    a.lse[i * a.Hq + hq] = lsum[m] > 0.f ? mrun[m] + std::log(lsum[m])
                                         : -std::numeric_limits<float>::infinity();
  }
}

}  // namespace
#endif

void dense_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     bool causal, int64_t causal_offset, double scale, const at::Tensor& out,
                     const at::Tensor& lse) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(),
              "query [n, Hq, D], key and value [S, H, D]");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(2) == 1,
                "query, key, value: bfloat16 with unit stride in the last dim");
  const int64_t n = query.size(0), Hq = query.size(1), D = query.size(2), S = key.size(0),
                H = key.size(1);
  TORCH_CHECK(key.size(2) == D && D % 16 == 0 && D <= kMaxD,
              "head_dim: a multiple of 16 up to ", kMaxD, ", equal in q, k, v");
  TORCH_CHECK(H > 0 && Hq % H == 0, "query heads: a multiple of the KV heads");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.sizes() == query.sizes(),
              "out: float32 contiguous [n, Hq, D]");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 &&
                  lse.size(0) == n && lse.size(1) == Hq,
              "lse: float32 contiguous [n, Hq]");
  const Args a{reinterpret_cast<const uint16_t*>(query.data_ptr()),
               reinterpret_cast<const uint16_t*>(key.data_ptr()),
               reinterpret_cast<const uint16_t*>(value.data_ptr()),
               query.stride(0), query.stride(1), key.stride(0), key.stride(1),
               value.stride(0), value.stride(1), n, S, Hq, H, D, causal_offset, causal,
               float(scale), out.data_ptr<float>(), lse.data_ptr<float>()};
  const int64_t row_blocks = (n + RB - 1) / RB;
  at::parallel_for(0, H * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t h = it % H, i0 = (it / H) * RB;
      run_item(a, h, i0, std::min(n, i0 + RB));
    }
  });
#else
  TORCH_CHECK(false, "lowbit_kv::dense_attention: this build has no AVX-512 BF16");
#endif
}

TORCH_LIBRARY_FRAGMENT(lowbit_kv, m) {
  m.def("dense_attention_available() -> bool", &dense_attention_available);
  m.def(
      "dense_attention(Tensor query, Tensor key, Tensor value, bool causal, int causal_offset, "
      "float scale, Tensor(a!) out, Tensor(b!) lse) -> ()");
}

TORCH_LIBRARY_IMPL(lowbit_kv, CPU, m) { m.impl("dense_attention", &dense_attention); }

}  // namespace lowbit_kv
