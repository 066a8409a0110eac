// A host emulation of the CUDA device features tqkv's kernels use, so that the
// kernel source itself (kernels/cuda/*_impl.cuh) runs in the tests of machines
// without a GPU.
//
// A launch runs its blocks one after another; a block's threads are fibers
// (ucontext) on the calling thread, switched only at barriers: __syncthreads,
// __syncwarp, and the warp collectives (__shfl_*_sync, __all_sync), which
// exchange values through a per-warp slot array between two warp barriers.
// The fibers of a block run in forward order in one phase between barriers and
// in reverse order in the next, so a missing barrier shows up as a stale read
// whichever thread writes first. __shared__ variables are static (one block
// runs at a time); dynamic shared memory is filled with NaN bytes at each
// block's start, as a real GPU guarantees nothing. Arithmetic intrinsics map
// to the same IEEE operations; fmaf is a true fused multiply-add.
//
// What it cannot show: timing, memory coalescing, bank conflicts, the device
// memory model beyond barriers, or code generation bugs of nvcc. It checks the
// kernels' logic: indexing, planning, reductions, masking and the bytes they
// write, against the CPU backend.
#ifndef TQKV_KERNELS_CUDA_EMULATION_EMULATED_DEVICE_H_
#define TQKV_KERNELS_CUDA_EMULATION_EMULATED_DEVICE_H_

#include <cuda_runtime_api.h>
#include <vector_types.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

// cuda_runtime_api.h defined these for a host compiler; here they mean the
// emulation's.
#undef __device__
#undef __host__
#undef __global__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#undef __grid_constant__
#define __grid_constant__

namespace tqkv {
namespace cuda {
namespace emulation {

extern dim3 thread_index;
extern dim3 block_index;
extern dim3 block_dim;
extern dim3 grid_dim;

void SyncThreads();
void SyncWarp();
// Writes `value` to this lane's slot, waits for the warp, reads `src_lane`'s
// slot, waits again.
uint64_t ExchangeInWarp(uint64_t value, int src_lane);
float* DynamicShared();
// Every lane of the warp contributes `bytes` at `mine`; all receives the 32
// contributions in lane order (32 * bytes, at most 32 * 256).
void WarpGather(const void* mine, size_t bytes, void* all);

// Runs `body` for every thread of every block of the grid. Kernels are 1-D
// in threads (grid may be 2-D).
// `func` is the kernel (for its attributes: cudaFuncSetAttribute).
void Launch(const void* func, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
            const std::function<void()>& body);

inline int Lane() { return static_cast<int>(thread_index.x & 31u); }

template <typename T>
T Shuffle(T value, int src_lane) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffles move up to 64 bits");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = ExchangeInWarp(bits, src_lane & 31);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

}  // namespace emulation
}  // namespace cuda
}  // namespace tqkv

#define threadIdx (::tqkv::cuda::emulation::thread_index)
#define blockIdx (::tqkv::cuda::emulation::block_index)
#define blockDim (::tqkv::cuda::emulation::block_dim)
#define gridDim (::tqkv::cuda::emulation::grid_dim)

#define TQKV_LAUNCH(kernel, grid, block, shared_bytes, stream, ...)                                               \
  ::tqkv::cuda::emulation::Launch(reinterpret_cast<const void*>(kernel), dim3(grid), dim3(block), (shared_bytes), \
                                  (stream), [&] { kernel(__VA_ARGS__); })

inline void __syncthreads() { ::tqkv::cuda::emulation::SyncThreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::tqkv::cuda::emulation::SyncWarp(); }

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  return ::tqkv::cuda::emulation::Shuffle(value, ::tqkv::cuda::emulation::Lane() ^ lane_mask);
}
template <typename T>
T __shfl_sync(unsigned, T value, int src_lane) {
  return ::tqkv::cuda::emulation::Shuffle(value, src_lane);
}
inline int __all_sync(unsigned, int predicate) {
  // Each lane reads every lane's predicate in turn; all lanes agree.
  int all = 1;
  for (int lane = 0; lane < 32; ++lane) all &= ::tqkv::cuda::emulation::Shuffle(predicate != 0 ? 1 : 0, lane);
  return all;
}
inline int __any_sync(unsigned mask, int predicate) { return !__all_sync(mask, predicate == 0); }
// Fibers switch only at barriers, so a read-modify-write is atomic.
inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  if (value < old) *address = value;
  return old;
}
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}
// One block runs at a time: every write is visible to the next block.
inline void __threadfence() {}
template <typename T>
T __ldcg(const T* p) {
  return *p;
}

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float __double2float_rn(double a) { return static_cast<float>(a); }
inline float __uint_as_float(unsigned int bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}
inline unsigned int __funnelshift_r(unsigned int lo, unsigned int hi, unsigned int shift) {
  const uint64_t both = (static_cast<uint64_t>(hi) << 32) | lo;
  return static_cast<unsigned int>(both >> (shift & 31u));
}
inline int min(int a, int b) { return a < b ? a : b; }
using std::isfinite;

#endif  // TQKV_KERNELS_CUDA_EMULATION_EMULATED_DEVICE_H_
