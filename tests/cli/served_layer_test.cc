// The benchmarks' served layers (client/cli/served_layer.h) against the
// server: the layout `tqkv bench attend` and tqkv_gpu_bench build for the
// default recipe is the one the server's embedded configuration makes, and
// what they attend over a placed state is what the server's KvCache::Attend
// computes. A bench that trimmed the mean to other pairs, kept other
// recent tokens, or rotated with another RoPE fails here.
#include "client/cli/served_layer.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "cache/kv_cache.h"
#include "client/cli/model_layouts.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "base/random.h"
#include "service/config.h"

namespace tqkv {
namespace cli {
namespace {

// The cache a server started without --config serves.
CacheOptions ServerDefault() {
  absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(service::DefaultServerConfigText());
  EXPECT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::vector<CacheOptions>> caches = service::ToCacheOptions(*config, size_t{1} << 30);
  EXPECT_TRUE(caches.ok()) << caches.status();
  return caches->at(0);
}

// What the bench builds for the server's preset on the bench's default
// layout (`--layout llama3-8b`, `--page-tokens 16`).
KvLayoutOptions BenchDefault(const CacheOptions& server) {
  absl::StatusOr<ModelShape> shape = FindModelShape("llama3-8b");
  EXPECT_TRUE(shape.ok()) << shape.status();
  return ServedLayoutOptions(server.layout.preset, *shape, 16);
}

// Keys with a large per-head offset (what centering removes), Gaussian
// values; token t depends on t alone, however the tokens are appended.
void Tokens(int64_t t0, int64_t n, int heads, int d, std::vector<float>* keys, std::vector<float>* values) {
  keys->resize(static_cast<size_t>(n) * heads * d);
  values->resize(keys->size());
  for (int64_t i = 0; i < n; ++i) {
    Random rng(DeriveSeed(35, t0 + i));
    for (int j = 0; j < heads * d; ++j) {
      const size_t at = static_cast<size_t>(i) * heads * d + j;
      (*keys)[at] = 3.0f * static_cast<float>((j * 7919) % 13) / 13.0f + static_cast<float>(rng.NextGaussian());
      (*values)[at] = static_cast<float>(rng.NextGaussian());
    }
  }
}

TEST(ServedLayer, TheDefaultRecipeHasTheServersLayout) {
  const CacheOptions server = ServerDefault();
  EXPECT_EQ(server.layout.preset, "tqkv_k3v4u_csw");
  auto ours = KvLayout::Create(BenchDefault(server));
  auto theirs = KvLayout::Create(server.layout);
  ASSERT_TRUE(ours.ok()) << ours.status();
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  const KvLayoutOptions& o = (*ours)->options();
  const KvLayoutOptions& s = (*theirs)->options();
  EXPECT_EQ((*ours)->key_centering(), KeyCentering::kPreRope);
  EXPECT_EQ((*ours)->key_centering(), (*theirs)->key_centering());
  EXPECT_EQ(o.centering_pairs, s.centering_pairs);
  EXPECT_EQ(o.centering_tokens, s.centering_tokens);
  EXPECT_EQ(o.centering_includes_sinks, s.centering_includes_sinks);
  EXPECT_EQ(o.exact_sink_tokens, s.exact_sink_tokens);
  EXPECT_EQ(o.exact_recent_tokens, s.exact_recent_tokens);
  EXPECT_EQ(o.page_tokens, s.page_tokens);
  EXPECT_EQ(o.rotation_seed, s.rotation_seed);
  EXPECT_EQ(o.num_kv_heads, s.num_kv_heads);
  EXPECT_EQ(o.num_query_heads, s.num_query_heads);
  EXPECT_EQ(o.head_dim, s.head_dim);
  EXPECT_EQ(o.rope.rotary_dims, s.rope.rotary_dims);
  EXPECT_EQ(o.rope.pair_layout, s.rope.pair_layout);
  EXPECT_EQ(o.rope.base, s.rope.base);
  EXPECT_EQ(o.rope.scaling, s.rope.scaling);
  EXPECT_EQ(o.rope.scaling_factor, s.rope.scaling_factor);
  EXPECT_EQ(o.rope.low_freq_factor, s.rope.low_freq_factor);
  EXPECT_EQ(o.rope.high_freq_factor, s.rope.high_freq_factor);
  EXPECT_EQ(o.rope.original_max_position, s.rope.original_max_position);
  EXPECT_EQ(o.rope.inv_freq, s.rope.inv_freq);
  for (int64_t context : {1, 60, 68, 1024, 32768}) {
    EXPECT_EQ((*ours)->exact_ranges(context).sink_end, (*theirs)->exact_ranges(context).sink_end) << context;
    EXPECT_EQ((*ours)->exact_ranges(context).recent_begin, (*theirs)->exact_ranges(context).recent_begin) << context;
  }
}

TEST(ServedLayer, ABenchAttendsWhatTheServerAttends) {
  const CacheOptions server = ServerDefault();
  const KvLayoutOptions bench = BenchDefault(server);
  const int heads = bench.num_kv_heads, d = bench.head_dim, qh = bench.num_query_heads;
  const std::vector<int64_t> contexts = {1000, 300};
  auto backend = MakeCpuBackend(1);

  // The bench: states built at each context, placed side by side in a pool.
  absl::StatusOr<ServedLayer> layer = BuildServedLayer(
      bench, *backend, contexts,
      [&](int64_t t0, int64_t n, std::vector<float>* k, std::vector<float>* v) { Tokens(t0, n, heads, d, k, v); });
  ASSERT_TRUE(layer.ok()) << layer.status();
  int32_t pages = 0;
  for (const ServedState& state : layer->states) pages += state.num_pages;
  absl::StatusOr<PagePool> pool = backend->AllocatePool(*layer->layout, pages);
  ASSERT_TRUE(pool.ok()) << pool.status();

  // The server: its default cache, a client prefilling 300 tokens of layer 0
  // and then 700 more, attending after each.
  CacheOptions options = server;
  options.memory_budget_bytes = size_t{256} << 20;
  absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(options, backend.get());
  ASSERT_TRUE(cache.ok()) << cache.status();
  const std::vector<float> query = [&] {
    std::vector<float> keys, values;
    Tokens(1 << 20, 4, heads, d, &keys, &values);
    return keys;  // 4 x heads x d = qh x d floats
  }();
  ASSERT_EQ(query.size(), static_cast<size_t>(qh) * d);

  int32_t first_page = 0;
  int64_t length = 0;
  for (size_t i : {size_t{1}, size_t{0}}) {  // 300, then 1000 tokens
    const ServedState& state = layer->states[i];
    ASSERT_EQ(state.context_tokens, contexts[i]);
    std::vector<float> keys, values;
    Tokens(length, contexts[i] - length, heads, d, &keys, &values);
    AppendRequest append;
    append.sequence_id = "s";
    append.start_position = length;
    append.layer_end = 1;
    append.num_tokens = contexts[i] - length;
    append.keys = keys.data();
    append.values = values.data();
    ASSERT_TRUE((*cache)->Append(append).ok());
    length = contexts[i];
    std::vector<float> theirs(query.size());
    const AttendRequestItem request{"s", 0, 1, query.data(), theirs.data(), nullptr};
    ASSERT_TRUE((*cache)->Attend({request}).ok());

    absl::StatusOr<PlacedTables> placed = PlaceServedState(*backend, *pool, state, first_page);
    ASSERT_TRUE(placed.ok()) << placed.status();
    first_page += state.num_pages;
    std::vector<float> ours(query.size());
    AttendItem item;
    item.block_table = placed->block_table.data();
    item.context_tokens = state.context_tokens;
    item.queries = query.data();
    item.output = ours.data();
    item.exact_block_table = placed->exact_block_table.data();
    item.key_mean = state.key_mean.data();
    const AttendItem items[] = {item};
    ASSERT_TRUE(backend->Attend({layer->layout.get(), *pool, items, 1.0f / std::sqrt(static_cast<float>(d))}).ok());
    for (size_t j = 0; j < ours.size(); ++j) ASSERT_EQ(ours[j], theirs[j]) << "context " << contexts[i] << ", " << j;

    // And what the bench says it reads.
    const ServedRecipe recipe = DescribeServedState(*layer->layout, state);
    EXPECT_EQ(recipe.mean_pairs, server.layout.centering_pairs);
    EXPECT_EQ(recipe.rope_pairs, d / 2);
    EXPECT_EQ(recipe.sinks, 4);
    EXPECT_EQ(recipe.recent, 64);
    EXPECT_EQ(recipe.Describe(), "pre-RoPE centering (8 of 64 pairs), 4 sinks + 64 recent exact");
  }
  backend->FreePool(*pool);
}

TEST(ServedLayer, PlainLayoutsHoldNoMeanAndNoExactPages) {
  absl::StatusOr<ModelShape> shape = FindModelShape("llama3-8b");
  ASSERT_TRUE(shape.ok());
  KvLayoutOptions plain = ServedLayoutOptions("tqkv_k3v4u_csw", *shape, 16);
  plain.key_centering = KeyCentering::kNone;
  plain.exact_sink_tokens = 0;
  plain.exact_recent_tokens = 0;
  auto backend = MakeCpuBackend(1);
  const std::vector<int64_t> contexts = {100};
  absl::StatusOr<ServedLayer> layer = BuildServedLayer(
      plain, *backend, contexts,
      [&](int64_t t0, int64_t n, std::vector<float>* k, std::vector<float>* v) { Tokens(t0, n, 8, 128, k, v); });
  ASSERT_TRUE(layer.ok()) << layer.status();
  const ServedState& state = layer->states[0];
  EXPECT_TRUE(state.key_mean.empty());
  EXPECT_TRUE(state.exact_block_table.empty());
  EXPECT_EQ(state.num_pages, 7);  // ceil(100 / 16)
  EXPECT_EQ(state.num_pages, ServedPagesBound(*layer->layout, 100));
  EXPECT_EQ(DescribeServedState(*layer->layout, state).Describe(), "plain");
}

TEST(ServedLayer, BadContextsAreInvalidArgument) {
  absl::StatusOr<ModelShape> shape = FindModelShape("llama3-8b");
  ASSERT_TRUE(shape.ok());
  auto backend = MakeCpuBackend(1);
  const TokenSource none = [](int64_t, int64_t, std::vector<float>*, std::vector<float>*) {};
  const KvLayoutOptions options = ServedLayoutOptions("bf16", *shape, 16);
  EXPECT_EQ(BuildServedLayer(options, *backend, {}, none).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int64_t> zero = {0};
  EXPECT_EQ(BuildServedLayer(options, *backend, zero, none).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cli
}  // namespace tqkv
