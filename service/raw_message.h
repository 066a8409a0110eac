// Helpers of the raw handlers (kv_cache_service.cc, call_reactors.cc, sequence_transfer.cc):
// parsing and serializing messages from and to grpc::ByteBuffer with precise
// errors, running a call's work so that no exception reaches gRPC, and
// accounting for a finished call.
#ifndef TQKV_SERVICE_RAW_MESSAGE_H_
#define TQKV_SERVICE_RAW_MESSAGE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include <chrono>
#include <exception>
#include <new>
#include <string>

#include "absl/status/status.h"
#include "google/protobuf/arena.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "service/auth.h"
#include "service/metrics.h"

namespace tqkv {
namespace service {

// No exception reaches gRPC, which would answer UNIMPLEMENTED and count
// nothing: a failed allocation is RESOURCE_EXHAUSTED, anything else INTERNAL.
template <typename Work>
inline absl::Status RunGuarded(const Work& work) {
  try {
    return work();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("the server could not allocate memory for this request");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("unexpected error serving this request: ", e.what()));
  }
}

// The arena a unary call's request and response live on: a decode layer's
// request holds a few objects per item (the item, its tensors, their
// shapes), which the arena takes in a few blocks and frees at once.
inline google::protobuf::ArenaOptions CallArenaOptions() {
  google::protobuf::ArenaOptions blocks;
  blocks.start_block_size = 16 << 10;
  blocks.max_block_size = 256 << 10;
  return blocks;
}

// The message `bytes` hold, or INVALID_ARGUMENT naming `what` (gRPC's own
// parse would answer UNIMPLEMENTED and count nothing).
template <typename Message>
inline absl::Status ParseMessage(const grpc::ByteBuffer& bytes, Message* message, const std::string& what) {
  message->Clear();
  grpc::ByteBuffer shared(bytes);  // shares the slices; Deserialize consumes its buffer
  if (grpc::SerializationTraits<Message>::Deserialize(&shared, message).ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s is not a valid %s: %d bytes that do not parse as protobuf, or a string field that is not UTF-8", what,
      Message::descriptor()->full_name(), bytes.Length()));
}

template <typename Message>
inline absl::Status SerializeMessage(const Message& message, grpc::ByteBuffer* out) {
  bool own_buffer = false;
  const grpc::Status s = grpc::SerializationTraits<Message>::Serialize(message, out, &own_buffer);
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cannot serialize the response: ", s.error_message()));
}

using CallClock = std::chrono::steady_clock;

// A call (or a stream's message) ends with `code`: counted for the tenant
// whose token made it, and in the rpc's metrics (null: none) since `start`.
inline void AccountCall(Metrics* metrics, const Caller& caller, Rpc rpc, CallClock::time_point start,
                        grpc::StatusCode code) {
  if (caller.tenant != nullptr) caller.tenant->CountCall(code);
  if (metrics != nullptr) {
    metrics->ObserveRpc(rpc, code, std::chrono::duration<double>(CallClock::now() - start).count());
  }
}

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_RAW_MESSAGE_H_
