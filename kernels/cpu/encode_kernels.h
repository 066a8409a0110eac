// Internal to the codecs: AVX-512 kernels of the store path (VectorCodec::
// Encode), defined in kernels/encode_avx512.cc and dispatched to from
// codec.cc, codebook.cc and bitpack.cc on ActiveSimdLevel() (and
// EncodeAvx512Usable()). Every kernel returns exactly the bytes / floats of
// the portable code it replaces (same float operations, no FMA), so the
// stored format does not depend on the SIMD level.
#ifndef TQKV_KERNELS_CPU_ENCODE_KERNELS_H_
#define TQKV_KERNELS_CPU_ENCODE_KERNELS_H_

#include <cstdint>

namespace tqkv {
namespace encode_internal {

// Whether the AVX-512 store kernels may run: ActiveSimdLevel() is kAvx512 and
// the CPU has BMI2 (used for bit packing).
bool EncodeAvx512Usable();

// All n floats finite and |x[i]| <= limit (limit = +inf: finite only).
bool AllFiniteWithinAvx512(const float* x, int n, float limit);
// y[i] = x[i] * s.
void ScaleAvx512(const float* x, int n, float s, float* y);
// levels[i] = #{boundaries < y[i]} for a codebook of `bits` bits (2^bits - 1
// ascending boundaries).
void QuantizeToLevelsAvx512(const float* boundaries, int bits, const float* y, int n,
                            uint8_t* levels);
// PackBits (bitpack.h) for 1 <= bits <= 8.
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
void UniformLevelsAvx512(const float* x, int n, float zero, float inv_scale, int max_code,
                         uint8_t* levels);

}  // namespace encode_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_ENCODE_KERNELS_H_
