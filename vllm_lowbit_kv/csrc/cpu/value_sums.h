// Sums of a group's value rows weighted by probabilities, acc_w[m * D + c] = sum_i
// p[m * TP + pos[i]] x(i, c), for a block of query vectors, vectorized over channels with the
// sums in registers (the per-channel scales are applied once afterwards,
// packed_attention.cpp, accumulate_values). Value codes (KIVI 2/4/8-bit, STP rows) and
// trits (five a byte) are decoded in registers as they are summed (AVX-512 or AVX2; the
// generic conversions, for any other CPU, are scalar loops). With AVX-512 VNNI and head_dim
// 64 or 128, consecutive rows of trits and of 2- and 4-bit codes are summed two at a time in
// integers (pair_sums): the group's probabilities in 32767 steps of their largest (each off
// by at most half a step, finer than the bf16 probabilities of flash attention's and vLLM's
// bf16 paths), so the output moves by at most T max|code value| / 65534 (a trit's alpha; a
// code's levels times its scale).
//
// Part of packed_attention.cpp, which includes it once (internal linkage, as vectors.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vectors.h"

namespace lowbit_kv {
namespace {

// psum[m0 + m] = sum_i p[(m0 + m) TP + pos[i]] over rows [0, n) for MB query vectors
template <int MB>
void probability_sums(const int* pos, int n, const float* p, int TP, float* psum, int m0) {
  for (int m = 0; m < MB; ++m) {
    float s[4] = {0.f, 0.f, 0.f, 0.f};  // independent partial sums
    for (int i = 0; i < n; ++i) s[i & 3] += p[(m0 + m) * TP + pos[i]];
    psum[m0 + m] = (s[0] + s[1]) + (s[2] + s[3]);
  }
}

// -- rows of trits (five a byte) ----------------------------------------------------------
// Digit d of a byte b of five trits, in 16-bit lanes: ((b kTritMul[d] mod 2^16) 3) >> 16,
// kTritMul[d] = ceil(2^16 / 3^(d + 1)) (exact for every b < 243: the fraction of
// b / 3^(d + 1), times 3, floored)
constexpr int kTritMul[5] = {21846, 7282, 2428, 810, 270};

#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
// 64 bytes hold 320 trits; output vector j (trits 64j .. 64j + 63) takes lane l from byte
// (64j + l) / 5, digit (64j + l) % 5: one byte permute, then the digits by kTritMul.
struct TritSimd {
  __m512i perm[5], mul[5][2];
  TritSimd() {
    alignas(64) uint8_t p[64];
    alignas(64) uint16_t m[2][32];
    for (int j = 0; j < 5; ++j) {
      for (int l = 0; l < 64; ++l) {
        const int t = 64 * j + l, digit = t % 5;
        p[l] = uint8_t(t / 5);
        m[l / 32][l % 32] = uint16_t(kTritMul[digit]);
      }
      perm[j] = _mm512_load_si512(p);
      for (int h = 0; h < 2; ++h) mul[j][h] = _mm512_load_si512(m[h]);
    }
  }
};
static const TritSimd kTritSimd;

// the digits (trit + 1) of bytes zero-extended in 16-bit lanes, mul the kTritMul of each
inline __m512i trit_digits(__m512i bytes16, __m512i mul) {
  return _mm512_mulhi_epu16(_mm512_mullo_epi16(bytes16, mul), _mm512_set1_epi16(3));
}

inline __m512i trits16(__m512i bytes16, __m512i mul) {
  return _mm512_sub_epi16(trit_digits(bytes16, mul), _mm512_set1_epi16(1));
}

// the bytes of raw that perm's even bytes select, zero-extended into 16-bit lanes
inline __m512i bytes_to_words(__m512i perm, __m512i raw) {
  return _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, perm, raw);
}

// n trits -> int8 in {-1, 0, 1}; dst holds round_up(n, 64) bytes
inline void decode_trits(const uint8_t* src, int n, int8_t* dst) {
  const int bytes = (n + 4) / 5;
  for (int b0 = 0; b0 < bytes; b0 += 64) {
    const __m512i v = b0 + 64 <= bytes
                          ? _mm512_loadu_si512(src + b0)
                          : _mm512_maskz_loadu_epi8((1ull << (bytes - b0)) - 1, src + b0);
    for (int j = 0; j < 5 && 5 * b0 + 64 * j < n; ++j) {
      const __m512i g = _mm512_permutexvar_epi8(kTritSimd.perm[j], v);
      const __m512i* mul = kTritSimd.mul[j];
      const __m256i lo = _mm512_cvtepi16_epi8(
          trits16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(g)), mul[0]));
      const __m256i hi = _mm512_cvtepi16_epi8(
          trits16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(g, 1)), mul[1]));
      _mm512_storeu_si512(dst + 5 * b0 + 64 * j,
                          _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    }
  }
}

// The same trits for the fused row sums below, with the bytes of each 32-channel half
// permuted straight into 16-bit lanes (zero-extended) and ordered so that lane 2i holds
// channel i and lane 2i + 1 channel 16 + i: then the trits, as bf16 in every 16-bit lane,
// become two float32 vectors of 16 channels in order by a shift and a mask (no
// conversions, no widening shuffles).
struct TritLanes {
  __m512i perm[5][2], mul[5][2];
  TritLanes() {
    for (int j = 0; j < 5; ++j)
      for (int h = 0; h < 2; ++h) {
        alignas(64) uint8_t p[64] = {};
        alignas(64) uint16_t m[32];
        for (int k = 0; k < 32; ++k) {
          const int t = 64 * j + 32 * h + (k % 2 ? 16 : 0) + k / 2;
          p[2 * k] = uint8_t(t / 5);
          m[k] = uint16_t(kTritMul[t % 5]);
        }
        perm[j][h] = _mm512_load_si512(p);
        mul[j][h] = _mm512_load_si512(m);
      }
  }
};
static const TritLanes kTritLanes;

// acc_w[m * D + c] = sum_i p[m * TP + pos[i]] trit(i, c) for MB query vectors from m0, over
// rows [0, n) of D trits (D a multiple of 64), decoded in registers: 64 bytes hold 320
// trits, five vectors of 64 channels of one row each; nothing is stored in between. A trit
// t is read as the float 2t (bf16 bits (digit - 1) << 14 moved to the top of a 32-bit
// lane), so the sums are halved at the end (exact).
template <int MB>
void ternary_row_sums(const uint8_t* src, int n, int D, const int* pos, const float* p, int TP,
                      float* acc_w, int m0) {
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  const int64_t bytes = (int64_t(n) * D + 4) / 5;
  // row i's 64-trit vector j of the stream (as phase j of its 64 bytes) into the sums
  auto add_row = [&](__m512 (*acc)[4], __m512i raw, int j, int i) {
    __m512 x[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i bytes16 = bytes_to_words(kTritLanes.perm[j][h], raw);
      const __m512i bf = _mm512_slli_epi16(trits16(bytes16, kTritLanes.mul[j][h]), 14);
      x[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(bf, 16));
      x[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(bf, top));
    }
    const int at = pos[i];
    for (int m = 0; m < MB; ++m) {
      const __m512 pm = _mm512_set1_ps(p[(m0 + m) * TP + at]);
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_fmadd_ps(x[v], pm, acc[m][v]);
    }
  };
  for (int c0 = 0; c0 < D; c0 += 64) {
    __m512 acc[MB][4];
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
    // five rows are D whole bytes: row r of every five takes its vector at the same place
    // and phase (no divisions in the loop)
    int phase[5];
    int64_t offset[5];
    for (int r = 0; r < 5; ++r) {
      const int u = r * (D / 64) + c0 / 64;
      phase[r] = u % 5;
      offset[r] = u / 5 * 64;
    }
    int i = 0;
    for (; i + 5 <= n; i += 5) {
      const uint8_t* five = src + int64_t(i) / 5 * D;
#pragma GCC unroll 5
      for (int r = 0; r < 5; ++r)
        add_row(acc, _mm512_loadu_si512(five + offset[r]), phase[r], i + r);
    }
    for (; i < n; ++i) {
      const int64_t u = (int64_t(i) * D + c0) / 64;  // 64-trit vector of the stream
      const int64_t b0 = u / 5 * 64;
      const __m512i raw = b0 + 64 <= bytes
                              ? _mm512_loadu_si512(src + b0)
                              : _mm512_maskz_loadu_epi8((1ull << (bytes - b0)) - 1, src + b0);
      add_row(acc, raw, int(u % 5), i);
    }
    const __m512 half = _mm512_set1_ps(0.5f);
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < 4; ++v)
        _mm512_storeu_ps(acc_w + (m0 + m) * D + c0 + v * L, _mm512_mul_ps(acc[m][v], half));
  }
}
#define LOWBIT_FUSED_TRITS 64  // ternary_row_sums takes D a multiple of this

#if defined(__AVX512VNNI__)
// Value rows summed two at a time through VNNI (pair_sums), for head_dim 64 or 128 where
// both rows of a pair lie in the 64 bytes from the first one's first byte: a query
// vector's probabilities of the group's rows as 16-bit fixed point (32767 steps of their
// largest, rounded to nearest: each off by at most half a step), a row pair's two in every
// 32-bit lane, against the rows' codes in the lanes' 16-bit halves: one vpdpwssd adds both
// rows' products for 16 channels, twice the float multiply-adds' work at their rate, and
// the codes stay in 16-bit lanes (no float conversion). Integer sums are exact; the
// output moves by at most T max|code| / 65534 of the largest probability.
constexpr float kPairScale = 32767.f;  // the fixed point's full scale

// Rows of trits (five a byte, rows back to back): rows A = 2k and B = 2k + 1 of every ten
// (2 D bytes, k < 5) start in byte 2 k D / 5, at digit 2 k D % 5. Quarter q (channels
// 16 q .. 16 q + 15): 16-bit lane 2i takes the byte of A's channel 16 q + i, lane 2i + 1
// that of B's (zero-extended), mul the kTritMul of each one's digit; codes are the digits
// (trit + 1).
struct TritPairs {
  static constexpr int kPhases = 5;
  int offset[5];
  __m512i perm[5][8], mul[5][8];
  explicit TritPairs(int D) {
    for (int k = 0; k < 5; ++k) {
      offset[k] = 2 * k * D / 5;
      const int phase = 2 * k * D % 5;
      for (int q = 0; q < D / 16; ++q) {
        alignas(64) uint8_t pm[64] = {};
        alignas(64) uint16_t m[32];
        for (int lane = 0; lane < 32; ++lane) {
          const int t = phase + (lane % 2) * D + 16 * q + lane / 2;
          pm[2 * lane] = uint8_t(t / 5);
          m[lane] = uint16_t(kTritMul[t % 5]);
        }
        perm[k][q] = _mm512_load_si512(pm);
        mul[k][q] = _mm512_load_si512(m);
      }
    }
  }
  int64_t start(int pair, int D) const { return int64_t(pair / 5) * 2 * D + offset[pair % 5]; }
  __m512i codes(__m512i raw, int k, int q) const {
    return trit_digits(bytes_to_words(perm[k][q], raw), mul[k][q]);
  }
};
static const TritPairs kTritPairs64(64), kTritPairs128(128);

// Rows of D b-bit codes (b = 2 or 4, D b / 8 bytes each, back to back; a pair at most 64
// bytes): quarter q's lane 2i takes the byte of A's channel 16 q + i, lane 2i + 1 B's,
// shifted right to the code and masked.
struct CodePairs {
  static constexpr int kPhases = 1;
  int row_bytes;
  __m512i perm[8], shift[8], mask;
  CodePairs(int D, int bits) : row_bytes(D * bits / 8), mask(_mm512_set1_epi16((1 << bits) - 1)) {
    for (int q = 0; q < D / 16; ++q) {
      alignas(64) uint8_t pm[64] = {};
      alignas(64) uint16_t sh[32];
      for (int lane = 0; lane < 32; ++lane) {
        const int bit = (16 * q + lane / 2) * bits;
        pm[2 * lane] = uint8_t((lane % 2) * row_bytes + bit / 8);
        sh[lane] = uint16_t(bit % 8);
      }
      perm[q] = _mm512_load_si512(pm);
      shift[q] = _mm512_load_si512(sh);
    }
  }
  int64_t start(int pair, int) const { return int64_t(pair) * 2 * row_bytes; }
  __m512i codes(__m512i raw, int, int q) const {
    return _mm512_and_si512(_mm512_srlv_epi16(bytes_to_words(perm[q], raw), shift[q]), mask);
  }
};
static const CodePairs kCodePairs2x64(64, 2), kCodePairs2x128(128, 2), kCodePairs4x64(64, 4);

// p[m * TP + i] for MB query vectors from m0 -> fixed[m * stride + i] (16-bit, rows
// [0, n), row n 0), their step unit[m] and the sum of each one's fixed-point values
template <int MB>
void fixed_point_rows(int n, const float* p, int TP, int m0, int stride, int16_t* fixed,
                      float* unit, int32_t* fixed_sum) {
  auto lanes = [n](int i) {  // rows [i, i + 16) that exist
    return n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
  };
  for (int m = 0; m < MB; ++m) {
    const float* rows = p + (m0 + m) * TP;
    __m512 top = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16)
      top = _mm512_max_ps(top, _mm512_maskz_loadu_ps(lanes(i), rows + i));
    const float largest = _mm512_reduce_max_ps(top);
    const __m512 to_fixed = _mm512_set1_ps(largest > 0.f ? kPairScale / largest : 0.f);
    unit[m] = largest / kPairScale;
    int16_t* fm = fixed + m * stride;
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < n; i += 16) {
      const __m512 row_p = _mm512_maskz_loadu_ps(lanes(i), rows + i);
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(row_p, to_fixed));
      sum = _mm512_add_epi32(sum, v);
      _mm512_mask_cvtepi32_storeu_epi16(fm + i, lanes(i), v);
    }
    fm[n] = 0;  // the odd row's partner
    fixed_sum[m] = _mm512_reduce_add_epi32(sum);
  }
}

// acc_w[m * D + c] = sum_i p[m * TP + i] (code(i, c) - offset) for MB query vectors from
// m0 over rows [0, n) of `rows` (a stream of `bytes` bytes); fixed: scratch of MB (n + 2)
// int16
template <int MB, typename Pairs>
void pair_sums(const Pairs& rows, const uint8_t* src, int64_t bytes, int n, int D, int offset,
               const float* p, int TP, float* acc_w, int16_t* fixed, int m0) {
  const int stride = (n + 2) & ~1;  // even, so that every pair is one aligned 32-bit word
  float unit[MB];
  int32_t fixed_sum[MB];
  fixed_point_rows<MB>(n, p, TP, m0, stride, fixed, unit, fixed_sum);
  constexpr int K = Pairs::kPhases;
  const int pairs = (n + 1) / 2;
  constexpr int Q = MB <= 4 ? 4 : 2;  // quarters a pass: MB Q sums in registers
  for (int q0 = 0; q0 < D / 16; q0 += Q) {
    __m512i acc[MB][Q];
    for (int m = 0; m < MB; ++m)
      for (int q = 0; q < Q; ++q) acc[m][q] = _mm512_setzero_si512();
    auto add_pair = [&](__m512i raw, int k, int j) {
      __m512i pair[MB];
      for (int m = 0; m < MB; ++m) {
        int32_t word;
        std::memcpy(&word, fixed + m * stride + 2 * j, 4);
        pair[m] = _mm512_set1_epi32(word);
      }
      for (int q = 0; q < Q; ++q) {
        const __m512i codes = rows.codes(raw, k, q0 + q);
        for (int m = 0; m < MB; ++m) acc[m][q] = _mm512_dpwssd_epi32(acc[m][q], codes, pair[m]);
      }
    };
    int j = 0;
    // K pairs at a time (the phases' whole period) while their last 64 bytes are in the stream
    for (; j + K <= pairs && rows.start(j + K - 1, D) + 64 <= bytes; j += K) {
#pragma GCC unroll 5
      for (int k = 0; k < K; ++k)
        add_pair(_mm512_loadu_si512(src + rows.start(j + k, D)), k, j + k);
    }
    for (; j < pairs; ++j) {
      const int64_t at = rows.start(j, D);
      const __m512i raw = at + 64 <= bytes
                              ? _mm512_loadu_si512(src + at)
                              : _mm512_maskz_loadu_epi8((1ull << (bytes - at)) - 1, src + at);
      add_pair(raw, j % K, j);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512i extra = _mm512_set1_epi32(fixed_sum[m] * offset);
      const __m512 u = _mm512_set1_ps(unit[m]);
      for (int q = 0; q < Q; ++q)
        _mm512_storeu_ps(acc_w + (m0 + m) * D + 16 * (q0 + q),
                         _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][q], extra)), u));
    }
  }
}

// ternary_row_sums through pair_sums for consecutive rows (pos[i] = pos[0] + i) and
// D = 64 or 128
template <int MB>
void ternary_pair_sums(const uint8_t* src, int n, int D, const int* pos, const float* p, int TP,
                       float* acc_w, int16_t* fixed, int m0) {
  pair_sums<MB>(D == 64 ? kTritPairs64 : kTritPairs128, src, (int64_t(n) * D + 4) / 5, n, D, 1,
                p + pos[0], TP, acc_w, fixed, m0);
}
#define LOWBIT_PAIR_SUMS  // pair_sums: trits of D = 64 or 128 and the code_pairs rows

// the code pairs of `bits`-bit rows of D channels, nullptr where pair_sums cannot take them
inline const CodePairs* code_pairs(int D, int bits) {
  if (bits == 2) return D == 64 ? &kCodePairs2x64 : D == 128 ? &kCodePairs2x128 : nullptr;
  return bits == 4 && D == 64 ? &kCodePairs4x64 : nullptr;
}

// row_sums over consecutive rows of `bits`-bit codes through pair_sums (psum: sum_i p_i
// per query vector, float32, where given)
template <int MB>
void code_pair_sums(const CodePairs* rows, const uint8_t* src, int n, int D, const int* pos,
                    const float* p, int TP, float* acc_w, float* psum, int16_t* fixed, int m0) {
  if (psum) probability_sums<MB>(pos, n, p, TP, psum, m0);
  pair_sums<MB>(*rows, src, int64_t(n) * rows->row_bytes, n, D, 0, p + pos[0], TP, acc_w, fixed,
                m0);
}
#endif
#else
// Byte -> its five trits (base 3, value - 1); rows of 8 so one 8-byte copy writes a
// byte's trits (the extra lanes are overwritten by the next byte).
struct TritTable {
  alignas(64) int8_t v[256][8];
  TritTable() {
    for (int b = 0; b < 256; ++b) {
      int x = b;
      for (int i = 0; i < 8; ++i) {
        v[b][i] = int8_t(i < 5 ? x % 3 - 1 : 0);
        if (i < 5) x /= 3;
      }
    }
  }
};
static const TritTable kTritTable;

// n trits -> int8 in {-1, 0, 1}; dst holds n + 8 bytes
inline void decode_trits(const uint8_t* src, int n, int8_t* dst) {
  for (int i = 0; i < (n + 4) / 5; ++i) std::memcpy(dst + 5 * i, kTritTable.v[src[i]], 8);
}

#if defined(__AVX2__)
// The AVX2 form of the fused row sums above, 16 channels at a time in 16-bit lanes. The
// trits of channels [c, c + 32) of a row start at digit r = (row D + c) % 5 of byte
// (row D + c) / 5 and lie in the next 8 bytes: one 16-byte load broadcast to both halves,
// then lane k of half h takes byte (r + ch) / 5, digit (r + ch) % 5 of channel
// ch = 16 h + k / 2 (k even) or 16 h + 8 + k / 2 (k odd) (a shuffle/multiplier pair per r
// and h), the digit by kTritMul. As in TritLanes, a trit t is read as the float
// 2t: bf16 bits (digit - 1) << 14 in every 16-bit lane, turned into two vectors of 8
// channels in order by one shift and one mask.
struct TritAvx2 {
  __m256i shuf[5][2], mul[5][2];
  TritAvx2() {
    alignas(32) uint8_t b[32];
    alignas(32) uint16_t m[16];
    for (int r = 0; r < 5; ++r)
      for (int h = 0; h < 2; ++h) {
        for (int k = 0; k < 16; ++k) {
          const int ch = 16 * h + (k % 2 ? 8 + k / 2 : k / 2);
          b[2 * k] = uint8_t((r + ch) / 5);
          b[2 * k + 1] = 0x80;  // zero high byte
          m[k] = uint16_t(kTritMul[(r + ch) % 5]);
        }
        shuf[r][h] = _mm256_load_si256((const __m256i*)b);
        mul[r][h] = _mm256_load_si256((const __m256i*)m);
      }
  }
};
static const TritAvx2 kTritAvx2;

// channels [16 h, 16 h + 16) of the 32 trits from digit r of the broadcast bytes, as two
// vectors of 8 floats, each 2 trit
inline void trits16_avx2(__m256i raw, int r, int h, __m256* x) {
  const __m256i digit = _mm256_mulhi_epu16(
      _mm256_mullo_epi16(_mm256_shuffle_epi8(raw, kTritAvx2.shuf[r][h]), kTritAvx2.mul[r][h]),
      _mm256_set1_epi16(3));
  const __m256i bf =
      _mm256_sub_epi16(_mm256_slli_epi16(digit, 14), _mm256_set1_epi16(0x4000));
  x[0] = _mm256_castsi256_ps(_mm256_slli_epi32(bf, 16));
  x[1] = _mm256_castsi256_ps(_mm256_and_si256(bf, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// acc_w[m * D + c] = sum_i p[m * TP + pos[i]] trit(i, c) for channels [c0, c0 + 16 H): the
// loops are all fixed-length, so that the MB x 2H sums stay in registers
template <int MB, int H>
void ternary_pass(const uint8_t* src, int n, int D, const int* pos, const float* p, int TP,
                  float* acc_w, int m0, int c0) {
  const int64_t bytes = (int64_t(n) * D + 4) / 5;
  alignas(16) uint8_t tail[16] = {};
  __m256 acc[MB][2 * H];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < 2 * H; ++v) acc[m][v] = _mm256_setzero_ps();
  int64_t b0 = c0 / 5;  // row i's first byte and digit, advanced by D trits a row
  int r = c0 % 5;
  for (int i = 0; i < n; ++i) {
    const uint8_t* window = src + b0;
    if (b0 + 16 > bytes) {  // the stream's last bytes: never read past it
      std::memcpy(tail, src + b0, size_t(bytes - b0));
      window = tail;
    }
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)window));
    __m256 x[2 * H];
    for (int h = 0; h < H; ++h) trits16_avx2(raw, r, h, x + 2 * h);
    const int at = pos[i];
    for (int m = 0; m < MB; ++m) {
      const __m256 pm = _mm256_set1_ps(p[(m0 + m) * TP + at]);
      for (int v = 0; v < 2 * H; ++v) acc[m][v] = _mm256_fmadd_ps(x[v], pm, acc[m][v]);
    }
    b0 += D / 5;
    r += D % 5;
    if (r >= 5) {
      r -= 5;
      ++b0;
    }
  }
  const __m256 half = _mm256_set1_ps(0.5f);
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < 2 * H; ++v)
      _mm256_storeu_ps(acc_w + (m0 + m) * D + c0 + v * 8, _mm256_mul_ps(acc[m][v], half));
}

// all D channels (a multiple of 16): 32 a pass for up to three query vectors, 16 for more
template <int MB>
void ternary_row_sums(const uint8_t* src, int n, int D, const int* pos, const float* p, int TP,
                      float* acc_w, int m0) {
  constexpr int H = MB <= 3 ? 2 : 1;  // more sums than registers past three
  int c0 = 0;
  for (; c0 + 16 * H <= D; c0 += 16 * H)
    ternary_pass<MB, H>(src, n, D, pos, p, TP, acc_w, m0, c0);
  if (c0 < D) ternary_pass<MB, 1>(src, n, D, pos, p, TP, acc_w, m0, c0);
}
#define LOWBIT_FUSED_TRITS 16
#endif
#endif

// -- rows of floats, int8 or b-bit codes ----------------------------------------------------
// acc_w[m * D + c] = sum_i p[m * TP + pos[i]] x[i * D + c] for MB query vectors from m0,
// psum[m] = sum_i p[m * TP + pos[i]]; vectorized over L channels, sums in registers.
// x is a row source: row(i, c) gives channels [c, c + L) of row i as floats, rows2(i, c, out)
// channels [c, c + 2 L) as two vectors (for some sources fewer instructions than two rows).
inline vf load_row(const float* x) { return loadf(x); }
// L int8 -> floats (GCC's generic conversion of byte vectors is scalarized)
inline vf load_row(const int8_t* x) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)x)));
  vf out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#elif defined(__AVX2__)
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)x)));
  vf out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  vf out;
  for (int l = 0; l < L; ++l) out[l] = float(x[l]);
  return out;
#endif
}

template <typename X>
struct DenseRows {  // rows of D floats or int8
  const X* x;
  int D;
  vf row(int i, int c) const { return load_row(x + int64_t(i) * D + c); }
  void rows2(int i, int c, vf* out) const {
    out[0] = row(i, c);
    out[1] = row(i, c + L);
  }
};

// rows of D b-bit codes (b = 2, 4, 8), rows back to back: decoded L at a time in registers
template <int BITS>
struct CodeRows {
  const uint8_t* codes;
  int row_bytes;  // D * BITS / 8
  vf row(int i, int c) const {
    const uint8_t* src = codes + int64_t(i) * row_bytes + c * BITS / 8;
#if defined(__AVX512F__)
    __m512i v;
    if constexpr (BITS == 2) {
      uint32_t w;
      std::memcpy(&w, src, 4);
      v = _mm512_and_si512(
          _mm512_srlv_epi32(_mm512_set1_epi32(int(w)),
                            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                              28, 30)),
          _mm512_set1_epi32(3));
    } else if constexpr (BITS == 4) {
      uint64_t w;
      std::memcpy(&w, src, 8);
      const __m512i both = _mm512_setr_epi32(int(uint32_t(w)), int(uint32_t(w)), int(uint32_t(w)),
                                             int(uint32_t(w)), int(uint32_t(w)), int(uint32_t(w)),
                                             int(uint32_t(w)), int(uint32_t(w)), int(w >> 32),
                                             int(w >> 32), int(w >> 32), int(w >> 32),
                                             int(w >> 32), int(w >> 32), int(w >> 32),
                                             int(w >> 32));
      v = _mm512_and_si512(
          _mm512_srlv_epi32(both, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16,
                                                    20, 24, 28)),
          _mm512_set1_epi32(15));
    } else {
      v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)src));
    }
    const __m512 f = _mm512_cvtepi32_ps(v);
    vf out;
    std::memcpy(&out, &f, sizeof out);
    return out;
#elif defined(__AVX2__)
    __m256i v;  // 8 codes: a broadcast word shifted per lane (as above), or 8 bytes widened
    if constexpr (BITS == 2) {
      uint16_t w;
      std::memcpy(&w, src, 2);
      v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w),
                                             _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                           _mm256_set1_epi32(3));
    } else if constexpr (BITS == 4) {
      uint32_t w;
      std::memcpy(&w, src, 4);
      v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(w)),
                                             _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                           _mm256_set1_epi32(15));
    } else {
      v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)src));
    }
    const __m256 f = _mm256_cvtepi32_ps(v);
    vf out;
    std::memcpy(&out, &f, sizeof out);
    return out;
#else
    vf out;
    for (int l = 0; l < L; ++l) {
      const int bit = l * BITS;
      out[l] = float((src[bit >> 3] >> (bit & 7)) & ((1 << BITS) - 1));
    }
    return out;
#endif
  }
  void rows2(int i, int c, vf* out) const {
#if defined(__AVX2__) && !defined(__AVX512F__)
    if constexpr (BITS == 2) {  // 16 codes: lane l takes codes l and 8 + l by one shift
      uint32_t w;
      std::memcpy(&w, codes + int64_t(i) * row_bytes + c / 4, 4);
      const __m256i v = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(int(w)),
                            _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
          _mm256_set1_epi32(0x30003));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(3)));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 16));
      out[0] = vf(lo);
      out[1] = vf(hi);
      return;
    }
#endif
    out[0] = row(i, c);
    out[1] = row(i, c + L);
  }
};

// channels [c0, c0 + NV * L): each probability is loaded once per block
template <int MB, int NV, typename X>
void row_sums_block(const X& x, const int* pos, int rows, const float* p, int TP, float* acc_w,
                    int D, int m0, int c0) {
  vf acc[MB][NV] = {};
  for (int i = 0; i < rows; ++i) {
    vf xv[NV];
    for (int v = 0; v + 1 < NV; v += 2) x.rows2(i, c0 + v * L, xv + v);
    if (NV % 2) xv[NV - 1] = x.row(i, c0 + (NV - 1) * L);
    const int at = pos[i];
    for (int m = 0; m < MB; ++m) {
      const float pm = p[(m0 + m) * TP + at];
      for (int v = 0; v < NV; ++v) acc[m][v] += xv[v] * pm;
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) storef(acc_w + (m0 + m) * D + c0 + v * L, acc[m][v]);
}

template <int MB, typename X>
void row_sums(const X& x, const int* pos, int rows, int D, const float* p, int TP,
              float* acc_w, float* psum, int m0) {
  if (psum) probability_sums<MB>(pos, rows, p, TP, psum, m0);
  // blocks of up to 4 vectors of channels
  constexpr int CB = 4;
  for (int c0 = 0; c0 < D; c0 += CB * L) {
    switch (std::min(CB, (D - c0) / L)) {
      case 1: row_sums_block<MB, 1>(x, pos, rows, p, TP, acc_w, D, m0, c0); break;
      case 2: row_sums_block<MB, 2>(x, pos, rows, p, TP, acc_w, D, m0, c0); break;
      case 3: row_sums_block<MB, 3>(x, pos, rows, p, TP, acc_w, D, m0, c0); break;
      default: row_sums_block<MB, 4>(x, pos, rows, p, TP, acc_w, D, m0, c0); break;
    }
  }
}

}  // namespace
}  // namespace lowbit_kv
