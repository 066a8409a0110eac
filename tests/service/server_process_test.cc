// tqkv-server as a process (the binary this build made), stopped with
// SIGTERM while a client holds what clients hold open: an idle channel, a
// health Watch, a DecodeStream between steps, an AppendStream mid-call and
// unary appends in flight. The exit must come once the calls in flight are
// answered and the snapshot is written, not at the grace deadline; a stream
// whose client never ends it is cancelled at the deadline; every append the
// server acknowledged is there after a restart. Loopback only; the bounds are
// far from what they measure (seconds against milliseconds).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cpp/tqkv_client.h"
#include "grpc_std.pb.h"
#include "gtest/gtest.h"

extern char** environ;

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
    memory_budget_bytes: 67108864
  }
)pb";
constexpr int kLayers = 4;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 64;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A fresh directory under the test's temp dir, removed with what it holds.
class TempDir {
 public:
  TempDir() {
    std::string pattern = absl::StrCat(::testing::TempDir(), "/server_process_XXXXXX");
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // "" when it could not be made.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// One tqkv-server child process: its output goes to a log file; killed
// (SIGKILL) on destruction if still running.
class ServerProcess {
 public:
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  // Starts the server with `args` on a loopback port the kernel picks and
  // waits (30 s at most) for its start-up line.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(const std::string& dir, const std::string& name,
                                                              const std::vector<std::string>& args) {
    std::unique_ptr<ServerProcess> p(new ServerProcess());
    p->log_ = absl::StrCat(dir, "/", name, ".log");
    std::ofstream(absl::StrCat(dir, "/config.txt")) << kConfig;
    std::vector<std::string> argv = {TQKV_SERVER_BINARY,
                                     "--host",
                                     "127.0.0.1",
                                     "--port",
                                     "0",
                                     "--threads",
                                     "1",
                                     "--metrics_port",
                                     "0",
                                     "--config",
                                     absl::StrCat(dir, "/config.txt")};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> pointers;
    for (std::string& a : argv) pointers.push_back(a.data());
    pointers.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, p->log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    const int spawned = posix_spawn(&p->pid_, pointers[0], &actions, nullptr, pointers.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (spawned != 0) return absl::InternalError(absl::StrCat("cannot start ", TQKV_SERVER_BINARY));
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      const std::string log = ReadAll(p->log_);
      const size_t at = log.find("listening on 127.0.0.1:");
      if (at != std::string::npos && log.find('\n', at) != std::string::npos) {
        p->port_ = std::atoi(log.c_str() + at + std::strlen("listening on 127.0.0.1:"));
        return p;
      }
      if (waitpid(p->pid_, nullptr, WNOHANG) == p->pid_) {
        p->pid_ = -1;
        return absl::InternalError(absl::StrCat("tqkv-server exited at start-up:\n", log));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return absl::DeadlineExceededError(absl::StrCat("no start-up line in 30 s:\n", ReadAll(p->log_)));
  }

  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }
  std::string log() const { return ReadAll(log_); }
  void Signal(int signal) { kill(pid_, signal); }

  // The exit status (-1: killed by a signal), or DEADLINE_EXCEEDED when it
  // is still running after `timeout`.
  absl::StatusOr<int> WaitExit(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return absl::DeadlineExceededError(absl::StrCat("tqkv-server still running after ", absl::FormatDuration(timeout)));
  }

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  int port_ = 0;
  std::string log_;
};

ClientOptions Options(const std::string& target) {
  ClientOptions options;
  options.target = target;
  options.max_attempts = 1;  // a refused call is a refused call here
  options.timeout = absl::Seconds(20);
  return options;
}

// `tokens` tokens of every layer for `id` at `start`, as an AppendRequest.
v1::AppendRequest AppendChunk(const std::string& id, int64_t start, int64_t tokens) {
  v1::AppendRequest request;
  request.set_sequence_id(id);
  request.set_start_position(start);
  const std::vector<float> data(kLayers * tokens * kKvHeads * kHeadDim, 0.25f);
  for (v1::Tensor* t : {request.mutable_keys(), request.mutable_values()}) {
    t->set_dtype(v1::DTYPE_F32);
    for (int64_t d : {int64_t{kLayers}, tokens, int64_t{kKvHeads}, int64_t{kHeadDim}}) t->add_shape(d);
    t->set_data(data.data(), data.size() * sizeof(float));
  }
  return request;
}

// Appends 8 tokens at a time to `id`, one call every 10 ms, until a call
// fails or `stop` (or 4096 tokens, far more than the test's seconds take);
// the tokens the server acknowledged are in *acked.
void AppendUntilRefused(Client* client, const std::string& id, const std::atomic<bool>* stop,
                        std::atomic<int64_t>* acked) {
  const std::vector<float> data(kLayers * 8 * kKvHeads * kHeadDim, 0.5f);
  for (int i = 0; i < 512 && !stop->load(); ++i) {
    if (i > 0) absl::SleepFor(absl::Milliseconds(10));
    AppendArgs args;
    args.sequence_id = id;
    args.start_position = acked->load();
    args.shape = {kLayers, 8, kKvHeads, kHeadDim};
    args.keys = data;
    args.values = data;
    if (!client->Append(args).ok()) return;
    *acked += 8;
  }
}

// What clients leave open on a server between calls: an idle channel (one
// call, then nothing), a health Watch (as load balancers hold) and a
// DecodeStream between steps (one answered, the next not sent).
struct IdleClients {
  explicit IdleClients(const std::string& target)
      : idle(Options(target)), decoder(Options(target)),
        channel(grpc::CreateChannel(target, grpc::InsecureChannelCredentials())) {}

  ::testing::AssertionResult Open() {
    if (!idle.GetServerInfo().ok()) return ::testing::AssertionFailure() << "GetServerInfo";
    const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Watch", grpc::internal::RpcMethod::SERVER_STREAMING);
    watch.reset(grpc::internal::ClientReaderFactory<testing::HealthCheckResponse>::Create(
        channel.get(), method, &watch_context, testing::HealthCheckRequest()));
    testing::HealthCheckResponse health;
    if (!watch->Read(&health)) return ::testing::AssertionFailure() << "Watch";
    stream = decoder.OpenDecodeStream();
    if (!stream->Step(AppendAttendArgs()).ok()) return ::testing::AssertionFailure() << "DecodeStream";
    return ::testing::AssertionSuccess();
  }

  Client idle;
  Client decoder;
  std::shared_ptr<grpc::Channel> channel;
  grpc::ClientContext watch_context;
  std::unique_ptr<grpc::ClientReader<testing::HealthCheckResponse>> watch;
  std::unique_ptr<DecodeStream> stream;
};

int64_t Tokens(Client& client, const std::string& id) {
  absl::StatusOr<SequenceState> s = client.GetSequence("", id);
  return s.ok() ? s->layer_tokens.front() : -1;
}

TEST(ServerProcess, SigtermExitsOnceTheCallsInFlightAreAnswered) {
  const TempDir temp;  // outlives the servers
  const std::string& dir = temp.path();
  ASSERT_FALSE(dir.empty());
  const std::vector<std::string> args = {"--data_dir", dir + "/data", "--shutdown_grace_seconds", "30"};
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(dir, "first", args);
  ASSERT_TRUE(server.ok()) << server.status();

  IdleClients held((*server)->target());
  ASSERT_TRUE(held.Open());
  // An AppendStream mid-call: one chunk sent, the rest after the signal.
  Client streamer(Options((*server)->target()));
  grpc::ClientContext append_context;
  v1::AppendResponse appended;
  auto append = streamer.stub().AppendStream(&append_context, &appended);
  ASSERT_TRUE(append->Write(AppendChunk("streamed", 0, 8)));
  // Unary appends in flight when the signal comes, on two channels.
  Client writer_a(Options((*server)->target())), writer_b(Options((*server)->target()));
  std::atomic<bool> stop{false};
  std::atomic<int64_t> acked_a{0}, acked_b{0};
  std::thread a(AppendUntilRefused, &writer_a, "unary-a", &stop, &acked_a);
  std::thread b(AppendUntilRefused, &writer_b, "unary-b", &stop, &acked_b);
  absl::SleepFor(absl::Milliseconds(300));

  const absl::Time signalled = absl::Now();
  (*server)->Signal(SIGTERM);
  // The AppendStream's client finishes its call within the grace: it gets
  // its answer.
  absl::SleepFor(absl::Milliseconds(200));
  append->Write(AppendChunk("streamed", 8, 8));
  append->WritesDone();
  const grpc::Status streamed = append->Finish();
  absl::StatusOr<int> code = (*server)->WaitExit(absl::Seconds(60));
  const absl::Duration took = absl::Now() - signalled;
  stop = true;
  a.join();
  b.join();
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << (*server)->log();
  EXPECT_EQ(*code, 0) << (*server)->log();
  std::printf("SIGTERM to exit: %.2f s (grace 30 s)\n", absl::ToDoubleSeconds(took));
  // The grace is 30 s; nothing was in flight for more than a moment. (The
  // server held its exit to the deadline while a client kept a connection
  // or a stream open.)
  EXPECT_LT(took, absl::Seconds(10)) << (*server)->log();
  EXPECT_TRUE(streamed.ok()) << streamed.error_message();
  EXPECT_EQ(appended.sequence().layer_tokens(0), 16);
  EXPECT_NE((*server)->log().find("saved 3 sequences of cache 'default'"), std::string::npos) << (*server)->log();
  // The DecodeStream was told the server is going away.
  absl::StatusOr<DecodeStream::Response> after = held.stream->Receive();
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
  held.watch_context.TryCancel();

  absl::StatusOr<std::unique_ptr<ServerProcess>> restarted = ServerProcess::Start(dir, "second", args);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  Client reader(Options((*restarted)->target()));
  EXPECT_EQ(Tokens(reader, "streamed"), 16);
  EXPECT_GT(acked_a.load(), 0);
  EXPECT_GE(Tokens(reader, "unary-a"), acked_a.load());
  EXPECT_GE(Tokens(reader, "unary-b"), acked_b.load());
}

TEST(ServerProcess, SigtermCancelsAStreamItsClientNeverEndsAtTheGraceDeadline) {
  const TempDir temp;  // outlives the server
  const std::string& dir = temp.path();
  ASSERT_FALSE(dir.empty());
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(dir, "server", {"--data_dir", dir + "/data", "--shutdown_grace_seconds", "2"});
  ASSERT_TRUE(server.ok()) << server.status();
  Client client(Options((*server)->target()));
  grpc::ClientContext context;
  v1::AppendResponse response;
  auto append = client.stub().AppendStream(&context, &response);
  ASSERT_TRUE(append->Write(AppendChunk("held", 0, 8)));
  absl::SleepFor(absl::Milliseconds(200));

  const absl::Time signalled = absl::Now();
  (*server)->Signal(SIGTERM);
  absl::StatusOr<int> code = (*server)->WaitExit(absl::Seconds(60));
  const absl::Duration took = absl::Now() - signalled;
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << (*server)->log();
  EXPECT_EQ(*code, 0);
  std::printf("SIGTERM to exit with a stream held open: %.2f s (grace 2 s)\n", absl::ToDoubleSeconds(took));
  // The stream is a call in flight: it has its grace, and no more.
  EXPECT_GE(took, absl::Milliseconds(1900));
  EXPECT_LT(took, absl::Seconds(2 + 3)) << (*server)->log();
  EXPECT_FALSE(append->Finish().ok());
  struct stat snapshot;
  EXPECT_EQ(stat((dir + "/data/default.tqkv-snapshot").c_str(), &snapshot), 0) << (*server)->log();
}

}  // namespace
}  // namespace tqkv
