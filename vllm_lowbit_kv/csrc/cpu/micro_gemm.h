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

}  // namespace
}  // namespace lowbit_kv
