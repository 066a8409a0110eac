// Number formats of the stored cache: IEEE half (fp16), bfloat16 and fp8 E4M3
// ("e4m3fn": no infinities, max 448, one NaN pattern per sign). Conversions
// round to nearest even. Shared by the CPU backend and CUDA kernels.
#ifndef TQKV_KERNELS_FLOAT_FORMATS_H_
#define TQKV_KERNELS_FLOAT_FORMATS_H_

#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace tqkv {

TQKV_HOST_DEVICE uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

TQKV_HOST_DEVICE float BitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// float -> fp16, round to nearest even; overflow gives +-inf, NaN stays NaN.
TQKV_HOST_DEVICE uint16_t FloatToHalf(float value) {
  uint32_t u = FloatBits(value);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint16_t out;
  if (u >= 0x47800000u) {  // >= 65536 (inf after rounding), inf or NaN
    out = (u > 0x7f800000u) ? 0x7e00u : 0x7c00u;
  } else if (u < 0x38800000u) {  // below 2^-14: half subnormal or zero
    // Adding 0.5 aligns the half subnormal's bits at the bottom of the float
    // mantissa and rounds them to nearest even in the FPU.
    const float shifted = BitsToFloat(u) + 0.5f;
    out = static_cast<uint16_t>(FloatBits(shifted) - 0x3f000000u);
  } else {
    const uint32_t mantissa_odd = (u >> 13) & 1u;
    u += 0xc8000fffu + mantissa_odd;  // rebias exponent (-112 << 23) and round
    out = static_cast<uint16_t>(u >> 13);
  }
  return static_cast<uint16_t>(out | sign);
}

TQKV_HOST_DEVICE float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// float -> bfloat16, round to nearest even; NaN stays NaN.
TQKV_HOST_DEVICE uint16_t FloatToBf16(float value) {
  const uint32_t u = FloatBits(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

TQKV_HOST_DEVICE float Bf16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

inline constexpr float kFp8E4m3Max = 448.0f;

// float -> fp8 E4M3, round to nearest even, saturating: |x| >= 448 (and +-inf)
// become +-448. NaN becomes the NaN pattern 0x7f (callers reject NaN first).
TQKV_HOST_DEVICE uint8_t FloatToFp8E4m3(float value) {
  uint32_t u = FloatBits(value);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return 0x7f;
  if (u >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7e);  // >= 448
  uint8_t out;
  if (u < 0x3c800000u) {  // below 2^-6: subnormal, steps of 2^-9
    // Adding 2^-9 * 2^23 = 2^14 aligns the 3 subnormal bits at the bottom of the
    // mantissa; the FPU rounds to nearest even. 0x46800000 is 16384.0f.
    const float shifted = BitsToFloat(u) + 16384.0f;
    out = static_cast<uint8_t>(FloatBits(shifted) - 0x46800000u);
  } else {
    const uint32_t mantissa_odd = (u >> 20) & 1u;
    u += 0xc407ffffu + mantissa_odd;  // rebias exponent (-120 << 23) and round
    const uint32_t code = u >> 20;
    out = static_cast<uint8_t>(code > 0x7eu ? 0x7eu : code);  // 464..<480 rounds to 480: saturate
  }
  return static_cast<uint8_t>(out | sign);
}

TQKV_HOST_DEVICE float Fp8E4m3ToFloat(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xf && mantissa == 0x7) return BitsToFloat(sign | 0x7fc00000u);
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // 2^-9
    return sign ? -magnitude : magnitude;
  }
  return BitsToFloat(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

// Decoded value of every fp8 E4M3 code, for table-driven decoding.
const float* Fp8E4m3Table();

// Bulk conversions between floats and little-endian 16-bit bytes (the wire
// form of f16 / bf16 tensors), element by element as FloatToHalf /
// FloatToBf16 / HalfToFloat / Bf16ToFloat; one loop per format, which the
// compiler vectorizes. `bf16` picks bfloat16, else IEEE half.
// Inline: the clients use them without linking the codec library.
inline void FloatsToHalfBytes(const float* x, size_t n, bool bf16, char* out) {
  if (bf16) {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t v = FloatToBf16(x[i]);
      memcpy(out + 2 * i, &v, 2);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t v = FloatToHalf(x[i]);
      memcpy(out + 2 * i, &v, 2);
    }
  }
}

inline void HalfBytesToFloats(const char* bytes, size_t n, bool bf16, float* out) {
  if (bf16) {
    for (size_t i = 0; i < n; ++i) {
      uint16_t v;
      memcpy(&v, bytes + 2 * i, 2);
      out[i] = Bf16ToFloat(v);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      uint16_t v;
      memcpy(&v, bytes + 2 * i, 2);
      out[i] = HalfToFloat(v);
    }
  }
}

// Largest finite fp16 value.
inline constexpr float kHalfMax = 65504.0f;

// Whether every one of n floats is finite (no NaN, no infinity): one
// branch-free pass at the widest vectors the CPU has (the build's baseline
// is SSE4.2; this runs at AVX-512 or AVX2 where present).
bool AllFinite(const float* x, size_t n);

}  // namespace tqkv

#endif  // TQKV_KERNELS_FLOAT_FORMATS_H_
