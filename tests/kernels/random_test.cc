#include "base/random.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace tqkv {
namespace {

TEST(Random, SameSeedGivesSameSequence) {
  Random a(42);
  Random b(42);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(a.NextU64(), b.NextU64()) << "at draw " << i;
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(a.NextGaussian(), b.NextGaussian()) << "at draw " << i;
}

TEST(Random, DifferentSeedsGiveDifferentSequences) {
  Random a(1);
  Random b(2);
  int equal = 0;
  for (int i = 0; i < 1000; ++i) equal += a.NextU64() == b.NextU64();
  EXPECT_EQ(equal, 0);
}

TEST(Random, KnownSeedGivesPinnedValues) {
  // The generator is part of the stored format (rotation signs, dense
  // rotations): its output for a seed must never change.
  uint64_t state = 0;
  EXPECT_EQ(SplitMix64(state), 0xE220A8397B1DCDAFull);  // published SplitMix64 value
  Random random(0);
  EXPECT_EQ(random.NextU64(), 0x99EC5F36CB75F2B4ull);
  EXPECT_EQ(random.NextU64(), 0xBF6E1F784956452Aull);
  EXPECT_EQ(DeriveSeed(1, 2, 3), 0xB0A1064EDAF73761ull);
  Random gaussian(0);
  EXPECT_DOUBLE_EQ(gaussian.NextGaussian(), -0.014106797381249181);
}

TEST(Random, NextDoubleStaysInUnitInterval) {
  Random random(7);
  double min = 1.0;
  double max = 0.0;
  for (int i = 0; i < 100000; ++i) {
    const double u = random.NextDouble();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    min = std::min(min, u);
    max = std::max(max, u);
  }
  EXPECT_LT(min, 1e-3);
  EXPECT_GT(max, 1.0 - 1e-3);
}

TEST(Random, GaussianHasZeroMeanAndUnitVariance) {
  Random random(123);
  constexpr int kSamples = 200000;
  double sum = 0.0;
  double sum_sq = 0.0;
  double sum_4 = 0.0;
  for (int i = 0; i < kSamples; ++i) {
    const double g = random.NextGaussian();
    sum += g;
    sum_sq += g * g;
    sum_4 += g * g * g * g;
  }
  const double mean = sum / kSamples;
  const double var = sum_sq / kSamples - mean * mean;
  // Standard errors: mean 1/sqrt(n) = 0.0022, variance sqrt(2/n) = 0.0032.
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(var, 1.0, 0.015);
  EXPECT_NEAR(sum_4 / kSamples, 3.0, 0.1);  // fourth moment of N(0, 1)
}

TEST(Random, NextSignIsBalanced) {
  Random random(5);
  int plus = 0;
  for (int i = 0; i < 100000; ++i) {
    const float s = random.NextSign();
    ASSERT_TRUE(s == 1.0f || s == -1.0f);
    plus += s > 0;
  }
  EXPECT_NEAR(plus, 50000, 800);  // 5 sigma
}

TEST(Random, NextBelowStaysInRangeAndIsUniform) {
  Random random(99);
  constexpr int kBuckets = 7;
  constexpr int kDraws = 70000;
  std::vector<int> counts(kBuckets, 0);
  for (int i = 0; i < kDraws; ++i) {
    const uint64_t v = random.NextBelow(kBuckets);
    ASSERT_LT(v, static_cast<uint64_t>(kBuckets));
    ++counts[v];
  }
  // Chi-square with 6 degrees of freedom: 22.5 is the 0.1% tail.
  double chi2 = 0.0;
  const double expected = static_cast<double>(kDraws) / kBuckets;
  for (int c : counts) chi2 += (c - expected) * (c - expected) / expected;
  EXPECT_LT(chi2, 22.5);

  for (int i = 0; i < 100; ++i) EXPECT_EQ(random.NextBelow(1), 0u);
  const uint64_t huge = (uint64_t{1} << 63) + 12345;
  for (int i = 0; i < 100; ++i) EXPECT_LT(random.NextBelow(huge), huge);
}

TEST(DeriveSeed, DistinctInputsGiveDistinctSeeds) {
  std::set<uint64_t> seeds;
  int inputs = 0;
  for (uint64_t base : {0ull, 1ull, 42ull}) {
    for (uint64_t a = 0; a < 16; ++a) {
      for (uint64_t b = 0; b < 16; ++b) {
        seeds.insert(DeriveSeed(base, a, b));
        ++inputs;
      }
    }
  }
  EXPECT_EQ(seeds.size(), static_cast<size_t>(inputs));
  EXPECT_NE(DeriveSeed(1, 2, 3), DeriveSeed(1, 3, 2));
  EXPECT_EQ(DeriveSeed(1, 2, 3), DeriveSeed(1, 2, 3));
  EXPECT_EQ(DeriveSeed(9, 4), DeriveSeed(9, 4, 0));
}

}  // namespace
}  // namespace tqkv
