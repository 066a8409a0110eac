// What both decode kernels (attend_simt_impl.cuh, attend_mma_impl.cuh) read
// tokens with: addressing a token in the pool, code unpacking and dot
// products against centroids, per-block tables, the pre-RoPE add-back and
// value accumulation. Part of attend_kernels_impl.cuh's one translation
// unit (nvcc and the host emulation compile it the same way).
#ifndef TQKV_KERNELS_CUDA_ATTEND_COMMON_IMPL_CUH_
#define TQKV_KERNELS_CUDA_ATTEND_COMMON_IMPL_CUH_

#include <cfloat>

#include "kernels/cuda/attend_kernels.cuh"
#include "kernels/cuda/device_compat.cuh"
#include "kernels/cuda/format_dispatch.cuh"
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

// kBytes bytes at p (16-byte aligned when kBytes is a multiple of 16, else
// 8- or 4-byte aligned) as words.
template <int kBytes>
__device__ __forceinline__ void LoadRaw(const uint8_t* p, uint32_t (&w)[kBytes / 4]) {
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[k];
      w[4 * k] = v.x;
      w[4 * k + 1] = v.y;
      w[4 * k + 2] = v.z;
      w[4 * k + 3] = v.w;
    }
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int k = 0; k < kBytes / 8; ++k) {
      const uint2 v = reinterpret_cast<const uint2*>(p)[k];
      w[2 * k] = v.x;
      w[2 * k + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kBytes / 4; ++k) w[k] = reinterpret_cast<const uint32_t*>(p)[k];
  }
}

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
__device__ __forceinline__ void DotCentroidsGeneric(const TokenCodes<const uint8_t>& codes, int part_offset, int first,
                                                    int bits, int count, const float* centroids, const float* q,
                                                    int q_stride, float (&dot)[kRows]) {
  for (int j = 0; j < count; ++j) {
    const float c = centroids[PackedCodeIn(codes, part_offset, first + j, bits)];
#pragma unroll
    for (int r = 0; r < kRows; ++r) dot[r] = fmaf(q[r * q_stride + j], c, dot[r]);
  }
}

// dot[r] += sum over 8 raw coordinates v[0..8).
template <int kRows>
__device__ __forceinline__ void Dot8(const float (&v)[8], const float* q, int q_stride, float (&dot)[kRows]) {
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
  static_assert(
      kFormat == DeviceFieldFormat::kFp16 || kFormat == DeviceFieldFormat::kBf16 || kFormat == DeviceFieldFormat::kFp8,
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
__device__ __forceinline__ void KeyGroupDot(const DeviceField& key, int head_dim, int page_tokens, const BlockTables& t,
                                            const uint8_t* page, int slot, int g, const float* s_q, int q_stride,
                                            float (&dot)[kRows]) {
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
        DotCentroidsGeneric<kRows>(codes, part.code_offset, base, part.bits, count, centroids, q, q_stride, part_dot);
    }
    const uint16_t* scalars =
        reinterpret_cast<const uint16_t*>(page + key.scalars_offset) + static_cast<int64_t>(slot) * key.num_scalars;
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
                          const int32_t* block_table, int tile_begin, int count, const int* visible, const float* s_q,
                          int q_stride, float* s_logit) {
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
// reduced angle (|angle| <= pi). RopeCosSinFast takes them by the hardware's
// approximations instead (SinCosReduced: absolute error below 4e-7 there),
// no second argument reduction and no slow path.

__device__ __forceinline__ double RopeReducedAngle(int64_t t, double theta) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  const double angle = static_cast<double>(t) * theta;
  return fma(-rint(angle * (1.0 / kTwoPi)), kTwoPi, angle);
}

__device__ __forceinline__ void RopeCosSin(int64_t t, double theta, float* c, float* s) {
  const float reduced = static_cast<float>(RopeReducedAngle(t, theta));
  *c = cosf(reduced);
  *s = sinf(reduced);
}

__device__ __forceinline__ void RopeCosSinFast(int64_t t, double theta, float* c, float* s) {
  SinCosReduced(static_cast<float>(RopeReducedAngle(t, theta)), s, c);
}

// Logit soft-capping of a logit x whose constant part `shift` is added
// later (AttendKernelParams::softcap): cap * tanh((x + shift) / cap) - shift.
__device__ __forceinline__ float SoftCap(float x, float cap, float shift) {
  return cap * tanhf((x + shift) / cap) - shift;
}

// The soft cap's shift of block row r: its output row's add-back constant.
__device__ __forceinline__ float SoftCapShift(const AttendKernelParams& p, const AttendItemDesc& item,
                                              const AttendBlock& b, int group, int r) {
  if (p.softcap_shift == nullptr || r >= b.rows) return 0.0f;
  const int row = b.row0 + r;
  return p.softcap_shift[item.query_row + static_cast<int64_t>(row / group) * p.view.num_query_heads +
                         b.kv_head * group + row % group];
}

// s_logit[r * kAttendTile + k] += the add-back of block row row0 + r at token
// tile_begin + k, for rows < rows, k < count and unmasked (finite) logits.
// One thread per token; the caller synchronises before and after.
template <int kRows>
__device__ void AddBackTile(const AddBackTables& ab, const AddBackDesc& desc, int row0, int rows, int tile_begin,
                            int count, float* s_logit) {
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
__device__ __forceinline__ void DecodeChunk(const TokenCodes<const uint8_t>& codes, int chunk, const float* centroids,
                                            float (&v)[8]) {
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
                                                const uint8_t* page, int slot, int chunk, const float* s_p, int k,
                                                float (&acc)[kRows][8], float (&zero_acc)[kRows]) {
  float p[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) p[r] = s_p[r * kAttendTile + k];
  float v[8];
  if constexpr (kValue == DeviceFieldFormat::kUniform || kValue == DeviceFieldFormat::kTurboQuant) {
    constexpr bool kCentroids = kValue == DeviceFieldFormat::kTurboQuant;
    DecodeChunkAnyBits<kCentroids>(FieldTokenCodes(value, page, page_tokens, slot), chunk, value.bits,
                                   t.value_centroids, v);
    const uint16_t* scalars =
        reinterpret_cast<const uint16_t*>(page + value.scalars_offset) + static_cast<int64_t>(slot) * value.num_scalars;
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
// Merge, in the decode kernels' tail: the block that finishes a unit's last
// split merges it (LastSplitOfUnit). No launch of its own and no shared
// memory: a lane holds every 32nd coordinate of a row in registers, the
// warp shares the splits' weights by shuffles, and a rotated value codec's
// inverse runs on the output row (MergeRow). Partials come from other SMs:
// read past L1.

constexpr int kMergeCoords = kMaxDeviceHeadDim / 32;

// Partial k's (max, sum) statistics of row r.
__device__ __forceinline__ const float* PartialStats(const MergeParams& p, int64_t partial, int r) {
  return p.partial_stats + (partial * kMaxBlockRows + r) * 2;
}

// Over a unit's splits, each lane reading every 32nd: the largest max and
// the sum of the splits' sums rescaled to it (a warp's butterfly each).
__device__ __forceinline__ void SplitTotals(const MergeParams& p, const MergeUnit& unit, int r, int lane,
                                            float* global_max, float* total) {
  float m = -INFINITY;
  for (int k = lane; k < unit.num_splits; k += 32) m = fmaxf(m, __ldcg(PartialStats(p, unit.first_partial + k, r)));
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullWarp, m, offset));
  float sum = 0.0f;
  for (int k = lane; k < unit.num_splits; k += 32) {
    const float* stats = PartialStats(p, unit.first_partial + k, r);
    const float split_max = __ldcg(stats);
    if (split_max != -INFINITY) sum += __ldcg(stats + 1) * expf(split_max - m);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFullWarp, sum, offset);
  *global_max = m;
  *total = sum;
}

// x[i] (coordinate lane + 32 i) += inv_total times the sum over partials
// [first, first + count) of row r of acc * exp(max - global_max). Each lane
// works out the weight of every 32nd partial once; shuffles share it.
__device__ __forceinline__ void SumPartials(const MergeParams& p, int64_t first, int count, int r, int d,
                                            float global_max, float inv_total, int lane, float (&x)[kMergeCoords]) {
  for (int chunk = 0; chunk < count; chunk += 32) {
    const int n = min(32, count - chunk);
    float weight = 0.0f;
    if (lane < n) {
      const float m = __ldcg(PartialStats(p, first + chunk + lane, r));
      weight = m == -INFINITY ? 0.0f : expf(m - global_max) * inv_total;
    }
    const float* acc = p.partial_acc + ((first + chunk) * kMaxBlockRows + r) * d;
    for (int k = 0; k < n; ++k) {
      const float w = __shfl_sync(kFullWarp, weight, k);
      if (w == 0.0f) continue;  // the whole warp: a split without tokens, whose acc may be anything
      const float* a = acc + static_cast<int64_t>(k) * kMaxBlockRows * d;
#pragma unroll
      for (int i = 0; i < kMergeCoords; ++i) {
        const int j = lane + 32 * i;
        if (j < d) x[i] = fmaf(__ldcg(a + j), w, x[i]);
      }
    }
  }
}

// Row r of `unit`: its output row and lse. The compressed splits of a
// rotated value codec (one part: DescribeLayout) are summed in its basis
// into the output row and rotated back there, with the first split's row r
// (summed already, read by no one after) as the rotation's scratch; the
// others' plain sums are added after.
__device__ void MergeRow(const MergeParams& p, const MergeUnit& unit, int r, int lane) {
  const PoolView& view = p.view;
  const int d = view.head_dim;
  const AttendItemDesc item = p.items[unit.item];
  const int group = view.num_query_heads / view.num_kv_heads;
  const int row = unit.row0 + r;
  const int64_t out_row =
      item.query_row + static_cast<int64_t>(row / group) * view.num_query_heads + unit.kv_head * group + row % group;
  float global_max, total;
  SplitTotals(p, unit, r, lane, &global_max, &total);
  const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  const DeviceField& value = view.heads[item.layer * view.num_kv_heads + unit.kv_head].value;
  const int basis = value.format == DeviceFieldFormat::kTurboQuant ? unit.basis_splits : 0;
  float* out = p.output + out_row * d;
  float x[kMergeCoords];
  if (basis > 0) {
#pragma unroll
    for (int i = 0; i < kMergeCoords; ++i) x[i] = 0.0f;
    SumPartials(p, unit.first_partial, basis, r, d, global_max, inv_total, lane, x);
#pragma unroll
    for (int i = 0; i < kMergeCoords; ++i) {
      if (lane + 32 * i < d) out[lane + 32 * i] = x[i];
    }
    __syncwarp();
    float* scratch = p.partial_acc + (static_cast<int64_t>(unit.first_partial) * kMaxBlockRows + r) * d;
    WarpRotateInverse(value.parts[0].rotation, out, scratch, lane);
    __syncwarp();
  }
#pragma unroll
  for (int i = 0; i < kMergeCoords; ++i) x[i] = basis > 0 && lane + 32 * i < d ? out[lane + 32 * i] : 0.0f;
  SumPartials(p, unit.first_partial + basis, unit.num_splits - basis, r, d, global_max, inv_total, lane, x);
#pragma unroll
  for (int i = 0; i < kMergeCoords; ++i) {
    if (lane + 32 * i < d) out[lane + 32 * i] = x[i];
  }
  if (lane == 0 && p.lse != nullptr) {
    const float constant = p.lse_constant != nullptr ? p.lse_constant[out_row] : 0.0f;
    p.lse[out_row] = total > 0.0f ? global_max + logf(total) + constant : -INFINITY;
  }
}

// Rows first_row, first_row + step, ... of unit u, by one warp. Not
// inlined: a call at the kernel's end, with nothing live across it, keeps
// the merge's registers out of the decode loop's allocation.
__device__ TQKV_NOINLINE void MergeUnitRows(const MergeParams& p, int u, int first_row, int step, int lane) {
  const MergeUnit unit = p.units[u];
  for (int r = first_row; r < unit.rows; r += step) {
    MergeRow(p, unit, r, lane);
    __syncwarp();
  }
}

// Counts one finished split of unit u (one thread of its block, after the
// block's stores are fenced and the block synchronised): whether it was the
// unit's last.
__device__ __forceinline__ bool ArriveAtUnit(const MergeParams& p, int u) {
  return atomicAdd(&p.units[u].arrived, 1) == p.units[u].num_splits - 1;
}

// Whether this warp's block finished the last of unit u's splits: called by
// every lane once the block's partial is written. The last sees every other
// split's partial.
__device__ __forceinline__ bool LastSplitOfUnit(const MergeParams& p, int u, int lane) {
  __threadfence();
  __syncwarp();
  const bool last = __shfl_sync(kFullWarp, lane == 0 ? static_cast<int>(ArriveAtUnit(p, u)) : 0, 0) != 0;
  if (last) __threadfence();
  return last;
}

// LastSplitOfUnit for a block of kAttendThreads threads (the fp32 kernel),
// then the merge, a row a warp: every thread calls it once the block's
// partial is written.
__device__ __forceinline__ void MergeIfLastBlock(const MergeParams& p, int u) {
  __shared__ int last_split;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_split = ArriveAtUnit(p, u);
  __syncthreads();
  if (last_split) {
    __threadfence();
    MergeUnitRows(p, u, static_cast<int>(threadIdx.x >> 5), kWarps, static_cast<int>(threadIdx.x & 31));
  }
}

}  // namespace
}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_ATTEND_COMMON_IMPL_CUH_
