#include "kernels/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#if TQKV_HAVE_CUDA_BACKEND
#include "kernels/cuda/cuda_backend.h"
#endif

namespace tqkv {
namespace {

absl::StatusOr<std::unique_ptr<Backend>> MakeCuda(const BackendOptions& options) {
#if TQKV_HAVE_CUDA_BACKEND
  CudaBackendOptions cuda;
  cuda.device = options.cuda_device;
  cuda.tensor_cores = options.cuda_tensor_cores;
  return MakeCudaBackend(cuda);
#else
  return absl::UnavailableError("this build has no CUDA backend (nvcc was not found at configure time)");
#endif
}

std::unique_ptr<Backend> MakeCpu(const BackendOptions& options) {
  CpuBackendOptions cpu;
  cpu.num_threads = options.cpu_threads;
  cpu.integer_attention = options.cpu_integer_attention;
  return MakeCpuBackend(cpu);
}

}  // namespace

bool CudaBackendBuilt() { return TQKV_HAVE_CUDA_BACKEND != 0; }

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options, std::string* why_not_cuda) {
  if (why_not_cuda != nullptr) why_not_cuda->clear();
  if (options.name == "cpu") return MakeCpu(options);
  if (options.name == "cuda") return MakeCuda(options);
  if (options.name == "auto") {
    absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCuda(options);
    if (cuda.ok()) return cuda;
    if (why_not_cuda != nullptr) *why_not_cuda = std::string(cuda.status().message());
    return MakeCpu(options);
  }
  return absl::InvalidArgumentError(absl::StrCat("backend '", options.name, "' is unknown; want auto, cpu or cuda"));
}

}  // namespace tqkv
