// Scores of a group's low-bit key codes, vectorized over its tokens (rows): out[m * TP + t]
// += sum_j w[m * J + j] code(t, j) for a block of query vectors, the weights per code column
// being the query folded into the codec's scales (packed_attention.cpp, key_scores). The
// rows are first repacked column-major into words (word w of row t in lane t; with AVX-512
// VBMI transposed 16 rows at a time by byte permutes), then summed by a multiply-add per
// code or read through lookup tables (T-MAC style): per query vector and per group of bits
// of a row, a table of the partial score of every bit pattern, the weights folded in,
// looked up for a vector of tokens by one permute (AVX-512: 4-bit groups of 1- and 2-bit
// codes, vpermps; AVX2: 2-bit groups of 1-bit codes, vpermilps).
//
// Part of packed_attention.cpp, which includes it once (internal linkage, as vectors.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "vectors.h"

namespace lowbit_kv {
namespace {

// -- repacked rows, multiply-add columns ---------------------------------------------------
// rows [0, n) of W whole words -> words[w * TP + i]
template <int W>
void whole_word_rows(const uint8_t* src, int n, uint32_t* words, int TP) {
  int i = 0;
#if defined(__AVX512F__)
  // 16 rows at a time: word w of row t is dword W t + w of their W vectors, taken from two
  // of them by one two-source permute (index W t + w mod 32), from four by two and a blend
  if constexpr (W == 1 || W == 2 || W == 4) {
    __m512i idx[W];
    for (int w = 0; w < W; ++w) {
      alignas(64) int32_t at[L];
      for (int t = 0; t < L; ++t) at[t] = (W * t + w) % 32;
      idx[w] = _mm512_load_si512(at);
    }
    for (; i + L <= n; i += L) {
      const uint8_t* rows = src + 4 * W * int64_t(i);
      __m512i v[W];
      for (int k = 0; k < W; ++k) v[k] = _mm512_loadu_si512(rows + 64 * k);
      for (int w = 0; w < W; ++w) {
        __m512i out;
        if constexpr (W == 1) out = v[0];
        if constexpr (W == 2) out = _mm512_permutex2var_epi32(v[0], idx[w], v[1]);
        if constexpr (W == 4)
          out = _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi32(v[0], idx[w], v[1]),
                                        _mm512_permutex2var_epi32(v[2], idx[w], v[3]));
        _mm512_storeu_si512(words + w * TP + i, out);
      }
    }
  }
#endif
  for (; i < n; ++i) {
    uint32_t row[W];
    std::memcpy(row, src + 4 * W * int64_t(i), 4 * W);
    for (int w = 0; w < W; ++w) words[w * TP + i] = row[w];
  }
}

// Rows [0, n) of J b-bit codes (rows back to back in the stream) -> W = ceil(J b / 32)
// words per row, word-major: words[w * TP + i]; rows [n, TP) are zero.
int repack_rows(const uint8_t* src, int n, int J, int bits, uint32_t* words, int TP) {
  const int64_t row_bits = int64_t(J) * bits, bytes = (n * row_bits + 7) / 8;
  const int W = int((row_bits + 31) / 32);
  if (row_bits % 32 == 0) {  // rows are whole words: a transpose
    switch (W) {  // fixed widths, vectorized
      case 1: whole_word_rows<1>(src, n, words, TP); break;
      case 2: whole_word_rows<2>(src, n, words, TP); break;
      case 4: whole_word_rows<4>(src, n, words, TP); break;
      default:
        for (int i = 0; i < n; ++i)
          for (int w = 0; w < W; ++w)
            std::memcpy(&words[w * TP + i], src + 4 * (int64_t(i) * W + w), 4);
    }
  } else {
    for (int i = 0; i < n; ++i)
      for (int w = 0; w < W; ++w) {
        const int64_t bit = i * row_bits + 32 * w, byte = bit >> 3;
        uint64_t v = 0;
        std::memcpy(&v, src + byte, size_t(std::min<int64_t>(8, bytes - byte)));
        uint32_t word = uint32_t(v >> (bit & 7));
        const int64_t left = row_bits - 32 * w;
        if (left < 32) word &= (1u << left) - 1;
        words[w * TP + i] = word;
      }
  }
  for (int w = 0; w < W; ++w) std::fill(words + w * TP + n, words + (w + 1) * TP, 0u);
  return W;
}

// out[m * TP + i] += sum_j w[m * J + j] code(i, j) for MB query vectors from m0, over
// repacked rows of b-bit codes; vectorized over L rows, query vectors in registers. A
// full word's codes are unrolled and taken in turn by S sums per query vector, so that
// about 8 multiply-adds are in flight (one sum per vector ran at one code per
// multiply-add latency: half the speed with 3 query vectors).
template <int MB, int BITS>
void column_scores_bits(const uint32_t* words, int W, int TP, int J, const float* w, float* out,
                        int m0) {
  constexpr int S = (8 + MB - 1) / MB;
  constexpr int per_word = 32 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  for (int tb = 0; tb < TP; tb += L) {
    vf acc[S][MB];
    for (int m = 0; m < MB; ++m) {
      acc[0][m] = loadf(out + (m0 + m) * TP + tb);
      for (int s = 1; s < S; ++s) acc[s][m] = vf{};
    }
    for (int wi = 0; wi < W; ++wi) {
      const vu wv = loadu(words + wi * TP + tb);
      const float* wj = w + wi * per_word;
      auto add_code = [&](vf* sums, int k) {
        if constexpr (BITS == 1) {  // a masked add per bit instead of a conversion
          const vi set = vi((wv & (1u << k)) != 0);
          for (int m = 0; m < MB; ++m) sums[m] = set ? sums[m] + wj[(m0 + m) * J + k] : sums[m];
        } else {
          const vf c = __builtin_convertvector(vi((wv >> unsigned(k * BITS)) & mask), vf);
          for (int m = 0; m < MB; ++m) sums[m] += c * wj[(m0 + m) * J + k];
        }
      };
      const int jn = std::min(per_word, J - wi * per_word);
      if (jn == per_word) {
#pragma GCC unroll 32
        for (int k = 0; k < per_word; ++k) add_code(acc[k % S], k);
      } else {
        for (int k = 0; k < jn; ++k) add_code(acc[0], k);
      }
    }
    for (int m = 0; m < MB; ++m) {
      for (int s = 1; s < S; ++s) acc[0][m] += acc[s][m];
      storef(out + (m0 + m) * TP + tb, acc[0][m]);
    }
  }
}

template <int MB>
void column_scores(const uint32_t* words, int W, int TP, int J, int bits, const float* w,
                   float* out, int m0) {
  switch (bits) {
    case 1: return column_scores_bits<MB, 1>(words, W, TP, J, w, out, m0);
    case 2: return column_scores_bits<MB, 2>(words, W, TP, J, w, out, m0);
    case 4: return column_scores_bits<MB, 4>(words, W, TP, J, w, out, m0);
    default: return column_scores_bits<MB, 8>(words, W, TP, J, w, out, m0);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define LOWBIT_FAST_CODES 1
// -- fast code rows (AVX-512 VBMI) -------------------------------------------------------
// Rows of rb bytes (b-bit codes, rows byte-aligned) are transposed 16 at a time by byte
// permutes (no scalar repacking): word w of row t lands in lane t.
constexpr int kMaxRowBytes = 64;

struct RowPlan {  // how to transpose 16 rows of rb bytes: per output word, its permutes
  struct Op {
    int z;            // window: bytes [64 z, 64 z + 128) of the 16 rows
    __mmask64 bytes;  // the output bytes (4 per lane) this permute fills
    uint8_t idx[64];  // byte index into the window per output byte
  };
  int W = 0, loads = 0;  // words per row; 64-byte loads the 16 rows need (windows + 1)
  std::vector<int> first;  // ops of word w: [first[w], first[w + 1])
  std::vector<Op> ops;
  explicit RowPlan(int rb) : W((rb + 3) / 4) {
    for (int w = 0; w < W; ++w) {
      first.push_back(int(ops.size()));
      for (int t = 0; t < L;) {
        const int z = (t * rb + 4 * w) / 64;
        Op op{z, 0, {}};
        std::memset(op.idx, 0, sizeof op.idx);
        for (; t < L && (t * rb + 4 * w) / 64 == z; ++t)
          for (int b = 0; b < 4; ++b) {
            op.idx[4 * t + b] = uint8_t(t * rb + 4 * w + b - 64 * z);
            op.bytes |= __mmask64(1) << (4 * t + b);
          }
        loads = std::max(loads, z + 2);
        ops.push_back(op);
      }
    }
    first.push_back(int(ops.size()));
  }
};

const RowPlan& row_plan(int rb) {
  static std::once_flag once[kMaxRowBytes + 1];
  static const RowPlan* plans[kMaxRowBytes + 1];
  std::call_once(once[rb], [rb] { plans[rb] = new RowPlan(rb); });
  return *plans[rb];
}

// Rows [0, n) of rb bytes (the stream holds n * rb bytes) -> words[w * TP + i] (word w of
// row i; rows [n, TP) zero; bytes of a word past its row belong to the next row)
void transpose_rows(const uint8_t* src, int n, int rb, uint32_t* words, int TP) {
  const RowPlan& p = row_plan(rb);
  const int64_t bytes = int64_t(n) * rb;
  alignas(64) uint8_t tail[64 * (kMaxRowBytes / 4 + 2)];
  for (int tb = 0; tb < TP; tb += L) {
    const uint8_t* blk = src + int64_t(tb) * rb;
    const int64_t avail = bytes - int64_t(tb) * rb;
    if (avail <= 0) {
      for (int w = 0; w < p.W; ++w)
        _mm512_storeu_si512(words + w * TP + tb, _mm512_setzero_si512());
      continue;
    }
    if (avail < 64 * p.loads) {  // the last rows: never read past the stream
      std::memset(tail, 0, size_t(64) * p.loads);
      std::memcpy(tail, blk, size_t(avail));
      blk = tail;
    }
    for (int w = 0; w < p.W; ++w) {
      __m512i r = _mm512_setzero_si512();
      for (int o = p.first[w]; o < p.first[w + 1]; ++o) {
        const RowPlan::Op& op = p.ops[o];
        const __m512i x = _mm512_permutex2var_epi8(
            _mm512_loadu_si512(blk + 64 * op.z), _mm512_loadu_si512(op.idx),
            _mm512_loadu_si512(blk + 64 * op.z + 64));
        r = o == p.first[w] ? x : _mm512_mask_mov_epi8(r, op.bytes, x);
      }
      _mm512_storeu_si512(words + w * TP + tb, r);
    }
  }
}

#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#define LOWBIT_LUT 1
// -- lookup-table code columns (T-MAC style) -----------------------------------------------
// Columns of low-bit codes, their rows as words (word w of row t in lane t), are read through
// lookup tables: per query vector and per group of G bits of a row a table of the partial
// dot product for every bit pattern (the per-channel weights folded in), looked up for L rows
// at once by one permute that reads only the low bits of each lane (so a lane is just
// shifted, never masked), where a group holds two codes or more. AVX-512: G = 4 (16
// entries, vpermps), 1- and 2-bit codes; AVX2: G = 2 (4 entries repeated in both 128-bit
// halves, vpermilps: an in-lane permute, where AVX2's cross-lane vpermps made 4-bit groups
// slower than multiply-adds on Zen 3), 1-bit codes.
constexpr int kGroupBits = L == 16 ? 4 : 2;
inline bool lut_reads(int bits) { return 2 * bits <= kGroupBits; }

// table[idx mod 2^G] in every lane (a table is one vector)
inline vf lookup(const float* table, vu idx) {
#if defined(__AVX512F__)
  return vf(_mm512_permutexvar_ps(__m512i(idx), _mm512_loadu_ps(table)));
#else
  return vf(_mm256_permutevar_ps(_mm256_loadu_ps(table), __m256i(idx)));
#endif
}

// tabs[(m * groups + k) * L + lane] = sum_j w[m * J + k * per + j] code_j(lane mod 2^G) for
// the MB query vectors from m0 (per = G / bits codes per group; tables indexed from m0)
template <int MB>
void build_tables(const float* w, int J, int bits, float* tabs, int m0) {
  const int per = kGroupBits / bits, groups = J / per;
  const vi mask = vi{} + ((1 << bits) - 1);
  vf code[kGroupBits];
  for (int j = 0; j < per; ++j)
    code[j] = __builtin_convertvector(((iota() & ((1 << kGroupBits) - 1)) >> (j * bits)) & mask,
                                      vf);
  for (int m = 0; m < MB; ++m) {
    const float* wm = w + (m0 + m) * J;
    float* tm = tabs + m * groups * L;
    for (int k = 0; k < groups; ++k) {
      vf t = code[0] * wm[k * per];
      for (int j = 1; j < per; ++j) t += code[j] * wm[k * per + j];
      storef(tm + k * L, t);
    }
  }
}

// out[m * TP + i] += the tables' sums over row i's groups, for MB query vectors from m0
template <int MB>
void lut_scores(const uint32_t* words, int groups, int TP, const float* tabs, float* out,
                int m0) {
  constexpr int per_word = 32 / kGroupBits;
  for (int tb = 0; tb < TP; tb += L) {
    vf acc[MB], acc2[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m] = loadf(out + (m0 + m) * TP + tb);
      acc2[m] = vf{};
    }
    for (int k0 = 0; k0 < groups; k0 += per_word) {
      const vu wv = loadu(words + (k0 / per_word) * TP + tb);
      const int kn = std::min(per_word, groups - k0);
      auto two_groups = [&](int k) {  // two chains per vector: the adds overlap
        const vu i0 = wv >> unsigned(kGroupBits * k), i1 = wv >> unsigned(kGroupBits * (k + 1));
        for (int m = 0; m < MB; ++m) {
          const float* tm = tabs + (m * groups + k0 + k) * L;
          acc[m] += lookup(tm, i0);
          acc2[m] += lookup(tm + L, i1);
        }
      };
      int k = 0;
      if (kn == per_word) {  // a whole word: unrolled, so that the shifts are by constants
#pragma GCC unroll 16
        for (k = 0; k < per_word; k += 2) two_groups(k);
      }
      for (; k + 2 <= kn; k += 2) two_groups(k);
      if (k < kn) {
        const vu i0 = wv >> unsigned(kGroupBits * k);
        for (int m = 0; m < MB; ++m) acc[m] += lookup(tabs + (m * groups + k0 + k) * L, i0);
      }
    }
    for (int m = 0; m < MB; ++m) storef(out + (m0 + m) * TP + tb, acc[m] + acc2[m]);
  }
}

template <int MB>
void lut_column_scores(const uint32_t* words, int TP, int J, int bits, const float* w,
                       float* tabs, float* out, int m0) {
  build_tables<MB>(w, J, bits, tabs, m0);
  lut_scores<MB>(words, J * bits / kGroupBits, TP, tabs, out, m0);
}
#endif

}  // namespace
}  // namespace lowbit_kv
