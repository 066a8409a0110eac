// The tensor-core (TF32 mma) decode kernel. Part of attend_kernels_impl.cuh's
// translation unit.
#ifndef TQKV_KERNELS_CUDA_ATTEND_MMA_IMPL_CUH_
#define TQKV_KERNELS_CUDA_ATTEND_MMA_IMPL_CUH_

#include "kernels/cuda/attend_common_impl.cuh"

namespace tqkv {
namespace cuda {
namespace {

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
  float key[16];                     // TF32-rounded key centroids (up to 4 bits)
  float value[16];                   // TF32-rounded value centroids
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
    LoadRaw<4 * kWords>(p, w);
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
        LoadWords<kWords>(at.page + f.codes_offset + static_cast<uint64_t>(at.slot) * f.code_bytes + run_offset, bytes,
                          aligned, w[h]);
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
__device__ __forceinline__ void MmaValueTile(const DeviceField& value, const PoolView& view, const int32_t* block_table,
                                             int tile, int token_end, int g, int t, const MmaWarpTables& tab,
                                             float (&acc)[kDim / 16][4]) {
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

// The value scale and zero point of this lane's two tokens (1 and 0 for
// formats without scalars; left as they are past token_end).
template <DeviceFieldFormat kValue>
__device__ __forceinline__ void MmaValueScalars(const DeviceField& value, const PoolView& view,
                                                const int32_t* block_table, const int (&tok)[2], int token_end,
                                                float (&value_scale)[2], float (&value_zero)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (tok[h] >= token_end) continue;
    if constexpr (kValue == DeviceFieldFormat::kTurboQuant || kValue == DeviceFieldFormat::kUniform) {
      const TokenAddress at = Locate(view, block_table, tok[h]);
      const uint16_t* scalars = reinterpret_cast<const uint16_t*>(at.page + value.scalars_offset) +
                                static_cast<int64_t>(at.slot) * value.num_scalars;
      value_scale[h] = HalfBitsToFloat(scalars[0]);
      if constexpr (kValue == DeviceFieldFormat::kUniform) value_zero[h] = HalfBitsToFloat(scalars[1]);
    } else {
      value_scale[h] = 1.0f;
    }
  }
}

// One tile's online softmax for this lane's rows 2t and 2t + 1: the logits
// c of tokens tok[0] and tok[1] masked to what each row sees, their
// probabilities (prob[token][row]) against the new running max, and the
// running sums, zero-point sums and accumulators rescaled.
template <int kMTiles>
__device__ __forceinline__ void MmaTileSoftmax(const float (&c)[4], const int (&tok)[2], int token_end,
                                               const int (&visible)[2], const float (&value_zero)[2],
                                               float (&row_max)[2], float (&row_sum)[2], float (&zero_sum)[2],
                                               float (&prob)[2][2], float (&acc)[kMTiles][4]) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float x0 = (tok[0] < token_end && tok[0] < visible[e]) ? c[e] : -INFINITY;
    const float x1 = (tok[1] < token_end && tok[1] < visible[e]) ? c[2 + e] : -INFINITY;
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
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, int kDim>
__global__ void __launch_bounds__(kMmaWarps * 32) AttendMmaKernel(__grid_constant__ const AttendKernelParams p) {
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
             row % group) *
                kDim +
            t * kKeyCoords;
    }
#pragma unroll
    for (int k = 0; k < kKeyCoords; ++k) q[k] = src != nullptr ? ToTf32(src[k]) : 0u;
  }
  // This lane's rows: 2t and 2t + 1.
  int visible[2];
  float row_max[2], row_sum[2], zero_sum[2], row_shift[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * t + e;
    visible[e] = r < b.rows ? item.context_tokens - item.num_query_tokens + 1 + (b.row0 + r) / group : 0;
    row_shift[e] = SoftCapShift(p, item, b, group, r);
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
    if (p.softcap > 0.0f) {  // the same for the whole launch; masked after
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        c[e] = SoftCap(c[e], p.softcap, row_shift[e]);
        c[2 + e] = SoftCap(c[2 + e], p.softcap, row_shift[e]);
      }
    }
    float value_scale[2] = {0.0f, 0.0f}, value_zero[2] = {0.0f, 0.0f};
    MmaValueScalars<kValue>(head.value, view, block_table, tok, b.token_end, value_scale, value_zero);
    float prob[2][2];
    MmaTileSoftmax<kMTiles>(c, tok, b.token_end, visible, value_zero, row_max, row_sum, zero_sum, prob, acc);
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
  if (LastSplitOfUnit(p.merge, b.unit, lane)) MergeUnitRows(p.merge, b.unit, 0, 1, lane);
}

}  // namespace
}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_ATTEND_MMA_IMPL_CUH_
