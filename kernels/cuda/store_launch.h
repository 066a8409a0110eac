// The host side of a store on the CUDA backend, below the backend class: a
// piece of a Store's tokens staged into a call's pinned buffer, and the
// store kernel's parameters for the prologue.
#ifndef TQKV_KERNELS_CUDA_STORE_LAUNCH_H_
#define TQKV_KERNELS_CUDA_STORE_LAUNCH_H_

#include <cstdint>

#include "kernels/backend.h"
#include "kernels/cuda/call_workspace.h"
#include "kernels/cuda/device_tables.h"
#include "kernels/cuda/planner.h"
#include "kernels/cuda/prologue_kernels.cuh"

namespace tqkv {
namespace cuda {

// Tokens [t0, t0 + tokens) of a store into the pinned buffer at `at`, with
// a no-error word.
void StageStore(const StoreParams& p, int64_t t0, int64_t tokens, const StoreWorkspace& at, Workspace& w);

// The store of a piece staged at `at` (device side), for the prologue.
StoreKernelParams StoreOf(const PoolTables& tables, const StoreParams& p, int64_t tokens, const StoreWorkspace& at,
                          const Workspace& w);

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_STORE_LAUNCH_H_
