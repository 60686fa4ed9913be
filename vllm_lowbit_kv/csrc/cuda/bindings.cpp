// Thin torch binding of packed_attention.cu (built by vllm_lowbit_kv/ops/cuda.py).
// Checks devices, dtypes and contiguity, fills the plain C argument struct and
// launches on the current CUDA stream.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "packed_attention.cuh"

namespace {

constexpr size_t kFormatFields = sizeof(LowbitPageFormat) / sizeof(int32_t);

void check_cuda(const torch::Tensor& t, const char* name, torch::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

// query [n, Hq, D] float32 (D contiguous), q_start int64 [R+1], pages uint8 [B, H, P],
// group_table int32 [R, G_max], num_groups/skip_tokens int32 [R], fft_inverse_t float32
// [n1, n1] (or empty), out float32 [n, Hq, D], lse float32 [n, Hq] (contiguous);
// part_out/part_lse: float32 [S, n, Hq, D] / [S, n, Hq] when num_splits S > 1, else empty.
void packed_attention(const torch::Tensor& query, const torch::Tensor& q_start,
                      const torch::Tensor& pages, const torch::Tensor& group_table,
                      const torch::Tensor& num_groups, const torch::Tensor& skip_tokens,
                      const torch::Tensor& fft_inverse_t, torch::Tensor& out, torch::Tensor& lse,
                      torch::Tensor& part_out, torch::Tensor& part_lse,
                      const std::vector<int64_t>& format, int64_t groups_per_split,
                      int64_t num_splits, double scale_log2) {
  check_cuda(query, "query", torch::kFloat32);
  check_cuda(q_start, "q_start", torch::kInt64);
  check_cuda(pages, "pages", torch::kUInt8);
  check_cuda(group_table, "group_table", torch::kInt32);
  check_cuda(num_groups, "num_groups", torch::kInt32);
  check_cuda(skip_tokens, "skip_tokens", torch::kInt32);
  check_cuda(out, "out", torch::kFloat32);
  check_cuda(lse, "lse", torch::kFloat32);
  TORCH_CHECK(format.size() == kFormatFields, "format must have ", kFormatFields, " fields, got ",
              format.size());
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [n, Hq, D], D contiguous");
  TORCH_CHECK(pages.dim() == 3 && pages.stride(2) == 1, "pages must be [blocks, H, P], P contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(pages.data_ptr()) % 4 == 0 && pages.stride(0) % 4 == 0 &&
                  pages.stride(1) % 4 == 0,
              "pages must be 4-byte aligned");
  TORCH_CHECK(group_table.dim() == 2 && group_table.stride(1) == 1, "group_table must be [R, G]");
  TORCH_CHECK(out.is_contiguous() && lse.is_contiguous(), "out and lse must be contiguous");

  LowbitAttentionArgs args{};
  int32_t fields[kFormatFields];
  for (size_t i = 0; i < kFormatFields; ++i) fields[i] = static_cast<int32_t>(format[i]);
  std::memcpy(&args.fmt, fields, sizeof(fields));
  args.query = query.data_ptr<float>();
  args.q_stride_row = query.stride(0);
  args.q_stride_head = query.stride(1);
  args.q_start = q_start.data_ptr<int64_t>();
  args.num_requests = static_cast<int32_t>(q_start.numel() - 1);
  args.num_rows = static_cast<int32_t>(query.size(0));
  args.Hq = static_cast<int32_t>(query.size(1));
  args.pages = pages.data_ptr<uint8_t>();
  args.page_stride_block = pages.stride(0);
  args.page_stride_head = pages.stride(1);
  args.group_table = group_table.data_ptr<int32_t>();
  args.table_stride = group_table.stride(0);
  args.num_groups = num_groups.data_ptr<int32_t>();
  args.skip_tokens = skip_tokens.data_ptr<int32_t>();
  args.fft_inverse_t = fft_inverse_t.numel() ? fft_inverse_t.data_ptr<float>() : nullptr;
  args.out = out.data_ptr<float>();
  args.lse = lse.data_ptr<float>();
  args.part_out = part_out.numel() ? part_out.data_ptr<float>() : nullptr;
  args.part_lse = part_lse.numel() ? part_lse.data_ptr<float>() : nullptr;
  args.num_splits = static_cast<int32_t>(num_splits);
  args.groups_per_split = static_cast<int32_t>(groups_per_split);
  args.scale_log2 = static_cast<float>(scale_log2);
  TORCH_CHECK(query.size(2) == args.fmt.D, "query head_dim must be ", args.fmt.D);
  const char* reason = lowbit_packed_attention_check(&args);
  TORCH_CHECK(reason == nullptr, "lowbit-kv CUDA kernel: ", reason ? reason : "");
  const cudaError_t err = lowbit_packed_attention(&args, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "lowbit-kv CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_attention", &packed_attention, "Paged decode attention over packed low-bit pages");
  m.attr("format_fields") = static_cast<int64_t>(kFormatFields);
}
