// The one place that turns an internal absl::Status into a gRPC status. Every
// handler finishes through ToGrpcStatus, so codes and messages reach clients
// unchanged: the canonical codes are numerically identical in both libraries.
#ifndef TQKV_SERVICE_STATUS_UTIL_H_
#define TQKV_SERVICE_STATUS_UTIL_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace tqkv {
namespace service {

// How many gRPC status codes there are (OK = 0 ... UNAUTHENTICATED = 16):
// the size of every per-code table (calls per tenant, metrics).
inline constexpr int kNumGrpcCodes = static_cast<int>(grpc::StatusCode::UNAUTHENTICATED) + 1;
static_assert(kNumGrpcCodes == 17);

// Same code, same message. Never fails; an out-of-range code (impossible for a
// canonical absl::Status) becomes UNKNOWN.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_STATUS_UTIL_H_
