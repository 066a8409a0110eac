// Internal to the CPU backend: the integer attention kernel's pieces that do
// not depend on how it forms its integer sums (attend_avx512_vnni.cc): the
// code unpacking tables, the int8 query, the online softmax and its 8-bit
// weights, and the final normalisation.
//
// Include only from translation units compiled with AVX-512 F/BW/VL/DQ,
// VNNI and VBMI. Everything here has internal linkage (an unnamed namespace,
// against the usual rule for headers) for the reason attend_avx512_common.h
// gives: each kernel file is compiled with its own ISA flags.
#ifndef TQKV_KERNELS_CPU_INTEGER_ATTEND_H_
#define TQKV_KERNELS_CPU_INTEGER_ATTEND_H_

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/addback_table.h"
#include "kernels/cpu/attend_avx512_common.h"
#include "kernels/cpu/attend_kernels.h"

namespace tqkv {
namespace cpu_internal {
namespace {  // NOLINT(build/namespaces): see the file comment

constexpr int kBlock = 64;  // tokens per online-softmax step
constexpr int kGroup = 16;  // tokens per score vector

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


// The state and the steps both integer kernels share, for one call: the
// codebooks' integer tables, the int8 query, the rows' online softmax. A
// kernel forms the raw integer scores of each block (raw[part][r * kBlock +
// i]: the sum over the part's coordinates of key byte x query byte), calls
// SoftmaxBlock, folds the block's values into out with FoldValues after
// Rescale, and ends with Finish.
//
// kKeyBits: the key codes' bits, or for split keys 10 x hot bits + cold bits.
template <int kKeyBits, FieldFormat kValue, int kValueBits>
struct IntegerAttention {
  static constexpr bool kUniform = kValue == FieldFormat::kUniform;
  static constexpr bool kSplit = kKeyBits >= 10;
  static constexpr int kParts = kSplit ? 2 : 1;
  static constexpr int kHotBits = kSplit ? kKeyBits / 10 : kKeyBits;
  static constexpr int kColdBits = kSplit ? kKeyBits % 10 : kKeyBits;

  const HeadAttendParams& p;
  const int d;
  const KeyCodes<kHotBits> keys;        // every coordinate's, or the hot part's
  const KeyCodes<kColdBits> cold_keys;  // split keys: the cold part's
  KeyPart parts[kParts];
  const ValueCodes<kValue, kValueBits> values;

  // The int8 query: row r, coordinates 128 s ... + 127 (of a part or not),
  // chunk m is 64 bytes at q8 + r * 2d + 256 s + 64 m: its 32 coordinates
  // twice. Query byte of coordinate c of row r: QueryByte(r, c).
  uint8_t* q8 = nullptr;
  // Per key part (its own codebook and stored scale): what a raw score unit
  // is worth, and the sum of the row's query bytes (which undoes the +128
  // of the key bytes).
  float score_unit[kParts][kMaxRows];
  int32_t q8_sum[kParts][kMaxRows];

  // The online softmax of each row, with the token before the block's
  // tokens: running maximum, denominator, and (uniform values) the weighted
  // sum of the tokens' zero points.
  float row_max[kMaxRows], row_sum[kMaxRows], row_zero[kMaxRows];

  explicit IntegerAttention(const HeadAttendParams& params)
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
    for (int r = 0; r < p.rows; ++r) {
      row_max[r] = -std::numeric_limits<float>::infinity();
      row_sum[r] = 0.0f;
      row_zero[r] = 0.0f;
      memset(p.out + static_cast<size_t>(r) * d, 0, sizeof(float) * d);
    }
    QuantizeQueries();
  }

  float KeyUnit(int part) const { return part == 0 ? keys.unit() : cold_keys.unit(); }

  int8_t QueryByte(int r, int c) const {
    return static_cast<int8_t>(q8[static_cast<size_t>(r) * 2 * d + 256 * (c / 128) + 64 * (c % 128 / 32) + c % 32]);
  }

  // The tokens each row sees of the 16 from group_start on, as lanes.
  static __mmask16 SeenLanes(int64_t seen) {
    return static_cast<__mmask16>(seen >= kGroup ? 0xffff : seen <= 0 ? 0 : (1u << seen) - 1);
  }

  // One block's softmax for every row: from raw[part] (the block's `groups`
  // groups of 16 tokens from t0), the tokens' scalars and the add-back of
  // the block (addback, after its Next()), fills for each row r
  //   weights[r * kBlock + i]  unsigned 8-bit weights in units of
  //                            weight_unit[r] (zero past the groups; all
  //                            zero, in units of 1, for a row that sees none
  //                            of the block)
  //   correction[r]            the factor out[r] takes before this block's
  //                            values join it (1 for such a row)
  // and moves row_max, row_sum and row_zero on.
  void SoftmaxBlock(int64_t t0, int groups, const int32_t* const* raw, const BlockTokens& tokens,
                    const AddBackTable& addback, uint8_t* weights, float* weight_unit, float* correction) {
    const float kNegInf = -std::numeric_limits<float>::infinity();
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    constexpr int kGroups = kBlock / kGroup;
    for (int r = 0; r < p.rows; ++r) {
      if (p.visible[r] <= t0) {
        memset(weights + r * kBlock, 0, kBlock);
        weight_unit[r] = 1.0f;
        correction[r] = 1.0f;
        continue;
      }
      const __m512 unit = _mm512_set1_ps(score_unit[0][r]);
      const __m512i bias = _mm512_set1_epi32(128 * q8_sum[0][r]);
      const __m512 cold_unit = _mm512_set1_ps(score_unit[kParts - 1][r]);
      const __m512i cold_bias = _mm512_set1_epi32(128 * q8_sum[kParts - 1][r]);
      // A row's block of scores, then of weights, stays in registers.
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
          const __m512i cold = _mm512_sub_epi32(_mm512_load_si512(raw[kParts - 1] + r * kBlock + kGroup * g), cold_bias);
          s = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(cold), cold_unit),
                              _mm512_load_ps(tokens.key_cold_scale + kGroup * g), s);
        }
        if (addback.pairs() > 0) s = _mm512_add_ps(s, avx512::AddBack(p, addback, r, kGroup * g));
        const __mmask16 live =
            SeenLanes(p.visible[r] - group_start) & static_cast<__mmask16>(~SeenLanes(p.token_begin - group_start));
        block[g] = _mm512_mask_mov_ps(neg_inf, live, s);
        m = _mm512_max_ps(m, block[g]);
      }
      const float new_max = std::max(row_max[r], avx512::Max(m));
      // exp(0) without the call: most blocks do not raise the maximum.
      correction[r] = row_max[r] == kNegInf ? 0.0f : row_max[r] == new_max ? 1.0f : std::exp(row_max[r] - new_max);
      row_max[r] = new_max;
      __m512 sum = _mm512_setzero_ps(), zero_sum = _mm512_setzero_ps(), w_max = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int g = 0; g < kGroups; ++g) {
        if (g >= groups) break;
        const __mmask16 live = _mm512_cmp_ps_mask(block[g], neg_inf, _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(live, avx512::Exp(_mm512_sub_ps(block[g], _mm512_set1_ps(new_max))));
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
        const float top = avx512::Max(w_max);
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
          uint8_t* to = weights + r * kBlock + kGroup * g;
          if (g >= groups) {
            _mm_store_si128(reinterpret_cast<__m128i*>(to), _mm_setzero_si128());
            continue;
          }
          const __m512i sum_to = _mm512_add_epi32(before, upto[g]);
          const __m512i w = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(sum_to, half), 8),
                                             _mm512_srli_epi32(_mm512_add_epi32(_mm512_sub_epi32(sum_to, fixed[g]), half), 8));
          _mm_store_si128(reinterpret_cast<__m128i*>(to), _mm512_cvtepi32_epi8(w));
        }
      }
      row_sum[r] = row_sum[r] * correction[r] + avx512::Sum(sum);
      row_zero[r] = row_zero[r] * correction[r] + avx512::Sum(zero_sum);
    }
  }

  // out[r] *= factor, before a block's values join a row whose maximum it
  // raised (SoftmaxBlock's correction).
  void Rescale(int r, float factor) {
    if (factor == 1.0f) return;
    float* out = p.out + static_cast<size_t>(r) * d;
    const __m512 f = _mm512_set1_ps(factor);
    for (int c = 0; c < d; c += 16) _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_loadu_ps(out + c), f));
  }

  // out[r][c ... c + 15] += sums x unit: a block's integer value sums (in
  // units of weight_unit[r] x values.unit()) join the accumulator.
  void FoldValues(int r, int c, __m512i sums, float unit) {
    float* o = p.out + static_cast<size_t>(r) * d + c;
    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(unit), _mm512_loadu_ps(o)));
  }

  // Normalises out by each row's denominator, adds the uniform values' zero
  // term, and writes lse.
  void Finish() {
    for (int r = 0; r < p.rows; ++r) {
      float* out = p.out + static_cast<size_t>(r) * d;
      if (row_sum[r] == 0.0f) {  // saw no token
        memset(out, 0, sizeof(float) * d);
        p.lse[r] = -std::numeric_limits<float>::infinity();
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

 private:
  // Queries to int8, per row and key part: q = unit * q8, |q8| <= 127.
  void QuantizeQueries() {
    q8 = QueryBytes(static_cast<size_t>(p.rows) * 2 * d);
    for (int r = 0; r < p.rows; ++r) {
      for (int part = 0; part < kParts; ++part) {
        const int begin = parts[part].begin, end = begin + parts[part].dims;
        const float* q = p.queries + static_cast<size_t>(r) * d;
        __m512 max_abs = _mm512_setzero_ps();
        for (int j = begin; j < end; j += 16) max_abs = _mm512_max_ps(max_abs, _mm512_abs_ps(_mm512_loadu_ps(q + j)));
        const float max = avx512::Max(max_abs);
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
        q8_sum[part][r] = static_cast<int32_t>(avx512::Sum(_mm512_cvtepi32_ps(sum)));
        score_unit[part][r] = unit * KeyUnit(part);
      }
    }
  }
};

}  // namespace
}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_INTEGER_ATTEND_H_
