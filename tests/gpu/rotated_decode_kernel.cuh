// A test-only device kernel over the stored format that the CPU backend
// writes: the same bit packing (bitpack.h) and number formats
// (float_formats.h), compiled for the GPU from the same headers, so that
// tests/gpu/format_kernels_test.cc can compare the two codes-to-floats paths
// alone. The product library never links it. The launcher returns
// cudaError_t (nvcc never sees abseil); rotated_decode.h wraps it.
#ifndef TQKV_TESTS_GPU_ROTATED_DECODE_KERNEL_CUH_
#define TQKV_TESTS_GPU_ROTATED_DECODE_KERNEL_CUH_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace tqkv {
namespace cuda {

// Rotated-domain decode of TurboQuant codes: out[v][j] = scale_v * centroids[code_vj].
// All pointers are device pointers.
struct RotatedDecodeParams {
  const uint8_t* codes = nullptr;    // [num_vectors][code_stride] packed codes
  int64_t code_stride = 0;           // bytes between vectors
  const uint16_t* scales = nullptr;  // [num_vectors][scale_stride] fp16
  int64_t scale_stride = 0;          // fp16 elements between vectors
  const float* centroids = nullptr;  // 2^bits
  int bits = 0;
  int dim = 0;
  int64_t num_vectors = 0;
  float* out = nullptr;  // [num_vectors][dim]
};

cudaError_t LaunchRotatedDecode(const RotatedDecodeParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_TESTS_GPU_ROTATED_DECODE_KERNEL_CUH_
