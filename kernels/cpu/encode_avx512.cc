// AVX-512 kernels of the store path; see kernels/cpu/encode_kernels.h.
// Compiled with -mavx512f -mavx512bw -mavx512vl -ffp-contract=off: the
// float operations must be exactly those of the portable code (no FMA).
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/encode_kernels.h"

namespace tqkv {
namespace encode_internal {
namespace {

inline __mmask16 TailMask(int remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xffff)
                         : static_cast<__mmask16>((1u << remaining) - 1u);
}

inline void StoreBytes16(uint8_t* out, __m512i v32, __mmask16 m) {
  _mm_mask_storeu_epi8(out, m, _mm512_cvtepi32_epi8(v32));
}

// Transposes 16 rows of 16 floats: r[i] lane j becomes r[j] lane i.
inline void Transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4 i + c], 128-bit lane k: rows 4i ... 4i + 3 of column 4k + c.
  __m512 u[16];
  for (int i = 0; i < 4; ++i) {
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = _mm512_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0x44);
      u[4 * i + 2 * h + 1] = _mm512_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0xee);
    }
  }
  // Column 4k + c gathers lane k of u[c], u[4 + c], u[8 + c], u[12 + c].
  for (int c = 0; c < 4; ++c) {
    const __m512 a1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);  // lanes 0, 2 of each
    const __m512 a2 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd);  // lanes 1, 3
    const __m512 b1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 b2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_f32x4(a1, b1, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(a1, b1, 0xdd);
    r[4 + c] = _mm512_shuffle_f32x4(a2, b2, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(a2, b2, 0xdd);
  }
}

}  // namespace

bool AllFiniteWithinAvx512(const float* x, int n, float limit) {
  const __m512 vlimit = _mm512_set1_ps(limit);
  const __m512 inf = _mm512_set1_ps(__builtin_inff());
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n - i);
    const __m512 v = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_maskz_loadu_epi32(m, x + i), abs_mask));
    // Ordered compares: NaN fails both.
    const __mmask16 ok = _mm512_cmp_ps_mask(v, inf, _CMP_LT_OQ) &
                         _mm512_cmp_ps_mask(v, vlimit, _CMP_LE_OQ);
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

void QuantizeToLevelsAvx512(const float* boundaries, int bits, const float* y, int n,
                            uint8_t* levels) {
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
        const __m512 b = bits <= 4 ? _mm512_permutexvar_ps(idx, t0)
                                   : _mm512_permutex2var_ps(t0, idx, t1);
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
    const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, round), _mm512_and_si512(hi, one)), 16);
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
    const __m512i t = _mm512_add_epi32(
        _mm512_add_epi32(u, bias), _mm512_and_si512(_mm512_srli_epi32(u, 20), one));
    __m512i code = _mm512_min_epu32(_mm512_srli_epi32(t, 20), max_code);
    // Subnormal range: the FPU rounds when 2^14 is added.
    const __mmask16 is_sub = _mm512_cmplt_epu32_mask(u, sub);
    const __m512i shifted =
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(u), shift));
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

void UniformLevelsAvx512(const float* x, int n, float zero, float inv_scale, int max_code,
                         uint8_t* levels) {
  const __m512 vzero = _mm512_set1_ps(zero);
  const __m512 vinv = _mm512_set1_ps(inv_scale);
  const __m512 half = _mm512_set1_ps(0.5f);
  const __m512 vmax = _mm512_set1_ps(static_cast<float>(max_code));
  const __m512 fzero = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    __m512 level = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v, vzero), vinv), half);
    level = _mm512_roundscale_ps(level, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    level = _mm512_min_ps(_mm512_max_ps(level, fzero), vmax);
    StoreBytes16(levels + i, _mm512_cvttps_epi32(level), m);
  }
}

void SumsOfSquaresAvx512(const float* const* x, int n, double* sums) {
  static_assert(kSumVectors == 32, "two groups of 16 vectors");
  // Lanes are vectors: four chains of 8 doubles, one add per coordinate each.
  __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
  int i = 0;
  // One group of 16 vectors at a time keeps a block in registers; the other
  // group's chains are independent, so the two still overlap.
  for (; i + 16 <= n; i += 16) {
    for (int g = 0; g < 2; ++g) {
      __m512 block[16];
      for (int v = 0; v < 16; ++v) block[v] = _mm512_loadu_ps(x[16 * g + v] + i);
      Transpose16(block);  // block[j] lane v: x[16 g + v][i + j]
      for (int j = 0; j < 16; ++j) {
        const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(block[j]));
        const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(block[j]), 1)));
        acc[2 * g] = _mm512_add_pd(acc[2 * g], _mm512_mul_pd(a, a));
        acc[2 * g + 1] = _mm512_add_pd(acc[2 * g + 1], _mm512_mul_pd(b, b));
      }
    }
  }
  for (int q = 0; q < 4; ++q) _mm512_storeu_pd(sums + 8 * q, acc[q]);
  for (; i < n; ++i) {
    for (int v = 0; v < kSumVectors; ++v) sums[v] += static_cast<double>(x[v][i]) * x[v][i];
  }
}

void CodewordSumsAvx512(const float* centroids, int bits, const uint8_t* const* levels, int n, float* sums) {
  static_assert(kSumVectors == 32, "two groups of 16 vectors");
  const int size = 1 << bits;
  float table[16] = {};
  for (int k = 0; k < size && k < 16; ++k) table[k] = centroids[k];
  const __m512 lookup = _mm512_loadu_ps(table);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int g = 0; g < 2; ++g) {
      __m512 block[16];
      for (int v = 0; v < 16; ++v) {
        const __m512i idx =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(levels[16 * g + v] + i)));
        block[v] = bits <= 4 ? _mm512_permutexvar_ps(idx, lookup) : _mm512_i32gather_ps(idx, centroids, 4);
      }
      Transpose16(block);
      for (int j = 0; j < 16; ++j) acc[g] = _mm512_add_ps(acc[g], _mm512_mul_ps(block[j], block[j]));
    }
  }
  _mm512_storeu_ps(sums, acc[0]);
  _mm512_storeu_ps(sums + 16, acc[1]);
  for (; i < n; ++i) {
    for (int v = 0; v < kSumVectors; ++v) sums[v] += centroids[levels[v][i]] * centroids[levels[v][i]];
  }
}

}  // namespace encode_internal
}  // namespace tqkv
