#include "service/config.h"

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
  EXPECT_EQ(c.layout.preset, "turboquant_k3v4_nc");
  EXPECT_EQ(c.layout.boundary_layers, 2);
  EXPECT_EQ(c.layout.boundary_preset, "fp16");
  EXPECT_EQ(c.memory_budget_bytes, size_t{1} << 30);
}

TEST(ServerConfig, SplitsTheBudgetAmongCachesWithoutOne) {
  absl::StatusOr<v1::ServerConfig> config = ParseServerConfig(R"pb(
    caches { name: "a" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 }
    caches { name: "b" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64
             memory_budget_bytes: 1000000 }
    caches { name: "c" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64
             idle_ttl_seconds: 30 }
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
  check("caches { name: \"a\" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 }"
        "caches { name: \"a\" num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 }",
        absl::StatusCode::kInvalidArgument, "appears twice");
  check("caches { num_layers: 0 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 }",
        absl::StatusCode::kInvalidArgument, ">= 1");
  check("caches { num_layers: 2 num_kv_heads: 2 num_query_heads: 3 head_dim: 64 }",
        absl::StatusCode::kInvalidArgument, "cache 'default'");
  check("caches { num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 preset: \"x\" }",
        absl::StatusCode::kNotFound, "cache 'default'");
  check("caches { num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 "
        "memory_budget_bytes: 10 }",
        absl::StatusCode::kInvalidArgument, "holds no page");
  check("caches { num_layers: 2 num_kv_heads: 1 num_query_heads: 1 head_dim: 64 "
        "idle_ttl_seconds: -1 }",
        absl::StatusCode::kInvalidArgument, "idle_ttl_seconds");
}

}  // namespace
}  // namespace service
}  // namespace tqkv
