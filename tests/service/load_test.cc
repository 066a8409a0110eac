// `tqkv load`'s generator (cli::RunLoad) against the real server on a
// loopback port: 8 clients for about a second, every method called, no errors.
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/cli/load_generator.h"
#include "gtest/gtest.h"
#include "service/config.h"
#include "service/server.h"

namespace tqkv {
namespace {

constexpr char kConfig[] = R"pb(
  caches {
    name: "default" num_layers: 4 num_kv_heads: 2 num_query_heads: 4 head_dim: 64
    page_tokens: 8 preset: "turboquant_k3v4_nc" boundary_layers: 1
    memory_budget_bytes: 16777216
  }
)pb";

TEST(LoadGenerator, EightClientsForASecondCallEveryMethodWithoutErrors) {
  service::ServerOptions server_options;
  server_options.host = "127.0.0.1";
  server_options.port = 0;
  server_options.metrics_port = -1;
  server_options.threads = 2;
  absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(kConfig);
  ASSERT_TRUE(config.ok()) << config.status();
  server_options.config = *config;
  absl::StatusOr<std::unique_ptr<service::Server>> server =
      service::Server::Start(server_options);
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

TEST(LoadGenerator, ARunWithoutABoundIsRefused) {
  cli::LoadOptions options;
  options.duration_seconds = 0;
  options.requests = 0;
  EXPECT_EQ(cli::RunLoad(options).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tqkv
