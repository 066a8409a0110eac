// Internal to the CPU backend: the integer attention kernel's pieces that do
// not depend on how it forms its integer sums (attend_avx512_vnni.cc): the
// code unpacking tables, the int8 query, the online softmax and its 8-bit
// weights, and the final normalisation.
//
// Include only from translation units compiled with AVX-512 F/BW/VL/DQ,
// VNNI, VBMI and VBMI2. Everything here has internal linkage (an unnamed namespace,
// against the usual rule for headers) for the reason simd_mappings.h
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

#include "kernels/cpu/addback.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/simd/simd_mappings.h"
#include "kernels/simd/simd_math.h"

namespace tqkv {
namespace cpu_internal {
namespace {  // NOLINT(build/namespaces): see the file comment

constexpr int kBlock = 64;  // tokens per online-softmax step
constexpr int kGroup = 16;  // tokens per score vector

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

// A codes tile (kernels/code_tiles.h) of 16 tokens: word w of every token
// is the 64-byte vector at tile + 64 w, token i in 32-bit lane i.
inline __m512i TileWord(const uint8_t* tile, int w) { return _mm512_loadu_si512(tile + 64 * w); }

// b-bit key codes of a tile's 16 tokens as unsigned bytes, four coordinates
// per token and vector: lane i (token i) holds the centroid + 128 (in units
// of unit()) of coordinates 4c ... 4c + 3, for vpdpbusd against a dword of
// four query bytes. Four codes are 4b bits of a token's stream, inside one
// word or (3 bits) straddling two; vpmultishiftqb takes each code's bits
// into its byte from a qword holding two tokens' word (or, straddling, the
// two words shifted together by vpshrdd), then vpermb maps it to its
// centroid byte.
template <int kBits>
struct TileKeyIndex {
  // shift[o / 4][k]: byte k of the vector (byte k % 8 of its qword: token
  // (k % 8) / 4 of the qword's two, coordinate k % 4) starts at this bit
  // of the qword when the four codes start at bit o of a word.
  alignas(64) uint8_t shift[8][64] = {};
  constexpr TileKeyIndex() {
    for (int o = 0; o < 32; o += 4) {
      for (int k = 0; k < 64; ++k) shift[o / 4][k] = static_cast<uint8_t>(32 * (k % 8 / 4) + o + kBits * (k % 4));
    }
  }
};
template <int kBits>
inline constexpr TileKeyIndex<kBits> kTileKeyIndex{};

template <int kBits>
class TileKeys {
 public:
  // Words that hold a whole number of four-coordinate groups, and those groups.
  static constexpr int kPeriodWords = kBits == 3 ? 3 : 1;
  static constexpr int kPeriodGroups = 8 * kPeriodWords / kBits;

  explicit TileKeys(const float* centroids) {
    for (int o = 0; o < 8; ++o) shift_[o] = _mm512_load_si512(kTileKeyIndex<kBits>.shift[o]);
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

  // Group m (coordinates 4 m ... 4 m + 3, m < kPeriodGroups) of the period
  // whose words are `words` (kPeriodWords of them; for 3 bits also the two
  // straddling pairs, (word i + 1 : word i) >> 16 for i = 0 and 1).
  __m512i Group(int m, const __m512i* words, const __m512i* shifted) const {
    const int bit = 4 * kBits * m, w = bit / 32, o = bit % 32;
    const bool straddles = o + 4 * kBits > 32;
    const __m512i source = straddles ? shifted[w] : words[w];
    const int at = straddles ? o - 16 : o;
    return _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shift_[at / 4], source), table_);
  }

 private:
  __m512i shift_[8], table_;
  float unit_;
};

// b-bit value codes of a quad of a tile's tokens as signed bytes, 16
// coordinates per vector: dword i holds coordinate 16 m + i (chunk m) of
// tokens 4 q ... 4 q + 3 (byte t: token 4 q + t), for vpdpbusd against the
// dword of the four tokens' unsigned 8-bit weights. Uniform codes are read as
// they are, centroids in units of unit() (at most 127: IntegerKeyUnit).
//
// Chunk m is 16 b bits of a token's stream from bit 16 m b: one word (2
// bits) or two. Two words of tokens 0-7 (8-15) are first put side by side
// in one vector (ChunkSource, vpermt2d: 8 bytes per token); then for each
// quad vpermb gathers the two bytes of each token in which a pair of
// coordinates lies and vpmultishiftqb moves each code to its own byte.
template <int kBits>
struct TileValueIndex {
  static constexpr bool kTwoWords = kBits > 2;
  static constexpr int kTokenBytes = kTwoWords ? 8 : 4;  // per token in a chunk's source
  // gather[o / 16][q][8 j + 2 t + e]: for a chunk starting at bit o of its
  // first word, qword j (coordinates 2 j and 2 j + 1) takes in bytes 2 t
  // and 2 t + 1 the two bytes of quad q's token t where they lie (the second
  // may be past them: the bits above a code do not matter).
  alignas(64) uint8_t gather[2][4][64] = {};
  // shift[8 j + i]: byte i of qword j (token i % 4, coordinate 2 j + i / 4)
  // starts at this bit of the qword (the same for o = 0 and 16).
  alignas(64) uint8_t shift[64] = {};
  constexpr TileValueIndex() {
    for (int o = 0; o < 2; ++o) {
      for (int q = 0; q < 4; ++q) {
        for (int j = 0; j < 8; ++j) {
          const int byte = (16 * o + 2 * j * kBits) / 8;
          for (int t = 0; t < 4; ++t) {
            const int token = kTwoWords ? (4 * q + t) % 8 : 4 * q + t;
            for (int e = 0; e < 2; ++e) {
              gather[o][q][8 * j + 2 * t + e] = static_cast<uint8_t>((kTokenBytes * token + byte + e) % 64);
            }
          }
        }
      }
    }
    for (int j = 0; j < 8; ++j) {
      const int bit = (2 * j * kBits) % 8;
      for (int i = 0; i < 8; ++i) shift[8 * j + i] = static_cast<uint8_t>(16 * (i % 4) + bit + kBits * (i / 4));
    }
  }
};
template <int kBits>
inline constexpr TileValueIndex<kBits> kTileValueIndex{};

template <FormatFamily kFormat, int kBits>
class TileValues {
 public:
  explicit TileValues(const float* centroids) {
    shift_ = _mm512_load_si512(kTileValueIndex<kBits>.shift);
    if constexpr (kFormat == FormatFamily::kTurboQuant) {
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

  // The source of chunk m for tokens 0-7 (half 0) or 8-15 (half 1); for 2
  // bits, the chunk's word of all 16 tokens.
  static __m512i ChunkSource(const uint8_t* tile, int m, int half) {
    const int w = 16 * m * kBits / 32;
    if constexpr (!TileValueIndex<kBits>::kTwoWords) {
      return TileWord(tile, w);
    } else {
      // Lane 2 k + h: word w + h of token 8 half + k.
      const __m512i pick = half == 0 ? _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)
                                     : _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
      return _mm512_permutex2var_epi32(TileWord(tile, w), pick, TileWord(tile, w + 1));
    }
  }
  // Where chunk m starts in its first word: 0 or 16.
  static int ChunkOffset(int m) { return 16 * m * kBits % 32; }

  // Chunk m of quad q, from the ChunkSource that holds the quad.
  __m512i Quad(__m512i source, int m, int q) const {
    const __m512i gather = _mm512_load_si512(kTileValueIndex<kBits>.gather[ChunkOffset(m) / 16][q]);
    const __m512i codes = _mm512_multishift_epi64_epi8(shift_, _mm512_permutexvar_epi8(gather, source));
    if constexpr (kFormat == FormatFamily::kUniform) {
      return _mm512_and_si512(codes, _mm512_set1_epi8((1 << kBits) - 1));
    } else {
      return _mm512_permutexvar_epi8(codes, table_);
    }
  }

 private:
  __m512i shift_, table_;
  float unit_ = 1.0f;
};

// The add-back (addback.h) with int16 dot products: each block, every row's
// coefficients w_ri (Re and -Im) rounded to int16 in units of 1 / scale_r,
// then vpdpwssd against the rotations tabulated as int16 pairs in units of
// 2^-14 (AddBackFrequency::rotation): one instruction per (row, pair) and 16
// tokens, half the multiply-adds of the fp32 kernels' add-back. With
//   scale_r = min(32767 / max_i |z_ri|, 2^16 / sum_i |z_ri|)
// (|w_ri| = |z_ri|: w is z rotated) every int16 fits and every int32 sum
// stays below 2^31. The roundings move row r's add-back at any token by at
// most
//   sqrt(2) (pairs / (2 scale_r) + 2^-15 sum_i |z_ri|),
// about 1e-4 of sum_i |z_ri| with 8 pairs: far inside what rounding the
// query to int8 does to the score.
class IntegerAddBack : public AddBackRows<simd::Avx512> {
 public:
  IntegerAddBack(const HeadAttendParams& p, int64_t first) : AddBackRows(p, first) {
    if (!active()) return;
    const size_t n = static_cast<size_t>(rows_) * pairs_;
    chunks_ = static_cast<int>((n + 15) / 16);
    thread_local std::vector<float> scales;
    thread_local std::vector<int32_t> words, lanes;
    scales.resize(n);
    words.resize(n);
    scales_ = scales.data();
    words_ = words.data();
    for (int r = 0; r < rows_; ++r) {
      float largest;
      const float sum = RowNorm(r, &largest);
      const float scale = sum > 0.0f ? std::min(32767.0f / largest, 65536.0f / sum) : 1.0f;
      unit_[r] = 1.0f / (scale * (1 << AddBackFrequency::kRotationBits));
      std::fill(scales_ + static_cast<size_t>(r) * pairs_, scales_ + static_cast<size_t>(r + 1) * pairs_, scale);
    }
    // Up to 16 pairs the block's seeding runs in vectors: the pairs'
    // e^{i t0 theta} in one (two for 9-16 pairs) of doubles, moved along
    // together, and each 16 (row, pair) of the flat arrays taking theirs by
    // a permute (pair_lanes_: the pair of each lane).
    vector_seed_ = pairs_ <= 16;
    if (!vector_seed_) return;
    lanes.resize(16 * static_cast<size_t>(chunks_));
    pair_lanes_ = lanes.data();
    for (int i = 0; i < 16 * chunks_; ++i) pair_lanes_[i] = i % pairs_;
    for (int i = 0; i < 16; ++i) {
      const bool pair = i < pairs_;
      seed_c_[i] = pair ? base_c_[i] : 1.0;
      seed_s_[i] = pair ? base_s_[i] : 0.0;
      step_c_[i] = pair ? p_.addback_freq[i]->step[0] : 1.0;
      step_s_[i] = pair ? p_.addback_freq[i]->step[1] : 0.0;
    }
  }

  // As AddBackRows::Next.
  void Next(float* ab) {
    if (vector_seed_) {
      SeedVectors();
    } else {
      Reseed();
      Pack();
      Advance();
    }
    int r = 0;
    for (; r + 4 <= rows_; r += 4) Tile<4>(r, ab);
    for (; r < rows_; ++r) Tile<1>(r, ab);
  }

 private:
  // The word of 16 (row, pair)s from at: (im << 16) | (re & 0xffff) of the
  // rounded w.
  static __m512i Word(__m512 re, __m512 im, __m512 scale) {
    const __m512i low = _mm512_cvtps_epi32(_mm512_mul_ps(re, scale));
    const __m512i high = _mm512_cvtps_epi32(_mm512_mul_ps(im, scale));
    return _mm512_ternarylogic_epi32(_mm512_slli_epi32(high, 16), low, _mm512_set1_epi32(0xffff), 0xf8);
  }

  static __mmask16 Lanes(int n, int at) { return static_cast<__mmask16>(n - at >= 16 ? 0xffff : (1u << (n - at)) - 1); }

  // words_ from the block's e^{i t0 theta} (Reseed and Pack in vectors),
  // then e^{i t0 theta} to the next block's (Advance).
  void SeedVectors() {
    const __m512d c0 = _mm512_load_pd(seed_c_), s0 = _mm512_load_pd(seed_s_);
    const __m512d c1 = _mm512_load_pd(seed_c_ + 8), s1 = _mm512_load_pd(seed_s_ + 8);
    const __m512 c = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(c0)), _mm512_cvtpd_ps(c1), 1);
    const __m512 s = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(s0)), _mm512_cvtpd_ps(s1), 1);
    const int n = rows_ * pairs_;
    for (int k = 0; k < chunks_; ++k) {
      const __mmask16 lanes = Lanes(n, 16 * k);
      const __m512i pair = _mm512_loadu_si512(pair_lanes_ + 16 * k);
      const __m512 ci = _mm512_permutexvar_ps(pair, c), si = _mm512_permutexvar_ps(pair, s);
      const __m512 x = _mm512_maskz_loadu_ps(lanes, z_re_ + 16 * k), y = _mm512_maskz_loadu_ps(lanes, z_im_ + 16 * k);
      // w = z e^{i t0 theta}: Re = x c + y s, -Im = y c - x s (AddBackRows::Reseed).
      const __m512 re = _mm512_fmadd_ps(x, ci, _mm512_mul_ps(y, si));
      const __m512 im = _mm512_fmsub_ps(y, ci, _mm512_mul_ps(x, si));
      _mm512_mask_storeu_epi32(words_ + 16 * k, lanes, Word(re, im, _mm512_maskz_loadu_ps(lanes, scales_ + 16 * k)));
    }
    const auto advance = [&](__m512d bc, __m512d bs, int at) {
      const __m512d sc = _mm512_load_pd(step_c_ + at), ss = _mm512_load_pd(step_s_ + at);
      _mm512_store_pd(seed_c_ + at, _mm512_fmsub_pd(bc, sc, _mm512_mul_pd(bs, ss)));
      _mm512_store_pd(seed_s_ + at, _mm512_fmadd_pd(bs, sc, _mm512_mul_pd(bc, ss)));
    };
    advance(c0, s0, 0);
    if (pairs_ > 8) advance(c1, s1, 8);
  }

  // words_ from w_re_ and w_im_ (after Reseed).
  void Pack() {
    const int n = rows_ * pairs_;
    for (int at = 0; at < n; at += 16) {
      const __mmask16 lanes = Lanes(n, at);
      const __m512i word = Word(_mm512_maskz_loadu_ps(lanes, w_re_ + at), _mm512_maskz_loadu_ps(lanes, w_im_ + at),
                                _mm512_maskz_loadu_ps(lanes, scales_ + at));
      _mm512_mask_storeu_epi32(words_ + at, lanes, word);
    }
  }

  // acc + the int16 pair dot products of the rotations r with the word at w,
  // broadcast by the instruction from memory.
  static __m512i Dot(__m512i acc, __m512i r, const int32_t* w) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(r), "m"(*w));
    return acc;
  }

  // Rows [r0, r0 + kRows) of ab.
  template <int kRows>
  void Tile(int r0, float* ab) const {
    constexpr int kGroups = kAttendBlock / 16;
    __m512i acc[kRows][kGroups];
    for (int k = 0; k < kRows; ++k) {
      for (int g = 0; g < kGroups; ++g) acc[k][g] = _mm512_setzero_si512();
    }
    for (int i = 0; i < pairs_; ++i) {
      const int32_t* rotation = p_.addback_freq[i]->rotation;
      __m512i f[kGroups];
      for (int g = 0; g < kGroups; ++g) f[g] = _mm512_load_si512(rotation + 16 * g);
      for (int k = 0; k < kRows; ++k) {
        const int32_t* w = words_ + static_cast<size_t>(r0 + k) * pairs_ + i;
        for (int g = 0; g < kGroups; ++g) acc[k][g] = Dot(acc[k][g], f[g], w);
      }
    }
    for (int k = 0; k < kRows; ++k) {
      const __m512 unit = _mm512_set1_ps(unit_[r0 + k]);
      for (int g = 0; g < kGroups; ++g) {
        _mm512_store_ps(ab + (r0 + k) * kAttendBlock + 16 * g, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[k][g]), unit));
      }
    }
  }

  float* scales_ = nullptr;   // [rows][pairs]: each row's scale
  int32_t* words_ = nullptr;  // [rows][pairs]
  float unit_[kMaxRows];      // what an int32 sum unit of row r is worth
  int chunks_ = 0;            // of 16 (row, pair)s
  bool vector_seed_ = false;
  int32_t* pair_lanes_ = nullptr;  // [chunks][16]
  alignas(64) double seed_c_[16];  // e^{i t0 theta} (padded with 1)
  alignas(64) double seed_s_[16];
  alignas(64) double step_c_[16];  // e^{i 64 theta}
  alignas(64) double step_s_[16];
};

// Where a block's groups of 16 tokens have their codes tiles, and the
// tokens' scalars.
struct BlockTokens {
  const uint8_t* key_tiles[kBlock / kGroup];
  const uint8_t* value_tiles[kBlock / kGroup];
  alignas(64) float key_scale[kBlock];       // split keys: the hot part's
  alignas(64) float key_cold_scale[kBlock];  // split keys: the cold part's
  alignas(64) float value_scale[kBlock];
  alignas(64) float value_zero[kBlock];  // uniform values: x = scale * code + zero
};

// What joins a block's compressed scores in SoftmaxBlock: the add-back and
// the exact tokens (addback.h, exact_tokens.h).
struct BlockExtras {
  // Groups [0, compressed_groups) have raw scores; the block's later groups
  // only exact tokens (or none that any row sees).
  int compressed_groups = 0;
  const float* addback = nullptr;       // [rows][kBlock], or null: none
  uint64_t exact = 0;                   // lanes read exact; their tokens' value scales must be zero
  const float* exact_scores = nullptr;  // [rows][kBlock]: their logits, before the add-back
  // [rows][kBlock]: written for the exact lanes of the rows that see the
  // block: their softmax weights, relative to the running maximum (as out).
  float* exact_weights = nullptr;
};

// Per-thread room for the int8 queries (rows x d bytes), 64-byte aligned.
int32_t* QueryWords(size_t bytes) {
  thread_local std::vector<uint8_t> scratch;
  if (scratch.size() < bytes + 64) scratch.resize(bytes + 64);
  return reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
}

// The coordinates of a key that one codebook and one stored scale cover:
// all of them, or (split keys) the hot part and then the cold part, each 64
// coordinates or a multiple of 128 (so its codes are whole words).
struct KeyPart {
  int begin = 0;  // first coordinate (of the rotated query)
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
template <int kKeyBits, FormatFamily kValue, int kValueBits>
struct IntegerAttention {
  static constexpr bool kUniform = kValue == FormatFamily::kUniform;
  static constexpr bool kSplit = IsSplitKeyBits(kKeyBits);
  static constexpr int kParts = kSplit ? 2 : 1;
  static constexpr int kHotBits = kSplit ? kKeyBits / 10 : kKeyBits;
  static constexpr int kColdBits = kSplit ? kKeyBits % 10 : kKeyBits;

  const HeadAttendParams& p;
  const int d;
  const TileKeys<kHotBits> keys;        // every coordinate's, or the hot part's
  const TileKeys<kColdBits> cold_keys;  // split keys: the cold part's
  KeyPart parts[kParts];
  const TileValues<kValue, kValueBits> values;

  // The int8 query, four bytes a word: q4[r * d / 4 + c] holds coordinates
  // 4 c ... 4 c + 3 of row r (each part's in its own unit).
  int32_t* q4 = nullptr;
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
      : p(params), d(params.head_dim), keys(params.key.centroids),
        cold_keys(kSplit ? params.key.cold_centroids : params.key.centroids), values(params.value.centroids) {
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

  // The tokens each row sees of the 16 from group_start on, as lanes.
  static __mmask16 SeenLanes(int64_t seen) {
    return static_cast<__mmask16>(seen >= kGroup ? 0xffff : seen <= 0 ? 0 : (1u << seen) - 1);
  }

  // One block's softmax for every row: from raw[part] (the block's groups of
  // 16 tokens from t0 that have compressed tokens), the tokens' scalars, and
  // the add-back and exact tokens of x, over `groups` groups, fills for each
  // row r
  //   weights[r * kBlock + i]  unsigned 8-bit weights in units of
  //                            weight_unit[r] (zero past the groups; all
  //                            zero, in units of 1, for a row that sees none
  //                            of the block)
  //   correction[r]            the factor out[r] takes before this block's
  //                            values join it (1 for such a row)
  // and moves row_max, row_sum and row_zero on.
  void SoftmaxBlock(int64_t t0, int groups, const int32_t* const* raw, const BlockTokens& tokens, const BlockExtras& x,
                    uint8_t* weights, float* weight_unit, float* correction) {
    // Rows two at a time where both see the block: each row's steps form
    // one long chain (two horizontal maxima, the exponentials, a scan), and
    // two independent chains side by side keep the core busy.
    int pending = -1;  // a row that sees the block, waiting for a partner
    for (int r = 0; r < p.rows; ++r) {
      if (p.visible[r] <= t0) {
        memset(weights + r * kBlock, 0, kBlock);
        weight_unit[r] = 1.0f;
        correction[r] = 1.0f;
        continue;
      }
      if (pending < 0) {
        pending = r;
        continue;
      }
      const int pair[2] = {pending, r};
      SoftmaxRows<2>(pair, t0, groups, raw, tokens, x, weights, weight_unit, correction);
      pending = -1;
    }
    if (pending >= 0) SoftmaxRows<1>(&pending, t0, groups, raw, tokens, x, weights, weight_unit, correction);
  }

  // Unsigned 8-bit fixed point of one row's block of weights (`block`, per
  // group of kGroup lanes), in units of the block's largest weight / 255,
  // rounded with the error carried from token to token: the weights are
  // first taken to 1/256 of a unit (W, exact integers), and token k of the
  // block (in the order lane-major over its groups: any fixed order works)
  // gets round(C_k / 256) - round(C_{k-1} / 256), C_k the sum of W up to k.
  // So any run of tokens weighs within 0.6 units of its exact weight, and
  // weights too small for a unit are not all dropped (each dropped alone, a
  // block of them would lose their mass). A negative or NaN weight (a value
  // scale the encoder never writes) weighs zero. Writes kBlock weights to
  // `to` (zero past `groups`) and returns the unit.
  __attribute__((always_inline)) static float FixedPointWeights(const __m512* block, int groups, uint8_t* to) {
    constexpr int kGroups = kBlock / kGroup;
    const __m512i zero = _mm512_setzero_si512(), half = _mm512_set1_epi32(128);
    __m512 w_max = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int g = 0; g < kGroups; ++g) {
      if (g >= groups) break;
      w_max = _mm512_max_ps(w_max, _mm512_abs_ps(block[g]));
    }
    const float top = simd::Avx512::ReduceMax(w_max);
    const __m512 to_fixed = _mm512_set1_ps(top > 0.0f ? 65280.0f / top : 0.0f);
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
    // round(C / 256) at each token, and at its predecessor in the order:
    // the same lane's previous group, or for group 0 the sum before the
    // lane (the previous lane's last group).
    __m512i rounded_before = _mm512_srli_epi32(_mm512_add_epi32(before, half), 8);
#pragma GCC unroll 4
    for (int g = 0; g < kGroups; ++g) {
      uint8_t* out = to + kGroup * g;
      if (g >= groups) {
        _mm_store_si128(reinterpret_cast<__m128i*>(out), _mm_setzero_si128());
        continue;
      }
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(before, upto[g]), half), 8);
      _mm_store_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_sub_epi32(rounded, rounded_before)));
      rounded_before = rounded;
    }
    return top > 0.0f ? top * (1.0f / 255.0f) : 1.0f;
  }

  // SoftmaxBlock for kRows rows (rows[i], each seeing the block) at once.
  template <int kRows>
  void SoftmaxRows(const int* rows, int64_t t0, int groups, const int32_t* const* raw, const BlockTokens& tokens,
                   const BlockExtras& x, uint8_t* weights, float* weight_unit, float* correction) {
    const float kNegInf = -std::numeric_limits<float>::infinity();
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    constexpr int kGroups = kBlock / kGroup;
    // A row's block of scores, then of weights, stays in registers.
    __m512 block[kRows][kGroups];
    // Soft-capping: one test per group, predicted (it is the call's).
    const bool capped = p.softcap > 0.0f;
    const __m512 cap = _mm512_set1_ps(p.softcap), inv_cap = _mm512_set1_ps(capped ? 1.0f / p.softcap : 0.0f);
    __m512 m[kRows];
#pragma GCC unroll 2
    for (int i = 0; i < kRows; ++i) {
      const int r = rows[i];
      const __m512 unit = _mm512_set1_ps(score_unit[0][r]);
      const __m512i bias = _mm512_set1_epi32(128 * q8_sum[0][r]);
      const __m512 cold_unit = _mm512_set1_ps(score_unit[kParts - 1][r]);
      const __m512i cold_bias = _mm512_set1_epi32(128 * q8_sum[kParts - 1][r]);
      const __m512 shift = _mm512_set1_ps(p.softcap_shift != nullptr ? p.softcap_shift[r] : 0.0f);
      m[i] = neg_inf;
#pragma GCC unroll 4
      for (int g = 0; g < kGroups; ++g) {
        if (g >= groups) break;
        const int64_t group_start = t0 + kGroup * g;
        __m512 s = neg_inf;
        if (g < x.compressed_groups) {
          const __m512i dots = _mm512_sub_epi32(_mm512_load_si512(raw[0] + r * kBlock + kGroup * g), bias);
          s = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots), unit),
                            _mm512_load_ps(tokens.key_scale + kGroup * g));
          if constexpr (kSplit) {
            const __m512i cold =
                _mm512_sub_epi32(_mm512_load_si512(raw[kParts - 1] + r * kBlock + kGroup * g), cold_bias);
            s = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(cold), cold_unit),
                                _mm512_load_ps(tokens.key_cold_scale + kGroup * g), s);
          }
        }
        const __mmask16 exact = static_cast<__mmask16>(x.exact >> (kGroup * g));
        if (exact != 0) s = _mm512_mask_loadu_ps(s, exact, x.exact_scores + r * kBlock + kGroup * g);
        if (x.addback != nullptr) s = _mm512_add_ps(s, _mm512_load_ps(x.addback + r * kBlock + kGroup * g));
        if (capped) s = simd::SoftCap<simd::Avx512>(s, cap, inv_cap, shift);
        const __mmask16 live =
            SeenLanes(p.visible[r] - group_start) & static_cast<__mmask16>(~SeenLanes(p.token_begin - group_start));
        block[i][g] = _mm512_mask_mov_ps(neg_inf, live, s);
        m[i] = _mm512_max_ps(m[i], block[i][g]);
      }
    }
    float new_max[kRows];
    __m512 sum[kRows], zero_sum[kRows];
#pragma GCC unroll 2
    for (int i = 0; i < kRows; ++i) {
      const int r = rows[i];
      new_max[i] = std::max(row_max[r], simd::Avx512::ReduceMax(m[i]));
      // exp(0) without the call: most blocks do not raise the maximum.
      correction[r] = row_max[r] == kNegInf      ? 0.0f
                      : row_max[r] == new_max[i] ? 1.0f
                                                 : std::exp(row_max[r] - new_max[i]);
      row_max[r] = new_max[i];
      sum[i] = zero_sum[i] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int g = 0; g < kGroups; ++g) {
      if (g >= groups) break;
      const __mmask16 exact = static_cast<__mmask16>(x.exact >> (kGroup * g));
#pragma GCC unroll 2
      for (int i = 0; i < kRows; ++i) {
        const __mmask16 live = _mm512_cmp_ps_mask(block[i][g], neg_inf, _CMP_NEQ_OQ);
        const __m512 e =
            _mm512_maskz_mov_ps(live, simd::Exp<simd::Avx512>(_mm512_sub_ps(block[i][g], _mm512_set1_ps(new_max[i]))));
        sum[i] = _mm512_add_ps(sum[i], e);
        // (All lanes: the exact ones are reloaded one by one, which a
        // masked store would not forward to.)
        if (exact != 0) _mm512_storeu_ps(x.exact_weights + rows[i] * kBlock + kGroup * g, e);
        // The compressed values' weights (exact lanes' value scales are zero).
        block[i][g] = _mm512_setzero_ps();
        if (g < x.compressed_groups) {
          if constexpr (kUniform) {
            zero_sum[i] = _mm512_fmadd_ps(e, _mm512_load_ps(tokens.value_zero + kGroup * g), zero_sum[i]);
          }
          block[i][g] = _mm512_mul_ps(e, _mm512_load_ps(tokens.value_scale + kGroup * g));
        }
      }
    }
#pragma GCC unroll 2
    for (int i = 0; i < kRows; ++i) {
      const int r = rows[i];
      weight_unit[r] = FixedPointWeights(block[i], groups, weights + r * kBlock);
      row_sum[r] = row_sum[r] * correction[r] + simd::Avx512::HorizontalSum(sum[i]);
      row_zero[r] = row_zero[r] * correction[r] + simd::Avx512::HorizontalSum(zero_sum[i]);
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
    q4 = QueryWords(static_cast<size_t>(p.rows) * d);
    uint8_t* q8 = reinterpret_cast<uint8_t*>(q4);
    for (int r = 0; r < p.rows; ++r) {
      for (int part = 0; part < kParts; ++part) {
        const int begin = parts[part].begin, end = begin + parts[part].dims;
        const float* q = p.queries + static_cast<size_t>(r) * d;
        __m512 max_abs = _mm512_setzero_ps();
        for (int j = begin; j < end; j += 16) max_abs = _mm512_max_ps(max_abs, _mm512_abs_ps(_mm512_loadu_ps(q + j)));
        const float max = simd::Avx512::ReduceMax(max_abs);
        const float unit = max > 0.0f ? max / 127.0f : 1.0f;
        // lrint(q / unit) (round to nearest even), at most 127 in magnitude.
        const __m512 divisor = _mm512_set1_ps(unit);
        const __m512i limit = _mm512_set1_epi32(127);
        __m512i sum = _mm512_setzero_si512();
        for (int j = begin; j < end; j += 16) {
          __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(q + j), divisor));
          v = _mm512_max_epi32(_mm512_min_epi32(v, limit), _mm512_sub_epi32(_mm512_setzero_si512(), limit));
          sum = _mm512_add_epi32(sum, v);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + static_cast<size_t>(r) * d + j), _mm512_cvtepi32_epi8(v));
        }
        q8_sum[part][r] = static_cast<int32_t>(simd::Avx512::HorizontalSum(_mm512_cvtepi32_ps(sum)));
        score_unit[part][r] = unit * KeyUnit(part);
      }
    }
  }
};

}  // namespace
}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_INTEGER_ATTEND_H_
