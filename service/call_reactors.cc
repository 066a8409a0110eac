#include "service/call_reactors.h"

#include <chrono>
#include <deque>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/descriptor.h"
#include "service/kv_cache_service.h"
#include "service/raw_message.h"
#include "service/status_util.h"

namespace tqkv {
namespace service {
namespace {

using Clock = CallClock;

// A unary rpc, served as a stream of one request and one response. gRPC
// reads a unary request whole before it calls the handler; a stream's
// handler runs when the call's headers arrive, so the token is checked
// before a byte of the body is read, and a refused call's body is never
// taken in (HTTP/2 flow control holds the sender at the stream's window).
// On the wire nothing changes: clients call it as the unary rpc it is.
class UnaryCallReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // work(caller, request bytes, response bytes) -> status, run on
  // `executor` (null: inline) after the request is read.
  using Work = UnaryWork;

  UnaryCallReactor(const absl::StatusOr<Caller>& caller, Rpc rpc, Metrics* metrics, CallExecutor* executor,
                   const Work* work)
      : rpc_(rpc), metrics_(metrics), executor_(executor), work_(work), start_(Clock::now()) {
    if (!caller.ok()) {
      Finish(ToGrpcStatus(caller.status()));
      return;
    }
    caller_ = *caller;
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-closed without a message, or gone
      End(absl::InvalidArgumentError("the call carried no request message"));
      return;
    }
    if (executor_ == nullptr) {
      Run();
      return;
    }
    const absl::Status queued = executor_->Submit(request_.Length(), [this] { Run(); });
    if (!queued.ok()) End(queued);
  }

  void OnDone() override { delete this; }

 private:
  void Run() {
    const absl::Status status = RunGuarded([this] { return (*work_)(caller_, request_, &response_); });
    request_.Clear();
    End(status);
  }

  void End(const absl::Status& status) {
    const grpc::Status done = ToGrpcStatus(status);
    AccountCall(metrics_, caller_, rpc_, start_, done.error_code());
    if (done.ok()) {
      StartWriteAndFinish(&response_, grpc::WriteOptions(), done);
    } else {
      Finish(done);
    }
  }

  void Finish(grpc::Status status) { grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>::Finish(status); }

  const Rpc rpc_;
  Metrics* const metrics_;
  CallExecutor* const executor_;
  const Work* const work_;  // the service's, which outlives its calls
  const Clock::time_point start_;
  Caller caller_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  Metrics::InFlight in_flight_{metrics_, rpc_};  // after the members it reads
};

// A long prefill in chunks: every chunk is one Append, stored as it arrives.
class AppendStreamReactor : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  // `caller`: the call's authentication; when not OK the stream ends with
  // it before any chunk is read.
  AppendStreamReactor(KvCacheService* service, grpc::ByteBuffer* response, const absl::StatusOr<Caller>& caller)
      : service_(service), out_(response), start_(Clock::now()) {
    if (!caller.ok()) {
      Finish(ToGrpcStatus(caller.status()));
      return;
    }
    caller_ = *caller;
    StartRead(&buffer_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed (or the call is gone)
      if (chunks_ == 0) {
        Finish(
            ToGrpcStatus(absl::InvalidArgumentError("AppendStream carried no AppendRequest; want at least one chunk")));
      } else {
        response_.set_stored_bytes(stored_bytes_);
        response_.set_stored_bytes_bf16(stored_bytes_bf16_);
        Finish(ToGrpcStatus(SerializeMessage(response_, out_)));
      }
      return;
    }
    CallExecutor* executor = service_->executor();
    if (executor == nullptr) {
      StoreChunk();
      return;
    }
    // No read is started until this chunk is stored: one chunk in flight.
    const absl::Status queued = executor->Submit(buffer_.Length(), [this] { StoreChunk(); });
    if (!queued.ok()) {
      Finish(ToGrpcStatus(absl::Status(queued.code(), absl::StrCat("chunk ", chunks_, ": ", queued.message()))));
    }
  }

  void OnDone() override { delete this; }

 private:
  // Stores request_ as the next chunk, then reads the next one or finishes.
  void StoreChunk() {
    if (absl::Status parsed = ParseMessage(buffer_, &request_, absl::StrCat("chunk ", chunks_)); !parsed.ok()) {
      Finish(ToGrpcStatus(parsed));
      return;
    }
    if (chunks_ > 0 && (request_.cache() != cache_ || request_.sequence_id() != sequence_id_)) {
      Finish(ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrFormat("chunk %d is for cache '%s' sequence '%s'; want the stream's cache '%s' sequence '%s'",
                          chunks_, request_.cache(), request_.sequence_id(), cache_, sequence_id_))));
      return;
    }
    v1::AppendResponse chunk;
    const absl::Status status = RunGuarded([this, &chunk] { return service_->DoAppend(caller_, request_, &chunk); });
    if (!status.ok()) {
      Finish(ToGrpcStatus(absl::Status(status.code(), absl::StrCat("chunk ", chunks_, ": ", status.message()))));
      return;
    }
    if (chunks_ == 0) {
      cache_ = request_.cache();
      sequence_id_ = request_.sequence_id();
    }
    ++chunks_;
    stored_bytes_ += chunk.stored_bytes();
    stored_bytes_bf16_ += chunk.stored_bytes_bf16();
    *response_.mutable_sequence() = std::move(*chunk.mutable_sequence());
    StartRead(&buffer_);
  }

  void Finish(grpc::Status status) {
    AccountCall(service_->metrics(), caller_, Rpc::kAppendStream, start_, status.error_code());
    grpc::ServerReadReactor<grpc::ByteBuffer>::Finish(std::move(status));
  }

  KvCacheService* const service_;
  Caller caller_;
  grpc::ByteBuffer* const out_;
  grpc::ByteBuffer buffer_;  // the read buffer; StoreChunk parses it
  v1::AppendRequest request_;
  v1::AppendResponse response_;
  std::string cache_;
  std::string sequence_id_;
  int chunks_ = 0;
  int64_t stored_bytes_ = 0;
  int64_t stored_bytes_bf16_ = 0;
  const Clock::time_point start_;
  Metrics::InFlight in_flight_{service_->metrics(), Rpc::kAppendStream};
};

// DecodeStream: one AppendAttend per message, in order (see the proto).
// States: a read is outstanding, or a step computes, or neither (waiting for
// the writes to drain below kMaxQueuedResponses); writes go out one at a
// time from `responses_`. Start* are called without mu_ held, after the
// state that licenses them was claimed under it. Draining (the server shuts
// down): no more reads; the stream ends UNAVAILABLE once the steps read are
// answered, without waiting for the outstanding read.
class DecodeStreamReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public KvCacheService::ShutdownListener {
 public:
  static constexpr size_t kMaxQueuedResponses = 4;

  DecodeStreamReactor(KvCacheService* service, const absl::StatusOr<Caller>& caller) : service_(service) {
    if (!caller.ok()) {
      finished_ = true;
      Finish(ToGrpcStatus(caller.status()));
      return;
    }
    caller_ = *caller;
    {
      absl::MutexLock lock(&mu_);
      reading_ = true;
      read_claim_ = read_started_ = 1;  // no reaction runs before the constructor returns
    }
    StartRead(&buffer_);
    // No reaction runs before the constructor returns, so none sees the
    // stream unregistered.
    if (!service_->AddStream(this)) EndForShutdown();
  }

  void EndForShutdown() override {
    Actions next;
    {
      absl::MutexLock lock(&mu_);
      draining_ = true;
      next = DecideLocked();
    }
    Act(next);
  }

  void OnReadDone(bool ok) override {
    Actions next;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (finished_) return;  // ended while this read was out: its message is not taken
      if (!ok) {
        read_closed_ = true;
        next = DecideLocked();
      } else {
        computing_ = true;
      }
    }
    if (!ok) {
      Act(next);
      return;
    }
    const Clock::time_point start = Clock::now();
    CallExecutor* executor = service_->executor();
    if (executor == nullptr) {
      Compute(start);
      return;
    }
    const absl::Status queued = executor->Submit(buffer_.Length(), [this, start] { Compute(start); });
    if (!queued.ok()) {
      // Unparsed: the id is read from the bytes only to answer (0 if they do not parse).
      (void)ParseMessage(buffer_, &request_, "");
      ++messages_;
      v1::DecodeStreamResponse response;
      response.set_request_id(request_.request_id());
      response.set_code(static_cast<int>(queued.code()));
      response.set_message(std::string(queued.message()));
      Deliver(std::move(response), start);
    }
  }

  void OnWriteDone(bool ok) override {
    Actions next;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      responses_.pop_front();
      if (!ok) broken_ = true;  // the client is gone
      next = DecideLocked();
    }
    Act(next);
  }

  void OnDone() override {
    service_->RemoveStream(this);
    delete this;
  }

 private:
  void Compute(Clock::time_point start) {
    if (absl::Status parsed = ParseMessage(buffer_, &request_, absl::StrCat("message ", messages_)); !parsed.ok()) {
      // No id to answer with: the stream ends with the error once the
      // answers before it are written.
      if (Metrics* metrics = service_->metrics()) {
        metrics->ObserveRpc(Rpc::kDecodeStreamStep, grpc::StatusCode::INVALID_ARGUMENT,
                            std::chrono::duration<double>(Clock::now() - start).count());
      }
      Actions next;
      {
        absl::MutexLock lock(&mu_);
        computing_ = false;
        read_closed_ = true;
        end_status_ = ToGrpcStatus(parsed);
        next = DecideLocked();
      }
      Act(next);
      return;
    }
    ++messages_;
    v1::DecodeStreamResponse response;
    response.set_request_id(request_.request_id());
    const absl::Status status = RunGuarded(
        [this, &response] { return service_->DoAppendAttend(caller_, request_.step(), response.mutable_step()); });
    if (!status.ok()) {
      response.clear_step();
      response.set_code(static_cast<int>(status.code()));
      response.set_message(std::string(status.message()));
    }
    Deliver(std::move(response), start);
  }

  void Deliver(v1::DecodeStreamResponse response, Clock::time_point start) {
    AccountCall(service_->metrics(), caller_, Rpc::kDecodeStreamStep, start,
                static_cast<grpc::StatusCode>(response.code()));
    grpc::ByteBuffer bytes;
    if (!SerializeMessage(response, &bytes).ok()) {
      response.clear_step();
      response.set_code(static_cast<int>(absl::StatusCode::kInternal));
      response.set_message("cannot serialize the answer");
      (void)SerializeMessage(response, &bytes);
    }
    Actions next;
    {
      absl::MutexLock lock(&mu_);
      computing_ = false;
      responses_.push_back(std::move(bytes));
      next = DecideLocked();
    }
    Act(next);
  }

  // What the state allows next: the next write, the next read, or the end
  // of the call. Decided in the same critical section as the state change
  // that allows it: a thread that changed the state and then decided in a
  // second one could find the call finished by another thread in between,
  // and the reactor deleted (OnDone).
  struct Actions {
    const grpc::ByteBuffer* write = nullptr;
    uint64_t read = 0;  // the read claimed (read_claim_), 0: none
    bool finish = false;
    grpc::Status end;
  };
  Actions DecideLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Actions next;
    if (finished_) return next;
    if (broken_ && !writing_) responses_.clear();  // nobody will read them
    if (!writing_ && !broken_ && !responses_.empty()) {
      writing_ = true;
      next.write = &responses_.front();  // deque: stays put while others are pushed
    }
    if (!reading_ && !computing_ && !read_closed_ && !draining_ && !broken_ &&
        responses_.size() < kMaxQueuedResponses) {
      reading_ = true;
      next.read = ++read_claim_;
    }
    // Draining ends the call with a read outstanding, but only one already
    // started: a read claimed and not yet started would start on a call that
    // may be gone.
    if ((!reading_ || (draining_ && read_started_ == read_claim_)) && !computing_ && !writing_ &&
        (broken_ || ((read_closed_ || draining_) && responses_.empty()))) {
      finished_ = true;
      next.finish = true;
      next.end = broken_                             ? grpc::Status(grpc::StatusCode::CANCELLED, "the client went away")
                 : read_closed_ || !end_status_.ok() ? end_status_
                                                     : ShuttingDownStatus();
    }
    return next;
  }
  // Starts what DecideLocked claimed, without mu_. A started read may let
  // a draining call finish: decided again. After Finish the reactor may be
  // gone: nothing follows it.
  void Act(Actions next) {
    for (;;) {
      if (next.write != nullptr) StartWrite(next.write);
      if (next.read == 0) break;
      StartRead(&buffer_);
      absl::MutexLock lock(&mu_);
      read_started_ = std::max(read_started_, next.read);
      next = DecideLocked();
    }
    if (next.finish) Finish(next.end);
  }

  static grpc::Status ShuttingDownStatus() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the server is shutting down; send the steps not answered again on a new stream "
                        "(to another server, or to this one once it restarts)");
  }

  KvCacheService* const service_;
  Caller caller_;
  grpc::ByteBuffer buffer_;          // the read buffer; the step computing parses it
  v1::DecodeStreamRequest request_;  // the step computing
  int64_t messages_ = 0;             // parsed so far (only Compute touches it)
  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> responses_ ABSL_GUARDED_BY(mu_);
  grpc::Status end_status_ ABSL_GUARDED_BY(mu_) = grpc::Status::OK;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  // Reads claimed by DecideLocked, and the last one started, counted from 1.
  uint64_t read_claim_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t read_started_ ABSL_GUARDED_BY(mu_) = 0;
  bool computing_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool read_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;  // EndForShutdown
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  Metrics::InFlight in_flight_{service_->metrics(), Rpc::kDecodeStreamStep};
};

}  // namespace

RawMethodHandler* NewStreamedHandler(StreamFactory factory) { return NewRawBidiHandler(std::move(factory)); }

int MethodIndex(Rpc rpc) {
  return google::protobuf::DescriptorPool::generated_pool()
      ->FindServiceByName("tqkv.v1.KvCache")
      ->FindMethodByName(RowOf(rpc).method)
      ->index();
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewUnaryCallReactor(const absl::StatusOr<Caller>& caller,
                                                                                 Rpc rpc, Metrics* metrics,
                                                                                 CallExecutor* executor,
                                                                                 const UnaryWork* work) {
  return new UnaryCallReactor(caller, rpc, metrics, executor, work);
}

grpc::ServerReadReactor<grpc::ByteBuffer>* NewAppendStreamReactor(KvCacheService* service, grpc::ByteBuffer* response,
                                                                  const absl::StatusOr<Caller>& caller) {
  return new AppendStreamReactor(service, response, caller);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewDecodeStreamReactor(
    KvCacheService* service, const absl::StatusOr<Caller>& caller) {
  return new DecodeStreamReactor(service, caller);
}

}  // namespace service
}  // namespace tqkv
