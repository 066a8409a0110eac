// The RoPE check (cache/rope_check.h): keys made with one RoPE, measured in
// the frame of another. It fires for another base, the other pair layout and
// Llama-3.1's RoPE on SmolLM2-shaped keys (the case), and stays
// silent for the model's own RoPE and for keys without a shared part; through
// a KvCache it counts each (sequence, layer) in CacheStats::rope_mismatches.
#include "cache/rope_check.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/random.h"
#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/key_centering.h"
#include "kernels/kv_layout.h"

namespace tqkv {
namespace {

constexpr int kHeads = 3;
constexpr int kDim = 64;
// The longest window the check reads, with the tokens it skips at position 0.
constexpr int64_t kLongWindow = RopeCheckLimits::kMaxTokens + RopeCheckLimits::kSkipFirst;

RopeOptions Rope(double base, RopePairLayout layout = RopePairLayout::kHalfSplit) {
  RopeOptions o;
  o.base = base;
  o.pair_layout = layout;
  return o;
}

// Llama-3.1's RoPE, as the default cache config carries it.
RopeOptions Llama31() {
  RopeOptions o = Rope(500000.0);
  o.scaling = RopeScaling::kLlama3;
  o.scaling_factor = 8.0;
  return o;
}

// [tokens, kHeads, kDim] keys at positions first..: a shared pre-RoPE vector
// per head (`shared` times a standard Gaussian per coordinate: ~0.7 of the
// energy at 1.5, as in real models) plus unit noise, rotated by `model`.
std::vector<float> MakeKeys(const RopeOptions& model, int64_t first, int64_t tokens, double shared, uint64_t seed) {
  auto table = RopeTable::Create(model, kDim);
  EXPECT_TRUE(table.ok()) << table.status();
  Random rng(seed);
  std::vector<double> mean(kHeads * kDim);
  for (double& m : mean) m = shared * rng.NextGaussian();
  std::vector<float> keys(static_cast<size_t>(tokens) * kHeads * kDim);
  std::vector<double> k(kDim);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < kHeads; ++h) {
      for (int j = 0; j < kDim; ++j) k[j] = mean[h * kDim + j] + rng.NextGaussian();
      table->Rotate(first + t, k.data(), /*inverse=*/false);
      for (int j = 0; j < kDim; ++j) keys[(t * kHeads + h) * kDim + j] = static_cast<float>(k[j]);
    }
  }
  return keys;
}

RopeCoherence Measure(const RopeOptions& model, const RopeOptions& cache, int64_t tokens, double shared = 1.5,
                      uint64_t seed = 1) {
  const int64_t first = 3;
  const std::vector<float> keys = MakeKeys(model, first, tokens, shared, seed);
  auto table = RopeTable::Create(cache, kDim);
  EXPECT_TRUE(table.ok()) << table.status();
  const RopeAngles angles = ComputeRopeAngles(*table, first, tokens);
  return MeasureRopeCoherence(*table, angles, keys.data(), 0, tokens, kHeads * kDim, kHeads, kDim);
}

std::string Describe(const RopeCoherence& r) {
  return "coherence " + std::to_string(r.coherence) + " at lag " + std::to_string(r.lag) + ", shared " +
         std::to_string(r.shared) + ", tokens " + std::to_string(r.tokens);
}

TEST(RopeCheck, StaysSilentForTheModelsOwnRope) {
  for (uint64_t seed : {1, 2, 3}) {
    for (int64_t tokens : {64, 256, 1000}) {
      for (const RopeOptions& rope : {Rope(100000.0), Rope(10000.0, RopePairLayout::kInterleaved), Llama31()}) {
        const RopeCoherence r = Measure(rope, rope, tokens, 1.5, seed);
        EXPECT_FALSE(r.mismatch) << Describe(r);
        EXPECT_GT(r.coherence, 0.95) << Describe(r);
        EXPECT_GT(r.shared, 0.3) << Describe(r);
        EXPECT_GT(r.tokens, 0);
        EXPECT_LE(r.tokens, RopeCheckLimits::kMaxTokens);
      }
    }
  }
}

TEST(RopeCheck, StaysSilentForKeysWithoutASharedPart) {
  for (uint64_t seed : {1, 2, 3, 4, 5}) {
    for (int64_t tokens : {64, 256}) {
      const RopeCoherence r = Measure(Rope(100000.0), Llama31(), tokens, /*shared=*/0.0, seed);
      EXPECT_FALSE(r.mismatch) << Describe(r);
      EXPECT_EQ(r.lag, 0) << "no lag has a shared part: " << Describe(r);
    }
  }
}

TEST(RopeCheck, FiresForAnotherBase) {
  for (uint64_t seed : {1, 2, 3}) {
    for (double base : {10000.0, 500000.0, 1000000.0}) {
      const RopeCoherence r = Measure(Rope(100000.0), Rope(base), kLongWindow, 1.5, seed);
      EXPECT_TRUE(r.mismatch) << "base " << base << ": " << Describe(r);
    }
  }
}

TEST(RopeCheck, FiresForLlama31RopeOnSmolLM2Keys) {
  // SmolLM2-135M: head dim 64, base 100000, half-split pairs.
  for (uint64_t seed : {1, 2, 3}) {
    const RopeCoherence r = Measure(Rope(100000.0), Llama31(), kLongWindow, 1.5, seed);
    EXPECT_TRUE(r.mismatch) << Describe(r);
  }
}

TEST(RopeCheck, FiresForTheOtherPairLayout) {
  for (uint64_t seed : {1, 2, 3}) {
    for (int64_t tokens : {int64_t{128}, kLongWindow}) {
      const RopeCoherence r = Measure(Rope(100000.0), Rope(100000.0, RopePairLayout::kInterleaved), tokens, 1.5, seed);
      EXPECT_TRUE(r.mismatch) << tokens << " tokens: " << Describe(r);
      const RopeCoherence back = Measure(Rope(10000.0, RopePairLayout::kInterleaved), Rope(10000.0), tokens, 1.5, seed);
      EXPECT_TRUE(back.mismatch) << tokens << " tokens: " << Describe(back);
    }
  }
}

TEST(RopeCheck, GivesNoVerdictOnFewTokens) {
  const RopeCoherence r = Measure(Rope(100000.0), Rope(10000.0), RopeCheckLimits::kMinTokens - 1);
  EXPECT_EQ(r.tokens, 0);
  EXPECT_FALSE(r.mismatch);
}

// A cache whose config carries Llama-3.1's RoPE, serving keys made with
// another: each sequence's first append counts once per layer, up to
// kChecksPerLayer sequences; the model's own RoPE counts nothing.
uint64_t MismatchesAfterSequences(const RopeOptions& cache_rope, const RopeOptions& model, int sequences) {
  constexpr int kLayers = 2;
  KvLayoutOptions o;
  o.num_layers = kLayers;
  o.num_kv_heads = kHeads;
  o.num_query_heads = kHeads;
  o.head_dim = kDim;
  o.page_tokens = 16;
  o.preset = "turboquant_k3v4_nc";
  o.boundary_layers = 0;
  o.key_centering = KeyCentering::kPreRope;
  o.rope = cache_rope;
  CacheOptions options;
  options.name = "rope-check";
  options.layout = o;
  options.memory_budget_bytes = size_t{16} << 20;
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  auto cache = KvCache::Create(options, backend.get());
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return 0;
  constexpr int64_t kTokens = kLongWindow;
  std::vector<float> keys, values;
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<float> layer = MakeKeys(model, 0, kTokens, 1.5, 10 + l);
    keys.insert(keys.end(), layer.begin(), layer.end());
  }
  Random rng(5);
  values.resize(keys.size());
  for (float& v : values) v = static_cast<float>(rng.NextGaussian());
  for (int s = 0; s < sequences; ++s) {
    AppendRequest r;
    r.sequence_id = "s" + std::to_string(s);
    r.layer_begin = 0;
    r.layer_end = kLayers;
    r.num_tokens = kTokens;
    r.keys = keys.data();
    r.values = values.data();
    EXPECT_TRUE((*cache)->Append(r).ok());
  }
  return (*cache)->Stats().rope_mismatches;
}

TEST(RopeCheck, CountsEachSequencesLayersUpToTheLimit) {
  EXPECT_EQ(MismatchesAfterSequences(Llama31(), Rope(100000.0), 1), 2u);
  EXPECT_EQ(MismatchesAfterSequences(Llama31(), Rope(100000.0), RopeCheckLimits::kChecksPerLayer + 2),
            2u * RopeCheckLimits::kChecksPerLayer);
  EXPECT_EQ(MismatchesAfterSequences(Rope(100000.0), Rope(100000.0), 3), 0u);
}

}  // namespace
}  // namespace tqkv
