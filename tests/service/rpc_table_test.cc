// service/rpc_table.h against the proto: every method served has one row,
// with its streaming shape, and the metric labels are unique.
#include "service/rpc_table.h"

#include <set>
#include <string>

#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "tqkv/v1/kvcache.pb.h"

namespace tqkv {
namespace service {
namespace {

TEST(RpcTable, NamesEveryMethodOfTheProtoOnceWithItsShape) {
  EXPECT_TRUE(CheckRpcTable().ok()) << CheckRpcTable();
  const google::protobuf::ServiceDescriptor* service =
      v1::AppendRequest::descriptor()->file()->FindServiceByName("KvCache");
  ASSERT_NE(service, nullptr);
  EXPECT_EQ(service->method_count(), kNumRpcs);
}

TEST(RpcTable, RowsAreInEnumOrderWithUniqueLabels) {
  std::set<std::string> labels;
  for (int i = 0; i < kNumRpcs; ++i) {
    EXPECT_EQ(static_cast<int>(kRpcTable[i].rpc), i);
    EXPECT_TRUE(labels.insert(kRpcTable[i].label).second) << kRpcTable[i].label;
    EXPECT_EQ(&RowOf(kRpcTable[i].rpc), &kRpcTable[i]);
  }
  EXPECT_STREQ(RowOf(Rpc::kDecodeStreamStep).method, "DecodeStream");
  EXPECT_EQ(RowOf(Rpc::kDecodeStreamStep).shape, RpcShape::kBidiStream);
}

}  // namespace
}  // namespace service
}  // namespace tqkv
