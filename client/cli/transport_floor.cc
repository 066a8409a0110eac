#include "client/cli/transport_floor.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace tqkv {
namespace cli {
namespace {

using Clock = std::chrono::steady_clock;

// One worker thread: the stand-in for tqkv-server's executor.
class Worker {
 public:
  Worker() : thread_([this] { Loop(); }) {}
  ~Worker() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Submit(std::function<void()> work) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(work));
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> work;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](Worker* w) { return w->stop_ || !w->queue_.empty(); }, this));
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
    }
  }
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

constexpr int64_t kMaxBytes = 256 << 20;

// `n` bytes whose first 8 hold `answer_bytes`: the size of the echo's answer.
grpc::ByteBuffer Bytes(int64_t n, int64_t answer_bytes) {
  std::string payload(static_cast<size_t>(n), '\x5a');
  if (n >= 8) std::memcpy(payload.data(), &answer_bytes, 8);
  grpc::Slice slice(payload);
  return grpc::ByteBuffer(&slice, 1);
}

// The answer size a request asks for; 0 when it is too short to say.
int64_t AnswerBytes(const grpc::ByteBuffer& request) {
  std::vector<grpc::Slice> slices;
  if (!request.Dump(&slices).ok()) return 0;
  char head[8];
  size_t have = 0;
  for (const grpc::Slice& slice : slices) {
    const size_t take = std::min(sizeof(head) - have, slice.size());
    std::memcpy(head + have, slice.begin(), take);
    have += take;
    if (have == sizeof(head)) break;
  }
  int64_t n = 0;
  if (have == sizeof(head)) std::memcpy(&n, head, 8);
  return std::clamp<int64_t>(n, 0, kMaxBytes);
}

// Answers every message of a stream (or the one of a call) with the size it
// asks for, built on the worker.
class EchoReactor : public grpc::ServerGenericBidiReactor {
 public:
  explicit EchoReactor(Worker* worker) : worker_(worker) { StartRead(&in_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    worker_->Submit([this] {
      const int64_t answer = AnswerBytes(in_);
      in_.Clear();
      out_ = Bytes(answer, 0);
      StartWrite(&out_);
    });
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    StartRead(&in_);
  }
  void OnDone() override { delete this; }

 private:
  Worker* const worker_;
  grpc::ByteBuffer in_, out_;
};

class EchoService : public grpc::CallbackGenericService {
 public:
  explicit EchoService(Worker* worker) : worker_(worker) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new EchoReactor(worker_);
  }

 private:
  Worker* const worker_;
};

// The child: serves until the parent closes `stop_fd` (or dies), then exits
// without running the parent's atexit handlers.
[[noreturn]] void ServeEcho(int port_fd, int stop_fd) {
  Worker worker;
  EchoService service(&worker);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&service);
  builder.SetMaxReceiveMessageSize(kMaxBytes);
  builder.SetMaxSendMessageSize(kMaxBytes);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) port = 0;
  (void)!write(port_fd, &port, sizeof(port));
  close(port_fd);
  char byte;
  while (read(stop_fd, &byte, 1) > 0) {
  }
  _exit(0);
}

bool Wait(grpc::CompletionQueue* cq) {
  void* tag = nullptr;
  bool ok = false;
  return cq->Next(&tag, &ok) && ok;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EchoServerProcess>> EchoServerProcess::Start() {
  int port_pipe[2], stop_pipe[2];
  if (pipe(port_pipe) != 0) return absl::UnavailableError("pipe failed");
  if (pipe(stop_pipe) != 0) {
    close(port_pipe[0]);
    close(port_pipe[1]);
    return absl::UnavailableError("pipe failed");
  }
  const pid_t pid = fork();
  if (pid < 0) return absl::UnavailableError(absl::StrCat("fork failed: ", strerror(errno)));
  if (pid == 0) {
    close(port_pipe[0]);
    close(stop_pipe[1]);
    ServeEcho(port_pipe[1], stop_pipe[0]);
  }
  close(port_pipe[1]);
  close(stop_pipe[0]);
  int port = 0;
  const bool got = read(port_pipe[0], &port, sizeof(port)) == sizeof(port);
  close(port_pipe[0]);
  std::unique_ptr<EchoServerProcess> echo(new EchoServerProcess(pid, port, stop_pipe[1]));
  if (!got || port == 0) return absl::UnavailableError("the echo server could not listen on loopback");
  return echo;
}

EchoServerProcess::~EchoServerProcess() {
  close(stop_fd_);
  int status = 0;
  if (waitpid(pid_, &status, 0) != pid_) kill(pid_, SIGKILL);
}

absl::StatusOr<TransportFloor> MeasureTransportFloor(int port, const TransportFloorOptions& options) {
  if (options.request_bytes < 8 || options.response_bytes < 0 || options.request_bytes > kMaxBytes ||
      options.response_bytes > kMaxBytes) {
    return absl::InvalidArgumentError(
        "want a request of [8, 256 MiB] bytes (it carries the answer's size) and an answer of at "
        "most 256 MiB");
  }
  if (options.messages < 10) return absl::InvalidArgumentError("want at least 10 messages");
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(kMaxBytes);
  arguments.SetMaxSendMessageSize(kMaxBytes);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(), arguments);
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  const std::string method = "/tqkv.bench.Echo/Echo";
  const grpc::ByteBuffer request = Bytes(options.request_bytes, options.response_bytes);

  std::unique_ptr<grpc::ClientContext> stream_context;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream;
  const auto open = [&]() -> bool {
    stream_context = std::make_unique<grpc::ClientContext>();
    stream = stub.PrepareCall(stream_context.get(), method, &cq);
    stream->StartCall(nullptr);
    return Wait(&cq);
  };
  const auto finish = [&] {
    stream->WritesDone(nullptr);
    Wait(&cq);
    grpc::Status status;
    stream->Finish(&status, nullptr);
    Wait(&cq);
  };
  if (!options.unary && !open()) return absl::UnavailableError("the echo stream did not open");

  std::vector<double> micros;
  const int64_t warmup = 50;
  for (int64_t i = 0; i < warmup + options.messages; ++i) {
    const Clock::time_point start = Clock::now();
    if (options.unary && !open()) return absl::UnavailableError("the echo call did not start");
    grpc::ByteBuffer copy = request;  // slices are shared, not copied
    stream->Write(copy, nullptr);
    if (!Wait(&cq)) return absl::UnavailableError("the echo write failed");
    grpc::ByteBuffer response;
    stream->Read(&response, nullptr);
    if (!Wait(&cq)) return absl::UnavailableError("the echo read failed");
    if (options.unary) finish();
    if (i >= warmup) {
      micros.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
  }
  if (!options.unary) finish();
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  std::sort(micros.begin(), micros.end());
  const auto at = [&](double q) { return micros[static_cast<size_t>(q * (micros.size() - 1))]; };
  return TransportFloor{at(0.5), at(0.9), at(0.99)};
}

}  // namespace cli
}  // namespace tqkv
