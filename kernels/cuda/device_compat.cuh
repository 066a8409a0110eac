// The device features tqkv's kernels use, in one place, for two compilers:
// nvcc, and the host emulation (emulation/emulated_device.h) that runs the
// same kernel source on CPU fibers for the tests of machines without a GPU.
// Kernels launch with TQKV_LAUNCH, read fp16 scalars with HalfBitsToFloat and
// take dynamic shared memory from DynamicSharedFloats.
#ifndef TQKV_KERNELS_CUDA_DEVICE_COMPAT_CUH_
#define TQKV_KERNELS_CUDA_DEVICE_COMPAT_CUH_

#include <cstdint>

#if defined(__CUDACC__)

#include <cuda_fp16.h>

#define TQKV_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)

namespace tqkv {
namespace cuda {

__device__ __forceinline__ float HalfBitsToFloat(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

__device__ __forceinline__ float* DynamicSharedFloats() {
  extern __shared__ float tqkv_dynamic_shared[];
  return tqkv_dynamic_shared;
}

}  // namespace cuda
}  // namespace tqkv

#else  // the host emulation

#include "kernels/cuda/emulation/emulated_device.h"
#include "kernels/float_formats.h"

namespace tqkv {
namespace cuda {

inline float HalfBitsToFloat(uint32_t bits) { return HalfToFloat(static_cast<uint16_t>(bits)); }
inline float* DynamicSharedFloats() { return emulation::DynamicShared(); }

}  // namespace cuda
}  // namespace tqkv

#endif

#endif  // TQKV_KERNELS_CUDA_DEVICE_COMPAT_CUH_
