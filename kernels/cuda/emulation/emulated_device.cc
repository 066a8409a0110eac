#include "kernels/cuda/emulation/emulated_device.h"

#include "kernels/cuda/emulation/call_counts.h"

#include <array>
#include <cstdio>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/cuda/emulation/fault_injection.h"

namespace tqkv {
namespace cuda {
namespace emulation {

dim3 thread_index;
dim3 block_index;
dim3 block_dim;
dim3 grid_dim;

namespace {

constexpr size_t kStackBytes = size_t{256} << 10;

// Saves the callee-saved registers and the stack pointer of the running
// context to *from, resumes the one saved at `to`. (ucontext's swapcontext
// would do, but makes a system call per switch for the signal mask, and the
// emulation switches at every barrier of every thread.)
extern "C" void tqkv_emulation_switch(void** from, void* to);
asm(R"(
  .text
  .globl tqkv_emulation_switch
  .type tqkv_emulation_switch, @function
tqkv_emulation_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tqkv_emulation_switch, .-tqkv_emulation_switch
)");

struct Fiber {
  void* context = nullptr;  // saved stack pointer
  std::unique_ptr<char[]> stack;
  dim3 index;
  bool done = false;
};

// The one block being run. Launches are serialised (kernels' __shared__
// variables are static), so one state serves every caller thread.
struct BlockState {
  std::vector<Fiber> fibers;
  void* scheduler = nullptr;
  int current = -1;
  const std::function<void()>* body = nullptr;
  int live = 0;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<int> warp_live, warp_arrived;
  std::vector<uint64_t> warp_generation;
  std::vector<std::array<uint64_t, 32>> slots;
  std::vector<std::array<uint8_t, 32 * 256>> gather;
  std::vector<float> dynamic_shared;
  uint64_t progress = 0;
};

BlockState& State() {
  static BlockState* state = new BlockState();
  return *state;
}

std::mutex& LaunchMutex() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}

void Yield() {
  BlockState& s = State();
  tqkv_emulation_switch(&s.fibers[s.current].context, s.scheduler);
}

int Warp() { return static_cast<int>(thread_index.x / 32u); }

// Releases the barriers that every live thread has now reached.
void ReleaseReady(int warp) {
  BlockState& s = State();
  if (s.warp_arrived[warp] > 0 && s.warp_arrived[warp] == s.warp_live[warp]) {
    s.warp_arrived[warp] = 0;
    ++s.warp_generation[warp];
  }
  if (s.arrived > 0 && s.arrived == s.live) {
    s.arrived = 0;
    ++s.generation;
  }
}

[[noreturn]] void FiberMain() {
  BlockState& s = State();
  (*s.body)();
  Fiber& f = s.fibers[s.current];
  f.done = true;
  const int warp = static_cast<int>(f.index.x / 32u);
  --s.live;
  --s.warp_live[warp];
  ++s.progress;
  ReleaseReady(warp);
  void* finished = nullptr;
  tqkv_emulation_switch(&finished, s.scheduler);
  __builtin_unreachable();
}

// A fresh stack whose first switch "returns" into FiberMain: six zeroed
// callee-saved registers, then FiberMain's address, with the stack aligned as
// at a function's entry.
void StartFiber(Fiber& f, int index) {
#if defined(__SANITIZE_ADDRESS__)
  // The frames of the last block's fibers never returned; their redzones are
  // still poisoned in this reused stack.
  ASAN_UNPOISON_MEMORY_REGION(f.stack.get(), kStackBytes);
#endif
  f.done = false;
  f.index = dim3(index, 0, 0);
  uintptr_t top = reinterpret_cast<uintptr_t>(f.stack.get() + kStackBytes) & ~uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top - 8 * sizeof(void*));
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  sp[6] = reinterpret_cast<void*>(&FiberMain);
  sp[7] = nullptr;  // FiberMain's (never used) return address
  f.context = sp;
}

}  // namespace

void SyncWarp() {
  BlockState& s = State();
  const int warp = Warp();
  ++s.progress;
  const uint64_t seen = s.warp_generation[warp];
  ++s.warp_arrived[warp];
  ReleaseReady(warp);
  while (s.warp_generation[warp] == seen) Yield();
}

void SyncThreads() {
  BlockState& s = State();
  ++s.progress;
  const uint64_t seen = s.generation;
  ++s.arrived;
  ReleaseReady(Warp());
  while (s.generation == seen) Yield();
}

uint64_t ExchangeInWarp(uint64_t value, int src_lane) {
  BlockState& s = State();
  const int warp = Warp();
  s.slots[warp][Lane()] = value;
  SyncWarp();
  const uint64_t out = s.slots[warp][src_lane];
  SyncWarp();
  return out;
}

void WarpGather(const void* mine, size_t bytes, void* all) {
  BlockState& s = State();
  if (bytes > 256) {
    std::fprintf(stderr, "emulated WarpGather: %zu bytes per lane, at most 256\n", bytes);
    std::abort();
  }
  uint8_t* buffer = s.gather[Warp()].data();
  std::memcpy(buffer + Lane() * bytes, mine, bytes);
  SyncWarp();
  std::memcpy(all, buffer, 32 * bytes);
  SyncWarp();
}

float* DynamicShared() { return State().dynamic_shared.data(); }

void Launch(const void* func, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t,
            const std::function<void()>& body) {
  if (StickyError() != cudaSuccess) return;  // a dead context runs nothing (fault_injection.h)
  if (!DynamicSharedAllowed(func, shared_bytes)) {
    std::fprintf(stderr,
                 "emulated launch: %zu bytes of dynamic shared memory without the kernel's "
                 "cudaFuncAttributeMaxDynamicSharedMemorySize\n",
                 shared_bytes);
    std::abort();
  }
  CountLaunch();
  std::lock_guard<std::mutex> lock(LaunchMutex());
  BlockState& s = State();
  const int threads = static_cast<int>(block.x * block.y * block.z);
  if (block.y != 1 || block.z != 1 || threads < 1 || threads > 1024) {
    std::fprintf(stderr, "emulated launch: blocks must be 1-D with 1..1024 threads\n");
    std::abort();
  }
  const int warps = (threads + 31) / 32;
  s.body = &body;
  if (static_cast<int>(s.fibers.size()) < threads) s.fibers.resize(threads);
  for (Fiber& f : s.fibers) {
    if (!f.stack) f.stack.reset(new char[kStackBytes]);
  }
  grid_dim = grid;
  block_dim = block;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        block_index = dim3(x, y, z);
        s.dynamic_shared.assign((shared_bytes + sizeof(float) - 1) / sizeof(float) + 4, NAN);
        s.live = threads;
        s.arrived = 0;
        s.warp_live.assign(warps, 32);
        s.warp_live[warps - 1] = threads - 32 * (warps - 1);
        s.warp_arrived.assign(warps, 0);
        s.warp_generation.assign(warps, 0);
        s.slots.assign(warps, {});
        s.gather.resize(warps);
        for (int i = 0; i < threads; ++i) StartFiber(s.fibers[i], i);
        int remaining = threads;
        bool forward = true;
        while (remaining > 0) {
          const uint64_t before = s.progress;
          for (int k = 0; k < threads; ++k) {
            const int i = forward ? k : threads - 1 - k;
            Fiber& f = s.fibers[i];
            if (f.done) continue;
            s.current = i;
            thread_index = f.index;
            tqkv_emulation_switch(&s.scheduler, f.context);
            if (f.done) --remaining;
          }
          forward = !forward;
          if (remaining > 0 && s.progress == before) {
            std::fprintf(stderr, "emulated launch: block (%u, %u, %u) deadlocked at a barrier\n", x, y, z);
            std::abort();
          }
        }
      }
    }
  }
}

}  // namespace emulation
}  // namespace cuda
}  // namespace tqkv
