// Internal to the CPU backend: the fused float attention kernel for one
// (item, KV head), written once as a template on a float-vector mapping S
// (kernels/simd/simd_mappings.h) and instantiated by attend_avx2.cc
// (simd::Avx2: 8 lanes, 16 registers) and attend_avx512.cc (simd::Avx512: 16
// lanes, 32 registers), each compiled with its ISA's flags.
//
// The algorithm, per block of 64 tokens (one online-softmax step):
// - Walk: where each token's codes live (BlockWalk: tiled planes copied back
//   to token-major) and its scalars; prefetch two blocks ahead.
// - Scores: rows (the query vectors sharing the head) in tiles of 4, 2 or 1
//   (ForRowTiles), tokens in tiles of S::kLanes / rows: one accumulator a
//   (row, token), all S::kLanes of them in registers, each code decoded once
//   for all the tile's rows and the tile's dot products reduced together
//   (S::SumEach, a transpose-add). Codes become floats with S's
//   code-unpacking loads (a vpermps lookup for centroid and packed uniform
//   codes, fp8 through its binary16 bits) in S's lane order; the queries are
//   permuted into the keys' order once. Split keys score their hot and cold
//   parts as two dot products, each times its own scale.
// - Softmax, row by row: the logit (score times the key scale, the exact
//   tokens' logits in their lanes, the pre-RoPE add-back, the soft cap),
//   masked to the tokens the row sees, then the online softmax step; the
//   weights times the value scales replace the logits.
// - Values: row tiles again, S::kRegisters / 2 accumulators over a run of
//   16-coordinate blocks across the block's tokens, each token's weight
//   broadcast once a tile, each code decoded once a tile; then the exact
//   tokens' values (ExactReader).
// - Finish: normalise, back to coordinate order, lse.
// No dequantized copy of the cache is made.
//
// Include only from files compiled for one ISA (anonymous namespace: each
// gets its own copy, simd_mappings.h says why). REQUIRES of a kernel:
// attend_kernels.h's (head_dim a multiple of 16; split keys' hot part too).
#ifndef TQKV_KERNELS_CPU_ATTEND_BODY_H_
#define TQKV_KERNELS_CPU_ATTEND_BODY_H_

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/addback.h"
#include "kernels/cpu/attend_dispatch.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/cpu/exact_tokens.h"
#include "kernels/simd/simd_mappings.h"
#include "kernels/simd/simd_math.h"

namespace tqkv {
namespace cpu_internal {
namespace {
namespace attend_body {

constexpr int kBlock = 64;  // tokens per online-softmax step

// The binary16 at p as a float.
inline float Half(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// Reads one field of a token, a 16-coordinate block at a time in S's lane
// order (Position), before the token's scale and zero (which the kernel folds
// into scores and weights).
template <class S, FormatFamily kFormat, int kBits>
class Decoder {
 public:
  using F32 = typename S::F32;

  explicit Decoder(const FieldReader& field) {
    if constexpr (kPacked) {
      float table[16];
      for (int i = 0; i < 16; ++i) {
        const int code = i % (1 << kBits);
        table[i] = kFormat == FormatFamily::kTurboQuant ? field.centroids[code] : static_cast<float>(code);
      }
      table_ = S::template MakeCodeTable<kBits>(table);
    }
  }

  // Where coordinate j of a 16-coordinate block lands in Block()'s output.
  static int Position(int j) {
    if constexpr (kFormat == FormatFamily::kBf16) return S::Bf16Position(j);
    if constexpr (kPacked) return S::CodePosition(j);
    return j;
  }

  // Coordinates 16 * block ... + 15 into v[0, S::kBlockVectors).
  void Block(const uint8_t* codes, int block, F32* v) const {
    if constexpr (kFormat == FormatFamily::kBf16) {
      S::Bf16x16(codes + 32 * block, v);
    } else if constexpr (kFormat == FormatFamily::kFp16) {
      S::Fp16x16(codes + 32 * block, v);
    } else if constexpr (kFormat == FormatFamily::kFp8) {
      S::Fp8x16(codes + 16 * block, v);  // 2^-8 times the value: kUnitScale undoes it
    } else if constexpr (!kPacked) {     // 8-bit uniform
      S::U8x16(codes + 16 * block, v);
    } else {
      S::template Codes<kBits, kFormat == FormatFamily::kUniform>(table_, codes + 2 * kBits * block, v);
    }
  }

  // The scales of n <= 64 tokens whose scalars follow each other, and for
  // uniform codes their zeros (x = scale * decoded + zero).
  static void Scalars(const uint8_t* scalars, int n, float* scale, float* zero) {
    int k = 0;
    for (; k + S::kLanes <= n; k += S::kLanes) {
      if constexpr (kFormat == FormatFamily::kTurboQuant) {
        S::Store(scale + k, S::LoadHalves(reinterpret_cast<const uint16_t*>(scalars + 2 * k)));
      } else if constexpr (kFormat == FormatFamily::kUniform) {  // [scale, zero] per token
        S::StoreHalfPairs(scalars + 4 * k, scale + k, zero + k);
      } else {
        S::Store(scale + k, S::Set1(kUnitScale));
      }
    }
    for (; k < n; ++k) {
      scale[k] = kScalars > 0 ? Half(scalars + 2 * kScalars * k) : kUnitScale;
      if constexpr (kScalars > 1) zero[k] = Half(scalars + 4 * k + 2);
    }
  }

 private:
  static constexpr bool kPacked =
      kFormat == FormatFamily::kTurboQuant || (kFormat == FormatFamily::kUniform && kBits <= 4);
  static constexpr int kScalars = kFormat == FormatFamily::kUniform ? 2 : kFormat == FormatFamily::kTurboQuant ? 1 : 0;
  // The scale of a field without scalars: Block() reads fp8 as 2^-8 times its value.
  static constexpr float kUnitScale = kFormat == FormatFamily::kFp8 ? 256.0f : 1.0f;

  typename S::CodeTable table_;
};

// Split TurboQuant keys: the hot part's codes, then the cold part's, each
// read by its own centroid Decoder. The query's first hot_dims coordinates
// are the hot part's (PrepareQuery's order); blocks [0, hot_dims / 16) of a
// token are hot. Scalars(): the hot scale and the cold one.
template <class S, int kHotBits, int kColdBits>
class SplitDecoder {
 public:
  explicit SplitDecoder(const FieldReader& field)
      : hot_(field), cold_(ColdPart(field)), hot_blocks_(field.hot_dims / 16), cold_offset_(field.cold_code_offset) {}

  static int Position(int j) { return S::CodePosition(j); }

  void Block(const uint8_t* codes, int block, typename S::F32* v) const {
    if (block < hot_blocks_) {
      hot_.Block(codes, block, v);
    } else {
      cold_.Block(codes + cold_offset_, block - hot_blocks_, v);
    }
  }

  static void Scalars(const uint8_t* scalars, int n, float* hot_scale, float* cold_scale) {
    int k = 0;
    for (; k + S::kLanes <= n; k += S::kLanes) S::StoreHalfPairs(scalars + 4 * k, hot_scale + k, cold_scale + k);
    for (; k < n; ++k) {
      hot_scale[k] = Half(scalars + 4 * k);
      cold_scale[k] = Half(scalars + 4 * k + 2);
    }
  }

 private:
  static FieldReader ColdPart(FieldReader field) {
    field.bits = kColdBits;
    field.centroids = field.cold_centroids;
    return field;
  }

  Decoder<S, FormatFamily::kTurboQuant, kHotBits> hot_;
  Decoder<S, FormatFamily::kTurboQuant, kColdBits> cold_;
  int hot_blocks_;
  int cold_offset_;
};

template <class S, FormatFamily kKey, int kKeyBits, bool kSplit = IsSplitKeyBits(kKeyBits)>
struct KeyDecoderFor {
  using type = Decoder<S, kKey, kKeyBits>;
};
template <class S, int kKeyBits>
struct KeyDecoderFor<S, FormatFamily::kTurboQuant, kKeyBits, true> {  // kKeyBits = SplitKeyBits(hot, cold)
  using type = SplitDecoder<S, kKeyBits / 10, kKeyBits % 10>;
};

// Room for n floats, per thread, 64-byte aligned (rows x head_dim is up to
// 128 KiB: too much for the stack of an arbitrary caller's thread).
inline float* QueryScratch(size_t n) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < n + 16) scratch.resize(n + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
}

// Where each token of a block lives, and its scalars.
struct BlockTokens {
  const uint8_t* key_codes[kBlock];
  const uint8_t* value_codes[kBlock];
  alignas(64) float key_scale[kBlock];
  alignas(64) float key_cold_scale[kBlock];  // split keys
  alignas(64) float value_scale[kBlock];
  alignas(64) float value_zero[kBlock];
};

// The raw dot products (before the token's scale) of S::kLanes / kRows tokens
// with kRows rows over the 16-coordinate blocks [b0, b1) of each token:
// S::kLanes accumulators in registers, each code decoded once for all rows.
// raw[r * kBlock + t] gets row r's product with token t.
template <class S, int kRows, typename KeyDecoder>
inline void ScoreTile(const KeyDecoder& key, const uint8_t* const* codes, const float* q, int d, int b0, int b1,
                      float* raw) {
  using F32 = typename S::F32;
  constexpr int kTokens = S::kLanes / kRows;
  constexpr int kVectors = S::kBlockVectors;
  F32 acc[S::kLanes];
  for (F32& a : acc) a = S::Zero();
  for (int b = b0; b < b1; ++b) {
    if constexpr (kTokens <= 2) {
      // The tokens decoded first, then each query vector loaded once.
      F32 k[kTokens][kVectors];
      for (int t = 0; t < kTokens; ++t) key.Block(codes[t], b, k[t]);
      for (int r = 0; r < kRows; ++r) {
        F32 qv[kVectors];
        for (int v = 0; v < kVectors; ++v) qv[v] = S::Load(q + r * d + 16 * b + S::kLanes * v);
        for (int t = 0; t < kTokens; ++t) {
          for (int v = 0; v < kVectors; ++v) acc[r * kTokens + t] = S::Fmadd(qv[v], k[t][v], acc[r * kTokens + t]);
        }
      }
    } else {
      // One token at a time: the query vectors stay in registers.
      F32 qv[kRows][kVectors];
      for (int r = 0; r < kRows; ++r) {
        for (int v = 0; v < kVectors; ++v) qv[r][v] = S::Load(q + r * d + 16 * b + S::kLanes * v);
      }
      for (int t = 0; t < kTokens; ++t) {
        F32 k[kVectors];
        key.Block(codes[t], b, k);
        for (int r = 0; r < kRows; ++r) {
          for (int v = 0; v < kVectors; ++v) acc[r * kTokens + t] = S::Fmadd(qv[r][v], k[v], acc[r * kTokens + t]);
        }
      }
    }
  }
  alignas(64) float sums[S::kLanes];
  S::Store(sums, S::SumEach(acc));
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTokens; ++t) raw[r * kBlock + t] = sums[r * kTokens + t];
  }
}

// Adds sum_i w[r][i] v_i over the block's `count` tokens to kRows rows of
// out, for the 16-coordinate blocks [b, b + kBlocks): kRows x kBlocks x
// S::kBlockVectors accumulators in registers for the whole block, each code
// decoded once for all rows.
template <class S, int kRows, int kBlocks, typename ValueDecoder>
inline void ValueTile(const ValueDecoder& value, const uint8_t* const* codes, int count, const float* w, int b,
                      float* out, int d) {
  using F32 = typename S::F32;
  constexpr int kVectors = S::kBlockVectors;
  static_assert(kRows * kBlocks * kVectors <= S::kRegisters / 2, "half the registers accumulate");
  F32 acc[kRows][kBlocks * kVectors];
  for (auto& row : acc) {
    for (F32& a : row) a = S::Zero();
  }
  for (int i = 0; i < count; ++i) {
    F32 wi[kRows];
    for (int r = 0; r < kRows; ++r) wi[r] = S::Set1(w[r * kBlock + i]);
    for (int c = 0; c < kBlocks; ++c) {
      F32 v[kVectors];
      value.Block(codes[i], b + c, v);
      for (int r = 0; r < kRows; ++r) {
        for (int u = 0; u < kVectors; ++u) acc[r][kVectors * c + u] = S::Fmadd(wi[r], v[u], acc[r][kVectors * c + u]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kBlocks * kVectors; ++j) {
      float* o = out + r * d + 16 * b + S::kLanes * j;
      S::Store(o, S::Add(S::Load(o), acc[r][j]));
    }
  }
}

// The fused kernel for one pair of formats on S: per block of 64 tokens the
// compressed tokens' raw scores (Scores), the online softmax with the exact
// tokens' logits in their lanes, the add-back and the soft cap (Softmax),
// then the compressed values (Values) and the exact ones
// (ExactReader::Values).
template <class S, FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
class Kernel {
 public:
  using F32 = typename S::F32;
  static constexpr int kGroup = S::kLanes;  // tokens a softmax vector holds
  static constexpr bool kSplit = IsSplitKeyBits(kKeyBits);
  using KeyDecoder = typename KeyDecoderFor<S, kKey, kKeyBits>::type;
  using ValueDecoder = Decoder<S, kValue, kValueBits>;

  explicit Kernel(const HeadAttendParams& params)
      : p(params), d(params.head_dim), blocks(params.head_dim / 16), key(params.key), value(params.value),
        exact(params) {
    const size_t block_floats = static_cast<size_t>(p.rows) * kBlock;
    queries = QueryScratch(static_cast<size_t>(p.rows) * d + 3 * block_floats);
    addback = queries + static_cast<size_t>(p.rows) * d;
    exact_scores = addback + block_floats;
    exact_weights = exact_scores + block_floats;
    for (int r = 0; r < p.rows; ++r) {
      for (int j = 0; j < d; ++j) {
        queries[r * d + j / 16 * 16 + KeyDecoder::Position(j % 16)] = p.queries[static_cast<size_t>(r) * d + j];
      }
      row_max[r] = kNegInf;
      row_sum[r] = 0.0f;
      row_zero[r] = 0.0f;
      memset(p.out + static_cast<size_t>(r) * d, 0, sizeof(float) * d);
    }
    exact.Clear();
  }

  void Run() {
    const int64_t max_visible = *std::max_element(p.visible, p.visible + p.rows);
    static_assert(kBlock == kAttendBlock, "add-back and exact tokens go by the kernels' blocks");
    const int64_t first = RunBlockStart(p, kBlock);
    AddBackRows<S> rows_addback(p, first);
    BlockWalk walk(p, first);
    // No row sees a token of the run: nothing to read (the padding needs one).
    const int64_t end = max_visible > p.token_begin ? max_visible : first;
    // The compressed codes are read up to the exact recent tokens.
    const int64_t compressed_end = CompressedEnd(p, first, end);
    BlockPrefetch prefetch(p, kBlock, first, compressed_end);
    for (int64_t t0 = first; t0 < end; t0 += kBlock) {
      if (rows_addback.active()) rows_addback.Next(addback);
      const int count = static_cast<int>(std::min<int64_t>(kBlock, max_visible - t0));
      const int compressed = static_cast<int>(std::clamp<int64_t>(compressed_end - t0, 0, count));
      const int groups = (count + kGroup - 1) / kGroup;
      const int compressed_groups = (compressed + kGroup - 1) / kGroup;
      const uint64_t exact_lanes = exact.BlockMask(t0, count);
      prefetch.Next();
      if (compressed > 0) Walk(walk, t0, compressed, compressed_groups * kGroup);
      if (exact_lanes != 0) {
        // Exact lanes of compressed tokens weigh nothing there.
        for (int i = 0; i < compressed_groups * kGroup; ++i) {
          if ((exact_lanes >> i) & 1) tokens.value_scale[i] = tokens.value_zero[i] = 0.0f;
        }
        exact.Scores(t0, exact_lanes, exact_scores);
      }
      Scores(t0, compressed_groups);
      prefetch.Next();
      for (int r = 0; r < p.rows; ++r) {
        if (p.visible[r] > t0) Softmax(r, t0, groups, compressed_groups, exact_lanes, rows_addback.active());
      }
      prefetch.Next();
      Values(t0, compressed);
      if (exact_lanes != 0) exact.Values(t0, exact_weights);
      prefetch.Next();
    }
    Finish();
  }

 private:
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // Where the block's compressed tokens live, and their scalars.
  void Walk(BlockWalk& walk, int64_t t0, int compressed, int padded) {
    walk.Next(
        t0, compressed, padded, tokens.key_codes, tokens.value_codes,
        [&](const uint8_t* key_scalars, const uint8_t* value_scalars, int i, int n) {
          KeyDecoder::Scalars(key_scalars, n, tokens.key_scale + i, tokens.key_cold_scale + i);
          ValueDecoder::Scalars(value_scalars, n, tokens.value_scale + i, tokens.value_zero + i);
        },
        [&](int i) {
          tokens.key_scale[i] = tokens.key_cold_scale[i] = tokens.value_scale[i] = tokens.value_zero[i] = 0.0f;
        });
  }

  // The raw scores of the compressed groups, row tile by row tile.
  void Scores(int64_t t0, int compressed_groups) {
    const int hot_blocks = kSplit ? p.key.hot_dims / 16 : blocks;
    ForRowTiles(p.rows, [&](auto tile_rows, int r0) {
      constexpr int kRows = decltype(tile_rows)::value;
      if (*std::max_element(p.visible + r0, p.visible + r0 + kRows) <= t0) return;
      const float* q = queries + r0 * d;
      for (int i = 0; i < compressed_groups * kGroup; i += S::kLanes / kRows) {
        ScoreTile<S, kRows>(key, tokens.key_codes + i, q, d, 0, hot_blocks, weights + r0 * kBlock + i);
        if constexpr (kSplit) {
          ScoreTile<S, kRows>(key, tokens.key_codes + i, q, d, hot_blocks, blocks, cold_raw + r0 * kBlock + i);
        }
      }
    });
  }

  // Row r's logit of group g: its compressed score times the tokens' scales
  // (-inf past the compressed groups), the exact logits in their lanes, the
  // add-back, the soft cap with a cap (masking comes after).
  F32 Logit(int r, int g, int compressed_groups, uint64_t exact_lanes, bool with_addback, F32 cap, F32 inv_cap,
            F32 shift) const {
    const int at = r * kBlock + kGroup * g;
    F32 score = S::Set1(kNegInf);
    if (g < compressed_groups) {
      score = S::Mul(S::Load(weights + at), S::Load(tokens.key_scale + kGroup * g));
      if constexpr (kSplit) {
        score = S::Fmadd(S::Load(cold_raw + at), S::Load(tokens.key_cold_scale + kGroup * g), score);
      }
    }
    const unsigned exact_group = static_cast<unsigned>((exact_lanes >> (kGroup * g)) & ((uint64_t{1} << kGroup) - 1));
    if (exact_group != 0) score = S::Select(S::LaneBits(exact_group), S::Load(exact_scores + at), score);
    if (with_addback) score = S::Add(score, S::Load(addback + at));
    if (p.softcap > 0.0f) score = simd::SoftCap<S>(score, cap, inv_cap, shift);  // predicted: the call's
    return score;
  }

  // Row r's logits of the block (Logit, masked to the tokens the row sees),
  // then its online softmax step: weights times the value scales in place of
  // the logits, and the exact lanes' weights to exact_weights.
  void Softmax(int r, int64_t t0, int groups, int compressed_groups, uint64_t exact_lanes, bool with_addback) {
    const F32 neg_inf = S::Set1(kNegInf);
    float* w = weights + r * kBlock;
    const F32 cap = S::Set1(p.softcap), inv_cap = S::Set1(p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f);
    const F32 shift = S::Set1(p.softcap_shift != nullptr ? p.softcap_shift[r] : 0.0f);
    F32 m = neg_inf;
    for (int g = 0; g < groups; ++g) {
      const int64_t group_start = t0 + kGroup * g;
      const int64_t seen = p.visible[r] - group_start;
      if (seen <= 0) {
        S::Store(w + kGroup * g, neg_inf);
        continue;
      }
      const int before = static_cast<int>(std::clamp<int64_t>(p.token_begin - group_start, 0, kGroup));
      const typename S::Mask live = S::RangeMask(before, static_cast<int>(std::min<int64_t>(seen, kGroup)));
      const F32 score =
          S::Select(live, Logit(r, g, compressed_groups, exact_lanes, with_addback, cap, inv_cap, shift), neg_inf);
      S::Store(w + kGroup * g, score);
      m = S::Max(m, score);
    }
    const float new_max = std::max(row_max[r], S::ReduceMax(m));
    // exp(0) without the call: most blocks do not raise the maximum.
    const float correction = row_max[r] == kNegInf   ? 0.0f
                             : row_max[r] == new_max ? 1.0f
                                                     : std::exp(row_max[r] - new_max);
    row_max[r] = new_max;
    F32 sum = S::Zero(), zero_sum = S::Zero();
    for (int g = 0; g < groups; ++g) {
      const F32 s = S::Load(w + kGroup * g);
      const F32 e = S::MaskZero(S::NotEqual(s, neg_inf), simd::Exp<S>(S::Sub(s, S::Set1(new_max))));
      if (exact_lanes != 0) S::Store(exact_weights + r * kBlock + kGroup * g, e);
      // Lanes past the compressed groups hold no compressed token.
      const F32 value_scale = g < compressed_groups ? S::Load(tokens.value_scale + kGroup * g) : S::Zero();
      S::Store(w + kGroup * g, S::Mul(e, value_scale));
      sum = S::Add(sum, e);
      if constexpr (kValue == FormatFamily::kUniform) {
        if (g < compressed_groups) zero_sum = S::Fmadd(e, S::Load(tokens.value_zero + kGroup * g), zero_sum);
      }
    }
    row_sum[r] = row_sum[r] * correction + S::HorizontalSum(sum);
    row_zero[r] = row_zero[r] * correction + S::HorizontalSum(zero_sum);
    exact.Rescale(r, correction);
    if (correction != 1.0f) {
      float* out = p.out + static_cast<size_t>(r) * d;
      const F32 factor = S::Set1(correction);
      for (int c = 0; c < d; c += S::kLanes) S::Store(out + c, S::Mul(S::Load(out + c), factor));
    }
  }

  // Value tiles of kBlocks blocks from b while they fit, then of half as
  // many, down to one block.
  template <int kRows, int kBlocks>
  void ValueBlocks(int& b, int compressed, const float* w, float* out) const {
    for (; b + kBlocks <= blocks; b += kBlocks) {
      ValueTile<S, kRows, kBlocks>(value, tokens.value_codes, compressed, w, b, out, d);
    }
    if constexpr (kBlocks > 1) ValueBlocks<kRows, kBlocks / 2>(b, compressed, w, out);
  }

  // The compressed values of the block's first `compressed` tokens, row tile
  // by row tile (rows that see none of the block weigh zero).
  void Values(int64_t t0, int compressed) {
    ForRowTiles(p.rows, [&](auto tile_rows, int r0) {
      constexpr int kRows = decltype(tile_rows)::value;
      if (*std::max_element(p.visible + r0, p.visible + r0 + kRows) <= t0) return;
      for (int r = r0; r < r0 + kRows; ++r) {
        if (p.visible[r] <= t0) memset(weights + r * kBlock, 0, sizeof(float) * kBlock);
      }
      int b = 0;
      ValueBlocks<kRows, S::kRegisters / 2 / (kRows * S::kBlockVectors)>(b, compressed, weights + r0 * kBlock,
                                                                         p.out + static_cast<size_t>(r0) * d);
    });
  }

  // Normalises out (back in coordinate order) and the exact share, writes lse.
  void Finish() {
    float line[kMaxHeadDim];
    for (int r = 0; r < p.rows; ++r) {
      float* out = p.out + static_cast<size_t>(r) * d;
      if (row_sum[r] == 0.0f) {  // saw no token
        memset(out, 0, sizeof(float) * d);
        exact.Finish(r, 0.0f);
        p.lse[r] = kNegInf;
        continue;
      }
      const float inv = 1.0f / row_sum[r];
      const float shift = row_zero[r] * inv;
      for (int j = 0; j < d; ++j) line[j] = out[j / 16 * 16 + ValueDecoder::Position(j % 16)] * inv + shift;
      memcpy(out, line, sizeof(float) * d);
      exact.Finish(r, inv);
      p.lse[r] = row_max[r] + std::log(row_sum[r]);
    }
  }

  const HeadAttendParams& p;
  const int d;
  const int blocks;  // of 16 coordinates
  const KeyDecoder key;
  const ValueDecoder value;
  ExactReader<S> exact;
  float* queries;                                // [rows][d], in the keys' lane order
  float* addback;                                // [rows][kBlock]: the block's add-back
  float* exact_scores;                           // [rows][kBlock]: the block's exact logits
  float* exact_weights;                          // [rows][kBlock]: and their weights
  alignas(64) float weights[kMaxRows * kBlock];  // per block: raw scores, logits, then weights
  alignas(64) float cold_raw[kSplit ? kMaxRows * kBlock : 1];
  BlockTokens tokens;
  float row_max[kMaxRows], row_sum[kMaxRows], row_zero[kMaxRows];
};

// The kernel set of attend_dispatch.h for S: every pair and width of the
// format table, two-part keys only with kSplitKeys.
template <class S, bool kSplitKeys>
struct FloatKernels {
  static constexpr bool Reads(FormatFamily, int key_bits, FormatFamily, int) {
    return kSplitKeys || !IsSplitKeyBits(key_bits);
  }
  template <FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
  static void Run(const HeadAttendParams& params) {
    Kernel<S, kKey, kKeyBits, kValue, kValueBits>(params).Run();
  }
};

// Whether FloatKernels<S, kSplitKeys> reads this pair at this head dim.
template <class S, bool kSplitKeys>
bool Supported(const FieldReader& key, const FieldReader& value, int head_dim) {
  if (key.split() && key.hot_dims % 16 != 0) return false;
  return head_dim % 16 == 0 && PickAttendKernel<FloatKernels<S, kSplitKeys>>(key, value) != nullptr;
}

template <class S, bool kSplitKeys>
void Attend(const HeadAttendParams& params) {
  PickAttendKernel<FloatKernels<S, kSplitKeys>>(params.key, params.value)(params);
}

}  // namespace attend_body
}  // namespace
}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_ATTEND_BODY_H_
