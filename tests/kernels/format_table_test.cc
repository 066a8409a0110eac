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
  EXPECT_FALSE(FindFormatPair(FormatFamily::kFp16, FormatFamily::kTurboQuant, &none));
}

TEST(FormatTable, VisitorsHandTheRowsOverAsConstants) {
  for (const FormatPairInfo& info : kFormatPairs) {
    const int got = VisitFormatPair(info.pair, -1, [](auto tag) {
      using Tag = decltype(tag);
      return static_cast<int>(Tag::kKey) * 100 + static_cast<int>(Tag::kValue) * 10 + (Tag::kTensorCores ? 1 : 0);
    });
    EXPECT_EQ(got, static_cast<int>(info.key) * 100 + static_cast<int>(info.value) * 10 + (info.tensor_cores ? 1 : 0))
        << info.name;
  }
  EXPECT_EQ(VisitFormatPair(static_cast<FormatPair>(kNumFormatPairs), -1, [](auto) { return 0; }), -1);
  for (const FormatFamilyInfo& info : kFormatFamilies) {
    const int got = VisitKeyFamily(info.family, -1, [](auto tag) { return static_cast<int>(decltype(tag)::kFormat); });
    EXPECT_EQ(got, info.reads_keys ? static_cast<int>(info.family) : -1) << info.name;
  }
  EXPECT_EQ(FamilyInfo(FormatFamily::kUniform).code_bits, FormatBits(2) | FormatBits(3) | FormatBits(4) | FormatBits(8));
}

}  // namespace
}  // namespace tqkv
