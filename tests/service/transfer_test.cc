// ExportSequences / ImportSequences end to end: two real servers on
// loopback, the real client. A moved sequence answers Attend and ScoreQuery
// bit for bit as before and keeps growing; a stream that is cut, corrupted
// or meant for another layout is refused precisely, keeping what landed.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <tuple>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "client/cpp/tqkv_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/auth.h"
#include "service/config.h"
#include "service/server.h"
#include "tests/service/random_floats.h"

namespace tqkv {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Centering and exact tokens, so that means and exact pages move too.
constexpr char kConfig[] = R"pb(
  caches {
    name: "default"
    num_layers: 3
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 64
    page_tokens: 8
    preset: "tqkv_k3v4u_csw"
    boundary_layers: 1
    memory_budget_bytes: 4194304
    rope { base: 10000 }
  }
  caches {
    name: "other"
    num_layers: 3
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 64
    page_tokens: 8
    preset: "turboquant_3bit_nc"
    boundary_layers: 1
    memory_budget_bytes: 4194304
  }
)pb";
constexpr int kLayers = 3, kKvHeads = 2, kQueryHeads = 4, kDim = 64;

std::unique_ptr<service::Server> Start(const std::string& tokens = "", const std::string& data_dir = "",
                                       const char* config = kConfig) {
  service::ServerOptions options;
  options.data_dir = data_dir;
  options.host = "127.0.0.1";
  options.port = 0;
  options.metrics_port = -1;
  options.threads = 1;
  options.config = *service::ParseServerConfig(config);
  if (!tokens.empty()) options.auth = *service::ParseAuthConfig(tokens);
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

Client ClientOf(const service::Server& server, const std::string& token = "") {
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", server.port());
  options.max_attempts = 1;
  options.timeout = absl::Seconds(20);
  options.stream_timeout = absl::Seconds(60);
  options.auth_token = token;
  return Client(options);
}

class TransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = Start();
    b_ = Start();
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
  }

  absl::Status Append(Client& c, const std::string& id, int64_t start, int64_t tokens, uint32_t seed,
                      const std::string& cache = "") {
    kv_.push_back(RandomFloats(static_cast<size_t>(kLayers * tokens * kKvHeads * kDim), seed));
    AppendArgs args;
    args.cache = cache;
    args.sequence_id = id;
    args.start_position = start;
    args.shape = {kLayers, tokens, kKvHeads, kDim};
    args.keys = kv_.back();
    args.values = kv_.back();
    return c.Append(args).status();
  }

  // Every layer's Attend output and lse and ScoreQuery logits, as bytes.
  std::string Reads(Client& c, const std::string& id, const std::string& cache = "") {
    std::string bytes;
    for (int layer = 0; layer < kLayers; ++layer) {
      AttendArgs attend;
      attend.cache = cache;
      attend.return_lse = true;
      AttendItemArgs item;
      item.sequence_id = id;
      item.layer = layer;
      item.shape = {1, kQueryHeads, kDim};
      item.queries = queries_;
      attend.items = {item};
      absl::StatusOr<std::vector<AttendOutput>> out = c.Attend(attend);
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) return "";
      bytes.append(reinterpret_cast<const char*>((*out)[0].output.data()), (*out)[0].output.size() * 4);
      bytes.append(reinterpret_cast<const char*>((*out)[0].lse.data()), (*out)[0].lse.size() * 4);
      ScoreArgs score;
      score.cache = cache;
      score.sequence_id = id;
      score.layer = layer;
      // From the oldest token a sliding-window layer still holds.
      absl::StatusOr<SequenceState> state = c.GetSequence(cache, id);
      if (state.ok() && !state->layer_oldest_token.empty()) score.token_begin = state->layer_oldest_token[layer];
      score.shape = {kQueryHeads, kDim};
      score.queries = absl::MakeConstSpan(queries_.data(), kQueryHeads * kDim);
      absl::StatusOr<ScoreResult> logits = c.Score(score);
      EXPECT_TRUE(logits.ok()) << logits.status();
      if (logits.ok()) bytes.append(reinterpret_cast<const char*>(logits->logits.data()), logits->logits.size() * 4);
    }
    return bytes;
  }

  std::vector<v1::ExportChunk> ExportAll(Client& c, v1::ExportRequest request) {
    std::vector<v1::ExportChunk> chunks;
    const absl::Status status = c.ExportSequences(request, [&](v1::ExportChunk& chunk) {
      chunks.push_back(chunk);
      return absl::OkStatus();
    });
    EXPECT_TRUE(status.ok()) << status;
    return chunks;
  }

  absl::StatusOr<v1::ImportResponse> ImportAll(Client& c, const std::vector<v1::ExportChunk>& chunks) {
    size_t next = 0;
    return c.ImportSequences([&](v1::ExportChunk* out) -> absl::StatusOr<bool> {
      if (next == chunks.size()) return false;
      *out = chunks[next++];
      return true;
    });
  }

  std::unique_ptr<service::Server> a_, b_;
  std::vector<std::vector<float>> kv_;
  std::vector<float> queries_ = RandomFloats(kQueryHeads * kDim, 5);
};

TEST_F(TransferTest, MovedSequencesReadBitForBitAndKeepGrowing) {
  Client a = ClientOf(*a_), b = ClientOf(*b_);
  ASSERT_TRUE(Append(a, "chat-1", 0, 150, 1).ok());
  for (int64_t t = 150; t < 160; ++t) ASSERT_TRUE(Append(a, "chat-1", t, 1, 100 + t).ok());
  ASSERT_TRUE(a.ForkSequence("", "chat-1", "chat-1/beam").ok());
  ASSERT_TRUE(Append(a, "chat-1/beam", 160, 3, 7).ok());
  ASSERT_TRUE(Append(a, "chat-2", 0, 5, 2).ok());
  ASSERT_TRUE(Append(a, "solo", 0, 20, 3).ok());

  v1::ExportRequest request;
  request.set_id_prefix("chat-");
  absl::StatusOr<v1::ImportResponse> moved = CopySequences(a, b, request);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_THAT(moved->sequence_ids(), ElementsAre("chat-1", "chat-1/beam", "chat-2"));
  EXPECT_EQ(b.GetSequence("", "solo").status().code(), absl::StatusCode::kNotFound);
  for (const std::string id : {"chat-1", "chat-1/beam", "chat-2"}) {
    EXPECT_EQ(b.GetSequence("", id)->layer_tokens, a.GetSequence("", id)->layer_tokens) << id;
    EXPECT_TRUE(Reads(a, id) == Reads(b, id)) << id << ": reads differ after the move";
  }
  // The pages moved as stored: exactly the pages the copies hold (a page
  // the fork shares with its parent once), page_bytes each.
  absl::StatusOr<v1::ServerInfo> info = b.GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(moved->bytes(), moved->pages() * info->caches(0).page_bytes());
  EXPECT_EQ(moved->pages(), info->caches(0).pages_used());

  // Both copies grow alike; the move can be repeated into another cache of
  // the same layout only.
  ASSERT_TRUE(Append(a, "chat-1", 160, 2, 9).ok());
  ASSERT_TRUE(Append(b, "chat-1", 160, 2, 9).ok());
  EXPECT_TRUE(Reads(a, "chat-1") == Reads(b, "chat-1"));
  request.clear_id_prefix();
  request.add_sequence_ids("solo");
  const absl::StatusOr<v1::ImportResponse> wrong = CopySequences(a, b, request, "other");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("preset"));
  EXPECT_EQ(b.GetSequence("other", "solo").status().code(), absl::StatusCode::kNotFound);
  // Twice into the same cache: the id is taken, and the copy there is
  // untouched.
  request.clear_sequence_ids();
  request.add_sequence_ids("chat-2");
  const std::string chat_2 = Reads(b, "chat-2");
  const int pages_used = b.GetServerInfo()->caches(0).pages_used();
  EXPECT_EQ(CopySequences(a, b, request).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(Reads(b, "chat-2") == chat_2);
  EXPECT_EQ(b.GetServerInfo()->caches(0).pages_used(), pages_used);
  // Unknown names and empty requests.
  request.clear_sequence_ids();
  request.add_sequence_ids("nope");
  EXPECT_EQ(CopySequences(a, b, request).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(CopySequences(a, b, v1::ExportRequest()).status().code(), absl::StatusCode::kInvalidArgument);
}

// The disaggregated path: a prefill server takes the prompt (one
// AppendStream), the decode server imports it, and the decode loop goes on
// there, layer by layer, exactly as it would have on the prefill server.
TEST_F(TransferTest, PrefillThenMoveThenDecodeGivesTheDecodeTheSourceWouldHave) {
  Client prefill = ClientOf(*a_), decode = ClientOf(*b_);
  std::vector<float> kv = RandomFloats(kLayers * 200 * kKvHeads * kDim, 21);
  std::vector<AppendArgs> chunks(2);
  for (int c = 0; c < 2; ++c) {
    chunks[c].sequence_id = "req-9";
    chunks[c].start_position = 100 * c;
    chunks[c].shape = {kLayers, 100, kKvHeads, kDim};
    chunks[c].keys =
        absl::MakeConstSpan(kv.data() + c * kLayers * 100 * kKvHeads * kDim, kLayers * 100 * kKvHeads * kDim);
    chunks[c].values = chunks[c].keys;
    chunks[c].wire_dtype = v1::DTYPE_BF16;
  }
  ASSERT_TRUE(prefill.AppendStream(chunks).ok());
  v1::ExportRequest request;
  request.add_sequence_ids("req-9");
  ASSERT_TRUE(CopySequences(prefill, decode, request).ok());
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < kLayers; ++layer) {
      const std::vector<float> token = RandomFloats(kKvHeads * kDim, 100 * step + layer);
      AppendAttendArgs args;
      args.layer = layer;
      args.return_lse = true;
      args.items.resize(1);
      args.items[0].sequence_id = "req-9";
      args.items[0].start_position = 200 + step;
      args.items[0].kv_shape = {1, kKvHeads, kDim};
      args.items[0].query_shape = {1, kQueryHeads, kDim};
      args.items[0].keys = token;
      args.items[0].values = token;
      args.items[0].queries = queries_;
      absl::StatusOr<AppendAttendResult> there = decode.AppendAttend(args);
      absl::StatusOr<AppendAttendResult> here = prefill.AppendAttend(args);
      ASSERT_TRUE(there.ok()) << there.status();
      ASSERT_TRUE(here.ok()) << here.status();
      ASSERT_TRUE(there->items[0].status.ok()) << there->items[0].status;
      EXPECT_EQ(there->items[0].attention.output, here->items[0].attention.output)
          << "step " << step << " layer " << layer;
      EXPECT_EQ(there->items[0].attention.lse, here->items[0].attention.lse);
    }
  }
}

// PullSequences: the destination dials the source itself.
TEST_F(TransferTest, ADestinationPullsSequencesFromTheSourceWithNoRelay) {
  Client a = ClientOf(*a_), b = ClientOf(*b_);
  ASSERT_TRUE(Append(a, "p-1", 0, 70, 1).ok());
  ASSERT_TRUE(Append(a, "p-2", 0, 9, 2).ok());
  v1::PullSequencesRequest pull;
  pull.set_source(absl::StrCat("127.0.0.1:", a_->port()));
  pull.mutable_export_request()->set_id_prefix("p-");
  absl::StatusOr<v1::ImportResponse> pulled = b.PullSequences(pull);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_THAT(pulled->sequence_ids(), ElementsAre("p-1", "p-2"));
  EXPECT_TRUE(Reads(a, "p-1") == Reads(b, "p-1"));
  EXPECT_TRUE(Reads(a, "p-2") == Reads(b, "p-2"));
  // The source's errors come back named; a source that is not there is
  // UNAVAILABLE; a layout that differs is refused as for an import.
  pull.mutable_export_request()->clear_id_prefix();
  pull.mutable_export_request()->add_sequence_ids("nope");
  absl::StatusOr<v1::ImportResponse> missing = b.PullSequences(pull);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("the export from"));
  pull.mutable_export_request()->clear_sequence_ids();
  pull.mutable_export_request()->add_sequence_ids("p-2");
  pull.set_target_cache("other");
  EXPECT_EQ(b.PullSequences(pull).status().code(), absl::StatusCode::kFailedPrecondition);
  pull.set_target_cache("");
  pull.set_source("127.0.0.1:1");
  EXPECT_EQ(b.PullSequences(pull).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(TransferTest, ACutOrCorruptedStreamKeepsOnlyTheSequencesThatLandedWhole) {
  Client a = ClientOf(*a_), b = ClientOf(*b_);
  ASSERT_TRUE(Append(a, "s1", 0, 40, 1).ok());
  ASSERT_TRUE(Append(a, "s2", 0, 90, 2).ok());
  v1::ExportRequest request;
  request.set_all(true);
  const std::vector<v1::ExportChunk> chunks = ExportAll(a, request);
  ASSERT_GE(chunks.size(), 6u);  // header, s1 + pages, s2 + pages, trailer
  ASSERT_TRUE(chunks.front().has_header());
  ASSERT_TRUE(chunks.back().has_trailer());
  size_t s2 = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].has_sequence() && chunks[i].sequence().sequence_id() == "s2") s2 = i;
  }
  ASSERT_GT(s2, 0u);

  // A flipped byte in s2's pages: DATA_LOSS naming s2; s1 landed.
  std::vector<v1::ExportChunk> corrupt = chunks;
  (*corrupt[s2 + 1].mutable_pages()->mutable_data())[100] ^= 1;
  absl::StatusOr<v1::ImportResponse> r = ImportAll(b, corrupt);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("sequence 's2'"));
  EXPECT_TRUE(b.GetSequence("", "s1").ok());
  EXPECT_EQ(b.GetSequence("", "s2").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(b.DropSequence("", "s1").ok());

  // Cut after s2's state, before its pages: DATA_LOSS, s2 absent and its
  // pages given back.
  std::vector<v1::ExportChunk> cut(chunks.begin(), chunks.begin() + s2 + 1);
  r = ImportAll(b, cut);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(b.GetSequence("", "s2").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(b.DropSequence("", "s1").ok());
  EXPECT_EQ(b.GetServerInfo()->caches(0).pages_used(), 0);

  // Without the trailer: everything lands, but the call says it was cut.
  std::vector<v1::ExportChunk> untrailed(chunks.begin(), chunks.end() - 1);
  r = ImportAll(b, untrailed);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("without its trailer"));
  ASSERT_TRUE(b.DropSequence("", "s1").ok());
  ASSERT_TRUE(b.DropSequence("", "s2").ok());

  // Pages out of order, a sequence before the header: INVALID_ARGUMENT.
  std::vector<v1::ExportChunk> reordered = chunks;
  reordered[s2 + 1].mutable_pages()->set_first_page(1);
  EXPECT_EQ(ImportAll(b, reordered).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(b.DropSequence("", "s1").ok());
  std::vector<v1::ExportChunk> headless(chunks.begin() + 1, chunks.end());
  EXPECT_EQ(ImportAll(b, headless).status().code(), absl::StatusCode::kInvalidArgument);

  // The whole stream lands, and reads as the source does.
  r = ImportAll(b, chunks);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->sequence_ids(), ElementsAre("s1", "s2"));
  EXPECT_TRUE(Reads(a, "s2") == Reads(b, "s2"));
}

// Snapshots (service/snapshot.h): a restart with a data directory brings
// every sequence back, reading bit for bit as before; a torn, corrupt or
// foreign snapshot is skipped whole.
class SnapshotTest : public TransferTest {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/tqkv_snapshot_XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override {
    a_.reset();  // its shutdown snapshot goes into dir_
    std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }
  std::string dir_;
};

TEST_F(SnapshotTest, ARestartBringsEverySequenceBackIdentically) {
  const std::string tokens = "ops\nta tenant=team-a max_sequences=3\n";
  std::string before_1, before_beam, before_a;
  {
    a_ = Start(tokens, dir_);
    ASSERT_NE(a_, nullptr);
    Client ops = ClientOf(*a_, "ops"), ta = ClientOf(*a_, "ta");
    ASSERT_TRUE(Append(ops, "chat-1", 0, 120, 1).ok());
    for (int64_t t = 120; t < 125; ++t) ASSERT_TRUE(Append(ops, "chat-1", t, 1, 10 + t).ok());
    ASSERT_TRUE(ops.ForkSequence("", "chat-1", "chat-1/beam").ok());
    ASSERT_TRUE(Append(ops, "chat-1/beam", 125, 2, 3).ok());
    ASSERT_TRUE(Append(ta, "team-a:q", 0, 30, 4).ok());
    ASSERT_TRUE(ops.CreateSequence("", "empty").ok());
    before_1 = Reads(ops, "chat-1");
    before_beam = Reads(ops, "chat-1/beam");
    before_a = Reads(ops, "team-a:q");
    // On demand: admins only.
    absl::StatusOr<v1::SaveSnapshotResponse> saved;
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer ta");
    v1::SaveSnapshotResponse response;
    EXPECT_EQ(ta.stub().SaveSnapshot(&context, v1::SaveSnapshotRequest(), &response).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    a_->Shutdown(absl::Now() + absl::Seconds(5));  // writes the snapshot
    a_->Wait();
    a_.reset();
  }
  a_ = Start(tokens, dir_);
  ASSERT_NE(a_, nullptr);
  Client ops = ClientOf(*a_, "ops"), ta = ClientOf(*a_, "ta");
  EXPECT_TRUE(Reads(ops, "chat-1") == before_1);
  EXPECT_TRUE(Reads(ops, "chat-1/beam") == before_beam);
  EXPECT_TRUE(Reads(ops, "team-a:q") == before_a);
  EXPECT_EQ(ops.GetSequence("", "empty")->layer_tokens, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(ops.GetServerInfo()->caches(0).sequences(), 4);
  // The tenant is charged again for what it holds, and the sequences grow.
  EXPECT_EQ(ta.GetServerInfo()->tenant().sequences(), 1);
  ASSERT_TRUE(Append(ops, "chat-1", 125, 3, 8).ok());

  // A torn file (a crash mid-write cannot leave one: writes go to a
  // temporary file renamed into place; a disk can) is skipped whole.
  a_->Shutdown(absl::Now() + absl::Seconds(5));
  a_->Wait();
  a_.reset();
  const std::string path = absl::StrCat(dir_, "/default.tqkv-snapshot");
  for (const char* damage : {"truncate", "flip", "foreign"}) {
    SCOPED_TRACE(damage);
    std::string bytes;
    {
      std::ifstream in(path, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    ASSERT_GT(bytes.size(), 1000u);
    std::string damaged = bytes;
    if (std::string(damage) == "truncate") damaged.resize(bytes.size() - 100);
    if (std::string(damage) == "flip") damaged[bytes.size() / 2] ^= 0x10;
    if (std::string(damage) != "foreign") {
      std::ofstream(path, std::ios::binary | std::ios::trunc) << damaged;
    }
    // A foreign layout: the same file read by a cache of another preset.
    const std::string other = absl::StrReplaceAll(kConfig, {{"tqkv_k3v4u_csw", "turboquant_3bit_nc"}});
    a_ = Start(tokens, dir_, std::string(damage) == "foreign" ? other.c_str() : kConfig);
    ASSERT_NE(a_, nullptr);
    EXPECT_EQ(ClientOf(*a_, "ops").GetServerInfo()->caches(0).sequences(), 0);
    // The skipped file was set aside, not overwritten by the next snapshot.
    int kept = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      kept += absl::StrContains(entry.path().filename().string(), "default.tqkv-snapshot.skipped-");
    }
    EXPECT_GE(kept, 1);
    // Put the intact file back for the next damage.
    a_->Shutdown(absl::Now() + absl::Seconds(5));
    a_->Wait();
    a_.reset();
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  }
  a_ = Start(tokens, dir_);
  EXPECT_EQ(ClientOf(*a_, "ops").GetServerInfo()->caches(0).sequences(), 4);
}

// The Gemma 3 shape the quality report serves: the default recipe (4
// exact sinks, exact recent tokens) and a sliding-window layer whose window
// is longer than the exact recent tokens.
constexpr char kWindowedExactConfig[] = R"pb(
  caches {
    name: "default"
    num_layers: 3
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 64
    page_tokens: 8
    preset: "tqkv_k3v4u_csw"
    boundary_layers: 0
    memory_budget_bytes: 8388608
    rope { base: 10000 }
    exact_recent_tokens: 16
    sliding_window_layers { layers: 1 window: 40 }
  }
)pb";

// Every state a decode leaves behind moves and restarts: past the sliding
// window, step by step, and every short length of exact sinks alone.
TEST_F(SnapshotTest, ExactTokensAndSlidingWindowsMoveAndRestartAtEveryLength) {
  for (const bool windowed : {true, false}) {
    SCOPED_TRACE(windowed ? "sinks, exact recent tokens and a sliding window" : "exact sinks only");
    const std::string config =
        windowed ? std::string(kWindowedExactConfig)
                 : absl::StrReplaceAll(kConfig, {{"tqkv_k3v4u_csw\"", "tqkv_k3v4u_csw\" exact_recent_tokens: 0"}});
    const std::string dir = absl::StrCat(dir_, windowed ? "/w" : "/s");
    a_ = Start("", dir, config.c_str());
    b_ = Start("", "", config.c_str());
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
    Client a = ClientOf(*a_), b = ClientOf(*b_);
    std::map<std::string, std::string> before;
    // Lengths 1..20, one sequence each; then one decoded past the sliding window,
    // moved to b at every step.
    for (int64_t n = 1; n <= 20; ++n) ASSERT_TRUE(Append(a, absl::StrCat("len-", n), 0, n, n).ok());
    ASSERT_TRUE(Append(a, "long", 0, 30, 99).ok());
    for (int64_t t = 30; t < 90; ++t) {
      ASSERT_TRUE(Append(a, "long", t, 1, 100 + t).ok());
      v1::ExportRequest request;
      request.add_sequence_ids("long");
      absl::StatusOr<v1::ImportResponse> moved = CopySequences(a, b, request);
      ASSERT_TRUE(moved.ok()) << "length " << t + 1 << ": " << moved.status();
      EXPECT_TRUE(Reads(a, "long") == Reads(b, "long")) << "length " << t + 1;
      ASSERT_TRUE(b.DropSequence("", "long").ok());
    }
    const std::vector<std::string> ids = *a.ListSequences("");
    for (const std::string& id : ids) before[id] = Reads(a, id);
    a_.reset();  // its shutdown writes the snapshot
    a_ = Start("", dir, config.c_str());
    ASSERT_NE(a_, nullptr);
    Client again = ClientOf(*a_);
    EXPECT_EQ(again.GetServerInfo()->caches(0).sequences(), 21);
    for (const auto& [id, reads] : before) EXPECT_TRUE(Reads(again, id) == reads) << id;
    a_.reset();
    b_.reset();
  }
}

// A snapshot loads whole or not at all; one that does not fit (a smaller
// pool, a tenant's smaller quota) is set aside whole and never written over,
// and loads once the cache fits it again.
TEST_F(SnapshotTest, ASnapshotThatDoesNotFitIsSetAsideWholeAndLoadsLater) {
  const std::string tokens = "ops\nta tenant=team-a max_sequences=3\n";
  const std::string path = absl::StrCat(dir_, "/default.tqkv-snapshot");
  std::map<std::string, std::string> before;
  {
    a_ = Start(tokens, dir_);
    ASSERT_NE(a_, nullptr);
    Client ops = ClientOf(*a_, "ops");
    ASSERT_TRUE(Append(ops, "big", 0, 300, 1).ok());
    ASSERT_TRUE(Append(ops, "team-a:x", 0, 40, 2).ok());
    ASSERT_TRUE(Append(ops, "team-a:y", 0, 40, 3).ok());
    const std::vector<std::string> ids = *ops.ListSequences("");
    for (const std::string& id : ids) before[id] = Reads(ops, id);
    a_.reset();
  }
  const auto file_bytes = [](const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string saved = file_bytes(path);
  ASSERT_GT(saved.size(), 1000u);
  const auto set_aside = [&]() {
    std::vector<std::string> files;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      if (absl::StrContains(entry.path().string(), ".skipped-")) files.push_back(entry.path().string());
    }
    return files;
  };
  // A pool of 60 pages holds the small ones and not "big"; a quota of one
  // sequence holds "team-a:x" and not "team-a:y" (which follows it).
  const std::string small =
      absl::StrReplaceAll(kConfig, {{"memory_budget_bytes: 4194304", "memory_budget_bytes: 600000"}});
  for (const auto& [why, config, auth] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"a smaller pool", small, tokens},
           {"a smaller quota", kConfig, "ops\nta tenant=team-a max_sequences=1\n"}}) {
    SCOPED_TRACE(why);
    a_ = Start(auth, dir_, config.c_str());
    ASSERT_NE(a_, nullptr);
    Client ops = ClientOf(*a_, "ops");
    absl::StatusOr<v1::ServerInfo> info = ops.GetServerInfo();
    EXPECT_EQ(info->caches(0).sequences(), 0);  // nothing of it
    EXPECT_EQ(info->caches(0).pages_used(), 0);
    ASSERT_EQ(set_aside().size(), 1u);
    EXPECT_TRUE(file_bytes(set_aside()[0]) == saved) << "the file set aside is the file, whole";
    // Snapshots go on, beside it.
    ASSERT_TRUE(Append(ops, "new", 0, 5, 7).ok());
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer ops");
    v1::SaveSnapshotResponse response;
    ASSERT_TRUE(ops.stub().SaveSnapshot(&context, v1::SaveSnapshotRequest(), &response).ok());
    EXPECT_EQ(response.files(0).sequences(), 1);
    a_.reset();
    EXPECT_TRUE(file_bytes(set_aside()[0]) == saved);
    // Put back as the operator would, for the next case.
    std::filesystem::rename(set_aside()[0], path);
  }
  a_ = Start(tokens, dir_);
  ASSERT_NE(a_, nullptr);
  Client ops = ClientOf(*a_, "ops");
  EXPECT_EQ(ops.GetServerInfo()->caches(0).sequences(), 3);
  for (const auto& [id, reads] : before) EXPECT_TRUE(Reads(ops, id) == reads) << id;
}

// Forks restart in the pages they held before: a pool that fits them
// shared, and would not fit one more copy of the parent, takes them all.
TEST_F(SnapshotTest, FortyForksRestartInThePagesTheyHeld) {
  a_ = Start("", dir_);
  ASSERT_NE(a_, nullptr);
  Client a = ClientOf(*a_);
  ASSERT_TRUE(Append(a, "doc", 0, 640, 1).ok());
  const int parent_pages = a.GetServerInfo()->caches(0).pages_used();
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(a.ForkSequence("", "doc", absl::StrCat("doc/", i)).ok());
  absl::StatusOr<v1::ServerInfo> info = a.GetServerInfo();
  const int used = info->caches(0).pages_used();
  const int64_t page_bytes = info->caches(0).page_bytes();
  EXPECT_EQ(used, parent_pages);
  ASSERT_GT(parent_pages, 17);
  std::map<std::string, std::string> before;
  for (const std::string id : {"doc", "doc/0", "doc/39"}) before[id] = Reads(a, id);
  a_.reset();

  const std::string fits = absl::StrReplaceAll(
      kConfig, {{"memory_budget_bytes: 4194304", absl::StrCat("memory_budget_bytes: ", (used + 17) * page_bytes)}});
  a_ = Start("", dir_, fits.c_str());
  ASSERT_NE(a_, nullptr);
  Client again = ClientOf(*a_);
  info = again.GetServerInfo();
  EXPECT_EQ(info->caches(0).sequences(), 41);
  EXPECT_EQ(info->caches(0).pages_used(), used);
  for (const auto& [id, reads] : before) EXPECT_TRUE(Reads(again, id) == reads) << id;
  // Shared again: a fork's first append copies only its last page.
  ASSERT_TRUE(Append(again, "doc/7", 640, 1, 3).ok());
  EXPECT_TRUE(Reads(again, "doc/0") == before["doc/0"]);
}

// A crash mid-write leaves a temporary file: the next start removes it. A
// second server on the same data directory is refused.
TEST_F(SnapshotTest, StaleTemporariesGoAndADataDirectoryServesOneServer) {
  std::filesystem::create_directories(dir_);
  const std::string tmp = absl::StrCat(dir_, "/default.tqkv-snapshot.tmp");
  std::ofstream(tmp) << "half a snapshot";
  a_ = Start("", dir_);
  ASSERT_NE(a_, nullptr);
  EXPECT_FALSE(std::filesystem::exists(tmp));
  service::ServerOptions options;
  options.data_dir = dir_;
  options.host = "127.0.0.1";
  options.port = 0;
  options.metrics_port = -1;
  options.config = *service::ParseServerConfig(kConfig);
  absl::StatusOr<std::unique_ptr<service::Server>> second = service::Server::Start(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("in use by another tqkv-server"));
  a_.reset();
  second = service::Server::Start(options);  // the lock went with the first
  EXPECT_TRUE(second.ok()) << second.status();
}

// An export stream carries a page several of its sequences share once;
// version 2 streams (no shared pages) still import.
TEST_F(TransferTest, SharedPagesTravelOnceAndVersion2StreamsStillImport) {
  Client a = ClientOf(*a_), b = ClientOf(*b_);
  ASSERT_TRUE(Append(a, "doc", 0, 200, 1).ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(a.ForkSequence("", "doc", absl::StrCat("doc/", i)).ok());
  ASSERT_TRUE(Append(a, "doc/3", 200, 2, 2).ok());
  v1::ExportRequest request;
  request.set_all(true);
  const std::vector<v1::ExportChunk> chunks = ExportAll(a, request);
  const int used = a.GetServerInfo()->caches(0).pages_used();
  EXPECT_EQ(chunks.back().trailer().pages(), used);
  absl::StatusOr<v1::ImportResponse> r = ImportAll(b, chunks);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(b.GetServerInfo()->caches(0).pages_used(), used);
  for (const std::string id : {"doc", "doc/0", "doc/3"}) EXPECT_TRUE(Reads(a, id) == Reads(b, id)) << id;

  // A shared page the stream did not offer is refused, naming it.
  for (const std::string id : {"doc", "doc/0", "doc/1", "doc/2", "doc/3", "doc/4"})
    ASSERT_TRUE(b.DropSequence("", id).ok());
  std::vector<v1::ExportChunk> forged = chunks;
  for (v1::ExportChunk& chunk : forged) {
    if (chunk.has_sequence()) chunk.mutable_sequence()->clear_offered_pages();
  }
  r = ImportAll(b, forged);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("which no earlier sequence offered"));

  // One sequence alone is a version 2 stream in all but its number.
  request.clear_all();
  request.add_sequence_ids("doc/3");
  std::vector<v1::ExportChunk> single = ExportAll(a, request);
  single.front().mutable_header()->set_format_version(2);
  // Written before sequence_key_scales existed: the header does not say.
  single.front().mutable_header()->mutable_layout()->clear_sequence_key_scales();
  r = ImportAll(b, single);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Reads(a, "doc/3") == Reads(b, "doc/3"));
  single.front().mutable_header()->set_format_version(1);
  EXPECT_EQ(ImportAll(b, single).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(TransferTest, SaveSnapshotWithoutADataDirectoryIsFailedPrecondition) {
  Client a = ClientOf(*a_);
  grpc::ClientContext context;
  v1::SaveSnapshotResponse response;
  const grpc::Status status = a.stub().SaveSnapshot(&context, v1::SaveSnapshotRequest(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("--data_dir"));
}

TEST(TransferTenants, ATenantMovesOnlyItsOwnSequencesAndIsChargedForThem) {
  const std::string tokens = "ops\nta tenant=team-a max_sequences=2\ntb tenant=team-b\n";
  std::unique_ptr<service::Server> a = Start(tokens), b = Start(tokens);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  Client ops_a = ClientOf(*a, "ops"), ta_a = ClientOf(*a, "ta"), ta_b = ClientOf(*b, "ta"), tb_a = ClientOf(*a, "tb");
  std::vector<float> kv = RandomFloats(kLayers * 4 * kKvHeads * kDim, 3);
  for (const std::string id : {"team-a:x", "team-a:y", "team-b:z"}) {
    AppendArgs args;
    args.sequence_id = id;
    args.shape = {kLayers, 4, kKvHeads, kDim};
    args.keys = kv;
    args.values = kv;
    ASSERT_TRUE(ops_a.Append(args).ok()) << id;
  }
  v1::ExportRequest request;
  request.add_sequence_ids("team-a:x");
  EXPECT_EQ(CopySequences(tb_a, ta_b, request).status().code(), absl::StatusCode::kPermissionDenied);
  request.clear_sequence_ids();
  request.set_id_prefix("team-");
  EXPECT_EQ(CopySequences(ta_a, ta_b, request).status().code(), absl::StatusCode::kPermissionDenied);
  // `all` from a tenant means its own namespace.
  request.clear_id_prefix();
  request.set_all(true);
  absl::StatusOr<v1::ImportResponse> moved = CopySequences(ta_a, ta_b, request);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_THAT(moved->sequence_ids(), ElementsAre("team-a:x", "team-a:y"));
  absl::StatusOr<v1::ServerInfo> info = ta_b.GetServerInfo();
  EXPECT_EQ(info->tenant().sequences(), 2);
  EXPECT_EQ(info->tenant().bytes(), moved->bytes());
  // team-b's sequence, moved by the admin into team-a's hands? Not on the
  // import side: a tenant's import names only its own ids.
  request.set_all(false);
  request.add_sequence_ids("team-b:z");
  EXPECT_EQ(CopySequences(ops_a, ta_b, request).status().code(), absl::StatusCode::kPermissionDenied);
  // A pull makes the server dial out: admins only.
  v1::PullSequencesRequest pull;
  pull.set_source(absl::StrCat("127.0.0.1:", a->port()));
  pull.set_source_auth_token("ta");
  pull.mutable_export_request()->set_all(true);
  EXPECT_EQ(ta_b.PullSequences(pull).status().code(), absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace tqkv
