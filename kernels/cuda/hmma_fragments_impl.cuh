// The fp16 tensor-core decode kernel's fragments from packed codes: lane
// runs of codes loaded and realigned, TurboQuant codes through per-warp
// tables of centroid pairs, uniform codes into the mantissa of 1024, fp8
// widened; the layout of AttendHmmaKernel (attend_hmma_impl.cuh, whose
// header comment states which lane holds what). Part of
// attend_kernels_impl.cuh's translation unit.
#ifndef TQKV_KERNELS_CUDA_HMMA_FRAGMENTS_IMPL_CUH_
#define TQKV_KERNELS_CUDA_HMMA_FRAGMENTS_IMPL_CUH_

#include <utility>

#include "kernels/cuda/attend_common_impl.cuh"

namespace tqkv {
namespace cuda {
namespace {

constexpr int kHmmaWarps = 4;
constexpr int kHmmaTile = 16;
constexpr int kPairTableWords = 2048;  // per warp (8 KB): pairs x copies
constexpr float kLog2e = 1.4426950408889634f;

// Copies of a kBits pair table that fit kPairTableWords, at most one per lane.
template <int kBits>
constexpr int PairCopies() {
  return (kPairTableWords >> (2 * kBits)) < 32 ? (kPairTableWords >> (2 * kBits)) : 32;
}
constexpr int Log2(int x) { return x <= 1 ? 0 : 1 + Log2(x / 2); }

template <DeviceFieldFormat kFormat>
constexpr bool IsRaw() {
  return kFormat == DeviceFieldFormat::kFp16 || kFormat == DeviceFieldFormat::kBf16 ||
         kFormat == DeviceFieldFormat::kFp8;
}

// Bits per coordinate of a field (the template argument of packed ones).
template <DeviceFieldFormat kFormat, int kBits>
constexpr int CoordBits() {
  return kFormat == DeviceFieldFormat::kFp8 ? 8 : IsRaw<kFormat>() ? 16 : kBits;
}

// Uniform codes are read two tokens at a time, by half-words of their runs:
// one PRMT pairs half h of both tokens (y_h: the first token's in the low
// half). Code j sits at bit p = kBits j % 16 of half h = kBits j / 16 and
// is OR'd into the 10-bit mantissa of 1024 at a place of its kind:
//   kDirect: it fits there as it sits (p + kBits <= 10), place p;
//   kHigh: from y_h shifted down by HighShift(h) (the first such code's p);
//   kBytes: a 3-bit code across two half-words of one word, from a PRMT of
//     its two bytes, place kBits j % 8;
//   kSplice: one across two words, spliced from y_h and y_(h + 1), place 0.
// A code at coordinate j of a lane's run is read times UniformFactor(j), a
// power of two the output undoes.
enum UniformCodeKind { kDirect, kHigh, kBytes, kSplice };

template <int kBits>
constexpr UniformCodeKind CodeKind(int j) {
  const int p = kBits * j % 16;
  if (p + kBits <= 10) return kDirect;
  if (p + kBits <= 16) return kHigh;
  return kBits * j / 8 % 4 != 3 ? kBytes : kSplice;
}

template <int kBits>
constexpr int HighShift(int h) {
  for (int j = (16 * h + kBits - 1) / kBits; kBits * j < 16 * (h + 1); ++j) {
    if (CodeKind<kBits>(j) == kHigh) return kBits * j % 16;
  }
  return 0;
}

template <int kBits>
constexpr int UniformPlace(int j) {
  const int p = kBits * j % 16;
  switch (CodeKind<kBits>(j)) {
    case kDirect:
      return p;
    case kHigh:
      return p - HighShift<kBits>(kBits * j / 16);
    case kBytes:
      return kBits * j % 8;
    default:
      return 0;
  }
}

// Where code j of the first token sits in the word UniformCode reads it
// from (the second token's 16 bits higher): before any shift down.
template <int kBits>
constexpr int CodeSourceBit(int j) {
  const UniformCodeKind kind = CodeKind<kBits>(j);
  return kind == kDirect || kind == kHigh ? kBits * j % 16 : kind == kBytes ? kBits * j % 8 : 0;
}

template <int kBits>
constexpr float UniformFactor(int j) {
  return static_cast<float>(1 << UniformPlace<kBits>(j));
}

// Words a lane loads to hold its run of kRunBits bits, whatever its shift
// ((lane * kRunBits) % 32), over kLanes lanes that split a token's codes.
template <int kRunBits, int kLanes>
constexpr int RunLoadWords() {
  int most = 0;
  for (int l = 0; l < kLanes; ++l) {
    const int need = ((l * kRunBits) % 32 + kRunBits + 31) / 32;
    most = need > most ? need : most;
  }
  return most;
}

// Whether the last lane's RunLoadWords reach past the token's words: then
// the words past them are not loaded (a compare a word; no preset's shape).
template <int kRunBits, int kLanes>
constexpr bool RunOverhangs() {
  return ((kLanes - 1) * kRunBits) / 32 + RunLoadWords<kRunBits, kLanes>() > (kLanes * kRunBits + 31) / 32;
}

// A lane's run of kRunBits bits (of kLanes lanes' runs, one token's codes),
// as words (bit 0 of w[0] = bit `shift` of the word at `word`). Word k of
// the token sits kStride * k bytes on (tiled planes: 64 bytes a word,
// token-major: 4); `k0` is the lane's first word.
template <int kRunBits, int kLanes, int kStride>
__device__ __forceinline__ void LoadRun(const uint8_t* word, int k0, int shift, uint32_t (&w)[(kRunBits + 31) / 32]) {
  constexpr int kWords = (kRunBits + 31) / 32;
  constexpr int kLoad = RunLoadWords<kRunBits, kLanes>();
  constexpr int kTokenWords = (kLanes * kRunBits + 31) / 32;
  if constexpr (kRunBits % 32 == 0) {
    // Runs start on word boundaries: shift is 0.
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = *reinterpret_cast<const uint32_t*>(word + k * kStride);
  } else {
    uint32_t raw[kWords + 1];
#pragma unroll
    for (int k = 0; k <= kWords; ++k) {
      const bool load = k < kLoad && (!RunOverhangs<kRunBits, kLanes>() || k0 + k < kTokenWords);
      raw[k] = load ? *reinterpret_cast<const uint32_t*>(word + k * kStride) : 0u;
    }
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = __funnelshift_r(raw[k], raw[k + 1], shift);
  }
}

// Bits [bit, bit + 32) of a run of words (zeros past its end).
template <int kWords>
__device__ __forceinline__ uint32_t RunBits(const uint32_t (&w)[kWords], int bit) {
  const int k = bit >> 5, s = bit & 31;
  if (s == 0) return w[k];
  return k + 1 < kWords ? __funnelshift_r(w[k], w[k + 1], s) : w[k] >> s;
}

// Split keys (two TurboQuant parts: the hot half of the channels at more
// bits) are kernel instances whose key bits are the format table's split
// width, SplitKeyBits(hot, cold) (43: 4 | 3 bits, 32: 3 | 2).
constexpr int KeyParts(DeviceFieldFormat key, int key_bits) {
  return key == DeviceFieldFormat::kTurboQuant && IsSplitKeyBits(key_bits) ? 2 : 1;
}
constexpr int KeyPartBits(DeviceFieldFormat key, int key_bits, int part) {
  return KeyParts(key, key_bits) == 1 ? key_bits : part == 0 ? key_bits / 10 : key_bits % 10;
}

// Per warp: a TurboQuant codebook's centroid pairs (FillPairTable), keys'
// (warp w: table w), with TurboQuant values values' (kHmmaWarps + w), and
// split keys' part 1 after those, from the first address of the array
// aligned to a table's size, so that a lookup's address is the pair's bits
// OR'd into the lane's copy (one LOP3, no add): the tables' memory holds
// one table more than the warps use. One table a warp: a static array that
// only the kernels that read it allocate; more: dynamic shared memory
// (HmmaTablesBytes: 72 KiB for two, 104 KiB for three, past a kernel's 48
// KiB of static shared memory: the launch opts in, HmmaDynamicShared).
constexpr uint32_t kPairTableBytes = 4 * kPairTableWords;
__shared__ uint32_t hmma_pair_tables[(kHmmaWarps + 1) * kPairTableWords];

// Pair tables per warp of an instance: keys' parts with TurboQuant keys,
// one more with TurboQuant values.
constexpr int HmmaTables(DeviceFieldFormat key, DeviceFieldFormat value, int key_bits) {
  return (key == DeviceFieldFormat::kTurboQuant ? KeyParts(key, key_bits) : 0) +
         (value == DeviceFieldFormat::kTurboQuant ? 1 : 0);
}

// Dynamic shared memory of an instance with `tables` tables a warp (none
// for one or none: the static array).
constexpr size_t HmmaTablesBytes(int tables) {
  return tables > 1 ? (static_cast<size_t>(tables) * kHmmaWarps + 1) * kPairTableBytes : 0;
}

template <bool kDynamic>
__device__ __forceinline__ uint32_t* PairTables() {
  if constexpr (kDynamic) {
    return reinterpret_cast<uint32_t*>(DynamicSharedFloats());
  } else {
    return hmma_pair_tables;
  }
}

// Bytes per token of a field's codes (AttendHmmaShape checks the layout's).
template <DeviceFieldFormat kFormat, int kBits, int kDim>
constexpr int CodeBytes() {
  return kDim * CoordBits<kFormat, kBits>() / 8;
}

// A lane's run of one token's codes: the token's kDim coordinates split
// among kLanes lanes (keys: the four lanes t of a lane group; values: the
// eight lane groups g), kCoords in a row each, kRunBits in kWords words.
template <DeviceFieldFormat kFormat_, int kBits_, int kDim_, int kLanes_>
struct LaneRun {
  static constexpr DeviceFieldFormat kFormat = kFormat_;
  static constexpr int kBits = kBits_;
  static constexpr int kDim = kDim_;
  static constexpr int kLanes = kLanes_;
  static constexpr int kCoords = kDim / kLanes;
  static constexpr int kRunBits = kCoords * CoordBits<kFormat, kBits>();
  static constexpr int kWords = (kRunBits + 31) / 32;
};

template <DeviceFieldFormat kKey, int kBits, int kDim>
using KeyRun = LaneRun<kKey, kBits, kDim, 4>;
template <DeviceFieldFormat kValue, int kBits, int kDim>
using ValueRun = LaneRun<kValue, kBits, kDim, 8>;

// The key fragments of one token (b[i] for k-step i) from its lane run:
// kKey's coordinates as fp16 / bf16 pairs.
// b[i][0..1] for one token: k-step i covers run coordinates 4i .. 4i + 3.
template <DeviceFieldFormat kKey, int kBits, int kDim>
__device__ __forceinline__ void KeyFragments(const uint32_t (&w)[KeyRun<kKey, kBits, kDim>::kWords], uint32_t lane_bits,
                                             const uint32_t* tables, uint32_t (&b)[kDim / 16][2]) {
  constexpr int kSteps = kDim / 16;
  if constexpr (kKey == DeviceFieldFormat::kFp16 || kKey == DeviceFieldFormat::kBf16) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      b[i][0] = w[2 * i];
      b[i][1] = w[2 * i + 1];
    }
  } else if constexpr (kKey == DeviceFieldFormat::kFp8) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      b[i][0] = Fp8x2ToHalf2(w[i]);
      b[i][1] = Fp8x2ToHalf2(w[i] >> 16);
    }
  } else {
    constexpr int kShift = Log2(PairCopies<kBits>()) + 2;
    constexpr uint32_t kMask = ((1u << (2 * kBits)) - 1u) << kShift;
#pragma unroll
    for (int p = 0; p < 2 * kSteps; ++p) {
      // The pair's bits moved to kShift in one shift: one funnel (or plain)
      // shift, then one LOP3 masks it and adds the lane's copy.
      const int bit = 2 * kBits * p - kShift;
      const uint32_t x = bit >= 0 ? RunBits(w, bit) : w[0] << -bit;
      const uint32_t offset = (x & kMask) | lane_bits;
      b[p >> 1][p & 1] = LoadShared32(tables, offset);
    }
  }
}

// The word holding code j of two tokens' runs a, b (realigned words): the
// first token's at CodeSourceBit(j), the second's 16 bits higher (a
// kHigh code still to be shifted down by HighShift), from their half-words
// y and y's shifted ones.
template <int kBits, int kJ, int kWords, int kHalves>
__device__ __forceinline__ uint32_t CodeSource(const uint32_t (&a)[kWords], const uint32_t (&b)[kWords],
                                               const uint32_t (&y)[kHalves], const uint32_t (&high)[kHalves]) {
  constexpr int kBit = kBits * kJ, kHalf = kBit / 16, kP = kBit % 16;
  constexpr UniformCodeKind kKind = CodeKind<kBits>(kJ);
  if constexpr (kKind == kDirect) {
    return y[kHalf];
  } else if constexpr (kKind == kHigh) {
    return high[kHalf];
  } else if constexpr (kKind == kBytes) {
    constexpr uint32_t kB = kBit / 8 % 4;
    return BytePerm(a[kBit / 32], b[kBit / 32], kB | (kB + 1) << 4 | (kB + 4) << 8 | (kB + 5) << 12);
  } else {
    constexpr uint32_t kLow = ((1u << (16 - kP)) - 1u) * 0x00010001u;  // bits from half kHalf
    return ((y[kHalf] >> kP) & kLow) | ((y[kHalf + 1] << (16 - kP)) & ~kLow);
  }
}

// Code j of two tokens' runs as an exact fp16 pair code * UniformFactor(j).
template <int kBits, int kJ, int kWords, int kHalves>
__device__ __forceinline__ uint32_t UniformCode(const uint32_t (&a)[kWords], const uint32_t (&b)[kWords],
                                                const uint32_t (&y)[kHalves], const uint32_t (&high)[kHalves]) {
  constexpr uint32_t kCode = ((1u << kBits) - 1u) * 0x00010001u;
  const uint32_t magic = 0x64006400u;  // 1024 in both halves (in a register: AndOr is one LOP3)
  const uint32_t x = CodeSource<kBits, kJ>(a, b, y, high);
  return Half2Sub(AndOr<(kCode << UniformPlace<kBits>(kJ))>(x, magic), magic);
}

// Code j of two tokens' runs as the fp16 pair of its centroids, from the
// values' pair table: the second token's code moved next to the first's
// (one LOP3 on the source word and its copy 16 - kBits bits down), the
// pair to the table's index bits, then as KeyFragments' lookups.
template <int kBits, int kJ, int kWords, int kHalves>
__device__ __forceinline__ uint32_t CentroidPair(const uint32_t (&a)[kWords], const uint32_t (&b)[kWords],
                                                 const uint32_t (&y)[kHalves], uint32_t lane_bits,
                                                 const uint32_t* tables) {
  constexpr int kQ = CodeSourceBit<kBits>(kJ);
  constexpr uint32_t kFirst = ((1u << kBits) - 1u) << kQ;
  constexpr int kShift = Log2(PairCopies<kBits>()) + 2;
  constexpr uint32_t kMask = ((1u << (2 * kBits)) - 1u) << kShift;
  const uint32_t x = CodeSource<kBits, kJ>(a, b, y, y);  // kHigh codes read from y: no shift down
  const uint32_t pair = (x & kFirst) | ((x >> (16 - kBits)) & ~kFirst);
  const uint32_t moved = kQ >= kShift ? pair >> (kQ - kShift) : pair << (kShift - kQ);
  return LoadShared32(tables, (moved & kMask) | lane_bits);
}

template <int kBits, int kWords, int kHalves, int... kJ>
__device__ __forceinline__ void UniformCodes(const uint32_t (&a)[kWords], const uint32_t (&b)[kWords],
                                             const uint32_t (&y)[kHalves], const uint32_t (&high)[kHalves],
                                             uint32_t (&out)[sizeof...(kJ)], std::integer_sequence<int, kJ...>) {
  ((out[kJ] = UniformCode<kBits, kJ>(a, b, y, high)), ...);
}

template <int kBits, int kWords, int kHalves, int... kJ>
__device__ __forceinline__ void CentroidPairs(const uint32_t (&a)[kWords], const uint32_t (&b)[kWords],
                                              const uint32_t (&y)[kHalves], uint32_t lane_bits, const uint32_t* tables,
                                              uint32_t (&out)[sizeof...(kJ)], std::integer_sequence<int, kJ...>) {
  ((out[kJ] = CentroidPair<kBits, kJ>(a, b, y, lane_bits, tables)), ...);
}

// Codes j of two tokens' runs (words realigned to the run's first bit) as
// fp16 pairs: uniform codes exact, code * UniformFactor(j); TurboQuant
// codes (kCentroids) their centroids from the pair table.
template <bool kCentroids, int kBits, int kCoords, int kWords>
__device__ __forceinline__ void CodePairs(const uint32_t (&a)[kWords], const uint32_t (&b)[kWords], uint32_t lane_bits,
                                          const uint32_t* tables, uint32_t (&out)[kCoords]) {
  static_assert(kBits >= 2 && kBits <= 4, "codes of 2, 3 or 4 bits");
  constexpr int kHalves = (kCoords * kBits + 15) / 16;
  uint32_t y[kHalves], high[kHalves];
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    y[h] = BytePerm(a[h / 2], b[h / 2], h % 2 == 0 ? 0x5410u : 0x7632u);
    high[h] = y[h] >> HighShift<kBits>(h);
  }
  if constexpr (kCentroids) {
    CentroidPairs<kBits>(a, b, y, lane_bits, tables, out, std::make_integer_sequence<int, kCoords>());
  } else {
    UniformCodes<kBits>(a, b, y, high, out, std::make_integer_sequence<int, kCoords>());
  }
}

// Value fragment pairs of two tokens' runs a, b (out[j]: coordinate j of
// the lane group's run, the first token's in the low half): raw 16-bit
// values paired, fp8 widened, codes as CodePairs.
template <DeviceFieldFormat kValue, int kBits, int kDim>
__device__ __forceinline__ void ValuePairs(const uint32_t (&a)[ValueRun<kValue, kBits, kDim>::kWords],
                                           const uint32_t (&b)[ValueRun<kValue, kBits, kDim>::kWords],
                                           uint32_t lane_bits, const uint32_t* tables, uint32_t (&out)[kDim / 8]) {
  constexpr int kCoords = kDim / 8;
  constexpr int kWords = ValueRun<kValue, kBits, kDim>::kWords;
  if constexpr (kValue == DeviceFieldFormat::kFp16 || kValue == DeviceFieldFormat::kBf16) {
#pragma unroll
    for (int m = 0; m < kWords; ++m) {
      out[2 * m] = BytePerm(a[m], b[m], 0x5410u);
      out[2 * m + 1] = BytePerm(a[m], b[m], 0x7632u);
    }
  } else if constexpr (kValue == DeviceFieldFormat::kFp8) {
#pragma unroll
    for (int j = 0; j < kCoords; ++j) {
      const uint32_t selector = static_cast<uint32_t>(j % 4) | (static_cast<uint32_t>(4 + j % 4) << 4);
      out[j] = Fp8x2ToHalf2(BytePerm(a[j / 4], b[j / 4], selector));
    }
  } else {
    CodePairs<kValue == DeviceFieldFormat::kTurboQuant, kBits, kCoords, kWords>(a, b, lane_bits, tables, out);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_HMMA_FRAGMENTS_IMPL_CUH_
