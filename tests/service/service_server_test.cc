// Integration tests of the server as a whole: metrics as data moves,
// retried calls whose answer was lost, the start-up choice of backends,
// byte accounting against the pool, and the client's retries. The fixture
// is in service_fixture.h.
#include <string>
#include <thread>
#include <vector>

#include "tests/service/service_fixture.h"

namespace tqkv {
namespace service_test {
namespace {

using ::testing::HasSubstr;

class MetricsTest : public ServiceTest {
 protected:
  MetricsTest() { with_metrics_ = true; }
};

TEST_F(MetricsTest, MetricsMoveAsDataIsAppended) {
  ASSERT_GT(server_->metrics_port(), 0);
  std::string text = HttpGet(server_->metrics_port(), "/metrics");
  ASSERT_FALSE(text.empty());
  const std::string def = "cache=\"default\"";
  EXPECT_EQ(Sample(text, "tqkv_cache_bytes_saved", {def}), 0);
  EXPECT_EQ(Sample(text, "tqkv_cache_pool_compression_ratio", {def}), 0);
  EXPECT_EQ(Sample(text, "tqkv_cache_pages_total", {def}), static_cast<double>((4u << 20) / page_bytes_));
  EXPECT_EQ(Sample(text, "tqkv_kernel_duration_seconds_count", {"kernel=\"store\"", "backend=\"cpu\""}), 0);

  const Kv kv = MakeKv(9, 95);
  absl::StatusOr<AppendResult> r = client_->Append(MakeAppend("m", 0, kv));
  ASSERT_TRUE(r.ok());
  const std::vector<float> q = RandomFloats(kQueryHeads * kHeadDim, 96);
  AttendArgs attend;
  attend.items = {{"m", 1, {1, kQueryHeads, kHeadDim}, q}};
  ASSERT_TRUE(client_->Attend(attend).ok());
  EXPECT_FALSE(client_->GetSequence("", "missing").ok());

  // A call is counted just after it is answered: wait (boundedly) until the
  // three are, so that no verdict depends on scheduling.
  const auto counted = [](const std::string& t) {
    return Sample(t, "tqkv_rpc_requests_total", {"method=\"Append\"", "code=\"OK\""}) >= 1 &&
           Sample(t, "tqkv_rpc_duration_seconds_count", {"method=\"Attend\""}) >= 1 &&
           Sample(t, "tqkv_rpc_errors_total", {"method=\"GetSequence\"", "code=\"NOT_FOUND\""}) >= 1;
  };
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20);;) {
    text = HttpGet(server_->metrics_port(), "/metrics");
    if (counted(text) || absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(Sample(text, "tqkv_cache_stored_bytes", {def}), r->stored_bytes);
  EXPECT_EQ(Sample(text, "tqkv_cache_stored_bytes_bf16", {def}), r->stored_bytes_bf16);
  EXPECT_EQ(Sample(text, "tqkv_cache_bytes_saved", {def}), r->stored_bytes_bf16 - r->stored_bytes);
  EXPECT_GT(Sample(text, "tqkv_cache_compression_ratio", {def}), 1.5);
  EXPECT_EQ(Sample(text, "tqkv_cache_pages_used", {def}), 3);
  EXPECT_EQ(Sample(text, "tqkv_cache_pool_bytes_used", {def}), 3.0 * page_bytes_);
  EXPECT_DOUBLE_EQ(Sample(text, "tqkv_cache_pool_compression_ratio", {def}),
                   static_cast<double>(r->stored_bytes_bf16) / (3.0 * page_bytes_));
  EXPECT_EQ(Sample(text, "tqkv_cache_sequences", {def}), 1);
  EXPECT_EQ(Sample(text, "tqkv_cache_tokens", {def}), 9);
  EXPECT_EQ(Sample(text, "tqkv_cache_evictions_total", {def}), 0);
  EXPECT_EQ(Sample(text, "tqkv_kernel_duration_seconds_count", {"kernel=\"store\""}), 1);
  EXPECT_EQ(Sample(text, "tqkv_kernel_duration_seconds_count", {"kernel=\"attend\""}), 1);
  EXPECT_EQ(Sample(text, "tqkv_rpc_requests_total", {"method=\"Append\"", "code=\"OK\""}), 1);
  EXPECT_EQ(Sample(text, "tqkv_rpc_errors_total", {"method=\"GetSequence\"", "code=\"NOT_FOUND\""}), 1);
  EXPECT_EQ(Sample(text, "tqkv_rpc_duration_seconds_count", {"method=\"Attend\""}), 1);
  // The executor: the calls ran on it (each is counted just after it
  // answered, so the last may not be yet), none waits now.
  EXPECT_EQ(Sample(text, "tqkv_executor_max_pending"), 1024);
  EXPECT_EQ(Sample(text, "tqkv_executor_queued"), 0);
  EXPECT_EQ(Sample(text, "tqkv_executor_rejected_total"), 0);
  EXPECT_GE(Sample(text, "tqkv_executor_completed_total"), 2);
  // The text served equals the in-process rendering's families.
  EXPECT_NE(server_->MetricsText().find("tqkv_cache_bytes_saved"), std::string::npos);
}

// Replaces the status of the first `lost` calls of `method` with UNAVAILABLE
// after the server has handled them: the answer is lost, the effect is not.
class LoseAnswers : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  LoseAnswers(std::string method, int lost) : method_(std::move(method)), lost_(lost) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo* info) override {
    if (method_ != info->method()) return nullptr;
    return new Interceptor(&lost_);
  }

 private:
  class Interceptor : public grpc::experimental::Interceptor {
   public:
    explicit Interceptor(std::atomic<int>* lost) : lost_(lost) {}
    void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
      if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::POST_RECV_STATUS) &&
          lost_->fetch_sub(1) > 0) {
        *methods->GetRecvStatus() = grpc::Status(grpc::StatusCode::UNAVAILABLE, "answer lost (test)");
      }
      methods->Proceed();
    }

   private:
    std::atomic<int>* lost_;
  };

  const std::string method_;
  std::atomic<int> lost_;
};

TEST_F(ServiceTest, RetriedCallsWhoseFirstAnswerWasLostSucceedOnce) {
  const auto client_losing = [&](const char* method) {
    std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
    factories.push_back(std::make_unique<LoseAnswers>(method, 1));
    auto channel = grpc::experimental::CreateCustomChannelWithInterceptors(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials(), grpc::ChannelArguments(),
        std::move(factories));
    ClientOptions options;
    options.initial_backoff = absl::Milliseconds(1);
    return std::make_unique<Client>(channel, options);
  };
  const Kv kv = MakeKv(6, 97);
  absl::StatusOr<AppendResult> r = client_losing("/tqkv.v1.KvCache/Append")->Append(MakeAppend("r", 0, kv));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sequence.layer_tokens, std::vector<int64_t>(kLayers, 6));
  EXPECT_EQ(MustGet("r").layer_tokens, std::vector<int64_t>(kLayers, 6));  // stored once

  // A retried append that did not land (wrong position) still fails.
  EXPECT_EQ(client_losing("/tqkv.v1.KvCache/Append")->Append(MakeAppend("r", 3, kv)).status().code(),
            absl::StatusCode::kFailedPrecondition);

  EXPECT_TRUE(client_losing("/tqkv.v1.KvCache/CreateSequence")->CreateSequence("", "n").ok());
  EXPECT_TRUE(client_losing("/tqkv.v1.KvCache/ForkSequence")->ForkSequence("", "r", "f").ok());
  EXPECT_TRUE(client_losing("/tqkv.v1.KvCache/DropSequence")->DropSequence("", "n").ok());
  EXPECT_EQ(client_->GetSequence("", "n").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MustGet("f").layer_tokens, std::vector<int64_t>(kLayers, 6));
}

// service_test links the real CUDA backend (where nvcc was found), so
// whether `--backend cuda` starts depends on the machine. The factory is
// asked at run time, as the server asks it, and the server must agree with
// it either way: no test here assumes a GPU is present or absent.
TEST(ServerStart, TakesTheCudaBackendExactlyWhereADeviceIsUsable) {
  BackendOptions probe_options;
  probe_options.name = "cuda";
  absl::StatusOr<std::unique_ptr<Backend>> probe = MakeBackend(probe_options);
  const bool usable = probe.ok();
  const absl::Status why_not = probe.status();
  probe = absl::UnavailableError("released");  // frees the probe's device memory first

  service::ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.config = *service::ParseServerConfig(kConfig);
  options.metrics_port = -1;
  options.memory_budget_bytes = uint64_t{64} << 20;  // small on any GPU
  options.backend = "cuda";
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
  if (usable) {
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ((*server)->backend().name(), "cuda");
    EXPECT_TRUE((*server)->backend().DeviceStatus().ok());
    server->reset();
  } else {
    // No device, no driver, or a build without CUDA: UNAVAILABLE, as the
    // factory said.
    EXPECT_EQ(why_not.code(), absl::StatusCode::kUnavailable) << why_not;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable) << server.status();
  }
  options.backend = "tpu";
  EXPECT_EQ(service::Server::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
}

// Options for a server on an ephemeral loopback port (2 threads, 16 MiB,
// no metrics) serving the caches of `config`, a ServerConfig textproto.
service::ServerOptions LoopbackOptions(const char* config) {
  service::ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.metrics_port = -1;
  options.threads = 2;
  options.memory_budget_bytes = uint64_t{16} << 20;
  absl::StatusOr<v1::ServerConfig> parsed = service::ParseServerConfig(config);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  if (parsed.ok()) options.config = *parsed;
  return options;
}

// --backend auto, per cache: a head dim of 100 is one the CUDA backend
// refuses (not a multiple of 8), so that cache runs on the CPU backend
// wherever a device is usable, and everything does where none is. Either
// way both caches serve, and the kernel metrics say which backend ran.
TEST(ServerStart, AutoPutsEachCacheOnABackendThatServesIt) {
  service::ServerOptions options = LoopbackOptions(R"pb(
    caches {
      name: "even"
      num_layers: 2
      num_kv_heads: 2
      num_query_heads: 4
      head_dim: 64
      page_tokens: 4
      preset: "turboquant_k3v4_nc"
      boundary_layers: 0
    }
    caches {
      name: "odd"
      num_layers: 2
      num_kv_heads: 2
      num_query_heads: 4
      head_dim: 100
      page_tokens: 4
      preset: "fp16"
      boundary_layers: 0
    }
  )pb");
  options.backend = "auto";
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string taken = (*server)->backend().name();
  ClientOptions client_options;
  client_options.target = absl::StrCat("127.0.0.1:", (*server)->port());
  Client client(client_options);
  for (const auto& [cache, d] : {std::pair<const char*, int>{"even", 64}, {"odd", 100}}) {
    const std::vector<float> keys = RandomFloats(static_cast<size_t>(2) * 3 * 2 * d, 7);
    AppendArgs append;
    append.cache = cache;
    append.sequence_id = "s";
    append.shape = {2, 3, 2, d};
    append.keys = keys;
    append.values = keys;
    absl::StatusOr<AppendResult> stored = client.Append(append);
    EXPECT_TRUE(stored.ok()) << cache << ": " << stored.status();
  }
  const std::string text = (*server)->MetricsText();
  const double cpu_stores = Sample(text, "tqkv_kernel_duration_seconds_count", {"kernel=\"store\"", "backend=\"cpu\""});
  if (taken == "cpu") {
    EXPECT_EQ(cpu_stores, 2);
  } else {
    EXPECT_EQ(taken, "cuda");
    EXPECT_EQ(cpu_stores, 1) << "the odd cache";
    EXPECT_EQ(Sample(text, "tqkv_kernel_duration_seconds_count", {"kernel=\"store\"", "backend=\"cuda\""}), 1);
  }
}

// Every byte figure an append answers is the change the pool's accounting
// made for it: with exact sinks and recent tokens, key centering and sliding-window
// layers, the answers of Append, AppendStream and AppendAttend (a retry
// included) sum to the sequence's stored_bytes, and the cache's sum is the
// sequences'.
TEST(ServerBytes, AppendAnswersSumToWhatThePoolHolds) {
  const service::ServerOptions options = LoopbackOptions(R"pb(
    caches {
      name: "default"
      num_layers: 4
      num_kv_heads: 2
      num_query_heads: 4
      head_dim: 64
      page_tokens: 4
      preset: "tqkv_k3v4u_csw"
      boundary_layers: 0
      exact_sink_tokens: 2
      exact_recent_tokens: 6
      sliding_window_layers { layers: 1 layers: 3 window: 5 }
    }
  )pb");
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions client_options;
  client_options.target = absl::StrCat("127.0.0.1:", (*server)->port());
  Client client(client_options);
  constexpr int kKv = 2, kQ = 4, kD = 64, kL = 4;
  int64_t sum[2] = {0, 0}, sum_bf16[2] = {0, 0};
  const auto check = [&](int s, const std::string& what) {
    absl::StatusOr<SequenceState> seq = client.GetSequence("", absl::StrCat("s", s));
    ASSERT_TRUE(seq.ok()) << seq.status();
    EXPECT_EQ(seq->stored_bytes, sum[s]) << what;
    EXPECT_EQ(seq->stored_bytes_bf16, sum_bf16[s]) << what;
    absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->caches(0).stored_bytes(), sum[0] + sum[1]) << what;
  };
  // s0: a prefill in one Append; s1: the same length as an AppendStream.
  const std::vector<float> kv = RandomFloats(static_cast<size_t>(kL) * 9 * kKv * kD, 3);
  AppendArgs prefill;
  prefill.sequence_id = "s0";
  prefill.shape = {kL, 9, kKv, kD};
  prefill.keys = kv;
  prefill.values = kv;
  absl::StatusOr<AppendResult> first = client.Append(prefill);
  ASSERT_TRUE(first.ok()) << first.status();
  sum[0] += first->stored_bytes;
  sum_bf16[0] += first->stored_bytes_bf16;
  EXPECT_EQ(first->sequence.stored_bytes, sum[0]);
  check(0, "after the prefill");
  std::vector<std::vector<float>> parts;
  std::vector<AppendArgs> chunks;
  for (int c = 0; c < 3; ++c) {
    parts.push_back(RandomFloats(static_cast<size_t>(kL) * 3 * kKv * kD, 10 + c));
    AppendArgs chunk = prefill;
    chunk.sequence_id = "s1";
    chunk.start_position = 3 * c;
    chunk.shape = {kL, 3, kKv, kD};
    chunk.keys = parts.back();
    chunk.values = parts.back();
    chunks.push_back(chunk);
  }
  absl::StatusOr<AppendResult> streamed = client.AppendStream(chunks);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  sum[1] += streamed->stored_bytes;
  sum_bf16[1] += streamed->stored_bytes_bf16;
  check(1, "after the stream");
  // Decode steps, layer by layer, past the exact recent tokens and the sliding window.
  const std::vector<float> token = RandomFloats(kKv * kD, 20);
  const std::vector<float> query = RandomFloats(kQ * kD, 21);
  for (int64_t t = 9; t < 20; ++t) {
    for (int layer = 0; layer < kL; ++layer) {
      AppendAttendArgs step;
      step.layer = layer;
      for (int s = 0; s < 2; ++s) {
        AppendAttendItemArgs item;
        item.sequence_id = absl::StrCat("s", s);
        item.start_position = t;
        item.kv_shape = {1, kKv, kD};
        item.query_shape = {1, kQ, kD};
        item.keys = token;
        item.values = token;
        item.queries = query;
        step.items.push_back(item);
      }
      absl::StatusOr<AppendAttendResult> r = client.AppendAttend(step);
      ASSERT_TRUE(r.ok()) << r.status();
      for (int s = 0; s < 2; ++s) ASSERT_TRUE(r->items[s].status.ok()) << r->items[s].status;
      // The answer sums its items: s1's share is the rest once s0's is known.
      absl::StatusOr<SequenceState> s0 = client.GetSequence("", "s0");
      ASSERT_TRUE(s0.ok()) << s0.status();
      const int64_t share = s0->stored_bytes - sum[0], share_bf16 = s0->stored_bytes_bf16 - sum_bf16[0];
      sum[0] += share;
      sum_bf16[0] += share_bf16;
      sum[1] += r->stored_bytes - share;
      sum_bf16[1] += r->stored_bytes_bf16 - share_bf16;
      // A retry of the same step lands nothing and counts nothing.
      absl::StatusOr<AppendAttendResult> again = client.AppendAttend(step);
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_TRUE(again->items[0].already_stored);
      EXPECT_EQ(again->stored_bytes, 0);
      EXPECT_EQ(again->stored_bytes_bf16, 0);
    }
    check(0, absl::StrCat("after step ", t));
    check(1, absl::StrCat("after step ", t));
  }
}

TEST(ClientRetries, GiveUpWithUnavailableWhenNoServerListens) {
  ClientOptions options;
  options.target = "127.0.0.1:1";  // nothing listens on port 1
  options.max_attempts = 3;
  options.initial_backoff = absl::Milliseconds(1);
  options.timeout = absl::Seconds(5);
  Client client(options);
  EXPECT_EQ(client.GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace service_test
}  // namespace tqkv
