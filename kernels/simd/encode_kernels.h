// Internal to the codecs: the SIMD kernels of the store path (VectorCodec::
// Encode), AVX-512 (kernels/cpu/encode_avx512.cc) and AVX2
// (kernels/cpu/encode_avx2.cc), reached from codec.cc, codebook.cc and
// bitpack.cc through ActiveEncodeKernels(). Every kernel returns exactly the
// bytes / floats of the portable code it replaces (same float operations, no
// FMA), so the stored format does not depend on the SIMD level.
#ifndef TQKV_KERNELS_SIMD_ENCODE_KERNELS_H_
#define TQKV_KERNELS_SIMD_ENCODE_KERNELS_H_

#include <cstdint>

namespace tqkv {
namespace encode_internal {

// What QuantizePack needs of one codebook, built once with the codec
// (MakeQuantizeTables) rather than on every call: the search's step tables
// and the squared centroids, as AVX-512 registers load them.
struct QuantizeTables {
  const float* boundaries = nullptr;  // 2^bits - 1 ascending
  const float* centroids = nullptr;   // 2^bits; nullptr: no codeword sum
  int bits = 0;
  // The search for 2-4 bits: the first step compares with first_bound
  // (boundaries[first - 1]); later step k (of `later`, step s = first >> (k +
  // 1)) looks up boundaries[level + s - 1] as shifted[k][level].
  int first = 0;
  int later = 0;
  float first_bound = 0.0f;
  alignas(64) float shifted[3][16] = {};
  alignas(64) float squares[16] = {};  // centroids[k]^2, zero past 2^bits
};

// The tables of a codebook of `bits` bits; `centroids` may be nullptr (no
// codeword sum). The arrays must outlive the tables.
QuantizeTables MakeQuantizeTables(const float* boundaries, const float* centroids, int bits);

// One ISA's store kernels; each has the contract of the AVX-512 function of
// the same name below.
struct EncodeKernels {
  const char* isa;
  bool (*all_finite_within)(const float* x, int n, float limit);
  void (*scale)(const float* x, int n, float s, float* y);
  void (*quantize_to_levels)(const float* boundaries, int bits, const float* y, int n, uint8_t* levels);
  void (*pack_bits)(const uint8_t* codes, int n, int bits, uint8_t* out);
  void (*float_to_half)(const float* x, int n, uint8_t* out);
  void (*float_to_bf16)(const float* x, int n, uint8_t* out);
  void (*float_to_fp8)(const float* x, int n, uint8_t* out);
  void (*min_max)(const float* x, int n, float* lo, float* hi);
  void (*uniform_levels)(const float* x, int n, float zero, float inv_scale, int max_code, uint8_t* levels);
  bool (*sum_of_squares)(const float* x, int n, double* sum);
  float (*codeword_sum)(const float* centroids, int bits, const uint8_t* levels, int n);
  float (*quantize_pack)(const QuantizeTables& tables, const float* y, int n, uint8_t* codes);
  // nullptr where the set has no fused kernel: the caller rotates, then
  // calls quantize_pack.
  float (*rotate_quantize_pack)(const float* x, float inv_norm, const float* pre_signs, int n,
                                const QuantizeTables& tables, uint8_t* codes);
  bool (*uniform_range)(const float* x, int n, float* lo, float* hi);
  void (*uniform_pack)(const float* x, int n, float zero, float inv_scale, int bits, uint8_t* codes);
};

// The longest vector (or TurboQuant part) the store kernels take: kMaxHeadDim.
inline constexpr int kMaxEncodeDim = 512;

// The widest set that ActiveSimdLevel() allows and the CPU runs (both need
// BMI2, for bit packing), or nullptr: the portable code.
const EncodeKernels* ActiveEncodeKernels();

// All n floats finite and |x[i]| <= limit (limit = +inf: finite only).
bool AllFiniteWithinAvx512(const float* x, int n, float limit);
// y[i] = x[i] * s.
void ScaleAvx512(const float* x, int n, float s, float* y);
// levels[i] = #{boundaries < y[i]} for a codebook of `bits` bits (2^bits - 1
// ascending boundaries).
void QuantizeToLevelsAvx512(const float* boundaries, int bits, const float* y, int n, uint8_t* levels);
// PackBits (bitpack.h) for 1 <= bits <= 8, with BMI2's pext (the AVX2 file
// holds it; both sets use it).
void PackBitsBmi2(const uint8_t* codes, int n, int bits, uint8_t* out);
// The same with AVX-512 BW shuffles for 2-4 bits, 64 codes per step
// (PackBitsBmi2 for other widths).
void PackBitsAvx512(const uint8_t* codes, int n, int bits, uint8_t* out);
// Little-endian 16-bit / 8-bit codes of FloatToHalf, FloatToBf16,
// FloatToFp8E4m3 (float_formats.h) for finite inputs.
void FloatToHalfAvx512(const float* x, int n, uint8_t* out);
void FloatToBf16Avx512(const float* x, int n, uint8_t* out);
void FloatToFp8E4m3Avx512(const float* x, int n, uint8_t* out);
// Uniform codec: lo = min, hi = max as the sequential std::min / std::max
// loop finds them (including which zero, -0 or +0, it keeps).
void MinMaxAvx512(const float* x, int n, float* lo, float* hi);
// levels[i] = clamp(floor((x[i] - zero) * inv_scale + 0.5f), 0, max_code).
void UniformLevelsAvx512(const float* x, int n, float zero, float inv_scale, int max_code, uint8_t* levels);

// The two sums of the stored scale, in the blocked order of
// kernels/blocked_sums.h: *sum = sum over i of (double)x[i] * x[i] (the
// squared norm; returns whether it is finite, i.e. every x[i] is), and the
// sum over i of c * c in float, c = centroids[levels[i]] (the codeword's
// squared norm, for norm correction).
bool SumOfSquaresAvx512(const float* x, int n, double* sum);
float CodewordSumAvx512(const float* centroids, int bits, const uint8_t* levels, int n);
bool SumOfSquaresAvx2(const float* x, int n, double* sum);
// One TurboQuant part's codes: levels of y (QuantizeToLevels) for the
// tables' codebook, packed (PackBits) into codes; returns their codeword sum
// (above) when tables.centroids is not null, else 0. REQUIRES: n <=
// kMaxEncodeDim.
float QuantizePackAvx512(const QuantizeTables& tables, const float* y, int n, uint8_t* codes);
float QuantizePackAvx2(const QuantizeTables& tables, const float* y, int n, uint8_t* codes);
// The whole store of one TurboQuant vector after its norm, in registers: y =
// SignedFwht(x * inv_norm, n, pre_signs, no post signs) as rotation.h's
// randomized (or plain, pre_signs null) Hadamard of a power-of-two n
// computes it, then QuantizePackAvx512(tables, y, n, codes): the same bytes
// and codeword sum as those calls. REQUIRES: CanRotateQuantizePack(n, bits).
float RotateQuantizePackAvx512(const float* x, float inv_norm, const float* pre_signs, int n,
                               const QuantizeTables& tables, uint8_t* codes);
// The same at 8 lanes (the pack through BMI2's pext).
float RotateQuantizePackAvx2(const float* x, float inv_norm, const float* pre_signs, int n,
                             const QuantizeTables& tables, uint8_t* codes);
// The vectors RotateQuantizePackAvx512 and RotateQuantizePackAvx2 take: n in
// {16, 32, 64, 128, 256} (the transform in at most 16 AVX-512 or 32 AVX2
// registers, the compiler spilling what does not fit), 2 <= bits <= 4.
constexpr bool CanRotateQuantizePack(int n, int bits) {
  return (n == 16 || n == 32 || n == 64 || n == 128 || n == 256) && bits >= 2 && bits <= 4;
}
// The uniform codec's two passes. UniformRange: false when a coordinate is
// not finite or beyond kHalfMax (the codec then finds which), else min and
// max as MinMax. UniformPack: UniformLevels with max_code 2^bits - 1, then
// PackBits. REQUIRES: n <= kMaxEncodeDim.
bool UniformRangeAvx512(const float* x, int n, float* lo, float* hi);
void UniformPackAvx512(const float* x, int n, float zero, float inv_scale, int bits, uint8_t* codes);
bool UniformRangeAvx2(const float* x, int n, float* lo, float* hi);
void UniformPackAvx2(const float* x, int n, float zero, float inv_scale, int bits, uint8_t* codes);
float CodewordSumAvx2(const float* centroids, int bits, const uint8_t* levels, int n);

// The same at 8 lanes (AVX2, F16C); the tail in the portable expressions.
bool AllFiniteWithinAvx2(const float* x, int n, float limit);
void ScaleAvx2(const float* x, int n, float s, float* y);
void QuantizeToLevelsAvx2(const float* boundaries, int bits, const float* y, int n, uint8_t* levels);
void FloatToHalfAvx2(const float* x, int n, uint8_t* out);
void FloatToBf16Avx2(const float* x, int n, uint8_t* out);
void FloatToFp8E4m3Avx2(const float* x, int n, uint8_t* out);
void MinMaxAvx2(const float* x, int n, float* lo, float* hi);
void UniformLevelsAvx2(const float* x, int n, float zero, float inv_scale, int max_code, uint8_t* levels);

}  // namespace encode_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_SIMD_ENCODE_KERNELS_H_
