// Host-side helpers of the CUDA backend: device discovery and CUDA errors as
// absl::Status (UNAVAILABLE when there is no usable device, INTERNAL for a
// failed call). Never aborts.
#ifndef TQKV_KERNELS_CUDA_DEVICE_H_
#define TQKV_KERNELS_CUDA_DEVICE_H_

#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tqkv {
namespace cuda {

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  size_t total_memory_bytes = 0;
};

// A CUDA result as a Status: OK for cudaSuccess; UNAVAILABLE when there is no
// usable device or driver, and for a sticky error (IsStickyError), which
// also carries the device-lost payload (IsDeviceLost); RESOURCE_EXHAUSTED
// when device or pinned memory runs out; INTERNAL otherwise. `what` names the
// failed call.
absl::Status CudaStatus(cudaError_t error, const char* what);

// Whether `error` leaves the CUDA context unusable for the rest of the
// process: an illegal address, a failed or timed-out launch, a device-side
// assert, a hardware exception (illegal instruction, misaligned address,
// stack error, bad PC), an uncorrectable ECC or NVLink error, a destroyed
// context. Every later CUDA call of the process fails the same way; only a
// restart recovers.
bool IsStickyError(cudaError_t error);

// Whether `status` came from a sticky error through CudaStatus.
bool IsDeviceLost(const absl::Status& status);

// The CUDA devices this process can use. UNAVAILABLE (not an error to log
// loudly) when the driver or a device is missing, as on build machines.
absl::StatusOr<std::vector<DeviceInfo>> ListDevices();

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_DEVICE_H_
