#include "kernels/cuda/device.h"

#include <cuda_runtime_api.h>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

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
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  if (IsStickyError(error)) {
    absl::Status lost =
        absl::UnavailableError(absl::StrCat("the CUDA device is lost (", message, "); restart the server to recover"));
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

absl::StatusOr<std::vector<DeviceInfo>> ListDevices() {
  int count = 0;
  absl::Status status = CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (!status.ok()) {
    // cudaErrorInsufficientDriver is also what a machine with no driver at all
    // reports; say both.
    return absl::UnavailableError(absl::StrCat("no usable CUDA device or driver (", status.message(), ")"));
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

}  // namespace cuda
}  // namespace tqkv
