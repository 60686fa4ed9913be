// Vectors of the build's own register width (GCC/Clang vector extensions, -march=native:
// 16 floats with AVX-512, else 8) and the softmax helpers both CPU kernels use.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lowbit_kv {
namespace {

// -- vectors ------------------------------------------------------------------------------
// lanes: a wider generic vector than the registers is kept in memory by GCC and moved
// through it piece by piece (the kernels ran 8-15x slower that way on AVX2)
#if defined(__AVX512F__)
constexpr int L = 16;
#else
constexpr int L = 8;
#endif
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));

inline vf loadf(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vu loadu(const uint32_t* p) { vu v; std::memcpy(&v, p, sizeof v); return v; }
// one broadcast (vf{} + x would be an add: 0 + -0 is +0, so the compiler must keep it)
inline vf splat(float x) { return __builtin_shuffle(vf{x}, vi{}); }
inline vi iota() { vi v; for (int l = 0; l < L; ++l) v[l] = l; return v; }
inline int round_up(int x) { return (x + L - 1) / L * L; }
// the first 64-byte boundary at or after x: whole cache lines for vectors and tile rows
inline float* aligned_floats(float* x) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(x) + 63) & ~uintptr_t(63));
}
// the first `lanes` (<= L) floats, the rest 0, and their store: masked moves, so that a
// caller's vectors stay in registers (a memcpy through a vector's address spills them)
inline vf loadf_first(const float* p, int lanes) {
#if defined(__AVX512F__)
  return vf(_mm512_maskz_loadu_ps(__mmask16((1u << lanes) - 1), p));
#elif defined(__AVX2__)
  return vf(_mm256_maskload_ps(p, __m256i(iota() < lanes)));
#else
  vf v = vf{};
  std::memcpy(&v, p, sizeof(float) * lanes);
  return v;
#endif
}
inline void storef_first(float* p, vf v, int lanes) {
#if defined(__AVX512F__)
  _mm512_mask_storeu_ps(p, __mmask16((1u << lanes) - 1), __m512(v));
#elif defined(__AVX2__)
  _mm256_maskstore_ps(p, __m256i(iota() < lanes), __m256(v));
#else
  std::memcpy(p, &v, sizeof(float) * lanes);
#endif
}

// horizontal max / sum by halving (log2(L) shuffles instead of a chain of L - 1 ops)
inline vf swap_halves(vf v, int half) {
  vi idx = iota() ^ half;
  return __builtin_shuffle(v, idx);
}
inline float hmax(vf v) {
  for (int half = L / 2; half; half /= 2) {
    const vf w = swap_halves(v, half);
    v = v > w ? v : w;
  }
  return v[0];
}
inline float hsum(vf v) {
  for (int half = L / 2; half; half /= 2) v += swap_halves(v, half);
  return v[0];
}

// out[u][0, n) = sum_{c < k} a[u][c] b[c ldb, + n) for NT rows u (n <= J L; b's rows read
// to their n-th float only): the NT J sums in registers, NT rows sharing each load of b and
// their sums independent chains of multiply-adds (one row alone waits on one chain per
// vector). Each sum in c order, as a scalar loop's.
template <int J, int NT>
inline void rows_times_block(const float* const* a, int k, const float* b, int64_t ldb, int n,
                             float* const* out) {
  const int last = n - (J - 1) * L;
  vf acc[NT][J] = {};
  for (int c = 0; c < k; ++c) {
    const float* row = b + c * ldb;
    vf col[J];
    for (int v = 0; v + 1 < J; ++v) col[v] = loadf(row + v * L);
    col[J - 1] = loadf_first(row + (J - 1) * L, last);
    for (int u = 0; u < NT; ++u) {
      const vf x = splat(a[u][c]);
      for (int v = 0; v < J; ++v) acc[u][v] += x * col[v];
    }
  }
  for (int u = 0; u < NT; ++u) {
    for (int v = 0; v + 1 < J; ++v) storef(out[u] + v * L, acc[u][v]);
    storef_first(out[u] + (J - 1) * L, acc[u][J - 1], last);
  }
}

template <int J>
void rows_times_rows(const float* a, int64_t lda, int rows, int k, const float* b, int64_t ldb,
                     int n, float* out, int64_t ldo) {
  constexpr int NT = L == 16 ? 4 : 2;  // AVX2's 16 registers: NT J sums and J of b
  int r = 0;
  for (; r + NT <= rows; r += NT) {
    const float* ar[NT];
    float* o[NT];
    for (int u = 0; u < NT; ++u) {
      ar[u] = a + (r + u) * lda;
      o[u] = out + (r + u) * ldo;
    }
    rows_times_block<J, NT>(ar, k, b, ldb, n, o);
  }
  for (; r < rows; ++r) {
    const float* ar = a + r * lda;
    float* o = out + r * ldo;
    rows_times_block<J, 1>(&ar, k, b, ldb, n, &o);
  }
}

// out[r * ldo, + n) = a[r * lda, + k) b for rows r < rows, b [k][n] with row stride ldb (a
// product of small matrices, rows_times_block); false, nothing written, where n > 4 L (0 < n)
inline bool rows_times(const float* a, int64_t lda, int rows, int k, const float* b,
                       int64_t ldb, int n, float* out, int64_t ldo) {
  switch ((n + L - 1) / L) {
    case 1: rows_times_rows<1>(a, lda, rows, k, b, ldb, n, out, ldo); return true;
    case 2: rows_times_rows<2>(a, lda, rows, k, b, ldb, n, out, ldo); return true;
    case 3: rows_times_rows<3>(a, lda, rows, k, b, ldb, n, out, ldo); return true;
    case 4: rows_times_rows<4>(a, lda, rows, k, b, ldb, n, out, ldo); return true;
    default: return false;
  }
}

// two accumulators and a shuffle reduction (the compiler's reduction went through memory)
inline float dot(const float* a, const float* b, int n) {
  vf s0 = vf{}, s1 = vf{};
  int i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    s0 += loadf(a + i) * loadf(b + i);
    s1 += loadf(a + i + L) * loadf(b + i + L);
  }
  if (i + L <= n) {
    s0 += loadf(a + i) * loadf(b + i);
    i += L;
  }
  if (i < n) s1 += loadf_first(a + i, n - i) * loadf_first(b + i, n - i);
  return hsum(s0 + s1);
}

// the lanes of a and b interleaved (a0, b0, a1, b1, ...): from their low halves, or high
inline vf zip_low(vf a, vf b) { return __builtin_shuffle(a, b, (iota() >> 1) + (iota() & 1) * L); }
inline vf zip_high(vf a, vf b) {
  return __builtin_shuffle(a, b, (iota() >> 1) + (iota() & 1) * L + L / 2);
}

// x[0, L), L vectors read as the rows of a matrix, transposed in registers: afterwards
// x[i][j] is the old x[j][i]. log2(L) butterfly stages of L two-source shuffles: in stage
// h, rows i and i + h (bit h of i clear) trade the lanes with bit h set for the other's
// lanes with it clear.
inline void transpose(vf* x) {
  const vi lane = iota();
  for (int h = 1; h < L; h *= 2) {
    const vi high = (lane & h) != 0;
    const vi lo = high ? lane - h + L : lane, hi = high ? lane + L : lane + h;
    for (int i = 0; i < L; ++i)
      if (!(i & h)) {
        const vf a = x[i], b = x[i + h];
        x[i] = __builtin_shuffle(a, b, lo);
        x[i + h] = __builtin_shuffle(a, b, hi);
      }
  }
}

// columns[c * ld + t] = element c of row t, for t in [0, np) (np a multiple of L; rows
// from n on read as 0) and c in [0, D) (a multiple of L), L x L blocks at a time through
// transpose; row(t, c) gives elements [c, c + L) of row t
template <typename Row>
inline void rows_to_columns(Row row, int n, int np, int D, float* columns, int64_t ld) {
  for (int t0 = 0; t0 < np; t0 += L)
    for (int c = 0; c < D; c += L) {
      vf block[L];
      for (int i = 0; i < L; ++i) block[i] = t0 + i < n ? row(t0 + i, c) : vf{};
      transpose(block);
      for (int i = 0; i < L; ++i) storef(columns + int64_t(c + i) * ld + t0, block[i]);
    }
}

// 2^y for softmax arguments in base 2 (y <= 0 or -inf; softmax_rows folds log2(e) into the
// scale, so the caller's scaling and subtraction are one multiply-add): y = k + f with k the
// nearest integer and |f| <= 1/2 (exact), 2^f by a polynomial, times 2^k. y < -126 gives 0,
// NaN stays NaN. The polynomial: e^(f ln 2)'s Taylor one of degree 6 (|f ln 2| <= 0.347:
// about 1 ulp, as a Cody-Waite exp), or, for probabilities about to be rounded to bf16
// (relative 2^-9), a degree-3 fit of 2^f (relative error under 1.1e-4, p(0) = 1 exactly, so
// a row's maximum stays exactly 1): three multiply-adds fewer.
constexpr float kLog2e = 1.44269504f;
constexpr float kExp2Taylor[7] = {1.f, 0.693147182f, 0.240226507f, 0.0555041087f,
                                  0.00961812911f, 0.00133335581f, 0.000154035304f};
constexpr float kExp2ForBf16[4] = {1.f, 0.693282962f, 0.242210984f, 0.0550089069f};
template <bool kForBf16>
inline vf exp2_poly(vf f) {
  constexpr const float* c = kForBf16 ? kExp2ForBf16 : kExp2Taylor;
  constexpr int degree = kForBf16 ? 3 : 6;
  vf p = splat(c[degree]);
  for (int i = degree - 1; i >= 0; --i) p = p * f + c[i];
  return p;
}
#if defined(__AVX512F__)
// the power of two by a rounding and a vscalefps: about half the instructions of the
// integer route below (the exponent built from a float-to-int conversion)
template <bool kForBf16 = false>
inline vf vexp2(vf y) {
  const __m512 ys = reinterpret_cast<__m512>(y);
  const __m512 v = _mm512_max_ps(_mm512_set1_ps(-127.f), ys);  // NaN: vmaxps returns ys
  const __m512 k = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 p =
      reinterpret_cast<__m512>(exp2_poly<kForBf16>(reinterpret_cast<vf>(_mm512_sub_ps(v, k))));
  const __mmask16 live = _mm512_cmp_ps_mask(ys, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);
  return reinterpret_cast<vf>(_mm512_maskz_scalef_ps(live, p, k));
}
#else
template <bool kForBf16 = false>
inline vf vexp2(vf y) {
  const vf v = y < -126.f ? splat(-126.f) : y;
  vf k = v + 0.5f;
  k = __builtin_convertvector(__builtin_convertvector(k, vi), vf);
  k = k > v + 0.5f ? k - 1.f : k;  // floor
  const vf p = exp2_poly<kForBf16>(v - k);
  const vi e = (__builtin_convertvector(k, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y < -126.f ? vf{} : p * scale;
}
#endif

// L bf16 values -> floats (a bf16 is the high half of a float32)
inline vf load_bf16(const uint16_t* p) {
  typedef uint16_t vh __attribute__((vector_size(2 * L)));
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One block of keys of an online softmax for M query vectors: row m at p + m * ldp holds its
// raw scores (n a multiple of L), of which positions [lo, hi[m]) count; scale > 0. Leaves in
// each row the probabilities exp(scale s - m) (0 outside its positions), m the row's new
// running maximum; updates mrun[m] and lsum[m] (the sum of those probabilities), multiplies
// acc[m * D, (m + 1) * D) (what the earlier blocks summed; D a multiple of L) by the
// correction exp(old m - m) and leaves it in corr[m] (1 where nothing changes: no position
// counts, or nothing was summed before). With `bf16` (a build with AVX-512 BF16) the
// probabilities go there instead, rounded to bf16 (nearest even), row m at bf16 + m * ldp:
// what the pair tiles' value products read, without a pass of their own (and their
// exponentials to the precision that rounding keeps, vexp2<true>).
// Each step runs over all rows before the next (the maxima, the corrections as vectors of
// rows, then the exponentials and sums): within a row the steps are a chain of dependent
// reductions, across rows they are independent, and the CPU overlaps them only when they
// come one after another (row by row, the dense kernel's softmax took half its time). The
// scale goes into the exponent (the maximum of the scaled scores is the scaled maximum), so
// the first pass writes only the vectors it masks.
inline void softmax_rows(float* p, int M, int64_t ldp, int n, int lo, const int* hi,
                         float scale, float* mrun, float* lsum, float* acc, int D,
                         float* corr, uint16_t* bf16 = nullptr) {
  constexpr float kNoKey = -std::numeric_limits<float>::infinity();
  const vi lane = iota();
  for (int m = 0; m < M; ++m) {  // maxima (positions that do not count set to -inf)
    float* row = p + m * ldp;
    vf mx = splat(kNoKey);
    for (int t = 0; t < n; t += L) {
      vf s = loadf(row + t);
      if (t < lo || t + L > hi[m]) {
        const vi pos = lane + t;
        s = (pos >= lo) & (pos < hi[m]) ? s : splat(kNoKey);
        storef(row + t, s);
      }
      mx = mx > s ? mx : s;
    }
    corr[m] = mrun[m];
    mrun[m] = std::max(mrun[m], hmax(mx) * scale);
  }
  for (int m = 0; m < M; m += L) {  // corrections exp(old m - new m), 1 where nothing was summed
    const int lanes = std::min(L, M - m);
    const vf old = loadf_first(corr + m, lanes), now = loadf_first(mrun + m, lanes);
    storef_first(corr + m, old == splat(kNoKey) ? splat(1.f) : vexp2((old - now) * kLog2e),
                 lanes);
  }
  for (int m = 0; m < M; ++m) {  // probabilities and their sums
    float* row = p + m * ldp;
    if (mrun[m] == kNoKey) {  // no position counted yet
      if (bf16)
        std::fill(bf16 + m * ldp, bf16 + m * ldp + n, uint16_t{0});
      else
        std::fill(row, row + n, 0.f);
      corr[m] = 1.f;
      continue;
    }
    const vf m_new = splat(mrun[m] * kLog2e);
    const float scale2 = scale * kLog2e;
    const auto probability = [&](int t) { return vexp2(loadf(row + t) * scale2 - m_new); };
    vf total{};
    int t = 0;
#if defined(__AVX512BF16__)
    if (bf16) {  // two vectors at a time: one conversion instruction for both
      const auto rounded_next = [&](int t) {  // to bf16 next: the short polynomial
        return vexp2<true>(loadf(row + t) * scale2 - m_new);
      };
      uint16_t* dst = bf16 + m * ldp;
      for (; t + 2 * L <= n; t += 2 * L) {
        const vf e0 = rounded_next(t), e1 = rounded_next(t + L);
        total += e0;
        total += e1;
        _mm512_storeu_si512(dst + t, (__m512i)_mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(e1),
                                                                   reinterpret_cast<__m512>(e0)));
      }
      for (; t < n; t += L) {
        const vf e = rounded_next(t);
        total += e;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t),
                            (__m256i)_mm512_cvtneps_pbh(reinterpret_cast<__m512>(e)));
      }
    }
#endif
    for (; t < n; t += L) {  // float32 probabilities in place (none left after bf16 ones)
      const vf e = probability(t);
      total += e;
      storef(row + t, e);
    }
    lsum[m] = lsum[m] * corr[m] + hsum(total);
  }
  for (int m = 0; m < M; ++m)
    if (corr[m] != 1.f)
      for (int c = 0; c < D; c += L) storef(acc + m * D + c, loadf(acc + m * D + c) * corr[m]);
}

}  // namespace
}  // namespace lowbit_kv
