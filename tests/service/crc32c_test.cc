#include "service/crc32c.h"

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tqkv {
namespace {

TEST(Crc32c, KnownValues) {
  // The check value of CRC-32C (RFC 3720, and every CRC catalogue).
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cPortable(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c(0, "", 0), 0u);
  // 32 bytes of zeros (RFC 3720, B.4).
  const std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(0, zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(Crc32c, TheFastPathEqualsTheTableAtEverySizeAndSplit) {
  std::mt19937 rng(1);
  std::vector<uint8_t> data(3 * 65536 + 123);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  for (size_t size : {size_t{0}, size_t{7}, size_t{8}, size_t{4095}, size_t{3 * 4096}, size_t{3 * 4096 + 5},
                      size_t{50000}, data.size()}) {
    EXPECT_EQ(Crc32c(0, data.data(), size), Crc32cPortable(0, data.data(), size)) << size;
    // Continuing from a state: Crc32c(a then b) == Crc32c(Crc32c(a), b).
    const size_t cut = size / 3;
    EXPECT_EQ(Crc32c(Crc32c(0, data.data(), cut), data.data() + cut, size - cut), Crc32cPortable(0, data.data(), size))
        << size;
  }
}

}  // namespace
}  // namespace tqkv
