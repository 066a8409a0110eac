// Bearer-token auth and TLS, end to end: the real server on a loopback port,
// the real client.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/impl/codegen/rpc_method.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/tqkv_client.h"
#include "gtest/gtest.h"
#include "grpc_std.pb.h"
#include "service/auth.h"
#include "service/config.h"
#include "service/server.h"

namespace tqkv {
namespace {

constexpr char kConfig[] = R"pb(
  caches {
    name: "default"
    num_layers: 2
    num_kv_heads: 1
    num_query_heads: 2
    head_dim: 64
    page_tokens: 4
    preset: "turboquant_k3v4_nc"
    memory_budget_bytes: 1048576
  }
)pb";

std::unique_ptr<service::Server> StartServer(std::vector<std::string> tokens, std::string cert = "",
                                             std::string key = "") {
  service::ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.metrics_port = -1;
  options.threads = 1;
  absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(kConfig);
  EXPECT_TRUE(config.ok()) << config.status();
  options.config = *config;
  options.auth = service::AuthConfig::AdminTokens(tokens);
  options.tls_cert_chain_pem = std::move(cert);
  options.tls_private_key_pem = std::move(key);
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

ClientOptions Options(const service::Server& server) {
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", server.port());
  options.max_attempts = 1;
  options.timeout = absl::Seconds(10);
  return options;
}

grpc::Status HealthCheck(grpc::Channel* channel) {
  const grpc::internal::RpcMethod check("/grpc.health.v1.Health/Check", grpc::internal::RpcMethod::NORMAL_RPC);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  testing::HealthCheckRequest request;
  testing::HealthCheckResponse response;
  return grpc::internal::BlockingUnaryCall<testing::HealthCheckRequest, testing::HealthCheckResponse>(
      channel, check, &context, request, &response);
}

TEST(AuthTokens, FileSyntaxIgnoresCommentsAndBlankLines) {
  absl::StatusOr<service::AuthConfig> config = service::ParseAuthConfig("# ops team\n\n  alpha  \r\nbeta\n#gamma\n");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->tokens.size(), 2u);
  EXPECT_EQ(config->tokens[0].token, "alpha");
  EXPECT_EQ(config->tokens[1].token, "beta");
  EXPECT_TRUE(config->tokens[0].tenant.empty());  // no tenant=: an admin token
  EXPECT_TRUE(config->tenants.empty());
  EXPECT_EQ(service::ParseAuthConfig("# only a comment\n\n").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(service::ParseAuthConfig("two words\n").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(service::LoadAuthConfig("/nonexistent/tokens").status().code(), absl::StatusCode::kNotFound);
}

TEST(AuthTokens, TenantLinesGiveTenantsAndQuotas) {
  absl::StatusOr<service::AuthConfig> config = service::ParseAuthConfig(
      "ops\n"
      "a1\ttenant=team-a max_bytes=8GiB max_sequences=100\n"
      "a2 tenant=team-a\n"
      "b1 tenant=team.b max_bytes=1.5MiB\n");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->tokens.size(), 4u);
  EXPECT_EQ(config->tokens[2].tenant, "team-a");
  ASSERT_EQ(config->tenants.size(), 2u);
  EXPECT_EQ(config->tenants[0].name, "team-a");
  EXPECT_EQ(config->tenants[0].max_bytes, uint64_t{8} << 30);
  EXPECT_EQ(config->tenants[0].max_sequences, 100);
  EXPECT_EQ(config->tenants[1].name, "team.b");
  EXPECT_EQ(config->tenants[1].max_bytes, uint64_t{3} << 19);
  EXPECT_EQ(config->tenants[1].max_sequences, 0);

  // Each malformed line is refused, naming its line.
  for (const char* bad : {"a tenant=\n", "a tenant=x:y\n", "a tenant=x max_bytes=lots\n",
                          "a tenant=x max_sequences=-1\n", "a colour=blue\n", "a max_bytes=1GiB\n", "a\na\n",
                          "tenant=x\n", "a tenant=x max_bytes=1\nb tenant=x max_bytes=2\n", "a\x01b\n"}) {
    absl::StatusOr<service::AuthConfig> refused = service::ParseAuthConfig(bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "line ")) << refused.status();
  }
  EXPECT_EQ(*service::ParseByteSize("512MiB"), uint64_t{512} << 20);
  EXPECT_EQ(*service::ParseByteSize("4096"), 4096u);
  EXPECT_FALSE(service::ParseByteSize("GiB").ok());
  EXPECT_FALSE(service::ParseByteSize("-1KiB").ok());
}

TEST(AuthTokens, ConstantTimeEqualsComparesWholeStrings) {
  EXPECT_TRUE(service::ConstantTimeEquals("secret", "secret"));
  EXPECT_FALSE(service::ConstantTimeEquals("secret", "secreT"));
  EXPECT_FALSE(service::ConstantTimeEquals("secret", "secret2"));
  EXPECT_FALSE(service::ConstantTimeEquals("", "x"));
}

TEST(Auth, TheRightTokenIsAcceptedAndOthersAreUnauthenticated) {
  std::unique_ptr<service::Server> server = StartServer({"first-token", "second-token"});
  ASSERT_NE(server, nullptr);
  for (const char* token : {"first-token", "second-token"}) {
    ClientOptions options = Options(*server);
    options.auth_token = token;
    Client client(options);
    EXPECT_TRUE(client.GetServerInfo().ok()) << token;
    EXPECT_TRUE(client.CreateSequence("", absl::StrCat("s-", token)).ok()) << token;
    // The client-streaming rpc is checked too.
    std::vector<float> kv(2 * 1 * 1 * 64, 0.5f);
    AppendArgs chunk;
    chunk.sequence_id = absl::StrCat("stream-", token);
    chunk.shape = {2, 1, 1, 64};
    chunk.keys = kv;
    chunk.values = kv;
    EXPECT_TRUE(client.AppendStream({&chunk, 1}).ok()) << token;
    // And the decode stream: the token is checked once, at its start.
    std::vector<float> q(1 * 2 * 64, 0.5f);
    AppendAttendArgs step;
    step.items.resize(1);
    step.items[0].sequence_id = absl::StrCat("decode-", token);
    step.items[0].kv_shape = {1, 1, 64};
    step.items[0].query_shape = {1, 2, 64};
    step.items[0].keys = absl::MakeConstSpan(kv.data(), 64);
    step.items[0].values = absl::MakeConstSpan(kv.data(), 64);
    step.items[0].queries = q;
    std::unique_ptr<DecodeStream> stream = client.OpenDecodeStream(step.items[0].sequence_id);
    absl::StatusOr<AppendAttendResult> r = stream->Step(step);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->items[0].status.ok()) << r->items[0].status;
    EXPECT_TRUE(stream->Close().ok());
  }
  for (const char* token : {"", "wrong-token", "first-toke", "first-token2"}) {
    ClientOptions options = Options(*server);
    options.auth_token = token;
    Client client(options);
    const absl::Status info = client.GetServerInfo().status();
    EXPECT_EQ(info.code(), absl::StatusCode::kUnauthenticated) << token;
    EXPECT_EQ(info.message(), "missing or invalid bearer token");
    EXPECT_EQ(client.CreateSequence("", "intruder").status().code(), absl::StatusCode::kUnauthenticated);
    std::vector<float> kv(2 * 1 * 1 * 64, 0.5f);
    AppendArgs chunk;
    chunk.sequence_id = "intruder";
    chunk.shape = {2, 1, 1, 64};
    chunk.keys = kv;
    chunk.values = kv;
    EXPECT_EQ(client.AppendStream({&chunk, 1}).status().code(), absl::StatusCode::kUnauthenticated);
    // The decode loop's calls too: the fused call, and the stream, which
    // ends before reading any request.
    std::vector<float> q(1 * 2 * 64, 0.5f);
    AppendAttendArgs step;
    step.items.resize(1);
    step.items[0].sequence_id = "intruder";
    step.items[0].kv_shape = {1, 1, 64};
    step.items[0].query_shape = {1, 2, 64};
    step.items[0].keys = absl::MakeConstSpan(kv.data(), 64);
    step.items[0].values = absl::MakeConstSpan(kv.data(), 64);
    step.items[0].queries = q;
    EXPECT_EQ(client.AppendAttend(step).status().code(), absl::StatusCode::kUnauthenticated);
    std::unique_ptr<DecodeStream> stream = client.OpenDecodeStream("intruder");
    EXPECT_EQ(stream->Step(step).status().code(), absl::StatusCode::kUnauthenticated);
  }
  // Nothing the rejected calls asked for happened.
  ClientOptions options = Options(*server);
  options.auth_token = "first-token";
  EXPECT_EQ(Client(options).GetSequence("", "intruder").status().code(), absl::StatusCode::kNotFound);
  // A scheme other than Bearer is refused; the scheme's case does not matter
  // (RFC 7235), the token's does.
  std::unique_ptr<v1::KvCache::Stub> stub =
      v1::KvCache::NewStub(grpc::CreateChannel(options.target, grpc::InsecureChannelCredentials()));
  const auto code_with = [&stub](const std::string& header) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", header);
    v1::GetServerInfoRequest request;
    v1::ServerInfo response;
    return stub->GetServerInfo(&context, request, &response).error_code();
  };
  EXPECT_EQ(code_with("Basic first-token"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(code_with("bearer first-token"), grpc::StatusCode::OK);
  EXPECT_EQ(code_with("BEARER first-token"), grpc::StatusCode::OK);
  EXPECT_EQ(code_with("Bearer FIRST-TOKEN"), grpc::StatusCode::UNAUTHENTICATED);
}

// A call without a valid token is refused when its headers arrive, before a
// byte of its request is read: the request below is never sent (the call
// stays open, not half-closed), and the answer still comes. A server that
// read unary requests whole first would wait for it until the deadline.
TEST(Auth, AnUnauthenticatedCallIsRefusedBeforeItsRequestIsRead) {
  std::unique_ptr<service::Server> server = StartServer({"token"});
  ASSERT_NE(server, nullptr);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()), grpc::InsecureChannelCredentials());
  const auto open_call = [&channel](const char* method, const char* header) {
    const grpc::internal::RpcMethod stream(method, grpc::internal::RpcMethod::BIDI_STREAMING);
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (header != nullptr) context->AddMetadata("authorization", header);
    std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> call(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel.get(), stream,
                                                                                              context.get()));
    return std::make_pair(std::move(context), std::move(call));
  };
  for (const char* method :
       {"/tqkv.v1.KvCache/Append", "/tqkv.v1.KvCache/Attend", "/tqkv.v1.KvCache/GetServerInfo",
        "/tqkv.v1.KvCache/AppendStream", "/tqkv.v1.KvCache/ExportSequences", "/tqkv.v1.KvCache/ImportSequences",
        "/tqkv.v1.KvCache/PullSequences", "/tqkv.v1.KvCache/ListSequences"}) {
    for (const char* header : {static_cast<const char*>(nullptr), "Bearer wrong"}) {
      auto [context, call] = open_call(method, header);
      const absl::Time start = absl::Now();
      const grpc::Status status = call->Finish();
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << method << ": " << status.error_message();
      EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << method;
    }
  }
  // With the token, a unary call that half-closes without its message is
  // told so.
  auto [context, call] = open_call("/tqkv.v1.KvCache/GetSequence", "Bearer token");
  ASSERT_TRUE(call->WritesDone());
  const grpc::Status status = call->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "the call carried no request message");
}

TEST(Auth, HealthStaysOpenWithoutAToken) {
  std::unique_ptr<service::Server> server = StartServer({"token"});
  ASSERT_NE(server, nullptr);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()), grpc::InsecureChannelCredentials());
  const grpc::Status status = HealthCheck(channel.get());
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST(ServerStart, TlsNeedsBothCertificateAndKey) {
  service::ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.metrics_port = -1;
  options.config = *service::ParseServerConfig(kConfig);
  options.tls_cert_chain_pem = "cert";
  EXPECT_EQ(service::Server::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(Tls, ATlsClientTalksToATlsServerAndAPlaintextClientCannot) {
  if (std::system("command -v openssl >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "openssl is not on PATH";
  }
  char dir_template[] = "/tmp/tqkv_tls_XXXXXX";
  const char* dir = mkdtemp(dir_template);
  ASSERT_NE(dir, nullptr);
  const std::string cert = absl::StrCat(dir, "/cert.pem"), key = absl::StrCat(dir, "/key.pem");
  const std::string command = absl::StrCat(
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
      "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout ",
      key, " -out ", cert, " >/dev/null 2>&1");
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const std::string cert_pem = ReadFile(cert), key_pem = ReadFile(key);
  std::system(absl::StrCat("rm -rf ", dir).c_str());
  ASSERT_FALSE(cert_pem.empty());

  std::unique_ptr<service::Server> server = StartServer({}, cert_pem, key_pem);
  ASSERT_NE(server, nullptr);
  ClientOptions options = Options(*server);
  options.tls_root_certs_pem = cert_pem;
  options.tls_server_name_override = "localhost";
  absl::StatusOr<v1::ServerInfo> info = Client(options).GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");

  ClientOptions plaintext = Options(*server);
  plaintext.timeout = absl::Seconds(3);
  EXPECT_FALSE(Client(plaintext).GetServerInfo().ok());
}

}  // namespace
}  // namespace tqkv
