#include "kernels/bitpack.h"

#include <vector>

#include "gtest/gtest.h"
#include "base/random.h"

namespace tqkv {
namespace {

const int kHeadDims[] = {32, 64, 80, 96, 112, 128, 160, 192, 256, 512};

TEST(BitPack, PackThenUnpackIsIdentityForEveryWidthAndHeadDim) {
  Random rng(7);
  for (int bits : {1, 2, 3, 4, 5, 6, 7, 8}) {
    for (int n : kHeadDims) {
      std::vector<uint8_t> codes(n);
      for (auto& c : codes) c = static_cast<uint8_t>(rng.NextBelow(1u << bits));
      std::vector<uint8_t> packed(PackedBytes(n, bits) + 1, 0xAB);
      PackBits(codes.data(), n, bits, packed.data());
      EXPECT_EQ(packed.back(), 0xAB) << "wrote past PackedBytes, bits=" << bits << " n=" << n;
      std::vector<uint8_t> unpacked(n);
      UnpackBits(packed.data(), n, bits, unpacked.data());
      EXPECT_EQ(unpacked, codes) << "bits=" << bits << " n=" << n;
      for (int j = 0; j < n; ++j) {
        ASSERT_EQ(PackedCodeAt(packed.data(), j, bits), codes[j]) << "bits=" << bits << " j=" << j;
      }
    }
  }
}

TEST(BitPack, PackedBytesRoundsUpToWholeBytes) {
  EXPECT_EQ(PackedBytes(128, 3), 48);
  EXPECT_EQ(PackedBytes(128, 4), 64);
  EXPECT_EQ(PackedBytes(80, 3), 30);
  EXPECT_EQ(PackedBytes(3, 3), 2);
  EXPECT_EQ(PackedBytes(1, 1), 1);
  EXPECT_EQ(PackedBytes(0, 4), 0);
}

TEST(BitPack, FourBitCodesPutTheEvenCoordinateInTheLowNibble) {
  const uint8_t codes[4] = {0x1, 0x2, 0xA, 0xF};
  uint8_t packed[2];
  PackBits(codes, 4, 4, packed);
  EXPECT_EQ(packed[0], 0x21);
  EXPECT_EQ(packed[1], 0xFA);
}

TEST(BitPack, ThreeBitCodesFormAnLsbFirstStreamAcrossBytes) {
  // Codes 1..8 masked to 3 bits: 1,2,3,4,5,6,7,0 -> bit j*3 holds code j.
  const uint8_t codes[8] = {1, 2, 3, 4, 5, 6, 7, 0};
  uint8_t packed[3];
  PackBits(codes, 8, 3, packed);
  uint32_t stream = packed[0] | (packed[1] << 8) | (packed[2] << 16);
  for (int j = 0; j < 8; ++j) EXPECT_EQ((stream >> (3 * j)) & 7u, codes[j]) << j;
  EXPECT_EQ(packed[0], 0xD1);  // 001 | 010 << 3 | (011 & 0b11) << 6
}

TEST(BitPack, HighBitsBeyondTheWidthAreIgnored) {
  const uint8_t codes[2] = {0xFF, 0xF0};
  uint8_t packed[1];
  PackBits(codes, 2, 2, packed);
  EXPECT_EQ(packed[0], 0x03);
}

TEST(BitPack, PaddingBitsOfTheLastByteAreZero) {
  const uint8_t codes[3] = {7, 7, 7};
  uint8_t packed[2] = {0xFF, 0xFF};
  PackBits(codes, 3, 3, packed);
  EXPECT_EQ(packed[1], 0x01);  // 9 bits used: bit 8 set, bits 9..15 zero
}

}  // namespace
}  // namespace tqkv
