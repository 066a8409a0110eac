// `tqkv load`'s generator (cli::RunLoad) against the real server on a
// loopback port: 8 clients for about a second, every method called, no errors.
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/cli/decode_load.h"
#include "client/cli/load_generator.h"
#include "gtest/gtest.h"
#include "service/config.h"
#include "service/server.h"

namespace tqkv {
namespace {

constexpr char kConfig[] = R"pb(
  caches {
    name: "default"
    num_layers: 4
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 64
    page_tokens: 8
    preset: "turboquant_k3v4_nc"
    boundary_layers: 1
    memory_budget_bytes: 16777216
  }
)pb";

// The server both generators play against, on a free loopback port.
absl::StatusOr<std::unique_ptr<service::Server>> StartServer() {
  service::ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.metrics_port = -1;
  options.threads = 2;
  absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(kConfig);
  if (!config.ok()) return config.status();
  options.config = *config;
  return service::Server::Start(options);
}

TEST(LoadGenerator, EightClientsForASecondCallEveryMethodWithoutErrors) {
  absl::StatusOr<std::unique_ptr<service::Server>> server = StartServer();
  ASSERT_TRUE(server.ok()) << server.status();

  cli::LoadOptions options;
  options.client.target = absl::StrCat("127.0.0.1:", (*server)->port());
  options.client.timeout = absl::Seconds(30);
  options.clients = 8;
  options.duration_seconds = 1;
  options.prefill_tokens = 24;
  options.prefill_chunk_tokens = 16;  // the prefill goes as an AppendStream
  options.decode_steps = 4;
  options.score_every = 2;
  options.top_k = 4;
  int progress_calls = 0;
  options.progress = [&](double, int64_t, int64_t) { ++progress_calls; };
  absl::StatusOr<cli::LoadReport> report = cli::RunLoad(options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->errors, 0) << report->first_error;
  EXPECT_GT(report->calls, 0);
  EXPECT_GT(report->tokens_appended, 0);
  std::map<std::string, cli::MethodStats> by_method;
  for (const cli::MethodStats& m : report->methods) by_method[m.method] = m;
  for (const char* method : {"AppendStream", "Append", "Attend", "ScoreQuery", "DropSequence"}) {
    ASSERT_TRUE(by_method.count(method)) << method;
    EXPECT_GT(by_method[method].calls, 0) << method;
    EXPECT_EQ(by_method[method].errors, 0) << method;
    EXPECT_GT(by_method[method].calls_per_second, 0) << method;
    EXPECT_LE(by_method[method].p50_ms, by_method[method].p99_ms) << method;
  }
  // The server's timings made it into GetServerInfo.
  EXPECT_GT(report->server_attend_seconds, 0);
  EXPECT_GT(report->attend_kernel_share, 0);
  EXPECT_LE(report->attend_kernel_share, 1);
  // Every sequence was dropped at the end.
  absl::StatusOr<v1::ServerInfo> info = Client(options.client).GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->caches(0).sequences(), 0);
}

TEST(DecodeLoad, EveryVariantDecodesLayerByLayerAndDropsItsSequences) {
  absl::StatusOr<std::unique_ptr<service::Server>> server = StartServer();
  ASSERT_TRUE(server.ok()) << server.status();

  cli::DecodeLoadOptions options;
  options.client.target = absl::StrCat("127.0.0.1:", (*server)->port());
  options.client.timeout = absl::Seconds(30);
  options.clients = 2;
  options.batch = 3;
  options.context = 40;
  options.prefill_chunk_tokens = 16;
  options.steps = 5;
  options.wire_dtype = v1::DTYPE_BF16;
  absl::StatusOr<cli::DecodeLoadReport> report = cli::RunDecodeLoad(options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->layers, 4);
  ASSERT_EQ(report->variants.size(), 3u);
  for (const cli::DecodeVariantReport& v : report->variants) {
    SCOPED_TRACE(cli::DecodeVariantName(v.variant));
    EXPECT_EQ(v.errors, 0) << v.first_error;
    EXPECT_EQ(v.steps, 2 * 5);  // both engines, every step
    EXPECT_LE(v.step_p50_ms, v.step_p99_ms);
    EXPECT_GT(v.kernel_ms_per_step, 0);
    EXPECT_GT(v.kernel_share, 0);
    EXPECT_GE(v.outside_us_per_layer, 0);
    EXPECT_GT(v.tokens_per_second, v.tokens_per_second_per_sequence);
  }
  // Calls per step: (batch + 1) per layer unary, one per layer fused, none
  // (one message per layer) on the stream.
  EXPECT_DOUBLE_EQ(report->variants[0].rpcs_per_step, 4 * (3 + 1));
  EXPECT_DOUBLE_EQ(report->variants[1].rpcs_per_step, 4);
  EXPECT_DOUBLE_EQ(report->variants[2].rpcs_per_step, 0);
  EXPECT_DOUBLE_EQ(report->variants[2].messages_per_step, 4);
  absl::StatusOr<v1::ServerInfo> info = Client(options.client).GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->caches(0).sequences(), 0);
}

TEST(DecodeLoad, BadOptionsAndVariantNamesAreRefused) {
  cli::DecodeLoadOptions options;
  options.batch = 0;
  EXPECT_EQ(cli::RunDecodeLoad(options).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cli::ParseDecodeVariants("fused,bogus").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::vector<cli::DecodeVariant>> v = cli::ParseDecodeVariants("stream,unary");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, (std::vector<cli::DecodeVariant>{cli::DecodeVariant::kStream, cli::DecodeVariant::kUnary}));
}

TEST(LoadGenerator, ARunWithoutABoundIsRefused) {
  cli::LoadOptions options;
  options.duration_seconds = 0;
  options.requests = 0;
  EXPECT_EQ(cli::RunLoad(options).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tqkv
