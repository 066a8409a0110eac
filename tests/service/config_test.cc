#include "service/config.h"

#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tqkv {
namespace service {
namespace {

using ::testing::HasSubstr;

TEST(ServerConfig, EmbeddedDefaultIsOneLlama8BCache) {
  absl::StatusOr<v1::ServerConfig> config = LoadServerConfig("");
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::vector<CacheOptions>> caches = ToCacheOptions(*config, 1 << 30);
  ASSERT_TRUE(caches.ok()) << caches.status();
  ASSERT_EQ(caches->size(), 1u);
  const CacheOptions& c = (*caches)[0];
  EXPECT_EQ(c.name, "default");
  EXPECT_EQ(c.layout.num_layers, 32);
  EXPECT_EQ(c.layout.num_kv_heads, 8);
  EXPECT_EQ(c.layout.num_query_heads, 32);
  EXPECT_EQ(c.layout.head_dim, 128);
  EXPECT_EQ(c.layout.page_tokens, 16);
  EXPECT_EQ(c.layout.preset, "tqkv_k3v4u_csw");
  EXPECT_EQ(c.layout.boundary_layers, 0);
  EXPECT_EQ(c.memory_budget_bytes, size_t{1} << 30);
  // The recipe in effect: pre-RoPE centering with Llama-3.1's RoPE, 4 sinks, the last 64 tokens.
  auto layout = KvLayout::Create(c.layout);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ((*layout)->key_centering(), KeyCentering::kPreRope);
  EXPECT_EQ((*layout)->rope().num_pairs(), 64);
  EXPECT_EQ((*layout)->options().exact_sink_tokens, 4);
  EXPECT_EQ((*layout)->options().exact_recent_tokens, 64);
}

TEST(ServerConfig, SplitsTheBudgetAmongCachesWithoutOne) {
  absl::StatusOr<v1::ServerConfig> config = ParseServerConfig(R"pb(
    caches { name: "a" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 }
    caches { name: "b" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 memory_budget_bytes: 1000000 }
    caches { name: "c" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 idle_ttl_seconds: 30 }
  )pb");
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::vector<CacheOptions>> caches = ToCacheOptions(*config, 8 << 20);
  ASSERT_TRUE(caches.ok()) << caches.status();
  EXPECT_EQ((*caches)[0].memory_budget_bytes, size_t{4} << 20);
  EXPECT_EQ((*caches)[1].memory_budget_bytes, 1000000u);
  EXPECT_EQ((*caches)[2].memory_budget_bytes, size_t{4} << 20);
  EXPECT_EQ((*caches)[2].idle_ttl, absl::Seconds(30));
  EXPECT_EQ((*caches)[0].idle_ttl, absl::InfiniteDuration());
}

TEST(ServerConfig, ReportsSyntaxErrorsWithTheirLine) {
  absl::StatusOr<v1::ServerConfig> config = ParseServerConfig("caches {\n  nam: \"x\"\n}\n");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("line 2"));
}

TEST(ServerConfig, RejectsInvalidCaches) {
  const auto check = [](const char* text, absl::StatusCode code, const char* substring) {
    absl::StatusOr<v1::ServerConfig> config = ParseServerConfig(text);
    ASSERT_TRUE(config.ok()) << config.status();
    absl::StatusOr<std::vector<CacheOptions>> caches = ToCacheOptions(*config, 1 << 30);
    ASSERT_FALSE(caches.ok()) << text;
    EXPECT_EQ(caches.status().code(), code) << caches.status();
    EXPECT_THAT(caches.status().message(), HasSubstr(substring));
  };
  check("", absl::StatusCode::kInvalidArgument, "no caches");
  check(
      "caches { name: \"a\" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 }"
      "caches { name: \"a\" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 }",
      absl::StatusCode::kInvalidArgument, "appears twice");
  check("caches { num_layers: 0 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 }", absl::StatusCode::kInvalidArgument,
        ">= 1");
  check("caches { num_layers: 2 num_kv_heads: 2 num_query_heads: 3 head_dim: 64 }", absl::StatusCode::kInvalidArgument,
        "cache 'default'");
  check("caches { num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 preset: \"x\" }",
        absl::StatusCode::kNotFound, "cache 'default'");
  check(
      "caches { num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 "
      "memory_budget_bytes: 10 }",
      absl::StatusCode::kInvalidArgument, "holds no page");
  check(
      "caches { num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 "
      "idle_ttl_seconds: -1 }",
      absl::StatusCode::kInvalidArgument, "idle_ttl_seconds");
}

TEST(ServerConfig, ReadsCenteringExactTokensAndProtectedLayers) {
  absl::StatusOr<v1::ServerConfig> config = ParseServerConfig(R"pb(
    caches {
      name: "c"
      num_layers: 4
      num_kv_heads: 1
      num_query_heads: 2
      head_dim: 64
      preset: "turboquant_k3v4_nc"
      boundary_layers: 0
      key_centering: "pre_rope"
      rope {
        pair_layout: HALF_SPLIT
        base: 500000
        scaling_type: "llama3"
        scaling_factor: 8
        low_freq_factor: 1
        high_freq_factor: 4
        original_max_position: 8192
      }
      centering_tokens: 32
      centering_pairs: 0
      exact_sink_tokens: 2
      exact_recent_tokens: 0
      protected_layers {
        layers: [ 0, 3 ]
        preset: "tqkv_k4v4"
      }
      protected_layers { layers: 1 preset: "fp16" }
    }
    caches {
      name: "recipe"
      num_layers: 2
      num_kv_heads: 1
      num_query_heads: 1
      head_dim: 64
      preset: "tqkv_k3v4u_csw"
      exact_recent_tokens: 16
    }
  )pb");
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::vector<CacheOptions>> caches = ToCacheOptions(*config, 8 << 20);
  ASSERT_TRUE(caches.ok()) << caches.status();
  const KvLayoutOptions& l = (*caches)[0].layout;
  EXPECT_EQ(l.key_centering, KeyCentering::kPreRope);
  EXPECT_EQ(l.rope.pair_layout, RopePairLayout::kHalfSplit);
  EXPECT_EQ(l.rope.scaling, RopeScaling::kLlama3);
  EXPECT_EQ(l.rope.base, 500000.0);
  EXPECT_EQ(l.centering_tokens, 32);
  EXPECT_EQ(l.centering_pairs, 0);
  EXPECT_EQ(l.exact_sink_tokens, 2);
  EXPECT_EQ(l.exact_recent_tokens, 0);
  EXPECT_EQ(l.layer_presets, (std::vector<std::string>{"tqkv_k4v4", "fp16", "", "tqkv_k4v4"}));
  // Unset recipe fields stay unset: the preset fills them.
  const KvLayoutOptions& r = (*caches)[1].layout;
  EXPECT_FALSE(r.key_centering.has_value());
  EXPECT_EQ(r.exact_sink_tokens, -1);
  EXPECT_EQ(r.exact_recent_tokens, 16);
  // What GetServerInfo reports: the recipe in effect.
  const v1::CacheConfig back = ToCacheConfig((*caches)[1]);
  EXPECT_EQ(back.key_centering(), "pre_rope");
  EXPECT_EQ(back.exact_sink_tokens(), 4);
  EXPECT_EQ(back.exact_recent_tokens(), 16);
  const v1::CacheConfig first = ToCacheConfig((*caches)[0]);
  ASSERT_EQ(first.protected_layers_size(), 2);
  EXPECT_EQ(first.protected_layers(0).preset(), "tqkv_k4v4");
  EXPECT_THAT(first.protected_layers(0).layers(), ::testing::ElementsAre(0, 3));
  EXPECT_EQ(first.rope().scaling_type(), "llama3");
}

// exact_recent_tokens was exact_window_tokens (same field number): a config
// file with the old name reads as before, with a warning per use; the old
// name inside a comment or a string is left alone, and the name written back
// is the new one.
TEST(ServerConfig, ReadsTheDeprecatedExactWindowTokensAsExactRecentTokens) {
  std::vector<std::string> warnings;
  absl::StatusOr<v1::ServerConfig> config = ParseServerConfig(
      "caches {\n"
      "  name: \"exact_window_tokens: 1\"  # exact_window_tokens: 2\n"
      "  num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64\n"
      "  preset: \"tqkv_k3v4u_csw\"\n"
      "\texact_window_tokens: 24\n"
      "}\n"
      "caches { name: \"b\" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 exact_recent_tokens: 8 }\n",
      &warnings);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->caches(0).name(), "exact_window_tokens: 1");
  EXPECT_TRUE(config->caches(0).has_exact_recent_tokens());
  EXPECT_EQ(config->caches(0).exact_recent_tokens(), 24);
  EXPECT_EQ(config->caches(1).exact_recent_tokens(), 8);
  EXPECT_THAT(warnings, ::testing::ElementsAre("config line 5: exact_window_tokens is deprecated; use "
                                               "exact_recent_tokens"));
  absl::StatusOr<std::vector<CacheOptions>> caches = ToCacheOptions(*config, 8 << 20);
  ASSERT_TRUE(caches.ok()) << caches.status();
  EXPECT_EQ((*caches)[0].layout.exact_recent_tokens, 24);
  EXPECT_EQ(ToCacheConfig((*caches)[0]).exact_recent_tokens(), 24);
  // Both names for the one field: the parser's "specified multiple times".
  absl::StatusOr<v1::ServerConfig> both = ParseServerConfig(
      "caches { num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 exact_window_tokens: 8 "
      "exact_recent_tokens: 8 }");
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument) << both.status();
  EXPECT_THAT(both.status().message(), HasSubstr("exact_recent_tokens")) << both.status();
}

TEST(ServerConfig, RejectsBadCenteringSettingsWithTheirName) {
  const auto check = [](const std::string& fields, const char* substring) {
    absl::StatusOr<v1::ServerConfig> config =
        ParseServerConfig("caches { num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 " + fields + " }");
    ASSERT_TRUE(config.ok()) << config.status();
    absl::StatusOr<std::vector<CacheOptions>> caches = ToCacheOptions(*config, 1 << 30);
    ASSERT_FALSE(caches.ok()) << fields;
    EXPECT_EQ(caches.status().code(), absl::StatusCode::kInvalidArgument) << caches.status();
    EXPECT_THAT(caches.status().message(), HasSubstr(substring)) << caches.status();
  };
  check("key_centering: \"before_rope\"", "key_centering");
  check("key_centering: \"pre_rope\" rope { base: 0.5 }", "rope base");
  check("key_centering: \"pre_rope\" rope { base: 10000 rotary_dims: 66 }", "rotary_dims");
  check("rope { base: 10000 scaling_type: \"yarn\" }", "scaling_type");
  check("exact_recent_tokens: -3", "exact_recent_tokens");
  check("exact_sink_tokens: 5000", "exact_sink_tokens");
  check("centering_pairs: 40", "centering_pairs");
  check("protected_layers { layers: 2 preset: \"fp16\" }", "layer 2");
  check("protected_layers { layers: 1 }", "no preset");
  check("protected_layers { layers: 1 preset: \"fp16\" } protected_layers { layers: 1 preset: \"fp8\" }", "twice");
  check("key_centering: \"pre_rope\" key_scales { layer: 2 scales: [1] }", "layer 2");
  check("key_centering: \"pre_rope\" key_scales { layer: 1 scales: [1, 2] }", "64");
  check("key_centering: \"none\" key_scales { layer: 1 }", "key_scales");
  check("layer_ropes { layers: 2 rope { base: 10000 } }", "layer 2");
  check("layer_ropes { layers: 1 rope { } }", "no base");
  check("key_centering: \"pre_rope\" layer_ropes { layers: 1 rope { base: 10000 } }", "the cache has none");
  check("layer_ropes { layers: 1 rope { base: 10000 } } layer_ropes { layers: 1 rope { base: 1e6 } }", "twice");
  check("key_centering: \"pre_rope\" rope { base: 1e6 } layer_ropes { layers: 0 rope { base: 1e4 rotary_dims: 66 } }",
        "layer 0's rope");
}

TEST(ServerConfig, ReadsLayerRopesAndWritesThemBack) {
  // Gemma 3 270M: base 1e6 on the global layers (5, 11, 17), 1e4 on the others.
  absl::StatusOr<v1::ServerConfig> config = ParseServerConfig(R"pb(
    caches {
      name: "gemma"
      num_layers: 18
      num_kv_heads: 1
      num_query_heads: 4
      head_dim: 256
      preset: "tqkv_k3v4u_csw"
      boundary_layers: 0
      rope { pair_layout: HALF_SPLIT base: 1e6 }
      layer_ropes {
        layers: [ 0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16 ]
        rope { pair_layout: HALF_SPLIT base: 10000 }
      }
      sliding_window_layers {
        layers: [ 0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16 ]
        window: 512
      }
    }
  )pb");
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::vector<CacheOptions>> caches = ToCacheOptions(*config, 64 << 20);
  ASSERT_TRUE(caches.ok()) << caches.status();
  const KvLayoutOptions& l = (*caches)[0].layout;
  ASSERT_EQ(l.layer_ropes.size(), 18u);
  for (int layer = 0; layer < 18; ++layer) {
    EXPECT_EQ(l.layer_ropes[layer].known(), (layer + 1) % 6 != 0) << layer;
  }
  EXPECT_EQ(l.layer_ropes[0].base, 10000.0);
  EXPECT_EQ(l.layer_ropes[0].pair_layout, RopePairLayout::kHalfSplit);
  auto layout = KvLayout::Create(l);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_DOUBLE_EQ((*layout)->rope(0).inv_freq(1), std::pow(1e4, -2.0 / 256));
  EXPECT_DOUBLE_EQ((*layout)->rope(5).inv_freq(1), std::pow(1e6, -2.0 / 256));
  const v1::CacheConfig back = ToCacheConfig((*caches)[0]);
  ASSERT_EQ(back.layer_ropes_size(), 1);
  EXPECT_EQ(back.layer_ropes(0).rope().base(), 10000.0);
  EXPECT_EQ(back.layer_ropes(0).layers_size(), 15);
  EXPECT_EQ(back.rope().base(), 1e6);
  // What GetServerInfo reports parses back to the same RoPE per layer.
  v1::ServerConfig again;
  *again.add_caches() = back;
  absl::StatusOr<std::vector<CacheOptions>> reread = ToCacheOptions(again, 64 << 20);
  ASSERT_TRUE(reread.ok()) << reread.status();
  const KvLayoutOptions& r = (*reread)[0].layout;
  ASSERT_EQ(r.layer_ropes.size(), 18u);
  for (int layer = 0; layer < 18; ++layer) {
    EXPECT_EQ(r.layer_ropes[layer].known(), l.layer_ropes[layer].known()) << layer;
    EXPECT_EQ(r.layer_ropes[layer].base, l.layer_ropes[layer].base) << layer;
    EXPECT_EQ(r.layer_ropes[layer].pair_layout, l.layer_ropes[layer].pair_layout) << layer;
  }
}

TEST(ServerConfig, ReadsKeyScalesAndWritesThemBack) {
  std::string scales;
  for (int j = 0; j < 64; ++j) scales += (j ? ", " : "") + std::to_string(0.5 + j / 64.0);
  absl::StatusOr<v1::ServerConfig> config = ParseServerConfig(
      "caches { num_layers: 3 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 preset: \"tqkv_k3v4u_csw\" "
      "key_scales { layer: 1 scales: [" +
      scales + "] } }");
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::vector<CacheOptions>> caches = ToCacheOptions(*config, 64 << 20);
  ASSERT_TRUE(caches.ok()) << caches.status();
  const KvLayoutOptions& l = (*caches)[0].layout;
  ASSERT_EQ(l.key_scales.size(), 3u * 64);
  EXPECT_EQ(l.key_scales[0], 1.0f);  // layers without an entry: 1
  EXPECT_EQ(l.key_scales[64 + 10], 0.5f + 10 / 64.0f);
  const v1::CacheConfig back = ToCacheConfig((*caches)[0]);
  ASSERT_EQ(back.key_scales_size(), 1);
  EXPECT_EQ(back.key_scales(0).layer(), 1);
  EXPECT_EQ(back.key_scales(0).scales_size(), 64);
}

TEST(ServerConfig, ReadsSequenceKeyScalesAndWritesThemBack) {
  const auto caches = [](const std::string& fields) -> absl::StatusOr<std::vector<CacheOptions>> {
    absl::StatusOr<v1::ServerConfig> config = ParseServerConfig(
        "caches { num_layers: 3 num_kv_heads: 2 num_query_heads: 2 head_dim: 64 preset: \"tqkv_k3v4u_csw\" " + fields +
        " }");
    if (!config.ok()) return config.status();
    return ToCacheOptions(*config, 64 << 20);
  };
  absl::StatusOr<std::vector<CacheOptions>> on = caches("sequence_key_scales: true");
  ASSERT_TRUE(on.ok()) << on.status();
  absl::StatusOr<std::shared_ptr<const KvLayout>> layout = KvLayout::Create((*on)[0].layout);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_TRUE((*layout)->sequence_key_scales());
  EXPECT_EQ((*layout)->mean_floats(), 2 * 2 * 64);  // the means, then the scales
  EXPECT_TRUE(ToCacheConfig((*on)[0]).sequence_key_scales());
  absl::StatusOr<std::vector<CacheOptions>> off = caches("sequence_key_scales: false");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(ToCacheConfig((*off)[0]).sequence_key_scales());
  EXPECT_EQ((*KvLayout::Create((*off)[0].layout))->mean_floats(), 2 * 64);
  std::string scales;
  for (int j = 0; j < 128; ++j) scales += j ? ", 1" : "1";
  for (const auto& [fields, why] :
       {std::pair<std::string, const char*>{"key_centering: \"none\" sequence_key_scales: true", "key_centering"},
        {"sequence_key_scales: true key_scales { layer: 0 scales: [" + scales + "] }", "both set"}}) {
    absl::StatusOr<std::vector<CacheOptions>> bad = caches(fields);
    ASSERT_FALSE(bad.ok()) << fields;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(bad.status().message(), HasSubstr(why)) << bad.status();
  }
  // Calibrated key_scales take the place of the recipe's sequence scales.
  absl::StatusOr<std::vector<CacheOptions>> calibrated = caches("key_scales { layer: 0 scales: [" + scales + "] }");
  ASSERT_TRUE(calibrated.ok()) << calibrated.status();
  EXPECT_FALSE(ToCacheConfig((*calibrated)[0]).sequence_key_scales());
}

TEST(ServerConfig, ReadsSlidingWindowLayersAndWritesThemBack) {
  // Gemma 3 270M's pattern: every sixth layer global, the others a window of 512.
  absl::StatusOr<v1::ServerConfig> config = ParseServerConfig(R"pb(
    caches {
      name: "gemma"
      num_layers: 18
      num_kv_heads: 1
      num_query_heads: 4
      head_dim: 256
      preset: "turboquant_k3v4_nc"
      boundary_layers: 0
      sliding_window_layers {
        layers: [ 0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16 ]
        window: 512
      }
    }
    caches {
      name: "mixed"
      num_layers: 4
      num_kv_heads: 1
      num_query_heads: 1
      head_dim: 64
      sliding_window_layers {
        layers: [ 0, 2 ]
        window: 128
      }
      sliding_window_layers { layers: 3 window: 4096 }
    }
    caches { name: "plain" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 }
  )pb");
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::vector<CacheOptions>> caches = ToCacheOptions(*config, 64 << 20);
  ASSERT_TRUE(caches.ok()) << caches.status();
  std::vector<int> want(18, 512);
  for (int layer : {5, 11, 17}) want[layer] = 0;
  EXPECT_EQ((*caches)[0].layout.layer_windows, want);
  EXPECT_EQ((*caches)[1].layout.layer_windows, (std::vector<int>{128, 0, 128, 4096}));
  EXPECT_TRUE((*caches)[2].layout.layer_windows.empty());
  // Round trip: what GetServerInfo reports parses back to the same windows.
  for (const CacheOptions& options : *caches) {
    v1::ServerConfig again;
    *again.add_caches() = ToCacheConfig(options);
    absl::StatusOr<std::vector<CacheOptions>> back = ToCacheOptions(again, 64 << 20);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ((*back)[0].layout.layer_windows, options.layout.layer_windows) << options.name;
  }
  const v1::CacheConfig mixed = ToCacheConfig((*caches)[1]);
  ASSERT_EQ(mixed.sliding_window_layers_size(), 2);
  EXPECT_EQ(mixed.sliding_window_layers(0).window(), 128);
  EXPECT_THAT(mixed.sliding_window_layers(0).layers(), ::testing::ElementsAre(0, 2));
  EXPECT_EQ(mixed.sliding_window_layers(1).window(), 4096);
  EXPECT_EQ(ToCacheConfig((*caches)[2]).sliding_window_layers_size(), 0);
}

TEST(ServerConfig, RejectsBadSlidingWindowLayers) {
  const auto check = [](const std::string& fields, const char* substring) {
    absl::StatusOr<v1::ServerConfig> config =
        ParseServerConfig("caches { num_layers: 4 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 " + fields + " }");
    ASSERT_TRUE(config.ok()) << config.status();
    absl::StatusOr<std::vector<CacheOptions>> caches = ToCacheOptions(*config, 1 << 30);
    ASSERT_FALSE(caches.ok()) << fields;
    EXPECT_EQ(caches.status().code(), absl::StatusCode::kInvalidArgument) << caches.status();
    EXPECT_THAT(caches.status().message(), HasSubstr(substring)) << caches.status();
  };
  check("sliding_window_layers { layers: 1 window: 0 }", "at least 1");
  check("sliding_window_layers { layers: 1 window: -5 }", "at least 1");
  check("sliding_window_layers { layers: 4 window: 8 }", "layer 4");
  check("sliding_window_layers { layers: [1, 1] window: 8 }", "twice");
  check("sliding_window_layers { layers: 1 window: 8 } sliding_window_layers { layers: 1 window: 16 }", "twice");
}

}  // namespace
}  // namespace service
}  // namespace tqkv
