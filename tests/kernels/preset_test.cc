#include "kernels/preset.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace tqkv {
namespace {

TEST(Preset, VllmNamesTakeNoMoreBytesThanVllmAtHeadDim128) {
  EXPECT_LE((*FindPreset("turboquant_k8v4"))->BytesPerTokenHead(128), 196);
  EXPECT_LE((*FindPreset("turboquant_4bit_nc"))->BytesPerTokenHead(128), 134);
  EXPECT_LE((*FindPreset("turboquant_k3v4_nc"))->BytesPerTokenHead(128), 118);
  EXPECT_LE((*FindPreset("turboquant_3bit_nc"))->BytesPerTokenHead(128), 102);
}

TEST(Preset, BaselinesHaveTheirNominalSize) {
  EXPECT_EQ((*FindPreset("fp16"))->BytesPerTokenHead(128), 512);
  EXPECT_EQ((*FindPreset("fp8"))->BytesPerTokenHead(128), 256);
  EXPECT_DOUBLE_EQ((*FindPreset("fp16"))->CompressionVsBf16(128), 1.0);
}

TEST(Preset, VllmNamesUseTheCodecsVllmUses) {
  const Preset* k3v4 = *FindPreset("turboquant_k3v4_nc");
  EXPECT_EQ(k3v4->key.kind, CodecKind::kTurboQuant);
  EXPECT_EQ(k3v4->key.bits, 3);
  EXPECT_TRUE(k3v4->key.norm_correction);
  EXPECT_EQ(k3v4->value.kind, CodecKind::kUniform);
  EXPECT_EQ(k3v4->value.bits, 4);
  EXPECT_EQ((*FindPreset("turboquant_k8v4"))->key.kind, CodecKind::kFp8);
}

TEST(Preset, NamesAreUniqueAndEverySpecIsValid) {
  std::set<std::string> names;
  for (const Preset& preset : AllPresets()) {
    EXPECT_TRUE(names.insert(std::string(preset.name)).second) << preset.name;
    EXPECT_TRUE(preset.key.Validate().ok()) << preset.name;
    EXPECT_TRUE(preset.value.Validate().ok()) << preset.name;
    for (int dim : {64, 80, 96, 128, 256}) {
      EXPECT_LE(preset.BytesPerTokenHead(dim), 4 * dim) << preset.name;
    }
  }
  for (const char* required :
       {"fp16", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"}) {
    EXPECT_TRUE(names.count(required)) << required;
  }
}

TEST(Preset, UnknownNamesAreNotFoundAndListTheKnownOnes) {
  absl::StatusOr<const Preset*> missing = FindPreset("turboquant_2bit");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("turboquant_3bit_nc"), std::string::npos);
}

TEST(Preset, ParsesAllAndCommaLists) {
  EXPECT_EQ(ParsePresetList("all")->size(), AllPresets().size());
  auto two = ParsePresetList("fp8,turboquant_3bit_nc");
  ASSERT_TRUE(two.ok());
  ASSERT_EQ(two->size(), 2u);
  EXPECT_EQ((*two)[1]->name, "turboquant_3bit_nc");
  EXPECT_FALSE(ParsePresetList("fp8,nope").ok());
  EXPECT_FALSE(ParsePresetList("").ok());
}

}  // namespace
}  // namespace tqkv
