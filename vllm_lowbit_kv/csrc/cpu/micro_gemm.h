// The two small matrix products of attention over a float tile of keys and values, as
// vLLM's CPU micro-GEMM does them: broadcast one element of a query (or probability) row,
// multiply a vector of 16 keys (or channels), keep a block of accumulators in registers.
// Both CPU kernels use them: dense_attention.cpp for bf16/float32 K/V, packed_attention.cpp
// for prefill chunks, on groups decoded to such tiles once for all their query vectors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "vectors.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace lowbit_kv {
namespace {

// Float buffers of a work item in one zeroed 64-byte-aligned block, buffer i starting
// i + 1 cache lines past a 4 KiB boundary. Separate vectors often start at equal offsets
// modulo 4 KiB, and then the loads of one alias the stores of another in the CPU's
// store-to-load check: the value kernel ran at half speed on the second thread that way.
class TilePool {
 public:
  explicit TilePool(std::initializer_list<int64_t> sizes) {
    int64_t at = 0;
    for (int64_t n : sizes) {
      at = (at + 1023) / 1024 * 1024 + 16 * int64_t(starts_.size() + 1);
      starts_.push_back(at);
      at += n;
    }
    pool_.assign(size_t(at + 16), 0.f);
    base_ = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(pool_.data()) + 63) &
                                     ~uintptr_t(63));
  }
  float* operator[](size_t i) const { return base_ + starts_[i]; }

 private:
  std::vector<float> pool_;
  std::vector<int64_t> starts_;
  float* base_;
};

constexpr int kScoreRows = 6;  // query rows per score block (6 x 4 accumulators)
constexpr int kValueRows = 4;  // probability rows per value block (4 x 4 accumulators)

// sc[r * ldc + t] = sum_d q[r * D + d] kt[d * ldk + t] for rows r < R, tokens t < NV L
template <int R, int NV>
inline void score_block(const float* q, int64_t D, const float* kt, int64_t ldk, float* sc,
                        int64_t ldc) {
  vf acc[R][NV] = {};
  for (int64_t d = 0; d < D; ++d) {
    vf b[NV];
    for (int j = 0; j < NV; ++j) b[j] = loadf(kt + d * ldk + j * L);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const vf a = splat(q[r * D + d]);
      for (int j = 0; j < NV; ++j) acc[r][j] += a * b[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) storef(sc + r * ldc + j * L, acc[r][j]);
}

template <int R>
inline void score_rows(const float* q, int64_t D, const float* kt, int64_t ldk, int n,
                       float* sc, int64_t ldc) {
  int t0 = 0;
  for (; t0 + 4 * L <= n; t0 += 4 * L) score_block<R, 4>(q, D, kt + t0, ldk, sc + t0, ldc);
  switch ((n - t0) / L) {
    case 3: score_block<R, 3>(q, D, kt + t0, ldk, sc + t0, ldc); break;
    case 2: score_block<R, 2>(q, D, kt + t0, ldk, sc + t0, ldc); break;
    case 1: score_block<R, 1>(q, D, kt + t0, ldk, sc + t0, ldc); break;
  }
}

// Scores of M query rows (q: rows of D floats, already scaled) against n keys given
// transposed (kt[d * ldk + t]; n a multiple of L): sc[m * ldc + t] = q_m . k_t.
inline void tile_scores(const float* q, int M, int64_t D, const float* kt, int64_t ldk, int n,
                        float* sc, int64_t ldc) {
  int m = 0;
  for (; m + kScoreRows <= M; m += kScoreRows)
    score_rows<kScoreRows>(q + m * D, D, kt, ldk, n, sc + m * ldc, ldc);
  switch (M - m) {
    case 5: score_rows<5>(q + m * D, D, kt, ldk, n, sc + m * ldc, ldc); break;
    case 4: score_rows<4>(q + m * D, D, kt, ldk, n, sc + m * ldc, ldc); break;
    case 3: score_rows<3>(q + m * D, D, kt, ldk, n, sc + m * ldc, ldc); break;
    case 2: score_rows<2>(q + m * D, D, kt, ldk, n, sc + m * ldc, ldc); break;
    case 1: score_rows<1>(q + m * D, D, kt, ldk, n, sc + m * ldc, ldc); break;
  }
}

// o[r * D + c] += sum_{t < n} p[r * ldp + t] v[t * D + c] for rows r < R, channels
// [c0, c0 + CW L)
template <int R, int CW>
inline void value_block(const float* p, int64_t ldp, const float* v, int64_t D, int64_t c0,
                        int n, float* o) {
  vf acc[R][CW];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) acc[r][c] = loadf(o + r * D + c0 + c * L);
  for (int t = 0; t < n; ++t) {
    vf b[CW];
    for (int c = 0; c < CW; ++c) b[c] = loadf(v + t * D + c0 + c * L);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const vf a = splat(p[r * ldp + t]);
      for (int c = 0; c < CW; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) storef(o + r * D + c0 + c * L, acc[r][c]);
}

template <int R>
inline void value_rows(const float* p, int64_t ldp, const float* v, int64_t D, int n, float* o) {
  int64_t c0 = 0;
  for (; c0 + 4 * L <= D; c0 += 4 * L) value_block<R, 4>(p, ldp, v, D, c0, n, o);
  switch ((D - c0) / L) {
    case 3: value_block<R, 3>(p, ldp, v, D, c0, n, o); break;
    case 2: value_block<R, 2>(p, ldp, v, D, c0, n, o); break;
    case 1: value_block<R, 1>(p, ldp, v, D, c0, n, o); break;
  }
}

// Weighted value rows of M probability rows over n value rows (v[t * D + c], D a multiple
// of L): o[m * D + c] += sum_t p[m * ldp + t] v_tc.
inline void tile_values(const float* p, int64_t ldp, int M, const float* v, int64_t D, int n,
                        float* o) {
  int m = 0;
  for (; m + kValueRows <= M; m += kValueRows)
    value_rows<kValueRows>(p + m * ldp, ldp, v, D, n, o + m * D);
  switch (M - m) {
    case 3: value_rows<3>(p + m * ldp, ldp, v, D, n, o + m * D); break;
    case 2: value_rows<2>(p + m * ldp, ldp, v, D, n, o + m * D); break;
    case 1: value_rows<1>(p + m * ldp, ldp, v, D, n, o + m * D); break;
  }
}

#if defined(__AVX512BF16__)
// -- bf16 pair tiles (AVX-512 BF16) ---------------------------------------------------------
// The same products at twice the rate: elements 2i and 2i + 1 of a row share one 32-bit
// word, and VDPBF16PS multiplies both pairs exactly and adds them to one float32 lane.
// Keys as pairs of channels per token (kp[p * ldk + t] = channels 2p, 2p + 1 of key t),
// values as pairs of tokens per channel (vp[i * D + c] = channel c of tokens 2i, 2i + 1),
// queries and probabilities as bf16 rows read two elements at a time.
constexpr bool kBf16Tiles = true;

// 16 floats of a and 16 of b -> 16 words (a_l, b_l) rounded to bf16 (a in the low half)
inline __m512i pair_words(const float* a, const float* b) {
  const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(b), _mm512_loadu_ps(a));
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                              25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                              18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, ab);
}

// n floats (n a multiple of 16) -> n bf16 in order, rounded to nearest even
inline void bf16_row(const float* x, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L)
    _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + L),
                                                              _mm512_loadu_ps(x + i)));
  if (i < n)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

// float tiles -> pair tiles: kt [D][ldk] -> kp [D / 2][ldk] (n tokens, a multiple of L);
// v [n][D] -> vp [ceil(n / 2)][D] (an odd last token paired with zeros)
inline void key_pairs(const float* kt, int64_t ldk, int64_t D, int n, uint32_t* kp) {
  for (int64_t p = 0; p < D / 2; ++p)
    for (int t = 0; t < n; t += L)
      _mm512_storeu_si512(kp + p * ldk + t,
                          pair_words(kt + 2 * p * ldk + t, kt + (2 * p + 1) * ldk + t));
}
inline void value_pairs(const float* v, int64_t D, int n, const float* zeros, uint32_t* vp) {
  for (int i = 0; 2 * i < n; ++i)
    for (int64_t c = 0; c < D; c += L)
      _mm512_storeu_si512(vp + i * D + c,
                          pair_words(v + 2 * i * D + c, 2 * i + 1 < n ? v + (2 * i + 1) * D + c
                                                                      : zeros));
}

template <int R, int NV>
inline void score_block_bf16(const uint32_t* qp, int64_t P, const uint32_t* kp, int64_t ldk,
                             float* sc, int64_t ldc) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512i b[NV];
    for (int j = 0; j < NV; ++j) b[j] = _mm512_loadu_si512(kp + p * ldk + j * L);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(int(qp[r * P + p]));
      for (int j = 0; j < NV; ++j)
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)a, (__m512bh)b[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(sc + r * ldc + j * L, acc[r][j]);
}

template <int R>
inline void score_rows_bf16(const uint32_t* qp, int64_t P, const uint32_t* kp, int64_t ldk,
                            int n, float* sc, int64_t ldc) {
  int t0 = 0;
  for (; t0 + 4 * L <= n; t0 += 4 * L) score_block_bf16<R, 4>(qp, P, kp + t0, ldk, sc + t0, ldc);
  switch ((n - t0) / L) {
    case 3: score_block_bf16<R, 3>(qp, P, kp + t0, ldk, sc + t0, ldc); break;
    case 2: score_block_bf16<R, 2>(qp, P, kp + t0, ldk, sc + t0, ldc); break;
    case 1: score_block_bf16<R, 1>(qp, P, kp + t0, ldk, sc + t0, ldc); break;
  }
}

// tile_scores over pair tiles: qp holds M rows of D bf16 (P = D / 2 words each)
inline void tile_scores_bf16(const uint32_t* qp, int M, int64_t D, const uint32_t* kp,
                             int64_t ldk, int n, float* sc, int64_t ldc) {
  const int64_t P = D / 2;
  int m = 0;
  for (; m + kScoreRows <= M; m += kScoreRows)
    score_rows_bf16<kScoreRows>(qp + m * P, P, kp, ldk, n, sc + m * ldc, ldc);
  switch (M - m) {
    case 5: score_rows_bf16<5>(qp + m * P, P, kp, ldk, n, sc + m * ldc, ldc); break;
    case 4: score_rows_bf16<4>(qp + m * P, P, kp, ldk, n, sc + m * ldc, ldc); break;
    case 3: score_rows_bf16<3>(qp + m * P, P, kp, ldk, n, sc + m * ldc, ldc); break;
    case 2: score_rows_bf16<2>(qp + m * P, P, kp, ldk, n, sc + m * ldc, ldc); break;
    case 1: score_rows_bf16<1>(qp + m * P, P, kp, ldk, n, sc + m * ldc, ldc); break;
  }
}

template <int R, int CW>
inline void value_block_bf16(const uint32_t* pp, int64_t ldp, const uint32_t* vp, int64_t D,
                             int64_t c0, int pairs, float* o) {
  __m512 acc[R][CW];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + c0 + c * L);
  for (int i = 0; i < pairs; ++i) {
    __m512i b[CW];
    for (int c = 0; c < CW; ++c) b[c] = _mm512_loadu_si512(vp + i * D + c0 + c * L);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(int(pp[r * ldp + i]));
      for (int c = 0; c < CW; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)a, (__m512bh)b[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) _mm512_storeu_ps(o + r * D + c0 + c * L, acc[r][c]);
}

template <int R>
inline void value_rows_bf16(const uint32_t* pp, int64_t ldp, const uint32_t* vp, int64_t D,
                            int pairs, float* o) {
  int64_t c0 = 0;
  for (; c0 + 4 * L <= D; c0 += 4 * L) value_block_bf16<R, 4>(pp, ldp, vp, D, c0, pairs, o);
  switch ((D - c0) / L) {
    case 3: value_block_bf16<R, 3>(pp, ldp, vp, D, c0, pairs, o); break;
    case 2: value_block_bf16<R, 2>(pp, ldp, vp, D, c0, pairs, o); break;
    case 1: value_block_bf16<R, 1>(pp, ldp, vp, D, c0, pairs, o); break;
  }
}

// tile_values over pair tiles: pp holds M rows of bf16 probabilities (ldp words apart),
// n tokens (vp: ceil(n / 2) token pairs)
inline void tile_values_bf16(const uint32_t* pp, int64_t ldp, int M, const uint32_t* vp,
                             int64_t D, int n, float* o) {
  const int pairs = (n + 1) / 2;
  int m = 0;
  for (; m + kValueRows <= M; m += kValueRows)
    value_rows_bf16<kValueRows>(pp + m * ldp, ldp, vp, D, pairs, o + m * D);
  switch (M - m) {
    case 3: value_rows_bf16<3>(pp + m * ldp, ldp, vp, D, pairs, o + m * D); break;
    case 2: value_rows_bf16<2>(pp + m * ldp, ldp, vp, D, pairs, o + m * D); break;
    case 1: value_rows_bf16<1>(pp + m * ldp, ldp, vp, D, pairs, o + m * D); break;
  }
}
#else
constexpr bool kBf16Tiles = false;
#endif

}  // namespace
}  // namespace lowbit_kv
