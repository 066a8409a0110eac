// Tenants end to end (service/auth.h): the real server on a loopback port
// with admin and tenant tokens, the real client. A tenant's token reaches
// only ids in its namespace on every rpc, and its quotas bound what it holds.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/tqkv_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kv_layout.h"
#include "service/auth.h"
#include "service/config.h"
#include "service/server.h"
#include "tests/service/random_floats.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;

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
constexpr int kLayers = 2, kKvHeads = 1, kQueryHeads = 2, kDim = 64;

class TenantTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(kConfig);
    ASSERT_TRUE(config.ok()) << config.status();
    absl::StatusOr<std::vector<CacheOptions>> caches = service::ToCacheOptions(*config, 1 << 20);
    ASSERT_TRUE(caches.ok()) << caches.status();
    absl::StatusOr<std::shared_ptr<const KvLayout>> layout = KvLayout::Create((*caches)[0].layout);
    ASSERT_TRUE(layout.ok()) << layout.status();
    page_bytes_ = (*layout)->page_bytes();
    // team-a may hold 8 pages and 5 sequences; team-b is unlimited.
    absl::StatusOr<service::AuthConfig> auth = service::ParseAuthConfig(
        absl::StrCat("ops-token\n", "a-token tenant=team-a max_bytes=", 8 * page_bytes_, " max_sequences=5\n",
                     "a-second-token tenant=team-a\n", "b-token tenant=team-b\n"));
    ASSERT_TRUE(auth.ok()) << auth.status();

    service::ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.metrics_port = -1;
    options.threads = 1;
    options.config = *config;
    options.auth = *auth;
    absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  Client As(const std::string& token) {
    ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", server_->port());
    options.max_attempts = 1;
    options.timeout = absl::Seconds(10);
    options.auth_token = token;
    return Client(options);
  }

  // `tokens` tokens of every layer, appended at `start`.
  absl::StatusOr<AppendResult> Append(Client& client, const std::string& id, int64_t start, int64_t tokens) {
    kv_.push_back(RandomFloats(static_cast<size_t>(kLayers * tokens * kKvHeads * kDim), ++seed_));
    AppendArgs args;
    args.sequence_id = id;
    args.start_position = start;
    args.shape = {kLayers, tokens, kKvHeads, kDim};
    args.keys = kv_.back();
    args.values = kv_.back();
    return client.Append(args);
  }

  ScoreArgs ScoreOf(const std::string& id) {
    ScoreArgs args;
    args.sequence_id = id;
    args.layer = 1;
    args.shape = {kQueryHeads, kDim};
    args.queries = queries_;
    return args;
  }

  AttendItemArgs AttendItem(const std::string& id) {
    AttendItemArgs item;
    item.sequence_id = id;
    item.layer = 0;
    item.shape = {1, kQueryHeads, kDim};
    item.queries = queries_;
    return item;
  }

  AppendAttendArgs Step(const std::string& id, int64_t start) {
    AppendAttendArgs step;
    step.layer = 0;
    step.items.resize(1);
    step.items[0].sequence_id = id;
    step.items[0].start_position = start;
    step.items[0].kv_shape = {1, kKvHeads, kDim};
    step.items[0].query_shape = {1, kQueryHeads, kDim};
    step.items[0].keys = absl::MakeConstSpan(queries_.data(), kDim);
    step.items[0].values = absl::MakeConstSpan(queries_.data(), kDim);
    step.items[0].queries = queries_;
    return step;
  }

  // Every rpc that names a sequence, naming `id` (and, for a fork, `other`
  // as the other end), as `client`: each must be PERMISSION_DENIED.
  void ExpectEveryRpcDenied(Client& client, const std::string& id, const std::string& own) {
    SCOPED_TRACE(id);
    const auto denied = [](const absl::Status& status, const char* rpc) {
      EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << rpc << ": " << status;
    };
    denied(Append(client, id, 0, 2).status(), "Append");
    {
      std::vector<float> kv = RandomFloats(kLayers * 2 * kKvHeads * kDim, ++seed_);
      AppendArgs chunk;
      chunk.sequence_id = id;
      chunk.shape = {kLayers, 2, kKvHeads, kDim};
      chunk.keys = kv;
      chunk.values = kv;
      denied(client.AppendStream({&chunk, 1}).status(), "AppendStream");
    }
    denied(client.Score(ScoreOf(id)).status(), "ScoreQuery");
    {
      AttendArgs attend;
      attend.items = {AttendItem(own), AttendItem(id)};  // one foreign item refuses the batch
      const absl::Status status = client.Attend(attend).status();
      denied(status, "Attend");
      EXPECT_THAT(std::string(status.message()), HasSubstr("item 1"));
    }
    denied(client.AppendAttend(Step(id, 0)).status(), "AppendAttend");
    {
      std::unique_ptr<DecodeStream> stream = client.OpenDecodeStream(id);
      denied(stream->Step(Step(id, 0)).status(), "DecodeStream");
      (void)stream->Close();
    }
    denied(client.CreateSequence("", id).status(), "CreateSequence");
    denied(client.ForkSequence("", id, own + "-fork").status(), "ForkSequence parent");
    denied(client.ForkSequence("", own, id + "-fork").status(), "ForkSequence child");
    denied(client.DropSequence("", id), "DropSequence");
    denied(client.GetSequence("", id).status(), "GetSequence");
  }

  std::unique_ptr<service::Server> server_;
  size_t page_bytes_ = 0;
  std::vector<std::vector<float>> kv_;
  std::vector<float> queries_ = RandomFloats(kQueryHeads * kDim, 7);
  uint32_t seed_ = 100;
};

TEST_F(TenantTest, ATenantReachesOnlyItsOwnSequencesOnEveryRpc) {
  Client a = As("a-token");
  Client b = As("b-token");
  Client ops = As("ops-token");
  ASSERT_TRUE(Append(a, "team-a:chat", 0, 6).ok());
  ASSERT_TRUE(Append(b, "team-b:chat", 0, 3).ok());
  absl::StatusOr<ScoreResult> before = a.Score(ScoreOf("team-a:chat"));
  ASSERT_TRUE(before.ok()) << before.status();

  // team-b's token on team-a's sequence, on an id in nobody's namespace, and
  // on ids that only look like its own.
  for (const std::string id : {"team-a:chat", "chat", "team-b", "team-bx:chat", "team-a:new"}) {
    ExpectEveryRpcDenied(b, id, "team-b:chat");
  }
  ExpectEveryRpcDenied(a, "team-b:chat", "team-a:chat");
  const absl::Status denied = b.GetSequence("", "team-a:chat").status();
  EXPECT_THAT(std::string(denied.message()),
              HasSubstr("outside tenant 'team-b': its token reaches only sequence ids starting with 'team-b:'"));

  // Nothing the refused calls asked for happened, and the same id in two
  // namespaces is two sequences.
  absl::StatusOr<SequenceState> chat = ops.GetSequence("", "team-a:chat");
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->layer_tokens, (std::vector<int64_t>{6, 6}));
  EXPECT_EQ(b.GetSequence("", "team-b:chat")->layer_tokens, (std::vector<int64_t>{3, 3}));
  for (const std::string id : {"chat", "team-a:new", "team-a:new-fork", "team-b:chat-fork"}) {
    EXPECT_EQ(ops.GetSequence("", id).status().code(), absl::StatusCode::kNotFound) << id;
  }
  absl::StatusOr<ScoreResult> after = a.Score(ScoreOf("team-a:chat"));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->logits, before->logits);

  // Both of team-a's tokens are team-a; the admin reaches everything.
  EXPECT_EQ(As("a-second-token").Score(ScoreOf("team-a:chat"))->logits, before->logits);
  EXPECT_EQ(ops.Score(ScoreOf("team-a:chat"))->logits, before->logits);
  ASSERT_TRUE(ops.ForkSequence("", "team-a:chat", "team-a:chat/beam-1").ok());
  EXPECT_TRUE(a.GetSequence("", "team-a:chat/beam-1").ok());
  EXPECT_TRUE(a.DropSequence("", "team-a:chat/beam-1").ok());
  EXPECT_TRUE(ops.DropSequence("", "team-b:chat").ok());

  // Per-tenant calls by code.
  const std::string metrics = server_->MetricsText();
  EXPECT_THAT(metrics, HasSubstr("tqkv_tenant_requests_total{code=\"PERMISSION_DENIED\",tenant=\"team-b\"} 56"));
  EXPECT_THAT(metrics, HasSubstr("tqkv_tenant_requests_total{code=\"PERMISSION_DENIED\",tenant=\"team-a\"} 11"));
}

TEST_F(TenantTest, QuotasBoundWhatATenantHoldsWhoeverCreatesItsSequences) {
  Client a = As("a-token");
  Client b = As("b-token");
  Client ops = As("ops-token");
  ASSERT_TRUE(Append(a, "team-a:1", 0, 16).ok());  // 4 pages
  ASSERT_TRUE(Append(a, "team-a:2", 0, 16).ok());  // 8 of 8
  const absl::Status full = Append(a, "team-a:3", 0, 1).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.message()), HasSubstr("tenant 'team-a' is at its quota"));
  EXPECT_EQ(ops.GetSequence("", "team-a:3").status().code(), absl::StatusCode::kNotFound);
  // Another tenant is not held back, and neither is the admin's own space.
  EXPECT_TRUE(Append(b, "team-b:1", 0, 32).ok());
  EXPECT_TRUE(Append(ops, "shared-prompt", 0, 32).ok());

  absl::StatusOr<v1::ServerInfo> info = a.GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(info->has_tenant());
  EXPECT_EQ(info->tenant().name(), "team-a");
  EXPECT_EQ(info->tenant().sequence_prefix(), "team-a:");
  EXPECT_EQ(info->tenant().max_bytes(), static_cast<int64_t>(8 * page_bytes_));
  EXPECT_EQ(info->tenant().bytes(), static_cast<int64_t>(8 * page_bytes_));
  EXPECT_EQ(info->tenant().sequences(), 2);
  EXPECT_EQ(info->tenant().tokens(), 32);
  EXPECT_EQ(info->tenant().quota_refusals(), 1);
  EXPECT_EQ(info->tenants_size(), 0);  // a tenant sees only itself

  // What an admin creates in team-a's namespace is team-a's; a fork is
  // charged for the pages it shares.
  ASSERT_TRUE(ops.CreateSequence("", "team-a:by-ops").ok());
  EXPECT_EQ(ops.ForkSequence("", "team-a:1", "team-a:1/beam").status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(a.DropSequence("", "team-a:1").ok());
  ASSERT_TRUE(Append(a, "team-a:3", 0, 1).ok());
  ASSERT_TRUE(a.ForkSequence("", "team-a:3", "team-a:3/beam").ok());  // 4 sequences, 6 pages
  ASSERT_TRUE(a.CreateSequence("", "team-a:5").ok());
  const absl::Status too_many = a.CreateSequence("", "team-a:6").status();
  EXPECT_EQ(too_many.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(too_many.message()), HasSubstr("max_sequences is 5"));

  absl::StatusOr<v1::ServerInfo> admin = ops.GetServerInfo();
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_FALSE(admin->has_tenant());
  ASSERT_EQ(admin->tenants_size(), 2);
  EXPECT_EQ(admin->tenants(0).name(), "team-a");
  EXPECT_EQ(admin->tenants(0).sequences(), 5);
  EXPECT_EQ(admin->tenants(0).bytes(), static_cast<int64_t>(6 * page_bytes_));
  EXPECT_EQ(admin->tenants(0).quota_refusals(), 3);
  EXPECT_EQ(admin->tenants(1).name(), "team-b");
  EXPECT_EQ(admin->tenants(1).bytes(), static_cast<int64_t>(8 * page_bytes_));

  const std::string metrics = server_->MetricsText();
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat("tqkv_tenant_bytes{tenant=\"team-a\"} ", 6 * page_bytes_)));
  EXPECT_THAT(metrics, HasSubstr("tqkv_tenant_sequences{tenant=\"team-a\"} 5"));
  EXPECT_THAT(metrics, HasSubstr("tqkv_tenant_quota_refusals_total{tenant=\"team-a\"} 3"));
  EXPECT_THAT(metrics, HasSubstr("tqkv_tenant_requests_total{code=\"RESOURCE_EXHAUSTED\",tenant=\"team-a\"} 2"));

  // Dropping everything gives it all back.
  for (const std::string id : {"team-a:2", "team-a:3", "team-a:3/beam", "team-a:5", "team-a:by-ops"}) {
    ASSERT_TRUE(a.DropSequence("", id).ok()) << id;
  }
  info = a.GetServerInfo();
  EXPECT_EQ(info->tenant().bytes(), 0);
  EXPECT_EQ(info->tenant().sequences(), 0);
  EXPECT_EQ(info->tenant().tokens(), 0);
}

}  // namespace
}  // namespace tqkv
