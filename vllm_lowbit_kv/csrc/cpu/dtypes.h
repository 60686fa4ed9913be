// Rows of the model's dtypes (float32, bfloat16, float16) and of int8 codes to float32 and
// back, and tensors addressed by byte strides, for the kernels that read or write tensors
// of any of them (exact_decode.cpp, staging.cpp, dense_attention.cpp's output).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lowbit_kv {
namespace {

// D elements of type t at p -> floats (times `scale`, for int8 codes)
inline void widen(at::ScalarType t, const void* p, int64_t D, float scale, float* dst) {
  switch (t) {
    case at::kFloat:
      std::memcpy(dst, p, sizeof(float) * D);
      return;
    case at::kBFloat16: {  // a bf16 is the high half of a float32
      const uint16_t* h = static_cast<const uint16_t*>(p);
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) {
        const uint32_t u = uint32_t(h[c]) << 16;
        std::memcpy(dst + c, &u, 4);
      }
      return;
    }
    case at::kHalf: {
      const c10::Half* h = static_cast<const c10::Half*>(p);
      for (int64_t c = 0; c < D; ++c) dst[c] = float(h[c]);
      return;
    }
    default: {  // int8 codes
      const int8_t* x = static_cast<const int8_t*>(p);
      int64_t c = 0;
#if defined(__AVX512F__)  // 16 at a time: the compiler's loop converted 8
      for (; c + 16 <= D; c += 16) {
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + c));
        _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)),
                                                _mm512_set1_ps(scale)));
      }
#endif
#pragma omp simd
      for (int64_t i = c; i < D; ++i) dst[i] = float(x[i]) * scale;
    }
  }
}

// D floats -> elements of float type t at p (rounded to nearest even, as torch's .to)
inline void narrow(const float* x, int64_t D, at::ScalarType t, void* p) {
  switch (t) {
    case at::kFloat:
      std::memcpy(p, x, sizeof(float) * D);
      return;
    case at::kBFloat16: {  // c10::BFloat16's rounding, written to vectorize
      uint16_t* h = static_cast<uint16_t*>(p);
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) {
        uint32_t u;
        std::memcpy(&u, x + c, 4);
        h[c] = x[c] != x[c] ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
      }
      return;
    }
    default: {
      c10::Half* h = static_cast<c10::Half*>(p);
      for (int64_t c = 0; c < D; ++c) h[c] = c10::Half(x[c]);
    }
  }
}

// A tensor's data pointer, strides in bytes (up to 4 dims) and dtype, read once: at::Tensor's
// accessors per row (a call and a dimension check each) cost more than the work on the row.
// An empty tensor has no base. Byte: const uint8_t to read, uint8_t to write.
template <typename Byte>
struct StridedView {
  Byte* base = nullptr;
  int64_t stride[4] = {};
  at::ScalarType dtype = at::kFloat;
  explicit StridedView(const at::Tensor& t) {
    if (!t.numel()) return;
    base = static_cast<Byte*>(t.data_ptr());
    for (int64_t i = 0; i < t.dim() && i < 4; ++i) stride[i] = t.stride(i) * t.element_size();
    dtype = t.scalar_type();
  }
  Byte* at(int64_t a, int64_t b, int64_t c = 0, int64_t d = 0) const {
    return base + a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3];
  }
  // row [D] at the given leading indices, widened (times `scale` for int8 codes)
  void row(int64_t a, int64_t b, int64_t c, int64_t d, int64_t D, float scale, float* dst) const {
    widen(dtype, at(a, b, c, d), D, scale, dst);
  }
};
using View = StridedView<const uint8_t>;
using MutableView = StridedView<uint8_t>;

}  // namespace
}  // namespace lowbit_kv
