// AVX-512 integer attention for TurboQuant pages (centroid keys, or split
// keys as two parts with their own codebooks, scales and int8 query units;
// centroid or uniform values; 2-4 bits; head_dim 64 or a multiple of 128; see
// AttendHeadAvx512VnniSupported), on CPUs with VNNI and VBMI. The fp32
// kernels spend 2 x rows x head_dim FMA lanes per token and head; this one
// spends a quarter of that on scores and on values:
//
// - Scores with vpdpbusd (64 byte products per instruction). The codebook is
//   one table for every coordinate, so a code becomes its centroid as an
//   unsigned byte with one vpermb; the query is rounded to int8 once per
//   call. Codes are unpacked in registers: one vector holds the codes of 64
//   coordinates of two tokens (HalfSegments), vpermb gathers the bytes of
//   eight codes into each qword, vpmultishiftqb moves each code to its own
//   byte. A vector holds 32 coordinates of two tokens; the dot products of a
//   row reduce with one transpose-add per 8 or 16 tokens. (vpermb rather
//   than the two-source vpermt2b: on Intel cores the latter is two uops.)
// - Values with vpdpbusd too, four tokens per instruction: a vector holds 16
//   coordinates of four tokens as signed bytes (lane i: coordinate i of
//   each; vpermb gathers, vpmultishiftqb aligns, then a mask for uniform
//   codes or vpermb onto the centroids in int8), times the dword of the four
//   tokens' softmax weights (times their scales) in unsigned 8-bit fixed
//   point per row and block, the rounding error carried from token to token.
//   Per token and 4-row tile and 128 coordinates that is 8 dot products and
//   6 shuffles, against 16 and 12 for pairs of int16 words (vpdpwssd), which
//   this kernel used before 2026-12-03. (Not vdpbf16ps: on Intel cores it
//   runs at one every two cycles, a quarter of vpdpwssd's rate, measured on
//   this project's Xeon.)
//
// Its error against exact attention over the same bytes, and why it sits far
// inside the codec's own error, is stated in attend_kernels.h.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/addback_table.h"
#include "kernels/cpu/attend_avx512_common.h"
#include "kernels/cpu/attend_kernels.h"

namespace tqkv {
namespace cpu_internal {
namespace {

using avx512::AddBack;
using avx512::Exp;
using avx512::LoadScalars;
using avx512::Max;
using avx512::Sum;

constexpr int kBlock = 64;     // tokens per online-softmax step
constexpr int kGroup = 16;     // tokens per score vector
constexpr int kSegment = 128;  // coordinates whose codes one pair of loads covers

// The code bytes [offset, offset + n) of token a in bytes 0 ... n - 1 and of
// token b in bytes 32 ... 32 + n - 1 (n <= 32: 64 coordinates of at most 4
// bits), zeros elsewhere; `mask` has the low n bits set. Masked loads: no
// byte past a token's codes is read.
inline __m512i HalfSegments(const uint8_t* a, const uint8_t* b, int offset, __mmask32 mask) {
  return _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_maskz_loadu_epi8(mask, a + offset)),
                            _mm256_maskz_loadu_epi8(mask, b + offset), 1);
}
inline __mmask32 LowBytes(int n) { return n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1; }

// acc + the byte dot products (vpdpbusd) of unsigned k with the signed bytes
// at q, read from memory by the instruction itself: left to the compiler,
// the 16 query vectors a tile shares would be hoisted into registers and
// spill the accumulators.
inline __m512i DotBytes(__m512i acc, __m512i k, const uint8_t* q) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(k), "m"(*reinterpret_cast<const __m512i*>(q)));
  return acc;
}

// acc + the byte dot products (vpdpbusd) of the unsigned weights w with
// the signed value bytes v. GCC 12's intrinsic copies its accumulator at
// every call, which spilled a tile's 16.
inline __m512i DotWeights(__m512i acc, __m512i w, __m512i v) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(v));
  return acc;
}

// The integer dot products of kPairs pairs of tokens with one row, given
// acc[p] (lanes 0-7: partial sums of the pair's first token, 8-15: of its
// second), reduced so that lane i holds token i of the tile (tokens p and
// p + 4 form pair p of a tile of 8; tokens kPairFirst16[p] and that + 4 of a
// tile of 16).
template <int kPairs>
inline __m512i SumPairs(const __m512i* acc) {
  __m512i a[kPairs / 2];
  for (int i = 0; i < kPairs / 2; ++i) {
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2 * i], acc[2 * i + 1]),
                            _mm512_unpackhi_epi32(acc[2 * i], acc[2 * i + 1]));
  }
  __m512i b[kPairs / 4];
  for (int i = 0; i < kPairs / 4; ++i) {
    b[i] =
        _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  }
  // 128-bit lane j of b[i] holds partial sums (over that lane) of pairs
  // 4i ... 4i + 3: lanes 0 and 1 belong to the pairs' first tokens.
  if constexpr (kPairs == 8) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88), _mm512_shuffle_i32x4(b[0], b[1], 0xdd));
  } else {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[0], 0x88), _mm512_shuffle_i32x4(b[0], b[0], 0xdd));
  }
}
constexpr int kPairFirst16[8] = {0, 1, 2, 3, 8, 9, 10, 11};

// b-bit key codes as unsigned bytes: 32 coordinates of two tokens per
// vector, each the centroid + 128 in units of key_unit().
template <int kBits>
struct KeyIndex {
  // Qword k of chunk m of a half segment (HalfSegments) gathers the kBits
  // bytes of codes 32 m + 8 (k % 4) ... + 7 of token k / 4 (bytes 32 and
  // up: the second token); vpmultishiftqb then takes byte i of a qword from
  // bit kBits * i.
  alignas(64) uint8_t gather[2][64] = {};
  alignas(64) uint8_t shift[64] = {};
  constexpr KeyIndex() {
    for (int m = 0; m < 2; ++m) {
      for (int k = 0; k < 8; ++k) {
        for (int i = 0; i < 8; ++i) {
          const int from = 4 * kBits * m + kBits * (k % 4) + (i < kBits - 1 ? i : kBits - 1);
          gather[m][8 * k + i] = static_cast<uint8_t>(from + (k / 4) * 32);
        }
      }
    }
    for (int i = 0; i < 64; ++i) shift[i] = static_cast<uint8_t>(kBits * (i % 8));
  }
};
template <int kBits>
inline constexpr KeyIndex<kBits> kKeyIndex{};

// IntegerKeyUnit for the codebook this thread saw last in slot kSlot (0:
// keys, 1: values; every layer and head of a layout shares one codebook per
// bit width and field).
template <int kSlot>
float CachedIntegerUnit(const float* centroids, int count) {
  thread_local float seen[16], unit = 0.0f;
  thread_local int seen_count = 0;
  if (count != seen_count || memcmp(seen, centroids, sizeof(float) * count) != 0) {
    memcpy(seen, centroids, sizeof(float) * count);
    seen_count = count;
    unit = IntegerKeyUnit(centroids, count);
  }
  return unit;
}

template <int kBits>
class KeyCodes {
 public:
  explicit KeyCodes(const float* centroids) {
    for (int m = 0; m < 2; ++m) gather_[m] = _mm512_load_si512(kKeyIndex<kBits>.gather[m]);
    shift_ = _mm512_load_si512(kKeyIndex<kBits>.shift);
    // vpermb reads index bits [5:0]: repeating the 2^b entries over 64 makes
    // the bits of the next code above a code irrelevant.
    unit_ = CachedIntegerUnit<0>(centroids, 1 << kBits);
    alignas(64) uint8_t table[64];
    for (int i = 0; i < 64; ++i) {
      const float c = centroids[i % (1 << kBits)] / unit_;
      table[i] = static_cast<uint8_t>(128 + static_cast<int>(std::lrint(std::clamp(c, -127.0f, 127.0f))));
    }
    table_ = _mm512_load_si512(table);
  }

  // What a byte stands for: centroid = unit() * (byte - 128).
  float unit() const { return unit_; }

  // Chunk m (coordinates 32 m ... + 31 of a half segment) of tokens a
  // (bytes 0-31) and b (bytes 32-63), given their HalfSegments.
  __m512i Chunk(__m512i halves, int m) const {
    const __m512i gathered = _mm512_permutexvar_epi8(gather_[m], halves);
    return _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shift_, gathered), table_);
  }

  // Code bytes of a half segment (64 coordinates).
  static constexpr int kHalfBytes = 8 * kBits;

 private:
  __m512i gather_[2], shift_, table_;
  float unit_;
};

// b-bit value codes of four tokens as signed bytes, 16 coordinates per
// vector: dword i holds coordinate i of tokens 0-3 (byte t: token t), for
// vpdpbusd against the dword of the four tokens' unsigned 8-bit weights.
// Uniform codes are read as they are, centroids in units of unit() (at most
// 127: IntegerKeyUnit).
//
// A quarter is 32 coordinates of a token, 4 b bytes. QuadQuarter loads 16
// bytes per token into lane t of a vector: the quarter's bytes, or for a
// token's last quarter (when fewer than 16 bytes follow its start) the 16
// that end with it, so no load crosses the token's codes; kLateShift is
// where that quarter's bytes start then.
template <int kBits>
struct QuadIndex {
  static constexpr int kQuarterBytes = 4 * kBits;
  static constexpr int kLateShift = 16 - kQuarterBytes;
  // gather[late][h][8 j + 2 t + k]: qword j of half h (coordinates 16 h +
  // 2 j and + 1 of the quarter) takes, in bytes 2 t and 2 t + 1, the two
  // bytes of token t in which those two codes lie (the second may belong to
  // the next code or token: shifted or looked up away).
  alignas(64) uint8_t gather[2][2][64] = {};
  // shift[8 j + i]: vpmultishiftqb takes byte i of qword j (token i % 4,
  // coordinate 2 j + i / 4 of the half) from this bit of the qword.
  alignas(64) uint8_t shift[64] = {};
  constexpr QuadIndex() {
    for (int late = 0; late < 2; ++late) {
      for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 8; ++j) {
          const int byte = kBits * (16 * h + 2 * j) / 8 + (late ? kLateShift : 0);
          for (int t = 0; t < 4; ++t) {
            for (int k = 0; k < 2; ++k) gather[late][h][8 * j + 2 * t + k] = static_cast<uint8_t>((16 * t + byte + k) % 64);
          }
        }
      }
    }
    for (int j = 0; j < 8; ++j) {
      const int bit = (kBits * 2 * j) % 8;  // the same in both halves: 16 b bits are whole bytes
      for (int i = 0; i < 8; ++i) shift[8 * j + i] = static_cast<uint8_t>(16 * (i % 4) + bit + kBits * (i / 4));
    }
  }
};
template <int kBits>
inline constexpr QuadIndex<kBits> kQuadIndex{};

template <FieldFormat kFormat, int kBits>
class ValueCodes {
 public:
  static constexpr int kQuarterBytes = QuadIndex<kBits>::kQuarterBytes;

  explicit ValueCodes(const float* centroids) {
    shift_ = _mm512_load_si512(kQuadIndex<kBits>.shift);
    if constexpr (kFormat == FieldFormat::kCentroids) {
      // vpermb reads index bits [5:0]: the 2^b entries repeat over 64, so the
      // bits above a code do not matter.
      unit_ = CachedIntegerUnit<1>(centroids, 1 << kBits);
      alignas(64) int8_t table[64];
      for (int i = 0; i < 64; ++i) {
        const float c = centroids[i % (1 << kBits)] / unit_;
        table[i] = static_cast<int8_t>(std::lrint(std::clamp(c, -127.0f, 127.0f)));
      }
      table_ = _mm512_load_si512(table);
    }
  }

  // What a byte stands for: value = unit() * byte (before the token's scale
  // and, for uniform codes, its zero).
  float unit() const { return unit_; }

  // The gather of half h of quarter `quarter` of a token with `quarters`.
  static __m512i Gather(int quarter, int quarters, int h) {
    const bool late = quarter == quarters - 1 && kQuarterBytes < 16;
    return _mm512_load_si512(kQuadIndex<kBits>.gather[late][h]);
  }
  // Where QuadQuarter loads quarter `quarter` of a token from.
  static int QuarterOffset(int quarter, int quarters) {
    const bool late = quarter == quarters - 1 && kQuarterBytes < 16;
    return kQuarterBytes * quarter - (late ? QuadIndex<kBits>::kLateShift : 0);
  }

  // 16 bytes of each of four tokens' codes from `offset`, token t in lane t.
  static __m512i QuadQuarter(const uint8_t* const* codes, int offset) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[0] + offset)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[1] + offset)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[2] + offset)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[3] + offset)), 3);
  }

  // Half h of a quarter of four tokens (QuadQuarter), given Gather(..., h).
  __m512i Half(__m512i quarter, __m512i gather) const {
    const __m512i codes = _mm512_multishift_epi64_epi8(shift_, _mm512_permutexvar_epi8(gather, quarter));
    if constexpr (kFormat == FieldFormat::kUniform) {
      return _mm512_and_si512(codes, _mm512_set1_epi8((1 << kBits) - 1));
    } else {
      return _mm512_permutexvar_epi8(codes, table_);
    }
  }

 private:
  __m512i shift_, table_;
  float unit_ = 1.0f;
};

// Where each token of a block lives, and its scalars.
struct BlockTokens {
  const uint8_t* key_codes[kBlock];
  const uint8_t* value_codes[kBlock];
  alignas(64) float key_scale[kBlock];       // split keys: the hot part's
  alignas(64) float key_cold_scale[kBlock];  // split keys: the cold part's
  alignas(64) float value_scale[kBlock];
  alignas(64) float value_zero[kBlock];  // uniform values: x = scale * code + zero
};

// Per-thread room for the int8 queries (rows x 2 d bytes).
uint8_t* QueryBytes(size_t n) {
  thread_local std::vector<uint8_t> scratch;
  if (scratch.size() < n + 64) scratch.resize(n + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
}

// The coordinates of a key that one codebook and one stored scale cover:
// all of them, or (split keys) the hot part and then the cold part, each 64
// coordinates or a multiple of 128.
struct KeyPart {
  int begin = 0;        // first coordinate (of the rotated query)
  int dims = 0;
  int code_offset = 0;  // bytes from a token's codes to this part's
};

// kKeyBits: the key codes' bits, or for split keys 10 x hot bits + cold bits.
template <int kKeyBits, FieldFormat kValue, int kValueBits>
struct Kernel {
  static constexpr bool kUniform = kValue == FieldFormat::kUniform;
  static constexpr bool kSplit = kKeyBits >= 10;
  static constexpr int kParts = kSplit ? 2 : 1;
  static constexpr int kHotBits = kSplit ? kKeyBits / 10 : kKeyBits;
  static constexpr int kColdBits = kSplit ? kKeyBits % 10 : kKeyBits;
  // The int8 query: row r, coordinates 128 s ... + 127 (of a part or not),
  // chunk m is 64 bytes at q8 + r * 2d + 256 s + 64 m: its 32 coordinates
  // twice.
  const HeadAttendParams& p;
  const int d;
  const KeyCodes<kHotBits> keys;        // every coordinate's, or the hot part's
  const KeyCodes<kColdBits> cold_keys;  // split keys: the cold part's
  KeyPart parts[kParts];
  const ValueCodes<kValue, kValueBits> values;

  Kernel(const HeadAttendParams& params)
      : p(params),
        d(params.head_dim),
        keys(params.key.centroids),
        cold_keys(kSplit ? params.key.cold_centroids : params.key.centroids),
        values(params.value.centroids) {
    if constexpr (kSplit) {
      parts[0] = {0, params.key.hot_dims, 0};
      parts[1] = {params.key.hot_dims, d - params.key.hot_dims, params.key.cold_code_offset};
    } else {
      parts[0] = {0, d, 0};
    }
  }

  float KeyUnit(int part) const { return part == 0 ? keys.unit() : cold_keys.unit(); }

  // Raw scores of one key part for a tile (ScoreTile).
  template <int kRows>
  void ScorePart(int part, const uint8_t* const* codes, const uint8_t* q8, int32_t* raw) const {
    const KeyPart& kp = parts[part];
    const uint8_t* q = q8 + 2 * kp.begin;
    const int part_segments = (kp.dims + kSegment - 1) / kSegment;
    if (part == 0) {
      if (kp.dims == 64) {
        ScoreTile<kRows, 2>(keys, part_segments, kp.code_offset, codes, q, raw);
      } else {
        ScoreTile<kRows, 4>(keys, part_segments, kp.code_offset, codes, q, raw);
      }
    } else if constexpr (kSplit) {
      if (kp.dims == 64) {
        ScoreTile<kRows, 2>(cold_keys, part_segments, kp.code_offset, codes, q, raw);
      } else {
        ScoreTile<kRows, 4>(cold_keys, part_segments, kp.code_offset, codes, q, raw);
      }
    }
  }

  // Raw integer scores (before the +128 correction) of kRows rows with a
  // tile of 2 * kPairs tokens (kPairs = 4 for 4 rows, else 8: 16
  // accumulators or fewer), into raw[r * kBlock + i]. Every loop but the
  // segments' has a compile-time count, so the accumulators stay in registers.
  template <int kRows, int kChunks, int kBits>
  void ScoreTile(const KeyCodes<kBits>& part_keys, int part_segments, int code_offset, const uint8_t* const* codes,
                 const uint8_t* q8, int32_t* raw) const {
    constexpr int kPairs = kRows == 4 ? 4 : 8;
    __m512i acc[kRows][kPairs];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
      for (int pair = 0; pair < kPairs; ++pair) acc[r][pair] = _mm512_setzero_si512();
    }
    constexpr int kHalfBytes = KeyCodes<kBits>::kHalfBytes;
    const __mmask32 mask = LowBytes(kHalfBytes);
    for (int s = 0; s < part_segments; ++s) {
#pragma GCC unroll 8
      for (int pair = 0; pair < kPairs; ++pair) {
        const int first = kPairs == 8 ? kPairFirst16[pair] : pair;
#pragma GCC unroll 2
        for (int h = 0; h < kChunks / 2; ++h) {
          const __m512i halves =
              HalfSegments(codes[first], codes[first + 4], code_offset + 16 * kBits * s + kHalfBytes * h, mask);
#pragma GCC unroll 2
          for (int m2 = 0; m2 < 2; ++m2) {
            const __m512i k = part_keys.Chunk(halves, m2);
            const int m = 2 * h + m2;
#pragma GCC unroll 4
            for (int r = 0; r < kRows; ++r) {
              acc[r][pair] = DotBytes(acc[r][pair], k, q8 + static_cast<size_t>(r) * 2 * d + 256 * s + 64 * m);
            }
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512i sums = SumPairs<kPairs>(acc[r]);
      if constexpr (kPairs == 8) {
        _mm512_storeu_si512(raw + r * kBlock, sums);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(raw + r * kBlock), _mm512_castsi512_si256(sums));
      }
    }
  }

  // out[r][32 (q0 + i) + c] += the sum over the block's quads of tokens of
  // weight x value, for kRows rows and kQuarters quarters (32 coordinates
  // each) from quarter q0: int32 accumulators of signed value bytes times
  // unsigned 8-bit weights (in units of weight_unit[r]).
  template <int kRows, int kQuarters>
  void ValueTile(const uint8_t* const* codes, int quads, const uint8_t* weights, const float* weight_unit, int q0,
                 float* out) const {
    using Codes = ValueCodes<kValue, kValueBits>;
    const int quarters = d / 32;
    __m512i acc[kRows][2 * kQuarters];
    for (auto& row : acc) {
      for (__m512i& a : row) a = _mm512_setzero_si512();
    }
    __m512i gather[kQuarters][2];
    int offset[kQuarters];
    for (int i = 0; i < kQuarters; ++i) {
      for (int h = 0; h < 2; ++h) gather[i][h] = Codes::Gather(q0 + i, quarters, h);
      offset[i] = Codes::QuarterOffset(q0 + i, quarters);
    }
    for (int quad = 0; quad < quads; ++quad) {
      __m512i w[kRows];
      for (int r = 0; r < kRows; ++r) {
        int four;
        memcpy(&four, weights + r * kBlock + 4 * quad, 4);
        w[r] = _mm512_set1_epi32(four);
      }
      for (int i = 0; i < kQuarters; ++i) {
        const __m512i quarter = Codes::QuadQuarter(codes + 4 * quad, offset[i]);
        for (int h = 0; h < 2; ++h) {
          const __m512i v = values.Half(quarter, gather[i][h]);
          for (int r = 0; r < kRows; ++r) acc[r][2 * i + h] = DotWeights(acc[r][2 * i + h], w[r], v);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512 unit = _mm512_set1_ps(weight_unit[r] * values.unit());
      for (int c = 0; c < 2 * kQuarters; ++c) {
        float* o = out + static_cast<size_t>(r) * d + 32 * q0 + 16 * c;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), unit, _mm512_loadu_ps(o)));
      }
    }
  }

  void Run() {
    const int rows = p.rows;
    // Queries to int8, per row: q = unit[r] * q8, |q8| <= 127; their sums
    // undo the +128 of the key bytes.
    uint8_t* q8 = QueryBytes(static_cast<size_t>(rows) * 2 * d);
    // Per key part (its own codebook and stored scale): the unit and sum.
    float score_unit[kParts][kMaxRows];
    int32_t q8_sum[kParts][kMaxRows];
    for (int r = 0; r < rows; ++r) {
      for (int part = 0; part < kParts; ++part) {
        const int begin = parts[part].begin, end = begin + parts[part].dims;
        const float* q = p.queries + static_cast<size_t>(r) * d;
        __m512 max_abs = _mm512_setzero_ps();
        for (int j = begin; j < end; j += 16) max_abs = _mm512_max_ps(max_abs, _mm512_abs_ps(_mm512_loadu_ps(q + j)));
        const float max = Max(max_abs);
        const float unit = max > 0.0f ? max / 127.0f : 1.0f;
        // lrint(q / unit) (round to nearest even), at most 127 in magnitude.
        const __m512 divisor = _mm512_set1_ps(unit);
        const __m512i limit = _mm512_set1_epi32(127);
        __m512i sum = _mm512_setzero_si512();
        for (int j = begin; j < end; j += 16) {
          __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(q + j), divisor));
          v = _mm512_max_epi32(_mm512_min_epi32(v, limit), _mm512_sub_epi32(_mm512_setzero_si512(), limit));
          sum = _mm512_add_epi32(sum, v);
          const __m128i bytes = _mm512_cvtepi32_epi8(v);
          // Chunk j / 32 at 64 (j / 32): coordinates 128 s + 32 m at 256 s + 64 m.
          uint8_t* chunk = q8 + static_cast<size_t>(r) * 2 * d + 64 * (j / 32) + j % 32;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk), bytes);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk + 32), bytes);
        }
        q8_sum[part][r] = static_cast<int32_t>(Sum(_mm512_cvtepi32_ps(sum)));
        score_unit[part][r] = unit * KeyUnit(part);
      }
    }

    alignas(64) int32_t raw[kParts][kMaxRows * kBlock];
    alignas(64) uint8_t weights[kMaxRows * kBlock];  // in units of weight_unit
    float weight_unit[kMaxRows];
    BlockTokens tokens;
    float row_max[kMaxRows], row_sum[kMaxRows], row_zero[kMaxRows];
    const int64_t max_visible = *std::max_element(p.visible, p.visible + rows);
    for (int r = 0; r < rows; ++r) {
      row_max[r] = -std::numeric_limits<float>::infinity();
      row_sum[r] = 0.0f;
      row_zero[r] = 0.0f;
      memset(p.out + static_cast<size_t>(r) * d, 0, sizeof(float) * d);
    }
    const float kNegInf = -std::numeric_limits<float>::infinity();
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    const auto seen_lanes = [](int64_t seen) {
      return static_cast<__mmask16>(seen >= kGroup ? 0xffff : seen <= 0 ? 0 : (1u << seen) - 1);
    };

    static_assert(kBlock == kAddBackBlock, "add-back tables cover one block");
    const int64_t first = RunBlockStart(p, kBlock);
    AddBackTable addback(p.addback_pairs, p.addback_inv_freq, first);
    BlockWalk walk(p, first);
    const int64_t end = max_visible > p.token_begin ? max_visible : first;
    const BlockPrefetch prefetch(p, kBlock, first, max_visible);
    for (int64_t t0 = first; t0 < end; t0 += kBlock) {
      addback.Next();
      const int count = static_cast<int>(std::min<int64_t>(kBlock, max_visible - t0));
      prefetch.Piece(t0, 0);
      const int groups = (count + kGroup - 1) / kGroup;
      walk.Next(
          t0, count, groups * kGroup, tokens.key_codes, tokens.value_codes,
          [&](const uint8_t* key_scalars, const uint8_t* value_scalars, int i, int n) {
            LoadScalars(key_scalars, n, tokens.key_scale + i, kSplit ? tokens.key_cold_scale + i : nullptr);
            LoadScalars(value_scalars, n, tokens.value_scale + i, kUniform ? tokens.value_zero + i : nullptr);
          },
          [&](int i) {
            tokens.key_scale[i] = tokens.key_cold_scale[i] = tokens.value_scale[i] = tokens.value_zero[i] = 0.0f;
          });

      // Raw scores, tile by tile.
      ForRowTiles(rows, [&](auto tile_rows, int r0) {
        constexpr int kRows = decltype(tile_rows)::value;
        constexpr int kTokens = kRows == 4 ? 8 : 16;
        if (*std::max_element(p.visible + r0, p.visible + r0 + kRows) <= t0) return;
        for (int part = 0; part < kParts; ++part) {
          for (int i = 0; i < groups * kGroup; i += kTokens) {
            ScorePart<kRows>(part, tokens.key_codes + i, q8 + static_cast<size_t>(r0) * 2 * d,
                             raw[part] + r0 * kBlock + i);
          }
        }
      });

      prefetch.Piece(t0, 1);
      // Scores, masked; then the online softmax, and fixed-point weights times the
      // tokens' value scales.
      // A row's block of scores, then of weights, stays in registers.
      constexpr int kGroups = kBlock / kGroup;
      for (int r = 0; r < rows; ++r) {
        if (p.visible[r] <= t0) continue;
        const __m512 unit = _mm512_set1_ps(score_unit[0][r]);
        const __m512i bias = _mm512_set1_epi32(128 * q8_sum[0][r]);
        const __m512 cold_unit = _mm512_set1_ps(score_unit[kParts - 1][r]);
        const __m512i cold_bias = _mm512_set1_epi32(128 * q8_sum[kParts - 1][r]);
        __m512 block[kGroups];
        __m512 m = neg_inf;
#pragma GCC unroll 4
        for (int g = 0; g < kGroups; ++g) {
          if (g >= groups) break;
          const int64_t group_start = t0 + kGroup * g;
          const __m512i dots = _mm512_sub_epi32(_mm512_load_si512(raw[0] + r * kBlock + kGroup * g), bias);
          __m512 s = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots), unit),
                                   _mm512_load_ps(tokens.key_scale + kGroup * g));
          if constexpr (kSplit) {
            const __m512i cold =
                _mm512_sub_epi32(_mm512_load_si512(raw[kParts - 1] + r * kBlock + kGroup * g), cold_bias);
            s = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(cold), cold_unit),
                                _mm512_load_ps(tokens.key_cold_scale + kGroup * g), s);
          }
          if (addback.pairs() > 0) s = _mm512_add_ps(s, AddBack(p, addback, r, kGroup * g));
          const __mmask16 live =
              seen_lanes(p.visible[r] - group_start) & static_cast<__mmask16>(~seen_lanes(p.token_begin - group_start));
          block[g] = _mm512_mask_mov_ps(neg_inf, live, s);
          m = _mm512_max_ps(m, block[g]);
        }
        const float new_max = std::max(row_max[r], Max(m));
        // exp(0) without the call: most blocks do not raise the maximum.
        const float correction =
            row_max[r] == kNegInf ? 0.0f : row_max[r] == new_max ? 1.0f : std::exp(row_max[r] - new_max);
        row_max[r] = new_max;
        __m512 sum = _mm512_setzero_ps(), zero_sum = _mm512_setzero_ps(), w_max = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int g = 0; g < kGroups; ++g) {
          if (g >= groups) break;
          const __mmask16 live = _mm512_cmp_ps_mask(block[g], neg_inf, _CMP_NEQ_OQ);
          const __m512 e = _mm512_maskz_mov_ps(live, Exp(_mm512_sub_ps(block[g], _mm512_set1_ps(new_max))));
          sum = _mm512_add_ps(sum, e);
          if constexpr (kUniform) {
            zero_sum = _mm512_fmadd_ps(e, _mm512_load_ps(tokens.value_zero + kGroup * g), zero_sum);
          }
          block[g] = _mm512_mul_ps(e, _mm512_load_ps(tokens.value_scale + kGroup * g));
          w_max = _mm512_max_ps(w_max, _mm512_abs_ps(block[g]));
        }
        {
          // Unsigned 8-bit fixed point per row and block, in units of the
          // block's largest weight / 255, rounded with the error carried
          // from token to token: the weights are first taken to 1/256 of a
          // unit (W, exact integers), and token k of the block (in the order
          // lane-major over its groups: any fixed order works) gets
          // round(C_k / 256) - round(C_{k-1} / 256), C_k the sum of W up to
          // k. So any run of tokens weighs within 0.6 units of its exact
          // weight, and weights too small for a unit are not all dropped
          // (each dropped alone, a block of them would lose their mass).
          // A negative or NaN weight (a value scale the encoder never
          // writes) weighs zero.
          const float top = Max(w_max);
          weight_unit[r] = top > 0.0f ? top * (1.0f / 255.0f) : 1.0f;
          const __m512 to_fixed = _mm512_set1_ps(top > 0.0f ? 65280.0f / top : 0.0f);
          const __m512i zero = _mm512_setzero_si512(), half = _mm512_set1_epi32(128);
          __m512i fixed[kGroups], upto[kGroups];  // W, and its sum over the groups up to g
          __m512i running = zero;
#pragma GCC unroll 4
          for (int g = 0; g < kGroups; ++g) {
            if (g >= groups) break;
            fixed[g] = _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(block[g], to_fixed)), zero);
            upto[g] = running = _mm512_add_epi32(running, fixed[g]);
          }
          // before[i]: the sum of W over lanes below i, every group.
          __m512i scan = _mm512_add_epi32(running, _mm512_alignr_epi32(running, zero, 15));
          scan = _mm512_add_epi32(scan, _mm512_alignr_epi32(scan, zero, 14));
          scan = _mm512_add_epi32(scan, _mm512_alignr_epi32(scan, zero, 12));
          scan = _mm512_add_epi32(scan, _mm512_alignr_epi32(scan, zero, 8));
          const __m512i before = _mm512_sub_epi32(scan, running);
#pragma GCC unroll 4
          for (int g = 0; g < kGroups; ++g) {
            if (g >= groups) break;
            const __m512i sum_to = _mm512_add_epi32(before, upto[g]);
            const __m512i w = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(sum_to, half), 8),
                                               _mm512_srli_epi32(_mm512_add_epi32(_mm512_sub_epi32(sum_to, fixed[g]), half), 8));
            _mm_store_si128(reinterpret_cast<__m128i*>(weights + r * kBlock + kGroup * g), _mm512_cvtepi32_epi8(w));
          }
        }
        row_sum[r] = row_sum[r] * correction + Sum(sum);
        row_zero[r] = row_zero[r] * correction + Sum(zero_sum);
        if (correction != 1.0f) {
          float* out = p.out + static_cast<size_t>(r) * d;
          const __m512 factor = _mm512_set1_ps(correction);
          for (int c = 0; c < d; c += 16) _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_loadu_ps(out + c), factor));
        }
      }

      prefetch.Piece(t0, 2);
      // Values, tile by tile; rows that see none of the block weigh zero.
      const int quads = groups * kGroup / 4;
      ForRowTiles(rows, [&](auto tile_rows, int r0) {
        constexpr int kRows = decltype(tile_rows)::value;
        if (*std::max_element(p.visible + r0, p.visible + r0 + kRows) <= t0) return;
        for (int r = r0; r < r0 + kRows; ++r) {
          if (p.visible[r] <= t0) memset(weights + r * kBlock, 0, kBlock);
        }
        float* out = p.out + static_cast<size_t>(r0) * d;
        const uint8_t* w = weights + r0 * kBlock;
        const float* unit = weight_unit + r0;
        const int quarters = d / 32;  // 2, or a multiple of 4
        int q = 0;
        if constexpr (kRows <= 2) {
          for (; q + 4 <= quarters; q += 4) ValueTile<kRows, 4>(tokens.value_codes, quads, w, unit, q, out);
        }
        for (; q < quarters; q += 2) ValueTile<kRows, 2>(tokens.value_codes, quads, w, unit, q, out);
      });
      prefetch.Piece(t0, 3);
    }
    for (int r = 0; r < rows; ++r) {
      float* out = p.out + static_cast<size_t>(r) * d;
      if (row_sum[r] == 0.0f) {  // saw no token
        memset(out, 0, sizeof(float) * d);
        p.lse[r] = kNegInf;
        continue;
      }
      const __m512 inv = _mm512_set1_ps(1.0f / row_sum[r]);
      const __m512 shift = _mm512_set1_ps(row_zero[r] / row_sum[r]);
      for (int c = 0; c < d; c += 16) {
        _mm512_storeu_ps(out + c, _mm512_fmadd_ps(_mm512_loadu_ps(out + c), inv, shift));
      }
      p.lse[r] = row_max[r] + std::log(row_sum[r]);
    }
  }
};

template <int kKeyBits, FieldFormat kValue, int kValueBits>
void Run(const HeadAttendParams& params) {
  Kernel<kKeyBits, kValue, kValueBits>(params).Run();
}

template <int kKeyBits, FieldFormat kValue>
AttendKernel PickForBits(int value_bits) {
  switch (value_bits) {
    case 2:
      return &Run<kKeyBits, kValue, 2>;
    case 3:
      return &Run<kKeyBits, kValue, 3>;
    case 4:
      return &Run<kKeyBits, kValue, 4>;
  }
  return nullptr;
}

template <int kKeyBits>
AttendKernel PickForValue(const FieldReader& value) {
  if (value.format == FieldFormat::kCentroids) return PickForBits<kKeyBits, FieldFormat::kCentroids>(value.bits);
  if (value.format == FieldFormat::kUniform) return PickForBits<kKeyBits, FieldFormat::kUniform>(value.bits);
  return nullptr;
}

// A key part's coordinates as the score tiles take them.
bool WholeSegments(int dims) { return dims == 64 || (dims > 0 && dims % kSegment == 0); }

AttendKernel Pick(const FieldReader& key, const FieldReader& value, int head_dim) {
  if (key.format == FieldFormat::kSplitCentroids) {
    if (!WholeSegments(key.hot_dims) || !WholeSegments(head_dim - key.hot_dims)) return nullptr;
    switch (10 * key.bits + key.cold_bits) {
      case 43:
        return PickForValue<43>(value);
      case 42:
        return PickForValue<42>(value);
      case 32:
        return PickForValue<32>(value);
    }
    return nullptr;
  }
  if (key.format != FieldFormat::kCentroids) return nullptr;
  if (!WholeSegments(head_dim)) return nullptr;
  switch (key.bits) {
    case 2:
      return PickForValue<2>(value);
    case 3:
      return PickForValue<3>(value);
    case 4:
      return PickForValue<4>(value);
  }
  return nullptr;
}

}  // namespace

float IntegerKeyUnit(const float* centroids, int count) {
  float max_abs = 0.0f;
  for (int i = 0; i < count; ++i) max_abs = std::max(max_abs, std::fabs(centroids[i]));
  if (!(max_abs > 0.0f)) return 1.0f;
  // The largest centroid at 96-127 units: the one whose rounding moves the
  // centroids least, relative to each (a Lloyd-Max codebook's smallest
  // centroids are its most used; at 127 units the 3-bit one's is 3% off).
  float best_unit = max_abs / 127.0f;
  double best_error = std::numeric_limits<double>::infinity();
  for (int top = 127; top >= 96; --top) {
    const float unit = max_abs / static_cast<float>(top);
    double error = 0;
    for (int i = 0; i < count; ++i) {
      if (centroids[i] == 0.0f) continue;
      const double steps = static_cast<double>(centroids[i]) / unit;
      const double relative = (steps - std::nearbyint(steps)) / steps;
      error += relative * relative;
    }
    if (error < best_error) {
      best_error = error;
      best_unit = unit;
    }
  }
  return best_unit;
}

float ValueUnit(const float* centroids, int count) { return IntegerKeyUnit(centroids, count); }

bool AttendHeadAvx512VnniSupported(const FieldReader& key, const FieldReader& value, int head_dim) {
  return Pick(key, value, head_dim) != nullptr;
}

void AttendHeadAvx512Vnni(const HeadAttendParams& params) { Pick(params.key, params.value, params.head_dim)(params); }

}  // namespace cpu_internal
}  // namespace tqkv
