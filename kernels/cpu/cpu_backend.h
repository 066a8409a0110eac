// The CPU backend: the reference implementation of Backend and a production
// backend for machines without a GPU. The pool is 64-byte aligned host memory.
#ifndef TQKV_KERNELS_CPU_CPU_BACKEND_H_
#define TQKV_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "kernels/backend.h"

namespace tqkv {

// num_threads: worker threads for large calls; 0 means the hardware
// concurrency. Calls from several caller threads run concurrently.
std::unique_ptr<Backend> MakeCpuBackend(int num_threads = 0);

}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_CPU_BACKEND_H_
