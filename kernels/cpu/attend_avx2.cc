// AVX2 fused attention for one (item, KV head), with 8-lane vectors and 16
// registers. Tokens go in blocks of 64 (one online-softmax step), rows (the
// query vectors sharing the head) in tiles of 4, 2 or 1, and every tile keeps
// 8 accumulators in registers while it reads codes straight from the page:
// scores take 2 tokens x 4 rows (4 x 2, 8 x 1) and reduce the 8 dot products
// with one transpose-add; values take 4 rows x 16 coordinates (2 x 32, 1 x 64)
// across the block's tokens, the weight of each token broadcast once per
// tile. Each code is decoded once per tile, not once per row, and nothing
// goes through a scratch copy. Codes become floats with vpermps on an 8-entry
// table (two tables and a blend for 4-bit centroids); fp8 through its fp16
// bits. Split keys score their hot and cold parts as two dot products, each
// times its own scale. Split keys have no AVX-512 twin: on an AVX-512
// machine the dispatch falls back to this kernel for them.
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
#include "kernels/simd/simd_mappings.h"

namespace tqkv {
namespace cpu_internal {
namespace {

constexpr int kLanes = 8;
constexpr int kGroup = 8;   // tokens scored and accumulated together
constexpr int kBlock = 64;  // tokens per online-softmax step

// exp(x) for x <= 0 (softmax arguments), relative error < 2e-7: Cody-Waite
// range reduction to |r| <= ln2/2, a degree-6 Taylor polynomial, and 2^n
// (n >= -126 after the clamp) written straight into the exponent field.
inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// The soft cap of logits whose constant part `shift` is added later:
// cap * tanh((x + shift) / cap) - shift. tanh(|y|) = (1 - e) / (1 + e) with
// e = exp(-2 |y|) (Exp's domain), its sign restored: absolute error about
// 3e-7 cap. -inf gives -cap - shift (callers mask after).
inline __m256 SoftCap(__m256 x, __m256 cap, __m256 inv_cap, __m256 shift) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 y = _mm256_mul_ps(_mm256_add_ps(x, shift), inv_cap);
  const __m256 e = Exp(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign_bit, y)));
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_fmsub_ps(cap, _mm256_or_ps(t, _mm256_and_ps(y, sign_bit)), shift);
}

// Lane t of the result is the sum of v[t]'s lanes (a transpose-add: 14
// shuffles and 7 adds instead of 8 full reductions).
inline __m256 SumEach(const __m256 v[8]) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {
    b[i] =
        _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xee));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

inline float Sum(__m256 v) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

inline float Max(__m256 v) {
  const __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(y, _mm_movehdup_ps(y)));
}

// 8 tokens' pairs of fp16 scalars [a, b] -> 8 floats a and 8 floats b.
inline void ScalarPairs(const uint8_t* scalars, float* a, float* b) {
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scalars)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scalars + 16)));
  // shuffle_ps leaves tokens in the order 0 1 4 5 2 3 6 7.
  _mm256_storeu_ps(a, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xd8)));
  _mm256_storeu_ps(b, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd)), 0xd8)));
}

inline int Load32(const uint8_t* p) {
  int v;
  memcpy(&v, p, sizeof(v));
  return v;
}

// Reads one field of a token, 16 coordinates at a time as two vectors, before
// the token's scale and zero (which the kernel folds into scores and weights).
template <FormatFamily kFormat, int kBits>
class Decoder {
 public:
  explicit Decoder(const FieldReader& field) {
    if constexpr (kPacked) {
      // vpermps reads index bits [2:0]: with the 2^b entries repeated over 8,
      // the bits of the next code above a code do not matter, so codes need
      // no mask. 4-bit centroids take a second table for codes 8-15.
      alignas(32) float table[16];
      for (int i = 0; i < 16; ++i) {
        const int code = i % (1 << kBits);
        table[i] = kFormat == FormatFamily::kTurboQuant ? field.centroids[code] : static_cast<float>(code);
      }
      low_ = _mm256_load_ps(table);
      high_ = _mm256_load_ps(table + 8);
      // Code 8h + j of a 16-code block sits at bit shift_[h][j] of the dword
      // vector h reads.
      alignas(32) int shift[2][8];
      for (int j = 0; j < 8; ++j) {
        shift[0][j] = kBits * j;
        shift[1][j] = kBits * j + (kBits == 2 ? 16 : kBits == 3 ? 8 : 0);
      }
      shift_[0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift[0]));
      shift_[1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift[1]));
    }
  }

  // Where coordinate j of a 16-coordinate block lands in the output of
  // Block(): positions 0-7 in the first vector, 8-15 in the second.
  static int Position(int j) { return kFormat == FormatFamily::kBf16 ? (j % 2) * 8 + j / 2 : j; }

  // Coordinates 16 * block ... + 15, in Position() order.
  void Block(const uint8_t* codes, int block, __m256* first, __m256* second) const {
    if constexpr (kFormat == FormatFamily::kBf16) {
      // A bf16 is the top half of a float: even coordinates shift up, odd
      // ones need only their low half cleared.
      const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * block));
      *first = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
      *second = _mm256_castsi256_ps(_mm256_and_si256(both, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    } else if constexpr (kFormat == FormatFamily::kFp16) {
      *first = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * block)));
      *second = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * block + 16)));
    } else if constexpr (kFormat == FormatFamily::kFp8) {
      // E4M3 -> binary16 bits: sign to bit 15, exponent and mantissa to bits
      // 13-7 (x << 8, an arithmetic shift right by one, a mask). That half is
      // the fp8 value times 2^-8, subnormals included; kUnitScale undoes it.
      const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * block)));
      const __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1),
                                            _mm256_set1_epi16(static_cast<short>(0xbf80)));
      *first = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
      *second = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
    } else if constexpr (!kPacked) {  // 8-bit uniform
      *first = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 16 * block))));
      *second = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 16 * block + 8))));
    } else {
      // 8 codes take kBits bytes; the second dword is placed so that neither
      // read leaves the block's 2 * kBits bytes.
      const int at = 2 * kBits * block, second_at = at + (kBits == 2 ? 0 : kBits == 3 ? 2 : 4);
      *first = Lookup(_mm256_srlv_epi32(_mm256_set1_epi32(Load32(codes + at)), shift_[0]));
      *second = Lookup(_mm256_srlv_epi32(_mm256_set1_epi32(Load32(codes + second_at)), shift_[1]));
    }
  }

  // The scales of n <= 64 tokens whose scalars follow each other, and for
  // uniform codes their zeros (x = scale * decoded + zero).
  static void Scalars(const uint8_t* scalars, int n, float* scale, float* zero) {
    int k = 0;
    for (; k + 8 <= n; k += 8) {
      if constexpr (kFormat == FormatFamily::kTurboQuant) {
        _mm256_storeu_ps(scale + k,
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scalars + 2 * k))));
      } else if constexpr (kFormat == FormatFamily::kUniform) {  // [scale, zero] per token
        ScalarPairs(scalars + 4 * k, scale + k, zero + k);
      } else {
        _mm256_storeu_ps(scale + k, _mm256_set1_ps(kUnitScale));
      }
    }
    for (; k < n; ++k) {
      uint16_t s[2] = {0, 0};
      memcpy(s, scalars + 2 * kScalars * k, 2 * kScalars);
      scale[k] = kScalars > 0 ? _cvtsh_ss(s[0]) : kUnitScale;
      if constexpr (kScalars > 1) zero[k] = _cvtsh_ss(s[1]);
    }
  }

 private:
  static constexpr bool kPacked =
      kFormat == FormatFamily::kTurboQuant || (kFormat == FormatFamily::kUniform && kBits <= 4);
  static constexpr int kScalars = kFormat == FormatFamily::kUniform ? 2 : kFormat == FormatFamily::kTurboQuant ? 1 : 0;
  // The scale of a field without scalars: Block() reads fp8 as 2^-8 times its value.
  static constexpr float kUnitScale = kFormat == FormatFamily::kFp8 ? 256.0f : 1.0f;

  __m256 Lookup(__m256i index) const {
    if constexpr (kBits == 4 && kFormat == FormatFamily::kTurboQuant) {
      // Bit 3 of the code, moved to the sign bit, picks the table.
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_, index), _mm256_permutevar8x32_ps(high_, index),
                              _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
    } else if constexpr (kBits == 4) {
      return _mm256_cvtepi32_ps(_mm256_and_si256(index, _mm256_set1_epi32(15)));
    } else {
      return _mm256_permutevar8x32_ps(low_, index);
    }
  }

  __m256 low_, high_;
  __m256i shift_[2];
};

// Split TurboQuant keys: the hot part's codes, then the cold part's, each
// read by its own centroid Decoder. The query's first hot_dims coordinates
// are the hot part's (PrepareQuery's order); blocks [0, hot_blocks()) of a
// token are hot. Scales(): the hot scale and the cold one.
template <int kHotBits, int kColdBits>
class SplitDecoder {
 public:
  explicit SplitDecoder(const FieldReader& field)
      : hot_(field), cold_(ColdPart(field)), hot_blocks_(field.hot_dims / 16), cold_offset_(field.cold_code_offset) {}

  static int Position(int j) { return j; }
  int hot_blocks() const { return hot_blocks_; }

  void Block(const uint8_t* codes, int block, __m256* first, __m256* second) const {
    if (block < hot_blocks_) {
      hot_.Block(codes, block, first, second);
    } else {
      cold_.Block(codes + cold_offset_, block - hot_blocks_, first, second);
    }
  }

  static void Scalars(const uint8_t* scalars, int n, float* hot_scale, float* cold_scale) {
    int k = 0;
    for (; k + 8 <= n; k += 8) ScalarPairs(scalars + 4 * k, hot_scale + k, cold_scale + k);
    for (; k < n; ++k) {
      uint16_t s[2];
      memcpy(s, scalars + 4 * k, 4);
      hot_scale[k] = _cvtsh_ss(s[0]);
      cold_scale[k] = _cvtsh_ss(s[1]);
    }
  }

 private:
  static FieldReader ColdPart(FieldReader field) {
    field.bits = kColdBits;
    field.centroids = field.cold_centroids;
    return field;
  }

  Decoder<FormatFamily::kTurboQuant, kHotBits> hot_;
  Decoder<FormatFamily::kTurboQuant, kColdBits> cold_;
  int hot_blocks_;
  int cold_offset_;
};

template <FormatFamily kKey, int kKeyBits, bool kSplit = IsSplitKeyBits(kKeyBits)>
struct KeyDecoderFor {
  using type = Decoder<kKey, kKeyBits>;
};
template <int kKeyBits>
struct KeyDecoderFor<FormatFamily::kTurboQuant, kKeyBits, true> {  // kKeyBits = SplitKeyBits(hot, cold)
  using type = SplitDecoder<kKeyBits / 10, kKeyBits % 10>;
};

// Room for n floats, per thread, 32-byte aligned (rows x head_dim is up to
// 128 KiB: too much for the stack of an arbitrary caller's thread).
float* QueryScratch(size_t n) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < n + 8) scratch.resize(n + 8);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t{31});
}

// Where each token of a block lives, and its scalars.
struct BlockTokens {
  const uint8_t* key_codes[kBlock];
  const uint8_t* value_codes[kBlock];
  alignas(32) float key_scale[kBlock];
  alignas(32) float key_cold_scale[kBlock];  // split keys
  alignas(32) float value_scale[kBlock];
  alignas(32) float value_zero[kBlock];
};

// The raw dot products (before the token's scale) of kTokens tokens with
// kRows rows over the 16-coordinate blocks [b0, b1) of each token: 8
// accumulators in registers, each code decoded once for all rows, no scratch.
// raw[r * kBlock + t] gets row r's product with token t.
template <int kRows, typename KeyDecoder>
inline void ScoreTile(const KeyDecoder& key, const uint8_t* const* codes, const float* q, int d, int b0, int b1,
                      float* raw) {
  constexpr int kTokens = 8 / kRows;
  __m256 acc[8];
  for (__m256& a : acc) a = _mm256_setzero_ps();
  for (int b = b0; b < b1; ++b) {
    if constexpr (kTokens <= 2) {
      // Both tokens decoded first, then each query half loaded once.
      __m256 k0[kTokens], k1[kTokens];
      for (int t = 0; t < kTokens; ++t) key.Block(codes[t], b, &k0[t], &k1[t]);
      for (int r = 0; r < kRows; ++r) {
        const __m256 qa = _mm256_loadu_ps(q + r * d + 16 * b), qb = _mm256_loadu_ps(q + r * d + 16 * b + 8);
        for (int t = 0; t < kTokens; ++t) {
          acc[r * kTokens + t] = _mm256_fmadd_ps(qb, k1[t], _mm256_fmadd_ps(qa, k0[t], acc[r * kTokens + t]));
        }
      }
    } else {
      // One token at a time: the query halves stay in registers.
      __m256 qa[kRows], qb[kRows];
      for (int r = 0; r < kRows; ++r) {
        qa[r] = _mm256_loadu_ps(q + r * d + 16 * b);
        qb[r] = _mm256_loadu_ps(q + r * d + 16 * b + 8);
      }
      for (int t = 0; t < kTokens; ++t) {
        __m256 k0, k1;
        key.Block(codes[t], b, &k0, &k1);
        for (int r = 0; r < kRows; ++r) {
          acc[r * kTokens + t] = _mm256_fmadd_ps(qb[r], k1, _mm256_fmadd_ps(qa[r], k0, acc[r * kTokens + t]));
        }
      }
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, SumEach(acc));
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTokens; ++t) raw[r * kBlock + t] = sums[r * kTokens + t];
  }
}

// Adds sum_i w[r][i] v_i over the block's `count` tokens to kRows rows of
// out, for the 16-coordinate blocks [b, b + kBlocks): up to 8 accumulators in
// registers for the whole block, each code decoded once for all rows.
template <int kRows, int kBlocks, typename ValueDecoder>
inline void ValueTile(const ValueDecoder& value, const uint8_t* const* codes, int count, const float* w, int b,
                      float* out, int d) {
  static_assert(kRows * kBlocks <= 4, "8 accumulators");
  __m256 acc[kRows][2 * kBlocks];
  for (auto& row : acc) {
    for (__m256& a : row) a = _mm256_setzero_ps();
  }
  for (int i = 0; i < count; ++i) {
    __m256 wi[kRows];
    for (int r = 0; r < kRows; ++r) wi[r] = _mm256_broadcast_ss(w + r * kBlock + i);
    for (int c = 0; c < kBlocks; ++c) {
      __m256 v0, v1;
      value.Block(codes[i], b + c, &v0, &v1);
      for (int r = 0; r < kRows; ++r) {
        acc[r][2 * c] = _mm256_fmadd_ps(wi[r], v0, acc[r][2 * c]);
        acc[r][2 * c + 1] = _mm256_fmadd_ps(wi[r], v1, acc[r][2 * c + 1]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < 2 * kBlocks; ++j) {
      float* o = out + r * d + 16 * b + kLanes * j;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[r][j]));
    }
  }
}

// The fused kernel for one pair of formats: per block of 64 tokens the
// compressed tokens' raw scores (Scores), the online softmax with the exact
// tokens' logits in their lanes and the add-back (Softmax), then the
// compressed values (Values) and the exact ones (ExactReader::Values).
template <FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
class Kernel {
 public:
  static constexpr bool kSplit = IsSplitKeyBits(kKeyBits);
  using KeyDecoder = typename KeyDecoderFor<kKey, kKeyBits>::type;
  using ValueDecoder = Decoder<kValue, kValueBits>;

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
    AddBackRows<simd::Avx2> rows_addback(p, first);
    BlockWalk walk(p, first);
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
              KeyDecoder::Scalars(key_scalars, n, tokens.key_scale + i, tokens.key_cold_scale + i);
              ValueDecoder::Scalars(value_scalars, n, tokens.value_scale + i, tokens.value_zero + i);
            },
            [&](int i) {
              tokens.key_scale[i] = tokens.key_cold_scale[i] = tokens.value_scale[i] = tokens.value_zero[i] = 0.0f;
            });
      }
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

  // The raw scores of the compressed groups, row tile by row tile.
  void Scores(int64_t t0, int compressed_groups) {
    const int hot_blocks = kSplit ? p.key.hot_dims / 16 : blocks;
    ForRowTiles(p.rows, [&](auto tile_rows, int r0) {
      constexpr int kRows = decltype(tile_rows)::value;
      if (*std::max_element(p.visible + r0, p.visible + r0 + kRows) <= t0) return;
      const float* q = queries + r0 * d;
      for (int i = 0; i < compressed_groups * kGroup; i += 8 / kRows) {
        ScoreTile<kRows>(key, tokens.key_codes + i, q, d, 0, hot_blocks, weights + r0 * kBlock + i);
        if constexpr (kSplit) {
          ScoreTile<kRows>(key, tokens.key_codes + i, q, d, hot_blocks, blocks, cold_raw + r0 * kBlock + i);
        }
      }
    });
  }

  // The exact lanes of group g (bits of exact_lanes) as a vector mask.
  static __m256 LaneMask(uint64_t exact_lanes, int g) {
    const __m256i bits = _mm256_set1_epi32(static_cast<int>((exact_lanes >> (kGroup * g)) & 0xff));
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(bits, lane), lane));
  }

  // Row r's logits of the block (its compressed scores times the tokens'
  // scales, the exact logits in their lanes, the add-back), then its online
  // softmax step: weights times the value scales in place of the logits, and
  // the exact lanes' weights to exact_weights.
  void Softmax(int r, int64_t t0, int groups, int compressed_groups, uint64_t exact_lanes, bool with_addback) {
    const __m256 neg_inf = _mm256_set1_ps(kNegInf);
    const __m256i lane_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    float* w = weights + r * kBlock;
    // Soft-capping: one test per group, predicted (it is the call's).
    const bool capped = p.softcap > 0.0f;
    const __m256 cap = _mm256_set1_ps(p.softcap), inv_cap = _mm256_set1_ps(capped ? 1.0f / p.softcap : 0.0f);
    const __m256 shift = _mm256_set1_ps(p.softcap_shift != nullptr ? p.softcap_shift[r] : 0.0f);
    __m256 m = neg_inf;
    for (int g = 0; g < groups; ++g) {
      const int64_t group_start = t0 + kGroup * g;
      const int64_t seen = p.visible[r] - group_start;
      if (seen <= 0) {
        _mm256_store_ps(w + kGroup * g, neg_inf);
        continue;
      }
      const int before = static_cast<int>(std::clamp<int64_t>(p.token_begin - group_start, 0, kGroup));
      const __m256 live = _mm256_castsi256_ps(_mm256_and_si256(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(seen, kGroup))), lane_index),
          _mm256_cmpgt_epi32(lane_index, _mm256_set1_epi32(before - 1))));
      __m256 score = neg_inf;
      if (g < compressed_groups) {
        score = _mm256_mul_ps(_mm256_load_ps(w + kGroup * g), _mm256_load_ps(tokens.key_scale + kGroup * g));
        if constexpr (kSplit) {
          score = _mm256_fmadd_ps(_mm256_load_ps(cold_raw + r * kBlock + kGroup * g),
                                  _mm256_load_ps(tokens.key_cold_scale + kGroup * g), score);
        }
      }
      if (((exact_lanes >> (kGroup * g)) & 0xff) != 0) {
        score =
            _mm256_blendv_ps(score, _mm256_load_ps(exact_scores + r * kBlock + kGroup * g), LaneMask(exact_lanes, g));
      }
      if (with_addback) score = _mm256_add_ps(score, _mm256_load_ps(addback + r * kBlock + kGroup * g));
      if (capped) score = SoftCap(score, cap, inv_cap, shift);
      score = _mm256_blendv_ps(neg_inf, score, live);
      _mm256_store_ps(w + kGroup * g, score);
      m = _mm256_max_ps(m, score);
    }
    const float new_max = std::max(row_max[r], Max(m));
    const float correction = row_max[r] == kNegInf   ? 0.0f
                             : row_max[r] == new_max ? 1.0f
                                                     : std::exp(row_max[r] - new_max);
    row_max[r] = new_max;
    __m256 sum = _mm256_setzero_ps(), zero_sum = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
      const __m256 s = _mm256_load_ps(w + kGroup * g);
      const __m256 live = _mm256_cmp_ps(s, neg_inf, _CMP_NEQ_OQ);
      const __m256 e = _mm256_and_ps(live, Exp(_mm256_sub_ps(s, _mm256_set1_ps(new_max))));
      if (exact_lanes != 0) _mm256_store_ps(exact_weights + r * kBlock + kGroup * g, e);
      // Lanes past the compressed groups hold no compressed token.
      const __m256 value_scale =
          g < compressed_groups ? _mm256_load_ps(tokens.value_scale + kGroup * g) : _mm256_setzero_ps();
      _mm256_store_ps(w + kGroup * g, _mm256_mul_ps(e, value_scale));
      sum = _mm256_add_ps(sum, e);
      if constexpr (kValue == FormatFamily::kUniform) {
        if (g < compressed_groups) {
          zero_sum = _mm256_fmadd_ps(e, _mm256_load_ps(tokens.value_zero + kGroup * g), zero_sum);
        }
      }
    }
    row_sum[r] = row_sum[r] * correction + Sum(sum);
    row_zero[r] = row_zero[r] * correction + Sum(zero_sum);
    exact.Rescale(r, correction);
    if (correction != 1.0f) {
      float* out = p.out + static_cast<size_t>(r) * d;
      const __m256 factor = _mm256_set1_ps(correction);
      for (int c = 0; c < d; c += kLanes) _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_loadu_ps(out + c), factor));
    }
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
      float* out = p.out + static_cast<size_t>(r0) * d;
      const float* w = weights + r0 * kBlock;
      constexpr int kBlocks = 4 / kRows;
      int b = 0;
      for (; b + kBlocks <= blocks; b += kBlocks)
        ValueTile<kRows, kBlocks>(value, tokens.value_codes, compressed, w, b, out, d);
      if constexpr (kBlocks == 4) {
        if (blocks - b >= 2) {
          ValueTile<kRows, 2>(value, tokens.value_codes, compressed, w, b, out, d);
          b += 2;
        }
      }
      if constexpr (kBlocks >= 2) {
        if (b < blocks) ValueTile<kRows, 1>(value, tokens.value_codes, compressed, w, b, out, d);
      }
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
  ExactReader<simd::Avx2> exact;
  float* queries;        // [rows][d], in the keys' lane order
  float* addback;        // [rows][kBlock]: the block's add-back
  float* exact_scores;   // [rows][kBlock]: the block's exact logits
  float* exact_weights;  // [rows][kBlock]: and their weights
  alignas(32) float weights[kMaxRows * kBlock];
  alignas(32) float cold_raw[kSplit ? kMaxRows * kBlock : 1];
  BlockTokens tokens;
  float row_max[kMaxRows], row_sum[kMaxRows], row_zero[kMaxRows];
};

template <FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
void AttendHead(const HeadAttendParams& p) {
  Kernel<kKey, kKeyBits, kValue, kValueBits>(p).Run();
}

struct Avx2Kernels {
  // Every pair and width of the table.
  static constexpr bool Reads(FormatFamily, int, FormatFamily, int) { return true; }
  template <FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
  static void Run(const HeadAttendParams& params) {
    AttendHead<kKey, kKeyBits, kValue, kValueBits>(params);
  }
};

}  // namespace

bool AttendHeadAvx2Supported(const FieldReader& key, const FieldReader& value, int head_dim) {
  if (key.split() && key.hot_dims % 16 != 0) return false;
  return head_dim % 16 == 0 && PickAttendKernel<Avx2Kernels>(key, value) != nullptr;
}

void AttendHeadAvx2(const HeadAttendParams& params) { PickAttendKernel<Avx2Kernels>(params.key, params.value)(params); }

}  // namespace cpu_internal
}  // namespace tqkv
