// Internal to the CPU backend: the AVX-512 pieces both AVX-512 attention
// kernels use (attend_avx512.cc, fp32; attend_avx512_vnni.cc, integer).
// Include only from translation units compiled with AVX-512 F/BW/VL/DQ. The
// functions have internal linkage on purpose: each file is compiled with its
// own ISA flags, and a shared inline definition would let the linker keep
// the copy built with the wider set (VNNI, VBMI) for the narrower kernel.
#ifndef TQKV_KERNELS_CPU_ATTEND_AVX512_COMMON_H_
#define TQKV_KERNELS_CPU_ATTEND_AVX512_COMMON_H_

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/attend_kernels.h"

namespace tqkv {
namespace cpu_internal {
namespace avx512 {

// exp(x) for x <= 0 (softmax arguments), relative error < 2e-7: Cody-Waite
// range reduction to |r| <= ln2/2 and a degree-6 Taylor polynomial.
static inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The soft cap of logits whose constant part `shift` is added later:
// cap * tanh((x + shift) / cap) - shift. tanh(|y|) = (1 - e) / (1 + e) with
// e = exp(-2 |y|) (Exp's domain), its sign restored: absolute error about
// 3e-7 cap. -inf gives -cap - shift (callers mask after).
static inline __m512 SoftCap(__m512 x, __m512 cap, __m512 inv_cap, __m512 shift) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 y = _mm512_mul_ps(_mm512_add_ps(x, shift), inv_cap);
  const __m512 e = Exp(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(y)));
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 sign = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(INT32_MIN)));
  return _mm512_fmsub_ps(cap, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_castps_si512(sign))),
                         shift);
}

// Horizontal sum and max (GCC 12's _mm512_reduce_* trip -Wuninitialized).
static inline float Sum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

static inline float Max(__m512 v) {
  const __m256 a = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(c, _mm_movehdup_ps(c)));
}

// The fp16 scalars of n <= 64 tokens whose scalars follow each other: one
// scale per token into `scale` (zero == nullptr), or [scale, zero] pairs
// into `scale` and `zero`.
static inline void LoadScalars(const uint8_t* scalars, int n, float* scale, float* zero) {
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

}  // namespace avx512
}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_ATTEND_AVX512_COMMON_H_
