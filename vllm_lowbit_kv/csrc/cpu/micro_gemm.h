// The two small matrix products of attention over a tile of keys and values, as vLLM's CPU
// micro-GEMM does them: broadcast one element of a query (or probability) row, multiply a
// vector of 16 keys (or channels), keep a block of accumulators in registers. Both CPU
// kernels use them through TileProducts (at the end): dense_attention.cpp for bf16/float32
// K/V, packed_attention.cpp for prefill chunks, on groups decoded to such tiles once for all
// their query vectors.
//
// Two tile types, one set of kernels: FloatTiles (float32 FMAs) and, where the build has
// AVX-512 BF16, Bf16PairTiles (VDPBF16PS: elements 2i and 2i + 1 of a row share one 32-bit
// word, both products exact, added to one float32 lane: twice the rate). A pair tile holds
// keys as pairs of channels per token (kp[p * ldk + t] = channels 2p, 2p + 1 of key t),
// values as pairs of tokens per channel (vp[i * D + c] = channel c of tokens 2i, 2i + 1),
// queries and probabilities as bf16 rows read two elements at a time. Where the build's CPU
// has AMX, TileProducts runs the pair products of whole 16-row blocks as tile multiplies
// (same layouts, see "AMX tiles"; 3x the dense kernel's speed on a 2-core Xeon,
// bench/results/prefill_exact_xeon.json).
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "vectors.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace lowbit_kv {
namespace {

// Float buffers of a work item in one zeroed 64-byte-aligned block, buffer i starting
// first_line + i cache lines past a 4 KiB boundary. Separate vectors often start at equal
// offsets modulo 4 KiB, and then the loads of one alias the stores of another in the CPU's
// store-to-load check: the value kernel ran at half speed on the second thread that way.
// (Pools used together start at different lines: TileProducts' past its callers'.)
class TilePool {
 public:
  explicit TilePool(std::initializer_list<int64_t> sizes, int first_line = 1) {
    int64_t at = 0;
    for (int64_t n : sizes) {
      at = (at + 1023) / 1024 * 1024 + 16 * int64_t(starts_.size() + first_line);
      starts_.push_back(at);
      at += n;
    }
    pool_.assign(size_t(at + 16), 0.f);
    base_ = aligned_floats(pool_.data());
  }
  float* operator[](size_t i) const { return base_ + starts_[i]; }

 private:
  std::vector<float> pool_;
  std::vector<int64_t> starts_;
  float* base_;
};

constexpr int kScoreRows = 6;  // query rows per score block (6 x kBlockVectors accumulators)
constexpr int kValueRows = 4;  // probability rows per value block (4 x kBlockVectors)
// vectors per block row: the accumulators, a row of B and a broadcast fill the registers
// (32 with AVX-512, 16 with AVX2)
constexpr int kBlockVectors = L == 16 ? 4 : 2;

template <int N>
using Int = std::integral_constant<int, N>;

// f(Int<B>{}, i) for i = 0, B, 2B, ... while a whole block of B fits in n, then once more
// with the rest (B <= 6): the block sizes become template arguments of the kernels
template <int B, typename F>
inline void in_blocks(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + B <= n; i += B) f(Int<B>{}, i);
  switch (n - i) {
    case 5: if constexpr (B > 5) f(Int<5>{}, i); break;
    case 4: if constexpr (B > 4) f(Int<4>{}, i); break;
    case 3: if constexpr (B > 3) f(Int<3>{}, i); break;
    case 2: if constexpr (B > 2) f(Int<2>{}, i); break;
    case 1: if constexpr (B > 1) f(Int<1>{}, i); break;
  }
}

// float32 elements, float32 FMAs
struct FloatTiles {
  using Elem = float;
  using Acc = vf;
  using B = vf;
  static constexpr int kPack = 1;  // elements per word
  static Acc zero() { return vf{}; }
  static Acc load_acc(const float* p) { return loadf(p); }
  static void store_acc(float* p, Acc a) { storef(p, a); }
  static B load(const Elem* p) { return loadf(p); }
  static B broadcast(Elem x) { return splat(x); }
  static Acc madd(Acc acc, B a, B b) { return acc + a * b; }
};

#if defined(__AVX512BF16__)
// bf16 pairs, VDPBF16PS
struct Bf16PairTiles {
  using Elem = uint32_t;
  using Acc = __m512;
  using B = __m512i;
  static constexpr int kPack = 2;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc load_acc(const float* p) { return _mm512_loadu_ps(p); }
  static void store_acc(float* p, Acc a) { _mm512_storeu_ps(p, a); }
  static B load(const Elem* p) { return _mm512_loadu_si512(p); }
  static B broadcast(Elem x) { return _mm512_set1_epi32(int(x)); }
  static Acc madd(Acc acc, B a, B b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
};
constexpr bool kBf16Tiles = true;
#else
constexpr bool kBf16Tiles = false;
#endif

// sc[r * ldc + t] = sum_k q[r * K + k] kt[k * ldk + t] for rows r < R, tokens t < NV L,
// over K words (D / kPack)
template <typename P, int R, int NV>
inline void score_block(const typename P::Elem* q, int64_t K, const typename P::Elem* kt,
                        int64_t ldk, float* sc, int64_t ldc) {
  typename P::Acc acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = P::zero();
  for (int64_t k = 0; k < K; ++k) {
    typename P::B b[NV];
    for (int j = 0; j < NV; ++j) b[j] = P::load(kt + k * ldk + j * L);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const typename P::B a = P::broadcast(q[r * K + k]);
      for (int j = 0; j < NV; ++j) acc[r][j] = P::madd(acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) P::store_acc(sc + r * ldc + j * L, acc[r][j]);
}

// Scores of M query rows (q: rows of D elements) against n keys given transposed (kt[k *
// ldk + t], k over words; n a multiple of L): sc[m * ldc + t] = q_m . k_t.
template <typename P>
inline void tile_scores(const typename P::Elem* q, int M, int64_t D, const typename P::Elem* kt,
                        int64_t ldk, int n, float* sc, int64_t ldc) {
  const int64_t K = D / P::kPack;
  in_blocks<kScoreRows>(M, [&](auto R, int64_t m) {
    in_blocks<kBlockVectors>(n / L, [&](auto NV, int64_t j) {
      score_block<P, decltype(R)::value, decltype(NV)::value>(q + m * K, K, kt + j * L, ldk,
                                                              sc + m * ldc + j * L, ldc);
    });
  });
}

// o[r * D + c] += sum_i p[r * ldp + i] v[i * D + c] for rows r < R, channels [c0, c0 + CW
// L), over `steps` words of p (tokens, or token pairs)
template <typename P, int R, int CW>
inline void value_block(const typename P::Elem* p, int64_t ldp, const typename P::Elem* v,
                        int64_t D, int64_t c0, int steps, float* o) {
  typename P::Acc acc[R][CW];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) acc[r][c] = P::load_acc(o + r * D + c0 + c * L);
  for (int i = 0; i < steps; ++i) {
    typename P::B b[CW];
    for (int c = 0; c < CW; ++c) b[c] = P::load(v + i * D + c0 + c * L);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const typename P::B a = P::broadcast(p[r * ldp + i]);
      for (int c = 0; c < CW; ++c) acc[r][c] = P::madd(acc[r][c], a, b[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) P::store_acc(o + r * D + c0 + c * L, acc[r][c]);
}

// Weighted value rows of M probability rows (ldp words apart) over n tokens (v: D channels
// per word row, D a multiple of L): o[m * D + c] += sum_t p[m, t] v_tc.
template <typename P>
inline void tile_values(const typename P::Elem* p, int64_t ldp, int M,
                        const typename P::Elem* v, int64_t D, int n, float* o) {
  const int steps = (n + P::kPack - 1) / P::kPack;
  in_blocks<kValueRows>(M, [&](auto R, int64_t m) {
    in_blocks<kBlockVectors>(D / L, [&](auto CW, int64_t c) {
      value_block<P, decltype(R)::value, decltype(CW)::value>(p + m * ldp, ldp, v, D, c * L,
                                                              steps, o + m * D);
    });
  });
}

#if defined(__AVX512BF16__)
// -- conversions to pair tiles ------------------------------------------------------------
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

// bf16 rows straight to pair tiles, no float round trip (the same words as key_pairs and
// value_pairs of the rows widened): key(t) -> D bf16 channels of key t (n keys, zero past
// them up to np, a multiple of L) -> kp [D / 2][ldk], a word per channel pair is a 32-bit
// transpose; value(t) likewise -> vp [ceil(n / 2)][D]
template <typename Row>
inline void key_pairs_bf16(Row key, int n, int np, int64_t D, uint32_t* kp, int64_t ldk) {
  rows_to_columns([&](int t, int p) { return loadf(reinterpret_cast<const float*>(key(t)) + p); },
                  n, np, int(D / 2), reinterpret_cast<float*>(kp), ldk);
}
template <typename Row>
inline void value_pairs_bf16(Row value, int n, int64_t D, uint32_t* vp) {
  for (int i = 0; 2 * i < n; ++i) {
    const uint16_t *a = value(2 * i), *b = 2 * i + 1 < n ? value(2 * i + 1) : nullptr;
    for (int64_t c = 0; c < D; c += L) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + c)));
      const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + c)))
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + i * D + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

#endif

#if defined(LOWBIT_AMX)
// -- AMX tiles ------------------------------------------------------------------------------
// Where the build's CPU has AMX and Linux grants this process the tile state, the pair
// tiles' products run as tile multiplies (TDPBF16PS: exact bf16 products, float32 sums, as
// VDPBF16PS, 16 rows at once). The pair layouts above are AMX's B operand as they stand
// (16 rows of 16 words: pairs of channels per token, pairs of tokens per channel), the bf16
// query and probability rows its A operand (amx.h: the grant and the tile configuration).

// tile_scores<Bf16PairTiles> for M16 rows (a multiple of 16), n keys (a multiple of 32), D
// channels (a multiple of 32)
inline void amx_scores(const uint32_t* q, int M16, int64_t D, const uint32_t* kp, int64_t ldk,
                       int n, float* sc, int64_t ldc) {
  load_tile_config();
  for (int m = 0; m < M16; m += 16)
    for (int t = 0; t < n; t += 32) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t k = 0; k < D / 2; k += 16) {  // 16 words: 32 channels
        _tile_loadd(2, q + m * D / 2 + k, D * 2);
        _tile_loadd(3, kp + k * ldk + t, ldk * 4);
        _tile_loadd(4, kp + k * ldk + t + 16, ldk * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
      }
      _tile_stored(0, sc + m * ldc + t, ldc * 4);
      _tile_stored(1, sc + m * ldc + t + 16, ldc * 4);
    }
}

// tile_values<Bf16PairTiles> for M16 rows (a multiple of 16) over `pairs` token pairs (a
// multiple of 16), D channels (a multiple of 32); p: ldp words per row
inline void amx_values(const uint32_t* p, int64_t ldp, int M16, const uint32_t* vp, int64_t D,
                       int pairs, float* o) {
  load_tile_config();
  for (int m = 0; m < M16; m += 16)
    for (int64_t c = 0; c < D; c += 32) {
      float* out = o + m * D + c;
      _tile_loadd(0, out, D * 4);
      _tile_loadd(1, out + 16, D * 4);
      for (int i = 0; i < pairs; i += 16) {
        _tile_loadd(2, p + m * ldp + i, ldp * 4);
        _tile_loadd(3, vp + i * D + c, D * 4);
        _tile_loadd(4, vp + i * D + c + 16, D * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
      }
      _tile_stored(0, out, D * 4);
      _tile_stored(1, out + 16, D * 4);
    }
}
#endif

// Q K^T and P V of a flash loop over tiles of float32 keys (transposed: kt[c * ldk + t])
// and values (rows: v[t * D + c]), for up to `rows` query vectors of D channels and up to
// `keys` keys per tile: float32 FMAs, or for bf16 inputs, where the build has AVX-512 BF16
// and D is a multiple of 2 L, bf16 pair tiles: exact bf16 products and float32 sums, the
// queries taken as given and the probabilities rounded to bf16, as vLLM's AMX and GPU
// flash attention do. Then bf16() is true and the softmax scale belongs on the scores.
// Per item queries(); per tile scores(), the softmax, values().
class TileProducts {
 public:
  // whether the products of bf16 inputs with D channels run on pair tiles
  static bool pairs_for(bool bf16_inputs, int64_t D) {
    return kBf16Tiles && bf16_inputs && D % (2 * L) == 0;
  }

  TileProducts(bool bf16_inputs, int64_t rows, int64_t D, int64_t keys)
      : bf16_(pairs_for(bf16_inputs, D)),
#if defined(LOWBIT_AMX)
        amx_(bf16_ && D % 32 == 0 && amx_granted()),
#endif
        D_(D),
        pairs_(bf16_ ? TilePool({rows * D / 2, D * keys / 2, keys * D / 2, rows * keys / 2, D},
                                kFirstLine)
                     : TilePool({})) {}

  bool bf16() const { return bf16_; }

  // M query vectors q[m * D + c], read by scores() until the next call
  void queries(const float* q, int M) {
    q_ = q;
    M_ = M;
#if defined(__AVX512BF16__)
    if (bf16_) bf16_row(q, int64_t(M) * D_, reinterpret_cast<uint16_t*>(words(kQuery)));
#endif
  }

  // sc[m * ldc + t] = q_m . k_t for n keys (a multiple of L)
  void scores(const float* kt, int64_t ldk, int n, float* sc, int64_t ldc) {
#if defined(__AVX512BF16__)
    if (bf16_) {
      key_pairs(kt, ldk, D_, n, words(kKeys));
      pair_scores(words(kKeys), ldk, n, sc, ldc);
      return;
    }
#endif
    tile_scores<FloatTiles>(q_, M_, D_, kt, ldk, n, sc, ldc);
  }

  // o[m * D + c] += sum_t p[m * ldp + t] v[t * D + c] over n tokens (ldp >= round_up(n))
  void values(const float* p, int64_t ldp, const float* v, int n, float* o) {
#if defined(__AVX512BF16__)
    if (bf16_) {
      value_pairs(v, D_, n, pairs_[kZeros], words(kValues));
      pair_values(p, ldp, words(kValues), n, o);
      return;
    }
#endif
    tile_values<FloatTiles>(p, ldp, M_, v, D_, n, o);
  }

#if defined(__AVX512BF16__)
  // scores() and values() of keys and values already in pair tiles (kp as key_pairs and
  // vp as value_pairs write them); bf16() only
  void pair_scores(const uint32_t* kp, int64_t ldk, int n, float* sc, int64_t ldc) {
    int done = 0;  // rows by AMX tiles, the rest by pair vectors
#if defined(LOWBIT_AMX)
    if (amx_ && n % 32 == 0) {
      done = M_ / 16 * 16;
      amx_scores(words(kQuery), done, D_, kp, ldk, n, sc, ldc);
    }
#endif
    tile_scores<Bf16PairTiles>(words(kQuery) + done * D_ / 2, M_ - done, D_, kp, ldk, n,
                               sc + done * ldc, ldc);
  }
  void pair_values(const float* p, int64_t ldp, const uint32_t* vp, int n, float* o) {
    for (int m = 0; m < M_; ++m) bf16_row(p + m * ldp, round_up(n), probabilities() + m * ldp);
    pair_values_bf16(ldp, vp, n, o);
  }
  // where pair_values_bf16 reads the probabilities: bf16 rows, row m at m * ldp
  uint16_t* probabilities() const { return reinterpret_cast<uint16_t*>(words(kProbabilities)); }
  // pair_values of probabilities already in probabilities() (softmax_rows writes them there)
  void pair_values_bf16(int64_t ldp, const uint32_t* vp, int n, float* o) {
    const uint32_t* pw = words(kProbabilities);
    int done = 0;
#if defined(LOWBIT_AMX)
    if (amx_ && n % 32 == 0) {
      done = M_ / 16 * 16;
      amx_values(pw, ldp / 2, done, vp, D_, n / 2, o);
    }
#endif
    tile_values<Bf16PairTiles>(pw + done * ldp / 2, ldp / 2, M_ - done, vp, D_, n,
                               o + done * D_);
  }
#endif

 private:
  enum Buffer { kQuery, kKeys, kValues, kProbabilities, kZeros };
  static constexpr int kFirstLine = 16;  // past the lines of the callers' pools
  uint32_t* words(Buffer b) const { return reinterpret_cast<uint32_t*>(pairs_[b]); }

  bool bf16_;
#if defined(LOWBIT_AMX)
  bool amx_;  // the bf16 products of whole 16-row blocks as AMX tile multiplies
#endif
  int64_t D_;
  TilePool pairs_;  // the pair tiles (bf16 only; no buffers otherwise)
  const float* q_ = nullptr;
  int M_ = 0;
};

}  // namespace
}  // namespace lowbit_kv
