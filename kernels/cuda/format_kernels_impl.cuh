// Kernel bodies and launchers of kernels/cuda/format_kernels.cuh, written once for two compilers:
// nvcc (the .cu file of the same name includes this) and the host emulation
// of tests/gpu (kernels/cuda/emulation/), which runs the same source on CPU
// fibers. Device features come from device_compat.cuh only.
#ifndef TQKV_KERNELS_CUDA_FORMAT_KERNELS_IMPL_CUH_
#define TQKV_KERNELS_CUDA_FORMAT_KERNELS_IMPL_CUH_

#include "kernels/cuda/format_kernels.cuh"
#include "kernels/cuda/device_compat.cuh"

#include "kernels/bitpack.h"
#include "kernels/float_formats.h"

namespace tqkv {
namespace cuda {
namespace {

// One thread per coordinate, a 2D grid over (vector, coordinate block).
__global__ void RotatedDecodeKernel(RotatedDecodeParams p) {
  const int64_t v = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= p.num_vectors || j >= p.dim) return;
  const uint8_t* codes = p.codes + v * p.code_stride;
  const float scale = HalfToFloat(p.scales[v * p.scale_stride]);
  p.out[v * p.dim + j] = scale * p.centroids[PackedCodeAt(codes, j, p.bits)];
}

}  // namespace

cudaError_t LaunchRotatedDecode(const RotatedDecodeParams& params, cudaStream_t stream) {
  if (params.num_vectors == 0 || params.dim == 0) return cudaSuccess;
  if (params.num_vectors > 65535) return cudaErrorInvalidValue;
  constexpr int kThreads = 128;
  const dim3 grid((params.dim + kThreads - 1) / kThreads, static_cast<unsigned>(params.num_vectors));
  TQKV_LAUNCH(RotatedDecodeKernel, grid, kThreads, 0, stream, params);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_FORMAT_KERNELS_IMPL_CUH_
