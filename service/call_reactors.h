// The gRPC reactors of KvCacheService's calls: how a call's messages are
// read, handed to the executor and answered. The handlers' logic is the
// service's (KvCacheService::Do*); the reactors add authentication at the
// call's start, flow control, ordering, metrics and shutdown.
//
// - Unary rpcs are served as streams of one message (KvCacheService::
//   ServeUnary): the token is checked when the headers arrive, before the
//   body is read, and a refused call's body is never taken in.
// - AppendStream: each chunk is one Append, stored as it arrives.
// - DecodeStream: one AppendAttend per message, answered in order, with at
//   most kMaxQueuedResponses answers waiting for the client.
//
// Every reactor deletes itself when gRPC calls OnDone.
#ifndef TQKV_SERVICE_CALL_REACTORS_H_
#define TQKV_SERVICE_CALL_REACTORS_H_

#include <functional>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/grpc_raw.h"
#include "service/auth.h"
#include "service/executor.h"
#include "service/metrics.h"
#include "service/rpc_table.h"

namespace tqkv {
namespace service {

class KvCacheService;

// What a unary rpc does with its request bytes: parse, work, serialize the
// response (KvCacheService::ServeUnary builds one per rpc).
using UnaryWork = std::function<absl::Status(const Caller&, const grpc::ByteBuffer&, grpc::ByteBuffer*)>;

// A unary call: `caller` not OK ends it with that status before its request
// is read; otherwise `work` runs on `executor` (null: inline) once the
// request is read, and its status ends the call, counted as `rpc` in
// `metrics` (null: not counted). `work` must outlive the call.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewUnaryCallReactor(const absl::StatusOr<Caller>& caller,
                                                                                 Rpc rpc, Metrics* metrics,
                                                                                 CallExecutor* executor,
                                                                                 const UnaryWork* work);

// AppendStream into `response` (the AppendResponse's bytes).
grpc::ServerReadReactor<grpc::ByteBuffer>* NewAppendStreamReactor(KvCacheService* service, grpc::ByteBuffer* response,
                                                                  const absl::StatusOr<Caller>& caller);

// DecodeStream; registered with the service for BeginShutdown while open.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewDecodeStreamReactor(
    KvCacheService* service, const absl::StatusOr<Caller>& caller);

// A handler (over proto/grpc_raw.h, the one file that uses gRPC's internal
// API) that serves a method of the raw service as a bidi stream of bytes, which
// KvCacheService registers with grpc::Service::MarkMethodStreamed for its
// unary rpcs and ExportSequences, so that a call's token is checked before
// its request is read. `factory` makes the call's reactor.
using StreamFactory =
    std::function<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*(grpc::CallbackServerContext*)>;
RawMethodHandler* NewStreamedHandler(StreamFactory factory);

// The index of `rpc`'s method in tqkv.v1.KvCache (the generated code's
// method order, which MarkMethodStreamed takes).
int MethodIndex(Rpc rpc);

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_CALL_REACTORS_H_
