// tqkv.v1.KvCache over a set of named KvCache instances and one Backend, on
// gRPC's callback API.
//
// Every handler validates its request completely (tensor dtype, rank, shape,
// byte length, finite values; ids; layer and token ranges) before the cache
// sees it, and finishes through ToGrpcStatus, so a malformed request gets its
// canonical code and changes nothing. An empty cache name means "default";
// an unknown one is NOT_FOUND.
//
// Handlers never block gRPC's callback threads: each checks auth, submits the
// call's work (validation, cache calls, kernels, encoding the response) to
// the CallExecutor (service/executor.h) and returns; the work finishes the
// reactor. A full executor answers RESOURCE_EXHAUSTED at once. Without an
// executor (tests) the work runs inline. GetServerInfo, which takes no
// sequence lock and runs no kernel, always runs inline.
//
// AppendAttend and DecodeStream: one layer of a decode step per call or per
// stream message (the proto documents ordering, flow control and errors).
// The cache sees an Append of each item's tokens to that one layer, then one
// Attend for every item stored; learned sink logits are applied here, to
// the kernel's output and log-sum-exp.
//
// Thread safety: all methods are thread-safe. The caches and the backend must
// outlive the service; the service must outlive the grpc::Server it is
// registered with (Shutdown + Wait first).
#ifndef TQKV_SERVICE_KV_CACHE_SERVICE_H_
#define TQKV_SERVICE_KV_CACHE_SERVICE_H_

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cache/kv_cache.h"
#include "kernels/backend.h"
#include "service/auth.h"
#include "service/executor.h"
#include "service/metrics.h"
#include "service/snapshot.h"
#include "tqkv/v1/kvcache.grpc.pb.h"

namespace tqkv {
namespace service {

// Longest accepted sequence id, in bytes.
inline constexpr size_t kMaxSequenceIdBytes = 256;

// Every method takes its messages as raw bytes (grpc::ByteBuffer) and parses
// them itself, after the auth check: bytes that are not a valid message (or
// a string field that is not UTF-8) are INVALID_ARGUMENT and counted, where
// gRPC's own parsing answers UNIMPLEMENTED and counts nothing, and where a
// stream would have taken a malformed message for its end (an AppendStream
// then answered OK with the chunks before it). The unary rpcs are served as
// streams of one message (KvCacheService::ServeUnary), so that a call
// without a valid token is refused when its headers arrive, before its
// body is read: gRPC reads a unary request whole before its handler runs.
using RawKvCacheService = v1::KvCache::WithRawCallbackMethod_Append<v1::KvCache::WithRawCallbackMethod_AppendStream<
    v1::KvCache::WithRawCallbackMethod_ScoreQuery<v1::KvCache::WithRawCallbackMethod_Attend<
        v1::KvCache::WithRawCallbackMethod_AppendAttend<v1::KvCache::WithRawCallbackMethod_DecodeStream<
            v1::KvCache::WithRawCallbackMethod_CreateSequence<v1::KvCache::WithRawCallbackMethod_ForkSequence<
                v1::KvCache::WithRawCallbackMethod_DropSequence<v1::KvCache::WithRawCallbackMethod_GetSequence<
                    v1::KvCache::WithRawCallbackMethod_GetServerInfo<v1::KvCache::WithRawCallbackMethod_ExportSequences<
                        v1::KvCache::WithRawCallbackMethod_ImportSequences<
                            v1::KvCache::WithRawCallbackMethod_SaveSnapshot<
                                v1::KvCache::WithRawCallbackMethod_ListSequences<
                                    v1::KvCache::WithRawCallbackMethod_PullSequences<
                                        v1::KvCache::Service>>>>>>>>>>>>>>>>;

class KvCacheService final : public RawKvCacheService {
 public:
  // `caches` by name (the first one's name, or "default", answers the empty
  // name: see Find). REQUIRES: `backend` is the backend the caches were
  // created on and outlives the service; so does `metrics` (null: none).
  // `auth` (no tokens: open) is checked first in every handler: a call
  // without a valid bearer token is UNAUTHENTICATED and its request unread;
  // a tenant's token reaches only the tenant's sequences, charged to its
  // account (PERMISSION_DENIED / RESOURCE_EXHAUSTED otherwise).
  // `executor` (null: run inline) must outlive the service.
  KvCacheService(std::vector<std::unique_ptr<KvCache>> caches, Backend* backend, Metrics* metrics = nullptr,
                 Authenticator auth = Authenticator(), CallExecutor* executor = nullptr);

  // The caches, in config order.
  const std::vector<KvCache*>& caches() const { return order_; }
  Metrics* metrics() const { return metrics_; }
  CallExecutor* executor() const { return executor_; }
  ~KvCacheService() override;

  // The largest response the server may send (its max message size; 0: no
  // limit). A call whose response would be larger is RESOURCE_EXHAUSTED
  // before any work is done, from the sizes the request fixes. Set before
  // serving.
  void set_max_response_bytes(int64_t bytes) { max_response_bytes_ = bytes; }
  int64_t max_response_bytes() const { return max_response_bytes_; }
  // Serves SaveSnapshot (null: FAILED_PRECONDITION, no data directory). Set
  // before serving; must outlive the service's calls.
  void set_snapshotter(Snapshotter* snapshotter) { snapshotter_ = snapshotter; }

  // The cache named `name` ("" means "default"); NOT_FOUND listing the names.
  absl::StatusOr<KvCache*> Find(const std::string& name) const;

  // Drops sequences idle past their cache's TTL; the server calls it
  // periodically. Returns how many were dropped.
  int EvictExpired();

  // The first step of a shutdown (Server::Shutdown calls it before gRPC's):
  // every open DecodeStream ends with UNAVAILABLE once the steps it has read
  // are answered, at once when it waits for its client's next step (a
  // decode loop resends unanswered steps on a new stream, see the proto),
  // and a DecodeStream opened from now on ends so before it reads. Other
  // calls are left alone: they are in flight until their clients end them.
  // Idempotent.
  void BeginShutdown();

  // A stream BeginShutdown ends; its reactor registers while open.
  class ShutdownListener {
   public:
    // Ends the stream as BeginShutdown says. Runs with the service's stream
    // lock held: it must not call AddStream or RemoveStream.
    virtual void EndForShutdown() = 0;

   protected:
    ~ShutdownListener() = default;
  };
  // Registers `stream`; false (nothing registered) once BeginShutdown ran.
  bool AddStream(ShutdownListener* stream);
  // Unregisters `stream` (nothing when it is not registered); called
  // before it is destroyed.
  void RemoveStream(ShutdownListener* stream);

  // The handlers' logic, without gRPC: what each rpc does, for the reactors
  // and for tests. `caller` is who the call's token says is calling
  // (service/auth.h): a tenant may name only its own sequences.
  absl::Status DoAppend(const Caller& caller, const v1::AppendRequest& request, v1::AppendResponse* response);
  absl::Status DoScoreQuery(const Caller& caller, const v1::ScoreQueryRequest& request,
                            v1::ScoreQueryResponse* response);
  absl::Status DoAttend(const Caller& caller, const v1::AttendRequest& request, v1::AttendResponse* response);
  // Call-level errors as the return value; per-item ones in the results.
  absl::Status DoAppendAttend(const Caller& caller, const v1::AppendAttendRequest& request,
                              v1::AppendAttendResponse* response);
  absl::Status DoCreateSequence(const Caller& caller, const v1::CreateSequenceRequest& request, v1::SequenceInfo* info);
  absl::Status DoForkSequence(const Caller& caller, const v1::ForkSequenceRequest& request, v1::SequenceInfo* info);
  absl::Status DoDropSequence(const Caller& caller, const v1::DropSequenceRequest& request);
  absl::Status DoGetSequence(const Caller& caller, const v1::GetSequenceRequest& request, v1::SequenceInfo* info);
  // A tenant's call gets its own TenantInfo; an admin's every tenant's.
  void DoGetServerInfo(const Caller& caller, v1::ServerInfo* info);
  absl::Status DoSaveSnapshot(const Caller& caller, v1::SaveSnapshotResponse* response);
  absl::Status DoListSequences(const Caller& caller, const v1::ListSequencesRequest& request,
                               v1::ListSequencesResponse* response);
  // Random at construction (ServerInfo.instance_id).
  const std::string& instance_id() const { return instance_id_; }

  // The authenticator: its tenants, for the metrics.
  const Authenticator& auth() const { return auth_; }

  // The streams (RawKvCacheService). The unary rpcs are served as streams
  // of one message each (see the class comment), registered in the
  // constructor.
  using Raw = grpc::ByteBuffer;
  grpc::ServerReadReactor<Raw>* AppendStream(grpc::CallbackServerContext* context, Raw* response) override;
  grpc::ServerBidiReactor<Raw, Raw>* DecodeStream(grpc::CallbackServerContext* context) override;
  // service/sequence_transfer.h. ExportSequences is served as a stream of
  // one request (registered in the constructor) so its token is checked
  // before its request is read.
  grpc::ServerReadReactor<Raw>* ImportSequences(grpc::CallbackServerContext* context, Raw* response) override;

 private:
  absl::Status FillSequenceInfo(KvCache& cache, const std::string& id, v1::SequenceInfo* info);
  // The unary handlers and ExportSequences' stream (the constructor's).
  void RegisterHandlers();
  // Serves unary `rpc` (its method: service/rpc_table.h) as a stream of one
  // request and one response: the call's token is checked when its headers
  // arrive, before its request is read; then the request is parsed as a
  // Request (INVALID_ARGUMENT when the bytes are not one) and
  // do_work(caller, request, &response) runs on the executor (inline for
  // GetServerInfo), its status finishing the call.
  template <typename Request, typename Response, typename Do>
  void ServeUnary(Rpc rpc, Do do_work);

  // What each unary rpc does with its bytes, by Rpc; set in the
  // constructor, read by the calls.
  std::array<std::function<absl::Status(const Caller&, const grpc::ByteBuffer&, grpc::ByteBuffer*)>, kNumRpcs>
      unary_work_;

  // Immutable after construction: read without a lock.
  std::map<std::string, std::unique_ptr<KvCache>> caches_;
  std::vector<KvCache*> order_;  // config order, for GetServerInfo
  Backend* backend_;
  Metrics* metrics_;
  const Authenticator auth_;
  CallExecutor* executor_;
  int64_t max_response_bytes_ = 0;
  Snapshotter* snapshotter_ = nullptr;
  std::string instance_id_;
  absl::Mutex streams_mu_;
  bool shutting_down_ ABSL_GUARDED_BY(streams_mu_) = false;
  std::set<ShutdownListener*> streams_ ABSL_GUARDED_BY(streams_mu_);

  // RESOURCE_EXHAUSTED when a response of about `bytes` (its tensors' bytes;
  // framing is allowed for) would exceed max_response_bytes_.
  absl::Status CheckResponseBytes(int64_t bytes, const char* advice) const;
};

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_KV_CACHE_SERVICE_H_
