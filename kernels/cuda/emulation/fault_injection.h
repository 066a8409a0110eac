// Faults of the emulated device (cuda_runtime_emulation.cc), for the tests of
// machines without a GPU: what a real device does after a sticky error, on
// demand.
//
// InjectStickyError(e) with a sticky error e (cuda::IsStickyError: an illegal
// address, a launch failure, an uncorrectable ECC error) makes every later
// runtime call of the process return e, as a dead context does: copies,
// allocations, stream and event calls, cudaSetDevice, cudaGetLastError (which
// does not clear it), and kernel launches, which then run nothing.
// cudaGetDeviceCount and cudaGetDeviceProperties still answer, as the driver
// does; frees still free. Unlike a real device, the emulated one recovers:
// InjectStickyError(cudaSuccess) ends the fault, so one test process can go
// on. Thread-safe.
#ifndef TQKV_KERNELS_CUDA_EMULATION_FAULT_INJECTION_H_
#define TQKV_KERNELS_CUDA_EMULATION_FAULT_INJECTION_H_

#include <cuda_runtime_api.h>

namespace tqkv {
namespace cuda {
namespace emulation {

void InjectStickyError(cudaError_t error);

// The injected error, cudaSuccess when none.
cudaError_t StickyError();

}  // namespace emulation
}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_EMULATION_FAULT_INJECTION_H_
