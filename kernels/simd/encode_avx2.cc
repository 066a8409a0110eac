// AVX2 kernels of the store path; see kernels/simd/encode_kernels.h. The
// AVX-512 file's kernels at 8 lanes: whole vectors here, the tail of a
// vector that is not a multiple of 8 in the portable code's own expressions.
// Compiled with -mavx2 -mf16c -mbmi2 -mfma -ffp-contract=off: the float
// operations must be exactly those of the portable code (no FMA contraction;
// the Hadamard stages' FMAs against +-1 are exact additions).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/blocked_sums.h"
#include "kernels/simd/encode_kernels.h"
#include "kernels/simd/hadamard_body.h"
#include "kernels/float_formats.h"

namespace tqkv {
namespace encode_internal {
namespace {

// The low byte of each of the 8 dwords of v, in order, to out[0..7].
inline void StoreLowBytes8(uint8_t* out, __m256i v) {
  const __m256i gather = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i bytes =
      _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, gather), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(bytes));
}

// The low 16 bits of each of the 8 dwords of v (each <= 0xffff), to out[0..15].
inline void StoreLowHalves8(uint8_t* out, __m256i v) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

// A binary search step's boundary: table[index] for up to 16 entries.
inline __m256 Lookup16(__m256 low, __m256 high, __m256i index) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_slli_epi32(index, 28));  // bit 3 to the sign
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, index), _mm256_permutevar8x32_ps(high, index), mask);
}

// QuantizeToLevel (codebook.h) for one coordinate: #{boundaries < y}.
inline int LevelOf(const float* boundaries, int num_boundaries, float y) {
  int lo = 0;
  for (int step = (num_boundaries + 1) >> 1; step > 0; step >>= 1) {
    if (y > boundaries[lo + step - 1]) lo += step;
  }
  return lo;
}

}  // namespace

bool SumOfSquaresAvx2(const float* x, int n, double* sum) {
  // The blocked order's 16 partials in four registers; multiply, then add:
  // the product of two floats is exact in double.
  __m256d p[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  int i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int q = 0; q < 4; ++q) {
      const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4 * q));
      p[q] = _mm256_add_pd(p[q], _mm256_mul_pd(a, a));
    }
  }
  alignas(32) double partial[kSumLanes];
  for (int q = 0; q < 4; ++q) _mm256_store_pd(partial + 4 * q, p[q]);
  for (; i < n; ++i) partial[i % kSumLanes] += static_cast<double>(x[i]) * x[i];
  *sum = FoldSumLanes(partial);
  return std::isfinite(*sum);
}

float CodewordSumAvx2(const float* centroids, int bits, const uint8_t* levels, int n) {
  const int size = 1 << bits;
  float squares[16] = {};
  for (int k = 0; k < size && k < 16; ++k) squares[k] = centroids[k] * centroids[k];
  const __m256 low = _mm256_loadu_ps(squares), high = _mm256_loadu_ps(squares + 8);
  __m256 p[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int q = 0; q < 2; ++q) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(levels + i + 8 * q)));
      __m256 square;
      if (bits <= 3) {
        square = _mm256_permutevar8x32_ps(low, idx);
      } else if (bits == 4) {
        square = Lookup16(low, high, idx);
      } else {
        const __m256 c = _mm256_i32gather_ps(centroids, idx, 4);
        square = _mm256_mul_ps(c, c);
      }
      p[q] = _mm256_add_ps(p[q], square);
    }
  }
  alignas(32) float partial[kSumLanes];
  _mm256_store_ps(partial, p[0]);
  _mm256_store_ps(partial + 8, p[1]);
  for (; i < n; ++i) partial[i % kSumLanes] += centroids[levels[i]] * centroids[levels[i]];
  return FoldSumLanes(partial);
}

bool AllFiniteWithinAvx2(const float* x, int n, float limit) {
  const __m256 vlimit = _mm256_set1_ps(limit);
  const __m256 inf = _mm256_set1_ps(__builtin_inff());
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    // Ordered compares: NaN fails both.
    const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(v, inf, _CMP_LT_OQ), _mm256_cmp_ps(v, vlimit, _CMP_LE_OQ));
    if (_mm256_movemask_ps(ok) != 0xff) return false;
  }
  for (; i < n; ++i) {
    if (!(std::fabs(x[i]) < __builtin_inff() && std::fabs(x[i]) <= limit)) return false;
  }
  return true;
}

void ScaleAvx2(const float* x, int n, float s, float* y) {
  const __m256 vs = _mm256_set1_ps(s);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
  for (; i < n; ++i) y[i] = x[i] * s;
}

void QuantizeToLevelsAvx2(const float* boundaries, int bits, const float* y, int n, uint8_t* levels) {
  const int num_boundaries = (1 << bits) - 1;
  float table[16];
  for (int k = 0; k < 16; ++k) table[k] = k < num_boundaries ? boundaries[k] : 0.0f;
  const __m256 low = _mm256_loadu_ps(table), high = _mm256_loadu_ps(table + 8);
  // boundaries[idx]: from registers up to 4 bits, else a gather.
  const auto boundary = [&](__m256i idx) {
    if (bits <= 3) return _mm256_permutevar8x32_ps(low, idx);
    if (bits == 4) return Lookup16(low, high, idx);
    return _mm256_i32gather_ps(boundaries, idx, 4);
  };
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(y + i);
    __m256i lo = _mm256_setzero_si256();
    for (int step = (num_boundaries + 1) >> 1; step > 0; step >>= 1) {
      const __m256i idx = _mm256_add_epi32(lo, _mm256_set1_epi32(step - 1));
      const __m256i gt = _mm256_castps_si256(_mm256_cmp_ps(v, boundary(idx), _CMP_GT_OQ));
      lo = _mm256_add_epi32(lo, _mm256_and_si256(gt, _mm256_set1_epi32(step)));
    }
    StoreLowBytes8(levels + i, lo);
  }
  for (; i < n; ++i) levels[i] = static_cast<uint8_t>(LevelOf(boundaries, num_boundaries, y[i]));
}

void PackBitsBmi2(const uint8_t* codes, int n, int bits, uint8_t* out) {
  if (bits == 8) {
    memcpy(out, codes, n);
    return;
  }
  // Eight codes of b bits are b bytes: pext gathers the low b bits of each
  // byte of a 64-bit word into one LSB-first stream (masking higher bits).
  const uint64_t mask = 0x0101010101010101ull * ((1u << bits) - 1u);
  const int total = (n * bits + 7) / 8;
  int j = 0;
  int written = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t word;
    memcpy(&word, codes + j, 8);
    const uint64_t packed = _pext_u64(word, mask);
    if (written + 8 <= total) {
      memcpy(out + written, &packed, 8);  // the excess is overwritten next
    } else {
      for (int k = 0; k < bits; ++k) out[written + k] = static_cast<uint8_t>(packed >> (8 * k));
    }
    written += bits;
  }
  if (j < n) {
    uint64_t word = 0;
    memcpy(&word, codes + j, n - j);
    const uint64_t packed = _pext_u64(word, mask);
    for (int k = 0; written < total; ++k) out[written++] = static_cast<uint8_t>(packed >> (8 * k));
  }
}

void FloatToHalfAvx2(const float* x, int n, uint8_t* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), h);
  }
  for (; i < n; ++i) {
    const uint16_t h = FloatToHalf(x[i]);
    memcpy(out + 2 * i, &h, 2);
  }
}

void FloatToBf16Avx2(const float* x, int n, uint8_t* out) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i round = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, round), _mm256_and_si256(hi, one)), 16);
    // |u| > inf as signed dwords: both sides are below 2^31.
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet), nan);
    StoreLowHalves8(out + 2 * i, r);
  }
  for (; i < n; ++i) {
    const uint16_t b = FloatToBf16(x[i]);
    memcpy(out + 2 * i, &b, 2);
  }
}

void FloatToFp8E4m3Avx2(const float* x, int n, uint8_t* out) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i sat = _mm256_set1_epi32(0x43e00000);
  const __m256i sub = _mm256_set1_epi32(0x3c800000);
  const __m256i bias = _mm256_set1_epi32(static_cast<int>(0xc407ffffu));
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i max_code = _mm256_set1_epi32(0x7e);
  const __m256 shift = _mm256_set1_ps(16384.0f);
  const __m256i shift_bits = _mm256_set1_epi32(0x46800000);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(raw, 24), _mm256_set1_epi32(0x80));
    const __m256i u = _mm256_and_si256(raw, abs_mask);  // below 2^31: signed compares are unsigned ones
    // Normal range: rebias and round, saturating at 0x7e.
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(_mm256_srli_epi32(u, 20), one));
    __m256i code = _mm256_min_epu32(_mm256_srli_epi32(t, 20), max_code);
    // Subnormal range: the FPU rounds when 2^14 is added.
    const __m256i is_sub = _mm256_cmpgt_epi32(sub, u);
    const __m256i shifted = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(u), shift));
    code = _mm256_blendv_epi8(code, _mm256_sub_epi32(shifted, shift_bits), is_sub);
    const __m256i saturated = _mm256_or_si256(_mm256_cmpgt_epi32(u, sat), _mm256_cmpeq_epi32(u, sat));
    code = _mm256_blendv_epi8(code, max_code, saturated);
    code = _mm256_or_si256(code, sign);
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(u, inf));
    StoreLowBytes8(out + i, code);
  }
  for (; i < n; ++i) out[i] = FloatToFp8E4m3(x[i]);
}

void MinMaxAvx2(const float* x, int n, float* lo_out, float* hi_out) {
  float lo_s = x[0], hi_s = x[0];
  int i = 0;
  if (n >= 8) {
    __m256 lo = _mm256_set1_ps(x[0]), hi = lo;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      lo = _mm256_min_ps(lo, v);
      hi = _mm256_max_ps(hi, v);
    }
    alignas(32) float lanes_lo[8], lanes_hi[8];
    _mm256_store_ps(lanes_lo, lo);
    _mm256_store_ps(lanes_hi, hi);
    for (int k = 0; k < 8; ++k) {
      lo_s = std::min(lo_s, lanes_lo[k]);
      hi_s = std::max(hi_s, lanes_hi[k]);
    }
  }
  for (; i < n; ++i) {
    lo_s = std::min(lo_s, x[i]);
    hi_s = std::max(hi_s, x[i]);
  }
  if (lo_s == 0.0f || hi_s == 0.0f) {
    // -0 and +0 compare equal: which one the sequential loop keeps depends on
    // the order, and the sign reaches the stored fp16 zero point / scale.
    lo_s = hi_s = x[0];
    for (int k = 1; k < n; ++k) {
      lo_s = std::min(lo_s, x[k]);
      hi_s = std::max(hi_s, x[k]);
    }
  }
  *lo_out = lo_s;
  *hi_out = hi_s;
}

void UniformLevelsAvx2(const float* x, int n, float zero, float inv_scale, int max_code, uint8_t* levels) {
  const __m256 vzero = _mm256_set1_ps(zero);
  const __m256 vinv = _mm256_set1_ps(inv_scale);
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 vmax = _mm256_set1_ps(static_cast<float>(max_code));
  const __m256 fzero = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 level = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vzero), vinv), half);
    level = _mm256_round_ps(level, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    level = _mm256_min_ps(_mm256_max_ps(level, fzero), vmax);
    StoreLowBytes8(levels + i, _mm256_cvttps_epi32(level));
  }
  for (; i < n; ++i) {
    const float level = std::floor((x[i] - zero) * inv_scale + 0.5f);
    levels[i] = static_cast<uint8_t>(std::clamp(level, 0.0f, static_cast<float>(max_code)));
  }
}

float QuantizePackAvx2(const QuantizeTables& tables, const float* y, int n, uint8_t* codes) {
  uint8_t levels[kMaxEncodeDim];
  QuantizeToLevelsAvx2(tables.boundaries, tables.bits, y, n, levels);
  PackBitsBmi2(levels, n, tables.bits, codes);
  return tables.centroids != nullptr ? CodewordSumAvx2(tables.centroids, tables.bits, levels, n) : 0.0f;
}

namespace {

// The packed stream of kBits-bit codes, 8 at a time, written in whole
// 8-byte words and an exact tail: no byte past the codes is touched.
template <int kBits>
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}

  // Codes in the low kBits bits of each byte of `bytes` (higher bits zero).
  void Put8(uint64_t bytes) {
    constexpr uint64_t kMask = 0x0101010101010101ull * ((1u << kBits) - 1u);
    const uint64_t bits = _pext_u64(bytes, kMask);  // 8 kBits bits
    word_ |= bits << fill_;
    fill_ += 8 * kBits;
    if (fill_ >= 64) {
      memcpy(out_, &word_, 8);
      out_ += 8;
      fill_ -= 64;
      word_ = fill_ > 0 ? bits >> (8 * kBits - fill_) : 0;
    }
  }

  void Flush() {
    if (fill_ > 0) memcpy(out_, &word_, static_cast<size_t>((fill_ + 7) / 8));
  }

 private:
  uint8_t* out_;
  uint64_t word_ = 0;
  int fill_ = 0;
};

// RotateQuantizePackAvx512 at 8 lanes for n = 8 kRegs (kRegs even) and
// kBits bits: the Hadamard stages of hadamard_body.h on registers, the
// search of QuantizeTables (as QuantizeToLevelsAvx2 finds the levels),
// CodewordSumAvx2's partials (register r adds to partials 8 (r % 2) ...),
// and the pack of PackBitsBmi2, with no pass through memory between them.
template <int kRegs, int kBits>
float RotateQuantizePackRegs(const float* x, float inv_norm, const float* pre_signs, const QuantizeTables& t,
                             uint8_t* codes) {
  static_assert(kRegs % 2 == 0, "whole 16-coordinate blocks");
  using S = simd::Avx2;
  constexpr int n = kRegs * 8;
  __m256 v[kRegs];
  hadamard::ScaledTransformStages<S, kRegs>(x, inv_norm, pre_signs, v);
  const __m256 scale = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))));

  // The search's tables (at most 4 bits: 16 entries, two registers each).
  const __m256 first_bound = _mm256_set1_ps(t.first_bound);
  const __m256i first = _mm256_set1_epi32(t.first);
  __m256 shifted_low[3], shifted_high[3];
  for (int k = 0; k < t.later; ++k) {
    shifted_low[k] = _mm256_load_ps(t.shifted[k]);
    shifted_high[k] = _mm256_load_ps(t.shifted[k] + 8);
  }
  const __m256 squares_low = _mm256_load_ps(t.squares), squares_high = _mm256_load_ps(t.squares + 8);
  const auto lookup = [](__m256 low, __m256 high, __m256i index) {
    return kBits <= 3 ? _mm256_permutevar8x32_ps(low, index) : Lookup16(low, high, index);
  };
  __m256 partial[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  BitWriter<kBits> writer(codes);
  // Four registers (32 codes) at a time: their levels to bytes in order, then
  // four 8-code steps of the pack.
#pragma GCC unroll 8
  for (int r0 = 0; r0 < kRegs; r0 += 4) {
    __m256i lo[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      if (r0 + j >= kRegs) {
        lo[j] = _mm256_setzero_si256();
        continue;
      }
      const __m256 y = _mm256_mul_ps(v[r0 + j], scale);
      __m256i level = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(y, first_bound, _CMP_GT_OQ)), first);
      for (int k = 0, step = t.first >> 1; k < t.later; ++k, step >>= 1) {
        const __m256 bound = lookup(shifted_low[k], shifted_high[k], level);
        const __m256i gt = _mm256_castps_si256(_mm256_cmp_ps(y, bound, _CMP_GT_OQ));
        level = _mm256_add_epi32(level, _mm256_and_si256(gt, _mm256_set1_epi32(step)));
      }
      partial[(r0 + j) % 2] = _mm256_add_ps(partial[(r0 + j) % 2], lookup(squares_low, squares_high, level));
      lo[j] = level;
    }
    // packus works within 128-bit lanes: bytes come out as dwords
    // (0.lo, 1.lo, 2.lo, 3.lo, 0.hi, 1.hi, 2.hi, 3.hi); vpermd restores
    // register order.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packus_epi16(_mm256_packus_epi32(lo[0], lo[1]), _mm256_packus_epi32(lo[2], lo[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const int words = kRegs - r0 < 4 ? kRegs - r0 : 4;
    writer.Put8(static_cast<uint64_t>(_mm256_extract_epi64(bytes, 0)));
    if (words > 1) writer.Put8(static_cast<uint64_t>(_mm256_extract_epi64(bytes, 1)));
    if (words > 2) writer.Put8(static_cast<uint64_t>(_mm256_extract_epi64(bytes, 2)));
    if (words > 3) writer.Put8(static_cast<uint64_t>(_mm256_extract_epi64(bytes, 3)));
  }
  writer.Flush();
  if (t.centroids == nullptr) return 0.0f;
  alignas(32) float sums[kSumLanes];
  _mm256_store_ps(sums, partial[0]);
  _mm256_store_ps(sums + 8, partial[1]);
  return FoldSumLanes(sums);
}

template <int kBits>
float RotateQuantizePackBits(const float* x, float inv_norm, const float* pre_signs, int n,
                             const QuantizeTables& tables, uint8_t* codes) {
  switch (n) {
    case 16:
      return RotateQuantizePackRegs<2, kBits>(x, inv_norm, pre_signs, tables, codes);
    case 32:
      return RotateQuantizePackRegs<4, kBits>(x, inv_norm, pre_signs, tables, codes);
    case 64:
      return RotateQuantizePackRegs<8, kBits>(x, inv_norm, pre_signs, tables, codes);
    case 128:
      return RotateQuantizePackRegs<16, kBits>(x, inv_norm, pre_signs, tables, codes);
    default:
      return RotateQuantizePackRegs<32, kBits>(x, inv_norm, pre_signs, tables, codes);
  }
}

}  // namespace

float RotateQuantizePackAvx2(const float* x, float inv_norm, const float* pre_signs, int n,
                             const QuantizeTables& tables, uint8_t* codes) {
  switch (tables.bits) {
    case 2:
      return RotateQuantizePackBits<2>(x, inv_norm, pre_signs, n, tables, codes);
    case 3:
      return RotateQuantizePackBits<3>(x, inv_norm, pre_signs, n, tables, codes);
    default:
      return RotateQuantizePackBits<4>(x, inv_norm, pre_signs, n, tables, codes);
  }
}

bool UniformRangeAvx2(const float* x, int n, float* lo, float* hi) {
  if (!AllFiniteWithinAvx2(x, n, kHalfMax)) return false;
  MinMaxAvx2(x, n, lo, hi);
  return true;
}

void UniformPackAvx2(const float* x, int n, float zero, float inv_scale, int bits, uint8_t* codes) {
  uint8_t levels[kMaxEncodeDim];
  UniformLevelsAvx2(x, n, zero, inv_scale, (1 << bits) - 1, levels);
  PackBitsBmi2(levels, n, bits, codes);
}

}  // namespace encode_internal
}  // namespace tqkv
