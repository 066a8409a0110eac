// The device code of kernels/cuda/store_kernels.cuh: one warp's store of one
// vector (StoreVector), run by the prologue kernel (prologue_kernels_impl.cuh,
// which includes this). Written once for two compilers: nvcc and the host
// emulation of tests/gpu (kernels/cuda/emulation/), which runs the same
// source on CPU fibers. Device features come from device_compat.cuh only.
#ifndef TQKV_KERNELS_CUDA_STORE_KERNELS_IMPL_CUH_
#define TQKV_KERNELS_CUDA_STORE_KERNELS_IMPL_CUH_

#include "kernels/cuda/store_kernels.cuh"
#include "kernels/cuda/device_compat.cuh"

#include <cfloat>

#include "kernels/bitpack.h"
#include "kernels/blocked_sums.h"
#include "kernels/cuda/token_codes.cuh"
#include "kernels/cuda/warp_rotation.cuh"
#include "kernels/float_formats.h"

namespace tqkv {
namespace cuda {
namespace {

// One warp's scratch: the input vector, a part's working copy, the rotation's
// temporary, the quantization levels, and the field's codes token-major (at
// most 2 bytes a coordinate; words, so that they can be copied as words).
struct WarpScratch {
  float x[kMaxDeviceHeadDim];
  float y[kMaxDeviceHeadDim];
  float tmp[kMaxDeviceHeadDim];
  uint8_t levels[kMaxDeviceHeadDim];
  uint32_t codes[kMaxDeviceHeadDim / 2];
};

__device__ __forceinline__ bool WarpAll(bool value) { return __all_sync(kFullWarp, value) != 0; }

// FoldSumLanes (blocked_sums.h) of the partials in lanes 0-15, returned to
// every lane: at width w, lane j < w adds lane j + w = j ^ w.
template <typename T>
__device__ __forceinline__ T FoldWarpSumLanes(T partial) {
  for (int w = kSumLanes / 2; w > 0; w /= 2) partial = partial + __shfl_xor_sync(kFullWarp, partial, w);
  return __shfl_sync(kFullWarp, partial, 0);
}

// LSB-first packing (bitpack.h) of n levels: every lane builds whole bytes.
__device__ void WarpPack(const uint8_t* levels, int n, int bits, uint8_t* out, int lane) {
  const int bytes = PackedBytes(n, bits);
  for (int k = lane; k < bytes; k += 32) {
    uint32_t byte = 0;
    for (int bit = 0; bit < 8; ++bit) {
      const int stream_bit = 8 * k + bit;
      const int j = stream_bit / bits;
      if (j < n) byte |= ((static_cast<uint32_t>(levels[j]) >> (stream_bit - j * bits)) & 1u) << bit;
    }
    out[k] = static_cast<uint8_t>(byte);
  }
}

// TurboQuantQuantizer::EncodeWithSumOfSquares on s.y[0, part.dim) (already
// gathered). Returns the error, if any; writes codes and the fp16 scale.
__device__ StoreError EncodePart(const DevicePart& part, WarpScratch& s, uint8_t* codes, uint16_t* scale_out,
                                 int lane) {
  const int n = part.dim;
  // The squared norm in double in the blocked order of blocked_sums.h: lane j
  // < 16 holds partial j; products of floats are exact in double.
  double sum_sq = 0.0;
  if (lane < kSumLanes) {
    for (int i = lane; i < n; i += kSumLanes) {
      const double v = s.y[i];
      sum_sq = __dadd_rn(sum_sq, __dmul_rn(v, v));
    }
  }
  sum_sq = FoldWarpSumLanes(sum_sq);
  const double norm = __dsqrt_rn(sum_sq);
  const int code_bytes = PackedBytes(n, part.bits);
  if (norm == 0.0) {
    for (int k = lane; k < code_bytes; k += 32) codes[k] = 0;
    if (lane == 0) *scale_out = 0;
    return StoreError::kNone;
  }
  const float inv_norm = __double2float_rn(__ddiv_rn(1.0, norm));
  for (int i = lane; i < n; i += 32) s.y[i] = __fmul_rn(s.y[i], inv_norm);
  __syncwarp();
  WarpRotateForward(part.rotation, s.y, s.tmp, lane);
  const int num_boundaries = (1 << part.bits) - 1;
  for (int i = lane; i < n; i += 32) {
    const float v = s.y[i];
    uint32_t level = 0;
    for (int b = 0; b < num_boundaries; ++b) level += v > part.boundaries[b] ? 1u : 0u;
    s.levels[i] = static_cast<uint8_t>(level);
  }
  __syncwarp();
  double scale = norm;
  if (part.norm_correction) {
    // float sum in the blocked order, as the CPU.
    float codeword_sq = 0.0f;
    if (lane < kSumLanes) {
      for (int i = lane; i < n; i += kSumLanes) {
        const float c = part.centroids[s.levels[i]];
        codeword_sq = __fadd_rn(codeword_sq, __fmul_rn(c, c));
      }
    }
    codeword_sq = FoldWarpSumLanes(codeword_sq);
    scale = __ddiv_rn(scale, __dsqrt_rn(static_cast<double>(codeword_sq)));
  }
  if (!(scale <= static_cast<double>(kHalfMax))) return StoreError::kNormTooLarge;
  WarpPack(s.levels, n, part.bits, codes, lane);
  if (lane == 0) *scale_out = FloatToHalf(__double2float_rn(scale));
  return StoreError::kNone;
}

// Copies a token's codes, encoded token-major in `codes`, to their place in
// the page (token_codes.cuh): whole aligned words as words, the rest bytes.
__device__ void StoreTokenCodes(const uint32_t* codes, const TokenCodes<uint8_t>& to, int lane) {
  const int words = to.aligned ? to.whole / kTileWordBytes : 0;
  for (int k = lane; k < words; k += 32) {
    *reinterpret_cast<uint32_t*>(to.words + k * to.word_stride) = codes[k];
  }
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(codes);
  for (int b = kTileWordBytes * words + lane; b < to.code_bytes; b += 32) *CodeByte(to, b) = bytes[b];
}

// Encodes s.x[0, head_dim) into one field's codes, token-major, and scalars.
__device__ StoreError EncodeField(const DeviceField& f, int head_dim, WarpScratch& s, uint8_t* codes, uint16_t* scalars,
                                  int lane) {
  bool finite = true;
  float lo = FLT_MAX, hi = -FLT_MAX, magnitude = 0.0f;
  for (int i = lane; i < head_dim; i += 32) {
    const float v = s.x[i];
    finite = finite && isfinite(v);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
    magnitude = fmaxf(magnitude, fabsf(v));
  }
  if (!WarpAll(finite)) return StoreError::kNotFinite;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(kFullWarp, lo, offset));
    hi = fmaxf(hi, __shfl_xor_sync(kFullWarp, hi, offset));
    magnitude = fmaxf(magnitude, __shfl_xor_sync(kFullWarp, magnitude, offset));
  }
  switch (f.format) {
    case DeviceFieldFormat::kFp16: {
      // Values in [65504, 65520) still round to the largest half.
      if (magnitude > 65519.0f) return StoreError::kOutOfRange;
      uint16_t* out = reinterpret_cast<uint16_t*>(codes);
      for (int i = lane; i < head_dim; i += 32) out[i] = FloatToHalf(s.x[i]);
      return StoreError::kNone;
    }
    case DeviceFieldFormat::kBf16: {
      uint16_t* out = reinterpret_cast<uint16_t*>(codes);
      for (int i = lane; i < head_dim; i += 32) out[i] = FloatToBf16(s.x[i]);
      return StoreError::kNone;
    }
    case DeviceFieldFormat::kFp8:
      for (int i = lane; i < head_dim; i += 32) codes[i] = FloatToFp8E4m3(s.x[i]);
      return StoreError::kNone;
    case DeviceFieldFormat::kUniform: {
      if (magnitude > kHalfMax) return StoreError::kOutOfRange;
      const int max_code = (1 << f.bits) - 1;
      const uint16_t zero_h = FloatToHalf(lo);
      const uint16_t scale_h = FloatToHalf(__fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(max_code)));
      const float zero = HalfToFloat(zero_h);
      const float scale = HalfToFloat(scale_h);
      const float inv_scale = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
      for (int i = lane; i < head_dim; i += 32) {
        const float level = floorf(__fadd_rn(__fmul_rn(__fsub_rn(s.x[i], zero), inv_scale), 0.5f));
        s.levels[i] = static_cast<uint8_t>(fminf(fmaxf(level, 0.0f), static_cast<float>(max_code)));
      }
      __syncwarp();
      WarpPack(s.levels, head_dim, f.bits, codes, lane);
      if (lane == 0) {
        scalars[0] = scale_h;
        scalars[1] = zero_h;
      }
      return StoreError::kNone;
    }
    case DeviceFieldFormat::kTurboQuant:
      for (int p = 0; p < f.num_parts; ++p) {
        const DevicePart& part = f.parts[p];
        for (int i = lane; i < part.dim; i += 32) {
          s.y[i] = s.x[part.channels != nullptr ? part.channels[i] : i];
        }
        __syncwarp();
        const StoreError error = EncodePart(part, s, codes + part.code_offset, scalars + part.scalar_index, lane);
        if (error != StoreError::kNone) return error;
        __syncwarp();
      }
      return StoreError::kNone;
  }
  return StoreError::kNone;
}

// Vectors (layer, token, KV head) of store p.
__host__ __device__ __forceinline__ int64_t StoreVectors(const StoreKernelParams& p) {
  return static_cast<int64_t>(p.num_layers) * p.num_tokens * p.num_kv_heads;
}

// Stores vector v < StoreVectors(p), key then value, by one warp with s as
// its scratch; a failure goes to p.error.
__device__ void StoreVector(const StoreKernelParams& p, int64_t v, WarpScratch& s, int lane) {
  const int head = static_cast<int>(v % p.num_kv_heads);
  const int64_t token = (v / p.num_kv_heads) % p.num_tokens;
  const int layer = p.layer_begin + static_cast<int>(v / (static_cast<int64_t>(p.num_kv_heads) * p.num_tokens));
  const DeviceHead& h = p.heads[layer * p.num_kv_heads + head];
  const int32_t slot_index = p.slots[token];
  uint8_t* page = p.pool + static_cast<uint64_t>(slot_index / p.page_tokens) * p.page_bytes;
  const int slot = slot_index % p.page_tokens;
  const int64_t row = v * p.head_dim;
  StoreError error = StoreError::kNone;
  for (int field = 0; field < 2 && error == StoreError::kNone; ++field) {
    const DeviceField& f = field == 0 ? h.key : h.value;
    const float* src = (field == 0 ? p.keys : p.values) + row;
    for (int i = lane; i < p.head_dim; i += 32) s.x[i] = src[i];
    __syncwarp();
    uint16_t* scalars =
        reinterpret_cast<uint16_t*>(page + f.scalars_offset) + static_cast<int64_t>(slot) * f.num_scalars;
    // Encoded in the warp's scratch, then copied to the plane's layout
    // (tiled or token-major) in one place. error is the same in every lane.
    error = EncodeField(f, p.head_dim, s, reinterpret_cast<uint8_t*>(s.codes), scalars, lane);
    __syncwarp();
    if (error == StoreError::kNone) StoreTokenCodes(s.codes, FieldTokenCodes(f, page, p.page_tokens, slot), lane);
  }
  if (error != StoreError::kNone && lane == 0) {
    atomicMin(p.error, static_cast<unsigned long long>(v) * 4ull + static_cast<unsigned long long>(error));
  }
}

}  // namespace
}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_STORE_KERNELS_IMPL_CUH_
