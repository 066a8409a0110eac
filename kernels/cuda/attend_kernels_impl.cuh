// Kernel bodies and launchers of kernels/cuda/attend_kernels.cuh, written once for two compilers:
// nvcc (the .cu file of the same name includes this) and the host emulation
// of tests/gpu (kernels/cuda/emulation/), which runs the same source on CPU
// fibers. Device features come from device_compat.cuh only.
#ifndef TQKV_KERNELS_CUDA_ATTEND_KERNELS_IMPL_CUH_
#define TQKV_KERNELS_CUDA_ATTEND_KERNELS_IMPL_CUH_

#include "kernels/cuda/attend_kernels.cuh"
#include "kernels/cuda/device_compat.cuh"
#include "kernels/cuda/format_dispatch.cuh"

#include <cfloat>

#include "kernels/cuda/token_codes.cuh"
#include "kernels/cuda/warp_rotation.cuh"
#include "kernels/float_formats.h"

namespace tqkv {
namespace cuda {
namespace {

constexpr int kWarps = kAttendThreads / 32;
constexpr int kCentroidTable = 256;  // up to 8-bit codebooks

struct TokenAddress {
  const uint8_t* page;
  int slot;
};

__device__ __forceinline__ TokenAddress Locate(const PoolView& v, const int32_t* block_table, int t) {
  int page_index, slot;
  if (v.page_shift >= 0) {
    page_index = t >> v.page_shift;
    slot = t & (v.page_tokens - 1);
  } else {
    page_index = t / v.page_tokens;
    slot = t - page_index * v.page_tokens;
  }
  return {v.pool + static_cast<uint64_t>(block_table[page_index]) * v.page_bytes, slot};
}

__device__ __forceinline__ float Bf16BitsToFloat(uint32_t bits) { return __uint_as_float(bits << 16); }

// ---------------------------------------------------------------------------
// Keys: a token's key is read by L lanes (L a power of two), each taking one
// group of up to 32 coordinates of one part; their partial dot products are
// summed with shuffles.

__host__ __device__ __forceinline__ int CeilDiv(int a, int b) { return (a + b - 1) / b; }

__host__ __device__ __forceinline__ int KeyGroups(const DeviceField& f, int head_dim) {
  if (f.format != DeviceFieldFormat::kTurboQuant) return CeilDiv(head_dim, 32);
  int groups = 0;
  for (int p = 0; p < f.num_parts; ++p) groups += CeilDiv(f.parts[p].dim, 32);
  return groups;
}

__host__ __device__ __forceinline__ int LanesPerToken(int groups) {
  int lanes = 1;
  while (lanes < groups) lanes *= 2;
  return lanes;
}

template <int kBits>
__device__ __forceinline__ uint32_t CodeAt(const uint32_t (&w)[kBits], int j) {
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const int bit = j * kBits;
  const int k = bit >> 5;
  const int shift = bit & 31;
  if (shift + kBits <= 32) return (w[k] >> shift) & kMask;
  return __funnelshift_r(w[k], w[k + 1], shift) & kMask;
}

// dot[r] += sum_j q[r][j] * centroids[code_j] over `count` (a multiple of 4,
// <= 32) coordinates whose kBits-bit codes start at byte `first` of the
// token's codes.
template <int kBits, int kRows>
__device__ __forceinline__ void DotCentroids(const TokenCodes<const uint8_t>& codes, int first, int count,
                                             const float* centroids, const float* q, int q_stride,
                                             float (&dot)[kRows]) {
  uint32_t w[kBits];
  LoadCodeRun<kBits>(codes, first, (count * kBits + 7) / 8, w);
#pragma unroll
  for (int j0 = 0; j0 < 32; j0 += 4) {
    if (j0 < count) {
      const float c0 = centroids[CodeAt<kBits>(w, j0)];
      const float c1 = centroids[CodeAt<kBits>(w, j0 + 1)];
      const float c2 = centroids[CodeAt<kBits>(w, j0 + 2)];
      const float c3 = centroids[CodeAt<kBits>(w, j0 + 3)];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float4 qv = *reinterpret_cast<const float4*>(q + r * q_stride + j0);
        dot[r] = fmaf(qv.x, c0, dot[r]);
        dot[r] = fmaf(qv.y, c1, dot[r]);
        dot[r] = fmaf(qv.z, c2, dot[r]);
        dot[r] = fmaf(qv.w, c3, dot[r]);
      }
    }
  }
}

// Any code width: one code at a time from the bit stream of the part whose
// codes start at byte part_offset.
template <int kRows>
__device__ __forceinline__ void DotCentroidsGeneric(const TokenCodes<const uint8_t>& codes, int part_offset,
                                                    int first, int bits, int count, const float* centroids,
                                                    const float* q, int q_stride, float (&dot)[kRows]) {
  for (int j = 0; j < count; ++j) {
    const float c = centroids[PackedCodeIn(codes, part_offset, first + j, bits)];
#pragma unroll
    for (int r = 0; r < kRows; ++r) dot[r] = fmaf(q[r * q_stride + j], c, dot[r]);
  }
}

// dot[r] += sum over 8 raw coordinates v[0..8).
template <int kRows>
__device__ __forceinline__ void Dot8(const float (&v)[8], const float* q, int q_stride,
                                     float (&dot)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float4 a = *reinterpret_cast<const float4*>(q + r * q_stride);
    const float4 b = *reinterpret_cast<const float4*>(q + r * q_stride + 4);
    dot[r] = fmaf(a.x, v[0], dot[r]);
    dot[r] = fmaf(a.y, v[1], dot[r]);
    dot[r] = fmaf(a.z, v[2], dot[r]);
    dot[r] = fmaf(a.w, v[3], dot[r]);
    dot[r] = fmaf(b.x, v[4], dot[r]);
    dot[r] = fmaf(b.y, v[5], dot[r]);
    dot[r] = fmaf(b.z, v[6], dot[r]);
    dot[r] = fmaf(b.w, v[7], dot[r]);
  }
}

// Eight raw coordinates of a 16-bit or fp8 field.
template <DeviceFieldFormat kFormat>
__device__ __forceinline__ void LoadRaw8(const uint8_t* codes, const float* fp8_table, float (&v)[8]) {
  static_assert(kFormat == DeviceFieldFormat::kFp16 || kFormat == DeviceFieldFormat::kBf16 ||
                    kFormat == DeviceFieldFormat::kFp8,
                "a format family without a reader here (kernels/format_table.h)");
  if constexpr (kFormat == DeviceFieldFormat::kFp8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(codes);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = fp8_table[(raw.x >> (8 * k)) & 0xffu];
      v[k + 4] = fp8_table[(raw.y >> (8 * k)) & 0xffu];
    }
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(codes);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (kFormat == DeviceFieldFormat::kBf16) {
        v[2 * k] = Bf16BitsToFloat(words[k] & 0xffffu);
        v[2 * k + 1] = Bf16BitsToFloat(words[k] >> 16);
      } else {
        v[2 * k] = HalfBitsToFloat(words[k] & 0xffffu);
        v[2 * k + 1] = HalfBitsToFloat(words[k] >> 16);
      }
    }
  }
}

// The shared tables a block reads codes through.
struct BlockTables {
  float key_centroids[kMaxDeviceParts][kCentroidTable];
  float value_centroids[kCentroidTable];
  float fp8[256];
};

__device__ void LoadTables(const DeviceHead& head, BlockTables& t) {
  for (int i = threadIdx.x; i < 256; i += blockDim.x) t.fp8[i] = Fp8E4m3ToFloat(static_cast<uint8_t>(i));
  if (head.key.format == DeviceFieldFormat::kTurboQuant) {
    for (int p = 0; p < head.key.num_parts; ++p) {
      const int levels = 1 << head.key.parts[p].bits;
      for (int i = threadIdx.x; i < levels; i += blockDim.x) {
        t.key_centroids[p][i] = head.key.parts[p].centroids[i];
      }
    }
  }
  if (head.value.format == DeviceFieldFormat::kTurboQuant) {
    const int levels = 1 << head.value.parts[0].bits;
    for (int i = threadIdx.x; i < levels; i += blockDim.x) {
      t.value_centroids[i] = head.value.parts[0].centroids[i];
    }
  }
}

// This lane's share of one token's logits: dot[r] += <q_r, key> over group g.
template <DeviceFieldFormat kKey, int kRows>
__device__ __forceinline__ void KeyGroupDot(const DeviceField& key, int head_dim, int page_tokens,
                                            const BlockTables& t, const uint8_t* page, int slot, int g,
                                            const float* s_q, int q_stride, float (&dot)[kRows]) {
  if constexpr (kKey == DeviceFieldFormat::kTurboQuant) {
    const TokenCodes<const uint8_t> codes = FieldTokenCodes(key, page, page_tokens, slot);
    const int groups0 = CeilDiv(key.parts[0].dim, 32);
    const int p = g < groups0 ? 0 : 1;
    const int gg = g < groups0 ? g : g - groups0;
    const DevicePart& part = key.parts[p];
    const int base = gg * 32;
    const int count = min(32, part.dim - base);
    const float* q = s_q + part.state_offset + base;
    float part_dot[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) part_dot[r] = 0.0f;
    const float* centroids = t.key_centroids[p];
    switch (part.bits) {
      case 2:
        DotCentroids<2, kRows>(codes, part.code_offset + base / 4, count, centroids, q, q_stride, part_dot);
        break;
      case 3:
        DotCentroids<3, kRows>(codes, part.code_offset + base * 3 / 8, count, centroids, q, q_stride, part_dot);
        break;
      case 4:
        DotCentroids<4, kRows>(codes, part.code_offset + base / 2, count, centroids, q, q_stride, part_dot);
        break;
      default:
        DotCentroidsGeneric<kRows>(codes, part.code_offset, base, part.bits, count, centroids, q, q_stride,
                                   part_dot);
    }
    const uint16_t* scalars = reinterpret_cast<const uint16_t*>(page + key.scalars_offset) +
                              static_cast<int64_t>(slot) * key.num_scalars;
    const float scale = HalfBitsToFloat(scalars[part.scalar_index]);
#pragma unroll
    for (int r = 0; r < kRows; ++r) dot[r] = fmaf(scale, part_dot[r], dot[r]);
  } else {
    // Raw planes are token-major (DescribeField refuses others).
    const uint8_t* codes = page + key.codes_offset + static_cast<uint64_t>(slot) * key.code_bytes;
    const int base = g * 32;
    const int count = min(32, head_dim - base);
    constexpr int kBytes = kKey == DeviceFieldFormat::kFp8 ? 1 : 2;
#pragma unroll
    for (int c8 = 0; c8 < 4; ++c8) {
      if (c8 * 8 < count) {
        float v[8];
        LoadRaw8<kKey>(codes + (base + c8 * 8) * kBytes, t.fp8, v);
        Dot8<kRows>(v, s_q + base + c8 * 8, q_stride, dot);
      }
    }
  }
}

// Logits of tokens [tile_begin, tile_begin + count) for the block's rows into
// s_logit[r * kAttendTile + k]; -inf for masked tokens (t >= visible[r]) and
// past `count`.
template <DeviceFieldFormat kKey, int kRows>
__device__ void ScoreTile(const PoolView& view, const DeviceField& key, const BlockTables& t,
                          const int32_t* block_table, int tile_begin, int count, const int* visible,
                          const float* s_q, int q_stride, float* s_logit) {
  const int groups = KeyGroups(key, view.head_dim);
  const int lanes = LanesPerToken(groups);
  const int tokens_per_step = kAttendThreads / lanes;
  const int slot_in_step = threadIdx.x / lanes;
  const int g = threadIdx.x % lanes;
  for (int step = 0; step * tokens_per_step < kAttendTile; ++step) {
    const int k = step * tokens_per_step + slot_in_step;
    float dot[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) dot[r] = 0.0f;
    if (k < count && g < groups) {
      const TokenAddress at = Locate(view, block_table, tile_begin + k);
      KeyGroupDot<kKey, kRows>(key, view.head_dim, view.page_tokens, t, at.page, at.slot, g, s_q, q_stride, dot);
    }
    for (int offset = lanes / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) dot[r] += __shfl_xor_sync(kFullWarp, dot[r], offset);
    }
    if (g == 0 && k < kAttendTile) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        s_logit[r * kAttendTile + k] = (k < count && tile_begin + k < visible[r]) ? dot[r] : -INFINITY;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// The pre-RoPE add-back (AddBackDesc). Angles reach t * theta ~ 1e6 rad, far
// beyond float's reach: the angle is formed and reduced mod 2 pi in double
// (error ~1e-10 rad at t = 1e6), then cos and sin are taken in float of the
// reduced angle (|angle| <= pi).

__device__ __forceinline__ void RopeCosSin(int64_t t, double theta, float* c, float* s) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  const double angle = static_cast<double>(t) * theta;
  const float reduced = static_cast<float>(fma(-rint(angle * (1.0 / kTwoPi)), kTwoPi, angle));
  *c = cosf(reduced);
  *s = sinf(reduced);
}

// s_logit[r * kAttendTile + k] += the add-back of block row row0 + r at token
// tile_begin + k, for rows < rows, k < count and unmasked (finite) logits.
// One thread per token; the caller synchronises before and after.
template <int kRows>
__device__ void AddBackTile(const AddBackTables& ab, const AddBackDesc& desc, int row0, int rows,
                            int tile_begin, int count, float* s_logit) {
  const double* theta = ab.theta + desc.theta;
  const float* coef = ab.coef + desc.coef + static_cast<int64_t>(row0) * 2 * desc.pairs;
  for (int k = threadIdx.x; k < count; k += blockDim.x) {
    float sum[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) sum[r] = 0.0f;
    for (int i = 0; i < desc.pairs; ++i) {
      float c, s;
      RopeCosSin(tile_begin + k, theta[i], &c, &s);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < rows) {
          const float* a = coef + r * 2 * desc.pairs;
          sum[r] = fmaf(a[i], c, fmaf(a[desc.pairs + i], s, sum[r]));
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float& logit = s_logit[r * kAttendTile + k];
      if (r < rows && logit != -INFINITY) logit += sum[r];
    }
  }
}

// ---------------------------------------------------------------------------
// Values: each lane owns 8 consecutive coordinates of every row and a share
// of the tile's tokens.

// Eight codes (kBits each) of chunk `chunk` of a packed field, as floats:
// codebook centroids (kCentroids) or the code values themselves. The chunk's
// kBits bytes come from the one or two words they fall in.
template <int kBits, bool kCentroids>
__device__ __forceinline__ void DecodeChunk(const TokenCodes<const uint8_t>& codes, int chunk,
                                            const float* centroids, float (&v)[8]) {
  const uint64_t w = LoadCodeBytes<kBits>(codes, chunk * kBits);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t code = static_cast<uint32_t>(w >> (k * kBits)) & ((1u << kBits) - 1u);
    v[k] = kCentroids ? centroids[code] : static_cast<float>(code);
  }
}

template <bool kCentroids>
__device__ __forceinline__ void DecodeChunkAnyBits(const TokenCodes<const uint8_t>& codes, int chunk, int bits,
                                                   const float* centroids, float (&v)[8]) {
  switch (bits) {
    case 2:
      return DecodeChunk<2, kCentroids>(codes, chunk, centroids, v);
    case 3:
      return DecodeChunk<3, kCentroids>(codes, chunk, centroids, v);
    case 4:
      return DecodeChunk<4, kCentroids>(codes, chunk, centroids, v);
    case 8:
      return DecodeChunk<8, kCentroids>(codes, chunk, centroids, v);
    default:
      for (int k = 0; k < 8; ++k) {
        const uint32_t code = PackedCodeIn(codes, 0, chunk * 8 + k, bits);
        v[k] = kCentroids ? centroids[code] : static_cast<float>(code);
      }
  }
}

// acc[r][k] += p[r][token] * value[token][chunk * 8 + k] (uniform: the zero
// point's share goes to zero_acc[r], added to every coordinate at the end).
template <DeviceFieldFormat kValue, int kRows>
__device__ __forceinline__ void AccumulateToken(const DeviceField& value, int page_tokens, const BlockTables& t,
                                                const uint8_t* page, int slot, int chunk,
                                                const float* s_p, int k, float (&acc)[kRows][8],
                                                float (&zero_acc)[kRows]) {
  float p[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) p[r] = s_p[r * kAttendTile + k];
  float v[8];
  if constexpr (kValue == DeviceFieldFormat::kUniform || kValue == DeviceFieldFormat::kTurboQuant) {
    constexpr bool kCentroids = kValue == DeviceFieldFormat::kTurboQuant;
    DecodeChunkAnyBits<kCentroids>(FieldTokenCodes(value, page, page_tokens, slot), chunk, value.bits,
                                   t.value_centroids, v);
    const uint16_t* scalars = reinterpret_cast<const uint16_t*>(page + value.scalars_offset) +
                              static_cast<int64_t>(slot) * value.num_scalars;
    const float scale = HalfBitsToFloat(scalars[0]);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float ps = p[r] * scale;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(ps, v[e], acc[r][e]);
    }
    if constexpr (kValue == DeviceFieldFormat::kUniform) {
      const float zero = HalfBitsToFloat(scalars[1]);
#pragma unroll
      for (int r = 0; r < kRows; ++r) zero_acc[r] = fmaf(p[r], zero, zero_acc[r]);
    }
  } else {
    // Raw planes are token-major (DescribeField refuses others).
    const uint8_t* codes = page + value.codes_offset + static_cast<uint64_t>(slot) * value.code_bytes;
    constexpr int kBytes = kValue == DeviceFieldFormat::kFp8 ? 1 : 2;
    LoadRaw8<kValue>(codes + chunk * 8 * kBytes, t.fp8, v);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(p[r], v[e], acc[r][e]);
    }
  }
}

// ---------------------------------------------------------------------------
// The fused decode kernel.

// Dynamic shared memory: queries [kRows][head_dim] (+32 floats of zeros past
// the end), logits / probabilities [kRows][kAttendTile], output [kRows][head_dim].
__host__ __device__ constexpr size_t AttendSharedBytes(int rows, int head_dim) {
  return sizeof(float) * (static_cast<size_t>(rows) * head_dim * 2 + 32 +
                          static_cast<size_t>(rows) * kAttendTile);
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, int kRows>
__global__ void __launch_bounds__(kAttendThreads) AttendKernel(AttendKernelParams p) {
  static_assert(FamilyInfo(kKey).reads_keys, "a key family the table says holds no keys");
  float* shared = DynamicSharedFloats();
  __shared__ BlockTables tables;
  __shared__ int visible[kRows];
  __shared__ float row_max[kRows], row_sum[kRows], row_alpha[kRows];

  const PoolView& view = p.view;
  const int d = view.head_dim;
  const AttendBlock b = p.blocks[blockIdx.x];
  const AttendItemDesc item = p.items[b.item];
  const DeviceHead& head = view.heads[item.layer * view.num_kv_heads + b.kv_head];
  const int group = view.num_query_heads / view.num_kv_heads;
  const int32_t* block_table = p.block_tables + (p.exact ? item.exact_block_table : item.block_table);
  const AddBackDesc addback =
      p.addback.heads != nullptr ? p.addback.heads[b.item * view.num_kv_heads + b.kv_head] : AddBackDesc();

  float* s_q = shared;
  float* s_logit = s_q + kRows * d + 32;
  float* s_out = s_logit + kRows * kAttendTile;

  LoadTables(head, tables);
  for (int i = threadIdx.x; i < kRows * d + 32; i += kAttendThreads) {
    const int r = i / d;
    float q = 0.0f;
    if (r < b.rows) {
      const int row = b.row0 + r;
      const int token = row / group;
      const int h = b.kv_head * group + row % group;
      q = p.prepared[(item.query_row + static_cast<int64_t>(token) * view.num_query_heads + h) * d + i % d];
    }
    s_q[i] = q;
  }
  for (int i = threadIdx.x; i < kRows * d; i += kAttendThreads) s_out[i] = 0.0f;
  if (threadIdx.x < kRows) {
    const int r = threadIdx.x;
    const int token = (b.row0 + r) / group;
    // Rows past b.rows see nothing; they only pad the instance's row count.
    visible[r] = r < b.rows ? item.context_tokens - item.num_query_tokens + 1 + token : 0;
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
  }
  __syncthreads();

  const int chunks = d / 8;
  const int value_slots = kAttendThreads / chunks;
  const int value_slot = threadIdx.x / chunks;
  const int chunk = threadIdx.x % chunks;
  float acc[kRows][8];
  float zero_acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    zero_acc[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.0f;
  }

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int tile = b.token_begin; tile < b.token_end; tile += kAttendTile) {
    const int count = min(kAttendTile, b.token_end - tile);
    ScoreTile<kKey, kRows>(view, head.key, tables, block_table, tile, count, visible, s_q, d, s_logit);
    __syncthreads();
    if (addback.pairs > 0) {  // the same for the whole block
      AddBackTile<kRows>(p.addback, addback, b.row0, b.rows, tile, count, s_logit);
      __syncthreads();
    }
    // Online softmax, one warp per row: the tile's max, its probabilities
    // relative to the new running max, and the factor for what came before.
    for (int r = warp; r < kRows; r += kWarps) {
      float* logit = s_logit + r * kAttendTile;
      float tile_max = -INFINITY;
      for (int k = lane; k < kAttendTile; k += 32) tile_max = fmaxf(tile_max, logit[k]);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullWarp, tile_max, offset));
      }
      const float old_max = row_max[r];
      const float new_max = fmaxf(old_max, tile_max);
      float sum = 0.0f;
      for (int k = lane; k < kAttendTile; k += 32) {
        const float x = logit[k];
        const float e = x == -INFINITY ? 0.0f : expf(x - new_max);
        logit[k] = e;
        sum += e;
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFullWarp, sum, offset);
      __syncwarp();
      if (lane == 0) {
        const float alpha = old_max == -INFINITY ? 0.0f : expf(old_max - new_max);
        row_alpha[r] = alpha;
        row_sum[r] = row_sum[r] * alpha + sum;
        row_max[r] = new_max;
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float alpha = row_alpha[r];
      zero_acc[r] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
    }
    if (value_slot < value_slots) {
      for (int k = value_slot; k < count; k += value_slots) {
        const TokenAddress at = Locate(view, block_table, tile + k);
        AccumulateToken<kValue, kRows>(head.value, view.page_tokens, tables, at.page, at.slot, chunk, s_logit, k,
                                       acc, zero_acc);
      }
    }
    __syncthreads();
  }

  // Sum the token slots' accumulators in a fixed order.
  for (int s = 0; s < value_slots; ++s) {
    if (value_slot == s) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int e = 0; e < 8; ++e) s_out[r * d + chunk * 8 + e] += acc[r][e] + zero_acc[r];
      }
    }
    __syncthreads();
  }
  float* stats = p.partial_stats + static_cast<int64_t>(b.partial) * kMaxBlockRows * 2;
  float* out = p.partial_acc + static_cast<int64_t>(b.partial) * kMaxBlockRows * d;
  for (int i = threadIdx.x; i < b.rows * d; i += kAttendThreads) out[i] = s_out[i];
  const int r = static_cast<int>(threadIdx.x);
  if (r < b.rows) {
    stats[2 * r] = row_max[r];
    stats[2 * r + 1] = row_sum[r];
  }
}

// ---------------------------------------------------------------------------
// Merge: one warp per (unit, row).

struct MergeScratch {
  float x[kMaxDeviceHeadDim];
  float y[kMaxDeviceHeadDim];
  float tmp[kMaxDeviceHeadDim];
  float out[kMaxDeviceHeadDim];
};

// x[j] = inv_total * sum over partials [first, first + count) of row r of
// acc[j] * exp(max - global_max), j lane-strided.
__device__ void SumPartials(const MergeParams& p, int64_t first, int count, int r, int d, float global_max,
                            float inv_total, int lane, float* x) {
  for (int j = lane; j < d; j += 32) {
    float sum = 0.0f;
    for (int k = 0; k < count; ++k) {
      const int64_t partial = first + k;
      const float m = p.partial_stats[(partial * kMaxBlockRows + r) * 2];
      if (m == -INFINITY) continue;
      sum += p.partial_acc[(partial * kMaxBlockRows + r) * d + j] * expf(m - global_max);
    }
    x[j] = sum * inv_total;
  }
}

__global__ void __launch_bounds__(kAttendThreads) MergeKernel(MergeParams p) {
  __shared__ MergeScratch scratch[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t global_warp = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t u = global_warp / kMaxBlockRows;
  const int r = static_cast<int>(global_warp % kMaxBlockRows);
  if (u >= p.num_units) return;
  const MergeUnit unit = p.units[u];
  if (r >= unit.rows) return;
  const PoolView& view = p.view;
  const int d = view.head_dim;
  const AttendItemDesc item = p.items[unit.item];
  const int group = view.num_query_heads / view.num_kv_heads;
  const int row = unit.row0 + r;
  const int token = row / group;
  const int h = unit.kv_head * group + row % group;
  const int64_t out_row = item.query_row + static_cast<int64_t>(token) * view.num_query_heads + h;
  MergeScratch& s = scratch[warp];

  float global_max = -INFINITY;
  for (int k = 0; k < unit.num_splits; ++k) {
    global_max = fmaxf(global_max, p.partial_stats[(static_cast<int64_t>(unit.first_partial + k) * kMaxBlockRows + r) * 2]);
  }
  float total = 0.0f;
  for (int k = 0; k < unit.num_splits; ++k) {
    const float* stats = p.partial_stats + (static_cast<int64_t>(unit.first_partial + k) * kMaxBlockRows + r) * 2;
    if (stats[0] != -INFINITY) total += stats[1] * expf(stats[0] - global_max);
  }
  const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  for (int j = lane; j < d; j += 32) s.out[j] = 0.0f;
  // The compressed splits of a rotated value codec: summed in its basis,
  // mapped back; every other split is in plain coordinates already.
  const DeviceField& value = view.heads[item.layer * view.num_kv_heads + unit.kv_head].value;
  const bool rotated = value.format == DeviceFieldFormat::kTurboQuant;
  const int basis = rotated ? unit.basis_splits : 0;
  __syncwarp();
  if (basis > 0) {
    SumPartials(p, unit.first_partial, basis, r, d, global_max, inv_total, lane, s.x);
    __syncwarp();
    for (int part_index = 0; part_index < value.num_parts; ++part_index) {
      const DevicePart& part = value.parts[part_index];
      for (int k = lane; k < part.dim; k += 32) s.y[k] = s.x[part.state_offset + k];
      __syncwarp();
      WarpRotateInverse(part.rotation, s.y, s.tmp, lane);
      for (int k = lane; k < part.dim; k += 32) s.out[part.channels != nullptr ? part.channels[k] : k] = s.y[k];
      __syncwarp();
    }
  }
  SumPartials(p, unit.first_partial + basis, unit.num_splits - basis, r, d, global_max, inv_total, lane, s.x);
  float* out = p.output + out_row * d;
  for (int j = lane; j < d; j += 32) out[j] = s.out[j] + s.x[j];
  if (lane == 0 && p.lse != nullptr) {
    const float constant = p.lse_constant != nullptr ? p.lse_constant[out_row] : 0.0f;
    p.lse[out_row] = total > 0.0f ? global_max + logf(total) + constant : -INFINITY;
  }
}

// ---------------------------------------------------------------------------
// ScoreQuery: logits of one layer's query heads over a token range.
// grid.x: tiles of kAttendTile tokens; grid.y: KV head * row chunks.

template <DeviceFieldFormat kKey, int kRows>
__global__ void __launch_bounds__(kAttendThreads) ScoreKernel(ScoreKernelParams p) {
  static_assert(FamilyInfo(kKey).reads_keys, "a key family the table says holds no keys");
  float* shared = DynamicSharedFloats();
  __shared__ BlockTables tables;
  __shared__ int visible[kRows];
  const PoolView& view = p.view;
  const int d = view.head_dim;
  const int group = view.num_query_heads / view.num_kv_heads;
  const int chunks_per_head = (group + kRows - 1) / kRows;
  const int kv = blockIdx.y / chunks_per_head;
  const int row0 = (blockIdx.y % chunks_per_head) * kRows;
  const int rows = min(kRows, group - row0);
  const DeviceHead& head = view.heads[p.layer * view.num_kv_heads + kv];
  float* s_q = shared;
  float* s_logit = s_q + kRows * d + 32;
  LoadTables(head, tables);
  for (int i = threadIdx.x; i < kRows * d + 32; i += kAttendThreads) {
    const int r = i / d;
    s_q[i] = r < rows ? p.prepared[static_cast<int64_t>(kv * group + row0 + r) * d + i % d] : 0.0f;
  }
  if (threadIdx.x < kRows) visible[threadIdx.x] = p.token_end;
  __syncthreads();
  const int tile = p.token_begin + blockIdx.x * kAttendTile;
  const int count = min(kAttendTile, p.token_end - tile);
  ScoreTile<kKey, kRows>(view, head.key, tables, p.block_table, tile, count, visible, s_q, d, s_logit);
  __syncthreads();
  if (p.addback.heads != nullptr && p.addback.heads[kv].pairs > 0) {
    AddBackTile<kRows>(p.addback, p.addback.heads[kv], row0, rows, tile, count, s_logit);
    __syncthreads();
  }
  const int64_t columns = p.token_end - p.token_begin;
  for (int r = 0; r < rows; ++r) {
    const float constant = p.constant != nullptr ? p.constant[kv * group + row0 + r] : 0.0f;
    for (int k = threadIdx.x; k < count; k += kAttendThreads) {
      p.logits[static_cast<int64_t>(kv * group + row0 + r) * columns + (tile - p.token_begin) + k] =
          s_logit[r * kAttendTile + k] + constant;
    }
  }
}

// ---------------------------------------------------------------------------
// The tensor-core decode kernel: one warp per AttendBlock, kMmaWarps warps
// per thread block, rows padded to the mma's N = 8. For each tile of 16
// tokens:
//   logits (16 tokens x 8 rows) = K Q^T: d / 8 TF32 m16n8k8 mmas; lane t's
//     k columns take key coordinates [t d/4, (t + 1) d/4) (a dot product does
//     not depend on the coordinates' order, so each lane reads one contiguous
//     run of codes);
//   the online softmax per row; probabilities times each token's value scale
//     go to the warp's shared tile;
//   out^T (d x 8 rows) += V^T P^T: d / 16 x 2 mmas; lane g's m rows take value
//     coordinates [g d/8, (g + 1) d/8).
// Row r lives in the lanes with t = r / 2 in both products, so the running
// max, sum and rescale stay in registers. Operands are TF32 (10-bit
// mantissa), sums fp32: outputs agree with the fp32 kernel to about 2e-3 of
// their largest magnitude.

constexpr int kMmaWarps = 4;
constexpr int kMmaTile = 16;

struct MmaWarpTables {
  float key[16];    // TF32-rounded key centroids (up to 4 bits)
  float value[16];  // TF32-rounded value centroids
  float p[kMmaTile][kMaxBlockRows];  // probabilities x value scale, [token][row]
};

__device__ __forceinline__ float RoundedTf32(float x) { return __uint_as_float(ToTf32(x)); }

// `bytes` bytes at p into words (zero past them): 16-byte loads for whole
// aligned 16-byte runs (raw 16-bit fields), 4-byte loads when aligned, else
// bytes.
template <int kWords>
__device__ __forceinline__ void LoadWords(const uint8_t* p, int bytes, bool aligned, uint32_t (&w)[kWords]) {
#pragma unroll
  for (int k = 0; k < kWords; ++k) w[k] = 0;
  if (kWords % 4 == 0 && bytes == 4 * kWords && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
#pragma unroll
    for (int k = 0; k < kWords / 4; ++k) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[k];
      w[4 * k] = v.x;
      w[4 * k + 1] = v.y;
      w[4 * k + 2] = v.z;
      w[4 * k + 3] = v.w;
    }
  } else if (aligned) {
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      if (4 * k < bytes) w[k] = reinterpret_cast<const uint32_t*>(p)[k];
    }
  } else {
    for (int i = 0; i < bytes; ++i) w[i >> 2] |= static_cast<uint32_t>(p[i]) << (8 * (i & 3));
  }
}

template <int kBits, int kWords>
__device__ __forceinline__ uint32_t CodeInWords(const uint32_t (&w)[kWords], int j) {
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const int bit = j * kBits;
  const int k = bit >> 5;
  const int shift = bit & 31;
  if (shift + kBits <= 32 || k + 1 >= kWords) return (w[k] >> shift) & kMask;
  return __funnelshift_r(w[k], w[k + 1], shift) & kMask;
}

// One lane's run of a field's codes, `bytes` bytes at `run_offset`, for
// tokens tok[0] and tok[1]; zeros for tokens at or past token_end (their
// pages may not exist). A token-major plane's run is contiguous (vector
// loads); a tiled plane's is gathered word by word (token_codes.cuh), which
// only packed fields (kPacked) can have, and of whole words only
// (AttendMmaSupported: code_bytes a multiple of 4). Bytes past `bytes`
// inside the last word are unspecified.
template <int kWords, bool kPacked>
__device__ __forceinline__ void LoadTokenRuns(const DeviceField& f, const PoolView& view, const int32_t* block_table,
                                              const int (&tok)[2], int token_end, int run_offset, int bytes,
                                              uint32_t (&w)[2][kWords]) {
  const bool aligned = ((f.code_bytes | run_offset) & 3) == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (tok[h] < token_end) {
      const TokenAddress at = Locate(view, block_table, tok[h]);
      if (kPacked && f.tiled) {
        LoadWordRun<kWords>(FieldTokenCodes(f, at.page, view.page_tokens, at.slot), run_offset, bytes, w[h]);
      } else {
        LoadWords<kWords>(at.page + f.codes_offset + static_cast<uint64_t>(at.slot) * f.code_bytes + run_offset,
                          bytes, aligned, w[h]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kWords; ++k) w[h][k] = 0;
    }
  }
}

// One raw 16-bit coordinate of a run of words.
template <DeviceFieldFormat kFormat>
__device__ __forceinline__ float Raw16At(const uint32_t* w, int j) {
  static_assert(kFormat == DeviceFieldFormat::kFp16 || kFormat == DeviceFieldFormat::kBf16,
                "the tensor-core kernel reads raw fields of 16 bits only");
  const uint32_t bits = (w[j >> 1] >> (16 * (j & 1))) & 0xffffu;
  return kFormat == DeviceFieldFormat::kBf16 ? Bf16BitsToFloat(bits) : HalfBitsToFloat(bits);
}

// c (the logits of tokens tok[0], tok[1] for rows 2t, 2t + 1) += K Q^T
// over every key coordinate, TurboQuant codes of kBits bits.
template <int kBits, int kDim>
__device__ __forceinline__ void MmaKeyCodes(const DeviceField& key, const PoolView& view, const int32_t* block_table,
                                            const int (&tok)[2], int token_end, int t, const uint32_t* q,
                                            const MmaWarpTables& tab, float (&c)[4]) {
  constexpr int kCoords = kDim / 4;
  constexpr int kBytes = kCoords * kBits / 8;
  constexpr int kWords = (kBytes + 3) / 4;
  const DevicePart& part = key.parts[0];
  uint32_t w[2][kWords];
  LoadTokenRuns<kWords, true>(key, view, block_table, tok, token_end, part.code_offset + t * kBytes, kBytes, w);
  float scale[2] = {0.0f, 0.0f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (tok[h] < token_end) {
      const TokenAddress at = Locate(view, block_table, tok[h]);
      const uint16_t* scalars = reinterpret_cast<const uint16_t*>(at.page + key.scalars_offset) +
                                static_cast<int64_t>(at.slot) * key.num_scalars;
      scale[h] = HalfBitsToFloat(scalars[part.scalar_index]);
    }
  }
  float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < kCoords / 2; ++j) {
    const uint32_t a[4] = {__float_as_uint(tab.key[CodeInWords<kBits>(w[0], 2 * j)]),
                           __float_as_uint(tab.key[CodeInWords<kBits>(w[1], 2 * j)]),
                           __float_as_uint(tab.key[CodeInWords<kBits>(w[0], 2 * j + 1)]),
                           __float_as_uint(tab.key[CodeInWords<kBits>(w[1], 2 * j + 1)])};
    const uint32_t b[2] = {q[2 * j], q[2 * j + 1]};
    MmaTf32(dot, a, b);
  }
  c[0] += scale[0] * dot[0];
  c[1] += scale[0] * dot[1];
  c[2] += scale[1] * dot[2];
  c[3] += scale[1] * dot[3];
}

template <DeviceFieldFormat kKey, int kDim>
__device__ __forceinline__ void MmaKeyTile(const DeviceField& key, const PoolView& view, const int32_t* block_table,
                                           const int (&tok)[2], int token_end, int t, const uint32_t* q,
                                           const MmaWarpTables& tab, float (&c)[4]) {
  if constexpr (kKey == DeviceFieldFormat::kTurboQuant) {
    switch (key.parts[0].bits) {
      case 2:
        return MmaKeyCodes<2, kDim>(key, view, block_table, tok, token_end, t, q, tab, c);
      case 3:
        return MmaKeyCodes<3, kDim>(key, view, block_table, tok, token_end, t, q, tab, c);
      default:
        return MmaKeyCodes<4, kDim>(key, view, block_table, tok, token_end, t, q, tab, c);
    }
  } else {
    constexpr int kCoords = kDim / 4;
    uint32_t w[2][kCoords / 2];
    LoadTokenRuns<kCoords / 2, false>(key, view, block_table, tok, token_end, t * kCoords * 2, kCoords * 2, w);
#pragma unroll
    for (int j = 0; j < kCoords / 2; ++j) {
      const uint32_t a[4] = {ToTf32(Raw16At<kKey>(w[0], 2 * j)), ToTf32(Raw16At<kKey>(w[1], 2 * j)),
                             ToTf32(Raw16At<kKey>(w[0], 2 * j + 1)), ToTf32(Raw16At<kKey>(w[1], 2 * j + 1))};
      const uint32_t b[2] = {q[2 * j], q[2 * j + 1]};
      MmaTf32(c, a, b);
    }
  }
}

// acc += V^T P^T for the tile's 16 tokens, value codes of kBits bits
// (kCentroids: TurboQuant centroids, else uniform levels).
template <int kBits, bool kCentroids, int kDim>
__device__ __forceinline__ void MmaValueCodes(const DeviceField& value, const PoolView& view,
                                              const int32_t* block_table, int tile, int token_end, int g, int t,
                                              const MmaWarpTables& tab, float (&acc)[kDim / 16][4]) {
  constexpr int kCoords = kDim / 8;
  constexpr int kBytes = kCoords * kBits / 8;
  constexpr int kWords = (kBytes + 3) / 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int tok[2] = {tile + 8 * half + t, tile + 8 * half + t + 4};
    uint32_t w[2][kWords];
    LoadTokenRuns<kWords, true>(value, view, block_table, tok, token_end, g * kBytes, kBytes, w);
    const uint32_t b[2] = {ToTf32(tab.p[8 * half + t][g]), ToTf32(tab.p[8 * half + t + 4][g])};
#pragma unroll
    for (int i = 0; i < kDim / 16; ++i) {
      uint32_t a[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t code = CodeInWords<kBits>(w[e >> 1], 2 * i + (e & 1));
        a[e] = __float_as_uint(kCentroids ? tab.value[code] : static_cast<float>(code));
      }
      // a[0] = (coord 2i, token t), a[1] = (2i + 1, t), a[2] = (2i, t + 4), a[3] = (2i + 1, t + 4).
      const uint32_t ordered[4] = {a[0], a[1], a[2], a[3]};
      MmaTf32(acc[i], ordered, b);
    }
  }
}

template <DeviceFieldFormat kValue, int kDim>
__device__ __forceinline__ void MmaValueTile(const DeviceField& value, const PoolView& view,
                                             const int32_t* block_table, int tile, int token_end, int g, int t,
                                             const MmaWarpTables& tab, float (&acc)[kDim / 16][4]) {
  if constexpr (kValue == DeviceFieldFormat::kTurboQuant || kValue == DeviceFieldFormat::kUniform) {
    constexpr bool kCentroids = kValue == DeviceFieldFormat::kTurboQuant;
    switch (value.bits) {
      case 2:
        return MmaValueCodes<2, kCentroids, kDim>(value, view, block_table, tile, token_end, g, t, tab, acc);
      case 3:
        return MmaValueCodes<3, kCentroids, kDim>(value, view, block_table, tile, token_end, g, t, tab, acc);
      default:
        return MmaValueCodes<4, kCentroids, kDim>(value, view, block_table, tile, token_end, g, t, tab, acc);
    }
  } else {
    constexpr int kCoords = kDim / 8;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int tok[2] = {tile + 8 * half + t, tile + 8 * half + t + 4};
      uint32_t w[2][kCoords / 2];
      LoadTokenRuns<kCoords / 2, false>(value, view, block_table, tok, token_end, g * kCoords * 2, kCoords * 2, w);
      const uint32_t b[2] = {ToTf32(tab.p[8 * half + t][g]), ToTf32(tab.p[8 * half + t + 4][g])};
#pragma unroll
      for (int i = 0; i < kDim / 16; ++i) {
        const uint32_t a[4] = {ToTf32(Raw16At<kValue>(w[0], 2 * i)), ToTf32(Raw16At<kValue>(w[0], 2 * i + 1)),
                               ToTf32(Raw16At<kValue>(w[1], 2 * i)), ToTf32(Raw16At<kValue>(w[1], 2 * i + 1))};
        MmaTf32(acc[i], a, b);
      }
    }
  }
}

// c (the logits of tokens tok[0], tok[1] for block rows row0 + 2t, + 2t + 1)
// += their add-back; entries of rows past `rows` are left alone.
__device__ __forceinline__ void MmaAddBack(const AddBackTables& ab, const AddBackDesc& desc, int row0, int rows,
                                           const int (&tok)[2], int t, float (&c)[4]) {
  const double* theta = ab.theta + desc.theta;
  const float* coef[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = min(2 * t + e, rows - 1);  // a valid row; the others' results go unused
    coef[e] = ab.coef + desc.coef + static_cast<int64_t>(row0 + r) * 2 * desc.pairs;
  }
  for (int i = 0; i < desc.pairs; ++i) {
    float cs[2], sn[2];
    RopeCosSin(tok[0], theta[i], &cs[0], &sn[0]);
    RopeCosSin(tok[1], theta[i], &cs[1], &sn[1]);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float a = coef[e][i], b = coef[e][desc.pairs + i];
      c[e] = fmaf(a, cs[0], fmaf(b, sn[0], c[e]));
      c[2 + e] = fmaf(a, cs[1], fmaf(b, sn[1], c[2 + e]));
    }
  }
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, int kDim>
__global__ void __launch_bounds__(kMmaWarps * 32) AttendMmaKernel(AttendKernelParams p) {
  static_assert(FamilyInfo(kKey).reads_keys, "a key family the table says holds no keys");
  __shared__ MmaWarpTables warp_tables[kMmaWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int index = blockIdx.x * kMmaWarps + warp;
  if (index >= p.num_blocks) return;  // a whole warp; the kernel has no block barrier
  MmaWarpTables& tab = warp_tables[warp];
  const PoolView& view = p.view;
  const AttendBlock b = p.blocks[index];
  const AttendItemDesc item = p.items[b.item];
  const DeviceHead& head = view.heads[item.layer * view.num_kv_heads + b.kv_head];
  const int group = view.num_query_heads / view.num_kv_heads;
  const int32_t* block_table = p.block_tables + (p.exact ? item.exact_block_table : item.block_table);
  const AddBackDesc addback =
      p.addback.heads != nullptr ? p.addback.heads[b.item * view.num_kv_heads + b.kv_head] : AddBackDesc();
  const int g = lane >> 2;
  const int t = lane & 3;
  constexpr int kKeyCoords = kDim / 4;
  constexpr int kValueCoords = kDim / 8;
  constexpr int kMTiles = kDim / 16;

  if constexpr (kKey == DeviceFieldFormat::kTurboQuant) {
    const DevicePart& part = head.key.parts[0];
    if (lane < (1 << part.bits)) tab.key[lane] = RoundedTf32(part.centroids[lane]);
  }
  if constexpr (kValue == DeviceFieldFormat::kTurboQuant) {
    const DevicePart& part = head.value.parts[0];
    if (lane < (1 << part.bits)) tab.value[lane] = RoundedTf32(part.centroids[lane]);
  }
  // B of the key product: row g's rotated query, this lane's coordinates.
  uint32_t q[kKeyCoords];
  {
    const float* src = nullptr;
    if (g < b.rows) {
      const int row = b.row0 + g;
      src = p.prepared +
            (item.query_row + static_cast<int64_t>(row / group) * view.num_query_heads + b.kv_head * group +
             row % group) * kDim + t * kKeyCoords;
    }
#pragma unroll
    for (int k = 0; k < kKeyCoords; ++k) q[k] = src != nullptr ? ToTf32(src[k]) : 0u;
  }
  // This lane's rows: 2t and 2t + 1.
  int visible[2];
  float row_max[2], row_sum[2], zero_sum[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * t + e;
    visible[e] = r < b.rows ? item.context_tokens - item.num_query_tokens + 1 + (b.row0 + r) / group : 0;
    row_max[e] = -INFINITY;
    row_sum[e] = 0.0f;
    zero_sum[e] = 0.0f;
  }
  float acc[kMTiles][4];
#pragma unroll
  for (int i = 0; i < kMTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
  }
  __syncwarp();

  for (int tile = b.token_begin; tile < b.token_end; tile += kMmaTile) {
    const int tok[2] = {tile + g, tile + g + 8};
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    MmaKeyTile<kKey, kDim>(head.key, view, block_table, tok, b.token_end, t, q, tab, c);
    if (addback.pairs > 0) MmaAddBack(p.addback, addback, b.row0, b.rows, tok, t, c);
    // The value scale and zero point of this lane's two tokens.
    float value_scale[2] = {0.0f, 0.0f}, value_zero[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (tok[h] >= b.token_end) continue;
      if constexpr (kValue == DeviceFieldFormat::kTurboQuant || kValue == DeviceFieldFormat::kUniform) {
        const TokenAddress at = Locate(view, block_table, tok[h]);
        const uint16_t* scalars = reinterpret_cast<const uint16_t*>(at.page + head.value.scalars_offset) +
                                  static_cast<int64_t>(at.slot) * head.value.num_scalars;
        value_scale[h] = HalfBitsToFloat(scalars[0]);
        if constexpr (kValue == DeviceFieldFormat::kUniform) value_zero[h] = HalfBitsToFloat(scalars[1]);
      } else {
        value_scale[h] = 1.0f;
      }
    }
    float prob[2][2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x0 = (tok[0] < b.token_end && tok[0] < visible[e]) ? c[e] : -INFINITY;
      const float x1 = (tok[1] < b.token_end && tok[1] < visible[e]) ? c[2 + e] : -INFINITY;
      float tile_max = fmaxf(x0, x1);
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullWarp, tile_max, offset));
      }
      const float new_max = fmaxf(row_max[e], tile_max);
      prob[0][e] = x0 == -INFINITY ? 0.0f : expf(x0 - new_max);
      prob[1][e] = x1 == -INFINITY ? 0.0f : expf(x1 - new_max);
      float sum = prob[0][e] + prob[1][e];
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) sum += __shfl_xor_sync(kFullWarp, sum, offset);
      const float alpha = row_max[e] == -INFINITY ? 0.0f : expf(row_max[e] - new_max);
      row_sum[e] = row_sum[e] * alpha + sum;
      row_max[e] = new_max;
      zero_sum[e] = zero_sum[e] * alpha + prob[0][e] * value_zero[0] + prob[1][e] * value_zero[1];
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        acc[i][e] *= alpha;
        acc[i][2 + e] *= alpha;
      }
    }
    __syncwarp();  // the previous tile's values have read tab.p
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      tab.p[g][2 * t + e] = prob[0][e] * value_scale[0];
      tab.p[g + 8][2 * t + e] = prob[1][e] * value_scale[1];
    }
    __syncwarp();
    MmaValueTile<kValue, kDim>(head.value, view, block_table, tile, b.token_end, g, t, tab, acc);
  }

  // The zero points' share is the same for every coordinate of a row.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) {
      zero_sum[e] += __shfl_xor_sync(kFullWarp, zero_sum[e], offset);
    }
  }
  float* stats = p.partial_stats + static_cast<int64_t>(b.partial) * kMaxBlockRows * 2;
  float* out = p.partial_acc + static_cast<int64_t>(b.partial) * kMaxBlockRows * kDim;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * t + e;
    if (r >= b.rows) continue;
    if (g == 0) {
      stats[2 * r] = row_max[e];
      stats[2 * r + 1] = row_sum[e];
    }
#pragma unroll
    for (int i = 0; i < kMTiles; ++i) {
      out[r * kDim + g * kValueCoords + 2 * i] = acc[i][e] + zero_sum[e];
      out[r * kDim + g * kValueCoords + 2 * i + 1] = acc[i][2 + e] + zero_sum[e];
    }
  }
}

using AttendKernelFunction = void (*)(AttendKernelParams);

// The tensor-core kernel's instance for a head dim; null for other dims.
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
AttendKernelFunction AttendMmaKernelFor(int head_dim) {
  switch (head_dim) {
    case 64:
      return AttendMmaKernel<kKey, kValue, 64>;
    case 128:
      return AttendMmaKernel<kKey, kValue, 128>;
    case 256:
      return AttendMmaKernel<kKey, kValue, 256>;
    default:
      return nullptr;
  }
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
cudaError_t LaunchAttendMmaDims(const AttendKernelParams& params, cudaStream_t stream) {
  const AttendKernelFunction kernel = AttendMmaKernelFor<kKey, kValue>(params.view.head_dim);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((params.num_blocks + kMmaWarps - 1) / kMmaWarps));
  TQKV_LAUNCH(kernel, grid, kMmaWarps * 32, 0, stream, params);
  return cudaGetLastError();
}

// The fp32 kernel's instance for a block row count; null for other counts.
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
AttendKernelFunction AttendKernelFor(int block_rows) {
  switch (block_rows) {
    case 1:
      return AttendKernel<kKey, kValue, 1>;
    case 2:
      return AttendKernel<kKey, kValue, 2>;
    case 4:
      return AttendKernel<kKey, kValue, 4>;
    case 8:
      return AttendKernel<kKey, kValue, 8>;
    default:
      return nullptr;
  }
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
cudaError_t LaunchAttendRows(int block_rows, const AttendKernelParams& params, cudaStream_t stream) {
  const size_t shared = AttendSharedBytes(block_rows, params.view.head_dim);
  const dim3 grid(static_cast<unsigned>(params.num_blocks));
  const AttendKernelFunction kernel = AttendKernelFor<kKey, kValue>(block_rows);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  TQKV_LAUNCH(kernel, grid, kAttendThreads, shared, stream, params);
  return cudaGetLastError();
}

template <DeviceFieldFormat kKey>
cudaError_t LaunchScoreRows(int block_rows, const ScoreKernelParams& params, cudaStream_t stream) {
  const int group = params.view.num_query_heads / params.view.num_kv_heads;
  const int chunks = (group + block_rows - 1) / block_rows;
  const int tokens = params.token_end - params.token_begin;
  const dim3 grid(static_cast<unsigned>((tokens + kAttendTile - 1) / kAttendTile),
                  static_cast<unsigned>(params.view.num_kv_heads * chunks));
  // Score blocks hold no output accumulator, but the layout is shared.
  const size_t shared = AttendSharedBytes(block_rows, params.view.head_dim);
  void (*kernel)(ScoreKernelParams) = nullptr;
  switch (block_rows) {
    case 1:
      kernel = ScoreKernel<kKey, 1>;
      break;
    case 2:
      kernel = ScoreKernel<kKey, 2>;
      break;
    case 4:
      kernel = ScoreKernel<kKey, 4>;
      break;
    case 8:
      kernel = ScoreKernel<kKey, 8>;
      break;
    default:
      return cudaErrorInvalidValue;
  }
  TQKV_LAUNCH(kernel, grid, kAttendThreads, shared, stream, params);
  return cudaGetLastError();
}

// AttendBlocks of one (key, value) instance resident per SM, from the
// occupancy API; kHasMma: the pair has a tensor-core instance.
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, bool kHasMma>
cudaError_t AttendInstanceBlocksPerSm(bool mma, int block_rows, int head_dim, int* blocks) {
  AttendKernelFunction kernel = nullptr;
  if (!mma) {
    kernel = AttendKernelFor<kKey, kValue>(block_rows);
  } else if constexpr (kHasMma) {
    kernel = AttendMmaKernelFor<kKey, kValue>(head_dim);
  }
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const int threads = mma ? kMmaWarps * 32 : kAttendThreads;
  const size_t shared = mma ? 0 : AttendSharedBytes(block_rows, head_dim);
  int thread_blocks = 0;
  const cudaError_t error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &thread_blocks, reinterpret_cast<const void*>(kernel), threads, shared);
  if (error != cudaSuccess) return error;
  *blocks = thread_blocks * (mma ? kMmaWarps : 1);
  return cudaSuccess;
}

}  // namespace

bool ScoreSupported(DeviceFieldFormat key) { return FamilyInfo(key).reads_keys; }

bool AttendMmaSupported(const DeviceField& key, const DeviceField& value, int head_dim) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return false;
  FormatPair pair;
  if (!FindFormatPair(key.format, value.format, &pair) || !PairInfo(pair).tensor_cores) return false;
  // Coded fields: one part of 2-4 bits (the kernel's per-lane code runs).
  auto small_codes = [](const DeviceField& f) {
    switch (f.format) {
      case DeviceFieldFormat::kFp16:
      case DeviceFieldFormat::kBf16:
      case DeviceFieldFormat::kFp8:
        return true;
      case DeviceFieldFormat::kUniform:
      case DeviceFieldFormat::kTurboQuant:
        // Whole 4-byte words per token (true at these dims and bits): the
        // kernel reads tiled planes a word at a time (LoadTokenRuns).
        return f.bits >= 2 && f.bits <= 4 && (f.format != DeviceFieldFormat::kTurboQuant || f.num_parts == 1) &&
               f.code_bytes % 4 == 0;
    }
    return false;
  };
  return small_codes(key) && small_codes(value);
}

cudaError_t LaunchAttend(FormatPair pair, int block_rows, const AttendKernelParams& params,
                         cudaStream_t stream) {
  if (params.num_blocks == 0) return cudaSuccess;
  return TQKV_CUDA_DISPATCH_FORMAT_PAIR(pair, kKey, kValue, kTensorCores,
                                        return LaunchAttendRows<kKey, kValue>(block_rows, params, stream););
}

cudaError_t LaunchAttendMma(FormatPair pair, const AttendKernelParams& params, cudaStream_t stream) {
  if (params.num_blocks == 0) return cudaSuccess;
  return TQKV_CUDA_DISPATCH_FORMAT_PAIR(pair, kKey, kValue, kTensorCores, {
    if constexpr (kTensorCores) {
      return LaunchAttendMmaDims<kKey, kValue>(params, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  });
}

cudaError_t AttendBlocksPerSm(FormatPair pair, bool mma, int block_rows, int head_dim, int* blocks) {
  return TQKV_CUDA_DISPATCH_FORMAT_PAIR(
      pair, kKey, kValue, kTensorCores,
      return AttendInstanceBlocksPerSm<kKey, kValue, kTensorCores>(mma, block_rows, head_dim, blocks););
}

cudaError_t LaunchMerge(const MergeParams& params, cudaStream_t stream) {
  if (params.num_units == 0) return cudaSuccess;
  const int64_t warps = static_cast<int64_t>(params.num_units) * kMaxBlockRows;
  TQKV_LAUNCH(MergeKernel, static_cast<unsigned>((warps + kWarps - 1) / kWarps), kAttendThreads, 0, stream, params);
  return cudaGetLastError();
}

cudaError_t LaunchScore(DeviceFieldFormat key, const ScoreKernelParams& params, cudaStream_t stream) {
  if (params.token_end <= params.token_begin) return cudaSuccess;
  const int group = params.view.num_query_heads / params.view.num_kv_heads;
  const int block_rows = BlockRowsFor(group);
  return TQKV_CUDA_DISPATCH_KEY_FORMAT(key, kKey, return LaunchScoreRows<kKey>(block_rows, params, stream););
}

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_ATTEND_KERNELS_IMPL_CUH_
