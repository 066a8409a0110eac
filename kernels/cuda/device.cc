#include "kernels/cuda/device.h"

#include <cuda_runtime_api.h>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/format_kernels.cuh"

namespace tqkv {
namespace cuda {

namespace {
// The payload that marks a status as a lost device (its value is unused).
constexpr char kDeviceLostPayload[] = "type.googleapis.com/tqkv.cuda.DeviceLost";
}  // namespace

bool IsStickyError(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContextIsDestroyed:
      return true;
    default:
      return false;
  }
}

bool IsDeviceLost(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kDeviceLostPayload).has_value();
}

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorName(error), " (",
                                           cudaGetErrorString(error), ")");
  if (IsStickyError(error)) {
    absl::Status lost = absl::UnavailableError(
        absl::StrCat("the CUDA device is lost (", message, "); restart the server to recover"));
    lost.SetPayload(kDeviceLostPayload, absl::Cord());
    return lost;
  }
  switch (error) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
      return absl::UnavailableError(message);
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

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

absl::StatusOr<std::vector<DeviceInfo>> ListDevices() {
  int count = 0;
  absl::Status status = CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (!status.ok()) {
    // cudaErrorInsufficientDriver is also what a machine with no driver at all
    // reports; say both.
    return absl::UnavailableError(
        absl::StrCat("no usable CUDA device or driver (", status.message(), ")"));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device");
  std::vector<DeviceInfo> devices;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    absl::Status prop_status = CudaStatus(cudaGetDeviceProperties(&prop, i), "cudaGetDeviceProperties");
    if (!prop_status.ok()) return prop_status;
    devices.push_back({i, prop.name, prop.major, prop.minor, prop.totalGlobalMem});
  }
  return devices;
}

absl::Status RotatedDecodeOnDevice(const uint8_t* codes, int code_bytes, const uint16_t* scales,
                                   const std::vector<float>& centroids, int bits, int dim,
                                   int64_t num_vectors, float* out) {
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
    status = CudaStatus(cudaMemcpy(d_scales.as<void>(), scales, sizeof(uint16_t) * num_vectors,
                                   cudaMemcpyHostToDevice), "copy scales");
  }
  if (status.ok()) {
    status = CudaStatus(cudaMemcpy(d_centroids.as<void>(), centroids.data(),
                                   sizeof(float) * centroids.size(), cudaMemcpyHostToDevice),
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
