// The CUDA store: quantizes and packs K/V vectors into their page slots,
// writing the bytes the CPU codecs write (codec.cc) for the same input. The
// prologue kernel (prologue_kernels.cuh) runs it, beside the query
// preparation of a decode.
//
// One warp per (layer, token, KV head): the key and then the value vector are
// read into the warp's shared memory, checked (finite; within fp16 range where
// the format needs it), then encoded by the field's format:
//   fp16 / bf16 / fp8   per-coordinate conversion (float_formats.h);
//   uniform             min / max, fp16 scale and zero, levels, bit packing;
//   TurboQuant parts    gather, sum of squares in float64 in the blocked order
//                       (blocked_sums.h),
//                       normalise, randomized Hadamard (warp butterflies) or
//                       dense rotation, midpoint search, norm correction,
//                       bit packing (bitpack.h), fp16 scale.
// The codes are encoded token-major in the warp's shared memory, then copied
// into the codes plane as its layout says (tiled for packed codecs,
// token-major for raw numbers: kernels/code_tiles.h, token_codes.cuh).
// Failures go to a device word as (vector index * 4 + StoreError); the
// smallest wins, so the report names the first failing vector like the CPU.
//
// All pointers are device pointers.
#ifndef TQKV_KERNELS_CUDA_STORE_KERNELS_CUH_
#define TQKV_KERNELS_CUDA_STORE_KERNELS_CUH_

#include <cstdint>

#include "kernels/cuda/device_format.h"

namespace tqkv {
namespace cuda {

// One store: tokens of one layout (the cache's or its exact layout).
struct StoreKernelParams {
  const DeviceHead* heads = nullptr;  // [num_layers * num_kv_heads] of the layout
  uint8_t* pool = nullptr;
  uint64_t page_bytes = 0;
  int32_t page_tokens = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t layer_begin = 0;
  int32_t num_layers = 0;  // layers in this call
  int32_t num_tokens = 0;
  const int32_t* slots = nullptr;       // [num_tokens]: page * page_tokens + slot
  const float* keys = nullptr;          // [num_layers, num_tokens, num_kv_heads, head_dim]
  const float* values = nullptr;        // same shape
  unsigned long long* error = nullptr;  // ~0ull when nothing failed
};

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_STORE_KERNELS_CUH_
