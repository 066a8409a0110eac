// Kernel body and launcher of rotated_decode_kernel.cuh, written once for two
// compilers: nvcc (rotated_decode_kernel.cu) and the host emulation
// (rotated_decode_kernel_emulated.cc, kernels/cuda/emulation/), which runs the
// same source on CPU fibers. Device features come from device_compat.cuh only.
#ifndef TQKV_TESTS_GPU_ROTATED_DECODE_KERNEL_IMPL_CUH_
#define TQKV_TESTS_GPU_ROTATED_DECODE_KERNEL_IMPL_CUH_

#include "tests/gpu/rotated_decode_kernel.cuh"
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

#endif  // TQKV_TESTS_GPU_ROTATED_DECODE_KERNEL_IMPL_CUH_
