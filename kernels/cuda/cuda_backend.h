// The CUDA backend: the Backend interface (backend.h) over a page pool in GPU
// memory, with the same page byte layout as the CPU backend (kv_layout.h,
// docs/format.md), so that pages written by one read the same through the
// other.
//
// Memory. AllocatePool makes one cudaMalloc for the pages and one for the
// layout's format tables (codebooks, rotation signs, Hadamard factors, dense
// rotation matrices, hot channels; with exact tokens, the exact layout's
// tables too, so Store and the reads take params.layout == the pool's
// layout or its exact_layout()), at start-up. Requests then run in
// workspaces made at construction: each has a stream, a pinned host staging
// buffer and a device buffer of CudaBackendOptions::workspace_bytes, so no
// call allocates device or pinned memory. A call takes a free workspace
// (waiting while all are busy), copies its inputs host -> pinned -> device,
// launches, copies the results back and waits on its own stream only; calls
// from several threads run concurrently up to the workspace count. Requests
// bigger than a workspace are processed in pieces (tokens for Store and Score,
// items and query tokens for Attend).
//
// Kernels: the prologue (prologue_kernels.cuh: stores, store_kernels.cuh, and
// query preparation, in one launch), ScoreQuery and fused split-KV decode
// (attend_kernels.cuh), on the tensor cores where the layout allows
// (CudaBackendOptions::tensor_cores). Every call is planned on the
// host first (planner.h): Attend's blocks, splits sized from the SM count and
// the occupancy API, pieces and batches that fit a workspace, and the offset
// of every buffer in it; Score's and Store's pieces likewise.
//
// Key centering and exact sink/recent tokens (backend.h) are served like the
// CPU backend: each read splits into the compressed run and the exact runs
// (own blocks, exact pages through the exact block table), merged exactly by
// log-sum-exp; the pre-RoPE add-back is added inside the kernels from
// per-call coefficients the host computes (as the CPU's MakeAddBackTerms),
// with angles reduced in double on the device (exact at any position); its
// constant part shifts only the lse (Attend) or every logit (Score).
//
// What it refuses with UNIMPLEMENTED, in SupportsLayout (host only, before
// anything is allocated; AllocatePool refuses the same): head dims above
// kMaxDeviceHeadDim or not a multiple of 8, QJL keys (evaluation only),
// TurboQuant parts whose width is not a multiple of 4, multi-part
// TurboQuant values, and key / value format pairs without a kernel (not in
// kernels/format_table.h). Use the CPU backend for those (`--backend auto`
// does, per cache).
//
// Timing (Backend::LastCallTiming): Store, Score and Attend report the device
// time of their kernels (CUDA events, copies excluded) and every call its
// wait for a free workspace; the server exports both beside the wall time.
//
// Errors: CUDA failures become a Status (UNAVAILABLE without a usable device,
// RESOURCE_EXHAUSTED when device memory is short, INTERNAL for a failed call);
// nothing aborts. Store reports non-finite or out-of-range input as
// INVALID_ARGUMENT like the CPU codecs. A sticky error (cuda::IsStickyError:
// illegal address, launch failure, uncorrectable ECC, ...) marks the backend
// lost: that call and every later one fail UNAVAILABLE, and DeviceStatus()
// says why, for the rest of the process (the context cannot be recovered).
#ifndef TQKV_KERNELS_CUDA_CUDA_BACKEND_H_
#define TQKV_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace tqkv {

struct CudaBackendOptions {
  // CUDA device ordinal.
  int device = 0;
  // Concurrent calls; each workspace holds `workspace_bytes` of pinned host
  // memory and as much device memory.
  int workspaces = 4;
  // 64 MiB fits a default-sized (64 MiB) request in one piece in most cases.
  size_t workspace_bytes = size_t{64} << 20;
  // Decode on the tensor cores (TF32 mma) where the layout allows it (see
  // cuda::AttendMmaSupported): several times fewer instructions per token;
  // outputs within about 2e-3 of the fp32 kernel instead of 1e-6. False: the
  // fp32 CUDA-core kernel everywhere.
  bool tensor_cores = true;
};

// UNAVAILABLE when the driver or the device is missing (as on build
// machines); INVALID_ARGUMENT for bad options.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const CudaBackendOptions& options = {});

}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_CUDA_BACKEND_H_
