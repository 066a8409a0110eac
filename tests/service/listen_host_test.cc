// Where the server listens by default, which addresses count as this
// machine only, and when it warns that anyone may call it (service/server.h).
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/auth.h"
#include "service/server.h"

namespace tqkv {
namespace service {
namespace {

using ::testing::HasSubstr;

TEST(ServerListenHost, IsLoopbackWithoutAuthAndEveryInterfaceWithIt) {
  ServerOptions options;
  EXPECT_EQ(ListenHost(options), "127.0.0.1");
  EXPECT_EQ(OpenAccessWarning(options, 50051), "");
  options.auth = AuthConfig::AdminTokens({"secret"});
  EXPECT_EQ(ListenHost(options), "0.0.0.0");
  EXPECT_EQ(OpenAccessWarning(options, 50051), "");
  options.host = "127.0.0.1";
  EXPECT_EQ(ListenHost(options), "127.0.0.1");
}

TEST(ServerListenHost, WarnsOnceOpenToOtherHostsWithoutAuth) {
  ServerOptions options;
  for (const char* host : {"0.0.0.0", "::", "192.0.2.7", "tqkv.example"}) {
    options.host = host;
    const std::string warning = OpenAccessWarning(options, 50051);
    EXPECT_THAT(warning, HasSubstr(std::string("serving ") + host + ":50051 without authentication"));
    EXPECT_THAT(warning, HasSubstr("--auth_token_file"));
    EXPECT_EQ(warning.find('\n'), std::string::npos) << "one line";
  }
  options.host = "0.0.0.0";
  options.auth = AuthConfig::AdminTokens({"secret"});
  EXPECT_EQ(OpenAccessWarning(options, 50051), "");
}

TEST(ServerListenHost, LoopbackIsOnlyWhatThisMachineReaches) {
  for (const char* host : {"127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(IsLoopbackHost(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "::", "", "10.0.0.1", "128.0.0.1", "::ffff:10.0.0.1", "example.com"}) {
    EXPECT_FALSE(IsLoopbackHost(host)) << host;
  }
}

}  // namespace
}  // namespace service
}  // namespace tqkv
