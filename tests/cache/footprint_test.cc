// FootprintOf against the real cache: random layouts (presets with and
// without exact tokens and centering, sliding-window layers, page sizes),
// a prefill in chunks then one-token decode steps, and the pages, exact
// pages, pool pages and stored bytes the cache reports for the sequence.
#include "cache/footprint.h"

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "cache_test_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/kv_layout.h"

namespace tqkv {
namespace {

using testing_util::RandomTensor;

struct Case {
  KvLayoutOptions layout;
  int64_t prefill = 0, chunk = 0, steps = 0;
};

Case RandomCase(std::mt19937& rng) {
  const std::vector<std::string> presets = {"tqkv_k3v4u_csw", "turboquant_k8v4",    "tqkv_k3v3",
                                            "fp16",           "turboquant_4bit_nc", "tqkv_k4v4u_csw"};
  const auto pick = [&rng](int n) { return static_cast<int>(rng() % n); };
  Case c;
  KvLayoutOptions& o = c.layout;
  o.num_layers = 2 + pick(4);
  o.num_kv_heads = 1 + pick(2);
  o.num_query_heads = o.num_kv_heads * (1 + pick(2));
  o.head_dim = 64;
  o.page_tokens = std::vector<int>{4, 8, 16}[pick(3)];
  o.preset = presets[pick(static_cast<int>(presets.size()))];
  o.boundary_layers = pick(2);
  o.boundary_preset = "fp16";
  o.rope.base = 10000.0;
  if (pick(2) == 0) {  // exact tokens set here, not from the preset
    o.exact_sink_tokens = pick(6);
    o.exact_recent_tokens = pick(30);
  }
  if (pick(2) == 0) {
    o.layer_windows.assign(o.num_layers, 0);
    const int window = 5 + pick(40);
    for (int& w : o.layer_windows) w = pick(3) == 0 ? 0 : window;
  }
  c.prefill = 1 + pick(150);
  c.chunk = 1 + pick(64);
  c.steps = 1 + pick(20);
  return c;
}

std::string Describe(const Case& c) {
  std::string windows;
  for (int w : c.layout.layer_windows) windows += std::to_string(w) + " ";
  return c.layout.preset + " layers " + std::to_string(c.layout.num_layers) + " page_tokens " +
         std::to_string(c.layout.page_tokens) + " sinks " + std::to_string(c.layout.exact_sink_tokens) + " recent " +
         std::to_string(c.layout.exact_recent_tokens) + " sliding windows [" + windows + "] prefill " +
         std::to_string(c.prefill) + " in " + std::to_string(c.chunk) + " + " + std::to_string(c.steps) + " steps";
}

// Appends [start, start + n) to every layer.
absl::Status Append(KvCache& cache, int64_t start, int64_t n, uint32_t seed) {
  const KvLayout& layout = cache.layout();
  const std::vector<float> keys = RandomTensor(layout.num_layers(), n, layout, seed);
  const std::vector<float> values = RandomTensor(layout.num_layers(), n, layout, seed + 1);
  AppendRequest r;
  r.sequence_id = "s";
  r.start_position = start;
  r.layer_begin = 0;
  r.layer_end = layout.num_layers();
  r.num_tokens = n;
  r.keys = keys.data();
  r.values = values.data();
  r.create_if_missing = true;
  return cache.Append(r);
}

TEST(FootprintTest, MatchesWhatTheCacheHoldsAfterDecodeSteps) {
  std::mt19937 rng(20261206);
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  int checked = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const Case c = RandomCase(rng);
    SCOPED_TRACE(Describe(c));
    CacheOptions o;
    o.layout = c.layout;
    o.memory_budget_bytes = size_t{32} << 20;
    auto made = KvCache::Create(o, backend.get());
    if (!made.ok()) continue;  // a random layout the cache refuses (checked elsewhere)
    KvCache& cache = **made;
    int64_t length = 0;
    while (length < c.prefill) {
      const int64_t n = std::min(c.chunk, c.prefill - length);
      ASSERT_TRUE(Append(cache, length, n, static_cast<uint32_t>(length)).ok());
      length += n;
    }
    for (int64_t s = 0; s < c.steps; ++s, ++length) {
      ASSERT_TRUE(Append(cache, length, 1, static_cast<uint32_t>(length)).ok());
    }
    const SequenceFootprint f = FootprintOf(cache.layout(), length);
    absl::StatusOr<SequenceInfo> info = cache.GetSequence("s");
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(f.pages, info->pages);
    EXPECT_EQ(f.exact_pages, info->exact_pages);
    EXPECT_EQ(f.total_pages(), cache.Stats().pages_used);
    EXPECT_EQ(f.pool_bytes, static_cast<uint64_t>(cache.Stats().pages_used) * cache.layout().page_bytes());
    EXPECT_EQ(f.stored_bytes, info->stored_bytes);
    EXPECT_EQ(f.stored_bytes_bf16, info->stored_bytes_bf16);
    ++checked;
  }
  EXPECT_GE(checked, 150);  // most random layouts are valid
}

TEST(FootprintTest, CountsExactPagesAndMeansOfTheDefaultRecipe) {
  KvLayoutOptions o = testing_util::SmallLayout("tqkv_k3v4u_csw");
  o.boundary_layers = 0;
  o.rope.base = 10000.0;
  auto layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const KvLayout& l = **layout;
  ASSERT_TRUE(l.has_exact_tokens());
  const int64_t length = 1000;
  const SequenceFootprint f = FootprintOf(l, length);
  EXPECT_EQ(f.pages, (length + o.page_tokens - 1) / o.page_tokens);
  EXPECT_GT(f.exact_pages, 0);
  EXPECT_GT(f.mean_bytes, 0u);
  // The pool holds more than the tokens' compressed bytes: exact copies and padding.
  EXPECT_GT(f.pool_bytes + f.mean_bytes, static_cast<uint64_t>(length) * l.num_layers() * l.token_bytes(0));
  EXPECT_EQ(FootprintOf(l, 0).total_pages(), 0);
}

}  // namespace
}  // namespace tqkv
