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
#include "kernels/cpu/integer_attend.h"

namespace tqkv {
namespace cpu_internal {
namespace {

using avx512::LoadScalars;

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
// The integer kernel: scores and values through vpdpbusd.
template <int kKeyBits, FieldFormat kValue, int kValueBits>
struct Kernel : IntegerAttention<kKeyBits, kValue, kValueBits> {
  using Base = IntegerAttention<kKeyBits, kValue, kValueBits>;
  using Base::cold_keys;
  using Base::d;
  using Base::keys;
  using Base::kParts;
  using Base::kSplit;
  using Base::kUniform;
  using Base::p;
  using Base::parts;
  using Base::values;

  explicit Kernel(const HeadAttendParams& params) : Base(params) {}

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
    alignas(64) int32_t raw[kParts][kMaxRows * kBlock];
    const int32_t* raw_parts[kParts];
    for (int part = 0; part < kParts; ++part) raw_parts[part] = raw[part];
    alignas(64) uint8_t weights[kMaxRows * kBlock];  // in units of weight_unit
    float weight_unit[kMaxRows], correction[kMaxRows];
    BlockTokens tokens;
    const int64_t max_visible = *std::max_element(p.visible, p.visible + rows);

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
            ScorePart<kRows>(part, tokens.key_codes + i, this->q8 + static_cast<size_t>(r0) * 2 * d,
                             raw[part] + r0 * kBlock + i);
          }
        }
      });

      prefetch.Piece(t0, 1);
      this->SoftmaxBlock(t0, groups, raw_parts, tokens, addback, weights, weight_unit, correction);
      for (int r = 0; r < rows; ++r) this->Rescale(r, correction[r]);

      prefetch.Piece(t0, 2);
      // Values, tile by tile; rows that see none of the block weigh zero.
      const int quads = groups * kGroup / 4;
      ForRowTiles(rows, [&](auto tile_rows, int r0) {
        constexpr int kRows = decltype(tile_rows)::value;
        if (*std::max_element(p.visible + r0, p.visible + r0 + kRows) <= t0) return;
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
    this->Finish();
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
