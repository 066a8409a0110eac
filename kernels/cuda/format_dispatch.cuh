// The CUDA backend's one dispatch from runtime formats to kernel template
// arguments, over the shared format table (kernels/format_table.h), in
// FlashInfer's DISPATCH_* style:
//
//   return TQKV_CUDA_DISPATCH_FORMAT_PAIR(pair, kKey, kValue, kTensorCores, {
//     return LaunchAttendRows<kKey, kValue>(block_rows, params, stream);
//   });
//
// runs the braced statements with kKey and kValue (DeviceFieldFormat) and
// kTensorCores (the table's column) as constexpr for the pair; a value that
// is no table entry, or a pair without kFusedCuda in its fused_on column (not
// instantiated), gives cudaErrorInvalidValue. TQKV_CUDA_DISPATCH_KEY_FORMAT
// does the same for a key family (families that cannot hold keys give
// cudaErrorInvalidValue). Every kFusedCuda entry is instantiated: a new pair is
// compiled into every launcher that dispatches through these, and fails to
// compile where a kernel cannot read its families.
//
// Host code only (the launchers); nvcc and the host emulation both compile it.
#ifndef TQKV_KERNELS_CUDA_FORMAT_DISPATCH_CUH_
#define TQKV_KERNELS_CUDA_FORMAT_DISPATCH_CUH_

#include <cuda_runtime_api.h>

#include "kernels/cuda/device_format.h"
#include "kernels/format_table.h"

#define TQKV_CUDA_DISPATCH_FORMAT_PAIR(pair, KEY, VALUE, TENSOR_CORES, ...)                                \
  ::tqkv::VisitFormatPair((pair), cudaErrorInvalidValue, [&](auto tqkv_pair_tag_) -> cudaError_t {         \
    if constexpr ((decltype(tqkv_pair_tag_)::kFusedOn & ::tqkv::kFusedCuda) == 0) {                        \
      return cudaErrorInvalidValue;                                                                        \
    } else {                                                                                               \
      [[maybe_unused]] constexpr ::tqkv::cuda::DeviceFieldFormat KEY = decltype(tqkv_pair_tag_)::kKey;     \
      [[maybe_unused]] constexpr ::tqkv::cuda::DeviceFieldFormat VALUE = decltype(tqkv_pair_tag_)::kValue; \
      [[maybe_unused]] constexpr bool TENSOR_CORES = decltype(tqkv_pair_tag_)::kTensorCores;               \
      __VA_ARGS__                                                                                          \
    }                                                                                                      \
  })

#define TQKV_CUDA_DISPATCH_KEY_FORMAT(format, KEY, ...)                                                   \
  ::tqkv::VisitKeyFamily((format), cudaErrorInvalidValue, [&](auto tqkv_family_tag_) -> cudaError_t {     \
    [[maybe_unused]] constexpr ::tqkv::cuda::DeviceFieldFormat KEY = decltype(tqkv_family_tag_)::kFormat; \
    __VA_ARGS__                                                                                           \
  })

#endif  // TQKV_KERNELS_CUDA_FORMAT_DISPATCH_CUH_
