// Dense attention over bfloat16 or float32 K/V as register-blocked matrix products: the
// exact part of a prefill chunk (its context's sinks and staged tokens, then its own tokens
// causally), vllm_lowbit_kv/paged/attention.py.
//
// out[i, q] = sum_j softmax_j(scale * q_i . k_j) v_j over the keys j that row i sees
// (causal: j <= i + causal_offset; else all S), lse[i, q] the log-sum-exp of the scaled
// scores; query head q reads KV head q / G (G = Hq / H); out in float32, or in the model's
// dtype where nothing is merged with it (a prefill step's rows). float32 inputs: float32
// arithmetic throughout (float32 attention up to summation order). bf16 inputs on a CPU
// with AVX-512 BF16: bf16 pair tiles (micro_gemm.h: exact bf16 products, float32 sums and
// softmax, the probabilities rounded to bf16 for the value sum, as vLLM's AMX and GPU flash
// attention do); elsewhere widened to float32.
//
// A flash loop per work item (KV head, block of RB query rows: M = RB * G query vectors
// that share every key): keys in blocks of KB, laid out once per block as tiles (keys
// transposed, values as rows), then the two products of micro_gemm.h: scores [M, KB] =
// Q K^T, and out [M, D] += P V after the running-max rescale.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "dtypes.h"
#include "micro_gemm.h"
#include "vectors.h"

namespace lowbit_kv {
namespace {

constexpr int KB = 8 * L;   // keys per block
constexpr int RB = 64;      // query rows per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// L elements -> floats
inline vf load16(const float* p) { return loadf(p); }
inline vf load16(const uint16_t* p) { return load_bf16(p); }

template <typename T>
struct Args {
  const T *q, *k, *v;
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;  // strides (elements) of dims 0 and 1
  int64_t n, S, Hq, H, D, offset;
  bool causal;
  float scale;
  void* out;                 // [n, Hq, D] of out_type, strides os0, os1 (elements)
  at::ScalarType out_type;   // float32, or the model's bf16 / fp16 (nothing left to merge)
  int64_t os0, os1;
  float* lse;
};

#if defined(__AVX512BF16__)
// The keys and values of every block of KB keys of every KV head as pair tiles
// (micro_gemm.h), laid out once per call from the bf16 rows: every row block of a head
// reads the same tiles.
class PairBlocks {
 public:
  explicit PairBlocks(const Args<uint16_t>& a) {
    const int64_t S = a.causal ? std::clamp<int64_t>(a.n + a.offset, 0, a.S) : a.S;
    blocks_ = (S + KB - 1) / KB;
    block_words_ = KB * a.D / 2;
    words_.reset(new uint32_t[size_t(a.H * blocks_ * 2 * block_words_)]);
    at::parallel_for(0, a.H * blocks_, 1, [&](int64_t begin, int64_t end) {
      for (int64_t it = begin; it < end; ++it) {
        const int64_t h = it / blocks_, b = it % blocks_, j0 = b * KB;
        const int nt = int(std::min<int64_t>(KB, S - j0));
        key_pairs_bf16([&](int t) { return a.k + (j0 + t) * a.ks0 + h * a.ks1; }, nt,
                       round_up(nt), a.D, keys(h, b), KB);
        value_pairs_bf16([&](int t) { return a.v + (j0 + t) * a.vs0 + h * a.vs1; }, nt, a.D,
                         values(h, b));
      }
    });
  }
  uint32_t* keys(int64_t h, int64_t b) const {
    return words_.get() + (h * blocks_ + b) * 2 * block_words_;
  }
  uint32_t* values(int64_t h, int64_t b) const { return keys(h, b) + block_words_; }

 private:
  int64_t blocks_, block_words_;
  std::unique_ptr<uint32_t[]> words_;  // [H][blocks][keys, values]
};
#else
struct PairBlocks {};  // no pair tiles in this build: never constructed
#endif

// A thread's buffers, sized for a whole row block and reused by each item it takes (zeroing
// them per item cost as much as a tenth of a prefill chunk's kernel time)
template <typename T>
struct ItemWork {
  ItemWork(const Args<T>& a, bool pairs)
      : M(std::min<int64_t>(RB, a.n) * (a.Hq / a.H)),
        products(std::is_same_v<T, uint16_t>, M, a.D, KB),
        tiles({M * a.D, M * a.D, M * KB, pairs ? 0 : a.D * KB, pairs ? 0 : KB * a.D}),
        mrun(M), lsum(M), corr(M), limit(M), hi(M) {}
  int64_t M;  // query vectors at most
  TileProducts products;
  TilePool tiles;  // q, o, p (scores, then probabilities), and without pairs K^T and V
  std::vector<float> mrun, lsum, corr;
  std::vector<int64_t> limit;  // query vector m sees keys [0, limit[m])
  std::vector<int> hi;         // ... of the block: [0, hi[m])
};

// rows [i0, i1) of KV head h; keys and values from `pairs` where given (bf16 pair tiles),
// else laid out per block from the rows
template <typename T>
void run_item(const Args<T>& a, const PairBlocks* pairs, ItemWork<T>& w, int64_t h, int64_t i0,
              int64_t i1) {
  const int64_t G = a.Hq / a.H, D = a.D, M = (i1 - i0) * G;
  TileProducts& products = w.products;
  const float q_scale = products.bf16() ? 1.f : a.scale;
  const float score_scale = products.bf16() ? a.scale : 1.f;
  float *q = w.tiles[0], *o = w.tiles[1], *p = w.tiles[2], *kt = w.tiles[3], *vt = w.tiles[4];
  std::vector<float> &mrun = w.mrun, &lsum = w.lsum;
  std::vector<int64_t>& limit = w.limit;
  std::fill_n(mrun.begin(), M, kNegInf);
  std::fill_n(lsum.begin(), M, 0.f);
  std::fill_n(o, M * D, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = i0 + m / G, hq = h * G + m % G;
    const T* src = a.q + i * a.qs0 + hq * a.qs1;
    for (int64_t c = 0; c < D; c += L) storef(&q[m * D + c], load16(src + c) * q_scale);
    limit[m] = a.causal ? std::clamp<int64_t>(i + a.offset + 1, 0, a.S) : a.S;
  }
  products.queries(q, int(M));
  const int64_t jmax = *std::max_element(limit.begin(), limit.begin() + M);
  for (int64_t j0 = 0; j0 < jmax; j0 += KB) {
    const int nt = int(std::min<int64_t>(KB, jmax - j0)), ntp = round_up(nt);
#if defined(__AVX512BF16__)
    if (pairs) products.pair_scores(pairs->keys(h, j0 / KB), KB, ntp, p, KB);
#endif
    if (!pairs) {
      const T* keys = a.k + j0 * a.ks0 + h * a.ks1;  // transposed; past nt: 0
      rows_to_columns([&](int t, int c) { return load16(keys + t * a.ks0 + c); }, nt, ntp,
                      int(D), kt, KB);
      for (int t = 0; t < ntp; ++t) {  // values as rows; past nt: 0
        const T* vr = a.v + (j0 + t) * a.vs0 + h * a.vs1;
        for (int64_t c = 0; c < D; c += L)
          storef(&vt[t * D + c], t < nt ? load16(vr + c) : vf{});
      }
      products.scores(kt, KB, ntp, p, KB);
    }
    for (int64_t m = 0; m < M; ++m) w.hi[m] = int(std::clamp<int64_t>(limit[m] - j0, 0, nt));
    // online softmax: probabilities in place, or as bf16 where the pair tiles read them
    uint16_t* bf16 = nullptr;
#if defined(__AVX512BF16__)
    if (pairs) bf16 = products.probabilities();
#endif
    softmax_rows(p, int(M), KB, ntp, 0, w.hi.data(), score_scale, mrun.data(), lsum.data(), o,
                 int(D), w.corr.data(), bf16);
#if defined(__AVX512BF16__)
    if (pairs) products.pair_values_bf16(KB, pairs->values(h, j0 / KB), nt, o);
#endif
    if (!pairs) products.values(p, KB, vt, nt, o);
  }
  const int64_t out_bytes = at::elementSize(a.out_type);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = i0 + m / G, hq = h * G + m % G;
    const float inv = lsum[m] > 0.f ? 1.f / lsum[m] : 0.f;
    for (int64_t c = 0; c < D; ++c) o[m * D + c] *= inv;
    narrow(o + m * D, D, a.out_type,
           static_cast<char*>(a.out) + (i * a.os0 + hq * a.os1) * out_bytes);
    a.lse[i * a.Hq + hq] = lsum[m] > 0.f ? mrun[m] + std::log(lsum[m]) : kNegInf;
  }
}

// Work items (KV head, block of RB rows) taken by the threads one at a time, the last row
// blocks first: causal row blocks differ in work (the last sees the most keys), and
// at::parallel_for's static split handed one thread all the long ones (the other waited
// about a third of a prefill chunk's kernel time).
template <typename T>
void run(const Args<T>& a) {
  std::optional<PairBlocks> pairs;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>)
    if (TileProducts::pairs_for(true, a.D)) pairs.emplace(a);
#endif
  const int64_t row_blocks = (a.n + RB - 1) / RB, items = a.H * row_blocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    ItemWork<T> work(a, pairs.has_value());
    for (int64_t k = next++; k < items; k = next++) {
      const int64_t h = k % a.H, i0 = (row_blocks - 1 - k / a.H) * RB;
      run_item(a, pairs ? &*pairs : nullptr, work, h, i0, std::min(a.n, i0 + RB));
    }
  });
}

template <typename T>
Args<T> args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
             bool causal, int64_t causal_offset, double scale, const at::Tensor& out,
             const at::Tensor& lse) {
  return Args<T>{reinterpret_cast<const T*>(query.data_ptr()),
                 reinterpret_cast<const T*>(key.data_ptr()),
                 reinterpret_cast<const T*>(value.data_ptr()),
                 query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                 value.stride(0), value.stride(1), query.size(0), key.size(0), query.size(1),
                 key.size(1), query.size(2), causal_offset, causal, float(scale),
                 out.data_ptr(), out.scalar_type(), out.stride(0), out.stride(1),
                 lse.data_ptr<float>()};
}

}  // namespace

void dense_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     bool causal, int64_t causal_offset, double scale, const at::Tensor& out,
                     const at::Tensor& lse) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(),
              "query [n, Hq, D], key and value [S, H, D]");
  const auto dtype = query.scalar_type();
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && t->scalar_type() == dtype &&
                    t->stride(2) == 1,
                "query, key, value: all bfloat16 or all float32, unit stride in the last dim");
  const int64_t n = query.size(0), Hq = query.size(1), D = query.size(2), H = key.size(1);
  TORCH_CHECK(key.size(2) == D && D % L == 0 && D > 0,
              "head_dim: a multiple of ", L, ", equal in q, k, v");
  TORCH_CHECK(H > 0 && Hq % H == 0, "query heads: a multiple of the KV heads");
  const auto out_type = out.scalar_type();
  TORCH_CHECK((out_type == at::kFloat || out_type == at::kBFloat16 || out_type == at::kHalf) &&
                  out.stride(2) == 1 && out.sizes() == query.sizes(),
              "out: float32, bfloat16 or float16 [n, Hq, D], unit stride in the last dim");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 &&
                  lse.size(0) == n && lse.size(1) == Hq,
              "lse: float32 contiguous [n, Hq]");
  if (dtype == at::kFloat)
    run(args<float>(query, key, value, causal, causal_offset, scale, out, lse));
  else
    run(args<uint16_t>(query, key, value, causal, causal_offset, scale, out, lse));
}

TORCH_LIBRARY_FRAGMENT(lowbit_kv, m) {
  m.def(
      "dense_attention(Tensor query, Tensor key, Tensor value, bool causal, int causal_offset, "
      "float scale, Tensor(a!) out, Tensor(b!) lse) -> ()");
}

TORCH_LIBRARY_IMPL(lowbit_kv, CPU, m) { m.impl("dense_attention", &dense_attention); }

}  // namespace lowbit_kv
