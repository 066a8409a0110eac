// One instruction set's float (and dword) vectors behind one small interface, so that a
// kernel body is written once, as a template on the mapping, and compiled in
// each ISA's source file with that ISA's flags (hadamard_avx2.cc,
// hadamard_avx512.cc). A mapping is defined only where the compiler targets
// its ISA.
//
// Everything is in an anonymous namespace on purpose: each source file gets
// its own copies, so the linker can never pick one ISA's inline code for
// another's, or for baseline code.
#ifndef TQKV_KERNELS_SIMD_SIMD_MAPPINGS_H_
#define TQKV_KERNELS_SIMD_SIMD_MAPPINGS_H_

#include <immintrin.h>

#include <cstdint>

namespace tqkv {
namespace simd {
namespace {

#if defined(__AVX2__) && defined(__FMA__)
// 8 floats: AVX2 + FMA.
struct Avx2 {
  using F32 = __m256;
  using Mask = __m256i;  // lanes as all-ones / zero dwords
  static constexpr int kLanes = 8;
  static constexpr int kRegisters = 16;

  static F32 Zero() { return _mm256_setzero_ps(); }
  static F32 Set1(float v) { return _mm256_set1_ps(v); }
  static F32 Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F32 v) { _mm256_storeu_ps(p, v); }
  static F32 Add(F32 a, F32 b) { return _mm256_add_ps(a, b); }
  static F32 Sub(F32 a, F32 b) { return _mm256_sub_ps(a, b); }
  static F32 Mul(F32 a, F32 b) { return _mm256_mul_ps(a, b); }
  static F32 Fmadd(F32 a, F32 b, F32 c) { return _mm256_fmadd_ps(a, b, c); }

  // Lanes [0, count) set; masked loads read zeros elsewhere, masked stores
  // leave the rest alone.
  static Mask TailMask(int count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F32 MaskLoad(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static void MaskStore(float* p, Mask m, F32 v) { _mm256_maskstore_ps(p, m, v); }
#if defined(__F16C__)
  // kLanes IEEE halves as floats (exact).
  static F32 LoadHalves(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
#endif

  // The Walsh-Hadamard butterflies of stride 1, 2, 4 within a register, each
  // (a + b, a - b) exactly as the scalar code: lanes whose bit is set in
  // kUpper get s - v (s holds the partner lane) as fma(v, -1, s), which
  // rounds the exact difference once.
  template <int kUpper>
  static F32 Stage(F32 v, F32 s) {
    return _mm256_fmadd_ps(v, _mm256_blend_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(-1.0f), kUpper), s);
  }
  static F32 InRegisterButterflies(F32 v) {
    v = Stage<0xAA>(v, _mm256_permute_ps(v, 0xB1));          // swap neighbours
    v = Stage<0xCC>(v, _mm256_permute_ps(v, 0x4E));          // swap pairs
    v = Stage<0xF0>(v, _mm256_permute2f128_ps(v, v, 0x01));  // swap 128-bit halves
    return v;
  }

  static float HorizontalSum(F32 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // The horizontal sums of a0..a3, reduced together, in lanes 0..3.
  static __m128 Sums4(F32 a0, F32 a1, F32 a2, F32 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    // h = [s0 s1 s2 s3 | s0' s1' s2' s3']: the two 128-bit halves' partial sums.
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  }
  // y[0..3] = Sums4.
  static void StoreSums4(F32 a0, F32 a1, F32 a2, F32 a3, float* y) { _mm_storeu_ps(y, Sums4(a0, a1, a2, a3)); }

  // Dword vectors, for transposes of 32-bit words.
  using I32 = __m256i;
  static I32 ZeroI32() { return _mm256_setzero_si256(); }
  static I32 LoadI32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void StoreI32(void* p, I32 v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
  static I32 UnpackLo32(I32 a, I32 b) { return _mm256_unpacklo_epi32(a, b); }
  static I32 UnpackHi32(I32 a, I32 b) { return _mm256_unpackhi_epi32(a, b); }
  static I32 UnpackLo64(I32 a, I32 b) { return _mm256_unpacklo_epi64(a, b); }
  static I32 UnpackHi64(I32 a, I32 b) { return _mm256_unpackhi_epi64(a, b); }
  // The 2 x 2 matrix of 128-bit lanes transposed: out[l] lane m = in[m] lane l.
  static void TransposeLanes(const I32* in, I32* out) {
    out[0] = _mm256_permute2x128_si256(in[0], in[1], 0x20);
    out[1] = _mm256_permute2x128_si256(in[0], in[1], 0x31);
  }
};
#endif

#if defined(__AVX512F__)
// 16 floats: AVX-512 F. The masked forms of permutes with an all-ones mask
// are the plain ones: GCC 12 warns about the uninitialised pass-through
// operand of the unmasked intrinsics (and of _mm512_reduce_add_ps).
struct Avx512 {
  using F32 = __m512;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 32;
  static constexpr __mmask16 kAll = 0xFFFF;

  static F32 Zero() { return _mm512_setzero_ps(); }
  static F32 Set1(float v) { return _mm512_set1_ps(v); }
  static F32 Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F32 v) { _mm512_storeu_ps(p, v); }
  static F32 Add(F32 a, F32 b) { return _mm512_add_ps(a, b); }
  static F32 Sub(F32 a, F32 b) { return _mm512_sub_ps(a, b); }
  static F32 Mul(F32 a, F32 b) { return _mm512_mul_ps(a, b); }
  static F32 Fmadd(F32 a, F32 b, F32 c) { return _mm512_fmadd_ps(a, b, c); }

  static Mask TailMask(int count) { return static_cast<__mmask16>((1u << count) - 1u); }
  static F32 MaskLoad(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void MaskStore(float* p, Mask m, F32 v) { _mm512_mask_storeu_ps(p, m, v); }
  static F32 LoadHalves(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  template <__mmask16 kUpper>
  static F32 Stage(F32 v, F32 s) {
    return _mm512_fmadd_ps(v, _mm512_mask_blend_ps(kUpper, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f)), s);
  }
  // Strides 1, 2, 4, 8 (Avx2::InRegisterButterflies).
  static F32 InRegisterButterflies(F32 v) {
    v = Stage<0xAAAA>(v, _mm512_mask_permute_ps(v, kAll, v, 0xB1));        // swap neighbours
    v = Stage<0xCCCC>(v, _mm512_mask_permute_ps(v, kAll, v, 0x4E));        // swap pairs
    v = Stage<0xF0F0>(v, _mm512_mask_shuffle_f32x4(v, kAll, v, v, 0xB1));  // swap 128-bit lanes
    v = Stage<0xFF00>(v, _mm512_mask_shuffle_f32x4(v, kAll, v, v, 0x4E));  // swap 256-bit halves
    return v;
  }

  static float HorizontalSum(F32 v) {
    v = _mm512_add_ps(v, _mm512_mask_shuffle_f32x4(v, kAll, v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_mask_shuffle_f32x4(v, kAll, v, v, 0xB1));
    v = _mm512_add_ps(v, _mm512_mask_permute_ps(v, kAll, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_mask_permute_ps(v, kAll, v, 0xB1));
    return _mm512_cvtss_f32(v);
  }
  static void StoreSums4(F32 a0, F32 a1, F32 a2, F32 a3, float* y) { _mm_storeu_ps(y, Sums4(a0, a1, a2, a3)); }
  // The horizontal sums of a0..a3, reduced together, in lanes 0..3.
  static __m128 Sums4(F32 a0, F32 a1, F32 a2, F32 a3) {
    // 128-bit lanes of p01: halves of a0 and a1 folded (a0, a0, a1, a1); same for p23.
    const __m512 p01 = _mm512_add_ps(_mm512_mask_shuffle_f32x4(a0, kAll, a0, a1, 0x44),
                                     _mm512_mask_shuffle_f32x4(a0, kAll, a0, a1, 0xEE));
    const __m512 p23 = _mm512_add_ps(_mm512_mask_shuffle_f32x4(a2, kAll, a2, a3, 0x44),
                                     _mm512_mask_shuffle_f32x4(a2, kAll, a2, a3, 0xEE));
    // 128-bit lane k of q: four partial sums of row k.
    __m512 q = _mm512_add_ps(_mm512_mask_shuffle_f32x4(p01, kAll, p01, p23, 0x88),
                             _mm512_mask_shuffle_f32x4(p01, kAll, p01, p23, 0xDD));
    q = _mm512_add_ps(q, _mm512_mask_permute_ps(q, kAll, q, 0x4E));
    q = _mm512_add_ps(q, _mm512_mask_permute_ps(q, kAll, q, 0xB1));
    // Element 4k holds row k's sum; gather elements 0, 4, 8, 12 to the front.
    const __m512i front = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps128(_mm512_mask_permutexvar_ps(q, kAll, front, q));
  }

  // Dword vectors, for transposes of 32-bit words.
  using I32 = __m512i;
  static I32 ZeroI32() { return _mm512_setzero_si512(); }
  static I32 LoadI32(const void* p) { return _mm512_loadu_si512(p); }
  static void StoreI32(void* p, I32 v) { _mm512_storeu_si512(p, v); }
  static I32 UnpackLo32(I32 a, I32 b) { return _mm512_unpacklo_epi32(a, b); }
  static I32 UnpackHi32(I32 a, I32 b) { return _mm512_unpackhi_epi32(a, b); }
  static I32 UnpackLo64(I32 a, I32 b) { return _mm512_unpacklo_epi64(a, b); }
  static I32 UnpackHi64(I32 a, I32 b) { return _mm512_unpackhi_epi64(a, b); }
  // The 4 x 4 matrix of 128-bit lanes transposed: out[l] lane m = in[m] lane l.
  static void TransposeLanes(const I32* in, I32* out) {
    const __m512i c0 = _mm512_shuffle_i32x4(in[0], in[1], 0x44), c1 = _mm512_shuffle_i32x4(in[2], in[3], 0x44);
    const __m512i c2 = _mm512_shuffle_i32x4(in[0], in[1], 0xee), c3 = _mm512_shuffle_i32x4(in[2], in[3], 0xee);
    out[0] = _mm512_shuffle_i32x4(c0, c1, 0x88);
    out[1] = _mm512_shuffle_i32x4(c0, c1, 0xdd);
    out[2] = _mm512_shuffle_i32x4(c2, c3, 0x88);
    out[3] = _mm512_shuffle_i32x4(c2, c3, 0xdd);
  }
};
#endif

}  // namespace
}  // namespace simd
}  // namespace tqkv

#endif  // TQKV_KERNELS_SIMD_SIMD_MAPPINGS_H_
