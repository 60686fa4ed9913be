// Test harness: runs the kernels of packed_attention.cu, unchanged, on the CPU with one
// fiber (ucontext) per CUDA thread, so CI (no GPU) executes the kernel's own indexing and
// synchronization (tests/test_cuda_kernel.py builds it with g++ and calls it via ctypes).
// Emulated, and only as far as packed_attention.cu uses it: thread/block indices,
// dynamic shared memory, __syncthreads / __syncwarp (barriers), __shfl_xor_sync (a
// per-warp exchange between two barriers, so every lane of the warp must call it, as
// in the kernel), __popc, __ldg, __funnelshift_r, __uint_as_float; the kernel's cp.async
// copies are plain copies here (LOWBIT_HOST_EMULATION), so its waits are no-ops. Memory
// is host memory; blocks run one after another.
// Fibers, not OS threads: a barrier is a switch of a few hundred nanoseconds instead of
// waking hundreds of threads on a few cores (the emulated tests ran 10x longer that way).
// The block's fibers run to their next barrier in turn, in alternating order, so a read
// of another thread's write with no barrier between them sees the old value in one of
// the two orders; a barrier that some threads never reach is reported, not a hang.
// Not a CUDA emulator: no timing, no memory model beyond barriers, float math by the
// host compiler.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace emu {

// A barrier of `expected` fibers: the last to arrive opens it (the next generation).
struct Barrier {
  int expected, arrived = 0;
  unsigned generation = 0;
};

struct Fiber {
  static constexpr size_t kStackBytes = 256 * 1024;
  ucontext_t context;
  std::unique_ptr<char[]> stack{new char[kStackBytes]};
  const Barrier* waiting = nullptr;  // the barrier it waits at, while at `generation`
  unsigned generation = 0;
  bool done = false;
};

struct BlockState {
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<float> exchange;  // one shuffle slot per thread
  std::vector<unsigned char> shared;
  BlockState(int threads, size_t smem)
      : block{threads}, warps(threads / 32, Barrier{32}), exchange(threads), shared(smem + 16) {}
};

thread_local uint3 thread_idx;
thread_local uint3 block_idx;
thread_local dim3 block_dim;
thread_local dim3 grid_dim;
thread_local BlockState* state;
thread_local Fiber* running;
thread_local ucontext_t scheduler;
thread_local const void* launched;  // the Launch<Kernel, Arg> the fibers start

inline void arrive_and_wait(Barrier& b) {
  running->waiting = &b;
  running->generation = b.generation;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
  }
  swapcontext(&running->context, &scheduler);
}

inline void sync_threads() { arrive_and_wait(state->block); }
inline void sync_warp() { arrive_and_wait(state->warps[thread_idx.x / 32]); }

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
struct Launch {
  Kernel kernel;
  const Arg& arg;
  static void fiber_main() {
    const auto* l = static_cast<const Launch*>(launched);
    l->kernel(l->arg);
    running->done = true;  // returns to the scheduler (uc_link)
  }
};

// Runs the grid's blocks one after another; false when a block's threads wait at
// barriers that can no longer open (some thread skipped a __syncthreads / __syncwarp).
template <class Kernel, class Arg>
bool launch(Kernel kernel, dim3 grid, int threads, size_t smem, const Arg& arg) {
  const Launch<Kernel, Arg> body{kernel, arg};
  launched = &body;
  std::vector<Fiber> fibers(threads);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        BlockState block(threads, smem);
        state = &block;
        block_idx = make_uint3(x, y, z);
        block_dim = dim3(threads);
        grid_dim = grid;
        for (Fiber& f : fibers) {  // (a ucontext_t points into itself: set up in place)
          f.waiting = nullptr;
          f.done = false;
          getcontext(&f.context);
          f.context.uc_stack = {f.stack.get(), 0, Fiber::kStackBytes};
          f.context.uc_link = &scheduler;
          makecontext(&f.context, &Launch<Kernel, Arg>::fiber_main, 0);
        }
        for (int left = threads, round = 0; left > 0; ++round) {
          bool moved = false;
          for (int i = 0; i < threads; ++i) {
            const int t = round % 2 ? threads - 1 - i : i;
            Fiber& f = fibers[t];
            if (f.done || (f.waiting && f.waiting->generation == f.generation)) continue;
            f.waiting = nullptr;
            thread_idx = make_uint3(t, 0, 0);
            running = &f;
            swapcontext(&scheduler, &f.context);
            moved = true;
            left -= f.done;
          }
          if (!moved) return false;
        }
      }
  return true;
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

// The CUDA launcher's work, run on the host. Returns 0; 1 when the checks refuse; 2 when
// threads of a block wait at a barrier the others never reach.
extern "C" int lowbit_packed_attention_emulated(const LowbitAttentionArgs* args) {
  if (lowbit_packed_attention_check(args) != nullptr) return 1;
  if (args->num_rows == 0) return 0;
  const LaunchPlan plan = launch_plan(*args);
  if (!emu::launch(plan.kernel, plan.grid, plan.threads, plan.smem, *args)) return 2;
  if (args->num_splits > 1 &&
      !emu::launch(combine_splits_kernel, dim3(args->num_rows * args->Hq), args->fmt.D, 0, *args))
    return 2;
  return 0;
}

extern "C" const char* lowbit_packed_attention_emulated_check(const LowbitAttentionArgs* args) {
  return lowbit_packed_attention_check(args);
}

extern "C" int lowbit_args_size() { return static_cast<int>(sizeof(LowbitAttentionArgs)); }
