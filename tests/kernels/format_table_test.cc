// The shared format table (kernels/format_table.h): its enumerators, lookups
// and visitors agree with its rows.
#include "kernels/format_table.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace tqkv {
namespace {

static_assert(kNumFormatFamilies == 5, "a new family: check every backend's readers");
static_assert(PairInfo(FormatPair::kTurboQuantUniform).key == FormatFamily::kTurboQuant);

TEST(FormatTable, RowsAreIndexedByTheirEnumerators) {
  for (int i = 0; i < kNumFormatFamilies; ++i) EXPECT_EQ(static_cast<int>(kFormatFamilies[i].family), i);
  std::set<std::pair<FormatFamily, FormatFamily>> seen;
  std::set<std::string> names;
  for (int i = 0; i < kNumFormatPairs; ++i) {
    const FormatPairInfo& info = kFormatPairs[i];
    EXPECT_EQ(static_cast<int>(info.pair), i);
    EXPECT_TRUE(seen.insert({info.key, info.value}).second) << info.name << " is listed twice";
    EXPECT_TRUE(names.insert(info.name).second) << info.name;
    EXPECT_TRUE(FamilyInfo(info.key).reads_keys) << info.name << ": its key family holds no keys";
    FormatPair found;
    ASSERT_TRUE(FindFormatPair(info.key, info.value, &found)) << info.name;
    EXPECT_EQ(found, info.pair);
  }
  FormatPair none;
  EXPECT_FALSE(FindFormatPair(FormatFamily::kUniform, FormatFamily::kUniform, &none));
  EXPECT_FALSE(FindFormatPair(FormatFamily::kUniform, FormatFamily::kFp16, &none));
}

TEST(FormatTable, WidthsAndBackendsColumns) {
  for (const FormatPairInfo& info : kFormatPairs) {
    EXPECT_NE(info.fused_on & kFusedCpu, 0u) << info.name << ": the CPU reads every pair";
    if (info.tensor_cores) {
      EXPECT_NE(info.fused_on & kFusedCuda, 0u) << info.name;
    }
  }
  EXPECT_TRUE(FamilyHasBits(FormatFamily::kUniform, 8));
  EXPECT_FALSE(FamilyHasBits(FormatFamily::kTurboQuant, 8));
  EXPECT_FALSE(FamilyHasBits(FormatFamily::kTurboQuant, 43));
  EXPECT_TRUE(KeyFamilyHasBits(FormatFamily::kTurboQuant, SplitKeyBits(4, 3)));
  EXPECT_FALSE(KeyFamilyHasBits(FormatFamily::kTurboQuant, SplitKeyBits(2, 2)));
  EXPECT_FALSE(KeyFamilyHasBits(FormatFamily::kFp16, SplitKeyBits(4, 3)));
  EXPECT_FALSE(KeyFamilyHasBits(FormatFamily::kUniform, 4)) << "uniform codes hold no keys";
  EXPECT_TRUE(IsSplitKeyBits(SplitKeyBits(3, 2)));
  EXPECT_FALSE(IsSplitKeyBits(16));
}

TEST(FormatTable, VisitorsHandTheRowsOverAsConstants) {
  for (const FormatPairInfo& info : kFormatPairs) {
    const int got = VisitFormatPair(info.pair, -1, [](auto tag) {
      using Tag = decltype(tag);
      return static_cast<int>(Tag::kKey) * 1000 + static_cast<int>(Tag::kValue) * 100 + (Tag::kTensorCores ? 10 : 0) +
             static_cast<int>(Tag::kFusedOn);
    });
    EXPECT_EQ(got, static_cast<int>(info.key) * 1000 + static_cast<int>(info.value) * 100 +
                       (info.tensor_cores ? 10 : 0) + static_cast<int>(info.fused_on))
        << info.name;
  }
  EXPECT_EQ(VisitFormatPair(static_cast<FormatPair>(kNumFormatPairs), -1, [](auto) { return 0; }), -1);
  for (const FormatFamilyInfo& info : kFormatFamilies) {
    const int got = VisitKeyFamily(info.family, -1, [](auto tag) { return static_cast<int>(decltype(tag)::kFormat); });
    EXPECT_EQ(got, info.reads_keys ? static_cast<int>(info.family) : -1) << info.name;
  }
  EXPECT_EQ(FamilyInfo(FormatFamily::kUniform).code_bits,
            FormatBits(2) | FormatBits(3) | FormatBits(4) | FormatBits(8));
}

}  // namespace
}  // namespace tqkv
