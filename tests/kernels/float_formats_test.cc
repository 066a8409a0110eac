#include "kernels/float_formats.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "base/random.h"

namespace tqkv {
namespace {

// Reference: GCC's _Float16 conversion rounds to nearest even.
uint16_t ReferenceHalf(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  memcpy(&bits, &h, 2);
  return bits;
}

TEST(Fp16, EveryHalfRoundTripsThroughFloatExactly) {
  for (uint32_t code = 0; code < 65536; ++code) {
    const uint16_t h = static_cast<uint16_t>(code);
    const float f = HalfToFloat(h);
    _Float16 ref;
    memcpy(&ref, &h, 2);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(ref)));
      continue;
    }
    ASSERT_EQ(FloatBits(f), FloatBits(static_cast<float>(ref))) << std::hex << code;
    ASSERT_EQ(FloatToHalf(f), h) << std::hex << code;
  }
}

TEST(Fp16, FloatToHalfRoundsToNearestEvenLikeTheCompiler) {
  Random rng(3);
  for (int i = 0; i < 2000000; ++i) {
    // Random bit patterns cover subnormals, overflow and ties.
    const float f = BitsToFloat(static_cast<uint32_t>(rng.NextU64()));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), ReferenceHalf(f)) << f;
  }
  // Exact ties between neighbouring halves.
  for (uint32_t code = 0; code < 0x7bff; ++code) {
    const float a = HalfToFloat(static_cast<uint16_t>(code));
    const float b = HalfToFloat(static_cast<uint16_t>(code + 1));
    const float mid = (a + b) * 0.5f;
    ASSERT_EQ(FloatToHalf(mid), ReferenceHalf(mid)) << mid;
  }
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(FloatToBf16(1.0f + 0x1.0p-8f), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1.8p-8f), 0x3f81);
  EXPECT_EQ(Bf16ToFloat(0x3f81), 1.0f + 0x1.0p-7f);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
}

// Reference fp8 E4M3: nearest finite code by exhaustive search, ties to the
// even code, saturating at 448.
uint8_t ReferenceFp8(float f) {
  const float magnitude = std::fabs(f);
  uint8_t best = 0;
  double best_error = std::numeric_limits<double>::infinity();
  for (int code = 0; code <= 0x7e; ++code) {
    const double error =
        std::fabs(static_cast<double>(Fp8E4m3ToFloat(static_cast<uint8_t>(code))) - static_cast<double>(magnitude));
    if (error < best_error || (error == best_error && (code & 1) == 0)) {
      best_error = error;
      best = static_cast<uint8_t>(code);
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(f) ? 0x80 : 0));
}

TEST(Fp8E4m3, DecodesKnownCodes) {
  EXPECT_EQ(Fp8E4m3ToFloat(0x00), 0.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x01), 0x1.0p-9f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x08), 0x1.0p-6f);
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0x7f)));
}

TEST(Fp8E4m3, EncodeMatchesExhaustiveNearestSearch) {
  Random rng(11);
  for (int i = 0; i < 200000; ++i) {
    const float f = static_cast<float>(rng.NextGaussian() * std::exp2(rng.NextDouble() * 24 - 14));
    ASSERT_EQ(FloatToFp8E4m3(f), ReferenceFp8(f)) << f;
  }
  // Every code and every midpoint between neighbours.
  for (int code = 0; code < 0x7e; ++code) {
    const float a = Fp8E4m3ToFloat(static_cast<uint8_t>(code));
    const float b = Fp8E4m3ToFloat(static_cast<uint8_t>(code + 1));
    ASSERT_EQ(FloatToFp8E4m3(a), code);
    ASSERT_EQ(FloatToFp8E4m3(-a), ReferenceFp8(-a));
    const float mid = (a + b) * 0.5f;
    ASSERT_EQ(FloatToFp8E4m3(mid), ReferenceFp8(mid)) << mid;
  }
}

TEST(Fp8E4m3, SaturatesInsteadOfOverflowing) {
  EXPECT_EQ(FloatToFp8E4m3(448.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4m3(470.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4m3(1e30f), 0x7e);
  EXPECT_EQ(FloatToFp8E4m3(-1e30f), 0xfe);
  EXPECT_EQ(FloatToFp8E4m3(std::numeric_limits<float>::infinity()), 0x7e);
}

TEST(Fp8E4m3, TableMatchesTheDecoder) {
  const float* table = Fp8E4m3Table();
  for (int code = 0; code < 256; ++code) {
    const float value = Fp8E4m3ToFloat(static_cast<uint8_t>(code));
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(table[code]));
    } else {
      EXPECT_EQ(table[code], value) << code;
    }
  }
}

}  // namespace
}  // namespace tqkv
