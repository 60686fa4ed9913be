// Test harness: runs the kernels of packed_attention.cu, unchanged, on the CPU with one
// std::thread per CUDA thread, so CI (no GPU) executes the kernel's own indexing and
// synchronization (tests/test_cuda_kernel.py builds it with g++ and calls it via ctypes).
// Emulated, and only as far as packed_attention.cu uses it: thread/block indices,
// dynamic shared memory, __syncthreads / __syncwarp (barriers), __shfl_xor_sync (a
// per-warp exchange between two barriers, so every lane of the warp must call it, as
// in the kernel), __popc, __ldg, __funnelshift_r, __uint_as_float; the kernel's cp.async
// copies are plain copies here (LOWBIT_HOST_EMULATION), so its waits are no-ops. Memory is host memory; blocks run one after another.
// Not a CUDA emulator: no timing, no memory model beyond barriers, float math by the
// host compiler.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace emu {

struct BlockState {
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> exchange;  // one shuffle slot per thread
  std::vector<unsigned char> shared;
  BlockState(int threads, size_t smem) : block(threads), exchange(threads), shared(smem + 16) {
    for (int w = 0; w < threads / 32; ++w) warps.emplace_back(std::make_unique<std::barrier<>>(32));
  }
};

thread_local uint3 thread_idx;
thread_local uint3 block_idx;
thread_local dim3 block_dim;
thread_local dim3 grid_dim;
thread_local BlockState* state;

inline void sync_threads() { state->block.arrive_and_wait(); }
inline void sync_warp() { state->warps[thread_idx.x / 32]->arrive_and_wait(); }

inline float shfl_xor(float v, int lane_mask) {
  const int t = static_cast<int>(thread_idx.x), lane = t % 32;
  state->exchange[t] = v;
  sync_warp();
  const float r = state->exchange[t - lane + (lane ^ lane_mask)];
  sync_warp();
  return r;
}

inline unsigned funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  const unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>(v >> (shift & 31u));
}

inline float uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline unsigned char* shared_memory() {
  const auto base = reinterpret_cast<std::uintptr_t>(state->shared.data());
  return reinterpret_cast<unsigned char*>((base + 15) / 16 * 16);
}

template <class Kernel, class Arg>
void launch(Kernel kernel, dim3 grid, int threads, size_t smem, const Arg& arg) {
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        BlockState block(threads, smem);
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            thread_idx = make_uint3(t, 0, 0);
            block_idx = make_uint3(x, y, z);
            block_dim = dim3(threads);
            grid_dim = grid;
            state = &block;
            kernel(arg);
          });
        }
        for (auto& th : pool) th.join();
      }
}

}  // namespace emu

#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim
#define __syncthreads() emu::sync_threads()
#define __syncwarp() emu::sync_warp()
#define __shfl_xor_sync(mask, v, lane_mask) emu::shfl_xor((v), (lane_mask))
#define __popc(x) __builtin_popcount(x)
#define __ldg(p) (*(p))
#define __funnelshift_r(lo, hi, shift) emu::funnelshift_r((lo), (hi), (shift))
#define __uint_as_float(u) emu::uint_as_float(u)
#define LOWBIT_HOST_EMULATION 1

#include "packed_attention.cu"

// The CUDA launcher's work, run on the host. Returns 0, or 1 when the checks refuse.
extern "C" int lowbit_packed_attention_emulated(const LowbitAttentionArgs* args) {
  if (lowbit_packed_attention_check(args) != nullptr) return 1;
  if (args->num_rows == 0) return 0;
  const LaunchPlan plan = launch_plan(*args);
  emu::launch(plan.kernel, plan.grid, plan.threads, plan.smem, *args);
  if (args->num_splits > 1)
    emu::launch(combine_splits_kernel, dim3(args->num_rows * args->Hq), args->fmt.D, 0, *args);
  return 0;
}

extern "C" const char* lowbit_packed_attention_emulated_check(const LowbitAttentionArgs* args) {
  return lowbit_packed_attention_check(args);
}

extern "C" int lowbit_args_size() { return static_cast<int>(sizeof(LowbitAttentionArgs)); }
