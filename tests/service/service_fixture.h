// The service integration tests' shared parts (service_test.cc,
// service_server_test.cc): the test layouts, K/V builders, a plain HTTP GET
// for /metrics, and ServiceTest, which starts the real server on an
// ephemeral loopback port with a real tqkv::Client (and the raw generated
// stub, for bytes the client would refuse to build).
#ifndef TQKV_TESTS_SERVICE_SERVICE_FIXTURE_H_
#define TQKV_TESTS_SERVICE_SERVICE_FIXTURE_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <sstream>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/impl/codegen/rpc_method.h>
#include <grpcpp/impl/codegen/sync_stream.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/client_interceptor.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cache/kv_cache.h"
#include "client/cpp/tqkv_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "grpc_std.pb.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/float_formats.h"
#include "service/config.h"
#include "service/server.h"
#include "tests/service/random_floats.h"

namespace tqkv {
namespace service_test {

inline constexpr int kLayers = 4;
inline constexpr int kKvHeads = 2;
inline constexpr int kQueryHeads = 4;
inline constexpr int kHeadDim = 64;
inline constexpr int kThreads = 2;
inline constexpr int kMaxMessageBytes = 1 << 20;

// "default": the layout the tests use; "tiny": the same layout with room for
// three pages, to fill the pool.
inline constexpr char kConfig[] = R"pb(
  caches {
    name: "default"
    num_layers: 4
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 64
    page_tokens: 4
    preset: "turboquant_k3v4_nc"
    boundary_layers: 1
    memory_budget_bytes: 4194304
  }
  caches {
    name: "tiny"
    num_layers: 4
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 64
    page_tokens: 4
    preset: "turboquant_k3v4_nc"
    boundary_layers: 1
  }
)pb";

// K/V for `tokens` tokens of `layers` layers.
struct Kv {
  int layers = kLayers;
  int64_t tokens = 0;
  std::vector<float> keys, values;
};

inline Kv MakeKv(int64_t tokens, uint32_t seed, int layers = kLayers) {
  const size_t n = static_cast<size_t>(layers) * tokens * kKvHeads * kHeadDim;
  return Kv{layers, tokens, RandomFloats(n, seed), RandomFloats(n, seed + 1000)};
}

inline AppendArgs MakeAppend(const std::string& id, int64_t start, const Kv& kv, int layer_begin = 0) {
  AppendArgs a;
  a.sequence_id = id;
  a.start_position = start;
  a.layer_begin = layer_begin;
  a.layer_end = layer_begin + kv.layers;
  a.shape = {kv.layers, kv.tokens, kKvHeads, kHeadDim};
  a.keys = kv.keys;
  a.values = kv.values;
  return a;
}

// AppendArgs only points at the data: keep the Kv alive.
inline AppendArgs MakeAppend(const std::string& id, int64_t start, Kv&& kv, int layer_begin = 0) = delete;

// GET http://127.0.0.1:port/path over a plain socket; the body, or "" on error.
inline std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
    }
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// The value of the first sample line of `text` that starts with `name` and
// contains every one of `labels` (e.g. "cache=\"default\""); -1 if none.
inline double Sample(const std::string& text, const std::string& name, std::initializer_list<std::string> labels = {}) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name, 0) != 0) continue;
    if (line.size() <= name.size() || (line[name.size()] != '{' && line[name.size()] != ' ')) {
      continue;
    }
    bool all = true;
    for (const std::string& l : labels) all = all && line.find(l) != std::string::npos;
    if (all) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return -1;
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(); }

  void StartServer() {
    service::ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(kConfig);
    ASSERT_TRUE(config.ok()) << config.status();
    options.config = *config;
    options.threads = kThreads;
    options.max_message_bytes = kMaxMessageBytes;
    // civetweb needs ~2 s to stop its listener: only the metrics test pays.
    options.metrics_port = with_metrics_ ? 0 : -1;
    options.memory_budget_bytes = 1;  // "tiny" gets 0 -> fixed below
    // Give "tiny" exactly three pages.
    absl::StatusOr<std::vector<CacheOptions>> probe = service::ToCacheOptions(options.config, uint64_t{1} << 30);
    ASSERT_TRUE(probe.ok()) << probe.status();
    absl::StatusOr<std::shared_ptr<const KvLayout>> layout = KvLayout::Create((*probe)[0].layout);
    ASSERT_TRUE(layout.ok());
    page_bytes_ = (*layout)->page_bytes();
    options.config.mutable_caches(1)->set_memory_budget_bytes(3 * page_bytes_);
    absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ClientOptions client_options;
    client_options.target = absl::StrCat("127.0.0.1:", server_->port());
    client_options.max_attempts = 2;
    client_options.initial_backoff = absl::Milliseconds(5);
    client_options.timeout = absl::Seconds(20);
    client_ = std::make_unique<Client>(client_options);
    channel_ = grpc::CreateChannel(client_options.target, grpc::InsecureChannelCredentials());
    stub_ = v1::KvCache::NewStub(channel_);
  }

  // A cache library instance with the server's "default" options, on its own
  // CPU backend: the reference for exact comparisons.
  std::unique_ptr<KvCache> Reference() {
    absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(kConfig);
    absl::StatusOr<std::vector<CacheOptions>> options = service::ToCacheOptions(*config, uint64_t{1} << 30);
    if (!options.ok()) return nullptr;
    if (reference_backend_ == nullptr) {
      CpuBackendOptions backend;  // the server's defaults (integer attention where the CPU has it)
      backend.num_threads = kThreads;
      reference_backend_ = MakeCpuBackend(backend);
    }
    absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create((*options)[0], reference_backend_.get());
    return cache.ok() ? *std::move(cache) : nullptr;
  }

  static void ReferenceAppend(KvCache& cache, const std::string& id, int64_t start, const Kv& kv, int layer_begin = 0) {
    AppendRequest r;
    r.sequence_id = id;
    r.start_position = start;
    r.layer_begin = layer_begin;
    r.layer_end = layer_begin + kv.layers;
    r.num_tokens = kv.tokens;
    r.keys = kv.keys.data();
    r.values = kv.values.data();
    ASSERT_TRUE(cache.Append(r).ok());
  }

  SequenceState MustGet(const std::string& id, const std::string& cache = "") {
    absl::StatusOr<SequenceState> s = client_->GetSequence(cache, id);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : SequenceState{};
  }

  v1::CacheInfo CacheStats(const std::string& name) {
    absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    for (const v1::CacheInfo& c : info->caches()) {
      if (c.config().name() == name) return c;
    }
    ADD_FAILURE() << "no cache " << name;
    return {};
  }

  bool with_metrics_ = false;
  size_t page_bytes_ = 0;
  std::unique_ptr<Backend> reference_backend_;
  std::unique_ptr<service::Server> server_;
  std::unique_ptr<Client> client_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

}  // namespace service_test
}  // namespace tqkv

#endif  // TQKV_TESTS_SERVICE_SERVICE_FIXTURE_H_
