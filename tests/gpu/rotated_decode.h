// Test helper: decodes TurboQuant codes on device 0 into the rotated basis
// (out[v][j] = scale_v * centroids[code_vj]) from host arrays, through the
// test-only RotatedDecode kernel (rotated_decode_kernel.cuh). It allocates
// device memory per call and synchronises the device, which is why it lives
// with the tests and not in the product library.
#ifndef TQKV_TESTS_GPU_ROTATED_DECODE_H_
#define TQKV_TESTS_GPU_ROTATED_DECODE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace tqkv {
namespace cuda {

// Copies in, launches, copies back. Errors as device.h's CudaStatus.
absl::Status RotatedDecodeOnDevice(const uint8_t* codes, int code_bytes, const uint16_t* scales,
                                   const std::vector<float>& centroids, int bits, int dim, int64_t num_vectors,
                                   float* out);

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_TESTS_GPU_ROTATED_DECODE_H_
