#include "client/cli/command_util.h"

#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tqkv {
namespace cli {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST(WithDefaultPort, AddsTheServersPortToAHostWithoutOne) {
  EXPECT_EQ(WithDefaultPort("localhost"), "localhost:50051");
  EXPECT_EQ(WithDefaultPort("10.0.0.7"), "10.0.0.7:50051");
  EXPECT_EQ(WithDefaultPort("[::1]"), "[::1]:50051");
  EXPECT_EQ(WithDefaultPort("tqkv-0.tqkv.default.svc"), "tqkv-0.tqkv.default.svc:50051");
}

TEST(WithDefaultPort, LeavesPortsSchemesAndBareIpv6Alone) {
  EXPECT_EQ(WithDefaultPort("localhost:443"), "localhost:443");
  EXPECT_EQ(WithDefaultPort("[::1]:7000"), "[::1]:7000");
  EXPECT_EQ(WithDefaultPort("dns:///tqkv:50051"), "dns:///tqkv:50051");
  EXPECT_EQ(WithDefaultPort("unix:/run/tqkv.sock"), "unix:/run/tqkv.sock");
  EXPECT_EQ(WithDefaultPort("ipv4:127.0.0.1:9"), "ipv4:127.0.0.1:9");
  EXPECT_EQ(WithDefaultPort("::1"), "::1");
  EXPECT_EQ(WithDefaultPort(""), "");
}

TEST(UnreachableMessage, NamesTheTargetWhenNothingAnswered) {
  const absl::Status refused = absl::UnavailableError(
      "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote "
      "host: Connection refused");
  EXPECT_EQ(UnreachableMessage(refused, "127.0.0.1:1"),
            "cannot reach 127.0.0.1:1 (connection refused): is tqkv-server running at 127.0.0.1:1?");
  EXPECT_THAT(UnreachableMessage(absl::UnavailableError("DNS resolution failed for nope:50051"), "nope:50051"),
              HasSubstr("(the host name does not resolve): is tqkv-server running at nope:50051?"));
}

TEST(UnreachableMessage, LeavesTheServersOwnErrorsAlone) {
  // The server answered: its message is the one to show.
  EXPECT_THAT(UnreachableMessage(absl::UnavailableError("the CUDA device was lost"), "h:1"), IsEmpty());
  EXPECT_THAT(UnreachableMessage(absl::NotFoundError("failed to connect to all addresses"), "h:1"), IsEmpty());
  // A pull whose source is down: the destination answered, naming the source.
  EXPECT_THAT(UnreachableMessage(absl::UnavailableError("the export from src:50051 failed: failed to connect to all "
                                                        "addresses; ... Connection refused"),
                                 "dest:50051"),
              IsEmpty());
  EXPECT_THAT(UnreachableMessage(absl::OkStatus(), "h:1"), IsEmpty());
}

}  // namespace
}  // namespace cli
}  // namespace tqkv
