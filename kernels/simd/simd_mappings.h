// One instruction set's float (and dword) vectors behind one small interface, so that a
// kernel body is written once, as a template on the mapping, and compiled in
// each ISA's source file with that ISA's flags: the Hadamard kernels
// (hadamard_body.h in hadamard_avx2.cc, hadamard_avx512.cc), the fused float
// attention kernel (kernels/cpu/attend_body.h in attend_avx2.cc,
// attend_avx512.cc; its exp and soft cap in simd_math.h). A mapping is
// defined only where the compiler targets its ISA; the operations a body
// needs beyond arithmetic (lane masks, horizontal reductions, the attention
// kernel's code-unpacking loads) say here what they compute, and each ISA
// picks its own instructions and, where a body allows it (the *Position
// functions), its own lane order.
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

  // --- What the fused float attention kernel (kernels/cpu/attend_body.h) adds.
  static F32 Max(F32 a, F32 b) { return _mm256_max_ps(a, b); }
  static F32 Div(F32 a, F32 b) { return _mm256_div_ps(a, b); }
  static F32 Fnmadd(F32 a, F32 b, F32 c) { return _mm256_fnmadd_ps(a, b, c); }
  static F32 Fmsub(F32 a, F32 b, F32 c) { return _mm256_fmsub_ps(a, b, c); }
  static F32 Abs(F32 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
  // |magnitude| with the sign of `sign` (magnitude's own sign bit clear).
  static F32 WithSignOf(F32 magnitude, F32 sign) {
    return _mm256_or_ps(magnitude, _mm256_and_ps(sign, _mm256_set1_ps(-0.0f)));
  }
  static F32 RoundNearest(F32 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // v * 2^n for an integral n in [-126, 127]: n straight into the exponent field.
  static F32 Pow2Scale(F32 v, F32 n) {
    return _mm256_mul_ps(
        v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
  }
  static float ReduceMax(F32 v) {
    const __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 y = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(y, _mm_movehdup_ps(y)));
  }
  // Lane t of the result is the sum of v[t]'s lanes: a transpose-add, 14
  // shuffles and 7 adds instead of 8 full reductions.
  static F32 SumEach(const F32 v[kLanes]) {
    __m256 a[4], b[2];
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    for (int i = 0; i < 2; ++i) {
      b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                           _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xee));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
  }

  // Lane masks: lanes [begin, end) for 0 <= begin <= end <= kLanes; lane i
  // where bit i of `bits` is set; lanes where a != b (ordered).
  static Mask RangeMask(int begin, int end) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(end), lane),
                            _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(begin - 1)));
  }
  static Mask LaneBits(unsigned bits) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane), lane);
  }
  static Mask NotEqual(F32 a, F32 b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_NEQ_OQ)); }
  // m ? a : b, lane by lane; m ? v : 0.
  static F32 Select(Mask m, F32 a, F32 b) { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(m)); }
  static F32 MaskZero(Mask m, F32 v) { return _mm256_and_ps(_mm256_castsi256_ps(m), v); }

#if defined(__F16C__)
  // The code-unpacking loads: 16 coordinates (one block) of a vector as
  // kBlockVectors registers, coordinate j at lane *Position(j) of them.
  static constexpr int kBlockVectors = 2;
  // 32 bytes of bf16. A bf16 is the top half of a float: even coordinates
  // shift up, odd ones need only their low half cleared.
  static int Bf16Position(int j) { return (j % 2) * 8 + j / 2; }
  static void Bf16x16(const uint8_t* p, F32* v) {
    const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
    v[1] = _mm256_castsi256_ps(_mm256_and_si256(both, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  // 32 bytes of IEEE halves, in order.
  static void Fp16x16(const uint8_t* p, F32* v) {
    v[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  // 16 fp8 E4M3 bytes, in order, each 2^-8 times its value: binary16 bits
  // with the sign at bit 15 and exponent and mantissa at bits 13-7 (x << 8,
  // an arithmetic shift right by one, a mask), subnormals included, widened
  // exactly.
  static void Fp8x16(const uint8_t* p, F32* v) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i half =
        _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1), _mm256_set1_epi16(static_cast<short>(0xbf80)));
    v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
    v[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
  }
  // 16 unsigned bytes, in order.
  static void U8x16(const uint8_t* p, F32* v) {
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
  // kBits-bit codes (2-4), 16 a block in 2 * kBits bytes, through a table of
  // their values (CodeTable): vpermps reads index bits [2:0], so with the 2^b
  // entries repeated over 8 the next code's bits above a code do not matter
  // and codes need no mask; 4-bit codes take a second table (or, with
  // kCodeValues, where each code's value is itself, a conversion).
  struct CodeTable {
    __m256 low, high;
    __m256i shift[2];
  };
  static int CodePosition(int j) { return j; }
  // entries[i]: the value of code i % 2^kBits, i < 16.
  template <int kBits>
  static CodeTable MakeCodeTable(const float* entries) {
    CodeTable t;
    t.low = _mm256_loadu_ps(entries);
    t.high = _mm256_loadu_ps(entries + 8);
    // Code 8h + j of the block sits at bit shift[h][j] of the dword vector h reads.
    alignas(32) int shift[2][8];
    for (int j = 0; j < 8; ++j) {
      shift[0][j] = kBits * j;
      shift[1][j] = kBits * j + (kBits == 2 ? 16 : kBits == 3 ? 8 : 0);
    }
    t.shift[0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift[0]));
    t.shift[1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift[1]));
    return t;
  }
  // The block at p: 8 codes take kBits bytes; the second dword is placed so
  // that neither read leaves the block's 2 * kBits bytes.
  template <int kBits, bool kCodeValues>
  static void Codes(const CodeTable& t, const uint8_t* p, F32* v) {
    v[0] = Lookup<kBits, kCodeValues>(t, _mm256_srlv_epi32(_mm256_set1_epi32(LoadWord(p)), t.shift[0]));
    v[1] = Lookup<kBits, kCodeValues>(t, _mm256_srlv_epi32(_mm256_set1_epi32(LoadWord(p + (kBits == 2   ? 0
                                                                                           : kBits == 3 ? 2
                                                                                                        : 4))),
                                                           t.shift[1]));
  }
  template <int kBits, bool kCodeValues>
  static F32 Lookup(const CodeTable& t, __m256i index) {
    if constexpr (kBits == 4 && !kCodeValues) {
      // Bit 3 of the code, moved to the sign bit, picks the table.
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.low, index), _mm256_permutevar8x32_ps(t.high, index),
                              _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
    } else if constexpr (kBits == 4) {
      return _mm256_cvtepi32_ps(_mm256_and_si256(index, _mm256_set1_epi32(15)));
    } else {
      return _mm256_permutevar8x32_ps(t.low, index);
    }
  }
  // kLanes pairs [a, b] of binary16 at p -> a[0, kLanes) and b[0, kLanes).
  static void StoreHalfPairs(const uint8_t* p, float* a, float* b) {
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    // shuffle_ps leaves tokens in the order 0 1 4 5 2 3 6 7.
    _mm256_storeu_ps(a,
                     _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xd8)));
    _mm256_storeu_ps(b,
                     _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd)), 0xd8)));
  }
#endif
  static int LoadWord(const uint8_t* p) {
    int v;
    __builtin_memcpy(&v, p, sizeof(v));
    return v;
  }

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

  // --- What the fused float attention kernel (kernels/cpu/attend_body.h) and
  // the integer one (integer_attend.h) add. Float bit operations go through
  // integer casts: the float forms need AVX-512 DQ.
  static F32 Max(F32 a, F32 b) { return _mm512_max_ps(a, b); }
  static F32 Div(F32 a, F32 b) { return _mm512_div_ps(a, b); }
  static F32 Fnmadd(F32 a, F32 b, F32 c) { return _mm512_fnmadd_ps(a, b, c); }
  static F32 Fmsub(F32 a, F32 b, F32 c) { return _mm512_fmsub_ps(a, b, c); }
  static F32 Abs(F32 v) { return _mm512_abs_ps(v); }
  static F32 WithSignOf(F32 magnitude, F32 sign) {
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(magnitude),
                        _mm512_and_si512(_mm512_castps_si512(sign), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));
  }
  static F32 RoundNearest(F32 v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F32 Pow2Scale(F32 v, F32 n) { return _mm512_scalef_ps(v, n); }
  static float ReduceMax(F32 v) {
    const __m256 a =
        _mm256_max_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_max_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_max_ss(c, _mm_movehdup_ps(c)));
  }
  // Lane t of the result is the sum of v[t]'s lanes: a transpose-add in 30
  // shuffles and 15 adds.
  static F32 SumEach(const F32 v[kLanes]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i) {
      a[i] = _mm512_add_ps(_mm512_mask_unpacklo_ps(v[2 * i], kAll, v[2 * i], v[2 * i + 1]),
                           _mm512_mask_unpackhi_ps(v[2 * i], kAll, v[2 * i], v[2 * i + 1]));
    }
    // 128-bit lane k of b[i]: v[4i .. 4i + 3]'s sums over their lane k.
    for (int i = 0; i < 4; ++i) {
      b[i] = _mm512_add_ps(_mm512_mask_shuffle_ps(a[2 * i], kAll, a[2 * i], a[2 * i + 1], 0x44),
                           _mm512_mask_shuffle_ps(a[2 * i], kAll, a[2 * i], a[2 * i + 1], 0xee));
    }
    for (int i = 0; i < 2; ++i) {
      c[i] = _mm512_add_ps(_mm512_mask_shuffle_f32x4(b[2 * i], kAll, b[2 * i], b[2 * i + 1], 0x88),
                           _mm512_mask_shuffle_f32x4(b[2 * i], kAll, b[2 * i], b[2 * i + 1], 0xdd));
    }
    return _mm512_add_ps(_mm512_mask_shuffle_f32x4(c[0], kAll, c[0], c[1], 0x88),
                         _mm512_mask_shuffle_f32x4(c[0], kAll, c[0], c[1], 0xdd));
  }

  static Mask RangeMask(int begin, int end) {
    return static_cast<__mmask16>(((1u << end) - 1u) & ~((1u << begin) - 1u));
  }
  static Mask LaneBits(unsigned bits) { return static_cast<__mmask16>(bits); }
  static Mask NotEqual(F32 a, F32 b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
  static F32 Select(Mask m, F32 a, F32 b) { return _mm512_mask_mov_ps(b, m, a); }
  static F32 MaskZero(Mask m, F32 v) { return _mm512_maskz_mov_ps(m, v); }

  // The code-unpacking loads (Avx2's say what each reads): one register a
  // block, in order but for packed codes.
  static constexpr int kBlockVectors = 1;
  static int Bf16Position(int j) { return j; }
  static void Bf16x16(const uint8_t* p, F32* v) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static void Fp16x16(const uint8_t* p, F32* v) { v[0] = LoadHalves(reinterpret_cast<const uint16_t*>(p)); }
  static void Fp8x16(const uint8_t* p, F32* v) {
    const __m256i x = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
    v[0] = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(x, 1), _mm256_set1_epi16(static_cast<short>(0xbf80))));
  }
  static void U8x16(const uint8_t* p, F32* v) {
    v[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // Packed codes: lanes 2j and 2j + 1 hold codes j and j + 8, shifted out of
  // one broadcast qword whose low dword holds codes 0-7 and whose high dword
  // codes 8-15 (read as Avx2 reads them, inside the block's 2 * kBits
  // bytes); vpermps reads index bits [3:0], a 16-entry table, no mask.
  struct CodeTable {
    __m512 table;
    __m512i shift;
  };
  static int CodePosition(int j) { return j < 8 ? 2 * j : 2 * (j - 8) + 1; }
  template <int kBits>
  static CodeTable MakeCodeTable(const float* entries) {
    CodeTable t;
    t.table = _mm512_loadu_ps(entries);
    alignas(64) int shift[16];
    for (int j = 0; j < 8; ++j) {
      shift[2 * j] = kBits * j;
      shift[2 * j + 1] = kBits * j + (kBits == 2 ? 16 : kBits == 3 ? 8 : 0);
    }
    t.shift = _mm512_load_si512(shift);
    return t;
  }
  template <int kBits, bool kCodeValues>
  static void Codes(const CodeTable& t, const uint8_t* p, F32* v) {
    __m512i words;
    if constexpr (kBits == 2) {
      words = _mm512_set1_epi32(LoadWord(p));
    } else if constexpr (kBits == 4) {
      long long q;
      __builtin_memcpy(&q, p, sizeof(q));
      words = _mm512_set1_epi64(q);
    } else {
      const uint64_t lo = static_cast<uint32_t>(LoadWord(p)), hi = static_cast<uint32_t>(LoadWord(p + 2));
      words = _mm512_set1_epi64(static_cast<long long>(lo | hi << 32));
    }
    v[0] = _mm512_mask_permutexvar_ps(t.table, kAll, _mm512_srlv_epi32(words, t.shift), t.table);
  }
  static void StoreHalfPairs(const uint8_t* p, float* a, float* b) {
    const __m512 lo = LoadHalves(reinterpret_cast<const uint16_t*>(p));
    const __m512 hi = LoadHalves(reinterpret_cast<const uint16_t*>(p + 32));
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    _mm512_storeu_ps(a, _mm512_mask_permutex2var_ps(lo, kAll, even, hi));
    _mm512_storeu_ps(b, _mm512_mask_permutex2var_ps(lo, kAll, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi));
  }
  static int LoadWord(const uint8_t* p) {
    int v;
    __builtin_memcpy(&v, p, sizeof(v));
    return v;
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
