// The routing rule of client/cpp/tqkv_client.h: RouteKey, and the
// `tqkv-route-key` metadata each rpc carries on the wire. The server here is
// the generated KvCache service with no method implemented (every call
// answers UNIMPLEMENTED) plus an interceptor that records the metadata each
// call arrived with: what a proxy in front of tqkv-servers would see.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include "absl/synchronization/mutex.h"
#include "client/cpp/tqkv_client.h"
#include "gtest/gtest.h"

namespace tqkv {
namespace {

TEST(RouteKey, IsTheTextBeforeTheFirstSlash) {
  EXPECT_EQ(RouteKey("chat-7"), "chat-7");
  EXPECT_EQ(RouteKey("chat-7/beam-2"), "chat-7");
  EXPECT_EQ(RouteKey("chat-7/beam-2/draft"), "chat-7");
  EXPECT_EQ(RouteKey("chat-7/"), "chat-7");
  EXPECT_EQ(RouteKey("/x"), "");
  EXPECT_EQ(RouteKey(""), "");
}

// method -> route keys of its calls, "<none>" for a call without the header.
class Recorder {
 public:
  void Add(const std::string& method, const std::string& key) {
    absl::MutexLock lock(&mu_);
    calls_[method].push_back(key);
  }
  std::map<std::string, std::vector<std::string>> Take() {
    absl::MutexLock lock(&mu_);
    return std::move(calls_);
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::vector<std::string>> calls_ ABSL_GUARDED_BY(mu_);
};

class RecordingInterceptor : public grpc::experimental::Interceptor {
 public:
  RecordingInterceptor(grpc::experimental::ServerRpcInfo* info, Recorder* recorder)
      : info_(info), recorder_(recorder) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      std::string key = "<none>";
      int count = 0;
      for (const auto& [name, value] : *methods->GetRecvInitialMetadata()) {
        if (std::string(name.data(), name.size()) == kRouteKeyMetadata) {
          key.assign(value.data(), value.size());
          ++count;
        }
      }
      if (count > 1) key = "<repeated>";
      std::string method = info_->method();
      recorder_->Add(method.substr(method.rfind('/') + 1), key);
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* info_;
  Recorder* recorder_;
};

class RecordingFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RecordingFactory(Recorder* recorder) : recorder_(recorder) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new RecordingInterceptor(info, recorder_);
  }

 private:
  Recorder* recorder_;
};

class RouteKeyOnTheWire : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> f;
    f.push_back(std::make_unique<RecordingFactory>(&recorder_));
    builder.experimental().SetInterceptorCreators(std::move(f));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override { server_->Shutdown(); }

  ClientOptions Options() const {
    ClientOptions options;
    options.target = "127.0.0.1:" + std::to_string(port_);
    options.max_attempts = 1;
    return options;
  }

  // One call of every rpc; each answers UNIMPLEMENTED.
  static void CallEveryRpc(Client& client) {
    const std::vector<float> kv(2 * 4, 0.5f);
    AppendArgs append;
    append.sequence_id = "chat-1/beam-0";
    append.shape = {1, 2, 1, 4};
    append.keys = kv;
    append.values = kv;
    EXPECT_EQ(client.Append(append).status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(client.AppendStream({append}).status().code(), absl::StatusCode::kUnimplemented);

    const std::vector<float> q(4, 1.0f);
    ScoreArgs score;
    score.sequence_id = "chat-2";
    score.shape = {1, 4};
    score.queries = q;
    EXPECT_EQ(client.Score(score).status().code(), absl::StatusCode::kUnimplemented);

    AttendArgs attend;
    for (const char* id : {"chat-3/a", "chat-4"}) {
      AttendItemArgs item;
      item.sequence_id = id;
      item.shape = {1, 1, 4};
      item.queries = q;
      attend.items.push_back(item);
    }
    EXPECT_EQ(client.Attend(attend).status().code(), absl::StatusCode::kUnimplemented);

    EXPECT_EQ(client.CreateSequence("", "chat-5").status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(client.ForkSequence("", "chat-6", "other-7").status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(client.DropSequence("", "chat-8/x/y").code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(client.GetSequence("", "chat 9").status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(client.GetServerInfo().status().code(), absl::StatusCode::kUnimplemented);
    // Keys that cannot be an HTTP/2 header value travel without the header.
    EXPECT_EQ(client.GetSequence("", "/leading-slash").status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(client.GetSequence("", "caf\xc3\xa9/1").status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(client.GetSequence("", "tab\there").status().code(), absl::StatusCode::kUnimplemented);
  }

  v1::KvCache::CallbackService service_;  // every method: UNIMPLEMENTED
  Recorder recorder_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(RouteKeyOnTheWire, EveryRpcCarriesTheKeyOfTheSequenceItRoutesBy) {
  Client client(Options());
  CallEveryRpc(client);
  using Keys = std::vector<std::string>;
  const std::map<std::string, Keys> want = {
      {"Append", Keys{"chat-1"}},         {"AppendStream", Keys{"chat-1"}},
      {"ScoreQuery", Keys{"chat-2"}},     {"Attend", Keys{"chat-3"}},        // the first item's key
      {"CreateSequence", Keys{"chat-5"}}, {"ForkSequence", Keys{"chat-6"}},  // the parent's key
      {"DropSequence", Keys{"chat-8"}},   {"GetSequence", Keys{"chat 9", "<none>", "<none>", "<none>"}},
      {"GetServerInfo", Keys{"<none>"}},
  };
  EXPECT_EQ(recorder_.Take(), want);
}

TEST_F(RouteKeyOnTheWire, OptionOffSendsNoKey) {
  ClientOptions options = Options();
  options.send_route_key = false;
  Client client(options);
  CallEveryRpc(client);
  for (const auto& [method, keys] : recorder_.Take()) {
    for (const std::string& key : keys) EXPECT_EQ(key, "<none>") << method;
  }
}

}  // namespace
}  // namespace tqkv
