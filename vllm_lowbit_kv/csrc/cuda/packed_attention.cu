// Paged decode attention over packed low-bit KV pages (CUDA, sm_80 / sm_90).
//
// One thread block per (query row, KV head, split): the block handles every
// query head of its KV head (GQA, up to LOWBIT_MAX_GQA) and a contiguous range
// of the request's groups (split-K); with several splits a second kernel
// combines the splits' normalized outputs by their log-sum-exp.
//
// Design. The first version ran at ~1% of an H200's bandwidth (2.4 ms at 32K context x
// batch 32, SmolLM2 shape): it was instruction-bound (per-element runtime bit widths and
// integer divisions, a loop of divisions per trit, 16 guarded head slots per FMA, serial
// global reads of the FFT map, each group's load waiting for the previous compute). Now:
//  * one kernel per head count GP in 1, 2, 4, 8, 16 (other GQA factors round up, the
//    extra heads with zero queries), so per-head loops unroll without guards; per-code
//    and per-token rows are head-minor with RS = GP rounded up to a power of two, one
//    vector shared-memory read giving every head's coefficient or probability;
//  * codec kinds and bit widths dispatch once per group (a block-uniform branch) to
//    loops templated on the width; a thread (or 2-4 lanes) per token reads its code row
//    as 32-bit words with a funnel shift (any bit alignment);
//  * 1- and 2-bit key codes (VidKV, KIVI-2) go through nibble tables built per group
//    from the coefficients: table[nibble][value][head] = sum of code * coef over the
//    nibble's codes, so a score costs one table row per 4 bits (one vector load and GP
//    adds) instead of a convert and GP multiply-adds per code; wider codes, or tables
//    above 32 KiB, take codes one by one (converted with two integer-free ops);
//  * group states are double-buffered in shared memory, the next group's bytes copied
//    with cp.async (sm_80+) while the current group is computed;
//  * VidKV: the FFT inverse map is staged in shared memory once per block; per group the
//    query is scattered into the state's channel order and transformed once (coef =
//    query folded into the code scales, bias = the constant part); ternary values: a
//    byte table built once per block (byte -> its 5 trits as 2-bit fields) turns the
//    trit bytes into a 2-bit tile, 16 trits per 32-bit word from 4 table reads, and the
//    per-channel magnitude applies once per group; KIVI values with one scale per token
//    have it folded into p (sum p * zero added once per group);
//  * values: a thread takes K consecutive channels (K = 4 up to 2 heads, 2 at 4 and 8, 1
//    at 16)
//    of a token slice, so one probability row (every head, one vector load) and one
//    code read (a byte when the K codes fit one) serve K channels; every head's
//    accumulators stay in registers;
//  * up to 4 heads, launch bounds cap the registers at 64 (8 blocks of 128 per SM; GQA 3
//    runs as 4, which fits where 3 heads took 72-96 registers).
// Per group: A scatter query / trit tile | B coefficients (+ B2 tables) | C scores |
// D online softmax (a warp per head) | E values (thread = K channels x token slice, every
// head in registers). Only packed bytes are read; nothing is written but the outputs.

#include <cuda_fp16.h>
#include <math.h>

#include "packed_attention.cuh"

namespace {

constexpr float kLn2 = 0.6931471805599453f;
constexpr float kMagic = 8388608.f;  // 2^23: __uint_as_float(0x4B000000 | u) - 2^23 == u

__device__ __forceinline__ float load_f16(const uint8_t* p, int idx) {
  const unsigned short bits =
      static_cast<unsigned short>(p[2 * idx]) | (static_cast<unsigned short>(p[2 * idx + 1]) << 8);
  return __half2float(__ushort_as_half(bits));
}

// small unsigned integer (< 2^23) as float without a conversion instruction
__device__ __forceinline__ float u2f(uint32_t u) { return __uint_as_float(0x4B000000u | u) - kMagic; }

// a stored trit + 1 (0, 1, 2) as the float trit (-1, 0, 1)
__device__ __forceinline__ float trit_f(uint32_t u) { return __uint_as_float(0x4B000000u | u) - (kMagic + 1.f); }

// 32 bits of the state starting at bit `pos` (state 4-byte aligned, padded by 4 bytes)
__device__ __forceinline__ uint32_t bits32(const uint32_t* words, int pos) {
  const uint32_t lo = words[pos >> 5], hi = words[(pos >> 5) + 1];
  return __funnelshift_r(lo, hi, static_cast<uint32_t>(pos) & 31u);
}

// number of set bits below bit `i` of a little-end-first bit array
__device__ __forceinline__ int bits_before(const uint8_t* mask, int i) {
  int n = __popc(mask[i / 8] & ((1u << (i % 8)) - 1u));
  for (int b = 0; b < i / 8; ++b) n += __popc(mask[b]);
  return n;
}

__host__ __device__ constexpr int row_stride(int gp) { return gp <= 1 ? 1 : gp <= 2 ? 2 : gp <= 4 ? 4 : gp <= 8 ? 8 : 16; }

// the GP values of a head-minor row of RS floats (16-byte aligned when RS >= 4)
template <int GP>
__device__ __forceinline__ void load_row(const float* p, float (&x)[GP]) {
  constexpr int RS = row_stride(GP);
  if constexpr (RS == 1) {
    x[0] = p[0];
  } else if constexpr (RS == 2) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    x[0] = v.x;
    x[1] = v.y;
  } else {
#pragma unroll
    for (int k = 0; k < RS / 4; ++k) {
      const float4 v = reinterpret_cast<const float4*>(p)[k];
      const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (4 * k + i < GP) x[4 * k + i] = e[i];
    }
  }
}

template <int GP>
__device__ __forceinline__ void store_row(float* p, const float (&x)[GP]) {
#pragma unroll
  for (int g = 0; g < GP; ++g) p[g] = x[g];
}

template <int GP>
__device__ __forceinline__ float warp_sum_lanes(float v, int width) {
  for (int o = width / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// -- asynchronous global -> shared copies (cp.async on sm_80+, a plain copy elsewhere) --
__device__ __forceinline__ void copy4_async(uint32_t* dst, const uint32_t* src) {
#if defined(LOWBIT_HOST_EMULATION)
  *dst = *src;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src) : "memory");
#else
  *dst = __ldg(src);
#endif
}

__device__ __forceinline__ void copy_commit() {
#if !defined(LOWBIT_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// wait until at most one committed copy group is still in flight
__device__ __forceinline__ void copy_wait_one() {
#if !defined(LOWBIT_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void copy_wait_all() {
#if !defined(LOWBIT_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

__host__ __device__ inline int align16(int bytes) { return (bytes + 15) / 16 * 16; }

__host__ __device__ inline int threads_for(int D) { return D <= 128 ? 128 : 256; }

__host__ __device__ inline int imin(int x, int y) { return x < y ? x : y; }
__host__ __device__ inline int imax(int x, int y) { return x > y ? x : y; }

// heads computed per block (GQA factor rounded up to an instantiated count)
// (3 as 4: within 64 registers, where 3 heads took 72-96)
__host__ __device__ inline int heads_computed(int G) { return G <= 2 ? G : G <= 4 ? 4 : G <= 8 ? 8 : 16; }

// value channels per thread: K consecutive channels share each probability row load
__host__ __device__ constexpr int value_channels(int rs) { return rs <= 2 ? 4 : rs <= 8 ? 2 : 1; }

__host__ __device__ inline bool ternary_values(const LowbitPageFormat& f) { return f.val_kind == LOWBIT_VAL_TERNARY; }

__host__ __device__ inline bool fft_keys(const LowbitPageFormat& f) { return f.key_kind == LOWBIT_KEY_VIDKV && f.fft; }

// Nibble tables of the 2-bit and 1-bit key codes: for each 4-bit nibble of a token's code
// row (2 or 4 codes) and each of its 16 values, the sum of code * coefficient per head, so
// a score costs one table row per 4 bits instead of a multiply-add per code and head.
// Nibbles of the 2-bit field (VidKV codes2 or KIVI 2-bit codes), then of the 1-bit field.
#ifndef LOWBIT_TABLE_BYTES  // the tests also build with 0: no tables, codes one by one
#define LOWBIT_TABLE_BYTES (32 * 1024)
#endif
constexpr int kTableBytes = LOWBIT_TABLE_BYTES;  // else (wide heads, many heads) codes one by one

__host__ __device__ inline int nibbles_2bit(const LowbitPageFormat& f) {
  if (f.key_kind == LOWBIT_KEY_VIDKV) return (2 * f.n2 + 3) / 4;
  return f.key_bits == 2 ? (2 * f.D + 3) / 4 : 0;
}

__host__ __device__ inline int nibbles_1bit(const LowbitPageFormat& f) {
  return f.key_kind == LOWBIT_KEY_VIDKV ? (f.n1 + 3) / 4 : 0;
}

__host__ __device__ inline int table_rows(const LowbitPageFormat& f, int RS) {
  const int rows = 16 * (nibbles_2bit(f) + nibbles_1bit(f));
  const bool all_small = f.key_kind == LOWBIT_KEY_VIDKV || f.key_bits == 2;
  return all_small && rows * RS * 4 <= kTableBytes ? rows : 0;
}

// shared memory, in bytes from the (16-byte aligned) base
struct SmemPlan {
  int q, qperm, coef, wbias, stats, scores, red, fftw, rank, trits, lut, tab, state, state_stride, total;
};

__host__ __device__ inline SmemPlan smem_plan(const LowbitAttentionArgs& a, int threads) {
  const LowbitPageFormat& f = a.fmt;
  const int RS = row_stride(heads_computed(a.Hq / f.H)), D = f.D, T = f.T;
  const int P = threads * value_channels(RS) / D;  // token slices of the value step
  SmemPlan s;
  int at = 0;
  s.q = at; at += align16(D * RS * 4);
  s.qperm = at; at += align16(D * RS * 4);
  s.coef = at; at += align16(D * RS * 4);
  s.wbias = at; at += align16((threads / 32) * RS * 4);
  s.stats = at; at += align16(5 * RS * 4);  // m, l, corr, pz (rows of RS)
  s.scores = at; at += align16(T * RS * 4);
  s.fftw = at; at += fft_keys(f) ? align16(f.n1 * f.n1 * 4) : 0;
  s.rank = at; at += align16(2 * T * 4);  // rank, prot (STP values)
  // ternary: 2-bit trit tile [rows][D] (16 per word) and the byte -> 5 trits table
  s.trits = at; at += ternary_values(f) ? align16((T - f.n_protect) * D / 4) : 0;
  s.lut = at; at += ternary_values(f) ? 256 * 4 : 0;
  s.tab = at; at += align16(table_rows(f, RS) * RS * 4);
  s.state_stride = align16(f.state_bytes + 8);  // + padding for 32-bit bit-window reads
  s.state = at; at += 2 * s.state_stride;
  // after the group loop: the slices' partial outputs over the per-group scratch
  s.red = s.scores;
  s.total = imax(at, s.red + P * D * RS * 4);
  return s;
}

// sum over the codes of one token row: acc[g] += code[i] * coef[i][g], i < n, codes of
// BITS bits from bit `pos` of the state; lane `sub` of `L` takes every L-th 32-bit word
template <int BITS, int GP>
__device__ __forceinline__ void dot_codes(const uint32_t* words, int pos, int n, int sub, int L,
                                          const float* coef, float (&acc)[GP]) {
  constexpr int RS = row_stride(GP), CPW = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int nw = (n + CPW - 1) / CPW;
  for (int w = sub; w < nw; w += L) {
    const uint32_t word = bits32(words, pos + w * 32);
    const float* cf = coef + w * CPW * RS;
    if ((w + 1) * CPW <= n) {
#pragma unroll
      for (int e = 0; e < CPW; ++e) {
        const float x = u2f((word >> (e * BITS)) & MASK);
        float c[GP];
        load_row<GP>(cf + e * RS, c);
#pragma unroll
        for (int g = 0; g < GP; ++g) acc[g] = fmaf(x, c[g], acc[g]);
      }
    } else {
      for (int e = 0; e < n - w * CPW; ++e) {
        const float x = u2f((word >> (e * BITS)) & MASK);
        float c[GP];
        load_row<GP>(cf + e * RS, c);
#pragma unroll
        for (int g = 0; g < GP; ++g) acc[g] = fmaf(x, c[g], acc[g]);
      }
    }
  }
}

// the same sum from the nibble table `tab` ([nibble][16][RS]) of this field's codes
template <int BITS, int GP>
__device__ __forceinline__ void dot_table(const uint32_t* words, int pos, int n, int sub, int L,
                                          const float* tab, float (&acc)[GP]) {
  constexpr int RS = row_stride(GP);
  const int nbits = n * BITS, nw = (nbits + 31) / 32;
  for (int w = sub; w < nw; w += L) {
    const uint32_t word = bits32(words, pos + w * 32);
    const float* tb = tab + w * 8 * 16 * RS;
    if ((w + 1) * 32 <= nbits) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float c[GP];
        load_row<GP>(tb + (e * 16 + ((word >> (4 * e)) & 15u)) * RS, c);
#pragma unroll
        for (int g = 0; g < GP; ++g) acc[g] += c[g];
      }
    } else {
      for (int e = 0; e < (nbits - w * 32 + 3) / 4; ++e) {
        float c[GP];
        load_row<GP>(tb + (e * 16 + ((word >> (4 * e)) & 15u)) * RS, c);
#pragma unroll
        for (int g = 0; g < GP; ++g) acc[g] += c[g];
      }
    }
  }
}

// K value codes of BITS bits from element e (a multiple of K) of the code stream at byte
// `off` of the state: bits BITS * k of the result (K * BITS divides 32; up to 8 bits they
// lie in one byte)
template <int BITS, int K>
__device__ __forceinline__ uint32_t value_codes(const uint32_t* words, int off, int e) {
  static_assert(32 % (K * BITS) == 0, "K codes within one word");
  if constexpr (K * BITS <= 8) {
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(words);
    return static_cast<uint32_t>(bytes[off + ((e * BITS) >> 3)]) >> ((e * BITS) & 7);
  } else {
    return bits32(words, off * 8 + e * BITS);
  }
}

template <int BITS, int GP, int K>
__device__ __forceinline__ void kivi_values(const LowbitPageFormat& f, const uint8_t* st, const float* p,
                                            int c0, int slice, int P, float (&acc)[K][GP]) {
  constexpr int RS = row_stride(GP);
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int D = f.D, T = f.T;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(st);
  if (f.val_kind == LOWBIT_VAL_KIVI_CHANNEL) {
    float s[K], z[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      s[k] = load_f16(st + f.v_scale, c0 + k);
      z[k] = load_f16(st + f.v_zero, c0 + k);
    }
    for (int t = slice; t < T; t += P) {
      const uint32_t x = value_codes<BITS, K>(words, f.v_codes, t * D + c0);
      float pr[GP];
      load_row<GP>(p + t * RS, pr);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const float v = fmaf(u2f((x >> (k * BITS)) & MASK), s[k], z[k]);
#pragma unroll
        for (int g = 0; g < GP; ++g) acc[k][g] = fmaf(pr[g], v, acc[k][g]);
      }
    }
  } else {
    const int per_tok = D / f.val_group;
    for (int t = slice; t < T; t += P) {
      const uint32_t x = value_codes<BITS, K>(words, f.v_codes, t * D + c0);
      float pr[GP];
      load_row<GP>(p + t * RS, pr);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int sidx = t * per_tok + (c0 + k) / f.val_group;
        const float v = fmaf(u2f((x >> (k * BITS)) & MASK), load_f16(st + f.v_scale, sidx),
                             load_f16(st + f.v_zero, sidx));
#pragma unroll
        for (int g = 0; g < GP; ++g) acc[k][g] = fmaf(pr[g], v, acc[k][g]);
      }
    }
  }
}

// KIVI per-token values with the token's scale in p (token_scaled): acc += p' * code
template <int BITS, int GP, int K>
__device__ __forceinline__ void kivi_scaled_values(const LowbitPageFormat& f, const uint8_t* st,
                                                   const float* p, int c0, int slice, int P,
                                                   float (&acc)[K][GP]) {
  constexpr int RS = row_stride(GP);
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int D = f.D, T = f.T;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(st);
#pragma unroll 2
  for (int t = slice; t < T; t += P) {
    const uint32_t x = value_codes<BITS, K>(words, f.v_codes, t * D + c0);
    float pr[GP];
    load_row<GP>(p + t * RS, pr);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float v = u2f((x >> (k * BITS)) & MASK);
#pragma unroll
      for (int g = 0; g < GP; ++g) acc[k][g] = fmaf(pr[g], v, acc[k][g]);
    }
  }
}

// up to 4 heads: at most 64 registers per thread (8 blocks of 128 threads per SM; shared
// memory allows about as many at the benchmark shapes)
#ifdef LOWBIT_HOST_EMULATION
#define LOWBIT_LAUNCH_BOUNDS(threads, blocks)
#else
#define LOWBIT_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#endif

template <int GP>
__device__ __forceinline__ void packed_attention_body(const LowbitAttentionArgs& a) {
#ifdef LOWBIT_HOST_EMULATION  // host_emulation.cpp: the CPU test harness
  unsigned char* smem_raw = emu::shared_memory();
#else
  extern __shared__ __align__(16) unsigned char smem_raw[];
#endif
  constexpr int RS = row_stride(GP), K = value_channels(RS);
  const LowbitPageFormat& f = a.fmt;
  const int row = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int lane = tid & 31, warp = tid >> 5, nwarps = nthreads >> 5;
  const int G = a.Hq / f.H, D = f.D, T = f.T, P = nthreads * K / D;
  const SmemPlan sp = smem_plan(a, nthreads);
  float* s_q = reinterpret_cast<float*>(smem_raw + sp.q);          // [D][RS]
  float* s_qperm = reinterpret_cast<float*>(smem_raw + sp.qperm);  // [D][RS]
  float* s_coef = reinterpret_cast<float*>(smem_raw + sp.coef);    // [D][RS]
  float* s_wbias = reinterpret_cast<float*>(smem_raw + sp.wbias);  // [warps][RS]
  float* s_m = reinterpret_cast<float*>(smem_raw + sp.stats);      // [RS] each
  float* s_l = s_m + RS;
  float* s_corr = s_l + RS;
  float* s_pz = s_corr + RS;  // per head: sum of p * zero over the group (token_scaled)
  float* s_p = reinterpret_cast<float*>(smem_raw + sp.scores);  // [T][RS]
  float* s_red = reinterpret_cast<float*>(smem_raw + sp.red);   // [P][D][RS] (P slices)
  float* s_w = reinterpret_cast<float*>(smem_raw + sp.fftw);    // [n1][n1]
  int* s_rank = reinterpret_cast<int*>(smem_raw + sp.rank);     // [T]
  int* s_prot = s_rank + T;                                     // [T]
  uint32_t* s_trit = reinterpret_cast<uint32_t*>(smem_raw + sp.trits);  // [rows][D / 16]
  uint32_t* s_lut = reinterpret_cast<uint32_t*>(smem_raw + sp.lut);      // [256]
  float* s_tab = reinterpret_cast<float*>(smem_raw + sp.tab);   // [nibble][16][RS]
  const int tab_rows = table_rows(f, RS), nib2 = nibbles_2bit(f);

  // the request owning this row: the last r with q_start[r] <= row
  int lo = 0, hi = a.num_requests;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (a.q_start[mid] <= row) lo = mid; else hi = mid;
  }
  const int r = lo;
  const int skip = a.skip_tokens[r];
  const int g_lo = imax(split * a.groups_per_split, skip / T);
  const int g_hi = imin((split + 1) * a.groups_per_split, a.num_groups[r]);
  const uint8_t* head_pages = a.pages + h * a.page_stride_head + f.sink_bytes;
  const int n_words = f.state_bytes / 4;
  auto issue = [&](int gi, int buf) {
    const int64_t gid = a.group_table[r * a.table_stride + gi];
    const uint32_t* src = reinterpret_cast<const uint32_t*>(
        head_pages + (gid / f.N) * a.page_stride_block + (gid % f.N) * f.state_bytes);
    uint32_t* dst = reinterpret_cast<uint32_t*>(smem_raw + sp.state + buf * sp.state_stride);
    for (int w = tid; w < n_words; w += nthreads) copy4_async(dst + w, src + w);
  };
  if (g_lo < g_hi) issue(g_lo, 0);
  copy_commit();

  // scaled query [D][RS] (heads >= G: zero), running stats, FFT map
  for (int i = tid; i < D * RS; i += nthreads) {
    const int c = i / RS, g = i % RS;
    s_q[i] = g < G ? a.query[row * a.q_stride_row + (h * G + g) * a.q_stride_head + c] * a.scale_log2 : 0.f;
  }
  if (tid < RS) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.f;
  }
  if (fft_keys(f))
    for (int i = tid; i < f.n1 * f.n1; i += nthreads) s_w[i] = __ldg(a.fft_inverse_t + i);
  if (ternary_values(f)) {  // byte (5 trits, first in the lowest digit) -> 2-bit fields of trit + 1
    for (int b = tid; b < 256; b += nthreads) {
      uint32_t x = static_cast<uint32_t>(b), fields = 0;
      for (int d = 0; d < 5; ++d) {
        fields |= (x % 3u) << (2 * d);
        x /= 3u;
      }
      s_lut[b] = b < 243 ? fields : 0u;
    }
  }

  // value step: channels c0 .. c0 + K - 1 and a token slice
  const int c0 = (tid % (D / K)) * K, slice = tid / (D / K);
  float acc[K][GP];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int g = 0; g < GP; ++g) acc[k][g] = 0.f;
  // score step: L lanes per token (a power of two, at most 4)
  int L = 1;
  while (L < 4 && 2 * L * T <= nthreads) L *= 2;
  const int sub = tid % L, tok0 = tid / L, tok_step = nthreads / L;
  const bool vidkv = f.key_kind == LOWBIT_KEY_VIDKV;
  const bool stp = ternary_values(f) && f.n_protect > 0;
  // KIVI per-token values with one scale per token: p * scale in the probabilities,
  // sum p * zero added once per group (slice 0)
  const bool token_scaled = f.val_kind == LOWBIT_VAL_KIVI_TOKEN && f.val_group == D;

  for (int gi = g_lo; gi < g_hi; ++gi) {
    const int buf = (gi - g_lo) & 1;
    if (gi + 1 < g_hi) issue(gi + 1, buf ^ 1);
    copy_commit();
    copy_wait_one();
    __syncthreads();  // this group's state is in shared memory; stats / query visible
    const uint8_t* st = smem_raw + sp.state + buf * sp.state_stride;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(st);

    // A. VidKV: query into the state's channel order (2-bit channels, then 1-bit ones);
    //    ternary values: trit bytes -> 2-bit tile; STP: rows of the tokens
    if (vidkv) {
      for (int c = tid; c < D; c += nthreads) {
        const int two = (st[f.k_cmask + c / 8] >> (c % 8)) & 1;
        const int before = bits_before(st + f.k_cmask, c);
        const int dest = two ? before : f.n2 + (c - before);
        float q[GP];
        load_row<GP>(s_q + c * RS, q);
        store_row<GP>(s_qperm + dest * RS, q);
      }
    }
    if (ternary_values(f)) {
      // tile word w: trits 16w .. 16w + 15, from the 4 bytes from byte 16w / 5 (bytes
      // past the field are the next field's or the padding: decoded, never read)
      const int n_tile = (T - f.n_protect) * D / 16;
      for (int w = tid; w < n_tile; w += nthreads) {
        const int b0 = (16 * w) / 5, o = 16 * w - 5 * b0;
        const uint32_t bytes = bits32(words, (f.v_trits + b0) * 8);
        const uint32_t l0 = s_lut[bytes & 255u], l1 = s_lut[(bytes >> 8) & 255u];
        const uint32_t l2 = s_lut[(bytes >> 16) & 255u], l3 = s_lut[bytes >> 24];
        const uint32_t lo = l0 | (l1 << 10) | (l2 << 20) | (l3 << 30), hi = l3 >> 2;
        s_trit[w] = __funnelshift_r(lo, hi, static_cast<uint32_t>(2 * o));
      }
      if (stp) {
        for (int t = tid; t < T; t += nthreads) {
          const int p = (st[f.v_tokmask + t / 8] >> (t % 8)) & 1;
          const int before = bits_before(st + f.v_tokmask, t);
          s_prot[t] = p;
          s_rank[t] = p ? before : t - before;
        }
      }
    }
    if (vidkv) __syncthreads();

    // B. coefficients coef[i][g] of each key code and the bias (constant part) per head
    {
      float b[GP];
#pragma unroll
      for (int g = 0; g < GP; ++g) b[g] = 0.f;
      if (!vidkv) {
        for (int c = tid; c < D; c += nthreads) {
          float q[GP];
          load_row<GP>(s_q + c * RS, q);
          const float sc = load_f16(st + f.k_scale, c), z = load_f16(st + f.k_zero, c);
#pragma unroll
          for (int g = 0; g < GP; ++g) {
            s_coef[c * RS + g] = q[g] * sc;
            b[g] = fmaf(q[g], z, b[g]);
          }
        }
      } else {
        for (int i = tid; i < f.n2 + f.n1; i += nthreads) {
          float q[GP];
          if (i < f.n2) {
            load_row<GP>(s_qperm + i * RS, q);
            const float sc = load_f16(st + f.k_scale2, i), z = load_f16(st + f.k_zero2, i);
#pragma unroll
            for (int g = 0; g < GP; ++g) {
              s_coef[i * RS + g] = q[g] * sc;
              b[g] = fmaf(q[g], z, b[g]);
            }
          } else {
            const int j = i - f.n2;
            if (f.fft) {  // qt_j = sum_i W[j][i] q_n[i]: the query in the component domain
#pragma unroll
              for (int g = 0; g < GP; ++g) q[g] = 0.f;
              for (int k = 0; k < f.n1; ++k) {
                const float w = s_w[k * f.n1 + j];
                float x[GP];
                load_row<GP>(s_qperm + (f.n2 + k) * RS, x);
#pragma unroll
                for (int g = 0; g < GP; ++g) q[g] = fmaf(w, x[g], q[g]);
              }
            } else {
              load_row<GP>(s_qperm + i * RS, q);
            }
            const float hv = load_f16(st + f.k_hi, j);
            const float lv = f.sign ? -hv : load_f16(st + f.k_lo, j);
#pragma unroll
            for (int g = 0; g < GP; ++g) {
              s_coef[i * RS + g] = q[g] * (hv - lv);
              b[g] = fmaf(q[g], lv, b[g]);
            }
          }
        }
      }
#pragma unroll
      for (int g = 0; g < GP; ++g) b[g] = warp_sum(b[g]);
      if (lane == 0) store_row<GP>(s_wbias + warp * RS, b);
    }
    __syncthreads();
    if (tab_rows > 0) {  // B2. nibble tables from the coefficients
      const int n_2bit = vidkv ? f.n2 : D;
      for (int rw = tid; rw < tab_rows; rw += nthreads) {
        const int nib = rw >> 4;
        const uint32_t v = rw & 15;
        float x[GP];
#pragma unroll
        for (int g = 0; g < GP; ++g) x[g] = 0.f;
        // nibble nib: 2 two-bit codes (coefficient rows from 2 * nib) or, past the 2-bit
        // fields, 4 one-bit codes (rows from n2 + 4 * (nib - nib2))
        const bool two = nib < nib2;
        const int bits = two ? 2 : 1, per = 4 / bits;
        const int first = two ? 2 * nib : f.n2 + 4 * (nib - nib2);
        const int end = two ? n_2bit : f.n2 + f.n1;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int idx = first + k;
          if (k < per && idx < end) {
            const float code = u2f((v >> (bits * k)) & ((1u << bits) - 1u));
            float c[GP];
            load_row<GP>(s_coef + idx * RS, c);
#pragma unroll
            for (int g = 0; g < GP; ++g) x[g] = fmaf(code, c[g], x[g]);
          }
        }
        store_row<GP>(s_tab + rw * RS, x);
      }
      __syncthreads();
    }

    // C. scores (log2 units) of the group's tokens, masked below skip_tokens
    {
      float bias[GP];
#pragma unroll
      for (int g = 0; g < GP; ++g) bias[g] = 0.f;
      for (int w = 0; w < nwarps; ++w) {
        float x[GP];
        load_row<GP>(s_wbias + w * RS, x);
#pragma unroll
        for (int g = 0; g < GP; ++g) bias[g] += x[g];
      }
      const int key_base = f.key_kind == LOWBIT_KEY_VIDKV ? f.k_codes2 : f.k_codes;
      for (int t0 = 0; t0 < T; t0 += tok_step) {  // uniform trip count (shuffles)
        const int t = t0 + tok0;
        float s[GP];
#pragma unroll
        for (int g = 0; g < GP; ++g) s[g] = 0.f;
        if (t < T && tab_rows > 0) {
          if (vidkv) {
            dot_table<2, GP>(words, key_base * 8 + t * f.n2 * 2, f.n2, sub, L, s_tab, s);
            dot_table<1, GP>(words, f.k_codes1 * 8 + t * f.n1, f.n1, sub, L, s_tab + nib2 * 16 * RS, s);
          } else {
            dot_table<2, GP>(words, key_base * 8 + t * D * 2, D, sub, L, s_tab, s);
          }
        } else if (t < T) {
          if (vidkv) {
            dot_codes<2, GP>(words, key_base * 8 + t * f.n2 * 2, f.n2, sub, L, s_coef, s);
            dot_codes<1, GP>(words, f.k_codes1 * 8 + t * f.n1, f.n1, sub, L, s_coef + f.n2 * RS, s);
          } else if (f.key_bits == 2) {
            dot_codes<2, GP>(words, key_base * 8 + t * D * 2, D, sub, L, s_coef, s);
          } else if (f.key_bits == 4) {
            dot_codes<4, GP>(words, key_base * 8 + t * D * 4, D, sub, L, s_coef, s);
          } else {
            dot_codes<8, GP>(words, key_base * 8 + t * D * 8, D, sub, L, s_coef, s);
          }
        }
#pragma unroll
        for (int g = 0; g < GP; ++g) s[g] = warp_sum_lanes<GP>(s[g], L);
        if (t < T && sub == 0) {
          const bool keep = gi * T + t >= skip;
#pragma unroll
          for (int g = 0; g < GP; ++g) s_p[t * RS + g] = keep ? s[g] + bias[g] : -INFINITY;
        }
      }
    }
    __syncthreads();

    // D. online softmax per head (a warp per head): scores -> probabilities
    for (int g = warp; g < GP; g += nwarps) {
      float mx = -INFINITY;
      for (int t = lane; t < T; t += 32) mx = fmaxf(mx, s_p[t * RS + g]);
      mx = warp_max(mx);
      const float m_old = s_m[g], m_new = fmaxf(m_old, mx);
      const float m_safe = m_new == -INFINITY ? 0.f : m_new;
      float sum = 0.f, zsum = 0.f;
      for (int t = lane; t < T; t += 32) {
        const float p = exp2f(s_p[t * RS + g] - m_safe);
        sum += p;
        if (token_scaled) {  // KIVI values with one scale / zero per token: fold them in
          zsum = fmaf(p, load_f16(st + f.v_zero, t), zsum);
          s_p[t * RS + g] = p * load_f16(st + f.v_scale, t);
        } else {
          s_p[t * RS + g] = p;
        }
      }
      sum = warp_sum(sum);
      if (token_scaled) zsum = warp_sum(zsum);
      __syncwarp();
      if (lane == 0) {
        const float c = exp2f(m_old - m_safe);
        s_corr[g] = c;
        s_pz[g] = zsum;
        s_l[g] = s_l[g] * c + sum;
        s_m[g] = m_new;
      }
    }
    __syncthreads();

    // E. values: thread (channels c0 .. c0 + K - 1, token slice) accumulates every head;
    //    one probability row load serves K channels
    {
      float corr[GP];
      load_row<GP>(s_corr, corr);
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int g = 0; g < GP; ++g) acc[k][g] *= corr[g];
      if (ternary_values(f)) {
        float tacc[K][GP];  // sum of p * trit; the channels' magnitudes apply once per group
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int g = 0; g < GP; ++g) tacc[k][g] = 0.f;
        if (stp) {
          float ps[K], pz[K];
#pragma unroll
          for (int k = 0; k < K; ++k) {
            ps[k] = load_f16(st + f.v_pscale, c0 + k);
            pz[k] = load_f16(st + f.v_pzero, c0 + k);
          }
          for (int t = slice; t < T; t += P) {
            const int e = s_rank[t] * D + c0;  // the token's first element in its stream
            float pr[GP];
            load_row<GP>(s_p + t * RS, pr);
            if (s_prot[t]) {
              const uint32_t x = value_codes<2, K>(words, f.v_pcodes, e);
#pragma unroll
              for (int k = 0; k < K; ++k) {
                const float v = fminf(fmaxf(fmaf(u2f((x >> (2 * k)) & 3u), ps[k], pz[k]), -65504.f), 65504.f);
#pragma unroll
                for (int g = 0; g < GP; ++g) acc[k][g] = fmaf(pr[g], v, acc[k][g]);
              }
            } else {
              const uint32_t x = s_trit[e >> 4] >> ((2 * e) & 31);
#pragma unroll
              for (int k = 0; k < K; ++k) {
                const float v = trit_f((x >> (2 * k)) & 3u);
#pragma unroll
                for (int g = 0; g < GP; ++g) tacc[k][g] = fmaf(pr[g], v, tacc[k][g]);
              }
            }
          }
        } else {
#pragma unroll 2
          for (int t = slice; t < T; t += P) {
            const int e = t * D + c0;
            const uint32_t x = s_trit[e >> 4] >> ((2 * e) & 31);
            float pr[GP];
            load_row<GP>(s_p + t * RS, pr);
#pragma unroll
            for (int k = 0; k < K; ++k) {
              const float v = trit_f((x >> (2 * k)) & 3u);
#pragma unroll
              for (int g = 0; g < GP; ++g) tacc[k][g] = fmaf(pr[g], v, tacc[k][g]);
            }
          }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const float alpha = load_f16(st + f.v_alpha, c0 + k);
#pragma unroll
          for (int g = 0; g < GP; ++g) acc[k][g] = fmaf(alpha, tacc[k][g], acc[k][g]);
        }
      } else if (token_scaled) {
        if (slice == 0) {
          float pz[GP];
          load_row<GP>(s_pz, pz);
#pragma unroll
          for (int k = 0; k < K; ++k)
#pragma unroll
            for (int g = 0; g < GP; ++g) acc[k][g] += pz[g];
        }
        if (f.val_bits == 2) kivi_scaled_values<2, GP, K>(f, st, s_p, c0, slice, P, acc);
        else if (f.val_bits == 4) kivi_scaled_values<4, GP, K>(f, st, s_p, c0, slice, P, acc);
        else kivi_scaled_values<8, GP, K>(f, st, s_p, c0, slice, P, acc);
      } else if (f.val_bits == 2) {
        kivi_values<2, GP, K>(f, st, s_p, c0, slice, P, acc);
      } else if (f.val_bits == 4) {
        kivi_values<4, GP, K>(f, st, s_p, c0, slice, P, acc);
      } else {
        kivi_values<8, GP, K>(f, st, s_p, c0, slice, P, acc);
      }
    }
    __syncthreads();  // the next iteration's copy overwrites this group's buffer
  }
  copy_wait_all();  // (none in flight: the last iteration issued no copy)

#pragma unroll
  for (int k = 0; k < K; ++k) store_row<GP>(s_red + (slice * D + c0 + k) * RS, acc[k]);
  __syncthreads();
  const int64_t n_heads = static_cast<int64_t>(a.num_rows) * a.Hq;
  const bool split_out = a.num_splits > 1;
  for (int i = tid; i < G * D; i += nthreads) {
    const int g = i / D, c = i % D;
    float sum = 0.f;
    for (int p = 0; p < P; ++p) sum += s_red[(p * D + c) * RS + g];
    const float l = s_l[g];
    const int64_t head = static_cast<int64_t>(row) * a.Hq + h * G + g;
    float* out = split_out ? a.part_out + (split * n_heads + head) * D : a.out + head * D;
    out[c] = l > 0.f ? sum / l : 0.f;
  }
  if (tid < G) {
    const float l = s_l[tid];
    const float lse = l > 0.f ? (s_m[tid] + log2f(l)) * kLn2 : -INFINITY;
    const int64_t head = static_cast<int64_t>(row) * a.Hq + h * G + tid;
    if (split_out) a.part_lse[split * n_heads + head] = lse;
    else a.lse[head] = lse;
  }
}

template <int GP>  // 1, 2 or 4 heads
__global__ void LOWBIT_LAUNCH_BOUNDS(256, 4) packed_attention_kernel(const LowbitAttentionArgs a) {
  packed_attention_body<GP>(a);
}

template <int GP>  // 8 or 16 heads: no register cap
__global__ void packed_attention_kernel_wide(const LowbitAttentionArgs a) {
  packed_attention_body<GP>(a);
}

// out, lse of one (row, query head) from the splits' normalized parts
__global__ void combine_splits_kernel(const LowbitAttentionArgs a) {
  const int64_t head = blockIdx.x, n_heads = static_cast<int64_t>(a.num_rows) * a.Hq;
  const int c = threadIdx.x, D = a.fmt.D;
  float mx = -INFINITY;
  for (int sp = 0; sp < a.num_splits; ++sp) mx = fmaxf(mx, a.part_lse[sp * n_heads + head]);
  if (mx == -INFINITY) {
    a.out[head * D + c] = 0.f;
    if (c == 0) a.lse[head] = -INFINITY;
    return;
  }
  float total = 0.f, sum = 0.f;
  for (int sp = 0; sp < a.num_splits; ++sp) {
    const float w = expf(a.part_lse[sp * n_heads + head] - mx);
    total += w;
    sum += w * a.part_out[(sp * n_heads + head) * D + c];
  }
  a.out[head * D + c] = sum / total;
  if (c == 0) a.lse[head] = mx + logf(total);
}

}  // namespace

extern "C" const char* lowbit_packed_attention_check(const LowbitAttentionArgs* args) {
  const LowbitPageFormat& f = args->fmt;
  if (f.D < 16 || f.D > LOWBIT_MAX_HEAD_DIM || (f.D & (f.D - 1)))
    return "head_dim must be a power of two in [16, 256]";
  if (f.T < 1 || f.T > LOWBIT_MAX_BLOCK_TOKENS) return "block_tokens must be in [1, 256]";
  if (f.H < 1 || args->Hq % f.H != 0) return "query heads must be a multiple of the KV heads";
  if (args->Hq / f.H > LOWBIT_MAX_GQA) return "at most 16 query heads per KV head";
  if (f.state_bytes % 4 != 0) return "state_bytes must be a multiple of 4";
  if (f.key_kind != LOWBIT_KEY_KIVI_CHANNEL && f.key_kind != LOWBIT_KEY_VIDKV) return "unknown key kind";
  if (f.key_kind == LOWBIT_KEY_KIVI_CHANNEL && f.key_bits != 2 && f.key_bits != 4 && f.key_bits != 8)
    return "KIVI keys of 2, 4 or 8 bits";
  if (f.val_kind < LOWBIT_VAL_KIVI_TOKEN || f.val_kind > LOWBIT_VAL_TERNARY) return "unknown value kind";
  if (f.val_kind != LOWBIT_VAL_TERNARY && f.val_bits != 2 && f.val_bits != 4 && f.val_bits != 8)
    return "KIVI values of 2, 4 or 8 bits";
  if (f.key_kind == LOWBIT_KEY_VIDKV && f.fft && args->fft_inverse_t == nullptr)
    return "VidKV FFT keys need the inverse map";
  if (args->num_splits < 1 || args->groups_per_split < 1) return "num_splits and groups_per_split must be >= 1";
  if (args->num_splits > 1 && (args->part_out == nullptr || args->part_lse == nullptr))
    return "split outputs need part_out and part_lse";
  const int threads = threads_for(f.D);
  // 160 KiB: within the opt-in shared memory of sm_80 (163 KiB) and sm_90 (227 KiB)
  if (smem_plan(*args, threads).total > 160 * 1024) return "shared memory need above 160 KiB";
  return nullptr;
}

// grid, block size, dynamic shared memory and kernel of one call (the CUDA launcher and
// the test harness use the same)
struct LaunchPlan {
  dim3 grid;
  int threads;
  int smem;
  void (*kernel)(const LowbitAttentionArgs);
};

static LaunchPlan launch_plan(const LowbitAttentionArgs& a) {
  const int threads = threads_for(a.fmt.D);
  void (*kernel)(const LowbitAttentionArgs) = nullptr;
  switch (heads_computed(a.Hq / a.fmt.H)) {
    case 1: kernel = packed_attention_kernel<1>; break;
    case 2: kernel = packed_attention_kernel<2>; break;
    case 4: kernel = packed_attention_kernel<4>; break;
    case 8: kernel = packed_attention_kernel_wide<8>; break;
    default: kernel = packed_attention_kernel_wide<16>; break;
  }
  return {dim3(a.num_rows, a.fmt.H, a.num_splits), threads, smem_plan(a, threads).total, kernel};
}

#ifndef LOWBIT_HOST_EMULATION
extern "C" cudaError_t lowbit_packed_attention(const LowbitAttentionArgs* args, cudaStream_t stream) {
  if (lowbit_packed_attention_check(args) != nullptr) return cudaErrorInvalidValue;
  if (args->num_rows == 0) return cudaSuccess;
  const LaunchPlan plan = launch_plan(*args);
  if (plan.smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(plan.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.smem);
    if (e != cudaSuccess) return e;
  }
  plan.kernel<<<plan.grid, plan.threads, plan.smem, stream>>>(*args);
  if (args->num_splits > 1) {
    combine_splits_kernel<<<static_cast<unsigned>(args->num_rows * args->Hq), args->fmt.D, 0, stream>>>(*args);
  }
  return cudaGetLastError();
}
#endif
