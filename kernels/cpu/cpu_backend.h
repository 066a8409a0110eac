// The CPU backend: the reference implementation of Backend and a production
// backend for machines without a GPU. The pool is 64-byte aligned host memory.
#ifndef TQKV_KERNELS_CPU_CPU_BACKEND_H_
#define TQKV_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "kernels/backend.h"

namespace tqkv {

struct CpuBackendOptions {
  // Worker threads for large calls; 0 means the hardware concurrency. Calls
  // from several caller threads run concurrently.
  int num_threads = 0;
  // TurboQuant attention (centroid keys, values of 2-4 bits) through the
  // integer kernel where the CPU has it (SimdLevel::kAvx512Vnni: AVX-512 with
  // VNNI, VBMI and VBMI2): about twice as fast as fp32, at outputs within 2%
  // of the fp32 kernels' error against exact attention (its rounding is
  // stated in kernels/cpu/attend_kernels.h). false: fp32 everywhere. As the
  // CUDA backend's tensor_cores.
  bool integer_attention = true;
};
std::unique_ptr<Backend> MakeCpuBackend(const CpuBackendOptions& options);

// The reference configuration: fp32 attention everywhere (no integer
// kernel), which the tests hold to float64 within 1e-5.
std::unique_ptr<Backend> MakeCpuBackend(int num_threads = 0);

}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_CPU_BACKEND_H_
