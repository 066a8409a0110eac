#include "service/rpc_table.h"

#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "tqkv/v1/kvcache.pb.h"

namespace tqkv {
namespace service {
namespace {

RpcShape ShapeOf(const google::protobuf::MethodDescriptor& m) {
  if (m.client_streaming() && m.server_streaming()) return RpcShape::kBidiStream;
  if (m.client_streaming()) return RpcShape::kClientStream;
  if (m.server_streaming()) return RpcShape::kServerStream;
  return RpcShape::kUnary;
}

}  // namespace

absl::Status CheckRpcTable() {
  const google::protobuf::ServiceDescriptor* service =
      v1::AppendRequest::descriptor()->file()->FindServiceByName("KvCache");
  if (service == nullptr) return absl::InternalError("the proto has no service tqkv.v1.KvCache");
  std::set<std::string> rows;
  for (int i = 0; i < kNumRpcs; ++i) {
    const RpcRow& row = kRpcTable[i];
    if (static_cast<int>(row.rpc) != i)
      return absl::InternalError(absl::StrCat("rpc table row ", i, " is out of order"));
    if (!rows.insert(row.method).second) {
      return absl::InternalError(absl::StrCat("rpc table: method ", row.method, " has two rows"));
    }
    const google::protobuf::MethodDescriptor* m = service->FindMethodByName(row.method);
    if (m == nullptr) {
      return absl::InternalError(absl::StrCat("rpc table: ", row.method, " is not a method of tqkv.v1.KvCache"));
    }
    if (ShapeOf(*m) != row.shape) {
      return absl::InternalError(absl::StrCat("rpc table: ", row.method, "'s streaming differs from the proto's"));
    }
  }
  for (int i = 0; i < service->method_count(); ++i) {
    if (rows.count(service->method(i)->name()) == 0) {
      return absl::InternalError(absl::StrCat("tqkv.v1.KvCache.", service->method(i)->name(),
                                              " has no row in service/rpc_table.h: it would not be served"));
    }
  }
  return absl::OkStatus();
}

}  // namespace service
}  // namespace tqkv
