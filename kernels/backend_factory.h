// Chooses and builds the compute backend at start-up, by name. The only place
// that knows which backends this build has: callers (the server, tools) never
// test for CUDA themselves.
#ifndef TQKV_KERNELS_BACKEND_FACTORY_H_
#define TQKV_KERNELS_BACKEND_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace tqkv {

struct BackendOptions {
  // "auto": CUDA when this build has it and a device is usable, else the CPU
  // (the server then puts each cache the CUDA backend cannot serve,
  // Backend::SupportsLayout, on a CPU backend of its own); "cpu"; or "cuda"
  // (UNAVAILABLE without a device or a CUDA build).
  std::string name = "auto";
  // CPU backend worker threads; 0 means the hardware concurrency.
  int cpu_threads = 0;
  // CPU TurboQuant attention through the integer kernel where the CPU has
  // AVX-512 VNNI + VBMI + VBMI2 (CpuBackendOptions::integer_attention).
  bool cpu_integer_attention = true;
  // CUDA device ordinal.
  int cuda_device = 0;
  // CUDA decode on the tensor cores where the layout allows (TF32 operands,
  // outputs within about 2e-3 of fp32); false: the fp32 kernel everywhere.
  bool cuda_tensor_cores = true;
};

// INVALID_ARGUMENT for an unknown name. With "auto", *why_not_cuda (when
// given) receives the reason the CUDA backend was not taken, or "".
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options,
                                                     std::string* why_not_cuda = nullptr);

// Whether this build contains the CUDA backend.
bool CudaBackendBuilt();

}  // namespace tqkv

#endif  // TQKV_KERNELS_BACKEND_FACTORY_H_
