// Encoding filled K/V groups into page states on the CPU: the codecs of
// vllm_lowbit_kv/codecs/ (kivi.py, quant.py, vidkv.py, rvq.py; their docstrings carry the paper's
// equations) in C++, for the serving path's writes (vllm_lowbit_kv/ops/cpu.py,
// encode_states). In PyTorch each group costs dozens of small tensor operations, which made
// encoding the largest part of our own prefill work; here one pass per (group, head).
//
// Codecs: KIVI per-channel keys and per-token / per-channel values (2, 4, 8 bits), VidKV keys
// (range-selected 2-bit channels, 1-bit channels or unique-rfft components with any
// one_bit mode) and ternary values, without STP (Python keeps the codecs for STP formats);
// RVQ keys and values (the greedy residual search, stage by stage over a group's rows).
// Same arithmetic as the codecs, in float32: min/max, fp16 metadata rounded before the
// codes are computed, round half to even. Bit-identical to them except where a sum's order
// matters (means over tokens and the rfft, which is the fixed forward map here): there a
// code may differ from the codecs' only within float32 rounding of its threshold, and an
// fp16 level by one step; an RVQ index only where two codes' distances tie within float32
// rounding (tests/test_cpu_encoder.py checks exactly that).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "amx.h"
#include "descriptors.h"
#include "dtypes.h"
#include "vectors.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace lowbit_kv {
namespace {

enum OneBit { ONE_BIT_MEAN = 0, ONE_BIT_SIGN = 1, ONE_BIT_MINMAX = 2 };  // vidkv.ONE_BIT_MODES
constexpr float kFp16Max = 65504.f;
// (q + M) - M rounds float32 |q| < 2**22 to the nearest integer, ties to even, as
// torch.round does (and vectorizes); codes here are within [-1, levels + 1]
constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2**23

inline float to_half(float x) { return static_cast<float>(c10::Half(x)); }

inline void put_halves(uint8_t* field, const float* x, int n) {
  for (int i = 0; i < n; ++i) {
    const uint16_t bits = c10::Half(x[i]).x;
    field[2 * i] = static_cast<uint8_t>(bits & 0xFF);
    field[2 * i + 1] = static_cast<uint8_t>(bits >> 8);
  }
}

// codes [n] of `bits` bits (up to 16) -> a little-end-first packed field
template <typename Code>
void pack_codes(const Code* codes, int64_t n, int bits, uint8_t* field) {
  uint64_t acc = 0;
  int filled = 0;
  for (int64_t i = 0; i < n; ++i) {
    acc |= static_cast<uint64_t>(codes[i]) << filled;
    for (filled += bits; filled >= 8; filled -= 8, acc >>= 8) *field++ = acc & 0xFF;
  }
  if (filled) *field = acc & 0xFF;
}

// per-column min and max of x [T, n] (row stride ld)
void column_range(const float* x, int T, int n, int ld, float* lo, float* hi) {
  std::copy(x, x + n, lo);
  std::copy(x, x + n, hi);
  for (int t = 1; t < T; ++t)
    for (int i = 0; i < n; ++i) {
      const float v = x[t * ld + i];
      lo[i] = v < lo[i] ? v : lo[i];
      hi[i] = v > hi[i] ? v : hi[i];
    }
}

// codes of one row x [n]: round((x - zero) / divisor) clamped to [0, levels]; a divisor of
// 1 marks a zero scale (codes 0). __restrict: uint8 stores may alias anything otherwise,
// which keeps the compiler from vectorizing
void quantize_row(const float* __restrict x, int n, const float* __restrict zero,
                  const float* __restrict divisor, float levels, uint8_t* __restrict codes) {
  for (int i = 0; i < n; ++i) {
    float q = ((x[i] - zero[i]) / divisor[i] + kRoundMagic) - kRoundMagic;
    q = q < 0.f ? 0.f : (q > levels ? levels : q);
    codes[i] = static_cast<uint8_t>(static_cast<int>(q));
  }
}

// Min-max quantization (quant.py: minmax_params, quantize) of x [rows, n] (row stride ld)
// with one quantizer per column (lo, hi given per column): fp16 zero = lo, fp16 scale =
// (hi - zero) / levels, codes round((x - zero) / scale) clamped, 0 where the scale is 0.
// Writes the codes [rows, n] row-major into `codes`, scale / zero [n] into the fields.
void minmax_columns(const float* x, int rows, int n, int ld, const float* lo, const float* hi,
                    int bits, uint8_t* codes, uint8_t* scale_field, uint8_t* zero_field,
                    std::vector<float>& work) {
  const float levels = static_cast<float>((1 << bits) - 1);
  work.resize(3 * static_cast<size_t>(n));
  float *zero = work.data(), *scale = zero + n, *divisor = scale + n;
  for (int i = 0; i < n; ++i) {
    zero[i] = to_half(lo[i]);
    scale[i] = to_half(std::max((hi[i] - zero[i]) / levels, 0.f));
    divisor[i] = scale[i] > 0.f ? scale[i] : 1.f;
  }
  put_halves(scale_field, scale, n);
  put_halves(zero_field, zero, n);
  for (int t = 0; t < rows; ++t) quantize_row(x + t * ld, n, zero, divisor, levels, codes + t * n);
  for (int i = 0; i < n; ++i)  // a zero scale (a constant column) codes everything as 0
    if (!(scale[i] > 0.f))
      for (int t = 0; t < rows; ++t) codes[t * n + i] = 0;
}

// Scratch of one thread: the group and its intermediate arrays.
struct Scratch {
  std::vector<float> x, y, lo, hi, work;
  std::vector<uint8_t> codes;
  std::vector<int8_t> trits;
  std::vector<int32_t> indices;
  std::vector<uint16_t> hits;
};

// KIVI per channel (kivi.py, axis "channel"): x [T, D]; descriptor [kind, bits, codes,
// scale, zero] (KK_* and KC_* agree)
void kivi_channels(const float* x, int T, int D, const int64_t* d, uint8_t* out, Scratch& s) {
  const int bits = static_cast<int>(d[KK_BITS]);
  s.lo.resize(D);
  s.hi.resize(D);
  s.codes.resize(static_cast<size_t>(T) * D);
  column_range(x, T, D, D, s.lo.data(), s.hi.data());
  minmax_columns(x, T, D, D, s.lo.data(), s.hi.data(), bits, s.codes.data(), out + d[KK_SCALE],
                 out + d[KK_ZERO], s.work);
  pack_codes(s.codes.data(), T * D, bits, out + d[KK_CODES]);
}

// KIVI per token (kivi.py, axis "token"): one quantizer per (token, `group` channels)
void kivi_tokens(const float* x, int T, int D, const int64_t* d, uint8_t* out, Scratch& s) {
  const int bits = static_cast<int>(d[KT_BITS]), group = static_cast<int>(d[KT_GROUP]);
  const int per_token = D / group;
  s.lo.resize(static_cast<size_t>(T) * per_token);
  s.hi.resize(s.lo.size());
  for (int r = 0; r < T * per_token; ++r) {
    const auto [mn, mx] = std::minmax_element(x + r * group, x + (r + 1) * group);
    s.lo[r] = *mn;
    s.hi[r] = *mx;
  }
  s.codes.resize(static_cast<size_t>(T) * D);
  std::vector<float>& w = s.work;
  const float levels = static_cast<float>((1 << bits) - 1);
  w.resize(2 * s.lo.size());
  float *zero = w.data(), *scale = zero + s.lo.size();
  for (size_t r = 0; r < s.lo.size(); ++r) {
    zero[r] = to_half(s.lo[r]);
    scale[r] = to_half(std::max((s.hi[r] - zero[r]) / levels, 0.f));
  }
  std::vector<float> zeros(group), divisors(group);
  for (size_t r = 0; r < s.lo.size(); ++r) {
    uint8_t* codes = s.codes.data() + r * group;
    if (!(scale[r] > 0.f)) {
      std::fill(codes, codes + group, 0);
      continue;
    }
    std::fill(zeros.begin(), zeros.end(), zero[r]);
    std::fill(divisors.begin(), divisors.end(), scale[r]);
    quantize_row(x + r * group, group, zeros.data(), divisors.data(), levels, codes);
  }
  put_halves(out + d[KT_SCALE], scale, static_cast<int>(s.lo.size()));
  put_halves(out + d[KT_ZERO], zero, static_cast<int>(s.lo.size()));
  pack_codes(s.codes.data(), T * D, bits, out + d[KT_CODES]);
}

// one row of the mean split: bit = y > mean; sums of each side and the count of ones
void split_row(const float* __restrict y, int n, const float* __restrict mean,
               float* __restrict s1, float* __restrict s0, float* __restrict count,
               uint8_t* __restrict bits) {
  for (int j = 0; j < n; ++j) {
    const bool one = y[j] > mean[j];
    s1[j] += one ? y[j] : 0.f;
    s0[j] += one ? 0.f : y[j];
    count[j] += one ? 1.f : 0.f;
    bits[j] = one;
  }
}

// 1-bit code of y [T, n] per column over the tokens (vidkv.one_bit_quantize): bits [T, n]
// packed into `codes_field`, levels lo / hi (or the single s1 for "sign", in hi_field)
void one_bit(const float* y, int T, int n, int mode, uint8_t* codes_field, uint8_t* lo_field,
             uint8_t* hi_field, Scratch& s) {
  s.codes.assign(static_cast<size_t>(T) * n, 0);
  s.work.assign(5 * static_cast<size_t>(n), 0.f);
  float *a = s.work.data(), *b = a + n, *s1 = b + n, *s0 = s1 + n, *count = s0 + n;
  if (mode == ONE_BIT_MINMAX) {  // levels min and max; bit = round((y - lo) / (hi - lo))
    column_range(y, T, n, n, a, b);
    for (int j = 0; j < n; ++j) {
      a[j] = to_half(a[j]);
      b[j] = to_half(b[j]);
      s1[j] = b[j] - a[j] > 0.f ? b[j] - a[j] : 1.f;
    }
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < n; ++j) {
        const float q = ((y[t * n + j] - a[j]) / s1[j] + kRoundMagic) - kRoundMagic;
        s.codes[t * n + j] = b[j] - a[j] > 0.f && q >= 1.f;
      }
    put_halves(lo_field, a, n);
    put_halves(hi_field, b, n);
  } else if (mode == ONE_BIT_SIGN) {  // levels -s, +s with s = mean |y|
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < n; ++j) {
        a[j] += std::fabs(y[t * n + j]);
        s.codes[t * n + j] = y[t * n + j] > 0.f;
      }
    for (int j = 0; j < n; ++j) a[j] /= static_cast<float>(T);
    put_halves(hi_field, a, n);
  } else {  // split at the mean; levels the means of each side (one Lloyd step)
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < n; ++j) a[j] += y[t * n + j];
    for (int j = 0; j < n; ++j) a[j] /= static_cast<float>(T);
    for (int t = 0; t < T; ++t) split_row(y + t * n, n, a, s1, s0, count, s.codes.data() + t * n);
    for (int j = 0; j < n; ++j) {
      const float n1 = count[j], n0 = static_cast<float>(T) - n1;
      float hi = s1[j] / std::max(n1, 1.f), lo = s0[j] / std::max(n0, 1.f);
      if (n1 == 0.f) hi = lo;
      if (n0 == 0.f) lo = hi;
      a[j] = lo;
      b[j] = hi;
    }
    put_halves(lo_field, a, n);
    put_halves(hi_field, b, n);
  }
  pack_codes(s.codes.data(), T * n, 1, codes_field);
}

// VidKV keys (vidkv.VidKVKeyCodec, no STP): the n2 widest-range channels 2-bit per
// channel, the others 1-bit, in the unique-rfft domain when `fft` (forward map F
// [n1, n1]: y = x F)
void vidkv_key(const float* x, int T, int D, const int64_t* d, int mode, const float* fft,
               uint8_t* out, Scratch& s) {
  const int n2 = static_cast<int>(d[VK_N2]), n1 = static_cast<int>(d[VK_N1]);
  s.lo.resize(D);
  s.hi.resize(D);
  column_range(x, T, D, D, s.lo.data(), s.hi.data());
  std::vector<float> range(D);
  for (int c = 0; c < D; ++c) range[c] = s.hi[c] - s.lo[c];
  // the n2 largest ranges, ties to the lower channel (a stable descending sort)
  std::vector<int> order(D);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return range[a] > range[b]; });
  std::vector<uint8_t> two(D, 0);
  for (int i = 0; i < n2; ++i) two[order[i]] = 1;
  pack_codes(two.data(), D, 1, out + d[VK_CHAN_MASK]);
  // the state's channel order: 2-bit channels, then 1-bit ones, each in index order
  std::vector<int> perm;
  perm.reserve(D);
  for (int pass = 1; pass >= 0; --pass)
    for (int c = 0; c < D; ++c)
      if (two[c] == pass) perm.push_back(c);
  s.y.resize(static_cast<size_t>(T) * D);
  float* xp = s.y.data();
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < D; ++i) xp[t * D + i] = x[t * D + perm[i]];
  std::vector<float> lo2(n2), hi2(n2);
  for (int i = 0; i < n2; ++i) {
    lo2[i] = s.lo[perm[i]];
    hi2[i] = s.hi[perm[i]];
  }
  s.codes.resize(static_cast<size_t>(T) * n2);
  minmax_columns(xp, T, n2, D, lo2.data(), hi2.data(), 2, s.codes.data(), out + d[VK_SCALE2],
                 out + d[VK_ZERO2], s.work);
  pack_codes(s.codes.data(), T * n2, 2, out + d[VK_CODES2]);
  if (n1 == 0) return;
  std::vector<float> y(static_cast<size_t>(T) * n1, 0.f);
  if (!fft) {
    for (int t = 0; t < T; ++t) std::copy(xp + t * D + n2, xp + (t + 1) * D, y.data() + t * n1);
  } else if (!rows_times(xp + n2, D, T, n1, fft, n1, n1, y.data(), n1)) {  // n1 > 4 L
    for (int t = 0; t < T; ++t) {
      const float* x1 = xp + t * D + n2;
      float* yt = y.data() + t * n1;
      for (int c = 0; c < n1; ++c)
        for (int j = 0; j < n1; ++j) yt[j] += x1[c] * fft[c * n1 + j];
    }
  }
  one_bit(y.data(), T, n1, mode, out + d[VK_CODES1], out + d[VK_LO1], out + d[VK_HI1], s);
}

// one row of trits: sign(v) where |v| > threshold, else 0; sums and counts of the kept |v|
void trit_row(const float* __restrict x, int D, const float* __restrict threshold,
              float* __restrict kept, float* __restrict count, int8_t* __restrict trits) {
  for (int c = 0; c < D; ++c) {
    const float a = std::fabs(x[c]);
    const bool keep = a > threshold[c];
    kept[c] += keep ? a : 0.f;
    count[c] += keep ? 1.f : 0.f;
    trits[c] = static_cast<int8_t>(keep ? (x[c] > 0.f ? 1 : -1) : 0);
  }
}

// ternary values (vidkv.TernaryValueCodec, no STP): per channel, trit = sign(v) where
// |v| > gamma * mean |v|, alpha = mean |v| of the kept elements; trits base 3, five a byte
void ternary_value(const float* x, int T, int D, const int64_t* d, float gamma, uint8_t* out,
                   Scratch& s) {
  s.work.assign(3 * static_cast<size_t>(D), 0.f);
  float *threshold = s.work.data(), *kept = threshold + D, *count = kept + D;
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < D; ++c) threshold[c] += std::fabs(x[t * D + c]);
  for (int c = 0; c < D; ++c) threshold[c] = gamma * (threshold[c] / static_cast<float>(T));
  const int n = T * D;
  s.trits.resize(static_cast<size_t>(n) + 5);
  for (int t = 0; t < T; ++t)
    trit_row(x + t * D, D, threshold, kept, count, s.trits.data() + t * D);
  for (int c = 0; c < D; ++c) kept[c] /= std::max(count[c], 1.f);
  put_halves(out + d[TV_ALPHA], kept, D);
  std::fill(s.trits.begin() + n, s.trits.end(), 0);  // padding: the zero trit
  uint8_t* packed = out + d[TV_TRITS];
  for (int b = 0; b * 5 < n; ++b) {
    const int8_t* q = s.trits.data() + 5 * b;
    packed[b] = static_cast<uint8_t>((q[0] + 1) + 3 * (q[1] + 1) + 9 * (q[2] + 1) +
                                     27 * (q[3] + 1) + 81 * (q[4] + 1));
  }
}

// -- RVQ (rvq.py, seed 001) -------------------------------------------------------------
constexpr int kLanes = 16;  // floats per AVX-512 vector (C and the bf16 pass's d: multiples)
// the float32 search's vectors (vectors.h: L lanes) per pass: 128 codes' distances with
// AVX-512; with AVX2's 16 registers, 2 rows x 4 distances, their best and code, a code
// and 2 broadcasts
constexpr int kSearchVectors = L == 16 ? 8 : 4;
constexpr int kSearchRows = 2;   // residual rows searched together (sharing code loads)
constexpr int kTileRows = 16;    // the same in the bf16 pass: a row per lane (an AMX tile's)
constexpr int kMaxPairGroup = 128;  // widest channel group of the bf16 pass
constexpr int kMaxCodes = 1 << 16;  // codes per codebook (indices of at most 16 bits)

// One role's codebooks as the search reads them, prepared once per page format in Python
// (vllm_lowbit_kv/ops/cpu.py, _search_tables): codes [K, C, d] (the layer's, as the
// kernel reads them), the same transposed to [K, d, C], ||c||^2 [K, C]; for the bf16
// pass's error bound (nearest_codes_bf16; c' = bf16(c)) ||c|| + ||c' - c|| [K, C],
// 2 ||c' - c|| [K, C] and each stage's largest of both [K, 2]; and, where d is a multiple
// of 16 up to kMaxPairGroup, the first pass's bf16 pairs [K, C, d / 2] ((c'_2j, c'_2j+1)
// of code c in a word; the AMX tiles' A).
struct RvqBooks {
  int K = 0, C = 0, d = 0;
  const float *codes = nullptr, *columns = nullptr, *norms = nullptr;
  const float *spread = nullptr, *twice_rounding = nullptr, *largest = nullptr;
  const uint32_t* code_pairs = nullptr;
  static bool has_pairs(int64_t d) { return d % kLanes == 0 && d <= kMaxPairGroup; }
  // stage k's part of the tables
  struct Stage {
    const uint32_t* code_pairs;
    const float *codes, *norms, *spread, *twice_rounding;
    float spread_max, twice_rounding_max;
  };
  Stage stage(int k) const {
    const size_t kc = static_cast<size_t>(k) * C, words = kc * d / 2;
    return {code_pairs ? code_pairs + words : nullptr,
            codes + kc * d, norms + kc, spread + kc, twice_rounding + kc, largest[2 * k],
            largest[2 * k + 1]};
  }
  // whether the bf16 pass runs as AMX tile multiplies (tile_distances)
  bool amx_search() const {
#if defined(LOWBIT_AMX)
    return code_pairs && d % 32 == 0 && C % 32 == 0 && amx_granted();
#else
    return false;
#endif
  }
  static int64_t search_floats(const std::vector<int64_t>& desc) {
    return desc[RV_K] * desc[RV_C] * (desc[RV_GROUP] + 3) + 2 * desc[RV_K];
  }
  static int64_t pair_words(const std::vector<int64_t>& desc) {
    return has_pairs(desc[RV_GROUP]) ? desc[RV_K] * desc[RV_C] * desc[RV_GROUP] / 2 : 0;
  }
  // points into the call's tensors and advances past this role's part
  void take(const std::vector<int64_t>& desc, const float*& books, const float*& search,
            const uint32_t*& pair_words_at) {
    K = static_cast<int>(desc[RV_K]);
    C = static_cast<int>(desc[RV_C]);
    d = static_cast<int>(desc[RV_GROUP]);
    const size_t kc = static_cast<size_t>(K) * C;
    codes = books;
    books += kc * d;
    columns = search;
    norms = columns + kc * d;
    spread = norms + kc;
    twice_rounding = spread + kc;
    largest = twice_rounding + kc;
    search = largest + 2 * K;
#if defined(__AVX512BF16__)
    if (has_pairs(d)) code_pairs = pair_words_at;
#endif
    pair_words_at += pair_words(desc);
  }
};

// distances ||c||^2 - 2 r.c of NV * L codes from c0 (cols: [d, C]) for the R residual
// rows r[R][d]; per row and lane, the smaller distance into best / code (a strict < keeps
// the earlier code, as argmin). R rows share each load of the codes.
template <int R, int NV>
inline void search_codes(const float* const* r, int d, const float* cols, const float* norms,
                         int C, int c0, vf* best, vi* code) {
  vf acc[R][NV];
  for (int v = 0; v < NV; ++v) {
    vf n;
    std::memcpy(&n, norms + c0 + v * L, sizeof(vf));
    for (int i = 0; i < R; ++i) acc[i][v] = n;
  }
  for (int j = 0; j < d; ++j) {
    const float* row = cols + static_cast<size_t>(j) * C + c0;
    float w[R];
    for (int i = 0; i < R; ++i) w[i] = -2.f * r[i][j];
    for (int v = 0; v < NV; ++v) {
      vf c;
      std::memcpy(&c, row + v * L, sizeof(vf));
      for (int i = 0; i < R; ++i) acc[i][v] += w[i] * c;
    }
  }
  const vi lane = iota();
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) {
      const vi closer = acc[i][v] < best[i];
      best[i] = closer ? acc[i][v] : best[i];
      code[i] = closer ? lane + (c0 + v * L) : code[i];
    }
}

// rvq.nearest for R residual rows: out[i] = the index of stage k's code nearest to r[i]
// (C a multiple of 16), the lowest index among equal distances
template <int R>
void nearest_codes(const float* const* r, const RvqBooks& b, int k, int32_t* out) {
  const float* cols = b.columns + static_cast<size_t>(k) * b.d * b.C;
  const float* norms = b.norms + static_cast<size_t>(k) * b.C;
  vf best[R];
  vi code[R];
  for (int i = 0; i < R; ++i)
    for (int l = 0; l < L; ++l) {
      best[i][l] = std::numeric_limits<float>::infinity();
      code[i][l] = l;
    }
  int c0 = 0;
  for (; c0 + kSearchVectors * L <= b.C; c0 += kSearchVectors * L)
    search_codes<R, kSearchVectors>(r, b.d, cols, norms, b.C, c0, best, code);
  for (; c0 < b.C; c0 += L) search_codes<R, 1>(r, b.d, cols, norms, b.C, c0, best, code);
  for (int i = 0; i < R; ++i) {
    int32_t c = code[i][0];
    float dist = best[i][0];
    for (int l = 1; l < L; ++l)
      if (best[i][l] < dist || (best[i][l] == dist && code[i][l] < c)) {
        dist = best[i][l];
        c = code[i][l];
      }
    out[i] = c;
  }
}

#if defined(__AVX512BF16__)
// a candidate's float32 distance ||c||^2 - 2 r.c (codes [C, d]), kept in best / found when
// smaller: given in ascending order, the lowest index among equal distances wins (argmin)
inline void keep_nearer(const float* r, const float* codes, const float* norms, int d, int c,
                        float& best, int32_t& found) {
  const float* code = codes + static_cast<size_t>(c) * d;
  __m512 dot = _mm512_setzero_ps();
  for (int j = 0; j < d; j += kLanes)
    dot = _mm512_fmadd_ps(_mm512_loadu_ps(r + j), _mm512_loadu_ps(code + j), dot);
  const float dist = norms[c] - 2.f * _mm512_reduce_add_ps(dot);
  const bool closer = dist < best;
  best = closer ? dist : best;
  found = closer ? c : found;
}

// The rows' side of the first pass below, kTileRows rows in lanes: wt[j][i] = word j of
// row i (bf16 pairs of -2 r_i, the tiles' B), ||r||, ||e_r|| and s one vector each
inline void residual_words(const float* const* r, int d, float spread_max, uint32_t* wt,
                           __m512& w_error, __m512& r_norm, __m512& sums) {
  // the norms carry float32 rounding of a few parts in 2^24 at most: 2^-12 covers it
  constexpr float kSlack = 1.f + 1.f / 4096;
  __m512 rr = _mm512_setzero_ps(), ee = _mm512_setzero_ps();
  for (int j0 = 0; j0 < d; j0 += L) {
    vf x[L];  // x[j]: channel j0 + j of the 16 rows
    for (int i = 0; i < kTileRows; ++i) std::memcpy(&x[i], r[i] + j0, sizeof(vf));
    transpose(x);
    for (int j = 0; j < L; j += 2) {
      __m512i halves[2];
      for (int h = 0; h < 2; ++h) {
        const __m512 xj = x[j + h], w2 = _mm512_mul_ps(xj, _mm512_set1_ps(-2.f));
        halves[h] = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w2)));
        const __m512 e = _mm512_sub_ps(  // exact: a float minus its rounding to 8 bits
            _mm512_castsi512_ps(_mm512_slli_epi32(halves[h], 16)), w2);
        rr = _mm512_fmadd_ps(xj, xj, rr);
        ee = _mm512_fmadd_ps(e, e, ee);
      }
      _mm512_store_si512(wt + (j0 + j) / 2 * kTileRows,
                         _mm512_or_si512(halves[0], _mm512_slli_epi32(halves[1], 16)));
    }
  }
  r_norm = _mm512_mul_ps(_mm512_sqrt_ps(rr), _mm512_set1_ps(kSlack));
  w_error = _mm512_mul_ps(_mm512_sqrt_ps(ee), _mm512_set1_ps(kSlack));
  const __m512 top = _mm512_set1_ps(spread_max);
  sums = _mm512_add_ps(
      _mm512_mul_ps(_mm512_fmadd_ps(_mm512_set1_ps(1.6e-5f), r_norm,
                                    _mm512_mul_ps(_mm512_set1_ps(1e-5f), top)), top),
      _mm512_set1_ps(1e-30f));
}

// dist[c][i] = w_i.c' for every code c of the stage (code_pairs: [C, d / 2] words, C a
// multiple of kLanes) and the kTileRows rows' words wt, in vdpbf16ps: each code's word
// broadcast against the rows' words, four codes at a time (one load of the rows' words
// serves them)
inline void pair_distances(const uint32_t* wt, int half, const uint32_t* code_pairs, int C,
                           float* dist) {
  constexpr int R = kTileRows, U = 4;
  const auto word = [&](int c, int j) {
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(
        static_cast<int>(code_pairs[static_cast<size_t>(c) * half + j])));
  };
  for (int c0 = 0; c0 < C; c0 += U) {
    __m512 acc[U];
    for (int u = 0; u < U; ++u) acc[u] = _mm512_setzero_ps();
    for (int j = 0; j < half; ++j) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_load_si512(wt + j * R));
      for (int u = 0; u < U; ++u) acc[u] = _mm512_dpbf16_ps(acc[u], w, word(c0 + u, j));
    }
    for (int u = 0; u < U; ++u) _mm512_storeu_ps(dist + (c0 + u) * R, acc[u]);
  }
}

#if defined(LOWBIT_AMX)
// pair_distances as AMX tile multiplies: A 16 codes' words, B the rows' words (d a multiple
// of 32 up to kMaxPairGroup, C of 32)
inline void tile_distances(const uint32_t* wt, int half, const uint32_t* code_pairs, int C,
                           float* dist) {
  constexpr int R = kTileRows;
  // tiles 4.. hold wt (one per 32 channels), 0-1 the sums, 2-3 the codes
  const int b_tiles = half / 16;
  switch (b_tiles) {  // tile numbers are immediates
    case 4: _tile_loadd(7, wt + 48 * R, 64); [[fallthrough]];
    case 3: _tile_loadd(6, wt + 32 * R, 64); [[fallthrough]];
    case 2: _tile_loadd(5, wt + 16 * R, 64); [[fallthrough]];
    default: _tile_loadd(4, wt, 64);
  }
  const auto multiply = [&](int t, int c0) {
    const uint32_t* a = code_pairs + static_cast<size_t>(c0) * half + 16 * t;
    _tile_loadd(2, a, half * 4);
    _tile_loadd(3, a + 16 * half, half * 4);
    switch (t) {
      case 0: _tile_dpbf16ps(0, 2, 4); _tile_dpbf16ps(1, 3, 4); break;
      case 1: _tile_dpbf16ps(0, 2, 5); _tile_dpbf16ps(1, 3, 5); break;
      case 2: _tile_dpbf16ps(0, 2, 6); _tile_dpbf16ps(1, 3, 6); break;
      default: _tile_dpbf16ps(0, 2, 7); _tile_dpbf16ps(1, 3, 7);
    }
  };
  for (int c0 = 0; c0 < C; c0 += 32) {
    _tile_zero(0);
    _tile_zero(1);
    for (int t = 0; t < b_tiles; ++t) multiply(t, c0);
    _tile_stored(0, dist + c0 * R, 64);
    _tile_stored(1, dist + (c0 + 16) * R, 64);
  }
}
#endif

// nearest_codes for kTileRows rows in two passes: every distance in bf16 products (twice
// float32's multiply-add rate or more), then in float32 only the codes the pass cannot
// tell from the nearest. With w = bf16(-2 r) = -2 r + e_r and c' = bf16(c) = c + e_c, the
// pass sums w.c' = -2 r.c + e_r.c' - 2 r.e_c exactly in its products (bf16 products are
// exact in float32), so by Cauchy-Schwarz it is off by at most
//     bound(c) = ||e_r|| (||c|| + ||e_c||) + ||r|| 2 ||e_c|| + s,
// s its float32 sums' rounding (d + 1 <= 129 roundings, the norm's included, of at most
// 2^-24 (||c||^2 + 2 ||r|| ||c'||): under 1.6e-5 ||r|| c'max + 1e-5 c'max^2; DAZ/FTZ
// moves a product by under 2^-126 |c_j|). The nearest code c* has approx(c*) - bound(c*)
// <= its distance <= every code's distance <= min approx + max bound, so the candidates
// are the codes with approx(c) - bound(c) <= min approx + max bound (the codes' own
// bounds, not the largest, make most rows single: about 1.2 per row on SmolLM2's K and V).
// The pass (AMX tile multiplies where `tiles`, else vdpbf16ps) gives the distances code-major,
// dist[c] one vector with a lane per row, so that every step after it runs on all 16 rows
// at once, with no horizontal reduction and no branch per row. A code can be a candidate
// only if dist <= limit + max bound, so one compare a code finds the few codes some row
// may take (hits), and only those get their own bound; a row with one candidate takes it
// without its float32 distance, the others compare their candidates' float32 distances.
// d a multiple of 16 up to kMaxPairGroup, C of kLanes (encode_states checks it); dist:
// scratch of 16 C floats (64-byte aligned); hits: of 2 C + 64 (each code's compare mask
// and 32 zeros, then the hit codes' rows' candidate masks and a last 32 masks' read).
void nearest_codes_bf16(const float* const* r, const RvqBooks& b, int k, bool tiles,
                        int32_t* out, float* dist, uint16_t* hits) {
  constexpr int R = kTileRows;
  const int d = b.d, C = b.C, half = d / 2;
  const RvqBooks::Stage st = b.stage(k);
  alignas(64) uint32_t wt[kMaxPairGroup / 2 * R];
  __m512 we, rn, s;
  residual_words(r, d, st.spread_max, wt, we, rn, s);
#if defined(LOWBIT_AMX)
  if (tiles)
    tile_distances(wt, half, st.code_pairs, C, dist);
  else
#endif
    pair_distances(wt, half, st.code_pairs, C, dist);
  // each code's distances, its norm added (stored back for the compares below), and their
  // minimum, four chains
  const auto distance = [&](int c) {
    const __m512 x =
        _mm512_add_ps(_mm512_loadu_ps(dist + c * R), _mm512_set1_ps(st.norms[c]));
    _mm512_storeu_ps(dist + c * R, x);
    return x;
  };
  __m512 lo[4] = {distance(0), distance(1), distance(2), distance(3)};
  for (int c = 4; c < C; c += 4)
    for (int j = 0; j < 4; ++j) lo[j] = _mm512_min_ps(lo[j], distance(c + j));
  const __m512 widest =
      _mm512_fmadd_ps(we, _mm512_set1_ps(st.spread_max),
                      _mm512_fmadd_ps(rn, _mm512_set1_ps(st.twice_rounding_max), s));
  const __m512 nearest = _mm512_min_ps(_mm512_min_ps(lo[0], lo[1]), _mm512_min_ps(lo[2], lo[3]));
  const __m512 limit = _mm512_add_ps(nearest, widest);
  // a candidate's dist is at most limit + its bound <= limit + widest; s more covers the
  // rounding of that sum (a few parts in 2^24 of it, far below s)
  const __m512 reach = _mm512_add_ps(_mm512_add_ps(limit, widest), s);
  for (int c = 0; c < C; ++c)
    hits[c] = _mm512_cmp_ps_mask(_mm512_loadu_ps(dist + c * R), reach, _CMP_LE_OQ);
  std::fill(hits + C, hits + C + 32, uint16_t{0});  // the last 32 masks' read
  // the hit codes' own bounds: per row the count of candidates and the last one
  __m512i count = _mm512_setzero_si512(), last = _mm512_setzero_si512();
  int listed = 0;
  // the hit codes (ascending) overwrite masks already read; their candidate rows after them
  uint16_t *list = hits, *candidate = hits + C + 32;
  for (int c0 = 0; c0 < C; c0 += 32) {
    for (uint32_t any = _mm512_test_epi16_mask(_mm512_loadu_si512(hits + c0),
                                               _mm512_set1_epi16(-1));
         any; any &= any - 1) {
      const int h = c0 + __builtin_ctz(any);
      const __m512 bound =
          _mm512_fmadd_ps(we, _mm512_set1_ps(st.spread[h]),
                          _mm512_fmadd_ps(rn, _mm512_set1_ps(st.twice_rounding[h]), s));
      const __mmask16 in = _mm512_cmp_ps_mask(
          _mm512_sub_ps(_mm512_loadu_ps(dist + h * R), bound), limit, _CMP_LE_OQ);
      count = _mm512_mask_add_epi32(count, in, count, _mm512_set1_epi32(1));
      last = _mm512_mask_mov_epi32(last, in, _mm512_set1_epi32(h));
      candidate[listed] = in;
      list[listed++] = static_cast<uint16_t>(h);
    }
  }
  // a row with one candidate takes it (the float32 nearest is among them); the others
  // compare their candidates' float32 distances, found by a bit test of 32 masks at a time
  _mm512_storeu_si512(out, last);
  for (uint32_t multi = _mm512_cmpneq_epi32_mask(count, _mm512_set1_epi32(1)); multi;
       multi &= multi - 1) {
    const int i = __builtin_ctz(multi);
    const __m512i row = _mm512_set1_epi16(static_cast<int16_t>(1 << i));
    float best = std::numeric_limits<float>::infinity();
    int32_t found = 0;
    for (int h0 = 0; h0 < listed; h0 += 32) {
      uint32_t bits = _mm512_test_epi16_mask(_mm512_loadu_si512(candidate + h0), row);
      if (listed - h0 < 32) bits &= (1u << (listed - h0)) - 1;  // past the list: stale masks
      for (; bits; bits &= bits - 1)
        keep_nearer(r[i], st.codes, st.norms, d, list[h0 + __builtin_ctz(bits)], best, found);
    }
    out[i] = found;
  }
}
#endif

// population std of x[0, n) in double: mean and variance as eight partial sums each (lanes
// the compiler can vectorize; double keeps the order's effect far below fp16's rounding)
double population_std(const float* x, int n) {
  constexpr int kParts = 8;
  double part[kParts] = {};
  int c = 0;
  for (; c + kParts <= n; c += kParts)
    for (int l = 0; l < kParts; ++l) part[l] += x[c + l];
  for (; c < n; ++c) part[c % kParts] += x[c];
  double mean = 0;
  for (double v : part) mean += v;
  mean /= n;
  double var[kParts] = {};
  for (c = 0; c + kParts <= n; c += kParts)
    for (int l = 0; l < kParts; ++l) var[l] += (x[c + l] - mean) * (x[c + l] - mean);
  for (; c < n; ++c) var[c % kParts] += (x[c] - mean) * (x[c] - mean);
  double sum = 0;
  for (double v : var) sum += v;
  return std::sqrt(sum / n);
}

// RVQ of x [T, D] (rvq.RVQCodec.encode_groups): per token the fp16 population std (1 where
// 0) divides the vector, whose channel groups (strided: channel j * n + g of group g) are
// coded by Algorithm 1, K greedy stages of nearest codes; indices [T, n, K] packed. Stage
// by stage over all T * n rows, so that one stage's codes stay in cache.
void rvq(const float* x, int T, int D, const int64_t* desc, const RvqBooks& b, uint8_t* out,
         Scratch& s) {
  const int d = b.d, n = D / d, K = b.K, rows = T * n;
  const bool strided = desc[RV_STRIDED] != 0;
  s.y.resize(static_cast<size_t>(rows) * d);  // residuals, row t * n + g
  s.lo.resize(T);                              // fp16 stds
  s.indices.resize(static_cast<size_t>(rows) * K);
  s.work.resize(static_cast<size_t>(kTileRows) * b.C + kLanes);  // the bf16 pass's distances
  float* distances = aligned_floats(s.work.data());
  s.hits.resize(2 * static_cast<size_t>(b.C) + 64);  // + a last 32 masks' read, twice
  for (int t = 0; t < T; ++t) {
    const float* row = x + static_cast<size_t>(t) * D;
    s.lo[t] = to_half(static_cast<float>(population_std(row, D)));
    const float scale = s.lo[t] > 0.f ? s.lo[t] : 1.f;
    float* z = s.y.data() + static_cast<size_t>(t) * n * d;
    for (int g = 0; g < n; ++g)
      for (int j = 0; j < d; ++j) z[g * d + j] = row[strided ? j * n + g : g * d + j] / scale;
  }
  int32_t* idx = s.indices.data();
  const bool pairs = b.code_pairs != nullptr, tiles = b.amx_search();
  const int step = pairs ? kTileRows : kSearchRows;
#if defined(LOWBIT_AMX)
  if (tiles) load_tile_config();  // the thread's, and nothing else in this loop loads its own
#endif
  for (int k = 0; k < K; ++k) {
    for (int i = 0; i < rows; i += step) {
      const int m = std::min(step, rows - i);
      const float* r[kTileRows];  // the last rows repeat the first of a short block, kept once
      for (int a = 0; a < step; ++a) r[a] = s.y.data() + static_cast<size_t>(i + a % m) * d;
      int32_t found[kTileRows];
#if defined(__AVX512BF16__)
      if (pairs)
        nearest_codes_bf16(r, b, k, tiles, found, distances, s.hits.data());
      else
#endif
        nearest_codes<kSearchRows>(r, b, k, found);
      for (int a = 0; a < m; ++a) idx[static_cast<size_t>(i + a) * K + k] = found[a];
    }
    // the residuals after the whole stage's search: a row's update waits for its code, and
    // in the search loop that wait held back the next rows' search
    for (int i = 0; i < rows; ++i) {
      const size_t code = static_cast<size_t>(k) * b.C + idx[static_cast<size_t>(i) * K + k];
      const float* c = b.codes + code * d;
      float* res = s.y.data() + static_cast<size_t>(i) * d;
      for (int j = 0; j < d; ++j) res[j] -= c[j];
    }
  }
  pack_codes(idx, static_cast<int64_t>(rows) * K, static_cast<int>(desc[RV_BITS]),
             out + desc[RV_CODES]);
  put_halves(out + desc[RV_STD], s.lo.data(), T);
}

// copy group rows [T, D] of dtype `type` (row stride ld bytes) into x as floats; false when
// an element is NaN, Inf or above the fp16 range (base.require_fp16_range)
bool load_group(const uint8_t* src, at::ScalarType type, int T, int D, int64_t ld,
                std::vector<float>& x) {
  x.resize(static_cast<size_t>(T) * D);
  for (int t = 0; t < T; ++t) widen(type, src + t * ld, D, 1.f, x.data() + t * D);
  int bad = 0;  // an int reduction: the loop vectorizes (a bool's did not)
#pragma omp simd reduction(| : bad)
  for (size_t i = 0; i < x.size(); ++i) bad |= !(std::fabs(x[i]) <= kFp16Max);  // NaN: bad
  return bad == 0;
}

}  // namespace

// K, V [E, T, H, D] (float32, bfloat16 or float16, any strides with unit stride in the
// last dim: a step's fresh rows as they are) -> states [E, H, state_bytes] (zeroed first:
// padding stays 0).
// codebooks: the layer's RVQ codebooks, keys' then values' (empty without RVQ); search,
// search_pairs: their tables for the search (RvqBooks).
// Returns false, with the states unspecified, when an element is NaN, Inf or above 65504.
bool encode_states(const at::Tensor& key, const at::Tensor& value,
                   const std::vector<int64_t>& geometry, const std::vector<int64_t>& key_desc,
                   const std::vector<int64_t>& value_desc, int64_t one_bit_mode, double gamma,
                   const at::Tensor& fft_forward, const at::Tensor& codebooks,
                   const at::Tensor& search, const at::Tensor& search_pairs,
                   const at::Tensor& states) {
  TORCH_CHECK(geometry.size() == G_COUNT, "geometry: ", G_COUNT, " integers");
  const int64_t T = geometry[G_T], D = geometry[G_D], H = geometry[G_H];
  const int64_t state_bytes = geometry[G_STATE_BYTES], k_bytes = geometry[G_K_BYTES];
  for (const at::Tensor* x : {&key, &value})
    TORCH_CHECK((x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16 ||
                 x->scalar_type() == at::kHalf) &&
                    x->dim() == 4 && x->stride(3) == 1 && x->size(1) == T && x->size(2) == H &&
                    x->size(3) == D,
                "key, value: float32, bfloat16 or float16 [E, T, H, D] with the format's T, H, "
                "D, unit stride in the last dim");
  const int64_t E = key.size(0);
  TORCH_CHECK(value.size(0) == E, "key and value: the same groups");
  TORCH_CHECK(states.scalar_type() == at::kByte && states.is_contiguous() && states.dim() == 3 &&
                  states.size(0) == E && states.size(1) == H && states.size(2) == state_bytes,
              "states: uint8 contiguous [E, H, state_bytes]");
  const int64_t kkind = key_desc.at(0), vkind = value_desc.at(0);
  TORCH_CHECK(kkind == KEY_KIVI_CHANNEL || kkind == KEY_RVQ ||
                  (kkind == KEY_VIDKV && key_desc.at(VK_NP) == 0),
              "keys: KIVI per channel, RVQ or VidKV without STP");
  TORCH_CHECK(vkind == VAL_KIVI_TOKEN || vkind == VAL_KIVI_CHANNEL || vkind == VAL_RVQ ||
                  (vkind == VAL_TERNARY && value_desc.at(TV_NP) == 0),
              "values: KIVI, RVQ or ternary without STP");
  const bool fft = fft_forward.numel() > 0;
  if (kkind == KEY_VIDKV && fft)
    TORCH_CHECK(fft_forward.scalar_type() == at::kFloat && fft_forward.is_contiguous() &&
                    fft_forward.numel() == key_desc[VK_N1] * key_desc[VK_N1],
                "fft_forward: float32 [n1, n1]");
  // the RVQ roles' codebooks and search tables (keys' first)
  RvqBooks key_books, value_books;
  int64_t book_floats = 0, search_floats = 0, pair_words = 0;
  for (const auto* desc : {&key_desc, &value_desc})
    if (is_rvq(*desc, desc == &key_desc)) {
      TORCH_CHECK((*desc).at(RV_C) % kLanes == 0 && D % (*desc)[RV_GROUP] == 0,
                  "RVQ: codebook size a multiple of 16, group size a divisor of D");
      book_floats += (*desc)[RV_K] * (*desc)[RV_C] * (*desc)[RV_GROUP];
      search_floats += RvqBooks::search_floats(*desc);
      pair_words += RvqBooks::pair_words(*desc);
    }
  TORCH_CHECK(codebooks.scalar_type() == at::kFloat && codebooks.is_contiguous() &&
                  codebooks.numel() == book_floats && search.scalar_type() == at::kFloat &&
                  search.is_contiguous() && search.numel() == search_floats &&
                  search_pairs.scalar_type() == at::kInt && search_pairs.is_contiguous() &&
                  search_pairs.numel() == pair_words,
              "codebooks, search, search_pairs: the RVQ roles' tables (ops/cpu.py)");
  const float* books = codebooks.data_ptr<float>();
  const float* tables = search.data_ptr<float>();
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(search_pairs.data_ptr<int32_t>());
  if (kkind == KEY_RVQ) key_books.take(key_desc, books, tables, pairs);
  if (vkind == VAL_RVQ) value_books.take(value_desc, books, tables, pairs);
  const float* F = fft ? fft_forward.data_ptr<float>() : nullptr;
  // group e, head h: its token 0 at byte (e stride(0) + h stride(2)) elt, rows stride(1) elt
  const auto byte_at = [](const at::Tensor& x, int64_t e, int64_t h) {
    return static_cast<const uint8_t*>(x.data_ptr()) +
           (e * x.stride(0) + h * x.stride(2)) * int64_t(x.element_size());
  };
  uint8_t* S = states.data_ptr<uint8_t>();
  states.zero_();
  std::atomic<bool> in_range{true};
  at::parallel_for(0, E * H, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    std::vector<float> x;
    const int tokens = static_cast<int>(T), dim = static_cast<int>(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = i / H, h = i % H;
      uint8_t* out = S + i * state_bytes;
      bool ok = load_group(byte_at(key, e, h), key.scalar_type(), tokens, dim,
                           key.stride(1) * int64_t(key.element_size()), x);
      if (kkind == KEY_VIDKV)
        vidkv_key(x.data(), tokens, dim, key_desc.data(), static_cast<int>(one_bit_mode), F, out,
                  s);
      else if (kkind == KEY_RVQ)
        rvq(x.data(), tokens, dim, key_desc.data(), key_books, out, s);
      else
        kivi_channels(x.data(), tokens, dim, key_desc.data(), out, s);
      ok &= load_group(byte_at(value, e, h), value.scalar_type(), tokens, dim,
                       value.stride(1) * int64_t(value.element_size()), x);
      uint8_t* vout = out + k_bytes;
      if (vkind == VAL_KIVI_TOKEN)
        kivi_tokens(x.data(), tokens, dim, value_desc.data(), vout, s);
      else if (vkind == VAL_KIVI_CHANNEL)
        kivi_channels(x.data(), tokens, dim, value_desc.data(), vout, s);
      else if (vkind == VAL_RVQ)
        rvq(x.data(), tokens, dim, value_desc.data(), value_books, vout, s);
      else
        ternary_value(x.data(), tokens, dim, value_desc.data(), static_cast<float>(gamma), vout,
                      s);
      if (!ok) in_range = false;
    }
  });
  return in_range;
}

TORCH_LIBRARY_FRAGMENT(lowbit_kv, m) {
  m.def(
      "encode_states(Tensor key, Tensor value, int[] geometry, int[] key_desc, int[] value_desc, "
      "int one_bit_mode, float gamma, Tensor fft_forward, Tensor codebooks, Tensor search, "
      "Tensor search_pairs, Tensor(a!) states) -> bool");
}

TORCH_LIBRARY_IMPL(lowbit_kv, CPU, m) { m.impl("encode_states", &encode_states); }

}  // namespace lowbit_kv
