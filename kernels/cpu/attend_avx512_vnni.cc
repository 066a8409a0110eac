// AVX-512 integer attention for TurboQuant pages (centroid keys, or split
// keys as two parts with their own codebooks, scales and int8 query units;
// centroid or uniform values; 2-4 bits; head_dim 64 or a multiple of 128; see
// AttendHeadAvx512VnniSupported), on CPUs with VNNI, VBMI and VBMI2. The
// fp32 kernels spend 2 x rows x head_dim FMA lanes per token and head; this
// one spends a quarter of that on scores and on values, on codes read in the
// tiles the page holds them in (kernels/code_tiles.h: 16 tokens, one 32-bit
// lane each, per 64-byte vector of one word):
//
// - Scores with vpdpbusd, 16 tokens per vector, one per lane: a vector holds
//   four coordinates of each token as centroid bytes (TileKeys::Group:
//   vpmultishiftqb takes each code's bits from a word of two tokens, or a
//   vpshrdd of two words where the codes straddle them; vpermb maps them to
//   the codebook, one table for every coordinate), against a dword of four
//   int8 query bytes broadcast from memory. The 16 lanes are the 16 tokens'
//   scores: no transposing, no horizontal sums. (Before 2026-12-04, with
//   token-major pages, a vector held 32 coordinates of two tokens and each
//   score took a transpose-add: about twice the work.)
// - Values with vpdpbusd too, four tokens per instruction: a vector holds 16
//   coordinates of four tokens as signed bytes (lane i: coordinate i of
//   each; TileValues::Quad: vpermt2d puts two words of eight tokens side by
//   side, vpermb gathers a quad's bytes, vpmultishiftqb aligns, then a mask
//   for uniform codes or vpermb onto the centroids in int8), times the dword
//   of the four tokens' softmax weights (times their scales) in unsigned
//   8-bit fixed point per row and block, the rounding error carried from
//   token to token (integer_attend.h). (Not vdpbf16ps: on Intel cores it
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

#include "kernels/cpu/addback.h"
#include "kernels/cpu/attend_dispatch.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/cpu/exact_tokens.h"
#include "kernels/cpu/integer_attend.h"
#include "kernels/simd/simd_mappings.h"

namespace tqkv {
namespace cpu_internal {
namespace {

// The fp16 scalars of n <= 64 tokens whose scalars follow each other: one
// scale per token into `scale` (zero == nullptr), or [scale, zero] pairs
// into `scale` and `zero`.
inline void LoadScalars(const uint8_t* scalars, int n, float* scale, float* zero) {
  for (int k = 0; k < n; k += 16) {
    const __mmask16 lanes = static_cast<__mmask16>(n - k >= 16 ? 0xffff : (1u << (n - k)) - 1);
    if (zero == nullptr) {
      _mm512_mask_storeu_ps(scale + k, lanes, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scalars + 2 * k)));
      continue;
    }
    const __m512 lo = _mm512_cvtph_ps(_mm256_maskz_loadu_epi32(static_cast<__mmask8>(lanes), scalars + 4 * k));
    const __m512 hi =
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi32(static_cast<__mmask8>(lanes >> 8), scalars + 4 * k + 32));
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    _mm512_mask_storeu_ps(scale + k, lanes, _mm512_permutex2var_ps(lo, even, hi));
    _mm512_mask_storeu_ps(zero + k, lanes,
                          _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi));
  }
}

// acc + the byte dot products (vpdpbusd) of the unsigned bytes k with the
// dword of four signed query bytes at q, broadcast by the instruction from
// memory (left to the compiler, a tile's query words would be hoisted into
// registers and spill the accumulators).
inline __m512i DotQuery(__m512i acc, __m512i k, const int32_t* q) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(k), "m"(*q));
  return acc;
}

// acc + the byte dot products (vpdpbusd) of the unsigned weights w with
// the signed value bytes v. GCC 12's intrinsic copies its accumulator at
// every call, which spilled a tile's 16.
inline __m512i DotWeights(__m512i acc, __m512i w, __m512i v) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(v));
  return acc;
}

// Per-thread room for n floats, 64-byte aligned (a block's add-back and
// exact-token scratch: up to 48 KiB, too much for an arbitrary caller's stack).
float* BlockScratch(size_t n) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < n + 16) scratch.resize(n + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
}

// The integer kernel: scores and values through vpdpbusd on codes tiles.
template <int kKeyBits, FormatFamily kValue, int kValueBits>
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

  // Raw scores (before the +128 correction) of one key part for kRows rows
  // and the 16 tokens of a tile, into raw[r * kBlock]: per row, the sum over
  // the part's coordinates of key byte x query byte.
  template <int kRows, int kBits>
  void ScoreTile(const TileKeys<kBits>& part_keys, const KeyPart& part, const uint8_t* tile, int r0,
                 int32_t* raw) const {
    using Keys = TileKeys<kBits>;
    // Accumulators per row: two with four rows, four with fewer, so that
    // enough chains of dot products run at once.
    constexpr int kChains = kRows >= 4 ? 2 : 4;
    __m512i acc[kRows][kChains];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
      for (int c = 0; c < kChains; ++c) acc[r][c] = _mm512_setzero_si512();
    }
    const uint8_t* words = tile + 64 * (part.code_offset / kTileWordBytes);
    const int32_t* q = this->q4 + static_cast<size_t>(r0) * (d / 4) + part.begin / 4;
    const int periods = part.dims * kBits / 32 / Keys::kPeriodWords;
    for (int period = 0; period < periods; ++period) {
      __m512i w[Keys::kPeriodWords], shifted[2];
#pragma GCC unroll 3
      for (int i = 0; i < Keys::kPeriodWords; ++i) w[i] = TileWord(words, Keys::kPeriodWords * period + i);
      if constexpr (kBits == 3) {
        shifted[0] = _mm512_shrdi_epi32(w[0], w[1], 16);
        shifted[1] = _mm512_shrdi_epi32(w[1], w[2], 16);
      }
#pragma GCC unroll 8
      for (int m = 0; m < Keys::kPeriodGroups; ++m) {
        const __m512i k = part_keys.Group(m, w, shifted);
        const int group = Keys::kPeriodGroups * period + m;
#pragma GCC unroll 4
        for (int r = 0; r < kRows; ++r) {
          acc[r][m % kChains] = DotQuery(acc[r][m % kChains], k, q + static_cast<size_t>(r) * (d / 4) + group);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      __m512i sum = acc[r][0];
#pragma GCC unroll 4
      for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, acc[r][c]);
      _mm512_store_si512(raw + r * kBlock, sum);
    }
  }

  // Raw scores of a row tile for one key part over a block's groups.
  template <int kRows>
  void ScorePart(int part, const BlockTokens& tokens, int groups, int r0, int32_t* raw) const {
    for (int g = 0; g < groups; ++g) {
      if (part == 0) {
        ScoreTile<kRows>(keys, parts[0], tokens.key_tiles[g], r0, raw + kGroup * g);
      } else if constexpr (kSplit) {
        ScoreTile<kRows>(cold_keys, parts[1], tokens.key_tiles[g], r0, raw + kGroup * g);
      }
    }
  }

  // out[r0 + r][16 (m0 + c) + i] += the sum over the block's groups of
  // weight x value, for kRows rows and kChunks chunks of 16 coordinates from m0:
  // int32 accumulators of signed value bytes times unsigned 8-bit weights
  // (in units of weight_unit[r]).
  template <int kRows, int kChunks>
  void ValueTile(const BlockTokens& tokens, int groups, const uint8_t* weights, const float* weight_unit, int r0,
                 int m0) {
    using Values = TileValues<kValue, kValueBits>;
    __m512i acc[kRows][kChunks];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) acc[r][c] = _mm512_setzero_si512();
    }
    for (int g = 0; g < groups; ++g) {
      const uint8_t* tile = tokens.value_tiles[g];
      // Each chunk's sources (the two halves' words side by side), then
      // quad by quad the rows' four weights, shared by every chunk.
      __m512i source[kChunks][2];
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) {
        source[c][0] = Values::ChunkSource(tile, m0 + c, 0);
        if constexpr (kValueBits > 2) source[c][1] = Values::ChunkSource(tile, m0 + c, 1);
      }
#pragma GCC unroll 4
      for (int quad = 0; quad < 4; ++quad) {
        __m512i w[kRows];
#pragma GCC unroll 4
        for (int r = 0; r < kRows; ++r) {
          // The quad's four weights, broadcast from memory (no shuffle).
          int32_t four;
          memcpy(&four, weights + r * kBlock + kGroup * g + 4 * quad, 4);
          w[r] = _mm512_set1_epi32(four);
        }
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) {
          const __m512i v = values.Quad(source[c][kValueBits > 2 ? quad / 2 : 0], m0 + c, quad);
#pragma GCC unroll 4
          for (int r = 0; r < kRows; ++r) acc[r][c] = DotWeights(acc[r][c], w[r], v);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const float unit = weight_unit[r] * values.unit();
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) this->FoldValues(r0 + r, 16 * (m0 + c), acc[r][c], unit);
    }
  }

  // Raw scores of the block's compressed groups, every row tile that sees the block.
  void ScoreBlock(int64_t t0, const BlockTokens& tokens, int groups, int32_t (*raw)[kMaxRows * kBlock]) const {
    ForRowTiles(p.rows, [&](auto tile_rows, int r0) {
      constexpr int kRows = decltype(tile_rows)::value;
      if (*std::max_element(p.visible + r0, p.visible + r0 + kRows) <= t0) return;
      for (int part = 0; part < kParts; ++part) ScorePart<kRows>(part, tokens, groups, r0, raw[part] + r0 * kBlock);
    });
  }

  // The block's compressed values, tile by tile; rows that see none of the
  // block weigh zero.
  void ValueBlock(int64_t t0, const BlockTokens& tokens, int groups, const uint8_t* weights, const float* weight_unit) {
    ForRowTiles(p.rows, [&](auto tile_rows, int r0) {
      constexpr int kRows = decltype(tile_rows)::value;
      if (*std::max_element(p.visible + r0, p.visible + r0 + kRows) <= t0) return;
      const uint8_t* w = weights + r0 * kBlock;
      const float* unit = weight_unit + r0;
      // (ValueTile's weights and units are the tile's rows'.)
      // As many chunks of 16 coordinates at once as 16 accumulators hold.
      constexpr int kChunks = kRows >= 4 ? 2 : kRows == 2 ? 4 : 8;
      const int chunks = d / 16;
      int m = 0;
      for (; m + kChunks <= chunks; m += kChunks) ValueTile<kRows, kChunks>(tokens, groups, w, unit, r0, m);
      for (; m < chunks; m += 4) ValueTile<kRows, 4>(tokens, groups, w, unit, r0, m);
    });
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
    // The add-back, the exact tokens' logits and weights: [rows][kBlock] each.
    float* extras = BlockScratch(3 * static_cast<size_t>(rows) * kBlock);
    BlockExtras x;
    x.addback = p.addback_pairs > 0 ? extras : nullptr;
    x.exact_scores = extras + static_cast<size_t>(rows) * kBlock;
    x.exact_weights = extras + 2 * static_cast<size_t>(rows) * kBlock;

    static_assert(kBlock == kAttendBlock, "add-back and exact tokens go by the kernels' blocks");
    const int64_t first = RunBlockStart(p, kBlock);
    IntegerAddBack addback(p, first);
    ExactReader<simd::Avx512> exact(p);
    exact.Clear();
    const int64_t end = max_visible > p.token_begin ? max_visible : first;
    // The compressed codes are read up to the exact recent tokens (the sinks' are
    // read and their logits replaced: a few lanes of one group).
    const int64_t compressed_end = CompressedEnd(p, first, end);
    BlockWalk walk(p, first);
    BlockPrefetch prefetch(p, kBlock, first, compressed_end);
    for (int64_t t0 = first; t0 < end; t0 += kBlock) {
      if (addback.active()) addback.Next(extras);
      const int count = static_cast<int>(std::min<int64_t>(kBlock, max_visible - t0));
      const int compressed = static_cast<int>(std::clamp<int64_t>(compressed_end - t0, 0, count));
      const int groups = (count + kGroup - 1) / kGroup;
      x.compressed_groups = (compressed + kGroup - 1) / kGroup;
      x.exact = exact.BlockMask(t0, count);
      prefetch.Next();
      if (compressed > 0) {
        walk.NextTiles(
            t0, compressed, x.compressed_groups * kGroup, tokens.key_tiles, tokens.value_tiles,
            [&](const uint8_t* key_scalars, const uint8_t* value_scalars, int i, int n) {
              LoadScalars(key_scalars, n, tokens.key_scale + i, kSplit ? tokens.key_cold_scale + i : nullptr);
              LoadScalars(value_scalars, n, tokens.value_scale + i, kUniform ? tokens.value_zero + i : nullptr);
            },
            [&](int i) {
              tokens.key_scale[i] = tokens.key_cold_scale[i] = tokens.value_scale[i] = tokens.value_zero[i] = 0.0f;
            });
      }
      if (x.exact != 0) {
        // Exact lanes of compressed groups weigh nothing there.
        for (int g = 0; g < x.compressed_groups; ++g) {
          const __mmask16 lanes = static_cast<__mmask16>(x.exact >> (kGroup * g));
          _mm512_mask_storeu_ps(tokens.value_scale + kGroup * g, lanes, _mm512_setzero_ps());
          _mm512_mask_storeu_ps(tokens.value_zero + kGroup * g, lanes, _mm512_setzero_ps());
        }
        exact.Scores(t0, x.exact, const_cast<float*>(x.exact_scores));
      }
      ScoreBlock(t0, tokens, x.compressed_groups, raw);

      prefetch.Next();
      this->SoftmaxBlock(t0, groups, raw_parts, tokens, x, weights, weight_unit, correction);
      for (int r = 0; r < rows; ++r) {
        this->Rescale(r, correction[r]);
        exact.Rescale(r, correction[r]);
      }

      prefetch.Next();
      ValueBlock(t0, tokens, x.compressed_groups, weights, weight_unit);
      if (x.exact != 0) exact.Values(t0, x.exact_weights);
      prefetch.Next();
    }
    for (int r = 0; r < rows; ++r) exact.Finish(r, this->row_sum[r] > 0.0f ? 1.0f / this->row_sum[r] : 0.0f);
    this->Finish();
  }
};

// The integer kernel's share of the table: TurboQuant keys (one or two
// parts) with TurboQuant or uniform values of at most 4 bits.
struct VnniKernels {
  static constexpr bool Reads(FormatFamily key, int, FormatFamily value, int value_bits) {
    return key == FormatFamily::kTurboQuant &&
           (value == FormatFamily::kTurboQuant || value == FormatFamily::kUniform) && value_bits <= 4;
  }
  template <FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
  static void Run(const HeadAttendParams& params) {
    Kernel<kKeyBits, kValue, kValueBits>(params).Run();
  }
};

// A key part's coordinates as the score tiles take them: whole periods of
// words at every width (TileKeys).
bool WholeSegments(int dims) { return dims == 64 || (dims > 0 && dims % 128 == 0); }

AttendKernel Pick(const FieldReader& key, const FieldReader& value, int head_dim) {
  const bool whole =
      key.split() ? WholeSegments(key.hot_dims) && WholeSegments(head_dim - key.hot_dims) : WholeSegments(head_dim);
  return whole ? PickAttendKernel<VnniKernels>(key, value) : nullptr;
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
