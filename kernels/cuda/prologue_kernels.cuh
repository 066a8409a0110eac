// The CUDA prologue kernel: the work that comes before a read of the pages,
// in one launch. Two kinds of work, independent of each other, so one grid
// runs both:
//   - stores (store_kernels.cuh): K/V vectors quantized and packed into
//     their page slots, the CPU codecs' bytes; one warp per (layer, token,
//     KV head), several stores (a layout and its exact layout) in one grid;
//   - query preparations: queries rotated into a layout's key basis, the
//     logit scale folded in, what the decode and ScoreQuery kernels read
//     (attend_kernels.cuh); one warp per row.
// A decode layer (Backend::StoreAndAttend) launches it once for the new
// tokens and the queries of both layouts, then the decode and merge
// kernels; Store, Attend and ScoreQuery launch it with their part only.
//
// The grid's first thread blocks loop over the stores' vectors (enough to
// fill the device several times over, as a lone store kernel would); the
// rest prepare one row per warp. The prepared rows and the stored slots
// must not overlap anything the same launch reads: the prologue reads only
// its inputs and the format tables.
//
// All pointers are device pointers. The launcher returns cudaError_t; the
// backend turns it into an absl::Status.
#ifndef TQKV_KERNELS_CUDA_PROLOGUE_KERNELS_CUH_
#define TQKV_KERNELS_CUDA_PROLOGUE_KERNELS_CUH_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/cuda/attend_kernels.cuh"
#include "kernels/cuda/store_kernels.cuh"

namespace tqkv {
namespace cuda {

// Rotates raw queries into each row's key basis and multiplies by the logit
// scale: prepared[r] = scale * KeyState(queries[r]). head_of_row[r] is
// layer * num_kv_heads + kv_head of view.
struct PrepareParams {
  PoolView view;
  int64_t num_rows = 0;
  const int32_t* head_of_row = nullptr;
  const float* queries = nullptr;  // [num_rows][head_dim]
  float* prepared = nullptr;       // [num_rows][head_dim]
  float scale = 0.0f;
};

// The most stores and preparations one launch takes: a layout and its
// exact layout (the compressed and the exact pages) of each.
inline constexpr int kMaxPrologueStores = 2;
inline constexpr int kMaxProloguePreparations = 2;

// stores[0, num_stores) and preparations[0, num_preparations); empty ones
// (no vectors, no rows) are allowed. Each store reports its own failures
// to its own error word.
struct PrologueParams {
  StoreKernelParams stores[kMaxPrologueStores];
  int32_t num_stores = 0;
  PrepareParams preparations[kMaxProloguePreparations];
  int32_t num_preparations = 0;
};

// No launch when there is nothing to do. cudaErrorInvalidValue for counts
// beyond the maxima.
cudaError_t LaunchPrologue(const PrologueParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_PROLOGUE_KERNELS_CUH_
