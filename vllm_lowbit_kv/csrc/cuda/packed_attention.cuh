// Paged decode attention over packed low-bit KV pages: the plain C interface of
// packed_attention.cu (no torch headers, so nvcc compiles it alone; the torch
// binding is bindings.cpp, the Python loader vllm_lowbit_kv/ops/cuda.py).
//
// Contract: vllm_lowbit_kv/ops/__init__.py (packed_attention_reference). Page
// layout: vllm_lowbit_kv/paged.py. The format (codec kinds, field offsets) is
// computed in Python by vllm_lowbit_kv/ops/page_format.py and passed as the
// int32 fields of LowbitPageFormat, in declaration order (the loader's
// FORMAT_FIELDS; tests/test_cuda_kernel.py checks that both lists agree).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

// codec kinds (vllm_lowbit_kv/ops/page_format.py)
#define LOWBIT_KEY_KIVI_CHANNEL 0
#define LOWBIT_KEY_VIDKV 1
#define LOWBIT_VAL_KIVI_TOKEN 0
#define LOWBIT_VAL_KIVI_CHANNEL 1
#define LOWBIT_VAL_TERNARY 2

#define LOWBIT_MAX_GQA 16  // query heads per KV head
#define LOWBIT_MAX_HEAD_DIM 256
#define LOWBIT_MAX_BLOCK_TOKENS 256

#ifdef __cplusplus
extern "C" {
#endif

// Geometry and byte offsets (from a group state's first byte; V fields include
// the K bytes). Offsets of fields a codec does not have are -1.
typedef struct LowbitPageFormat {
  int32_t T;            // tokens per group
  int32_t D;            // head_dim
  int32_t H;            // KV heads
  int32_t N;            // groups per block
  int32_t sink_bytes;   // per head, before the group states
  int32_t state_bytes;  // per group and head (a multiple of 4)
  int32_t key_kind;
  int32_t key_bits;     // KIVI keys
  int32_t n2;           // VidKV keys: 2-bit channels
  int32_t n1;           // VidKV keys: 1-bit channels / components
  int32_t fft;          // VidKV keys: 1-bit part in the unique-rfft domain
  int32_t sign;         // VidKV keys: one_bit == "sign" (levels -s1, +s1)
  int32_t k_codes, k_scale, k_zero;
  int32_t k_cmask, k_scale2, k_zero2, k_lo, k_hi, k_codes2, k_codes1;
  int32_t val_kind;
  int32_t val_bits;     // KIVI values
  int32_t val_group;    // KIVI per-token values: channels per scale
  int32_t n_protect;    // ternary values: STP-protected tokens per group
  int32_t v_codes, v_scale, v_zero;
  int32_t v_pscale, v_pzero, v_alpha, v_tokmask, v_pcodes, v_trits;
} LowbitPageFormat;

typedef struct LowbitAttentionArgs {
  LowbitPageFormat fmt;
  const float* query;        // [num_rows, Hq, D], rows and heads strided, D contiguous
  int64_t q_stride_row, q_stride_head;
  const int64_t* q_start;    // [num_requests + 1]
  int32_t num_requests, num_rows, Hq;
  const uint8_t* pages;      // [num_blocks, H, P] (4-byte aligned)
  int64_t page_stride_block, page_stride_head;
  const int32_t* group_table;  // [num_requests, table_stride] global group ids
  int64_t table_stride;
  const int32_t* num_groups;   // [num_requests]
  const int32_t* skip_tokens;  // [num_requests]
  const float* fft_inverse_t;  // [n1, n1]: (W^T)[i][j], W row j = channels of unit component j
  float* out;                  // [num_rows, Hq, D]
  float* lse;                  // [num_rows, Hq]
  float* part_out;             // [num_splits, num_rows, Hq, D] when num_splits > 1
  float* part_lse;             // [num_splits, num_rows, Hq]
  int32_t num_splits, groups_per_split;
  float scale_log2;            // softmax scale * log2(e)
} LowbitAttentionArgs;

// NULL when the arguments can run, else the reason (a static string).
const char* lowbit_packed_attention_check(const LowbitAttentionArgs* args);

// Launch on `stream` (asynchronous). Returns the launch status.
cudaError_t lowbit_packed_attention(const LowbitAttentionArgs* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
