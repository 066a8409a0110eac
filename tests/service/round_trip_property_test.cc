// The round-trip property (tests/cache/round_trip_property.h) through real
// servers on loopback and the real client: random layouts the server accepts
// x random operation sequences (decode steps through AppendAttend), in
// lockstep with an unmoved twin server. The moved server is moved to a fresh
// server through ExportSequences -> ImportSequences (a client relay) or
// PullSequences, or restarted from the snapshot its shutdown writes, and
// must then hold and answer exactly what its twin does.
//
// The suite runs a bounded slice. The long run draws runs until
// TQKV_ROUND_TRIP_SECONDS have passed:
//   TQKV_ROUND_TRIP_SECONDS=1200 build/bin/service_test --gtest_filter='ServerRoundTrip*'
// TQKV_ROUND_TRIP_SEED=<n> repeats run n alone.
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/cpp/tqkv_client.h"
#include "gtest/gtest.h"
#include "service/config.h"
#include "service/server.h"
#include "tests/cache/round_trip_property.h"

namespace tqkv {
namespace {

using round_trip::AppendCall;
using round_trip::DecodeItem;
using round_trip::FloatBytes;
using round_trip::ReadResult;
using round_trip::Usage;

constexpr int kSliceRuns = 20;
constexpr int kStepsPerRun = 45;

// A tqkv-server in process, serving one cache, with a data directory of its
// own; Move starts a fresh server and Restart the same one again.
class ServerTarget : public round_trip::Target {
 public:
  static absl::StatusOr<std::unique_ptr<ServerTarget>> Create(const v1::CacheConfig& cache, uint64_t seed) {
    std::unique_ptr<ServerTarget> t(new ServerTarget(cache, seed));
    RETURN_IF_ERROR(t->StartFresh());
    return t;
  }
  ~ServerTarget() override {
    server_.reset();
    for (const std::string& dir : dirs_) std::system(absl::StrCat("rm -rf ", dir).c_str());
  }

  absl::StatusOr<bool> Append(const AppendCall& c) override {
    AppendArgs args;
    args.sequence_id = c.id;
    args.start_position = c.start;
    args.layer_begin = c.layer_begin;
    args.layer_end = c.layer_end;
    args.shape = {c.layer_end - c.layer_begin, c.n, heads_, dim_};
    args.keys = c.keys;
    args.values = c.values;
    args.request_id = c.request_id;
    ASSIGN_OR_RETURN(AppendResult r, client_->Append(args));
    return r.already_stored;
  }
  std::vector<ReadResult> DecodeLayer(int layer, const std::vector<DecodeItem>& items) override {
    AppendAttendArgs args;
    args.layer = layer;
    args.return_lse = true;
    for (const DecodeItem& item : items) {
      AppendAttendItemArgs a;
      a.sequence_id = item.id;
      a.start_position = item.start;
      a.kv_shape = {1, heads_, dim_};
      a.query_shape = {1, query_heads_, dim_};
      a.keys = item.key;
      a.values = item.value;
      a.queries = item.query;
      args.items.push_back(a);
    }
    absl::StatusOr<AppendAttendResult> r = client_->AppendAttend(args);
    std::vector<ReadResult> out;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!r.ok()) {
        out.push_back({r.status().code(), ""});
      } else {
        const AppendAttendItemResult& item = r->items[i];
        out.push_back({item.status.code(),
                       item.status.ok() ? FloatBytes(item.attention.output) + FloatBytes(item.attention.lse) : ""});
      }
    }
    return out;
  }
  absl::Status Create(const std::string& id) override { return client_->CreateSequence("", id).status(); }
  absl::Status Fork(const std::string& parent, const std::string& child) override {
    return client_->ForkSequence("", parent, child).status();
  }
  absl::Status Drop(const std::string& id) override { return client_->DropSequence("", id); }
  absl::StatusOr<SequenceInfo> Get(const std::string& id) override {
    ASSIGN_OR_RETURN(SequenceState s, client_->GetSequence("", id));
    SequenceInfo info;
    info.id = s.sequence_id;
    info.layer_tokens = s.layer_tokens;
    info.layer_held_begin = s.layer_oldest_token;
    info.pages = s.pages;
    return info;
  }
  std::vector<std::string> List() override {
    absl::StatusOr<std::vector<std::string>> ids = client_->ListSequences("");
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<std::string>();
  }
  ReadResult Attend(const std::string& id, int layer, int query_tokens, const std::vector<float>& q) override {
    AttendArgs args;
    args.return_lse = true;
    args.items.push_back({id, layer, {query_tokens, query_heads_, dim_}, q});
    absl::StatusOr<std::vector<AttendOutput>> out = client_->Attend(args);
    if (!out.ok()) return {out.status().code(), ""};
    return {absl::StatusCode::kOk, FloatBytes((*out)[0].output) + FloatBytes((*out)[0].lse)};
  }
  ReadResult Score(const std::string& id, int layer, int64_t begin, int64_t end, const std::vector<float>& q) override {
    if (begin == end) return {absl::StatusCode::kOk, ""};  // token_end 0 means "the layer's length"
    ScoreArgs args;
    args.sequence_id = id;
    args.layer = layer;
    args.shape = {query_heads_, dim_};
    args.queries = q;
    args.token_begin = begin;
    args.token_end = end;
    absl::StatusOr<ScoreResult> r = client_->Score(args);
    if (!r.ok()) return {r.status().code(), ""};
    return {absl::StatusCode::kOk, FloatBytes(r->logits)};
  }
  Usage GetUsage() override {
    absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return Usage{-1};
    const v1::CacheInfo& c = info->caches(0);
    return Usage{c.pages_used(), c.sequences(), c.tokens(), static_cast<uint64_t>(c.stored_bytes()),
                 static_cast<uint64_t>(c.stored_bytes_bf16())};
  }

  // Into a fresh server, by a client relay or a pull, alternately.
  absl::Status Move() override {
    std::unique_ptr<service::Server> from = std::move(server_);
    std::unique_ptr<Client> from_client = std::move(client_);
    RETURN_IF_ERROR(StartFresh());
    v1::ExportRequest request;
    request.set_all(true);
    if (moves_++ % 2 == 0) {
      RETURN_IF_ERROR(CopySequences(*from_client, *client_, request).status());
    } else {
      v1::PullSequencesRequest pull;
      pull.set_source(absl::StrCat("127.0.0.1:", from->port()));
      *pull.mutable_export_request() = request;
      RETURN_IF_ERROR(client_->PullSequences(pull).status());
    }
    return absl::OkStatus();  // `from` shuts down, writing its own directory
  }
  // Shutdown writes the snapshot; the next start loads it.
  absl::Status Restart() override {
    server_->Shutdown(absl::Now() + absl::Seconds(5));
    server_->Wait();
    server_.reset();
    return StartIn(dirs_.back());
  }

 private:
  ServerTarget(const v1::CacheConfig& cache, uint64_t seed)
      : heads_(cache.num_kv_heads()), query_heads_(cache.num_query_heads()), dim_(cache.head_dim()), seed_(seed) {
    *config_.add_caches() = cache;
  }

  absl::Status StartFresh() {
    std::string dir = absl::StrCat("/tmp/tqkv_round_trip_", getpid(), "_", seed_, "_", dirs_.size());
    std::system(absl::StrCat("rm -rf ", dir).c_str());
    dirs_.push_back(dir);
    return StartIn(dir);
  }
  absl::Status StartIn(const std::string& dir) {
    service::ServerOptions options;
    options.data_dir = dir;
    options.host = "127.0.0.1";
    options.port = 0;
    options.metrics_port = -1;
    options.threads = 1;
    options.config = config_;
    ASSIGN_OR_RETURN(server_, service::Server::Start(options));
    ClientOptions client;
    client.target = absl::StrCat("127.0.0.1:", server_->port());
    client.max_attempts = 1;
    client.timeout = absl::Seconds(30);
    client.stream_timeout = absl::Seconds(60);
    client_ = std::make_unique<Client>(client);
    return absl::OkStatus();
  }

  const int64_t heads_, query_heads_, dim_;
  const uint64_t seed_;
  v1::ServerConfig config_;
  std::vector<std::string> dirs_;
  std::unique_ptr<service::Server> server_;
  std::unique_ptr<Client> client_;
  int moves_ = 0;
};

bool RunOne(uint64_t seed, int* round_trips) {
  std::mt19937_64 rng(seed);
  std::shared_ptr<const KvLayout> layout;
  const CacheOptions options = round_trip::RandomCacheOptions(rng, &layout);
  const v1::CacheConfig config = service::ToCacheConfig(options);
  SCOPED_TRACE(testing::Message() << "seed " << seed << ", config " << config.ShortDebugString());
  absl::StatusOr<std::unique_ptr<ServerTarget>> a = ServerTarget::Create(config, seed * 2);
  absl::StatusOr<std::unique_ptr<ServerTarget>> b = ServerTarget::Create(config, seed * 2 + 1);
  EXPECT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  if (!a.ok() || !b.ok()) return false;
  round_trip::Lockstep run(*layout, a->get(), b->get(), seed * 7919 + 1, options.evict_lru);
  const bool ok = run.Run(kStepsPerRun);
  *round_trips += run.round_trips();
  return ok;
}

TEST(ServerRoundTripProperty, EveryStateSurvivesMovesAndRestartsBitForBit) {
  int round_trips = 0;
  if (const char* seed = std::getenv("TQKV_ROUND_TRIP_SEED")) {
    EXPECT_TRUE(RunOne(std::strtoull(seed, nullptr, 10), &round_trips));
    return;
  }
  const char* seconds = std::getenv("TQKV_ROUND_TRIP_SECONDS");
  const absl::Time until = absl::Now() + absl::Seconds(seconds == nullptr ? 0 : std::atof(seconds));
  int runs = 0, failed = 0;
  for (uint64_t seed = 1; (runs < kSliceRuns || absl::Now() < until) && failed < 3; ++seed, ++runs) {
    failed += !RunOne(seed, &round_trips);
  }
  std::printf("server round trip property: %d runs, %d moves and restarts, %d runs failed\n", runs, round_trips,
              failed);
  EXPECT_GE(round_trips, runs);
}

}  // namespace
}  // namespace tqkv
