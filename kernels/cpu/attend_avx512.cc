// AVX-512 fused attention for one (item, KV head): scores straight from the
// packed codes (a codebook lookup with vpermps, then FMAs against the rotated
// query), online softmax per block of 64 tokens, values accumulated in their
// own basis. No dequantized copy of the cache is made.
//
// Tokens go in groups of 16, expanded into a 16 x d scratch block in L1, and
// the work per group is bounded by FMAs (rows x d / 16 each for scores and
// values) plus about three shuffle/ALU uops per 16 expanded coordinates:
// - Scores: a key vector holds 8 coordinates of two tokens, so one FMA chain
//   serves two tokens and the 16 dot products of a row reduce with 21 shuffle
//   and add uops. Two rows go together so each key vector is loaded once.
// - Values: per 16-coordinate chunk, the group's 16 value chunks are loaded
//   once and every row's accumulator takes 16 FMAs between a load and a store.
// Each format expands in whatever lane order is cheapest; queries are
// permuted into the key order and outputs back from the value order.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/addback.h"
#include "kernels/cpu/attend_avx512_common.h"
#include "kernels/cpu/attend_dispatch.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/cpu/exact_tokens.h"
#include "kernels/simd/simd_mappings.h"

namespace tqkv {
namespace cpu_internal {
namespace {

using avx512::Exp;
using avx512::Max;
using avx512::Sum;

constexpr int kLanes = 16;
constexpr int kGroup = 16;  // tokens scored and accumulated together
constexpr int kBlock = 64;  // tokens per online-softmax step

// Key vector p of a group holds tokens kPairFirst[p] (lanes 0-7) and
// kPairFirst[p] + 4 (lanes 8-15); with this pairing SumPairs returns the 16
// dot products in token order.
constexpr int kPairFirst[8] = {0, 1, 2, 3, 8, 9, 10, 11};

// Lane t of the result is the full dot product of token t, given acc[p] with
// the partial products of pair p: a transpose-add in 21 uops.
inline __m512 SumPairs(const __m512 acc[8]) {
  __m512 a[4], b[2];
  for (int i = 0; i < 4; ++i) {
    a[i] =
        _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]), _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {
    b[i] =
        _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xee));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
}

inline int Load32(const uint8_t* p) {
  int v;
  memcpy(&v, p, sizeof(v));
  return v;
}

inline long long Load64(const uint8_t* p) {
  long long v;
  memcpy(&v, p, sizeof(v));
  return v;
}

// Reads one field of a token, before the token's scale and zero (which the
// kernel folds into scores and weights), in a lane order of its choosing.
template <FormatFamily kFormat, int kBits>
class Decoder {
 public:
  explicit Decoder(const FieldReader& field) {
    if constexpr (kLookup) {
      // vpermps reads index bits [3:0]: with the 2^b entries repeated over 16,
      // the bits of the next code above a code do not matter, so codes need
      // no mask. Uniform codes become floats through the same lookup.
      alignas(64) float table[16];
      for (int i = 0; i < 16; ++i) {
        const int code = i % (1 << kBits);
        table[i] = kFormat == FormatFamily::kTurboQuant ? field.centroids[code] : static_cast<float>(code);
      }
      table_ = _mm512_load_ps(table);
      // Pairs(): code 8h + j of a 16-code block sits at bit pair_shift_[h][j]
      // of the dword it reads (h = 0: first vector, 1: second).
      // Chunk(): code j sits at bit chunk_shift_[lane] of the lane's dword of
      // a broadcast qword, lanes 2j and 2j + 1 holding codes j and j + 8.
      alignas(64) int pair_shift[2][16], chunk_shift[16];
      for (int j = 0; j < 8; ++j) {
        for (int half = 0; half < 2; ++half) {  // of the vector: token a, token b
          pair_shift[0][8 * half + j] = kBits * j;
          pair_shift[1][8 * half + j] = kBits * j + (kBits == 2 ? 16 : kBits == 3 ? 8 : 0);
        }
        chunk_shift[2 * j] = kBits * j + (kBits == 3 ? 8 : 0);
        chunk_shift[2 * j + 1] = kBits * j + (kBits == 2 ? 16 : 0);
      }
      pair_shift_[0] = _mm512_load_si512(pair_shift[0]);
      pair_shift_[1] = _mm512_load_si512(pair_shift[1]);
      chunk_shift_ = _mm512_load_si512(chunk_shift);
    }
  }

  // Where coordinate j of a 16-coordinate block lands in the output of
  // Pairs(): positions 0-7 in the first vector, 8-15 in the second.
  static int PairPosition(int j) { return kFormat == FormatFamily::kBf16 ? (j % 2) * 8 + j / 2 : j; }

  // Keys: coordinates 16 * block ... + 15 of tokens a and b as two vectors,
  // each holding 8 coordinates of a (lanes 0-7) and the same 8 of b.
  void Pairs(const uint8_t* a, const uint8_t* b, int block, __m512* first, __m512* second) const {
    if constexpr (kFormat == FormatFamily::kBf16) {
      // A bf16 is the top half of a float: even coordinates shift up, odd
      // ones need only their low half cleared.
      const __m512i both = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * block))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * block)), 1);
      *first = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
      *second = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    } else if constexpr (kFormat == FormatFamily::kFp16) {
      const auto halves = [&](int at) {
        return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b + at), reinterpret_cast<const __m128i*>(a + at));
      };
      *first = _mm512_cvtph_ps(halves(32 * block));
      *second = _mm512_cvtph_ps(halves(32 * block + 16));
    } else if constexpr (kFormat == FormatFamily::kFp8) {
      // Bytes a0-7 b0-7 and a8-15 b8-15, each then as halves (Fp8Halves).
      const __m128i ra = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * block));
      const __m128i rb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * block));
      *first = _mm512_cvtph_ps(Fp8Halves(_mm_unpacklo_epi64(ra, rb)));
      *second = _mm512_cvtph_ps(Fp8Halves(_mm_unpackhi_epi64(ra, rb)));
    } else {
      static_assert(kLookup, "keys are centroids, fp16, bf16 or fp8");
      // 8 codes take kBits bytes; the second dword is placed so that neither
      // read leaves the block's 2 * kBits bytes.
      const int at = 2 * kBits * block, second_at = at + (kBits == 2 ? 0 : kBits == 3 ? 2 : 4);
      const __m512i w0 = _mm512_mask_set1_epi32(_mm512_set1_epi32(Load32(a + at)), 0xff00, Load32(b + at));
      const __m512i w1 =
          _mm512_mask_set1_epi32(_mm512_set1_epi32(Load32(a + second_at)), 0xff00, Load32(b + second_at));
      *first = _mm512_permutexvar_ps(_mm512_srlv_epi32(w0, pair_shift_[0]), table_);
      *second = _mm512_permutexvar_ps(_mm512_srlv_epi32(w1, pair_shift_[1]), table_);
    }
  }

  // Where coordinate j of a head_dim vector lands in the output of Chunk().
  static int ChunkPosition(int j, int head_dim) {
    const int base = j / 32 * 32;
    if constexpr (kFormat == FormatFamily::kBf16) {
      if (base + 32 <= head_dim) return base + (j % 2) * 16 + (j - base) / 2;
      return j;
    } else if constexpr (kLookup) {
      return j / 16 * 16 + (j % 16 < 8 ? 2 * (j % 8) : 2 * (j % 8) + 1);
    } else {
      return j;
    }
  }

  // Values: 16 coordinates (chunk c, in ChunkPosition order).
  __m512 Chunk(const uint8_t* codes, int c, int chunks) const {
    if constexpr (kFormat == FormatFamily::kBf16) {
      if (c / 2 * 2 + 1 < chunks) {  // 32 coordinates: even ones, then odd ones
        const __m512i both = _mm512_loadu_si512(codes + 64 * (c / 2));
        return _mm512_castsi512_ps(c % 2 == 0
                                       ? _mm512_slli_epi32(both, 16)
                                       : _mm512_and_si512(both, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
      }
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * c));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    } else if constexpr (kFormat == FormatFamily::kFp16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * c)));
    } else if constexpr (kFormat == FormatFamily::kFp8) {
      return _mm512_cvtph_ps(Fp8Halves(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * c))));
    } else if constexpr (!kLookup) {  // 8-bit uniform
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * c));
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw));
    } else {
      // One broadcast qword whose low dword holds codes 0-7 of the chunk and
      // whose high dword holds codes 8-15. For 3 bits it starts a byte before
      // the chunk and ends a byte after it: the value codes plane follows the
      // key planes and precedes its scalars plane in the same page, so both
      // bytes are inside the page.
      const __m512i words = kBits == 2 ? _mm512_set1_epi32(Load32(codes + 4 * c))
                                       : _mm512_set1_epi64(Load64(codes + 2 * kBits * c - (kBits == 3 ? 1 : 0)));
      return _mm512_permutexvar_ps(_mm512_srlv_epi32(words, chunk_shift_), table_);
    }
  }

  // The scales of n <= 64 tokens whose scalars follow each other, and for
  // uniform codes their zeros (x = scale * decoded + zero).
  static void Scalars(const uint8_t* scalars, int n, float* scale, float* zero) {
    if constexpr (kFormat == FormatFamily::kTurboQuant) {
      avx512::LoadScalars(scalars, n, scale, nullptr);
    } else if constexpr (kFormat == FormatFamily::kUniform) {  // [scale, zero] per token
      avx512::LoadScalars(scalars, n, scale, zero);
    } else {
      for (int k = 0; k < n; k += 16) {
        const __mmask16 lanes = static_cast<__mmask16>(n - k >= 16 ? 0xffff : (1u << (n - k)) - 1);
        _mm512_mask_storeu_ps(scale + k, lanes, _mm512_set1_ps(kUnitScale));
      }
    }
  }

 private:
  // The scale of a field without scalars: fp8 is read as 2^-8 times its value.
  static constexpr float kUnitScale = kFormat == FormatFamily::kFp8 ? 256.0f : 1.0f;

  // 16 fp8 E4M3 bytes as binary16 bits: sign to bit 15, exponent and
  // mantissa to bits 13-7 (x << 8, an arithmetic shift right by one, a
  // mask). Each half is the fp8 value times 2^-8, subnormals included, and
  // vcvtph2ps widens it exactly.
  static __m256i Fp8Halves(__m128i bytes) {
    const __m256i x = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
    return _mm256_and_si256(_mm256_srai_epi16(x, 1), _mm256_set1_epi16(static_cast<short>(0xbf80)));
  }

  static constexpr bool kLookup =
      kFormat == FormatFamily::kTurboQuant || (kFormat == FormatFamily::kUniform && kBits <= 4);
  __m512 table_;
  __m512i pair_shift_[2];
  __m512i chunk_shift_;
};

// Room for n floats, per thread (rows x head_dim is up to 128 KiB: too much
// for the stack of an arbitrary caller's thread).
float* QueryScratch(size_t n) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < n + 16) scratch.resize(n + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
}

// Where each token of a block lives, and its scalars.
struct BlockTokens {
  const uint8_t* key_codes[kBlock];
  const uint8_t* value_codes[kBlock];
  alignas(64) float key_scale[kBlock];
  alignas(64) float value_scale[kBlock];
  alignas(64) float value_zero[kBlock];
};

// The fused kernel for one pair of formats: per block of 64 tokens the
// compressed groups' scores (Scores), the exact tokens' logits in place of
// theirs and the add-back (FinishScores), the online softmax (Softmax), then
// the compressed values (Values) and the exact ones (ExactReader::Values).
template <FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
class Kernel {
 public:
  using KeyDecoder = Decoder<kKey, kKeyBits>;
  using ValueDecoder = Decoder<kValue, kValueBits>;

  explicit Kernel(const HeadAttendParams& params)
      : p(params), d(params.head_dim), chunks(params.head_dim / kLanes), key(params.key), value(params.value),
        exact(params) {
    // The queries in the keys' lane order.
    queries = QueryScratch(static_cast<size_t>(p.rows) * d + 2 * static_cast<size_t>(p.rows) * kBlock);
    addback = queries + static_cast<size_t>(p.rows) * d;
    exact_scores = addback + static_cast<size_t>(p.rows) * kBlock;
    for (int r = 0; r < p.rows; ++r) {
      for (int j = 0; j < d; ++j) {
        queries[r * d + j / 16 * 16 + KeyDecoder::PairPosition(j % 16)] = p.queries[static_cast<size_t>(r) * d + j];
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
    AddBackRows<simd::Avx512> rows_addback(p, first);
    BlockWalk walk(p, first);
    // No row sees a token of the run: nothing to read (the padding below needs one).
    const int64_t end = max_visible > p.token_begin ? max_visible : first;
    // The compressed codes are read up to the exact window.
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
      if (compressed > 0) {
        walk.Next(
            t0, compressed, compressed_groups * kGroup, tokens.key_codes, tokens.value_codes,
            [&](const uint8_t* key_scalars, const uint8_t* value_scalars, int i, int n) {
              KeyDecoder::Scalars(key_scalars, n, tokens.key_scale + i, nullptr);
              ValueDecoder::Scalars(value_scalars, n, tokens.value_scale + i, tokens.value_zero + i);
            },
            [&](int i) { tokens.key_scale[i] = tokens.value_scale[i] = tokens.value_zero[i] = 0.0f; });
      }
      if (exact_lanes != 0) {
        // Exact lanes of compressed groups weigh nothing there.
        for (int g = 0; g < compressed_groups; ++g) {
          const __mmask16 lanes = static_cast<__mmask16>(exact_lanes >> (kGroup * g));
          _mm512_mask_storeu_ps(tokens.value_scale + kGroup * g, lanes, _mm512_setzero_ps());
          _mm512_mask_storeu_ps(tokens.value_zero + kGroup * g, lanes, _mm512_setzero_ps());
        }
        exact.Scores(t0, exact_lanes, exact_scores);
      }
      for (int g = 0; g < compressed_groups; ++g) Scores(t0, g);
      FinishScores(t0, groups, compressed_groups, exact_lanes, rows_addback.active());
      prefetch.Next();
      Softmax(t0, groups, compressed_groups);
      prefetch.Next();
      for (int g = 0; g < compressed_groups; ++g) Values(t0, g);
      if (exact_lanes != 0) exact.Values(t0, weights);
      prefetch.Next();
    }
    Finish();
  }

 private:
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // The lanes of a group that a row sees, given how many of its tokens it sees.
  static __mmask16 SeenLanes(int64_t seen) {
    return static_cast<__mmask16>(seen >= kGroup ? 0xffff : seen <= 0 ? 0 : (1u << seen) - 1);
  }

  // Group g's scaled compressed scores into weights, two rows at a time (rows
  // that see none of the group: -inf).
  void Scores(int64_t t0, int g) {
    const int64_t group_start = t0 + kGroup * g;
    const uint8_t* const* codes = tokens.key_codes + kGroup * g;
    for (int pair = 0; pair < 8; ++pair) {
      const uint8_t* a = codes[kPairFirst[pair]];
      const uint8_t* b = codes[kPairFirst[pair] + 4];
      for (int block = 0; block < chunks; ++block) {
        key.Pairs(a, b, block, reinterpret_cast<__m512*>(lines + ((2 * block) * 8 + pair) * kLanes),
                  reinterpret_cast<__m512*>(lines + ((2 * block + 1) * 8 + pair) * kLanes));
      }
    }
    const __m512 scale = _mm512_load_ps(tokens.key_scale + kGroup * g);
    for (int r = 0; r < p.rows; r += 2) {
      // Two rows share each key load (the second is the first again when
      // rows is odd).
      const int r1 = std::min(r + 1, p.rows - 1);
      float* w0 = weights + r * kBlock + kGroup * g;
      float* w1 = weights + r1 * kBlock + kGroup * g;
      if (p.visible[r] <= group_start && p.visible[r1] <= group_start) {
        _mm512_store_ps(w0, _mm512_set1_ps(kNegInf));
        _mm512_store_ps(w1, _mm512_set1_ps(kNegInf));
        continue;
      }
      const float* q0 = queries + r * d;
      const float* q1 = queries + r1 * d;
      __m512 acc0[8], acc1[8];
      for (int i = 0; i < 8; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
      for (int m = 0; m < 2 * chunks; ++m) {
        const __m512 qa = _mm512_broadcast_f32x8(_mm256_loadu_ps(q0 + 8 * m));
        const __m512 qb = _mm512_broadcast_f32x8(_mm256_loadu_ps(q1 + 8 * m));
        const float* k = lines + 8 * kLanes * m;
        for (int i = 0; i < 8; ++i) {
          const __m512 kv = _mm512_load_ps(k + kLanes * i);
          acc0[i] = _mm512_fmadd_ps(qa, kv, acc0[i]);
          acc1[i] = _mm512_fmadd_ps(qb, kv, acc1[i]);
        }
      }
      _mm512_store_ps(w1, _mm512_mul_ps(SumPairs(acc1), scale));
      _mm512_store_ps(w0, _mm512_mul_ps(SumPairs(acc0), scale));
    }
  }

  // Every row's logits of the block's groups: the compressed scores of the
  // first compressed_groups, the exact tokens' in their lanes, plus the
  // add-back, soft-capped with a cap; lanes a row does not see at -inf.
  void FinishScores(int64_t t0, int groups, int compressed_groups, uint64_t exact_lanes, bool with_addback) {
    // Soft-capping: one test per group, predicted (it is the call's).
    const bool capped = p.softcap > 0.0f;
    const __m512 cap = _mm512_set1_ps(p.softcap), inv_cap = _mm512_set1_ps(capped ? 1.0f / p.softcap : 0.0f);
    for (int r = 0; r < p.rows; ++r) {
      if (p.visible[r] <= t0) continue;
      const __m512 shift = _mm512_set1_ps(p.softcap_shift != nullptr ? p.softcap_shift[r] : 0.0f);
      for (int g = 0; g < groups; ++g) {
        const int64_t group_start = t0 + kGroup * g;
        float* w = weights + r * kBlock + kGroup * g;
        __m512 s = g < compressed_groups ? _mm512_load_ps(w) : _mm512_set1_ps(kNegInf);
        const __mmask16 exact_group = static_cast<__mmask16>(exact_lanes >> (kGroup * g));
        if (exact_group != 0) s = _mm512_mask_loadu_ps(s, exact_group, exact_scores + r * kBlock + kGroup * g);
        if (with_addback) s = _mm512_add_ps(s, _mm512_load_ps(addback + r * kBlock + kGroup * g));
        if (capped) s = avx512::SoftCap(s, cap, inv_cap, shift);
        const __mmask16 live =
            SeenLanes(p.visible[r] - group_start) & static_cast<__mmask16>(~SeenLanes(p.token_begin - group_start));
        _mm512_store_ps(w, _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), live, s));
      }
    }
  }

  // Online softmax: rescale what came before, turn logits into weights
  // (uniform values: and sum their zero points over the compressed groups).
  void Softmax(int64_t t0, int groups, int compressed_groups) {
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    for (int r = 0; r < p.rows; ++r) {
      if (p.visible[r] <= t0) continue;
      float* w = weights + r * kBlock;
      __m512 m = neg_inf;
      for (int g = 0; g < groups; ++g) m = _mm512_max_ps(m, _mm512_load_ps(w + kGroup * g));
      const float new_max = std::max(row_max[r], Max(m));
      // exp(0) without the call: most blocks do not raise the maximum.
      const float correction = row_max[r] == kNegInf   ? 0.0f
                               : row_max[r] == new_max ? 1.0f
                                                       : std::exp(row_max[r] - new_max);
      row_max[r] = new_max;
      __m512 sum = _mm512_setzero_ps(), zero_sum = _mm512_setzero_ps();
      for (int g = 0; g < groups; ++g) {
        const __m512 s = _mm512_load_ps(w + kGroup * g);
        const __mmask16 live = _mm512_cmp_ps_mask(s, neg_inf, _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(live, Exp(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
        _mm512_store_ps(w + kGroup * g, e);
        sum = _mm512_add_ps(sum, e);
        if constexpr (kValue == FormatFamily::kUniform) {
          if (g < compressed_groups) {
            zero_sum = _mm512_fmadd_ps(e, _mm512_load_ps(tokens.value_zero + kGroup * g), zero_sum);
          }
        }
      }
      row_sum[r] = row_sum[r] * correction + Sum(sum);
      row_zero[r] = row_zero[r] * correction + Sum(zero_sum);
      exact.Rescale(r, correction);
      if (correction != 1.0f) {
        float* out = p.out + static_cast<size_t>(r) * d;
        const __m512 factor = _mm512_set1_ps(correction);
        for (int c = 0; c < chunks; ++c) {
          _mm512_storeu_ps(out + kLanes * c, _mm512_mul_ps(_mm512_loadu_ps(out + kLanes * c), factor));
        }
      }
    }
  }

  // Group g's compressed values into out (exact lanes' value scales are zero).
  void Values(int64_t t0, int g) {
    const int64_t group_start = t0 + kGroup * g;
    const __m512 scale = _mm512_load_ps(tokens.value_scale + kGroup * g);
    for (int r = 0; r < p.rows; ++r) {
      const __m512 w = _mm512_load_ps(weights + r * kBlock + kGroup * g);
      _mm512_store_ps(group_weights + r * kGroup, _mm512_mul_ps(w, scale));
    }
    const uint8_t* const* codes = tokens.value_codes + kGroup * g;
    for (int i = 0; i < kGroup; ++i) {
      for (int c = 0; c < chunks; ++c)
        _mm512_store_ps(lines + (kGroup * c + i) * kLanes, value.Chunk(codes[i], c, chunks));
    }
    for (int c = 0; c < chunks; ++c) {
      __m512 v[kGroup];
      for (int i = 0; i < kGroup; ++i) v[i] = _mm512_load_ps(lines + (kGroup * c + i) * kLanes);
      for (int r = 0; r < p.rows; ++r) {
        if (p.visible[r] <= group_start) continue;
        float* out = p.out + static_cast<size_t>(r) * d + kLanes * c;
        const float* gw = group_weights + r * kGroup;
        // Two chains of 8 FMAs rather than one of 16: the latency of the
        // chains, not the FMA ports, would bound this loop.
        __m512 acc = _mm512_loadu_ps(out), acc2 = _mm512_mul_ps(_mm512_set1_ps(gw[8]), v[8]);
        for (int i = 0; i < 8; ++i) {
          acc = _mm512_fmadd_ps(_mm512_set1_ps(gw[i]), v[i], acc);
          if (i > 0) acc2 = _mm512_fmadd_ps(_mm512_set1_ps(gw[8 + i]), v[8 + i], acc2);
        }
        _mm512_storeu_ps(out, _mm512_add_ps(acc, acc2));
      }
    }
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
      for (int j = 0; j < d; ++j) line[j] = out[ValueDecoder::ChunkPosition(j, d)] * inv + shift;
      memcpy(out, line, sizeof(float) * d);
      exact.Finish(r, inv);
      p.lse[r] = row_max[r] + std::log(row_sum[r]);
    }
  }

  const HeadAttendParams& p;
  const int d;
  const int chunks;
  const KeyDecoder key;
  const ValueDecoder value;
  ExactReader<simd::Avx512> exact;
  float* queries;       // [rows][d], in the keys' lane order
  float* addback;       // [rows][kBlock]: the block's add-back
  float* exact_scores;  // [rows][kBlock]: the block's exact logits
  // The group's expanded keys, [d / 8][pair][16], then its values, [d / 16][token][16].
  alignas(64) float lines[kGroup * kMaxHeadDim];
  alignas(64) float weights[kMaxRows * kBlock];        // per block: scores, then weights
  alignas(64) float group_weights[kMaxRows * kGroup];  // weight * value scale
  BlockTokens tokens;
  float row_max[kMaxRows], row_sum[kMaxRows], row_zero[kMaxRows];
};

template <FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
void AttendHead(const HeadAttendParams& p) {
  Kernel<kKey, kKeyBits, kValue, kValueBits>(p).Run();
}

struct Avx512Kernels {
  // Every pair of the table; two-part keys take the AVX2 kernel (the
  // backend falls back).
  static constexpr bool Reads(FormatFamily, int key_bits, FormatFamily, int) { return !IsSplitKeyBits(key_bits); }
  template <FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
  static void Run(const HeadAttendParams& params) {
    AttendHead<kKey, kKeyBits, kValue, kValueBits>(params);
  }
};

}  // namespace

bool AttendHeadAvx512Supported(const FieldReader& key, const FieldReader& value, int head_dim) {
  return head_dim % kLanes == 0 && PickAttendKernel<Avx512Kernels>(key, value) != nullptr;
}

void AttendHeadAvx512(const HeadAttendParams& params) {
  PickAttendKernel<Avx512Kernels>(params.key, params.value)(params);
}

}  // namespace cpu_internal
}  // namespace tqkv
