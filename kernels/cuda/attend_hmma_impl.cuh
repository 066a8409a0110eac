// The fp16 / bf16 tensor-core decode kernel (m16n8k16) on packed codes.
// Part of attend_kernels_impl.cuh's translation unit.
#ifndef TQKV_KERNELS_CUDA_ATTEND_HMMA_IMPL_CUH_
#define TQKV_KERNELS_CUDA_ATTEND_HMMA_IMPL_CUH_

#include <utility>

#include "kernels/cuda/attend_common_impl.cuh"
#include "kernels/cuda/attend_mma_impl.cuh"  // MmaAddBack: the same fragment layout
#include "kernels/cuda/hmma_fragments_impl.cuh"

namespace tqkv {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// One warp per AttendBlock, kHmmaWarps warps per thread block, one tile of
// 16 tokens (one code tile, inside one page) per iteration. The tile's
// tokens are the mma's M rows, so no operand is padding:
//   logits S (16 tokens x 8 rows) = K Q^T: d / 16 k-steps; lane (g, t)
//     supplies tokens g and 8 + g's key coordinates [t d/4, (t + 1) d/4)
//     (a dot product does not depend on the order of its coordinates, so
//     each lane reads one run of codes) and holds their logits for rows
//     2t, 2t + 1; the query is B, loaded once;
//   out^T (d x 8 rows) += V^T P^T: d / 16 m-tiles of 16 value coordinates,
//     one k-step of the 16 tokens; lane group g supplies coordinates
//     [g d/8, (g + 1) d/8) of tokens 2t, 2t + 1, 8 + 2t, 9 + 2t; P moves
//     from the logits' layout to B's by four shuffles.
// Dequantization builds the fragments' 16-bit pairs directly:
//   TurboQuant keys: a pair of codes indexes a per-warp table of centroid
//     pairs (fp16x2), copied per lane so the lookups are conflict-free;
//     the token's norm scales the logit after the mma;
//   TurboQuant values: both tokens' codes of a coordinate brought side by
//     side index the values' pair table (hmma_fragments_impl.cuh); the
//     token's norm scales P;
//   uniform values: code bits OR'd into the mantissa of 1024 (the fp16
//     magic number), 1024 subtracted, the code's power-of-two position
//     undone on the output; scale and zero point act on P and on a running
//     zero-point sum;
//   fp8 E4M3: widened exactly to fp16 pairs; fp16 as stored;
//   bf16: bf16 mma, the query split into two bf16 terms (hi + lo: 16
//     significant bits, as fp16's 11 and better), P in bf16;
//   split TurboQuant keys (two parts, each half of the query's state at its
//     own bits): lane t reads a run of each part; the parts' k-steps go to
//     two accumulators (independent mma chains), each scaled by its part's
//     norm; a pair table per part.
// Key pair tables hold the centroids times DeviceField::pair_scale, the
// query fragments the state over it (less fp16 rounding of the codebook).
// The online softmax is in base 2; the accumulators are rescaled only when
// a row's running max changes. Tiles that straddle the block's ends or a
// row's visible end are masked; the others run without compares.
// Requirements (AttendHmmaShape): head_dim 64, 128 or 256; page_tokens a
// multiple of 16; one part per field but split keys; packed codes tiled in
// whole words; one fp16 norm per TurboQuant part and token, (scale, zero)
// per uniform value token; TurboQuant values of 3-4 bits with TurboQuant
// keys of 3-4 bits, of 3 bits with split keys of 4 | 3 or 3 | 2 bits.

// The pre-RoPE add-back (AddBackDesc) as one more k-step of the key
// product, for up to kAddBackMmaPairs pairs: S += F C^T with F[token][2i,
// 2i + 1] = (cos, sin)(token theta_i) and C[row][2i, 2i + 1] = (A[row][i],
// B[row][i]) (its fp16 hi + lo terms: three mmas, about 20 significant bits).
// Lane (g, t) holds pairs t and t + 4 of tokens g and 8 + g and steps them
// 16 tokens a tile by a rotation; they are set exactly (RopeCosSinFast) at
// the block's first tile and every kAddBackAnchor tokens, which bounds the
// rotations' rounding drift.
constexpr int kAddBackMmaPairs = 8;
constexpr int kAddBackAnchor = 1024;

struct AddBackState {
  float cs[2][2], sn[2][2];  // [token g, 8 + g][pair t, t + 4]
  float step_cs[2], step_sn[2];
  double theta[2];
  uint32_t coef_hi[2], coef_lo[2];  // B: row g's (A, B) of pairs t, t + 4
};

__device__ __forceinline__ uint32_t PackHalf2Lo(float lo, float hi, uint32_t packed) {
  return PackHalf2(lo - HalfBitsToFloat(packed & 0xffffu), hi - HalfBitsToFloat(packed >> 16));
}

__device__ __forceinline__ void AddBackSetup(const AddBackTables& ab, const AddBackDesc& desc, int row0, int rows,
                                             int g, int t, AddBackState& st) {
  const bool row_ok = g < rows;
  const float* coef = ab.coef + desc.coef + static_cast<int64_t>(row0 + (row_ok ? g : 0)) * 2 * desc.pairs;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int i = t + 4 * u;
    const bool on = i < desc.pairs;
    st.theta[u] = on ? ab.theta[desc.theta + i] : 0.0;
    RopeCosSinFast(kHmmaTile, st.theta[u], &st.step_cs[u], &st.step_sn[u]);
    const float a = on && row_ok ? coef[i] : 0.0f, b = on && row_ok ? coef[desc.pairs + i] : 0.0f;
    st.coef_hi[u] = PackHalf2(a, b);
    st.coef_lo[u] = PackHalf2Lo(a, b, st.coef_hi[u]);
  }
}

// The features of the tile starting at `tile`, exactly.
__device__ __forceinline__ void AddBackAnchor(int tile, int g, AddBackState& st) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int u = 0; u < 2; ++u) RopeCosSinFast(tile + 8 * h + g, st.theta[u], &st.cs[h][u], &st.sn[h][u]);
  }
}

// c (the key product's fragment) += this tile's add-back; the features then
// step to the next tile.
__device__ __forceinline__ void AddBackMma(AddBackState& st, float (&c)[4]) {
  uint32_t hi[4], lo[4];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      hi[2 * u + h] = PackHalf2(st.cs[h][u], st.sn[h][u]);
      lo[2 * u + h] = PackHalf2Lo(st.cs[h][u], st.sn[h][u], hi[2 * u + h]);
      const float cs = st.cs[h][u], sn = st.sn[h][u];
      st.cs[h][u] = fmaf(cs, st.step_cs[u], -sn * st.step_sn[u]);
      st.sn[h][u] = fmaf(sn, st.step_cs[u], cs * st.step_sn[u]);
    }
  }
  MmaF16(c, hi, st.coef_hi);
  MmaF16(c, lo, st.coef_hi);
  MmaF16(c, hi, st.coef_lo);
}

// Query fragments of row g (`row`: its state; null for rows past the
// block's, zero): k-step i's a[0] holds run coordinates 4i, 4i + 1, a[2]
// 4i + 2, 4i + 3 of lane t's run, [t, t + 1) kDim / 4 of the state; with
// split keys, part 0's steps then part 1's, the lane's run of each part's
// state ([t, t + 1) kDim / 8, and kDim / 2 on), times the part's
// `inverse` (of its pair tables' scale). For bf16 keys lo holds what bf16
// rounding left of each (hi + lo ~ the float query).
template <bool kBf16, int kDim, int kParts>
__device__ __forceinline__ void LoadQuery(const float* row, int t, const float (&inverse)[kParts],
                                          uint32_t (&hi)[kDim / 16][2], uint32_t (&lo)[kDim / 16][2]) {
  constexpr int kPartSteps = kDim / 16 / kParts;
#pragma unroll
  for (int i = 0; i < kDim / 16; ++i) {
    const int part = i / kPartSteps;
    const float* src = row != nullptr ? row + part * (kDim / kParts) + t * (kDim / kParts / 4) : nullptr;
    const int k = i % kPartSteps;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float x0 = src != nullptr ? src[4 * k + 2 * h] * inverse[part] : 0.0f;
      const float x1 = src != nullptr ? src[4 * k + 2 * h + 1] * inverse[part] : 0.0f;
      if constexpr (kBf16) {
        hi[i][h] = PackBf162(x0, x1);
        lo[i][h] = PackBf162(x0 - Bf16BitsToFloat(hi[i][h] & 0xffffu), x1 - Bf16BitsToFloat(hi[i][h] >> 16));
      } else {
        hi[i][h] = PackHalf2(x0, x1);
        lo[i][h] = 0u;
      }
    }
  }
}

template <bool kBf16>
__device__ __forceinline__ void Mma16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (kBf16) {
    MmaBf16(d, a, b);
  } else {
    MmaF16(d, a, b);
  }
}

// Fills the pair table at shared address `table`: word pair * copies + c
// holds (centroid[pair & mask], centroid[pair >> bits]) times `scale` as
// fp16, the lower code in the low half.
template <int kBits>
__device__ __forceinline__ void FillPairTable(const float* centroids, float scale, int lane, uint32_t* tables,
                                              uint32_t table) {
  constexpr int kCopies = PairCopies<kBits>();
  constexpr int kEntries = kCopies << (2 * kBits);
  for (int i = lane; i < kEntries; i += 32) {
    const int pair = i / kCopies;
    StoreShared32(tables, table + 4 * i,
                  PackHalf2(centroids[pair & ((1 << kBits) - 1)] * scale, centroids[pair >> kBits] * scale));
  }
}

// What one lane knows of a block for the whole loop.
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, int kDim_, int kKeyBits, int kValueBits>
struct HmmaLane {
  static constexpr int kDim = kDim_;
  static constexpr bool kBf16 = kKey == DeviceFieldFormat::kBf16;
  static constexpr bool kKeyCodes = kKey == DeviceFieldFormat::kTurboQuant;
  static constexpr bool kUniform = kValue == DeviceFieldFormat::kUniform;
  static constexpr bool kValueCodes = kValue == DeviceFieldFormat::kTurboQuant;
  static constexpr int kTables = HmmaTables(kKey, kValue, kKeyBits);
  static constexpr bool kDynamicTables = kTables > 1;
  // Split keys: part 0 (the first kDim / 2 coordinates of the query's state)
  // and part 1, each at its own bits with its own norm and pair table.
  static constexpr int kKeyParts = KeyParts(kKey, kKeyBits);
  static constexpr bool kSplit = kKeyParts == 2;
  static constexpr int kScalarBytes = kUniform ? 4 : 2;  // a value token's (scale, zero) or norm
  // bf16 at head_dim 256 loads its values after the logits, not with the
  // keys: holding both (and the query's two terms) spilled.
  static constexpr bool kLateValues = kBf16 && kDim == 256;
  static constexpr int kSteps = kDim / 16;               // k-steps of the key product
  static constexpr int kPartSteps = kSteps / kKeyParts;  // of them, each key part's (part 0's first)
  static constexpr int kMTiles = kDim / 16;              // m-tiles (16 value coordinates) of the value product
  static constexpr int kRun = kDim / 8;                  // value coordinates a lane group reads
  // A key part's runs: lane t reads coordinates [t, t + 1) kDim / (4 parts)
  // of each part.
  using KR = KeyRun<kKey, KeyPartBits(kKey, kKeyBits, 0), kDim / kKeyParts>;
  using KR1 = KeyRun<kKey, KeyPartBits(kKey, kKeyBits, 1), kDim / kKeyParts>;  // split keys' part 1
  using VR = ValueRun<kValue, kValueBits, kDim>;
  static constexpr int kPart1Bytes = CodeBytes<kKey, KR::kBits, KR::kDim>();  // where part 1's codes start
  static constexpr int kKeyBytes = kPart1Bytes + (kSplit ? CodeBytes<kKey, KR1::kBits, KR1::kDim>() : 0);
  static constexpr int kNormBytes = 2 * kKeyParts;  // a key token's fp16 norms
  static constexpr int kValueBytes = CodeBytes<kValue, kValueBits, kDim>();
  static constexpr int kKeyStride = IsRaw<kKey>() ? 4 : 4 * kTileTokens;
  static constexpr int kValueStride = IsRaw<kValue>() ? 4 : 4 * kTileTokens;

  static constexpr int kKeyLanes = KR::kLanes;    // lanes t = 0..3 split a key token's run
  static constexpr int kValueLanes = VR::kLanes;  // lane groups g = 0..7 a value token's

  int g, t;
  uint32_t lane_bits, value_lane_bits, key1_lane_bits;  // this lane's copy in this warp's pair tables
  // This lane's first bytes in page 0's first tile (the pool, the plane's
  // offset in a page, the lane's in a tile), hoisted out of the DeviceHead:
  // key codes of token g (its run's first word; key1_lane: of part 1),
  // the fp16 norms of key token g, value codes of token 2t (its run's
  // first word), (scale, zero) or the norm of value token g. A tile adds
  // its page's start and its place (HmmaAt).
  const uint8_t* key_lane;
  const uint8_t* key1_lane;
  const uint8_t* norm_lane;
  const uint8_t* value_lane;
  const uint8_t* scalar_lane;
  int key_k0, key_shift, key1_k0, key1_shift, value_k0, value_shift;  // run's first word, bit in it
  uint32_t page_bytes;                                                // AttendHmmaShape: < 2^32
  uint32_t q_hi[kSteps][2], q_lo[kSteps][2];                          // row g's query: B of the key product
  // Rows 2t, 2t + 1: what they see, their running max (natural log units
  // and base 2), and this lane's share of their sums.
  int visible[2];
  float row_shift[2], row_max[2], max_log2[2], row_sum[2], zero_sum[2];
  // acc[i]: rows 2t, 2t + 1 of run coordinates 2i (0, 1) and 2i + 1 (2, 3)
  // of lane group g's value run.
  float acc[kMTiles][4];
};

// The lane's first bytes in each plane (HmmaLane::key_lane ...).
template <typename L>
__device__ __forceinline__ void HmmaLanePlanes(const PoolView& view, const DeviceHead& head, L& l) {
  using KR = typename L::KR;
  using VR = typename L::VR;
  const uint8_t* pool = view.pool;
  l.page_bytes = static_cast<uint32_t>(view.page_bytes);
  l.key_k0 = l.t * KR::kRunBits / 32;
  l.key_shift = l.t * KR::kRunBits % 32;
  l.value_k0 = l.g * VR::kRunBits / 32;
  l.value_shift = l.g * VR::kRunBits % 32;
  if constexpr (IsRaw<KR::kFormat>()) {  // token-major
    l.key_lane = pool + head.key.codes_offset + l.g * L::kKeyBytes + l.t * (KR::kRunBits / 8);
  } else {  // tiled: word k of token s at 64 k + 4 s
    l.key_lane = pool + head.key.codes_offset + 4 * l.g + l.key_k0 * L::kKeyStride;
  }
  if constexpr (L::kSplit) {  // part 1's codes: whole words on (AttendHmmaShape)
    using KR1 = typename L::KR1;
    l.key1_k0 = l.t * KR1::kRunBits / 32;  // in part 1's words
    l.key1_shift = l.t * KR1::kRunBits % 32;
    l.key1_lane = pool + head.key.codes_offset + 4 * l.g + (L::kPart1Bytes / 4 + l.key1_k0) * L::kKeyStride;
  } else {
    l.key1_k0 = l.key1_shift = 0;
    l.key1_lane = l.key_lane;
  }
  if constexpr (IsRaw<VR::kFormat>()) {
    l.value_lane = pool + head.value.codes_offset + 2 * l.t * L::kValueBytes + l.g * (VR::kRunBits / 8);
  } else {
    l.value_lane = pool + head.value.codes_offset + 8 * l.t + l.value_k0 * L::kValueStride;
  }
  l.norm_lane = pool + head.key.scalars_offset + L::kNormBytes * l.g;
  l.scalar_lane = pool + head.value.scalars_offset + L::kScalarBytes * l.g;
}

template <typename L>
__device__ __forceinline__ void HmmaSetup(const AttendKernelParams& p, const AttendBlock& b, const AttendItemDesc& item,
                                          const DeviceHead& head, int warp, int lane, L& l) {
  const PoolView& view = p.view;
  const int group = view.num_query_heads / view.num_kv_heads;
  l.g = lane >> 2;
  l.t = lane & 3;
  l.lane_bits = l.value_lane_bits = l.key1_lane_bits = 0;
  if constexpr (L::kKeyCodes) {
    uint32_t* anchor = PairTables<L::kDynamicTables>();
    const uint32_t tables = (SharedAddress(anchor) + kPairTableBytes - 1) & ~(kPairTableBytes - 1);
    // The warp's k-th table (HmmaTables: keys' part 0, values', keys' part 1).
    // Keys' tables scaled by the field's pair_scale (the query by its
    // inverse), values' as they are.
    const auto fill = [&](int k, int bits, const DevicePart& part, float scale) {
      const uint32_t table = tables + static_cast<uint32_t>(k * kHmmaWarps + warp) * kPairTableBytes;
      switch (bits) {  // a constant once inlined
        case 2:
          FillPairTable<2>(part.centroids, scale, lane, anchor, table);
          return table + static_cast<uint32_t>(lane % PairCopies<2>()) * 4;
        case 3:
          FillPairTable<3>(part.centroids, scale, lane, anchor, table);
          return table + static_cast<uint32_t>(lane % PairCopies<3>()) * 4;
        default:
          FillPairTable<4>(part.centroids, scale, lane, anchor, table);
          return table + static_cast<uint32_t>(lane % PairCopies<4>()) * 4;
      }
    };
    l.lane_bits = fill(0, L::KR::kBits, head.key.parts[0], head.key.pair_scale[0]);
    if constexpr (L::kValueCodes) l.value_lane_bits = fill(1, L::VR::kBits, head.value.parts[0], 1.0f);
    if constexpr (L::kSplit) {
      l.key1_lane_bits = fill(L::kTables - 1, L::KR1::kBits, head.key.parts[1], head.key.pair_scale[1]);
    }
  }
  HmmaLanePlanes(view, head, l);
  const float* src = nullptr;
  if (l.g < b.rows) {
    const int row = b.row0 + l.g;
    src = p.prepared + (item.query_row + static_cast<int64_t>(row / group) * view.num_query_heads + b.kv_head * group +
                        row % group) *
                           L::kDim;
  }
  float inverse[L::kKeyParts];
#pragma unroll
  for (int k = 0; k < L::kKeyParts; ++k) inverse[k] = L::kKeyCodes ? 1.0f / head.key.pair_scale[k] : 1.0f;
  LoadQuery<L::kBf16, L::kDim, L::kKeyParts>(src, l.t, inverse, l.q_hi, l.q_lo);
  const int visible_base = item.context_tokens - item.num_query_tokens + 1;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * l.t + e;
    l.visible[e] = r < b.rows ? visible_base + (b.row0 + r) / group : b.token_end;
    l.row_shift[e] = SoftCapShift(p, item, b, group, r);
    l.row_max[e] = -INFINITY;
    l.max_log2[e] = 0.0f;
    l.row_sum[e] = 0.0f;
    l.zero_sum[e] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < L::kMTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) l.acc[i][e] = 0.0f;
  }
}

// One tile's first bytes for this lane: HmmaLane's, moved to the tile's
// page (its block-table entry) and place in the page (in_page 16-token
// tiles on).
struct HmmaTileAt {
  const uint8_t* key;
  const uint8_t* key1;  // split keys' part 1
  const uint8_t* norms;
  const uint8_t* value;
  const uint8_t* scalars;
};

template <typename L>
__device__ __forceinline__ HmmaTileAt HmmaAt(const L& l, uint32_t entry, uint32_t in_page) {
  const auto at = [&](const uint8_t* lane, uint32_t tile_bytes) {
    return lane + static_cast<uint64_t>(in_page) * tile_bytes + static_cast<uint64_t>(entry) * l.page_bytes;
  };
  return {at(l.key_lane, kHmmaTile * L::kKeyBytes), at(l.key1_lane, kHmmaTile * L::kKeyBytes),
          at(l.norm_lane, L::kNormBytes * kHmmaTile), at(l.value_lane, kHmmaTile * L::kValueBytes),
          at(l.scalar_lane, L::kScalarBytes * kHmmaTile)};
}

// Logits S = K Q^T of the tile (16 tokens x 8 rows): c[0], c[1] token g,
// rows 2t, 2t + 1; c[2], c[3] token 8 + g. Split keys: each part's k-steps
// into their own accumulator (two independent mma chains), scaled by the
// part's norm.
template <typename L>
__device__ __forceinline__ void HmmaLogits(const L& l, const HmmaTileAt& at, float (&c)[4]) {
  using KR = typename L::KR;
  using KR1 = typename L::KR1;
  constexpr int kParts = L::kKeyParts, kPartSteps = L::kPartSteps;
  const uint32_t* tables = PairTables<L::kDynamicTables>();
  uint32_t kb[2][kParts][kPartSteps][2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t w[KR::kWords];
    if constexpr (IsRaw<KR::kFormat>()) {  // token 8 h + g
      LoadRaw<KR::kRunBits / 8>(at.key + 8 * h * L::kKeyBytes, w);
    } else {
      LoadRun<KR::kRunBits, L::kKeyLanes, L::kKeyStride>(at.key + 32 * h, l.key_k0, l.key_shift, w);
    }
    KeyFragments<KR::kFormat, KR::kBits, KR::kDim>(w, l.lane_bits, tables, kb[h][0]);
    if constexpr (L::kSplit) {
      uint32_t w1[KR1::kWords];
      LoadRun<KR1::kRunBits, L::kKeyLanes, L::kKeyStride>(at.key1 + 32 * h, l.key1_k0, l.key1_shift, w1);
      KeyFragments<KR1::kFormat, KR1::kBits, KR1::kDim>(w1, l.key1_lane_bits, tables, kb[h][kParts - 1]);
    }
  }
  float part[kParts][4];
#pragma unroll
  for (int p = 0; p < kParts; ++p) {
#pragma unroll
    for (int k = 0; k < 4; ++k) part[p][k] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < kPartSteps; ++i) {
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      const uint32_t a[4] = {kb[0][p][i][0], kb[1][p][i][0], kb[0][p][i][1], kb[1][p][i][1]};
      Mma16<L::kBf16>(part[p], a, l.q_hi[p * kPartSteps + i]);
      if constexpr (L::kBf16) Mma16<L::kBf16>(part[p], a, l.q_lo[p * kPartSteps + i]);
    }
  }
  if constexpr (L::kSplit) {  // the norms of tokens g and 8 + g: part 0's, part 1's
    const uint32_t* norms = reinterpret_cast<const uint32_t*>(at.norms);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t both = norms[8 * h];
      const float norm0 = HalfBitsToFloat(both & 0xffffu), norm1 = HalfBitsToFloat(both >> 16);
#pragma unroll
      for (int e = 0; e < 2; ++e) c[2 * h + e] = fmaf(part[0][2 * h + e], norm0, part[1][2 * h + e] * norm1);
    }
  } else if constexpr (L::kKeyCodes) {  // the norms of tokens g and 8 + g
    const uint16_t* norms = reinterpret_cast<const uint16_t*>(at.norms);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float norm = HalfBitsToFloat(norms[8 * h]);
      c[2 * h] = part[0][2 * h] * norm;
      c[2 * h + 1] = part[0][2 * h + 1] * norm;
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) c[k] = part[0][k];
  }
}

// The tile's values: (scale, zero) of tokens g and 8 + g, and the codes of
// tokens 2t, 2t + 1, 8 + 2t, 9 + 2t (loaded before the softmax, so the
// loads overlap it).
template <typename L>
__device__ __forceinline__ void HmmaLoadValues(const L& l, const HmmaTileAt& at, float (&scale)[2], float (&zero)[2],
                                               uint32_t (&vw)[4][L::VR::kWords]) {
  using VR = typename L::VR;
  scale[0] = scale[1] = 1.0f;
  zero[0] = zero[1] = 0.0f;
  if constexpr (L::kUniform) {
    const uint32_t* scalars = reinterpret_cast<const uint32_t*>(at.scalars);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t both = scalars[8 * h];
      scale[h] = HalfBitsToFloat(both & 0xffffu);
      zero[h] = HalfBitsToFloat(both >> 16);
    }
  } else if constexpr (L::kValueCodes) {  // the norms of tokens g and 8 + g
    const uint16_t* norms = reinterpret_cast<const uint16_t*>(at.scalars);
#pragma unroll
    for (int h = 0; h < 2; ++h) scale[h] = HalfBitsToFloat(norms[8 * h]);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int s = 8 * (k >> 1) + (k & 1);  // tokens 2t + s
    if constexpr (IsRaw<VR::kFormat>()) {
      LoadRaw<VR::kRunBits / 8>(at.value + s * L::kValueBytes, vw[k]);
    } else {
      LoadRun<VR::kRunBits, L::kValueLanes, L::kValueStride>(at.value + 4 * s, l.value_k0, l.value_shift, vw[k]);
    }
  }
}

// An edge tile: tokens outside the block or past what a row sees get no
// weight; their pages' bytes are unspecified, so their codes become zeros
// (no NaN into the mma).
template <typename L>
__device__ __forceinline__ void HmmaMaskEdge(const L& l, const AttendBlock& b, int tile, float (&c)[4],
                                             float (&scale)[2], float (&zero)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int token = tile + 8 * h + l.g;
    const bool stored = token >= b.token_begin && token < b.token_end;
#pragma unroll
    for (int e = 0; e < 2; ++e) c[2 * h + e] = stored && token < l.visible[e] ? c[2 * h + e] : -INFINITY;
    scale[h] = stored ? scale[h] : 0.0f;
    zero[h] = stored ? zero[h] : 0.0f;
  }
}

template <typename L>
__device__ __forceinline__ void HmmaMaskValues(const L& l, const AttendBlock& b, int tile,
                                               uint32_t (&vw)[4][L::VR::kWords]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int token = tile + 8 * (k >> 1) + 2 * l.t + (k & 1);
    const bool stored = token >= b.token_begin && token < b.token_end;
#pragma unroll
    for (int m = 0; m < L::VR::kWords; ++m) vw[k][m] = stored ? vw[k][m] : 0u;
  }
}

// The tile's max of rows 2t, 2t + 1 (lane groups g = 0..7 hold two tokens
// each); whether either grew past the row's running max.
__device__ __forceinline__ bool HmmaTileMax(const float (&c)[4], const float (&row_max)[2], float (&tile_max)[2]) {
  bool grew = false;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float m = fmaxf(c[e], c[2 + e]);
    m = fmaxf(m, __shfl_xor_sync(kFullWarp, m, 4));
    m = fmaxf(m, __shfl_xor_sync(kFullWarp, m, 8));
    tile_max[e] = fmaxf(m, __shfl_xor_sync(kFullWarp, m, 16));
    grew = grew || tile_max[e] > row_max[e];
  }
  return grew;
}

// A new running max: the sums and accumulators rescaled to it.
template <typename L>
__device__ __forceinline__ void HmmaRescale(const float (&tile_max)[2], L& l) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float new_max = fmaxf(l.row_max[e], tile_max[e]);
    const float alpha = l.row_max[e] == -INFINITY ? 0.0f : FastExp2((l.row_max[e] - new_max) * kLog2e);
    l.row_sum[e] *= alpha;
    l.zero_sum[e] *= alpha;
#pragma unroll
    for (int i = 0; i < L::kMTiles; ++i) {
      l.acc[i][e] *= alpha;
      l.acc[i][2 + e] *= alpha;
    }
    l.row_max[e] = new_max;
    l.max_log2[e] = new_max == -INFINITY ? 0.0f : new_max * kLog2e;
  }
}

// The tile's weights (base 2, against the running max): prob[2h + e] is
// token 8h + g's for row 2t + e, times the token's value scale.
template <typename L>
__device__ __forceinline__ void HmmaProbabilities(const float (&c)[4], const float (&scale)[2], const float (&zero)[2],
                                                  L& l, float (&prob)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int e = k & 1, h = k >> 1;
    prob[k] = FastExp2(fmaf(c[k], kLog2e, -l.max_log2[e]));
    l.row_sum[e] += prob[k];
    if constexpr (L::kUniform) l.zero_sum[e] = fmaf(prob[k], zero[h], l.zero_sum[e]);
    prob[k] *= scale[h];
  }
}

// P^T as B of the value product: lane (g, t) needs row g's P of tokens 2t,
// 2t + 1 (pb[0]) and 8 + 2t, 9 + 2t (pb[1]). Lane (2t, g / 2) holds row g's
// P of tokens 2t and 8 + 2t as the pair for row parity g & 1; lane (2t + 1,
// g / 2) those of 2t + 1 and 9 + 2t. bf16 pages take P in bf16 (as
// FlashAttention does: 8 significant bits on weights in [0, 1]).
template <bool kBf16>
__device__ __forceinline__ void HmmaTransposeP(const float (&prob)[4], int g, int t, uint32_t (&pb)[2]) {
  uint32_t mine[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    mine[e] = kBf16 ? PackBf162(prob[e], prob[2 + e]) : PackHalf2(prob[e], prob[2 + e]);
  }
  uint32_t x[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int source = 4 * (2 * t + k) + (g >> 1);
    const uint32_t even = __shfl_sync(kFullWarp, mine[0], source);
    const uint32_t odd = __shfl_sync(kFullWarp, mine[1], source);
    x[k] = (g & 1) ? odd : even;
  }
  pb[0] = BytePerm(x[0], x[1], 0x5410u);
  pb[1] = BytePerm(x[0], x[1], 0x7632u);
}

// out^T (value coordinates x rows) += V^T P^T.
template <typename L>
__device__ __forceinline__ void HmmaValues(const uint32_t (&vw)[4][L::VR::kWords], const uint32_t (&pb)[2], L& l) {
  using VR = typename L::VR;
  uint32_t va[2][L::kRun];
  const uint32_t* tables = PairTables<L::kDynamicTables>();
  ValuePairs<VR::kFormat, VR::kBits, VR::kDim>(vw[0], vw[1], l.value_lane_bits, tables, va[0]);
  ValuePairs<VR::kFormat, VR::kBits, VR::kDim>(vw[2], vw[3], l.value_lane_bits, tables, va[1]);
#pragma unroll
  for (int i = 0; i < L::kMTiles; ++i) {
    const uint32_t a[4] = {va[0][2 * i], va[0][2 * i + 1], va[1][2 * i], va[1][2 * i + 1]};
    Mma16<L::kBf16>(l.acc[i], a, pb);
  }
}

// Rows 2t, 2t + 1's sums over the eight lane groups, then the block's
// partial output and (max, sum) statistics.
template <typename L>
__device__ __forceinline__ void HmmaFinish(const AttendKernelParams& p, const AttendBlock& b, L& l) {
  constexpr int kDim = L::kDim;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) {
      l.row_sum[e] += __shfl_xor_sync(kFullWarp, l.row_sum[e], offset);
      l.zero_sum[e] += __shfl_xor_sync(kFullWarp, l.zero_sum[e], offset);
    }
  }
  float* stats = p.partial_stats + static_cast<int64_t>(b.partial) * kMaxBlockRows * 2;
  float* out = p.partial_acc + static_cast<int64_t>(b.partial) * kMaxBlockRows * kDim;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * l.t + e;
    if (r >= b.rows) continue;
    if (l.g == 0) {
      stats[2 * r] = l.row_max[e];
      stats[2 * r + 1] = l.row_sum[e];
    }
#pragma unroll
    for (int i = 0; i < L::kMTiles; ++i) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int j = 2 * i + u;  // run coordinate
        const float unit = L::kUniform ? 1.0f / UniformFactor<L::VR::kBits>(j) : 1.0f;
        out[r * kDim + l.g * L::kRun + j] = l.acc[i][2 * u + e] * unit + l.zero_sum[e];
      }
    }
  }
}

// The kernel's loop variants (its last template argument, from
// HmmaLoopFor): the general loop (any pages, the launch's add-back and
// soft-capping); and, for pages of one tile (the server's default: a tile's
// addresses are its page's) without soft-capping, a loop with no add-back
// and one with the mma add-back (exact for up to kAddBackMmaPairs pairs; an
// item with none adds zeros). Each keeps only its own branches: no per-tile
// tests of launch-wide settings.
constexpr int kHmmaGeneral = 0;
constexpr int kHmmaOneTilePlain = 1;
constexpr int kHmmaOneTileAddBack = 2;

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, int kDim, int kKeyBits, int kValueBits, int kLoop>
__global__ void __launch_bounds__(kHmmaWarps * 32, 2) AttendHmmaKernel(__grid_constant__ const AttendKernelParams p) {
  static_assert(kDim == 64 || kDim == 128 || kDim == 256, "head dims 64, 128, 256");
  static_assert((kKey == DeviceFieldFormat::kBf16) == (kValue == DeviceFieldFormat::kBf16),
                "bf16 keys go with bf16 values");
  using L = HmmaLane<kKey, kValue, kDim, kKeyBits, kValueBits>;
  constexpr bool kGeneral = kLoop == kHmmaGeneral;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int index = blockIdx.x * kHmmaWarps + warp;
  if (index >= p.num_blocks) return;  // a whole warp; the kernel has no block barrier
  const PoolView& view = p.view;
  const AttendBlock b = p.blocks[index];
  const AttendItemDesc item = p.items[b.item];
  const DeviceHead& head = view.heads[item.layer * view.num_kv_heads + b.kv_head];
  const int32_t* block_table = p.block_tables + (p.exact ? item.exact_block_table : item.block_table);
  const AddBackDesc addback =
      p.addback.heads != nullptr ? p.addback.heads[b.item * view.num_kv_heads + b.kv_head] : AddBackDesc();
  L l;
  HmmaSetup(p, b, item, head, warp, lane, l);
  // Tiles [first_full, last_full] lie inside the block and what every row
  // sees (row 0 sees the least): tile - full_base > full_span (unsigned)
  // says a tile is not one of them.
  const int group = view.num_query_heads / view.num_kv_heads;
  const int full_end = min(b.token_end, item.context_tokens - item.num_query_tokens + 1 + b.row0 / group);
  const int first_tile = b.token_begin & ~(kHmmaTile - 1);
  const int first_full = (b.token_begin + kHmmaTile - 1) & ~(kHmmaTile - 1);
  const int last_full = full_end - kHmmaTile;
  const uint32_t full_base = last_full >= first_full ? static_cast<uint32_t>(first_full) : 0x80000000u;
  const uint32_t full_span = last_full >= first_full ? static_cast<uint32_t>(last_full - first_full) : 0u;
  AddBackState addback_state;
  const bool addback_mma =
      kLoop == kHmmaOneTileAddBack || (kGeneral && addback.pairs > 0 && addback.pairs <= kAddBackMmaPairs);
  if (addback_mma) {
    AddBackSetup(p.addback, addback, b.row0, b.rows, l.g, l.t, addback_state);
    AddBackAnchor(first_tile, l.g, addback_state);
  }
  // The tiles' pages: tile `tile` is block_table[page]'s in_page-th.
  const uint32_t tiles_per_page = kGeneral ? view.page_tokens / kHmmaTile : 1;
  uint32_t page = first_tile / view.page_tokens;
  uint32_t in_page = kGeneral ? (first_tile - page * view.page_tokens) / kHmmaTile : 0;
  __syncwarp();  // the pair table is written

  for (int tile = first_tile; tile < b.token_end; tile += kHmmaTile) {
    const bool edge = static_cast<uint32_t>(tile) - full_base > full_span;  // one compare
    const HmmaTileAt at = HmmaAt(l, static_cast<uint32_t>(block_table[page]), in_page);
    const bool next_page = !kGeneral || ++in_page == tiles_per_page;
    page += next_page ? 1 : 0;
    in_page = next_page ? 0 : in_page;
    float c[4];
    HmmaLogits(l, at, c);
    float scale[2], zero[2];
    uint32_t vw[4][L::VR::kWords];
    if constexpr (!L::kLateValues) HmmaLoadValues(l, at, scale, zero, vw);
    if (addback_mma) {
      const bool anchor = (tile & (kAddBackAnchor - 1)) == 0;
      if (anchor) {
        AddBackAnchor(tile, l.g, addback_state);
      }
      AddBackMma(addback_state, c);
    } else if (kGeneral && addback.pairs > 0) {
      const int tok[2] = {tile + l.g, tile + 8 + l.g};
      MmaAddBack(p.addback, addback, b.row0, b.rows, tok, l.t, c);
    }
    if (kGeneral && p.softcap > 0.0f) {  // the same for the whole launch; masked after
#pragma unroll
      for (int k = 0; k < 4; ++k) c[k] = SoftCap(c[k], p.softcap, l.row_shift[k & 1]);
    }
    if constexpr (L::kLateValues) HmmaLoadValues(l, at, scale, zero, vw);
    if (edge) {
      HmmaMaskEdge(l, b, tile, c, scale, zero);
      HmmaMaskValues(l, b, tile, vw);
    }
    // The online softmax: rescaled only when a row's max grows.
    float tile_max[2];
    const bool grew = HmmaTileMax(c, l.row_max, tile_max);
    if (__any_sync(kFullWarp, grew)) HmmaRescale(tile_max, l);
    float prob[4];
    HmmaProbabilities(c, scale, zero, l, prob);
    uint32_t pb[2];
    HmmaTransposeP<L::kBf16>(prob, l.g, l.t, pb);
    HmmaValues(vw, pb, l);
  }
  HmmaFinish(p, b, l);
  if (LastSplitOfUnit(p.merge, b.unit, lane)) MergeUnitRows(p.merge, b.unit, 0, 1, lane);
}

}  // namespace
}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_ATTEND_HMMA_IMPL_CUH_
