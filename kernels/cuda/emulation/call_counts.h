// What the emulated device (cuda_runtime_emulation.cc) was asked to do, for
// tests that hold the CUDA backend to a budget of launches, copies and
// synchronizations per call: the emulation cannot time a kernel, but it sees
// every runtime call a real device would get. Counted over the process, from
// the last ResetCallCounts; thread-safe.
#ifndef TQKV_KERNELS_CUDA_EMULATION_CALL_COUNTS_H_
#define TQKV_KERNELS_CUDA_EMULATION_CALL_COUNTS_H_

#include <cstdint>

namespace tqkv {
namespace cuda {
namespace emulation {

struct CallCounts {
  int64_t launches = 0;
  int64_t copies_to_device = 0;  // host to device (cudaMemcpy / cudaMemcpyAsync)
  int64_t copies_to_host = 0;    // device to host
  int64_t copies_on_device = 0;  // device to device
  int64_t synchronizations = 0;  // stream, event and device synchronizations
};

CallCounts GetCallCounts();
void ResetCallCounts();

// The emulation's own bookkeeping (cuda_runtime_emulation.cc and the
// launcher in emulated_device.cc).
void CountLaunch();
// Whether a launch of `func` may take `bytes` of dynamic shared memory: up
// to 48 KiB, more only up to what cudaFuncSetAttribute's
// cudaFuncAttributeMaxDynamicSharedMemorySize allowed it (as on a GPU).
bool DynamicSharedAllowed(const void* func, size_t bytes);

}  // namespace emulation
}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_EMULATION_CALL_COUNTS_H_
