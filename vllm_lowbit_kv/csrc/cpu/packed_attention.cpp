// Paged decode attention straight from packed low-bit pages, for the CPU.
//
// Implements the contract of vllm_lowbit_kv/ops/__init__.py (packed_attention):
// every query row of request r attends to all of r's packed tokens (its
// groups listed in group_table, minus the first skip_tokens positions); the
// result is the softmax-weighted value (float32) and the log-sum-exp per
// (row, query head), -inf / 0 for rows without packed keys.
//
// Nothing is dequantized beyond one group: a work item (request, KV head,
// range of groups) walks its groups, decodes each group's codes into small
// per-thread buffers and folds them into a flash-decoding style online
// softmax. Items run in parallel through at::parallel_for (torch's OpenMP
// pool); long contexts are split over several items and merged by
// log-sum-exp afterwards.
//
// Keys are never rebuilt: where a codec is linear in its codes the query is
// folded into the group's metadata (q . (code * scale + zero) =
// (q * scale) . code + q . zero), and VidKV's fixed inverse map A of the rfft
// unique parts moves onto the query (q_N . (z A) = (A q_N) . z). Scores are
// then sums of code columns times weights, vectorized over 16 tokens. Values
// are accumulated the same way: sum_t p_t (alpha_c trit_tc) =
// alpha_c sum_t p_t trit_tc, vectorized over 16 channels.
//
// Folding costs per query vector what a decode costs once, so an item with many query
// vectors (a prefill chunk) instead decodes each group into float tiles, through those
// same folded paths for keys (unit queries give the key channels; values are decoded row
// by row), and multiplies the tiles with all its query vectors (micro_gemm.h). The serving
// path's bf16 prefill chunks instead take their groups as dense rows (decode_groups: keys
// straight from their codes where it can, else that decode) into the dense kernel's one
// pass over context and own tokens.
//
// The build is -march=native, so the ISA is the machine's. The per-ISA primitives live
// apart: code_columns.h scores columns of key codes (multiply-adds or T-MAC lookup
// tables), value_sums.h sums value rows (codes and trits decoded in registers, VNNI pair
// sums) against probabilities.
//
// RVQ pages (seed 001: each token's head vector as K codeword indices per channel group,
// times its std; the layer's codebooks, float32, passed beside the pages): where the item
// is long enough to pay for them, through per-query tables (q . codeword for every code,
// built once per item: a score is n K lookups; values as weights summed per codeword and
// multiplied out once at the end); otherwise, and for tiles, decoded one group at a time
// and read as dense rows.
//
// A rotating layout's pages hold K M and V M (an orthonormal M, rotation.py): the kernel
// multiplies each query vector by M as it loads it and each output row by M^T as it
// writes it (both passed in, so that both products read contiguous columns), so a
// rotation costs two small matrix-vector products per row, not a pass of its own.
//
// Vectors are GCC/Clang vector extensions of the build's register width (vectors.h: 16
// floats with AVX-512, 8 with AVX2).
//
// The page formats come from Python (vllm_lowbit_kv/ops/cpu.py) as integer
// descriptors: byte offsets of every field of one group state, in the order
// documented by the enums of descriptors.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "descriptors.h"
#include "dtypes.h"
#include "code_columns.h"
#include "micro_gemm.h"
#include "value_sums.h"
#include "vectors.h"

namespace lowbit_kv {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

constexpr int kMaxMB = 8;  // query vectors kept in registers at once

// -- decoding helpers -----------------------------------------------------------------
inline void halves_to_float(const uint8_t* src, int n, float* dst) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + L <= n; i += L)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + 2 * i))));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (i < n) {  // the tail: a masked load (no scalar conversions)
    const __mmask16 k = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, src + 2 * i)));
    return;
  }
#endif
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + 2 * i))));
#endif
  for (; i < n; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    dst[i] = float(c10::Half(bits, c10::Half::from_bits()));
  }
}

inline bool bit_at(const uint8_t* p, int i) { return (p[i >> 3] >> (i & 7)) & 1; }

#if defined(__AVX512F__) || defined(__AVX2__)
#define LOWBIT_COMPRESS 1
constexpr uint32_t kAllLanes = (1u << L) - 1;
// bits [c0, c0 + L) of a bit mask of at least c0 + L bits (c0 a multiple of L)
inline uint32_t lane_bits(const uint8_t* p, int c0) {
  uint32_t m = 0;
  std::memcpy(&m, p + c0 / 8, L / 8);
  return m;
}

#if !defined(__AVX512F__)
// per 8-bit mask: its set lanes in order, then the others (AVX2 has no compress)
struct CompressTable {
  alignas(32) int32_t lanes[256][8];
  CompressTable() {
    for (int k = 0; k < 256; ++k) {
      int n = 0;
      for (int set = 1; set >= 0; --set)
        for (int l = 0; l < 8; ++l)
          if (((k >> l) & 1) == set) lanes[k][n++] = l;
    }
  }
};
static const CompressTable kCompress;
inline __m256i compress_lanes(uint32_t k) {
  return _mm256_load_si256((const __m256i*)kCompress.lanes[k & 0xFF]);
}
#endif

// the lanes of v (vi or vf, moved as bits) whose bit in k is set, in order, first (the
// lanes after them: anything)
template <typename V>
inline V compress(V v, uint32_t k) {
#if defined(__AVX512F__)
  return V(_mm512_maskz_compress_epi32(__mmask16(k), __m512i(v)));
#else
  return V(_mm256_permutevar8x32_epi32(__m256i(v), compress_lanes(k)));
#endif
}
#endif

// Flat b-bit codes [0, count) of a stream of `bytes` bytes (little-end first) -> floats.
// dst holds round_up(count) floats (the tail lanes get whatever codes follow, or 0).
// L codes of b bits start at a multiple of L b bits (of 32 from 4 bits up), so their
// words are spread over the lanes by one shuffle.
template <int BITS>
void decode_codes_bits(const uint8_t* src, int64_t bytes, int64_t count, float* dst) {
  typedef uint32_t v4u __attribute__((vector_size(16)));
  vu shift;
  for (int l = 0; l < L; ++l) shift[l] = (l * BITS) % 32;
  const uint32_t mask = (1u << BITS) - 1;
  for (int64_t f0 = 0; f0 < count; f0 += L) {
    const int64_t byte0 = f0 * BITS / 8;
    v4u w = {0, 0, 0, 0};
    if (byte0 + 16 <= bytes)
      std::memcpy(&w, src + byte0, 16);
    else
      std::memcpy(&w, src + byte0, size_t(bytes - byte0));
    vu words;
    if constexpr (L * BITS <= 32) {
      words = vu{} + w[0];
    } else if constexpr (L == 8) {  // 8-bit codes
      words = __builtin_shufflevector(w, w, 0, 0, 0, 0, 1, 1, 1, 1);
    } else if constexpr (BITS == 4) {
      words = __builtin_shufflevector(w, w, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    } else {
      words = __builtin_shufflevector(w, w, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    }
    storef(dst + f0, __builtin_convertvector(vi((words >> shift) & mask), vf));
  }
}

void decode_codes(const uint8_t* src, int64_t bytes, int64_t count, int bits, float* dst) {
  switch (bits) {
    case 1: return decode_codes_bits<1>(src, bytes, count, dst);
    case 2: return decode_codes_bits<2>(src, bytes, count, dst);
    case 4: return decode_codes_bits<4>(src, bytes, count, dst);
    default: return decode_codes_bits<8>(src, bytes, count, dst);
  }
}

// Dispatch a kernel templated on the block size over all M query vectors.
#define LOWBIT_FOR_BLOCKS(M, KERNEL, ...)                                    \
  for (int m0_ = 0; m0_ < (M); m0_ += kMaxMB) {                              \
    switch (std::min(kMaxMB, (M) - m0_)) {                                   \
      case 1: KERNEL<1>(__VA_ARGS__, m0_); break;                            \
      case 2: KERNEL<2>(__VA_ARGS__, m0_); break;                            \
      case 3: KERNEL<3>(__VA_ARGS__, m0_); break;                            \
      case 4: KERNEL<4>(__VA_ARGS__, m0_); break;                            \
      case 5: KERNEL<5>(__VA_ARGS__, m0_); break;                            \
      case 6: KERNEL<6>(__VA_ARGS__, m0_); break;                            \
      case 7: KERNEL<7>(__VA_ARGS__, m0_); break;                            \
      default: KERNEL<8>(__VA_ARGS__, m0_); break;                           \
    }                                                                        \
  }

// mat_vec's columns [j0, j0 + J L) (the last vector may be partial) for MB vectors from m0
template <int MB, int J>
void mat_vec_columns(const float* at, int n, const float* x, float* u, int m0, int j0) {
  const int last = std::min(L, n - j0 - (J - 1) * L);  // lanes of the last vector
  vf acc[MB][J] = {};
  for (int c = 0; c < n; ++c) {
    const float* row = at + size_t(c) * n + j0;
    vf col[J];
#pragma GCC unroll 4
    for (int j = 0; j + 1 < J; ++j) col[j] = loadf(row + j * L);
    col[J - 1] = last == L ? loadf(row + (J - 1) * L) : loadf_first(row + (J - 1) * L, last);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const float xm = x[(m0 + m) * n + c];
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) acc[m][j] += col[j] * xm;
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    float* dst = u + (m0 + m) * n + j0;
#pragma GCC unroll 4
    for (int j = 0; j + 1 < J; ++j) storef(dst + j * L, acc[m][j]);
    if (last == L)
      storef(dst + (J - 1) * L, acc[m][J - 1]);
    else
      storef_first(dst + (J - 1) * L, acc[m][J - 1], last);
  }
}

// u[m * n + j] = sum_c at[c * n + j] x[m * n + c] (at = A transposed) for MB vectors from m0;
// up to 4 column vectors per pass, so that the independent sums (MB per vector) hide the
// multiply-add latency
template <int MB>
void mat_vec(const float* at, int n, const float* x, float* u, int m0) {
  constexpr int kMaxJ = MB >= 8 ? 1 : MB >= 4 ? 2 : 4;
  for (int j0 = 0; j0 < n;) {
    const int vectors = std::min(kMaxJ, (n - j0 + L - 1) / L);
    switch (vectors) {
      case 4: mat_vec_columns<MB, (kMaxJ >= 4 ? 4 : 1)>(at, n, x, u, m0, j0); break;
      case 3: mat_vec_columns<MB, (kMaxJ >= 3 ? 3 : 1)>(at, n, x, u, m0, j0); break;
      case 2: mat_vec_columns<MB, (kMaxJ >= 2 ? 2 : 1)>(at, n, x, u, m0, j0); break;
      default: mat_vec_columns<MB, 1>(at, n, x, u, m0, j0); break;
    }
    j0 += vectors * L;
  }
}

// token positions of an STP group: protected first, then the rest, each in order
// (vidkv.py front_perm); identity when nothing is protected
void stp_positions(const uint8_t* tok_mask, int T, int n_protect, int* pos) {
  if (!n_protect) {
    for (int t = 0; t < T; ++t) pos[t] = t;
    return;
  }
  int ip = 0;
  for (int t = 0; t < T / 8; ++t) ip += __builtin_popcount(tok_mask[t]);
  if (T % 8) ip += __builtin_popcount(tok_mask[T / 8] & ((1u << (T % 8)) - 1));
  TORCH_CHECK(ip == n_protect, "lowbit-kv: tok_mask has ", ip, " bits set, not ", n_protect,
              " (corrupt page?)");
#if defined(LOWBIT_COMPRESS)
  // L tokens at a time by compressing their indices; pos holds T + L (a store writes L
  // lanes): the protected ones first, then the rest, each pass overwriting the spill of
  // the one before
  for (int pass = 0, at = 0; pass < 2; ++pass)
    for (int t0 = 0; t0 < T; t0 += L) {
      uint32_t bits = 0;
      std::memcpy(&bits, tok_mask + t0 / 8, size_t(std::min(L / 8, (T - t0 + 7) / 8)));
      const uint32_t valid = T - t0 >= L ? kAllLanes : (1u << (T - t0)) - 1;
      const uint32_t k = (pass ? ~bits : bits) & valid;
      const vi idx = compress(iota() + t0, k);
      std::memcpy(pos + at, &idx, sizeof idx);
      at += __builtin_popcount(k);
    }
  return;
#endif
  int il = n_protect;
  ip = 0;
  for (int t = 0; t < T; ++t) {  // branch-free: the mask bits are random
    const int bit = bit_at(tok_mask, t);
    pos[bit ? ip : il] = t;
    ip += bit;
    il += 1 - bit;
  }
}

// -- per-thread scratch -------------------------------------------------------------------
struct Format {
  int T, D, TP, H, N;
  int64_t sink_bytes, state_bytes, k_bytes;
  std::vector<int64_t> key, val;
  const float* fft_map_t;  // [n1, n1] A transposed (column j of A is row j), or nullptr
  const float* key_books;  // RVQ keys: the layer's codebooks [K][C][d^], or nullptr
  const float* val_books;  // RVQ values: likewise
  const float* key_columns;  // RVQ keys: their codebooks transposed [K][d^][C], or nullptr
};

// indices of one RVQ group (the larger of the keys' and the values'), 0 without RVQ
size_t rvq_indices_per_group(const Format& f) {
  size_t most = 0;
  for (const std::vector<int64_t>* d : {&f.key, &f.val})
    if (is_rvq(*d, d == &f.key))
      most = std::max(most, size_t(f.T) * (f.D / (*d)[RV_GROUP]) * (*d)[RV_K]);
  return most;
}

struct Scratch {
  std::vector<uint32_t> words;  // repacked code rows, [D / 4 + 1][TP]
  std::vector<float> x;         // decoded value rows [T * D] (+ tail)
  std::vector<float> ss;        // scores in storage order (STP keys) [M * TP]
  std::vector<float> w, w1;     // weights per query vector [M * D]
  std::vector<float> cst, psum; // [M]
  std::vector<float> meta;      // [4 * D]: metadata of one group as floats
  std::vector<float> extra;     // STP keys: protected scores; KIVI values: per-token scale/zero
  std::vector<float> qn, u;     // [M * D]: normal channels of the queries, A q_N
  std::vector<float> tabs;      // lookup tables of kMaxMB query vectors [kMaxMB][<= D][L]
  std::vector<int> idx2, idxn, kpos, vpos;
  std::vector<int32_t> rvq_rows;  // RVQ: one group's indices as row offsets [T * n * K]
  std::vector<float> rvq_sd;      // and its tokens' std [T]
  Scratch(const Format& f, int M)
      : words(size_t(f.D / 4 + 1) * f.TP), x(size_t(f.TP) * f.D + 2 * L), ss(size_t(M) * f.TP),
        w(size_t(M) * f.D + L), w1(size_t(M) * f.D + L), cst(M), psum(M),
        meta(4 * size_t(f.D)), qn(size_t(M) * f.D + L), u(size_t(M) * f.D + L),
        tabs(size_t(kMaxMB) * f.D * L), idx2(f.D), idxn(f.D), kpos(f.T + L),
        vpos(f.T + L), rvq_rows(rvq_indices_per_group(f)), rvq_sd(rvq_rows.empty() ? 0 : f.T) {}
};

// Rows [0, n) of J b-bit codes (rows back to back in the stream) -> words[w * TP + i];
// returns W, the words per row
int code_words(const uint8_t* src, int n, int J, int bits, uint32_t* words, int TP) {
#if defined(LOWBIT_FAST_CODES)
  const int64_t row_bits = int64_t(J) * bits;
  // rows of one, two or four whole words: copied or taken apart 16 at a time (repack_rows)
  const bool word_rows = row_bits == 32 || row_bits == 64 || row_bits == 128;
  if (!word_rows && row_bits % 8 == 0 && row_bits / 8 <= kMaxRowBytes) {
    transpose_rows(src, n, int(row_bits / 8), words, TP);
    return int((row_bits + 31) / 32);
  }
#endif
  return repack_rows(src, n, J, bits, words, TP);
}

// out[m * TP + i] += sum_j w[m * J + j] code(i, j) over rows [0, n) of J b-bit codes (rows
// back to back in the stream at src), for the M query vectors; rows [n, TP) get finite junk
void code_column_scores(const uint8_t* src, int n, int J, int bits, const float* w, int M,
                        int TP, float* out, Scratch& s) {
  const int W = code_words(src, n, J, bits, s.words.data(), TP);
#if defined(LOWBIT_LUT)
  if (lut_reads(bits) && int64_t(J) * bits % kGroupBits == 0) {
    LOWBIT_FOR_BLOCKS(M, lut_column_scores, s.words.data(), TP, J, bits, w, s.tabs.data(), out)
    return;
  }
#endif
  LOWBIT_FOR_BLOCKS(M, column_scores, s.words.data(), W, TP, J, bits, w, out)
}

// -- keys: scores sc[m * TP + t] = q_m . k_t (q already scaled), token order --------------
// scores of rows coded per channel (b-bit codes, fp16 scale/zero per channel over D)
void affine_channel_scores(const uint8_t* codes, int rows, int bits, const uint8_t* scale_h,
                           const uint8_t* zero_h, const float* q, int M, int D, int TP,
                           float* out, Scratch& s) {
  float* scale = s.meta.data();
  float* zero = scale + D;
  halves_to_float(scale_h, D, scale);
  halves_to_float(zero_h, D, zero);
  for (int m = 0; m < M; ++m) {
    const float* qm = q + m * D;
    float* wm = s.w.data() + m * D;
#pragma omp simd
    for (int c = 0; c < D; ++c) wm[c] = qm[c] * scale[c];
    std::fill(out + m * TP, out + (m + 1) * TP, dot(qm, zero, D));
  }
  code_column_scores(codes, rows, D, bits, s.w.data(), M, TP, out, s);
}

// -- RVQ ---------------------------------------------------------------------------------
// One codec's RVQ descriptor (descriptors.h, enum Rvq): K codebooks of C codes of d^ = gs
// channels, n = D / gs channel groups, b-bit indices.
struct RvqShape {
  int K, C, bits, gs, n;
  bool strided;
  int64_t codes, std;
  RvqShape(const std::vector<int64_t>& d, int D)
      : K(int(d[RV_K])), C(int(d[RV_C])), bits(int(d[RV_BITS])), gs(int(d[RV_GROUP])),
        n(D / gs), strided(d[RV_STRIDED] != 0), codes(d[RV_CODES]), std(d[RV_STD]) {}
  // channel of element j of group g (vllm_lowbit_kv/codecs/rvq.py: the grouping)
  int channel(int g, int j) const { return strided ? j * n + g : g * gs + j; }
};

// A group's indices as offsets within their tables: index i of the stream (token-major, then
// group, then codebook; little-end first) picks a row of `width` floats of its table (a
// codebook's gs-float codes, a per-query table's W lanes), so rows[i] = index_i width; and
// the tokens' std sd[t] (1 where the std is 0)
void rvq_rows(const uint8_t* st, const RvqShape& r, int T, int width, int32_t* rows, float* sd) {
  const uint8_t* codes = st + r.codes;
  const uint32_t mask = (1u << r.bits) - 1;
  const int64_t count = int64_t(T) * r.n * r.K;
  if (r.bits == 8) {
    for (int64_t i = 0; i < count; ++i) rows[i] = codes[i] * width;
  } else {
    for (int64_t i = 0, bit = 0; i < count; ++i, bit += r.bits) {
      const uint8_t* b = codes + (bit >> 3);  // an index spans at most 3 bytes (<= 16 bits)
      const uint32_t w = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16;
      rows[i] = int32_t((w >> (bit & 7)) & mask) * width;
    }
  }
  halves_to_float(st + r.std, T, sd);
  for (int t = 0; t < T; ++t) sd[t] = sd[t] > 0.f ? sd[t] : 1.f;
}

// RVQ group -> rows x [T][D]: per token and channel group the sum of its K codewords,
// times the token's std, channels put back by the grouping
// (vllm_lowbit_kv/codecs/rvq.py: decode_groups). The sums run L channels at a time in
// registers; strided groups of two (D = 2 d^, keys) are interleaved by two shuffles per
// 2 L channels, other strided groups element by element.
void rvq_decode(const uint8_t* st, const std::vector<int64_t>& d, const float* books, int T, int D,
                float* x, Scratch& s) {
  const RvqShape r(d, D);
  int32_t* rows = s.rvq_rows.data();
  float* sd = s.rvq_sd.data();
  rvq_rows(st, r, T, r.gs, rows, sd);
  const int64_t book = int64_t(r.C) * r.gs;  // floats per codebook
  const bool apart = r.strided && r.n > 1;  // one group is contiguous either way
  const bool zip = apart && r.n == 2 && r.gs % L == 0;
  for (int t = 0; t < T; ++t) {
    float* row = x + int64_t(t) * D;
    float* z = apart ? s.meta.data() : row;  // group g's sums at z + g gs
    for (int g = 0; g < r.n; ++g) {
      const int32_t* code = rows + (t * r.n + g) * r.K;
      float* zg = z + g * r.gs;
      int j = 0;
      for (; j + L <= r.gs; j += L) {
        vf acc{};
        for (int k = 0; k < r.K; ++k) acc += loadf(books + k * book + code[k] + j);
        storef(zg + j, acc * sd[t]);
      }
      for (; j < r.gs; ++j) {
        float acc = 0.f;
        for (int k = 0; k < r.K; ++k) acc += books[k * book + code[k] + j];
        zg[j] = acc * sd[t];
      }
    }
    if (zip) {
      for (int j = 0; j < r.gs; j += L) {
        const vf a = loadf(z + j), b = loadf(z + r.gs + j);
        storef(row + 2 * j, zip_low(a, b));
        storef(row + 2 * j + L, zip_high(a, b));
      }
    } else if (apart) {
      for (int g = 0; g < r.n; ++g)
        for (int j = 0; j < r.gs; ++j) row[r.channel(g, j)] = z[g * r.gs + j];
    }
  }
}

// RVQ key group -> its channels xt[c * TP + t] = k_t[c] (tail tokens 0)
void rvq_key_columns(const Format& f, const uint8_t* st, float* xt, Scratch& s) {
  const int T = f.T, D = f.D, TP = f.TP;
  float* x = s.x.data();
  rvq_decode(st, f.key, f.key_books, T, D, x, s);
  rows_to_columns([&](int t, int c) { return loadf(x + int64_t(t) * D + c); }, T, TP, D, xt, TP);
}

// A VidKV key state's metadata as floats: the 2-bit channels' scale and zero [n2], the
// 1-bit components' levels lo and hi [n1] (lo = -hi with sign levels)
void vidkv_key_levels(const std::vector<int64_t>& d, const uint8_t* st, float* scale2,
                      float* zero2, float* lo, float* hi) {
  const int n2 = int(d[VK_N2]), n1 = int(d[VK_N1]);
  halves_to_float(st + d[VK_SCALE2], n2, scale2);
  halves_to_float(st + d[VK_ZERO2], n2, zero2);
  halves_to_float(st + d[VK_HI1], n1, hi);
  if (d[VK_SIGN])
    for (int j = 0; j < n1; ++j) lo[j] = -hi[j];
  else
    halves_to_float(st + d[VK_LO1], n1, lo);
}

void key_scores(const Format& f, const uint8_t* st, const float* q, int M, float* sc, Scratch& s) {
  const int T = f.T, D = f.D, TP = f.TP;
  const auto& d = f.key;
  if (d[0] == KEY_RVQ) {  // dense rows of one group, transposed: scores vectorized over tokens
    std::vector<float>& xt = s.extra;
    xt.resize(size_t(D) * TP);
    rvq_key_columns(f, st, xt.data(), s);
    for (int m = 0; m < M; ++m) {
      float* row = sc + m * TP;
      const float* qm = q + m * D;
      for (int t0 = 0; t0 < TP; t0 += L) {
        vf acc = vf{};
        for (int c = 0; c < D; ++c) acc += splat(qm[c]) * loadf(xt.data() + size_t(c) * TP + t0);
        storef(row + t0, acc);
      }
    }
    return;
  }
  if (d[0] == KEY_KIVI_CHANNEL) {
    affine_channel_scores(st + d[KK_CODES], T, int(d[KK_BITS]), st + d[KK_SCALE],
                          st + d[KK_ZERO], q, M, D, TP, sc, s);
    return;
  }
  const int n2 = int(d[VK_N2]), n1 = int(d[VK_N1]), np = int(d[VK_NP]), n = T - np;
  int* pos = s.kpos.data();
  stp_positions(np ? st + d[VK_TOK_MASK] : nullptr, T, np, pos);
  // STP: scores in storage order (protected rows, then the rest), scattered at the end
  float* low = np ? s.ss.data() : sc;
  std::vector<float>& prot = s.extra;
  if (np) {  // protected tokens: 2-bit per channel over all D channels
    prot.resize(size_t(M) * TP);
    affine_channel_scores(st + d[VK_PROT_CODES], np, 2, st + d[VK_PROT_SCALE],
                          st + d[VK_PROT_ZERO], q, M, D, TP, prot.data(), s);
  }
  // low tokens: 2-bit channels (chan_mask set) and 1-bit (FFT) components
  const uint8_t* cmask = st + d[VK_CHAN_MASK];
  int j2 = 0;
#if defined(LOWBIT_COMPRESS)
  for (int c0 = 0; c0 < D; c0 += L) j2 += __builtin_popcount(lane_bits(cmask, c0));
#else
  int jn = 0;
  for (int c = 0; c < D; ++c) {  // branch-free: the mask bits are random
    const int bit = bit_at(cmask, c);
    s.idx2[j2] = c;
    s.idxn[jn] = c;
    j2 += bit;
    jn += 1 - bit;
  }
#endif
  TORCH_CHECK(j2 == n2, "lowbit-kv: chan_mask has ", j2, " bits set, not ", n2, " (corrupt page?)");
  float* scale2 = s.meta.data();
  float* zero2 = scale2 + D;
  float* lo = zero2 + D;
  float* hi = lo + D;
  vidkv_key_levels(d, st, scale2, zero2, lo, hi);
  float* w2 = s.w.data();   // [M][n2]
  float* w1 = s.w1.data();  // [M][n1]
  float* qn = s.qn.data();  // [M][n1]: the normal channels (A q_N: s.u)
  for (int m = 0; m < M; ++m) {
    const float* qm = q + m * D;
    float* w2m = w2 + m * n2;
#if defined(LOWBIT_COMPRESS)
    // compress the query's channels by the mask (whole-vector stores: the buffers have
    // slack, and the spill past one vector's share is overwritten by the next)
    for (int c0 = 0, a = 0, b = 0; c0 < D; c0 += L) {
      const uint32_t k = lane_bits(cmask, c0), rest = ~k & kAllLanes;
      const vf v = loadf(qm + c0);
      storef(w2m + a, compress(v, k));
      storef(qn + m * n1 + b, compress(v, rest));
      a += __builtin_popcount(k);
      b += __builtin_popcount(rest);
    }
#else
    for (int j = 0; j < n2; ++j) w2m[j] = qm[s.idx2[j]];
    for (int j = 0; j < n1; ++j) qn[m * n1 + j] = qm[s.idxn[j]];
#endif
  }
  // u = A q_N: the inverse transform moved onto the query
  if (f.fft_map_t) LOWBIT_FOR_BLOCKS(M, mat_vec, f.fft_map_t, n1, qn, s.u.data())
  const float* un = f.fft_map_t ? s.u.data() : qn;
  // the weights read the compressed queries only now: a vector load right behind the
  // compressing stores spans two of them and waits for both to retire (a fifth of this
  // function's time when it followed them)
  for (int m = 0; m < M; ++m) {
    float* w2m = w2 + m * n2;
    s.cst[m] = dot(w2m, zero2, n2);
#pragma omp simd
    for (int j = 0; j < n2; ++j) w2m[j] *= scale2[j];
    const float* u = un + m * n1;
    float* w1m = w1 + m * n1;
#pragma omp simd
    for (int j = 0; j < n1; ++j) w1m[j] = u[j] * (hi[j] - lo[j]);
    std::fill(low + m * TP, low + (m + 1) * TP, s.cst[m] + dot(u, lo, n1));
  }
  if (n2) {
    code_column_scores(st + d[VK_CODES2], n, n2, 2, w2, M, TP, low, s);
  }
  if (n1) {
    code_column_scores(st + d[VK_CODES1], n, n1, 1, w1, M, TP, low, s);
  }
  if (np) {  // scatter storage order to token order
    for (int m = 0; m < M; ++m) {
      for (int i = 0; i < np; ++i) sc[m * TP + pos[i]] = prot[m * TP + i];
      for (int i = 0; i < n; ++i) sc[m * TP + pos[np + i]] = low[m * TP + i];
    }
  }
}

// -- values: acc[m * D + c] += sum_t p[m * TP + t] v_tc -------------------------------------
// acc[m] += a w_m (+ b psum_m) from the sums in s.w (and s.psum)
void fold_sums(const float* a, const float* b, int M, int D, float* acc, Scratch& s) {
  for (int m = 0; m < M; ++m) {
    const float* wm = s.w.data() + m * D;
    float* am = acc + m * D;
    const float ps = s.psum[m];
    if (b) {
#pragma omp simd
      for (int c = 0; c < D; ++c) am[c] += a[c] * wm[c] + b[c] * ps;
    } else {
#pragma omp simd
      for (int c = 0; c < D; ++c) am[c] += a[c] * wm[c];
    }
  }
}

// acc += a[c] * (sum_i p_i x_ic) + b[c] * (sum_i p_i) over the given rows of x
template <typename X>
void accumulate(const X& x, const int* pos, int rows, const float* p, int M, int D, int TP,
                const float* a, const float* b, float* acc, Scratch& s) {
  // sum_i p_i only matters with an offset b
  LOWBIT_FOR_BLOCKS(M, row_sums, x, pos, rows, D, p, TP, s.w.data(), b ? s.psum.data() : nullptr)
  fold_sums(a, b, M, D, acc, s);
}

int64_t code_bytes(int64_t count, int bits) { return (count * bits + 7) / 8; }

// accumulate over rows of D b-bit codes (b = 2, 4 or 8; D * b a multiple of 32 bits)
void accumulate_codes(const uint8_t* codes, int bits, const int* pos, int rows, const float* p,
                      int M, int D, int TP, const float* a, const float* b, float* acc,
                      Scratch& s) {
  const int rb = D * bits / 8;
#if defined(LOWBIT_PAIR_SUMS)
  // consecutive rows only (STP's protected ones are scattered, and too few to pay for
  // gathering their probabilities)
  const CodePairs* pairs = code_pairs(D, bits);
  if (pairs && rows > 0 && pos[rows - 1] - pos[0] == rows - 1) {
    LOWBIT_FOR_BLOCKS(M, code_pair_sums, pairs, codes, rows, D, pos, p, TP, s.w.data(),
                      b ? s.psum.data() : nullptr, reinterpret_cast<int16_t*>(s.x.data()))
    return fold_sums(a, b, M, D, acc, s);
  }
#endif
  switch (bits) {
    case 2: return accumulate(CodeRows<2>{codes, rb}, pos, rows, p, M, D, TP, a, b, acc, s);
    case 4: return accumulate(CodeRows<4>{codes, rb}, pos, rows, p, M, D, TP, a, b, acc, s);
    default: return accumulate(CodeRows<8>{codes, rb}, pos, rows, p, M, D, TP, a, b, acc, s);
  }
}

// KIVI per-token values as rows x[t * D + c] (x holds round_up(T D) floats), given their
// scales then zeros sz [2][T][D / group] as floats
void kivi_token_rows(const Format& f, const uint8_t* sv, float* x, const float* sz) {
  const int T = f.T, D = f.D, bits = int(f.val[KT_BITS]), gs = int(f.val[KT_GROUP]), ng = D / gs;
  decode_codes(sv + f.val[KT_CODES], code_bytes(int64_t(T) * D, bits), int64_t(T) * D, bits, x);
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < ng; ++g) {
      const float sc = sz[t * ng + g], z = sz[T * ng + t * ng + g];
      float* xr = x + t * D + g * gs;
#pragma omp simd
      for (int c = 0; c < gs; ++c) xr[c] = xr[c] * sc + z;
    }
}

// p (probabilities, token order) may be overwritten
void accumulate_values(const Format& f, const uint8_t* sv, float* p, int M, float* acc,
                       Scratch& s) {
  const int T = f.T, D = f.D, TP = f.TP;
  const auto& d = f.val;
  float* x = s.x.data();
  float* scale = s.meta.data();
  float* zero = scale + D;
  int* pos = s.vpos.data();
  if (d[0] == VAL_RVQ) {  // dense rows of one group
    rvq_decode(sv, d, f.val_books, T, D, x, s);
    stp_positions(nullptr, T, 0, pos);
    std::fill(scale, scale + D, 1.f);
    accumulate(DenseRows<float>{x, D}, pos, T, p, M, D, TP, scale, nullptr, acc, s);
    return;
  }
  if (d[0] == VAL_KIVI_TOKEN) {  // scale/zero per token group
    const int bits = int(d[KT_BITS]), gs = int(d[KT_GROUP]), ng = D / gs;
    std::vector<float>& sz = s.extra;  // scale then zero, [T][ng] each
    sz.resize(size_t(2) * T * ng);
    halves_to_float(sv + d[KT_SCALE], T * ng, sz.data());
    halves_to_float(sv + d[KT_ZERO], T * ng, sz.data() + T * ng);
    stp_positions(nullptr, T, 0, pos);
    std::fill(scale, scale + D, 1.f);
    // one group per token: sum_t p_t (s_t x_t + z_t) = sum_t (p_t s_t) x_t + sum_t p_t z_t
    if (ng == 1) {
      const float* st = sz.data();
      const float* zt = sz.data() + T;
      for (int m = 0; m < M; ++m) {
        float* pm = p + m * TP;
        s.cst[m] = dot(pm, zt, T);
#pragma omp simd
        for (int t = 0; t < T; ++t) pm[t] *= st[t];
      }
      accumulate_codes(sv + d[KT_CODES], bits, pos, T, p, M, D, TP, scale, nullptr, acc, s);
      for (int m = 0; m < M; ++m) {
        float* am = acc + m * D;
        const float pz = s.cst[m];
#pragma omp simd
        for (int c = 0; c < D; ++c) am[c] += pz;
      }
      return;
    }
    kivi_token_rows(f, sv, x, sz.data());
    accumulate(DenseRows<float>{x, D}, pos, T, p, M, D, TP, scale, nullptr, acc, s);
    return;
  }
  if (d[0] == VAL_KIVI_CHANNEL) {
    const int bits = int(d[KC_BITS]);
    halves_to_float(sv + d[KC_SCALE], D, scale);
    halves_to_float(sv + d[KC_ZERO], D, zero);
    stp_positions(nullptr, T, 0, pos);
    accumulate_codes(sv + d[KC_CODES], bits, pos, T, p, M, D, TP, scale, zero, acc, s);
    return;
  }
  // ternary (+ STP): protected rows 2-bit per channel, the rest alpha_c * trit
  const int np = int(d[TV_NP]), n = T - np;
  stp_positions(np ? sv + d[TV_TOK_MASK] : nullptr, T, np, pos);
  if (np) {
    halves_to_float(sv + d[TV_PROT_SCALE], D, scale);
    halves_to_float(sv + d[TV_PROT_ZERO], D, zero);
    accumulate_codes(sv + d[TV_PROT_CODES], 2, pos, np, p, M, D, TP, scale, zero, acc, s);
  }
  halves_to_float(sv + d[TV_ALPHA], D, scale);
#if defined(LOWBIT_FUSED_TRITS)
  if (D % LOWBIT_FUSED_TRITS == 0) {
#if defined(LOWBIT_PAIR_SUMS)
    if ((D == 64 || D == 128) && n > 0 && np == 0) {  // consecutive rows (no STP)
      LOWBIT_FOR_BLOCKS(M, ternary_pair_sums, sv + d[TV_TRITS], n, D, pos + np, p, TP,
                        s.w.data(), reinterpret_cast<int16_t*>(x))
    } else
#endif
    LOWBIT_FOR_BLOCKS(M, ternary_row_sums, sv + d[TV_TRITS], n, D, pos + np, p, TP, s.w.data())
    return fold_sums(scale, nullptr, M, D, acc, s);
  }
#endif
  int8_t* trits = reinterpret_cast<int8_t*>(x);
  decode_trits(sv + d[TV_TRITS], n * D, trits);
  accumulate(DenseRows<int8_t>{trits, D}, pos + np, n, p, M, D, TP, scale, nullptr, acc, s);
}

// rows [0, rows) of D b-bit codes (back to back) -> x[pos[i] * D + c] = code * scale[c] +
// zero[c] (s.x: scratch)
void affine_rows(const uint8_t* codes, int bits, const float* scale, const float* zero,
                 const int* pos, int rows, int D, float* x, Scratch& s) {
  float* c = s.x.data();
  decode_codes(codes, code_bytes(int64_t(rows) * D, bits), int64_t(rows) * D, bits, c);
  for (int i = 0; i < rows; ++i) {
    float* xr = x + size_t(pos[i]) * D;
#pragma omp simd
    for (int j = 0; j < D; ++j) xr[j] = c[i * D + j] * scale[j] + zero[j];
  }
}

// Group sv's values as rows x[t * D + c] = v_t[c] (rows [T, TP) zero), each format's
// arithmetic written out: the tile path's one-hot probabilities through accumulate_values
// would cost T times a row's work per row.
void value_rows(const Format& f, const uint8_t* sv, float* x, Scratch& s) {
  const int T = f.T, D = f.D, TP = f.TP;
  const auto& d = f.val;
  std::fill(x + size_t(T) * D, x + size_t(TP) * D, 0.f);
  float* scale = s.meta.data();
  float* zero = scale + D;
  int* pos = s.vpos.data();
  if (d[0] == VAL_RVQ) {
    rvq_decode(sv, d, f.val_books, T, D, x, s);
  } else if (d[0] == VAL_KIVI_TOKEN) {
    const int ng = D / int(d[KT_GROUP]);
    std::vector<float>& sz = s.extra;
    sz.resize(size_t(2) * T * ng);
    halves_to_float(sv + d[KT_SCALE], T * ng, sz.data());
    halves_to_float(sv + d[KT_ZERO], T * ng, sz.data() + T * ng);
    kivi_token_rows(f, sv, x, sz.data());
  } else if (d[0] == VAL_KIVI_CHANNEL) {
    halves_to_float(sv + d[KC_SCALE], D, scale);
    halves_to_float(sv + d[KC_ZERO], D, zero);
    stp_positions(nullptr, T, 0, pos);
    affine_rows(sv + d[KC_CODES], int(d[KC_BITS]), scale, zero, pos, T, D, x, s);
  } else {  // ternary (+ STP): protected rows 2-bit per channel, the rest alpha_c * trit
    const int np = int(d[TV_NP]), n = T - np;
    stp_positions(np ? sv + d[TV_TOK_MASK] : nullptr, T, np, pos);
    if (np) {
      halves_to_float(sv + d[TV_PROT_SCALE], D, scale);
      halves_to_float(sv + d[TV_PROT_ZERO], D, zero);
      affine_rows(sv + d[TV_PROT_CODES], 2, scale, zero, pos, np, D, x, s);
    }
    halves_to_float(sv + d[TV_ALPHA], D, scale);
    int8_t* trits = reinterpret_cast<int8_t*>(s.x.data());
    decode_trits(sv + d[TV_TRITS], n * D, trits);
    for (int i = 0; i < n; ++i) {
      float* xr = x + size_t(pos[np + i]) * D;
      const int8_t* tr = trits + i * D;
#pragma omp simd
      for (int j = 0; j < D; ++j) xr[j] = scale[j] * float(tr[j]);
    }
  }
}

// -- RVQ through per-query tables (decode items) -------------------------------------------
// A token's key is s_t sum_g sum_k c_k[j_tgk] (its std times the codewords of its indices,
// channels by group), so q . k_t = s_t sum_{g,k} (q_g . c_k[j_tgk]): with a table of q_g . c
// for every codeword, built once per item, a score is n K lookups instead of a decode (K D
// additions) and a product (D). Values alike: sum_t p_t v_t = sum_{g,k,j} (sum of p_t s_t
// over the tokens whose index at (g, k) is j) c_k[j], weights summed per codeword as the
// tokens go and multiplied out once at the end. Tables are laid out [g K + k][C][W]: a
// codeword's row holds the M query vectors' entries in W lanes (4 for up to 4 vectors, as
// SmolLM2's 3 query heads per KV head, else L; zeros past M; items of more than L vectors
// read no tables, rvq_tables_pay), read and added as one vector (a 4-lane row never
// straddles a cache line).
struct RvqTables {
  int W = 0;                        // row width
  std::vector<float> keys, values;  // [n K C W] each, where used
  std::vector<float> qg;            // the queries' channels by group [M][n][d^]
  std::vector<float> corr;          // the softmax's rescale of each row lane this group [W]
  std::vector<float> pt;            // one group's weights token-major [T][W]
};

inline int rvq_row_width(int M) { return M <= 4 ? 4 : L; }

// whether an item of `tokens` tokens and M query vectors reads this codec faster through
// tables: building (or multiplying out) one costs M K C D multiply-adds, after which a
// token costs n K M additions instead of K D (its decode) plus M D (its products). The
// counts weighed by what one thread of a Zen 5 measured: 4-lane rows (M <= 4: a 16-byte
// read per entry, tables of n K C 4 floats) break even at about half the tokens the counts
// say (3 query vectors: rvq8x256 ~370, rvq4x256 ~250), one-vector rows at about twice
// (rvq8x256, 6 and 12 query vectors: ~1.7K and ~3-4K), wider rows not by 16K tokens
// (rvq8x256 at 24 and 60 vectors: tables of 1 and 2 MB)
bool rvq_tables_pay(const RvqShape& r, int D, int M, int64_t tokens) {
  if (M > L) return false;
  const int64_t per_token = int64_t(r.K) * D + int64_t(M) * D - int64_t(r.n) * r.K * M;
  const int64_t build = int64_t(M) * r.K * r.C * D;
  return M <= 4 ? 2 * tokens * per_token > build : tokens * per_token > 2 * build;
}

size_t rvq_table_floats(const RvqShape& r, int W) { return size_t(r.n) * r.K * r.C * W; }

// keys[((g K + k) C + j) W + m] = q_m,g . c_k[j] for MB query vectors from m0 (q already
// scaled), L codes at a time from the codebooks transposed (columns [K][d^][C]), each code
// column loaded once for all MB; with 4-lane rows (M <= 4) the four sums (zeros past M)
// are interleaved into the rows by two rounds of zips, wider rows take them lane by lane.
template <int MB>
void key_table_block(const RvqShape& r, const float* columns, RvqTables& tab, int m0) {
  const int C = r.C, gs = r.gs, W = tab.W;
  alignas(64) float lanes[MB][L];
  for (int g = 0; g < r.n; ++g)
    for (int k = 0; k < r.K; ++k) {
      const float* bt = columns + size_t(k) * gs * C;
      float* rows = tab.keys.data() + (int64_t(g) * r.K + k) * C * W;
      const float* qm[MB];
      for (int b = 0; b < MB; ++b) qm[b] = tab.qg.data() + ((m0 + b) * r.n + g) * gs;
      for (int j0 = 0; j0 < C; j0 += L) {
        const int jb = std::min(L, C - j0);
        vf acc[std::max(MB, 4)] = {};
        if (jb == L) {
          for (int i = 0; i < gs; ++i) {
            const vf col = loadf(bt + size_t(i) * C + j0);
            for (int b = 0; b < MB; ++b) acc[b] += splat(qm[b][i]) * col;
          }
        } else {  // the last codes of a codebook whose size is not a multiple of L
          for (int b = 0; b < MB; ++b)
            for (int j = 0; j < jb; ++j)
              for (int i = 0; i < gs; ++i) acc[b][j] += qm[b][i] * bt[size_t(i) * C + j0 + j];
        }
        if (W == 4 && jb == L) {
          const vf t0 = zip_low(acc[0], acc[2]), t1 = zip_high(acc[0], acc[2]);
          const vf t2 = zip_low(acc[1], acc[3]), t3 = zip_high(acc[1], acc[3]);
          float* out = rows + int64_t(j0) * 4;
          storef(out, zip_low(t0, t2));
          storef(out + L, zip_high(t0, t2));
          storef(out + 2 * L, zip_low(t1, t3));
          storef(out + 3 * L, zip_high(t1, t3));
        } else {
          for (int b = 0; b < MB; ++b) storef(lanes[b], acc[b]);
          for (int j = 0; j < jb; ++j)
            for (int b = 0; b < MB; ++b) rows[(j0 + j) * W + m0 + b] = lanes[b][j];
        }
      }
    }
}

void rvq_key_table(const RvqShape& r, const float* columns, const float* q, int M, int D,
                   RvqTables& tab) {
  tab.keys.assign(rvq_table_floats(r, tab.W), 0.f);
  tab.qg.resize(size_t(M) * D);
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < r.n; ++g)
      for (int i = 0; i < r.gs; ++i)
        tab.qg[(m * r.n + g) * r.gs + i] = q[m * D + r.channel(g, i)];
  LOWBIT_FOR_BLOCKS(M, key_table_block, r, columns, tab)
}

// VW floats (4 or L) as one vector
template <int VW>
struct Lanes {
  typedef float V __attribute__((vector_size(4 * VW)));
  static V load(const float* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
};

// sc[m * TP + t] = q_m . k_t for the group's T tokens, from the key table of VW-lane rows
template <int VW>
void table_scores(const int32_t* rows, const float* sd, const RvqShape& r, const float* table,
                  int T, int M, int TP, float* sc) {
  using V = typename Lanes<VW>::V;
  const int nk = r.n * r.K;
  const int64_t stride = int64_t(r.C) * VW;  // floats per table (g, k)
  alignas(64) float lanes[VW];
  for (int t = 0; t < T; ++t) {
    const int32_t* row = rows + t * nk;
    auto entry = [&](int gk) { return Lanes<VW>::load(table + gk * stride + row[gk]); };
    V a0 = V{}, a1 = V{}, a2 = V{}, a3 = V{};  // one chain of nk additions: the bound
    int gk = 0;
    for (; gk + 4 <= nk; gk += 4) {
      a0 += entry(gk);
      a1 += entry(gk + 1);
      a2 += entry(gk + 2);
      a3 += entry(gk + 3);
    }
    for (; gk < nk; ++gk) a0 += entry(gk);
    Lanes<VW>::store(lanes, ((a0 + a1) + (a2 + a3)) * sd[t]);
    for (int m = 0; m < M; ++m) sc[m * TP + t] = lanes[m];
  }
}

// values[((g K + k) C + j) VW + m] += sum of p[m * TP + t] s_t over the tokens t with
// index j at (g, k)
template <int VW>
void table_weights(const int32_t* rows, const float* sd, const RvqShape& r, const float* p,
                   int T, int M, int TP, RvqTables& tab) {
  const int nk = r.n * r.K;
  const int64_t stride = int64_t(r.C) * VW;  // floats per table (g, k)
  tab.pt.assign(size_t(T) * VW, 0.f);  // p_t s_t token-major: a token's weights are one load
  for (int m = 0; m < M; ++m)
    for (int t = 0; t < T; ++t) tab.pt[size_t(t) * VW + m] = p[m * TP + t] * sd[t];
  for (int t = 0; t < T; ++t) {
    const auto w = Lanes<VW>::load(tab.pt.data() + size_t(t) * VW);
    const int32_t* row = rows + t * nk;
    float* base = tab.values.data();  // table (g, k)
    for (int gk = 0; gk < nk; ++gk, base += stride) {
      float* e = base + row[gk];
      Lanes<VW>::store(e, Lanes<VW>::load(e) + w);
    }
  }
}

void rvq_table_scores(const uint8_t* st, const RvqShape& r, const RvqTables& tab, int T, int M,
                      int TP, float* sc, Scratch& s) {
  rvq_rows(st, r, T, tab.W, s.rvq_rows.data(), s.rvq_sd.data());
  (tab.W == 4 ? table_scores<4> : table_scores<L>)(s.rvq_rows.data(), s.rvq_sd.data(), r,
                                                   tab.keys.data(), T, M, TP, sc);
}

void rvq_table_weights(const uint8_t* sv, const RvqShape& r, const float* p, int T, int M,
                       int TP, RvqTables& tab, Scratch& s) {
  rvq_rows(sv, r, T, tab.W, s.rvq_rows.data(), s.rvq_sd.data());
  (tab.W == 4 ? table_weights<4> : table_weights<L>)(s.rvq_rows.data(), s.rvq_sd.data(), r, p,
                                                     T, M, TP, tab);
}

// the value table times this group's softmax corrections (as acc), where one is not 1: L
// floats at a time, the W (4 or L) corrections repeated across the vector
void rvq_rescale(RvqTables& tab) {
  if (std::all_of(tab.corr.begin(), tab.corr.end(), [](float c) { return c == 1.f; })) return;
  vf c;
  for (int l = 0; l < L; ++l) c[l] = tab.corr[l % tab.W];
  float* v = tab.values.data();
  const size_t n = tab.values.size();
  size_t i = 0;
  for (; i + L <= n; i += L) storef(v + i, loadf(v + i) * c);
  for (; i < n; ++i) v[i] *= tab.corr[i % tab.W];
}

// n <= L floats at p as a vector (L loaded where there are; zeros past n otherwise, so
// that nothing past a codebook's end is read)
inline vf code_slice(const float* p, int n) {
  if (n >= L) return loadf(p);
  vf v = vf{};
  std::memcpy(&v, p, sizeof(float) * size_t(n));
  return v;
}

// acc[m * D + c] += the value table multiplied out: sum_{g,k,j} w_gkj,m c_k[j] at the
// channels of group g, for MB query vectors from m0: L channels of each in registers, two
// sums per vector over the codes, each code slice loaded once for all MB
template <int MB>
void fold_block(const RvqShape& r, const float* books, const RvqTables& tab, int D, float* acc,
                int m0) {
  const int gs = r.gs, W = tab.W;
  alignas(64) float lanes[L];
  for (int g = 0; g < r.n; ++g)
    for (int i0 = 0; i0 < gs; i0 += L) {
      vf s0[MB] = {}, s1[MB] = {};
      for (int k = 0; k < r.K; ++k) {
        const float* w = tab.values.data() + (int64_t(g) * r.K + k) * r.C * W + m0;
        const float* c = books + int64_t(k) * r.C * gs + i0;
        int j = 0;
        for (; j + 2 <= r.C; j += 2) {
          const vf c0 = code_slice(c + int64_t(j) * gs, gs - i0);
          const vf c1 = code_slice(c + int64_t(j + 1) * gs, gs - i0);
          for (int b = 0; b < MB; ++b) {
            s0[b] += splat(w[int64_t(j) * W + b]) * c0;
            s1[b] += splat(w[int64_t(j + 1) * W + b]) * c1;
          }
        }
        if (j < r.C) {
          const vf c0 = code_slice(c + int64_t(j) * gs, gs - i0);
          for (int b = 0; b < MB; ++b) s0[b] += splat(w[int64_t(j) * W + b]) * c0;
        }
      }
      for (int b = 0; b < MB; ++b) {
        storef(lanes, s0[b] + s1[b]);
        for (int i = i0; i < std::min(gs, i0 + L); ++i)
          acc[(m0 + b) * D + r.channel(g, i)] += lanes[i - i0];
      }
    }
}

void rvq_fold_values(const RvqShape& r, const float* books, const RvqTables& tab, int M, int D,
                     float* acc) {
  LOWBIT_FOR_BLOCKS(M, fold_block, r, books, tab, D, acc)
}

// -- one work item: request r, KV head h, its groups [g_lo, g_hi) -----------------------
struct Item {
  int64_t r, h, g_lo, g_hi, partial;  // partial: index into the split buffers, -1: final
};

struct Run {
  const Format* f;
  const uint8_t* pages;
  int64_t block_stride, head_stride;
  const int64_t* q_start;
  const int64_t* table;
  int64_t table_stride;
  const int64_t* skip;
  at::ScalarType qtype;
  const void* query;
  int64_t q_row_stride, q_head_stride;
  int64_t Hq, G;
  float scale;
  // the layout's rotation (pages hold K M and V M): M and M^T [D][D] row-major, or
  // nullptr; the query is read as q M, the output written as o M^T
  const float* rot;
  const float* rot_t;

  // the state of group gi of item it's request (its group table's entry) and KV head
  const uint8_t* state(const Item& it, int64_t gi) const {
    const int64_t gid = table[it.r * table_stride + gi];
    return pages + (gid / f->N) * block_stride + it.h * head_stride + f->sink_bytes +
           (gid % f->N) * f->state_bytes;
  }
};

// dst[0, D) = the query vector of (row, head) times scale, as float32
inline void load_query(const Run& run, int64_t row, int64_t head, int D, float scale,
                       float* dst) {
  const int64_t first = row * run.q_row_stride + head * run.q_head_stride;
  int c = 0;
  if (run.qtype == at::kBFloat16) {
    const uint16_t* src = static_cast<const uint16_t*>(run.query) + first;
    for (; c + L <= D; c += L) storef(dst + c, load_bf16(src + c) * scale);
  } else if (run.qtype == at::kFloat) {
    const float* src = static_cast<const float*>(run.query) + first;
    for (; c + L <= D; c += L) storef(dst + c, loadf(src + c) * scale);
  }
  for (; c < D; ++c) {  // fp16, and what is left past the last vector
    const int64_t i = first + c;
    switch (run.qtype) {
      case at::kFloat: dst[c] = static_cast<const float*>(run.query)[i] * scale; break;
      case at::kBFloat16:
        dst[c] = float(static_cast<const c10::BFloat16*>(run.query)[i]) * scale;
        break;
      default: dst[c] = float(static_cast<const c10::Half*>(run.query)[i]) * scale;
    }
  }
}

// Query vectors from which an item decodes each group once to float tiles and multiplies
// them (micro_gemm.h) instead of folding every query vector into the codes (a prefill
// chunk): the decode costs a few hundred query vectors' worth of the folded path, the
// products then run at a matrix-multiply rate. SmolLM2's vidkv pages on a 2-core EPYC,
// one thread: tiles 10-15% faster per row from 96-128 rows x 3 query heads, 25% slower at
// 64 rows; 20-25% faster at 512.
constexpr int kTileMinVectors = 256;

// Per-thread buffers of the item loop (the scratch also serves the tile decode's D and T
// basis vectors; the tile buffers are empty unless an item of the call reaches the tile
// path).
struct Work {
  Scratch s;
  RvqTables rvq;
  TilePool tiles;
  float *q, *sc, *acc, *mrun, *lsum;
  float *kt, *vrows, *basis;  // tile path: K^T [D][TP], V [TP][D], basis vectors
  TileProducts products;      // tile path: Q K^T and P V (micro_gemm.h)
  std::vector<int> group_end;  // softmax_rows' hi: a group's T positions, every row
  std::vector<float> corr;     // softmax_rows' corrections (RVQ value tables keep their own)
  // tile: whether an item of the call takes the tile path (1) or not (0: empty buffers);
  // bf16: the call's queries are bf16
  Work(const Format& f, int M, int64_t tile, bool bf16)
      : s(f, tile ? std::max(M, f.D) : M),
        tiles({int64_t(M) * f.D, int64_t(M) * f.TP, int64_t(M) * f.D, M, M,
               tile * f.D * f.TP, tile * f.TP * f.D,
               tile * f.D * f.D}),
        q(tiles[0]), sc(tiles[1]), acc(tiles[2]), mrun(tiles[3]), lsum(tiles[4]), kt(tiles[5]),
        vrows(tiles[6]), basis(tiles[7]), products(tile && bf16, tile * M, f.D, tile * f.TP),
        group_end(M, f.T), corr(M) {}
};

// The scratch of this thread for calls without the tile path (decode steps), kept between
// calls per page format: allocating and zeroing it (about 100 KB) cost as much as attending
// a short context. A call reuses it as the items of one call reuse theirs.
Work& kept_work(const Format& f, int M) {
  constexpr size_t kMostFormats = 8;  // a model's layers use one or two
  struct Kept {
    std::vector<int64_t> format;
    int M;
    std::unique_ptr<Work> work;
  };
  thread_local std::vector<Kept> kept;
  std::vector<int64_t> format{f.T, f.D, f.TP, f.H, f.N, f.sink_bytes, f.state_bytes, f.k_bytes};
  format.insert(format.end(), f.key.begin(), f.key.end());
  format.insert(format.end(), f.val.begin(), f.val.end());
  for (Kept& k : kept)
    if (k.format == format) {
      if (k.M < M) k = {std::move(format), M, std::make_unique<Work>(f, M, 0, false)};
      return *k.work;
    }
  if (kept.size() == kMostFormats) kept.erase(kept.begin());
  kept.push_back({std::move(format), M, std::make_unique<Work>(f, M, 0, false)});
  return *kept.back().work;
}

// VidKV's A as the rows of key_rows' `columns`, [n1][n1] (empty without the FFT)
std::vector<float> key_map_columns(const Format& f) {
  if (f.key[0] != KEY_VIDKV || !f.fft_map_t) return {};
  const int n1 = int(f.key[VK_N1]);
  std::vector<float> columns(size_t(n1) * n1);
  for (int j = 0; j < n1; ++j)
    for (int c = 0; c < n1; ++c) columns[j * n1 + c] = f.fft_map_t[c * n1 + j];
  return columns;
}

// Group st's keys as rows rows[t * D + c] = k_t[c] (t < T), read straight from the codes
// where the format allows, for decode_groups (decode_tiles' unit vectors cost D query
// vectors' scores per group): KIVI per channel, code * scale + zero; VidKV without STP, the
// 2-bit channels likewise and the 1-bit components as their levels (lo or hi), mapped to
// the normal channels by A where the format has the FFT: x_N = sum_j z_j a_j, a_j = column
// j of A, given as the rows of `columns` [n1][n1] (fft_map_t transposed, key_map_columns).
// False, nothing written, for the other formats. rows: not s's memory (s: scratch).
bool key_rows(const Format& f, const uint8_t* st, const float* columns, float* rows,
              Scratch& s) {
  const int T = f.T, D = f.D;
  const auto& d = f.key;
  float *scale = s.meta.data(), *zero = scale + D;
  if (d[0] == KEY_KIVI_CHANNEL) {
    halves_to_float(st + d[KK_SCALE], D, scale);
    halves_to_float(st + d[KK_ZERO], D, zero);
    stp_positions(nullptr, T, 0, s.kpos.data());
    affine_rows(st + d[KK_CODES], int(d[KK_BITS]), scale, zero, s.kpos.data(), T, D, rows, s);
    return true;
  }
  if (d[0] != KEY_VIDKV || d[VK_NP] != 0) return false;
  const int n2 = int(d[VK_N2]), n1 = int(d[VK_N1]), J = round_up(n1) / L;
  if (f.fft_map_t && J > 4) return false;  // wider than rows_times runs below
  // the codes in s.x (T D + 2 L floats hold both streams), the levels in s.meta
  float *c2 = s.x.data(), *c1 = c2 + size_t(T) * n2 + L;
  float *scale2 = scale, *zero2 = zero, *lo = zero + D, *hi = lo + D;
  vidkv_key_levels(d, st, scale2, zero2, lo, hi);
  decode_codes(st + d[VK_CODES2], code_bytes(int64_t(T) * n2, 2), int64_t(T) * n2, 2, c2);
  decode_codes(st + d[VK_CODES1], code_bytes(int64_t(T) * n1, 1), int64_t(T) * n1, 1, c1);
  // each token's row first in stream order (its 2-bit channels, then its normal ones),
  // then put in channel order
  for (int t = 0; t < T; ++t) {
    const float* code2 = c2 + t * n2;
    float* x = rows + t * D;
#pragma omp simd
    for (int j = 0; j < n2; ++j) x[j] = code2[j] * scale2[j] + zero2[j];
  }
  for (int t = 0; t < T; ++t) {  // the components' levels z, in place of their bits
    float* z = c1 + t * n1;
#pragma omp simd
    for (int j = 0; j < n1; ++j) z[j] = z[j] != 0.f ? hi[j] : lo[j];
  }
  if (!f.fft_map_t) {
    for (int t = 0; t < T; ++t) std::memcpy(rows + t * D + n2, c1 + t * n1, sizeof(float) * n1);
  } else if (n1 > 0) {
    rows_times(c1, n1, T, n1, columns, n1, n1, rows + n2, D);
  }
  const uint8_t* cmask = st + d[VK_CHAN_MASK];
  float* x = s.w.data();  // one token's row in stream order
#if defined(__AVX512F__)
  // channel order by expanding loads: a 16-channel block takes its 2-bit channels (mask bits
  // set) from the next 2-bit values and the rest from the next normal ones
  for (int t = 0; t < T; ++t) {
    float* row = rows + t * D;
    std::memcpy(x, row, sizeof(float) * D);
    const float *two = x, *normal = x + n2;
    for (int c = 0; c < D; c += L) {
      uint16_t bits;
      std::memcpy(&bits, cmask + c / 8, sizeof bits);
      const __m512 v = _mm512_mask_expandloadu_ps(_mm512_maskz_expandloadu_ps(bits, two),
                                                  __mmask16(~bits), normal);
      _mm512_storeu_ps(row + c, v);
      two += __builtin_popcount(bits);
      normal += L - __builtin_popcount(bits);
    }
  }
#else
  int* source = s.idx2.data();  // channel c's place in the stream-order row
  for (int c = 0, a = 0, b = n2; c < D; ++c) source[c] = bit_at(cmask, c) ? a++ : b++;
  for (int t = 0; t < T; ++t) {
    float* row = rows + t * D;
    std::memcpy(x, row, sizeof(float) * D);
    for (int c = 0; c < D; ++c) row[c] = x[source[c]];
  }
#endif
  return true;
}

// Group st decoded as tiles: wk.kt[c * TP + t] = k_t[c] and wk.vrows[t * D + c] = v_t[c]
// (tokens in [T, TP) finite junk). The key codecs are linear in what the kernel folds into
// them, so the folded paths decode too: the scores of the unit vectors e_c are the key
// channels (one definition of every key format's arithmetic, the one the decode items use;
// RVQ's folded path decodes the rows first, so its tiles are those rows). Values are
// decoded row by row (value_rows).
void decode_tiles(const Format& f, const uint8_t* st, Work& wk) {
  const int D = f.D, T = f.T, TP = f.TP;
  float* e = wk.basis;
  if (f.key[0] == KEY_RVQ) {
    rvq_key_columns(f, st, wk.kt, wk.s);
  } else {
    std::fill(e, e + size_t(D) * D, 0.f);
    for (int c = 0; c < D; ++c) e[c * D + c] = 1.f;
    key_scores(f, st, e, D, wk.kt, wk.s);
  }
  value_rows(f, st + f.k_bytes, wk.vrows, wk.s);
}

// Online softmax over the item's groups. Leaves acc (unnormalized), mrun (running max)
// and lsum (sum of exp(score - mrun)) for the M = rows * G query vectors. after: the
// thread's next item (its first group is fetched during this item's last), or nullptr.
void run_item(const Run& run, const Item& it, const Item* after, Work& wk, float* acc,
              float* mrun, float* lsum) {
  const Format& f = *run.f;
  const int T = f.T, D = f.D, TP = f.TP;
  const int64_t q0 = run.q_start[it.r], rows = run.q_start[it.r + 1] - q0;
  const int M = int(rows * run.G);
  float* q = wk.q;
  float* sc = wk.sc;
  const bool tiles = M >= kTileMinVectors;
  const bool pairs = tiles && wk.products.bf16();  // then the scale goes on the scores
  const float q_scale = pairs ? 1.f : run.scale;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < run.G; ++g)
      load_query(run, q0 + i, it.h * run.G + g, D, q_scale, q + (i * run.G + g) * D);
  if (run.rot) {  // q M (the scratch's u is free until the first group's keys)
    float* rotated = wk.s.u.data();
    LOWBIT_FOR_BLOCKS(M, mat_vec, run.rot, D, q, rotated)
    std::copy(rotated, rotated + size_t(M) * D, q);
  }
  if (tiles) wk.products.queries(q, M);
  std::fill(acc, acc + size_t(M) * D, 0.f);
  std::fill(mrun, mrun + M, kNegInf);
  std::fill(lsum, lsum + M, 0.f);
  // RVQ codes through tables where building them pays for this item's tokens
  const int64_t tokens = (it.g_hi - it.g_lo) * T;
  std::optional<RvqShape> key_rvq, val_rvq;
  wk.rvq.W = rvq_row_width(M);
  if (!tiles && f.key[0] == KEY_RVQ && rvq_tables_pay(RvqShape(f.key, D), D, M, tokens)) {
    key_rvq.emplace(f.key, D);
    rvq_key_table(*key_rvq, f.key_columns, q, M, D, wk.rvq);
  }
  if (!tiles && f.val[0] == VAL_RVQ && rvq_tables_pay(RvqShape(f.val, D), D, M, tokens)) {
    val_rvq.emplace(f.val, D);
    wk.rvq.values.assign(rvq_table_floats(*val_rvq, wk.rvq.W), 0.f);
    wk.rvq.corr.assign(wk.rvq.W, 1.f);
  }
  const int64_t skip = run.skip[it.r];
  // The next group's state (states are scattered over the cache) is fetched a quarter at a
  // time, between this group's phases: all at once, its lines (56 for vidkv) outnumber the
  // core's line fill buffers and the prefetches stall it (a decode call 7-24% slower)
  const int64_t lines = (f.state_bytes + 63) / 64;
  for (int64_t gi = it.g_lo; gi < it.g_hi; ++gi) {
    const uint8_t* st = run.state(it, gi);
    // the last group's fetches bring the first group of the thread's next item
    const uint8_t* next = gi + 1 < it.g_hi                   ? run.state(it, gi + 1)
                          : after && after->g_lo < after->g_hi ? run.state(*after, after->g_lo)
                                                               : nullptr;
    auto fetch_quarter = [&](int q) {
      if (next)
        for (int64_t l = lines * q / 4; l < lines * (q + 1) / 4; ++l)
          __builtin_prefetch(next + l * 64);
    };
    fetch_quarter(0);
    if (tiles) {
      decode_tiles(f, st, wk);
      wk.products.scores(wk.kt, TP, TP, sc, TP);
    } else if (key_rvq) {
      rvq_table_scores(st, *key_rvq, wk.rvq, T, M, TP, sc, wk.s);
    } else {
      key_scores(f, st, q, M, sc, wk.s);
    }
    fetch_quarter(1);
    const int masked = int(std::clamp<int64_t>(skip - gi * T, 0, T));  // leading sink positions
    softmax_rows(sc, M, TP, TP, masked, wk.group_end.data(), pairs ? run.scale : 1.f, mrun, lsum,
                 acc, D, val_rvq ? wk.rvq.corr.data() : wk.corr.data());
    fetch_quarter(2);
    if (tiles) {
      wk.products.values(sc, TP, wk.vrows, T, acc);
    } else if (val_rvq) {
      rvq_rescale(wk.rvq);
      rvq_table_weights(st + f.k_bytes, *val_rvq, sc, T, M, TP, wk.rvq, wk.s);
    } else {
      accumulate_values(f, st + f.k_bytes, sc, M, acc, wk.s);
    }
    fetch_quarter(3);
  }
  if (val_rvq) rvq_fold_values(*val_rvq, f.val_books, wk.rvq, M, D, acc);
}

void write_rows(const Run& run, int64_t r, int64_t h, const float* acc, const float* mrun,
                const float* lsum, float* out, float* lse, int D) {
  const int64_t q0 = run.q_start[r], rows = run.q_start[r + 1] - q0;
  const int G = int(run.G);
  for (int64_t i = 0; i < rows; ++i) {
    float* o = out + ((q0 + i) * run.Hq + h * G) * D;  // the row's G heads, back to back
    if (run.rot)  // acc M^T, scaled below
      LOWBIT_FOR_BLOCKS(G, mat_vec, run.rot_t, D, acc + i * G * D, o)
    for (int g = 0; g < G; ++g) {
      const int64_t m = i * G + g;
      const bool any = lsum[m] > 0.f;
      const float inv = any ? 1.f / lsum[m] : 0.f;
      const float* src = run.rot ? o + g * D : acc + m * D;
      for (int c = 0; c < D; ++c) o[g * D + c] = src[c] * inv;
      lse[(q0 + i) * run.Hq + h * G + g] = any ? mrun[m] + std::log(lsum[m]) : kNegInf;
    }
  }
}

constexpr int64_t kMinGroupsPerSplit = 4;

// A page format from its descriptors (vllm_lowbit_kv/ops/cpu.py), checked
Format make_format(at::IntArrayRef geometry, at::IntArrayRef key_desc, at::IntArrayRef value_desc,
                   const at::Tensor& fft_map, const at::Tensor& codebooks,
                   const at::Tensor& key_columns) {
  TORCH_CHECK(geometry.size() == G_COUNT, "geometry: ", G_COUNT, " entries expected");
  Format f{int(geometry[G_T]), int(geometry[G_D]), round_up(int(geometry[G_T])),
           int(geometry[G_H]), int(geometry[G_N]), geometry[G_SINK_BYTES],
           geometry[G_STATE_BYTES], geometry[G_K_BYTES], key_desc.vec(), value_desc.vec(), nullptr,
           nullptr, nullptr, nullptr};
  TORCH_CHECK(!f.key.empty() && !f.val.empty(), "empty codec descriptor");
  TORCH_CHECK((f.key[0] == KEY_KIVI_CHANNEL && f.key.size() == KK_COUNT) ||
                  (f.key[0] == KEY_VIDKV && f.key.size() == VK_COUNT) ||
                  (f.key[0] == KEY_RVQ && f.key.size() == RV_COUNT),
              "key descriptor: unknown kind or length");
  TORCH_CHECK((f.val[0] == VAL_KIVI_TOKEN && f.val.size() == KT_COUNT) ||
                  (f.val[0] == VAL_KIVI_CHANNEL && f.val.size() == KC_COUNT) ||
                  (f.val[0] == VAL_TERNARY && f.val.size() == TV_COUNT) ||
                  (f.val[0] == VAL_RVQ && f.val.size() == RV_COUNT),
              "value descriptor: unknown kind or length");
  const int64_t D = f.D;
  // RVQ: codebooks holds the key codebooks (if the keys are RVQ), then the value codebooks
  int64_t book_floats = 0;
  for (const std::vector<int64_t>* d : {&f.key, &f.val})
    if (is_rvq(*d, d == &f.key)) {
      TORCH_CHECK((*d)[RV_BITS] >= 1 && (*d)[RV_BITS] <= 16 && (*d)[RV_C] >= 1 &&
                      (*d)[RV_C] <= (int64_t(1) << (*d)[RV_BITS]) && (*d)[RV_GROUP] >= 1 &&
                      (*d)[RV_GROUP] <= D && D % (*d)[RV_GROUP] == 0,
                  "RVQ descriptor: bits in [1, 16], C <= 2^bits, d^ dividing head_dim");
      book_floats += (*d)[RV_K] * (*d)[RV_C] * (*d)[RV_GROUP];
    }
  if (book_floats) {
    TORCH_CHECK(codebooks.scalar_type() == at::kFloat && codebooks.is_contiguous() &&
                    codebooks.numel() == book_floats,
                "codebooks: float32 contiguous, ", book_floats, " values (keys' then values')");
    const float* books = codebooks.data_ptr<float>();
    if (f.key[0] == KEY_RVQ) {
      f.key_books = books;
      books += f.key[RV_K] * f.key[RV_C] * f.key[RV_GROUP];
      TORCH_CHECK(key_columns.scalar_type() == at::kFloat && key_columns.is_contiguous() &&
                      key_columns.numel() == f.key[RV_K] * f.key[RV_C] * f.key[RV_GROUP],
                  "key_columns: float32 contiguous, the RVQ key codebooks transposed [K][d^][C]");
      f.key_columns = key_columns.data_ptr<float>();
    }
    if (f.val[0] == VAL_RVQ) f.val_books = books;
  }
  TORCH_CHECK(D % L == 0, "head_dim must be a multiple of ", L);
  if (f.key[0] == KEY_VIDKV && fft_map.numel()) {
    const int64_t n1 = f.key[VK_N1];
    TORCH_CHECK(fft_map.scalar_type() == at::kFloat && fft_map.is_contiguous() &&
                    fft_map.numel() == n1 * n1,
                "fft_map: float32 contiguous [n1, n1] (A transposed)");
    f.fft_map_t = fft_map.data_ptr<float>();
  }
  return f;
}

void check_pages(const Format& f, const at::Tensor& pages) {
  TORCH_CHECK(pages.scalar_type() == at::kByte && pages.dim() == 3 && pages.size(1) == f.H &&
                  pages.stride(2) == 1,
              "pages: uint8 [num_blocks, H, page bytes] with unit stride in the last dim");
  TORCH_CHECK(pages.size(2) == f.sink_bytes + f.N * f.state_bytes, "pages: ",
              f.sink_bytes + f.N * f.state_bytes, " bytes per head expected");
}

}  // namespace

void packed_attention(const at::Tensor& query, const at::Tensor& q_start, const at::Tensor& pages,
                      const at::Tensor& group_table, const at::Tensor& num_groups,
                      const at::Tensor& skip_tokens, double scale, at::IntArrayRef geometry,
                      at::IntArrayRef key_desc, at::IntArrayRef value_desc,
                      const at::Tensor& fft_map, const at::Tensor& codebooks,
                      const at::Tensor& key_columns, const at::Tensor& rotation,
                      const at::Tensor& out, const at::Tensor& lse) {
  const Format f = make_format(geometry, key_desc, value_desc, fft_map, codebooks, key_columns);
  const int64_t T = f.T, D = f.D, H = f.H;
  TORCH_CHECK(query.dim() == 3 && query.size(2) == D && query.stride(2) == 1,
              "query: [n, Hq, ", D, "] with unit stride in the last dim");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16 ||
                  query.scalar_type() == at::kHalf,
              "query dtype: float32, bfloat16 or float16");
  const int64_t n = query.size(0), Hq = query.size(1);
  TORCH_CHECK(Hq % H == 0, "query heads (", Hq, ") must be a multiple of the KV heads (", H, ")");
  check_pages(f, pages);
  for (const at::Tensor* t : {&q_start, &group_table, &num_groups, &skip_tokens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "index tensors: int64 contiguous");
  const int64_t R = q_start.numel() - 1;
  TORCH_CHECK(R >= 0 && num_groups.numel() == R && skip_tokens.numel() == R &&
                  group_table.dim() == 2 && group_table.size(0) == R,
              "q_start [R+1], num_groups [R], skip_tokens [R], group_table [R, G_max]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 &&
                  out.size(0) == n && out.size(1) == Hq && out.size(2) == D,
              "out: float32 contiguous [n, Hq, D]");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == n * Hq,
              "lse: float32 contiguous [n, Hq]");
  TORCH_CHECK(rotation.numel() == 0 ||
                  (rotation.scalar_type() == at::kFloat && rotation.is_contiguous() &&
                   rotation.numel() == 2 * D * D),
              "rotation: float32 contiguous [2, head_dim, head_dim] (M and M^T), or empty");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ng = num_groups.data_ptr<int64_t>();
  const int64_t* sk = skip_tokens.data_ptr<int64_t>();
  TORCH_CHECK(R == 0 || (qs[0] >= 0 && qs[R] <= n), "q_start must lie in [0, n]");
  const int64_t num_gids = pages.size(0) * f.N;
  const int64_t* table = group_table.data_ptr<int64_t>();
  float* out_p = out.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  const int64_t G = Hq / H;

  // rows outside every request, and requests without packed keys: out 0, lse -inf
  std::vector<char> covered(n, 0);
  std::vector<int64_t> active;
  int64_t total_work = 0;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(qs[r + 1] >= qs[r], "q_start must be non-decreasing");
    TORCH_CHECK(ng[r] >= 0 && ng[r] <= group_table.size(1), "num_groups[", r, "] out of range");
    const int64_t first = std::max<int64_t>(sk[r], 0) / T;
    if (qs[r + 1] > qs[r] && ng[r] > first) {
      for (int64_t gi = first; gi < ng[r]; ++gi) {
        const int64_t gid = table[r * group_table.stride(0) + gi];
        TORCH_CHECK(gid >= 0 && gid < num_gids, "group_table[", r, ", ", gi, "] = ", gid,
                    " outside the cache's ", num_gids, " groups");
      }
      active.push_back(r);
      total_work += (ng[r] - first) * (qs[r + 1] - qs[r]);
      std::fill(covered.begin() + qs[r], covered.begin() + qs[r + 1], 1);
    }
  }
  for (int64_t i = 0; i < n; ++i)
    if (!covered[i]) {
      std::fill(out_p + i * Hq * D, out_p + (i + 1) * Hq * D, 0.f);
      std::fill(lse_p + i * Hq, lse_p + (i + 1) * Hq, kNegInf);
    }
  if (active.empty()) return;

  // Work items: (request, head) pairs, long contexts split so that every thread gets
  // several items; the splits of one (request, head) are merged below. RVQ items build
  // tables of every codeword once per item (rvq_tables_pay), so their contexts are split
  // only as far as every thread gets one.
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  const bool rvq = f.key[0] == KEY_RVQ || f.val[0] == VAL_RVQ;
  const int64_t want_items = (rvq ? 1 : 4) * threads;
  const int64_t base_items = int64_t(active.size()) * H;
  std::vector<Item> items;
  int64_t partials = 0, max_m = 0;
  for (int64_t r : active) {
    const int64_t first = std::max<int64_t>(sk[r], 0) / T, groups = ng[r] - first;
    const int64_t rows = qs[r + 1] - qs[r];
    max_m = std::max(max_m, rows * G);
    // a share of the wanted items proportional to this request's work
    int64_t splits = base_items >= want_items
                         ? 1
                         : (want_items * groups * rows + total_work * H - 1) / (total_work * H);
    const int64_t most = std::max<int64_t>(groups / kMinGroupsPerSplit, 1);
    splits = std::clamp<int64_t>(splits, 1, most);
    // a request alone (a prefill chunk): as many items as a whole number of rounds of the
    // threads, or the last round runs one thread
    if (active.size() == 1)
      while (splits < most && (H * splits) % threads) ++splits;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t lo = first + groups * s / splits, hi = first + groups * (s + 1) / splits;
        items.push_back({r, h, lo, hi, splits > 1 ? partials++ : -1});
      }
  }
  std::vector<float> p_acc, p_m, p_l;
  if (partials) {
    p_acc.resize(size_t(partials) * max_m * D);
    p_m.resize(size_t(partials) * max_m);
    p_l.resize(size_t(partials) * max_m);
  }

  const float* rot = rotation.numel() ? rotation.data_ptr<float>() : nullptr;
  Run run{&f, pages.data_ptr<uint8_t>(), pages.stride(0), pages.stride(1), qs, table,
          group_table.stride(0), sk, query.scalar_type(), query.data_ptr(), query.stride(0),
          query.stride(1), Hq, G, float(scale), rot, rot ? rot + D * D : nullptr};

  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::optional<Work> own;
    Work& wk = max_m >= kTileMinVectors
                   ? own.emplace(f, int(max_m), 1, run.qtype == at::kBFloat16)
                   : kept_work(f, int(max_m));
    for (int64_t k = begin; k < end; ++k) {
      const Item& it = items[k];
      const Item* after = k + 1 < end ? &items[k + 1] : nullptr;
      if (it.partial >= 0) {
        const size_t at_m = size_t(it.partial) * max_m;
        run_item(run, it, after, wk, p_acc.data() + at_m * D, p_m.data() + at_m,
                 p_l.data() + at_m);
      } else {
        run_item(run, it, after, wk, wk.acc, wk.mrun, wk.lsum);
        write_rows(run, it.r, it.h, wk.acc, wk.mrun, wk.lsum, out_p, lse_p, int(D));
      }
    }
  });
  if (!partials) return;

  // merge the splits of each (request, head) by log-sum-exp
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first, end) items of one (request, head)
  for (int64_t k = 0; k < int64_t(items.size());) {
    int64_t e = k + 1;
    while (e < int64_t(items.size()) && items[e].r == items[k].r && items[e].h == items[k].h) ++e;
    if (items[k].partial >= 0) runs.push_back({k, e});
    k = e;
  }
  at::parallel_for(0, int64_t(runs.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc, mrun, lsum;
    for (int64_t k = begin; k < end; ++k) {
      const Item& first = items[runs[k].first];
      const int64_t M = (qs[first.r + 1] - qs[first.r]) * G;
      acc.assign(size_t(M) * D, 0.f);
      mrun.assign(M, kNegInf);
      lsum.assign(M, 0.f);
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = runs[k].first; j < runs[k].second; ++j)
          mrun[m] = std::max(mrun[m], p_m[size_t(items[j].partial) * max_m + m]);
        if (mrun[m] == kNegInf) continue;
        for (int64_t j = runs[k].first; j < runs[k].second; ++j) {
          const size_t at_m = size_t(items[j].partial) * max_m + m;
          if (p_m[at_m] == kNegInf) continue;
          const float w = std::exp(p_m[at_m] - mrun[m]);
          lsum[m] += w * p_l[at_m];
          const float* src = p_acc.data() + at_m * D;
          float* dst = acc.data() + m * D;
#pragma omp simd
          for (int64_t c = 0; c < D; ++c) dst[c] += w * src[c];
        }
      }
      write_rows(run, first.r, first.h, acc.data(), mrun.data(), lsum.data(), out_p, lse_p, int(D));
    }
  });
}

// One context's packed groups as dense rows, for a prefill chunk that attends to them with
// the dense kernel (vllm_lowbit_kv/paged/attention.py): tokens [skip, G T) of the groups
// gids (token order) -> rows [0, G T - skip) of key_out and value_out [rows, H, D] (float32,
// bfloat16 or float16; unit stride in the last dim), in the pages' space (a rotating layout's
// rows stay rotated). Keys from their codes where key_rows reads the format, else as
// decode_tiles decodes them (the tile path's arithmetic); values by value_rows.
void decode_groups(const at::Tensor& pages, const at::Tensor& gids, int64_t skip,
                   at::IntArrayRef geometry, at::IntArrayRef key_desc,
                   at::IntArrayRef value_desc, const at::Tensor& fft_map,
                   const at::Tensor& codebooks, const at::Tensor& key_columns,
                   const at::Tensor& key_out, const at::Tensor& value_out) {
  const Format f = make_format(geometry, key_desc, value_desc, fft_map, codebooks, key_columns);
  check_pages(f, pages);
  const int64_t T = f.T, D = f.D, H = f.H, TP = f.TP, G = gids.numel();
  TORCH_CHECK(gids.scalar_type() == at::kLong && gids.is_contiguous(),
              "gids: int64 contiguous");
  TORCH_CHECK(skip >= 0 && skip <= G * T, "skip: in [0, ", G * T, "]");
  const int64_t rows = G * T - skip;
  for (const at::Tensor* t : {&key_out, &value_out})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == rows && t->size(1) == H && t->size(2) == D &&
                    t->stride(2) == 1 &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16 ||
                     t->scalar_type() == at::kHalf),
                "key_out, value_out: float32, bfloat16 or float16 [", rows, ", ", H, ", ", D,
                "] with unit stride in the last dim");
  const int64_t* g = gids.data_ptr<int64_t>();
  const int64_t num_gids = pages.size(0) * f.N;
  for (int64_t i = 0; i < G; ++i)
    TORCH_CHECK(g[i] >= 0 && g[i] < num_gids, "gids[", i, "] = ", g[i], " outside the cache's ",
                num_gids, " groups");
  const uint8_t* base = pages.data_ptr<uint8_t>();
  const MutableView ko(key_out), vo(value_out);
  const std::vector<float> columns = key_map_columns(f);
  at::parallel_for(0, G * H, 1, [&](int64_t begin, int64_t end) {
    Work wk(f, 1, 1, false);
    std::vector<float> key_buf(size_t(TP) * D);  // key_rows and value_rows use wk.s.x
    float* keys = key_buf.data();
    for (int64_t k = begin; k < end; ++k) {
      const int64_t gi = k / H, h = k % H, gid = g[gi];
      const uint8_t* st = base + (gid / f.N) * pages.stride(0) + h * pages.stride(1) +
                          f.sink_bytes + (gid % f.N) * f.state_bytes;
      if (key_rows(f, st, columns.data(), keys, wk.s)) {
        value_rows(f, st + f.k_bytes, wk.vrows, wk.s);
      } else {
        decode_tiles(f, st, wk);
        rows_to_columns([&](int c, int t) { return loadf(wk.kt + c * TP + t); }, int(D),
                        int(D), int(TP), keys, D);
      }
      for (int64_t t = std::max<int64_t>(skip - gi * T, 0); t < T; ++t) {
        const int64_t r = gi * T + t - skip;
        narrow(keys + t * D, D, ko.dtype, ko.at(r, h));
        narrow(wk.vrows + t * D, D, vo.dtype, vo.at(r, h));
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(lowbit_kv, m) {
  m.def(
      "packed_attention(Tensor query, Tensor q_start, Tensor pages, Tensor group_table, "
      "Tensor num_groups, Tensor skip_tokens, float scale, int[] geometry, int[] key_desc, "
      "int[] value_desc, Tensor fft_map, Tensor codebooks, Tensor key_columns, Tensor rotation, "
      "Tensor(a!) out, Tensor(b!) lse) -> ()");
}

TORCH_LIBRARY_FRAGMENT(lowbit_kv, m) {
  m.def(
      "decode_groups(Tensor pages, Tensor gids, int skip, int[] geometry, int[] key_desc, "
      "int[] value_desc, Tensor fft_map, Tensor codebooks, Tensor key_columns, "
      "Tensor(a!) key_out, Tensor(b!) value_out) -> ()");
}

TORCH_LIBRARY_IMPL(lowbit_kv, CPU, m) {
  m.impl("packed_attention", &packed_attention);
  m.impl("decode_groups", &decode_groups);
}

}  // namespace lowbit_kv
