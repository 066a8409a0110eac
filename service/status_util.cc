#include "service/status_util.h"

#include <string>

namespace tqkv {
namespace service {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  // absl::StatusCode and grpc::StatusCode share the canonical numbering 0..16.
  const grpc::StatusCode grpc_code = (code >= 0 && code <= grpc::StatusCode::UNAUTHENTICATED)
                                         ? static_cast<grpc::StatusCode>(code)
                                         : grpc::StatusCode::UNKNOWN;
  return grpc::Status(grpc_code, std::string(status.message()));
}

}  // namespace service
}  // namespace tqkv
