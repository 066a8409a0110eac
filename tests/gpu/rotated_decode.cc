#include "tests/gpu/rotated_decode.h"

#include <cuda_runtime_api.h>

#include "kernels/cuda/device.h"
#include "tests/gpu/rotated_decode_kernel.cuh"

namespace tqkv {
namespace cuda {
namespace {

// Device memory freed on scope exit.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  absl::Status Allocate(size_t bytes) { return CudaStatus(cudaMalloc(&ptr_, bytes), "cudaMalloc"); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

}  // namespace

absl::Status RotatedDecodeOnDevice(const uint8_t* codes, int code_bytes, const uint16_t* scales,
                                   const std::vector<float>& centroids, int bits, int dim, int64_t num_vectors,
                                   float* out) {
  DeviceBuffer d_codes, d_scales, d_centroids, d_out;
  const size_t codes_size = static_cast<size_t>(code_bytes) * num_vectors;
  const size_t out_size = sizeof(float) * dim * num_vectors;
  absl::Status status = d_codes.Allocate(codes_size);
  if (status.ok()) status = d_scales.Allocate(sizeof(uint16_t) * num_vectors);
  if (status.ok()) status = d_centroids.Allocate(sizeof(float) * centroids.size());
  if (status.ok()) status = d_out.Allocate(out_size);
  if (!status.ok()) return status;
  status = CudaStatus(cudaMemcpy(d_codes.as<void>(), codes, codes_size, cudaMemcpyHostToDevice), "copy codes");
  if (status.ok()) {
    status = CudaStatus(cudaMemcpy(d_scales.as<void>(), scales, sizeof(uint16_t) * num_vectors, cudaMemcpyHostToDevice),
                        "copy scales");
  }
  if (status.ok()) {
    status = CudaStatus(
        cudaMemcpy(d_centroids.as<void>(), centroids.data(), sizeof(float) * centroids.size(), cudaMemcpyHostToDevice),
        "copy centroids");
  }
  if (!status.ok()) return status;
  RotatedDecodeParams params;
  params.codes = d_codes.as<uint8_t>();
  params.code_stride = code_bytes;
  params.scales = d_scales.as<uint16_t>();
  params.scale_stride = 1;
  params.centroids = d_centroids.as<float>();
  params.bits = bits;
  params.dim = dim;
  params.num_vectors = num_vectors;
  params.out = d_out.as<float>();
  status = CudaStatus(LaunchRotatedDecode(params, nullptr), "RotatedDecodeKernel launch");
  if (status.ok()) status = CudaStatus(cudaDeviceSynchronize(), "RotatedDecodeKernel");
  if (status.ok()) {
    status = CudaStatus(cudaMemcpy(out, d_out.as<void>(), out_size, cudaMemcpyDeviceToHost), "copy out");
  }
  return status;
}

}  // namespace cuda
}  // namespace tqkv
