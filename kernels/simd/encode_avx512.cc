// AVX-512 kernels of the store path; see kernels/simd/encode_kernels.h.
// Compiled with -mavx512f -mavx512bw -mavx512vl -ffp-contract=off: the
// float operations must be exactly those of the portable code (no FMA).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels/blocked_sums.h"

#include "kernels/simd/encode_kernels.h"
#include "kernels/simd/hadamard_body.h"
#include "kernels/float_formats.h"

namespace tqkv {
namespace encode_internal {
namespace {

inline __mmask16 TailMask(int remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << remaining) - 1u);
}

inline void StoreBytes16(uint8_t* out, __m512i v32, __mmask16 m) {
  _mm_mask_storeu_epi8(out, m, _mm512_cvtepi32_epi8(v32));
}

// FoldSumLanes (blocked_sums.h) in registers: partials 0-7 in `low`, 8-15 in
// `high`; each step adds lane j + w to lane j.
inline double FoldSumLanes(__m512d low, __m512d high) {
  const __m512d s8 = _mm512_add_pd(low, high);
  const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
  const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}

// The same for 16 float partials in one register.
inline float FoldSumLanes(__m512 partial) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(partial),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(partial), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// The uniform codec's level of each lane, as a float:
// clamp(floor((v - zero) * inv_scale + 0.5f), 0, max_code).
inline __m512 UniformLevel(__m512 v, __m512 zero, __m512 inv_scale, __m512 max_code) {
  const __m512 level =
      _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v, zero), inv_scale), _mm512_set1_ps(0.5f)),
                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  return _mm512_min_ps(_mm512_max_ps(level, _mm512_setzero_ps()), max_code);
}

}  // namespace

bool AllFiniteWithinAvx512(const float* x, int n, float limit) {
  const __m512 vlimit = _mm512_set1_ps(limit);
  const __m512 inf = _mm512_set1_ps(__builtin_inff());
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n - i);
    const __m512 v = _mm512_castsi512_ps(_mm512_and_si512(_mm512_maskz_loadu_epi32(m, x + i), abs_mask));
    // Ordered compares: NaN fails both.
    const __mmask16 ok = _mm512_cmp_ps_mask(v, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(v, vlimit, _CMP_LE_OQ);
    if ((ok & m) != m) return false;
  }
  return true;
}

void ScaleAvx512(const float* x, int n, float s, float* y) {
  const __m512 vs = _mm512_set1_ps(s);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
  }
}

void QuantizeToLevelsAvx512(const float* boundaries, int bits, const float* y, int n, uint8_t* levels) {
  const int num_boundaries = (1 << bits) - 1;
  // Branch-free binary search, as QuantizeToLevel: for ascending boundaries
  // it finds #{boundaries < y}, like the counting loop. NaN compares false.
  if (bits <= 5) {
    float table[32];
    for (int k = 0; k < 32; ++k) table[k] = k < num_boundaries ? boundaries[k] : 0.0f;
    const __m512 t0 = _mm512_loadu_ps(table);
    const __m512 t1 = _mm512_loadu_ps(table + 16);
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = TailMask(n - i);
      const __m512 v = _mm512_maskz_loadu_ps(m, y + i);
      __m512i lo = _mm512_setzero_si512();
      for (int step = (num_boundaries + 1) >> 1; step > 0; step >>= 1) {
        const __m512i idx = _mm512_add_epi32(lo, _mm512_set1_epi32(step - 1));
        const __m512 b = bits <= 4 ? _mm512_permutexvar_ps(idx, t0) : _mm512_permutex2var_ps(t0, idx, t1);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, b, _CMP_GT_OQ);
        lo = _mm512_mask_add_epi32(lo, gt, lo, _mm512_set1_epi32(step));
      }
      StoreBytes16(levels + i, lo, m);
    }
    return;
  }
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, y + i);
    __m512i lo = _mm512_setzero_si512();
    for (int step = (num_boundaries + 1) >> 1; step > 0; step >>= 1) {
      const __m512i idx = _mm512_add_epi32(lo, _mm512_set1_epi32(step - 1));
      const __m512 b = _mm512_i32gather_ps(idx, boundaries, 4);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, b, _CMP_GT_OQ);
      lo = _mm512_mask_add_epi32(lo, gt, lo, _mm512_set1_epi32(step));
    }
    StoreBytes16(levels + i, lo, m);
  }
}

void FloatToHalfAvx512(const float* x, int n, uint8_t* out) {
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n - i);
    const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(out + 2 * i, m, h);
  }
}

void FloatToBf16Avx512(const float* x, int n, uint8_t* out) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000);
  const __m512i round = _mm512_set1_epi32(0x7fff);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n - i);
    const __m512i u = _mm512_maskz_loadu_epi32(m, x + i);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, round), _mm512_and_si512(hi, one)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, quiet));
    _mm256_mask_storeu_epi16(out + 2 * i, m, _mm512_cvtepi32_epi16(r));
  }
}

void FloatToFp8E4m3Avx512(const float* x, int n, uint8_t* out) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000);
  const __m512i sat = _mm512_set1_epi32(0x43e00000);
  const __m512i sub = _mm512_set1_epi32(0x3c800000);
  const __m512i bias = _mm512_set1_epi32(static_cast<int>(0xc407ffffu));
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i max_code = _mm512_set1_epi32(0x7e);
  const __m512 shift = _mm512_set1_ps(16384.0f);
  const __m512i shift_bits = _mm512_set1_epi32(0x46800000);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n - i);
    const __m512i raw = _mm512_maskz_loadu_epi32(m, x + i);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(raw, 24), _mm512_set1_epi32(0x80));
    const __m512i u = _mm512_and_si512(raw, abs_mask);
    // Normal range: rebias and round, saturating at 0x7e.
    const __m512i t = _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(_mm512_srli_epi32(u, 20), one));
    __m512i code = _mm512_min_epu32(_mm512_srli_epi32(t, 20), max_code);
    // Subnormal range: the FPU rounds when 2^14 is added.
    const __mmask16 is_sub = _mm512_cmplt_epu32_mask(u, sub);
    const __m512i shifted = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(u), shift));
    code = _mm512_mask_mov_epi32(code, is_sub, _mm512_sub_epi32(shifted, shift_bits));
    code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epu32_mask(u, sat), max_code);
    code = _mm512_or_si512(code, sign);
    code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(u, inf), _mm512_set1_epi32(0x7f));
    StoreBytes16(out + i, code, m);
  }
}

void MinMaxAvx512(const float* x, int n, float* lo_out, float* hi_out) {
  const __m512 first = _mm512_set1_ps(x[0]);
  __m512 lo = first, hi = first;
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n - i);
    const __m512 v = _mm512_mask_loadu_ps(first, m, x + i);
    lo = _mm512_min_ps(lo, v);
    hi = _mm512_max_ps(hi, v);
  }
  float lo_s = _mm512_reduce_min_ps(lo);
  float hi_s = _mm512_reduce_max_ps(hi);
  if (lo_s == 0.0f || hi_s == 0.0f) {
    // -0 and +0 compare equal: which one the sequential loop keeps depends on
    // the order, and the sign reaches the stored fp16 zero point / scale.
    lo_s = hi_s = x[0];
    for (int i = 1; i < n; ++i) {
      lo_s = x[i] < lo_s ? x[i] : lo_s;  // std::min(lo, x)
      hi_s = hi_s < x[i] ? x[i] : hi_s;  // std::max(hi, x)
    }
  }
  *lo_out = lo_s;
  *hi_out = hi_s;
}

void UniformLevelsAvx512(const float* x, int n, float zero, float inv_scale, int max_code, uint8_t* levels) {
  const __m512 vzero = _mm512_set1_ps(zero);
  const __m512 vinv = _mm512_set1_ps(inv_scale);
  const __m512 vmax = _mm512_set1_ps(static_cast<float>(max_code));
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n - i);
    const __m512 level = UniformLevel(_mm512_maskz_loadu_ps(m, x + i), vzero, vinv, vmax);
    StoreBytes16(levels + i, _mm512_cvttps_epi32(level), m);
  }
}

bool SumOfSquaresAvx512(const float* x, int n, double* sum) {
  // Partials 0-7 and 8-15 of the blocked order in two registers. The
  // product of two floats is exact in double, so the FMA rounds exactly as
  // the portable multiply-then-add; masked-off lanes add +0, which changes no
  // partial (all of them are >= +0).
  __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
  for (int i = 0; i < n; i += kSumLanes) {
    const __m512 v = _mm512_maskz_loadu_ps(TailMask(n - i), x + i);
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    low = _mm512_fmadd_pd(a, a, low);
    high = _mm512_fmadd_pd(b, b, high);
  }
  *sum = FoldSumLanes(low, high);
  return std::isfinite(*sum);
}

float CodewordSumAvx512(const float* centroids, int bits, const uint8_t* levels, int n) {
  const int size = 1 << bits;
  float squares[16] = {};
  for (int k = 0; k < size && k < 16; ++k) squares[k] = centroids[k] * centroids[k];
  const __m512 lookup = _mm512_loadu_ps(squares);
  __m512 acc = _mm512_setzero_ps();  // the kSumLanes partials
  for (int i = 0; i < n; i += kSumLanes) {
    const __mmask16 m = TailMask(n - i);
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, levels + i));
    __m512 square;
    if (bits <= 4) {
      square = _mm512_maskz_permutexvar_ps(m, idx, lookup);
    } else {
      const __m512 c = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, centroids, 4);
      square = _mm512_mul_ps(c, c);
    }
    acc = _mm512_add_ps(acc, square);
  }
  return FoldSumLanes(acc);
}

namespace {

// PackBitsAvx512's shuffles for `bits` bits: runs (vpshufb) moves bytes
// 0 ... bits - 1 of each qword of a 128-bit lane to the lane's start (-128:
// a zero byte); lanes (vpermw) takes the first `bits` words of each lane.
struct PackIndex {
  alignas(64) int8_t runs[64] = {};
  alignas(64) int16_t lanes[32] = {};
  constexpr explicit PackIndex(int bits) {
    for (int i = 0; i < 64; ++i) {
      const int k = i % 16;
      runs[i] = static_cast<int8_t>(k < bits ? k : k < 2 * bits ? 8 + k - bits : -128);
    }
    for (int w = 0; w < 32; ++w) lanes[w] = static_cast<int16_t>(w < 4 * bits ? 8 * (w / bits) + w % bits : 0);
  }
};
constexpr PackIndex kPackIndex[3] = {PackIndex(2), PackIndex(3), PackIndex(4)};

// One step of PackBitsAvx512: the first m of the 64 codes in the bytes of
// `codes` (2 <= bits <= 4; each < 2^bits, bytes from m on zero), as their
// m * bits bits at out. Byte pairs, then word pairs, then dword pairs merge
// (code 2 j + 1 above code 2 j, as the LSB-first stream has them): each
// qword ends with its 8 codes in its low `bits` bytes. vpshufb moves a
// 128-bit lane's two such runs to its start and vpermw packs the lanes'
// runs (bits words each) together.
inline void PackStep(__m512i codes, int m, int bits, uint8_t* out) {
  const __m512i byte_pairs = _mm512_set1_epi16(static_cast<int16_t>(1 | (1 << (8 + bits))));
  const __m512i word_pairs = _mm512_set1_epi32(1 | (1 << (16 + 2 * bits)));
  const PackIndex& index = kPackIndex[bits - 2];
  __m512i v = _mm512_madd_epi16(_mm512_maddubs_epi16(codes, byte_pairs), word_pairs);
  v = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi64(0xffffffffll)), _mm512_srli_epi64(v, 32 - 4 * bits));
  v = _mm512_permutexvar_epi16(_mm512_load_si512(index.lanes), _mm512_shuffle_epi8(v, _mm512_load_si512(index.runs)));
  const int bytes = (m * bits + 7) / 8;
  _mm512_mask_storeu_epi8(out, bytes == 64 ? ~__mmask64{0} : (__mmask64{1} << bytes) - 1, v);
}

// The int32 levels of coordinates 16 j ... 16 j + 15 in lo[j], j < 4, as the
// 64 bytes of one vector in coordinate order: two in-lane packs leave
// coordinates 16 j + 4 L ... + 3 in dword 4 L + j; vpermd puts them at 4 j + L.
// (Built in registers: four 16-byte stores read back as one 64-byte load
// would miss store forwarding.)
inline __m512i LevelBytes(const __m512i* lo) {
  const __m512i packed = _mm512_packus_epi16(_mm512_packus_epi32(lo[0], lo[1]), _mm512_packus_epi32(lo[2], lo[3]));
  return _mm512_permutexvar_epi32(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), packed);
}

// The packed codes of x[0, n) (2 <= bits <= 4): levels(v, m) gives the int32
// levels of 16 coordinates v (lanes outside m loaded as 0); lanes past n are
// zeroed before the pack, so no code lands past n.
template <typename Levels>
inline void PackLevels(const float* x, int n, int bits, uint8_t* codes, Levels&& levels) {
  for (int i = 0; i < n; i += 64) {
    __m512i lo[4];
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm512_setzero_si512();
      if (i + 16 * j >= n) continue;
      const __mmask16 m = TailMask(n - i - 16 * j);
      lo[j] = _mm512_maskz_mov_epi32(m, levels(_mm512_maskz_loadu_ps(m, x + i + 16 * j), m));
    }
    PackStep(LevelBytes(lo), n - i < 64 ? n - i : 64, bits, codes + i / 8 * bits);
  }
}

}  // namespace

void PackBitsAvx512(const uint8_t* codes, int n, int bits, uint8_t* out) {
  if (bits < 2 || bits > 4) {
    PackBitsBmi2(codes, n, bits, out);
    return;
  }
  const __m512i width = _mm512_set1_epi8(static_cast<char>((1 << bits) - 1));
  for (int i = 0; i < n; i += 64) {
    const int m = n - i < 64 ? n - i : 64;
    const __mmask64 in = m == 64 ? ~__mmask64{0} : (__mmask64{1} << m) - 1;
    PackStep(_mm512_and_si512(_mm512_maskz_loadu_epi8(in, codes + i), width), m, bits, out + i / 8 * bits);
  }
}

namespace {

// QuantizePackAvx512's search of one codebook (2-4 bits, QuantizeTables), in
// registers: levels of 16 coordinates at a time, and the running codeword
// sum. The search halves: a compare with one boundary, then each later step
// s looks up boundaries[level + s - 1] in a table shifted by s - 1 (no index
// add).
class LevelSearch {
 public:
  explicit LevelSearch(const QuantizeTables& t)
      : later_(t.later), first_step_(t.first), lookup_(_mm512_load_ps(t.squares)),
        first_bound_(_mm512_set1_ps(t.first_bound)) {
    for (int k = 0; k < later_; ++k) shifted_[k] = _mm512_load_ps(t.shifted[k]);
  }

  // The int32 levels of v; lanes outside m add nothing to the sum.
  __m512i operator()(__m512 v, __mmask16 m) {
    __m512i lo =
        _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(v, first_bound_, _CMP_GT_OQ), _mm512_set1_epi32(first_step_));
    for (int k = 0, step = first_step_ >> 1; k < later_; ++k, step >>= 1) {
      const __mmask16 gt = _mm512_cmp_ps_mask(v, _mm512_permutexvar_ps(lo, shifted_[k]), _CMP_GT_OQ);
      lo = _mm512_mask_add_epi32(lo, gt, lo, _mm512_set1_epi32(step));
    }
    acc_ = _mm512_add_ps(acc_, _mm512_maskz_permutexvar_ps(m, lo, lookup_));
    return lo;
  }

  // The codeword sum in the blocked order (CodewordSumAvx512's).
  float CodewordSum() const { return FoldSumLanes(acc_); }

 private:
  int later_;
  int first_step_;
  __m512 lookup_;
  __m512 first_bound_;
  __m512 shifted_[3];  // at most 4 bits: steps 4, 2, 1 after the first
  __m512 acc_ = _mm512_setzero_ps();
};

// RotateQuantizePackAvx512 for n = 16 kRegs: hadamard_body.h's transform
// stages on registers that come from x and go to the search, not through
// memory.
template <int kRegs>
float RotateQuantizePackRegs(const float* x, float inv_norm, const float* pre_signs, const QuantizeTables& tables,
                             uint8_t* codes) {
  using S = simd::Avx512;
  constexpr int n = kRegs * 16;
  __m512 v[kRegs];
  hadamard::ScaledTransformStages<S, kRegs>(x, inv_norm, pre_signs, v);
  const __m512 scale = _mm512_set1_ps(static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))));
  LevelSearch search(tables);
#pragma GCC unroll 4
  for (int r0 = 0; r0 < kRegs; r0 += 4) {
    __m512i lo[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      lo[j] = r0 + j < kRegs ? search(_mm512_mul_ps(v[r0 + j], scale), 0xffff) : _mm512_setzero_si512();
    }
    PackStep(LevelBytes(lo), n - 16 * r0 < 64 ? n - 16 * r0 : 64, tables.bits, codes + 2 * r0 * tables.bits);
  }
  return tables.centroids != nullptr ? search.CodewordSum() : 0.0f;
}

}  // namespace

float QuantizePackAvx512(const QuantizeTables& tables, const float* y, int n, uint8_t* codes) {
  const int bits = tables.bits;
  if (bits < 2 || bits > 4) {
    uint8_t levels[kMaxEncodeDim];
    QuantizeToLevelsAvx512(tables.boundaries, bits, y, n, levels);
    PackBitsAvx512(levels, n, bits, codes);
    return tables.centroids != nullptr ? CodewordSumAvx512(tables.centroids, bits, levels, n) : 0.0f;
  }
  // QuantizeToLevelsAvx512's search and CodewordSumAvx512's lookups on the
  // same registers, 16 coordinates at a time, then one pack.
  LevelSearch search(tables);
  PackLevels(y, n, bits, codes, search);
  return tables.centroids != nullptr ? search.CodewordSum() : 0.0f;
}

float RotateQuantizePackAvx512(const float* x, float inv_norm, const float* pre_signs, int n,
                               const QuantizeTables& tables, uint8_t* codes) {
  switch (n) {
    case 16:
      return RotateQuantizePackRegs<1>(x, inv_norm, pre_signs, tables, codes);
    case 32:
      return RotateQuantizePackRegs<2>(x, inv_norm, pre_signs, tables, codes);
    case 64:
      return RotateQuantizePackRegs<4>(x, inv_norm, pre_signs, tables, codes);
    case 128:
      return RotateQuantizePackRegs<8>(x, inv_norm, pre_signs, tables, codes);
    default:
      return RotateQuantizePackRegs<16>(x, inv_norm, pre_signs, tables, codes);
  }
}

bool UniformRangeAvx512(const float* x, int n, float* lo_out, float* hi_out) {
  // AllFiniteWithinAvx512 (limit kHalfMax) and MinMaxAvx512 in one pass.
  const __m512 limit = _mm512_set1_ps(kHalfMax);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512 first = _mm512_set1_ps(x[0]);
  __m512 lo = first, hi = first;
  for (int i = 0; i < n; i += 16) {
    const __m512 v = _mm512_mask_loadu_ps(first, TailMask(n - i), x + i);
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask));
    // Ordered compare: NaN fails; infinities exceed the limit.
    if (_mm512_cmp_ps_mask(magnitude, limit, _CMP_LE_OQ) != 0xffff) return false;
    lo = _mm512_min_ps(lo, v);
    hi = _mm512_max_ps(hi, v);
  }
  *lo_out = _mm512_reduce_min_ps(lo);
  *hi_out = _mm512_reduce_max_ps(hi);
  if (*lo_out == 0.0f || *hi_out == 0.0f) MinMaxAvx512(x, n, lo_out, hi_out);  // which zero, as MinMaxAvx512
  return true;
}

void UniformPackAvx512(const float* x, int n, float zero, float inv_scale, int bits, uint8_t* codes) {
  if (bits < 2 || bits > 4) {
    uint8_t levels[kMaxEncodeDim];
    UniformLevelsAvx512(x, n, zero, inv_scale, (1 << bits) - 1, levels);
    PackBitsAvx512(levels, n, bits, codes);
    return;
  }
  // UniformLevelsAvx512's levels, kept in registers.
  const __m512 vzero = _mm512_set1_ps(zero);
  const __m512 vinv = _mm512_set1_ps(inv_scale);
  const __m512 vmax = _mm512_set1_ps(static_cast<float>((1 << bits) - 1));
  PackLevels(x, n, bits, codes,
             [&](__m512 v, __mmask16) { return _mm512_cvttps_epi32(UniformLevel(v, vzero, vinv, vmax)); });
}

}  // namespace encode_internal
}  // namespace tqkv
