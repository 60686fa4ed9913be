// Paged decode attention over packed low-bit KV pages (CUDA, sm_80 / sm_90).
//
// One thread block per (query row, KV head, split): the block handles every
// query head of its KV head (GQA, up to LOWBIT_MAX_GQA) and a contiguous range
// of the request's groups (split-K); with several splits a second kernel
// combines the splits' normalized outputs by their log-sum-exp.
//
// Per group: the group's state (K then V bytes, ~2 KB for vidkv at T = 64,
// D = 64) is copied to shared memory with 4-byte loads, then
//  1. key coefficients: the query is folded into the key codes' scale factors,
//     coef[g][i] = q[g][c(i)] * scale(i), and the constant part into bias[g]
//     (KIVI: per channel; VidKV: q is scattered into the state's channel
//     order from the channel mask, and for the FFT components transformed once
//     per group, qt = W q_n with W the fixed real inverse of the unique rfft
//     parts, instead of rebuilding T keys);
//  2. scores s[g][t] = bias[g] + sum_i code[t][i] * coef[g][i] (4 lanes per
//     token, shuffle-reduced), masked below skip_tokens;
//  3. online softmax per head (one warp per head);
//  4. values decoded element by element (KIVI per token / per channel,
//     ternary with or without STP-protected 2-bit tokens) and accumulated in
//     registers, thread (channel, token slice) x all heads.
// Only packed bytes are read; nothing is written but the outputs.

#include <cuda_fp16.h>
#include <math.h>

#include "packed_attention.cuh"

namespace {

constexpr int kScoreLanes = 4;  // lanes per token in the score step (divides 32)
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float load_f16(const uint8_t* p, int idx) {
  const unsigned short bits =
      static_cast<unsigned short>(p[2 * idx]) | (static_cast<unsigned short>(p[2 * idx + 1]) << 8);
  return __half2float(__ushort_as_half(bits));
}

// code number e of a little-end-first packed array of `bits`-bit codes
__device__ __forceinline__ int code_at(const uint8_t* p, int e, int bits) {
  const int per = 8 / bits;
  return (p[e / per] >> ((e % per) * bits)) & ((1 << bits) - 1);
}

// trit number e (-1, 0, 1) of a base-3 array, five per byte
__device__ __forceinline__ int trit_at(const uint8_t* p, int e) {
  int b = p[e / 5];
  for (int d = e % 5; d > 0; --d) b /= 3;
  return b % 3 - 1;
}

// number of set bits below bit `i` of a little-end-first bit array
__device__ __forceinline__ int bits_before(const uint8_t* mask, int i) {
  int n = __popc(mask[i / 8] & ((1u << (i % 8)) - 1u));
  for (int b = 0; b < i / 8; ++b) n += __popc(mask[b]);
  return n;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

struct Smem {
  float* q;       // [G][D] scaled query
  float* qperm;   // [G][D] query in the state's channel order (VidKV)
  float* coef;    // [G][D] coefficient of each key code
  float* scores;  // [G][T] scores, then probabilities
  float* bias;    // [G]
  float* m;       // [G] running max (log2 units)
  float* l;       // [G] running sum
  float* corr;    // [G] rescale of this group
  int* rank;      // [T] token's row among the protected / unprotected tokens (STP)
  int* prot;      // [T]
  float* red;     // [P][G][D] final reduction over token slices
  uint8_t* state; // one group state
};

__host__ __device__ inline int align16(int bytes) { return (bytes + 15) / 16 * 16; }

__host__ __device__ inline int threads_for(int D) { return D <= 128 ? 128 : 256; }

__host__ __device__ inline int imin(int x, int y) { return x < y ? x : y; }
__host__ __device__ inline int imax(int x, int y) { return x > y ? x : y; }

__host__ __device__ inline int smem_bytes(const LowbitAttentionArgs& a, int threads) {
  const int G = a.Hq / a.fmt.H, D = a.fmt.D, T = a.fmt.T, P = threads / D;
  const int floats = 3 * G * D + G * T + 4 * G + P * G * D;
  return align16(floats * 4 + 2 * T * 4) + align16(a.fmt.state_bytes);
}

__device__ Smem carve(unsigned char* base, const LowbitAttentionArgs& a, int threads) {
  const int G = a.Hq / a.fmt.H, D = a.fmt.D, T = a.fmt.T, P = threads / D;
  Smem s;
  float* f = reinterpret_cast<float*>(base);
  s.q = f; f += G * D;
  s.qperm = f; f += G * D;
  s.coef = f; f += G * D;
  s.scores = f; f += G * T;
  s.bias = f; f += G;
  s.m = f; f += G;
  s.l = f; f += G;
  s.corr = f; f += G;
  s.red = f; f += P * G * D;
  s.rank = reinterpret_cast<int*>(f);
  s.prot = s.rank + T;
  s.state = base + align16((3 * G * D + G * T + 4 * G + P * G * D) * 4 + 2 * T * 4);
  return s;
}

// 1. key coefficients and biases of one group (state in shared memory)
__device__ void key_coefficients(const LowbitAttentionArgs& a, const Smem& s, int G) {
  const LowbitPageFormat& f = a.fmt;
  const int D = f.D, tid = threadIdx.x, nthreads = blockDim.x;
  const int lane = tid & 31, warp = tid >> 5, nwarps = nthreads >> 5;
  const uint8_t* st = s.state;
  if (f.key_kind == LOWBIT_KEY_KIVI_CHANNEL) {
    for (int i = tid; i < G * D; i += nthreads) s.coef[i] = s.q[i] * load_f16(st + f.k_scale, i % D);
    for (int g = warp; g < G; g += nwarps) {
      float b = 0.f;
      for (int c = lane; c < D; c += 32) b += s.q[g * D + c] * load_f16(st + f.k_zero, c);
      b = warp_sum(b);
      if (lane == 0) s.bias[g] = b;
    }
    return;
  }
  // VidKV: 2-bit channels first, then 1-bit ones, each in channel order (front_perm)
  for (int c = tid; c < D; c += nthreads) {
    const int two = (st[f.k_cmask + c / 8] >> (c % 8)) & 1;
    const int before = bits_before(st + f.k_cmask, c);
    const int dest = two ? before : f.n2 + (c - before);
    for (int g = 0; g < G; ++g) s.qperm[g * D + dest] = s.q[g * D + c];
  }
  __syncthreads();
  for (int g = warp; g < G; g += nwarps) {
    const float* qp = s.qperm + g * D;
    float b = 0.f;
    for (int i = lane; i < f.n2; i += 32) {
      s.coef[g * D + i] = qp[i] * load_f16(st + f.k_scale2, i);
      b += qp[i] * load_f16(st + f.k_zero2, i);
    }
    for (int j = lane; j < f.n1; j += 32) {
      float qt;
      if (f.fft) {  // qt_j = sum_i W[j][i] q_n[i]: the query in the component domain
        qt = 0.f;
        for (int i = 0; i < f.n1; ++i) qt += __ldg(a.fft_inverse_t + i * f.n1 + j) * qp[f.n2 + i];
      } else {
        qt = qp[f.n2 + j];
      }
      const float hi = load_f16(st + f.k_hi, j);
      const float lo = f.sign ? -hi : load_f16(st + f.k_lo, j);
      s.coef[g * D + f.n2 + j] = qt * (hi - lo);
      b += qt * lo;
    }
    b = warp_sum(b);
    if (lane == 0) s.bias[g] = b;
  }
}

// 2. scores of the group's T tokens for every head, masked below `skip`
__device__ void key_scores(const LowbitAttentionArgs& a, const Smem& s, int G, int first_pos,
                           int skip) {
  const LowbitPageFormat& f = a.fmt;
  const int D = f.D, T = f.T, tid = threadIdx.x, nthreads = blockDim.x;
  const uint8_t* st = s.state;
  for (int base = 0; base < T * kScoreLanes; base += nthreads) {  // uniform trip count
    const int item = base + tid, t = item / kScoreLanes, sub = item % kScoreLanes;
    float acc[LOWBIT_MAX_GQA];
#pragma unroll
    for (int g = 0; g < LOWBIT_MAX_GQA; ++g) acc[g] = 0.f;
    if (t < T) {
      if (f.key_kind == LOWBIT_KEY_KIVI_CHANNEL) {
        for (int c = sub; c < D; c += kScoreLanes) {
          const float code = static_cast<float>(code_at(st + f.k_codes, t * D + c, f.key_bits));
#pragma unroll
          for (int g = 0; g < LOWBIT_MAX_GQA; ++g)
            if (g < G) acc[g] += code * s.coef[g * D + c];
        }
      } else {
        for (int i = sub; i < f.n2; i += kScoreLanes) {
          const float code = static_cast<float>(code_at(st + f.k_codes2, t * f.n2 + i, 2));
#pragma unroll
          for (int g = 0; g < LOWBIT_MAX_GQA; ++g)
            if (g < G) acc[g] += code * s.coef[g * D + i];
        }
        for (int j = sub; j < f.n1; j += kScoreLanes) {
          if (code_at(st + f.k_codes1, t * f.n1 + j, 1)) {
#pragma unroll
            for (int g = 0; g < LOWBIT_MAX_GQA; ++g)
              if (g < G) acc[g] += s.coef[g * D + f.n2 + j];
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < LOWBIT_MAX_GQA; ++g) {
      if (g < G) {
        for (int o = kScoreLanes / 2; o > 0; o >>= 1) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], o);
      }
    }
    if (t < T && sub == 0) {
      const bool keep = first_pos + t >= skip;
#pragma unroll
      for (int g = 0; g < LOWBIT_MAX_GQA; ++g)
        if (g < G) s.scores[g * T + t] = keep ? acc[g] + s.bias[g] : -INFINITY;
    }
  }
}

// 3. online softmax: scores -> probabilities, running max/sum, this group's rescale
__device__ void softmax_update(const Smem& s, int G, int T) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int g = warp; g < G; g += nwarps) {
    float* sc = s.scores + g * T;
    float mx = -INFINITY;
    for (int t = lane; t < T; t += 32) mx = fmaxf(mx, sc[t]);
    mx = warp_max(mx);
    const float m_old = s.m[g], m_new = fmaxf(m_old, mx);
    const float m_safe = m_new == -INFINITY ? 0.f : m_new;
    float sum = 0.f;
    for (int t = lane; t < T; t += 32) {
      const float p = exp2f(sc[t] - m_safe);
      sc[t] = p;
      sum += p;
    }
    sum = warp_sum(sum);
    __syncwarp();
    if (lane == 0) {
      const float c = exp2f(m_old - m_safe);
      s.corr[g] = c;
      s.l[g] = s.l[g] * c + sum;
      s.m[g] = m_new;
    }
  }
}

// 4. decoded value of token t, channel c
__device__ __forceinline__ float value_at(const LowbitPageFormat& f, const Smem& s, int t, int c) {
  const uint8_t* st = s.state;
  const int D = f.D;
  if (f.val_kind == LOWBIT_VAL_TERNARY) {
    if (f.n_protect > 0 && s.prot[t]) {
      const float v = code_at(st + f.v_pcodes, s.rank[t] * D + c, 2) * load_f16(st + f.v_pscale, c) +
                      load_f16(st + f.v_pzero, c);
      return fminf(fmaxf(v, -65504.f), 65504.f);
    }
    const int row = f.n_protect > 0 ? s.rank[t] : t;
    return trit_at(st + f.v_trits, row * D + c) * load_f16(st + f.v_alpha, c);
  }
  const int sidx = f.val_kind == LOWBIT_VAL_KIVI_TOKEN ? t * (D / f.val_group) + c / f.val_group : c;
  return code_at(st + f.v_codes, t * D + c, f.val_bits) * load_f16(st + f.v_scale, sidx) +
         load_f16(st + f.v_zero, sidx);
}

__global__ void packed_attention_kernel(const LowbitAttentionArgs a) {
#ifdef LOWBIT_HOST_EMULATION  // host_emulation.cpp: the CPU test harness
  unsigned char* smem_raw = emu::shared_memory();
#else
  extern __shared__ __align__(16) unsigned char smem_raw[];
#endif
  const LowbitPageFormat& f = a.fmt;
  const int row = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int G = a.Hq / f.H, D = f.D, T = f.T, P = nthreads / D;
  const Smem s = carve(smem_raw, a, nthreads);

  // the request owning this row: the last r with q_start[r] <= row
  int lo = 0, hi = a.num_requests;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (a.q_start[mid] <= row) lo = mid; else hi = mid;
  }
  const int r = lo;

  for (int i = tid; i < G * D; i += nthreads) {
    const int g = i / D, c = i % D;
    s.q[i] = a.query[row * a.q_stride_row + (h * G + g) * a.q_stride_head + c] * a.scale_log2;
  }
  if (tid < G) {
    s.m[tid] = -INFINITY;
    s.l[tid] = 0.f;
  }
  const int c_v = tid % D, slice = tid / D;  // value step: channel and token slice
  float acc[LOWBIT_MAX_GQA];
#pragma unroll
  for (int g = 0; g < LOWBIT_MAX_GQA; ++g) acc[g] = 0.f;

  const int skip = a.skip_tokens[r];
  const int g_lo = imax(split * a.groups_per_split, skip / T);
  const int g_hi = imin((split + 1) * a.groups_per_split, a.num_groups[r]);
  const uint8_t* head_pages = a.pages + h * a.page_stride_head + f.sink_bytes;
  __syncthreads();
  for (int gi = g_lo; gi < g_hi; ++gi) {
    const int64_t gid = a.group_table[r * a.table_stride + gi];
    const uint32_t* src = reinterpret_cast<const uint32_t*>(
        head_pages + (gid / f.N) * a.page_stride_block + (gid % f.N) * f.state_bytes);
    uint32_t* dst = reinterpret_cast<uint32_t*>(s.state);
    for (int w = tid; w < f.state_bytes / 4; w += nthreads) dst[w] = __ldg(src + w);
    __syncthreads();
    if (f.val_kind == LOWBIT_VAL_TERNARY && f.n_protect > 0) {
      for (int t = tid; t < T; t += nthreads) {
        const int p = (s.state[f.v_tokmask + t / 8] >> (t % 8)) & 1;
        const int before = bits_before(s.state + f.v_tokmask, t);
        s.prot[t] = p;
        s.rank[t] = p ? before : t - before;
      }
    }
    key_coefficients(a, s, G);
    __syncthreads();
    key_scores(a, s, G, gi * T, skip);
    __syncthreads();
    softmax_update(s, G, T);
    __syncthreads();
#pragma unroll
    for (int g = 0; g < LOWBIT_MAX_GQA; ++g)
      if (g < G) acc[g] *= s.corr[g];
    for (int t = slice; t < T; t += P) {
      const float v = value_at(f, s, t, c_v);
#pragma unroll
      for (int g = 0; g < LOWBIT_MAX_GQA; ++g)
        if (g < G) acc[g] += s.scores[g * T + t] * v;
    }
    __syncthreads();  // the next group's state overwrites shared memory
  }

#pragma unroll
  for (int g = 0; g < LOWBIT_MAX_GQA; ++g)
    if (g < G) s.red[(slice * G + g) * D + c_v] = acc[g];
  __syncthreads();
  const int64_t n_heads = static_cast<int64_t>(a.num_rows) * a.Hq;
  const bool split_out = a.num_splits > 1;
  for (int i = tid; i < G * D; i += nthreads) {
    const int g = i / D, c = i % D;
    float sum = 0.f;
    for (int p = 0; p < P; ++p) sum += s.red[(p * G + g) * D + c];
    const float l = s.l[g];
    const int64_t head = static_cast<int64_t>(row) * a.Hq + h * G + g;
    float* out = split_out ? a.part_out + (split * n_heads + head) * D : a.out + head * D;
    out[c] = l > 0.f ? sum / l : 0.f;
  }
  if (tid < G) {
    const float l = s.l[tid];
    const float lse = l > 0.f ? (s.m[tid] + log2f(l)) * kLn2 : -INFINITY;
    const int64_t head = static_cast<int64_t>(row) * a.Hq + h * G + tid;
    if (split_out) a.part_lse[split * n_heads + head] = lse;
    else a.lse[head] = lse;
  }
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
  if (f.val_kind < LOWBIT_VAL_KIVI_TOKEN || f.val_kind > LOWBIT_VAL_TERNARY) return "unknown value kind";
  if (f.key_kind == LOWBIT_KEY_VIDKV && f.fft && args->fft_inverse_t == nullptr)
    return "VidKV FFT keys need the inverse map";
  if (args->num_splits < 1 || args->groups_per_split < 1) return "num_splits and groups_per_split must be >= 1";
  if (args->num_splits > 1 && (args->part_out == nullptr || args->part_lse == nullptr))
    return "split outputs need part_out and part_lse";
  const int threads = threads_for(f.D);
  // 160 KiB: within the opt-in shared memory of sm_80 (163 KiB) and sm_90 (227 KiB)
  if (smem_bytes(*args, threads) > 160 * 1024) return "shared memory need above 160 KiB";
  return nullptr;
}

// grid, block size and dynamic shared memory of one call (the CUDA launcher and the test
// harness use the same)
struct LaunchPlan {
  dim3 grid;
  int threads;
  int smem;
};

static LaunchPlan launch_plan(const LowbitAttentionArgs& a) {
  const int threads = threads_for(a.fmt.D);
  return {dim3(a.num_rows, a.fmt.H, a.num_splits), threads, smem_bytes(a, threads)};
}

#ifndef LOWBIT_HOST_EMULATION
extern "C" cudaError_t lowbit_packed_attention(const LowbitAttentionArgs* args, cudaStream_t stream) {
  if (lowbit_packed_attention_check(args) != nullptr) return cudaErrorInvalidValue;
  if (args->num_rows == 0) return cudaSuccess;
  const LaunchPlan plan = launch_plan(*args);
  if (plan.smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(packed_attention_kernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, plan.smem);
    if (e != cudaSuccess) return e;
  }
  packed_attention_kernel<<<plan.grid, plan.threads, plan.smem, stream>>>(*args);
  if (args->num_splits > 1) {
    combine_splits_kernel<<<static_cast<unsigned>(args->num_rows * args->Hq), args->fmt.D, 0, stream>>>(*args);
  }
  return cudaGetLastError();
}
#endif
