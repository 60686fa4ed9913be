// Vectors of the build's own register width (GCC/Clang vector extensions, -march=native:
// 16 floats with AVX-512, else 8) and the softmax helpers both CPU kernels use.
#pragma once

#include <cstdint>
#include <cstring>

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

// exp(x) for softmax arguments (x <= 0 or -inf): Cody-Waite range reduction and a
// degree-6 Taylor polynomial, about 1 ulp; x < -87 gives 0.
inline vf vexp(vf x) {
  const vf v = x < -87.f ? splat(-87.f) : x;
  vf k = v * 1.44269504f + 0.5f;
  k = __builtin_convertvector(__builtin_convertvector(k, vi), vf);
  k = k > v * 1.44269504f + 0.5f ? k - 1.f : k;  // floor
  const vf r = v - k * 0.693145752f - k * 1.42860677e-06f;
  const vf p = 1.f + r * (1.f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f +
               r * (0.00833333377f + r * 0.00138888892f)))));
  const vi e = (__builtin_convertvector(k, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  return x < -87.f ? vf{} : p * scale;
}

}  // namespace
}  // namespace lowbit_kv
