// The decode loop through the real server: AppendAttend (one layer of a step,
// batched over sequences) and DecodeStream (the same, one message per layer),
// checked against the cache library doing Append then Attend; their errors;
// the executor's bounds; many streams at once against a replay.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cache/kv_cache.h"
#include "client/cpp/tqkv_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "service/config.h"
#include "service/executor.h"
#include "service/server.h"
#include "tests/service/random_floats.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;

constexpr int kLayers = 3;
constexpr int kKvHeads = 2;
constexpr int kQueryHeads = 4;
constexpr int kHeadDim = 64;

// "default": compressed with an fp16 first and last layer; "csw": the
// centering + sinks + recent tokens recipe the default config serves; "tiny": room
// for two pages; "swa": the recipe with sliding-window layers 0 and 2.
constexpr char kConfig[] = R"pb(
  caches {
    name: "default"
    num_layers: 3
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 64
    page_tokens: 4
    preset: "turboquant_k3v4_nc"
    boundary_layers: 1
    memory_budget_bytes: 8388608
  }
  caches {
    name: "csw"
    num_layers: 3
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 64
    page_tokens: 4
    preset: "tqkv_k3v4u_csw"
    boundary_layers: 0
    exact_sink_tokens: 2
    exact_recent_tokens: 8
    centering_tokens: 8
    rope { pair_layout: HALF_SPLIT base: 10000 }
    memory_budget_bytes: 8388608
  }
  caches {
    name: "tiny"
    num_layers: 3
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 64
    page_tokens: 4
    preset: "fp16"
    boundary_layers: 0
  }
  caches {
    name: "swa"
    num_layers: 3
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 64
    page_tokens: 4
    preset: "tqkv_k3v4u_csw"
    boundary_layers: 0
    exact_sink_tokens: 2
    exact_recent_tokens: 4
    centering_tokens: 8
    rope { pair_layout: HALF_SPLIT base: 10000 }
    sliding_window_layers {
      layers: [ 0, 2 ]
      window: 6
    }
    memory_budget_bytes: 8388608
  }
)pb";

// One item's data: K/V [tokens, kv_heads, head_dim], Q [tokens, heads, dim].
struct Step {
  std::string id;
  int64_t start = 0;
  int64_t tokens = 1;
  std::vector<float> keys, values, queries;
};

Step MakeStep(const std::string& id, int64_t start, int64_t tokens, uint64_t seed) {
  Step s;
  s.id = id;
  s.start = start;
  s.tokens = tokens;
  s.keys = RandomFloats(tokens * kKvHeads * kHeadDim, seed);
  s.values = RandomFloats(tokens * kKvHeads * kHeadDim, seed + 1);
  s.queries = RandomFloats(tokens * kQueryHeads * kHeadDim, seed + 2);
  return s;
}

AppendAttendItemArgs ItemArgs(const Step& s) {
  AppendAttendItemArgs a;
  a.sequence_id = s.id;
  a.start_position = s.start;
  a.kv_shape = {s.tokens, kKvHeads, kHeadDim};
  a.query_shape = {s.tokens, kQueryHeads, kHeadDim};
  a.keys = s.keys;
  a.values = s.values;
  a.queries = s.queries;
  return a;
}

// The args point into `steps`: keep them alive while the args are used (a
// braced temporary lives only to the end of the full expression).
AppendAttendArgs StepArgs(const std::string& cache, int layer, const std::vector<Step>& steps, bool return_lse = true) {
  AppendAttendArgs args;
  args.cache = cache;
  args.layer = layer;
  args.return_lse = return_lse;
  for (const Step& s : steps) args.items.push_back(ItemArgs(s));
  return args;
}

class DecodeLoopTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(service::ExecutorOptions()); }

  void Start(const service::ExecutorOptions& executor) {
    server_.reset();
    service::ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(kConfig);
    ASSERT_TRUE(config.ok()) << config.status();
    options.config = *config;
    options.threads = 2;
    options.metrics_port = -1;
    options.executor = executor;
    // "tiny": exactly two pages.
    absl::StatusOr<std::vector<CacheOptions>> probe = service::ToCacheOptions(options.config, uint64_t{1} << 30);
    ASSERT_TRUE(probe.ok()) << probe.status();
    absl::StatusOr<std::shared_ptr<const KvLayout>> tiny = KvLayout::Create((*probe)[2].layout);
    ASSERT_TRUE(tiny.ok());
    options.config.mutable_caches(2)->set_memory_budget_bytes(2 * (*tiny)->page_bytes());
    absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ClientOptions client_options;
    client_options.target = absl::StrCat("127.0.0.1:", server_->port());
    client_options.max_attempts = 1;
    client_options.timeout = absl::Seconds(30);
    client_ = std::make_unique<Client>(client_options);
  }

  // The cache library on its own CPU backend, with the server's options for
  // `cache`: the reference.
  std::unique_ptr<KvCache> Reference(int index) {
    absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(kConfig);
    absl::StatusOr<std::vector<CacheOptions>> options = service::ToCacheOptions(*config, uint64_t{1} << 30);
    if (!options.ok()) return nullptr;
    if (backend_ == nullptr) {
      CpuBackendOptions backend;  // the server's defaults (integer attention where the CPU has it)
      backend.num_threads = 2;
      backend_ = MakeCpuBackend(backend);
    }
    absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create((*options)[index], backend_.get());
    return cache.ok() ? *std::move(cache) : nullptr;
  }

  // What the reference gives for `s` appended to `layer`, then attended.
  static void ReferenceStep(KvCache& cache, int layer, const Step& s, std::vector<float>* output,
                            std::vector<float>* lse) {
    AppendRequest r;
    r.sequence_id = s.id;
    r.start_position = s.start;
    r.layer_begin = layer;
    r.layer_end = layer + 1;
    r.num_tokens = s.tokens;
    r.keys = s.keys.data();
    r.values = s.values.data();
    ASSERT_TRUE(cache.Append(r).ok());
    output->assign(s.queries.size(), 0.0f);
    lse->assign(s.tokens * kQueryHeads, 0.0f);
    AttendRequestItem item{s.id, layer, static_cast<int>(s.tokens), s.queries.data(), output->data(), lse->data()};
    ASSERT_TRUE(cache.Attend(absl::MakeConstSpan(&item, 1)).ok());
  }

  // The bytes the pool counts for `ids` together (GetSequence; 0 for one
  // that does not exist yet).
  int64_t HeldBytes(const std::string& cache, std::initializer_list<const char*> ids) {
    int64_t bytes = 0;
    for (const char* id : ids) {
      absl::StatusOr<SequenceState> seq = client_->GetSequence(cache, id);
      if (seq.ok()) bytes += seq->stored_bytes;
    }
    return bytes;
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<service::Server> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(DecodeLoopTest, AppendAttendEqualsAppendThenAttendLayerByLayer) {
  for (const auto& [cache_name, index] : {std::pair<std::string, int>{"default", 0}, {"csw", 1}, {"swa", 3}}) {
    SCOPED_TRACE(cache_name);
    std::unique_ptr<KvCache> reference = Reference(index);
    ASSERT_NE(reference, nullptr);
    // A prefill of 12 tokens for "a" and 5 tokens (in one multi-token item)
    // for "b", then 14 decode steps for both, layer by layer.
    int64_t pos_a = 0, pos_b = 0;
    uint64_t seed = 100;
    for (int step = 0; step < 15; ++step) {
      const int64_t ta = step == 0 ? 12 : 1, tb = step == 0 ? 5 : 1;
      for (int layer = 0; layer < kLayers; ++layer) {
        const std::vector<Step> steps = {MakeStep("a", pos_a, ta, seed), MakeStep("b", pos_b, tb, seed + 10)};
        seed += 20;
        // The reply's bytes: the change the pool's accounting made for both.
        const int64_t held_before = HeldBytes(cache_name, {"a", "b"});
        absl::StatusOr<AppendAttendResult> got = client_->AppendAttend(StepArgs(cache_name, layer, steps));
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_EQ(got->items.size(), 2u);
        for (int i = 0; i < 2; ++i) {
          const AppendAttendItemResult& r = got->items[i];
          ASSERT_TRUE(r.status.ok()) << r.status;
          std::vector<float> output, lse;
          ReferenceStep(*reference, layer, steps[i], &output, &lse);
          EXPECT_EQ(r.attention.output, output) << "step " << step << " layer " << layer;
          EXPECT_EQ(r.attention.lse, lse);
          EXPECT_EQ(r.attention.shape, (std::array<int64_t, 3>{steps[i].tokens, kQueryHeads, kHeadDim}));
          EXPECT_EQ(r.layer_tokens, steps[i].start + steps[i].tokens);
          EXPECT_FALSE(r.already_stored);
        }
        EXPECT_EQ(got->stored_bytes, HeldBytes(cache_name, {"a", "b"}) - held_before);
      }
      pos_a += ta;
      pos_b += tb;
    }
    absl::StatusOr<SequenceState> a = client_->GetSequence(cache_name, "a");
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->layer_tokens, std::vector<int64_t>(kLayers, pos_a));
    // Windowed layers keep what the last token's query sees (6 tokens), the
    // full-attention layer everything.
    const int64_t oldest = cache_name == "swa" ? pos_a - 6 : 0;
    EXPECT_EQ(a->layer_oldest_token, (std::vector<int64_t>{oldest, 0, oldest}));
  }
}

TEST_F(DecodeLoopTest, AResentStepIsAlreadyStoredAndAttendsTheSame) {
  const std::vector<Step> steps = {MakeStep("r", 0, 6, 1)};
  absl::StatusOr<AppendAttendResult> first = client_->AppendAttend(StepArgs("", 1, steps));
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<AppendAttendResult> again = client_->AppendAttend(StepArgs("", 1, steps));
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(again->items[0].status.ok()) << again->items[0].status;
  EXPECT_TRUE(again->items[0].already_stored);
  EXPECT_EQ(again->items[0].attention.output, first->items[0].attention.output);
  EXPECT_EQ(again->stored_bytes, 0);
  absl::StatusOr<SequenceState> r = client_->GetSequence("", "r");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->layer_tokens, (std::vector<int64_t>{0, 6, 0}));
  // A different length at the same position is no retry.
  const std::vector<Step> other = {MakeStep("r", 0, 4, 2)};
  absl::StatusOr<AppendAttendResult> wrong = client_->AppendAttend(StepArgs("", 1, other));
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ(wrong->items[0].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong->items[0].status.message(), HasSubstr("6"));
}

TEST_F(DecodeLoopTest, StateErrorsAreReportedPerItemAndTheOthersProceed) {
  ASSERT_TRUE(client_->AppendAttend(StepArgs("", 0, {MakeStep("x", 0, 3, 1)})).ok());
  const std::vector<Step> steps = {MakeStep("x", 7, 1, 2),       // wrong position
                                   MakeStep("new", 0, 2, 3),     // fine: created
                                   MakeStep("ghost", 0, 1, 4)};  // do_not_create
  AppendAttendArgs args = StepArgs("", 0, steps);
  args.items[2].create_if_missing = false;
  absl::StatusOr<AppendAttendResult> got = client_->AppendAttend(args);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->items[0].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(got->items[0].status.message(), HasSubstr("3"));
  EXPECT_TRUE(got->items[1].status.ok());
  EXPECT_EQ(got->items[1].layer_tokens, 2);
  EXPECT_EQ(got->items[2].status.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(got->items[2].attention.output.empty());
  EXPECT_EQ(client_->GetSequence("", "x")->layer_tokens[0], 3);
  EXPECT_EQ(client_->GetSequence("", "ghost").status().code(), absl::StatusCode::kNotFound);

  // A full pool: the item that does not fit fails alone and changes nothing.
  const std::vector<Step> big = {MakeStep("t1", 0, 8, 5)};
  ASSERT_TRUE(client_->AppendAttend(StepArgs("tiny", 0, big))->items[0].status.ok());
  absl::StatusOr<AppendAttendResult> full = client_->AppendAttend(StepArgs("tiny", 0, {MakeStep("t2", 0, 1, 6)}));
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->items[0].status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(client_->GetSequence("tiny", "t2").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(DecodeLoopTest, MalformedRequestsFailTheCallAndStoreNothing) {
  const auto expect_invalid = [&](const AppendAttendArgs& args, const std::string& what) {
    absl::StatusOr<AppendAttendResult> got = client_->AppendAttend(args);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(got.status().message(), HasSubstr(what));
    EXPECT_EQ(client_->GetSequence("", "m").status().code(), absl::StatusCode::kNotFound) << what;
  };
  const std::vector<Step> good = {MakeStep("m", 0, 2, 1)};
  const std::vector<Step> twice = {good[0], MakeStep("m", 0, 2, 2)};
  expect_invalid(StepArgs("", 0, twice), "also item 0");
  AppendAttendArgs layer = StepArgs("", 0, good);
  layer.layer = kLayers;
  expect_invalid(layer, "layer 3");
  AppendAttendArgs scale = StepArgs("", 0, good);
  scale.scale = -1;
  expect_invalid(scale, "scale");
  std::vector<Step> nan = {good[0], MakeStep("n2", 0, 2, 3)};
  nan[1].values[5] = std::nanf("");
  expect_invalid(StepArgs("", 0, nan), "item 1 values");
  std::vector<Step> short_queries = {good[0], MakeStep("n3", 0, 2, 4)};
  short_queries[1].queries.resize(kQueryHeads * kHeadDim);
  AppendAttendArgs mismatch = StepArgs("", 0, short_queries);
  mismatch.items[1].query_shape = {1, kQueryHeads, kHeadDim};
  expect_invalid(mismatch, "item 1 queries");
  AppendAttendArgs sinks = StepArgs("", 0, good);
  sinks.sink_logits = {1.0f, 2.0f};
  expect_invalid(sinks, "sink_logits");
  const std::vector<Step> negative = {MakeStep("m", -1, 1, 5)};
  expect_invalid(StepArgs("", 0, negative), "start_position");
  AppendAttendArgs cache = StepArgs("nope", 0, good);
  EXPECT_EQ(client_->AppendAttend(cache).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(DecodeLoopTest, SinkLogitsJoinTheSoftmaxAsAZeroValueLogit) {
  const std::vector<Step> steps = {MakeStep("s", 0, 5, 9)};
  const Step& s = steps[0];
  absl::StatusOr<AppendAttendResult> plain = client_->AppendAttend(StepArgs("", 0, steps));
  ASSERT_TRUE(plain.ok());
  const std::vector<float> sinks = {-1.0f, 0.0f, 2.0f, 30.0f};
  // The same tokens attended again (already stored) with sinks, unary and via Attend.
  AppendAttendArgs args = StepArgs("", 0, steps);
  args.sink_logits = sinks;
  absl::StatusOr<AppendAttendResult> with = client_->AppendAttend(args);
  ASSERT_TRUE(with.ok()) << with.status();
  AttendArgs attend;
  attend.items = {{"s", 0, {5, kQueryHeads, kHeadDim}, s.queries}};
  attend.return_lse = true;
  attend.sink_logits = sinks;
  absl::StatusOr<std::vector<AttendOutput>> via_attend = client_->Attend(attend);
  ASSERT_TRUE(via_attend.ok()) << via_attend.status();
  const AttendOutput& p = plain->items[0].attention;
  for (int t = 0; t < 5; ++t) {
    for (int h = 0; h < kQueryHeads; ++h) {
      const double lse = p.lse[t * kQueryHeads + h];
      const double total = std::log(std::exp(lse) + std::exp(static_cast<double>(sinks[h])));
      EXPECT_NEAR(with->items[0].attention.lse[t * kQueryHeads + h], total, 1e-5);
      EXPECT_NEAR((*via_attend)[0].lse[t * kQueryHeads + h], total, 1e-5);
      for (int d = 0; d < kHeadDim; ++d) {
        const size_t i = (t * kQueryHeads + h) * kHeadDim + d;
        const double want = p.output[i] * std::exp(lse - total);
        EXPECT_NEAR(with->items[0].attention.output[i], want, 1e-5);
        EXPECT_NEAR((*via_attend)[0].output[i], want, 1e-5);
      }
    }
  }
}

// Logit soft-capping on the centering + sinks + recent tokens cache (so the
// add-back's constant part is in play): AppendAttend, Attend and a
// DecodeStream step agree, and their lse is the log-sum-exp of
// cap * tanh(x / cap) over the true logits x, which ScoreQuery returns (and
// returns capped when asked). A cap of 1 moves the lse far beyond the
// tolerance the integer kernel needs.
TEST_F(DecodeLoopTest, LogitSoftcapCapsEveryLogitOnEveryPath) {
  constexpr float kCap = 1.0f;
  constexpr int kTokens = 12;
  std::vector<Step> steps = {MakeStep("cap", 0, kTokens, 77)};
  // Keys around a shared vector, as a model's are: the centering then has a
  // mean to take out and the add-back to put back.
  for (size_t i = 0; i < steps[0].keys.size(); ++i) steps[0].keys[i] += 2.0f * std::sin(0.37f * (i % (2 * kHeadDim)));
  const Step& s = steps[0];
  AppendAttendArgs args = StepArgs("csw", 1, steps);
  args.logit_softcap = kCap;
  absl::StatusOr<AppendAttendResult> appended = client_->AppendAttend(args);
  ASSERT_TRUE(appended.ok()) << appended.status();
  ASSERT_TRUE(appended->items[0].status.ok()) << appended->items[0].status;
  const AttendOutput& capped = appended->items[0].attention;

  AttendArgs attend;
  attend.cache = "csw";
  attend.items = {{"cap", 1, {kTokens, kQueryHeads, kHeadDim}, s.queries}};
  attend.return_lse = true;
  attend.logit_softcap = kCap;
  absl::StatusOr<std::vector<AttendOutput>> via_attend = client_->Attend(attend);
  ASSERT_TRUE(via_attend.ok()) << via_attend.status();
  std::unique_ptr<DecodeStream> stream = client_->OpenDecodeStream("cap");
  absl::StatusOr<AppendAttendResult> via_stream = stream->Step(args);  // already stored: attends only
  ASSERT_TRUE(via_stream.ok()) << via_stream.status();
  ASSERT_TRUE(via_stream->items[0].status.ok()) << via_stream->items[0].status;
  EXPECT_TRUE(via_stream->items[0].already_stored);
  args.logit_softcap = 0.0f;
  absl::StatusOr<AppendAttendResult> uncapped = client_->AppendAttend(args);
  ASSERT_TRUE(uncapped.ok()) << uncapped.status();

  double moved = 0.0;
  for (int t = 0; t < kTokens; ++t) {
    ScoreArgs score;
    score.cache = "csw";
    score.sequence_id = "cap";
    score.layer = 1;
    score.shape = {kQueryHeads, kHeadDim};
    score.queries =
        absl::MakeConstSpan(s.queries).subspan(static_cast<size_t>(t) * kQueryHeads * kHeadDim, kQueryHeads * kHeadDim);
    score.token_end = t + 1;
    absl::StatusOr<ScoreResult> raw = client_->Score(score);
    ASSERT_TRUE(raw.ok()) << raw.status();
    score.logit_softcap = kCap;
    absl::StatusOr<ScoreResult> capped_logits = client_->Score(score);
    ASSERT_TRUE(capped_logits.ok()) << capped_logits.status();
    for (int h = 0; h < kQueryHeads; ++h) {
      double top = -1e300, sum = 0.0;
      std::vector<double> x(t + 1);
      for (int k = 0; k <= t; ++k) {
        const size_t at = static_cast<size_t>(h) * (t + 1) + k;
        x[k] = kCap * std::tanh(raw->logits[at] / kCap);
        EXPECT_NEAR(capped_logits->logits[at], x[k], 1e-6);
        top = std::max(top, x[k]);
      }
      for (double v : x) sum += std::exp(v - top);
      const size_t row = static_cast<size_t>(t) * kQueryHeads + h;
      EXPECT_NEAR(capped.lse[row], top + std::log(sum), 0.05) << "token " << t << " head " << h;
      EXPECT_NEAR((*via_attend)[0].lse[row], capped.lse[row], 1e-5);
      EXPECT_NEAR(via_stream->items[0].attention.lse[row], capped.lse[row], 1e-5);
      moved = std::max(moved, std::fabs(double{uncapped->items[0].attention.lse[row]} - capped.lse[row]));
      for (int d = 0; d < kHeadDim; ++d) {
        const size_t i = row * kHeadDim + d;
        EXPECT_NEAR((*via_attend)[0].output[i], capped.output[i], 1e-5);
        EXPECT_NEAR(via_stream->items[0].attention.output[i], capped.output[i], 1e-5);
      }
    }
  }
  EXPECT_GT(moved, 0.5) << "the cap should move the lse by far more than the tolerance";
}

// A negative, infinite or NaN cap is INVALID_ARGUMENT on every path, and an
// AppendAttend or a DecodeStream step refused for it stores nothing.
TEST_F(DecodeLoopTest, ABadLogitSoftcapIsRefusedAndChangesNothing) {
  const std::vector<Step> steps = {MakeStep("bad", 0, 2, 5)};
  std::unique_ptr<DecodeStream> stream = client_->OpenDecodeStream("bad");
  for (float cap : {-1.0f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    SCOPED_TRACE(cap);
    AppendAttendArgs args = StepArgs("csw", 0, steps);
    args.logit_softcap = cap;
    absl::StatusOr<AppendAttendResult> unary = client_->AppendAttend(args);
    EXPECT_EQ(unary.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(unary.status().message(), HasSubstr("logit_softcap"));
    absl::StatusOr<AppendAttendResult> streamed = stream->Step(args);
    EXPECT_EQ(streamed.status().code(), absl::StatusCode::kInvalidArgument) << streamed.status();
    EXPECT_EQ(client_->GetSequence("csw", "bad").status().code(), absl::StatusCode::kNotFound);
    AttendArgs attend;
    attend.cache = "csw";
    attend.items = {{"bad", 0, {2, kQueryHeads, kHeadDim}, steps[0].queries}};
    attend.logit_softcap = cap;
    EXPECT_EQ(client_->Attend(attend).status().code(), absl::StatusCode::kInvalidArgument);
    ScoreArgs score;
    score.cache = "csw";
    score.sequence_id = "bad";
    score.shape = {kQueryHeads, kHeadDim};
    score.queries = absl::MakeConstSpan(steps[0].queries).subspan(0, kQueryHeads * kHeadDim);
    score.logit_softcap = cap;
    EXPECT_EQ(client_->Score(score).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST_F(DecodeLoopTest, DecodeStreamAnswersInOrderAndEqualsUnary) {
  std::unique_ptr<DecodeStream> stream = client_->OpenDecodeStream("st");
  // Twin sequences: "st" through the stream, "un" through unary calls, with
  // the same data. Four steps of three layers, all sent before any is read.
  std::vector<AppendAttendArgs> sent;
  std::vector<std::vector<Step>> keep;
  keep.reserve(12);
  uint64_t seed = 1;
  for (int step = 0; step < 4; ++step) {
    for (int layer = 0; layer < kLayers; ++layer) {
      keep.push_back({MakeStep("st", step == 0 ? 0 : 3 + step, step == 0 ? 4 : 1, seed++)});
      absl::StatusOr<uint64_t> id = stream->Send(StepArgs("", layer, keep.back()));
      ASSERT_TRUE(id.ok()) << id.status();
      EXPECT_EQ(*id, keep.size());
      sent.push_back(StepArgs("", layer, keep.back()));
    }
  }
  // A malformed step in the middle of the stream: an error response, and
  // the stream goes on.
  const AppendAttendArgs bad = StepArgs("", 9, keep.back());
  ASSERT_TRUE(stream->Send(bad).ok());
  for (size_t i = 0; i < sent.size(); ++i) {
    absl::StatusOr<DecodeStream::Response> r = stream->Receive();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->request_id, i + 1);
    ASSERT_TRUE(r->status.ok()) << r->status;
    ASSERT_TRUE(r->result.items[0].status.ok()) << r->result.items[0].status;
    std::vector<Step> twin = keep[i];
    twin[0].id = "un";
    absl::StatusOr<AppendAttendResult> unary = client_->AppendAttend(StepArgs("", sent[i].layer, twin));
    ASSERT_TRUE(unary.ok());
    EXPECT_EQ(r->result.items[0].attention.output, unary->items[0].attention.output);
    EXPECT_EQ(r->result.items[0].attention.lse, unary->items[0].attention.lse);
    EXPECT_EQ(r->result.stored_bytes, unary->stored_bytes);
  }
  absl::StatusOr<DecodeStream::Response> error = stream->Receive();
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->request_id, sent.size() + 1);
  EXPECT_EQ(error->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(error->status.message(), HasSubstr("layer 9"));
  // Still open: one more step works.
  const std::vector<Step> more = {MakeStep("st", 7, 1, 99)};
  absl::StatusOr<AppendAttendResult> last = stream->Step(StepArgs("", 0, more));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->items[0].layer_tokens, 8);
  EXPECT_TRUE(stream->Close().ok());
}

TEST_F(DecodeLoopTest, AResumedStreamResendsWhatWasNotAnsweredWithoutStoringTwice) {
  std::vector<std::vector<Step>> steps;
  for (int layer = 0; layer < kLayers; ++layer) steps.push_back({MakeStep("z", 0, 2, 10 + layer)});
  {
    std::unique_ptr<DecodeStream> stream = client_->OpenDecodeStream("z");
    for (int layer = 0; layer < kLayers; ++layer) {
      ASSERT_TRUE(stream->Send(StepArgs("", layer, steps[layer])).ok());
    }
    // Only the first answer is read; the stream is then dropped (cancelled).
    absl::StatusOr<DecodeStream::Response> r = stream->Receive();
    ASSERT_TRUE(r.ok());
  }
  std::unique_ptr<DecodeStream> resumed = client_->OpenDecodeStream("z");
  for (int layer = 1; layer < kLayers; ++layer) {
    absl::StatusOr<AppendAttendResult> r = resumed->Step(StepArgs("", layer, steps[layer]));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->items[0].status.ok()) << r->items[0].status;
    EXPECT_EQ(r->items[0].layer_tokens, 2);
  }
  EXPECT_TRUE(resumed->Close().ok());
  EXPECT_EQ(client_->GetSequence("", "z")->layer_tokens, std::vector<int64_t>(kLayers, 2));
}

TEST_F(DecodeLoopTest, AFullExecutorRefusesAtOnceAndNoCallStalls) {
  service::ExecutorOptions tight;
  tight.threads = 1;
  tight.max_pending = 2;
  Start(tight);
  ASSERT_TRUE(client_->AppendAttend(StepArgs("", 0, {MakeStep("e", 0, 64, 1)})).ok());
  // Eight threads hammer a two-call executor: every call ends, OK or
  // RESOURCE_EXHAUSTED, and the refusals are counted.
  std::atomic<int> ok{0}, refused{0}, other{0};
  std::vector<std::thread> threads;
  const std::vector<float> q = RandomFloats(64 * kQueryHeads * kHeadDim, 2);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10; ++i) {
        AttendArgs args;
        args.items = {{"e", 0, {64, kQueryHeads, kHeadDim}, q}};
        absl::StatusOr<std::vector<AttendOutput>> r = client_->Attend(args);
        if (r.ok()) {
          ++ok;
        } else if (absl::IsResourceExhausted(r.status())) {
          EXPECT_THAT(r.status().message(), HasSubstr("pending"));
          ++refused;
        } else {
          ++other;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok + refused, 80);
  EXPECT_EQ(other, 0);
  EXPECT_GT(ok, 0);
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->executor().threads(), 1);
  EXPECT_EQ(info->executor().max_pending_calls(), 2);
  EXPECT_EQ(info->executor().rejected(), refused.load());
}

// 64 streams decode their own sequences at once while unary calls run beside
// them; every stream's outputs must equal a replay of its steps on the
// library. TQKV_SOAK_SECONDS=60 makes it the minute-long soak
// docs/decode_loop.md quotes; the suite runs a bounded slice.
// Resident memory of this process (server, clients and the reference), KiB.
int64_t ResidentKib() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  int64_t kib = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "VmRSS: %ld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib;
}

TEST_F(DecodeLoopTest, SixtyFourStreamsAndUnaryTrafficEqualAReplay) {
  const char* soak = std::getenv("TQKV_SOAK_SECONDS");
  const double seconds = soak != nullptr ? std::atof(soak) : 0.0;
  constexpr int kStreams = 64;
  constexpr int kStepsPerSequence = 12;  // then the sequence is dropped and a new one starts
  const absl::Time deadline = absl::Now() + absl::Seconds(seconds);
  std::unique_ptr<KvCache> reference = Reference(1);
  ASSERT_NE(reference, nullptr);
  std::atomic<int> failures{0};
  std::atomic<int64_t> replayed{0}, max_call_us{0};
  std::atomic<bool> stop_unary{false};
  absl::Mutex error_mu;
  std::string first_error;
  const auto fail = [&](const std::string& what) {
    ++failures;
    absl::MutexLock lock(&error_mu);
    if (first_error.empty()) first_error = what;
  };
  const auto timed = [&](absl::Time start) {
    const int64_t us = absl::ToInt64Microseconds(absl::Now() - start);
    int64_t seen = max_call_us.load();
    while (us > seen && !max_call_us.compare_exchange_weak(seen, us)) {
    }
  };
  const int64_t rss_start = ResidentKib();
  std::vector<std::thread> threads;
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      std::unique_ptr<DecodeStream> stream = client_->OpenDecodeStream(absl::StrCat("soak-", s));
      uint64_t seed = 1000000 * s;
      for (int n = 0; n == 0 || absl::Now() < deadline; ++n) {
        // One sequence: its messages and answers, replayed on the library
        // (thread-safe) once it is dropped, then forgotten.
        const std::string id = absl::StrCat("soak-", s, "/", n);
        std::vector<Step> sent;
        std::vector<int> layers;
        std::vector<std::vector<float>> got;
        int64_t pos = 0;
        for (int step = 0; step < kStepsPerSequence; ++step) {
          const int64_t tokens = step == 0 ? 5 : 1;
          for (int layer = 0; layer < kLayers; ++layer) {
            std::vector<Step> items = {MakeStep(id, pos, tokens, seed++)};
            const absl::Time start = absl::Now();
            absl::StatusOr<AppendAttendResult> r = stream->Step(StepArgs("csw", layer, items, false));
            timed(start);
            if (!r.ok() || !r->items[0].status.ok()) {
              fail((r.ok() ? r->items[0].status : r.status()).ToString());
              return;
            }
            got.push_back(std::move(r->items[0].attention.output));
            sent.push_back(std::move(items[0]));
            layers.push_back(layer);
          }
          pos += tokens;
        }
        if (absl::Status d = client_->DropSequence("csw", id); !d.ok()) fail(d.ToString());
        for (size_t m = 0; m < sent.size(); ++m) {
          std::vector<float> output, lse;
          ReferenceStep(*reference, layers[m], sent[m], &output, &lse);
          if (output != got[m]) fail(absl::StrCat(id, " message ", m, " differs from the replay"));
          ++replayed;
        }
        if (!reference->Drop(id).ok()) fail(absl::StrCat("reference drop ", id));
      }
      if (absl::Status c = stream->Close(); !c.ok()) fail(c.ToString());
    });
  }
  std::thread unary([&] {
    std::vector<float> keys = RandomFloats(kLayers * 2 * kKvHeads * kHeadDim, 5);
    for (int n = 0; !stop_unary.load(); ++n) {
      const std::string id = absl::StrCat("unary-", n);
      AppendArgs a;
      a.cache = "csw";
      a.sequence_id = id;
      a.shape = {kLayers, 2, kKvHeads, kHeadDim};
      a.keys = keys;
      a.values = keys;
      const absl::Time start = absl::Now();
      for (const absl::Status& st :
           {client_->Append(a).status(), client_->GetServerInfo().status(), client_->DropSequence("csw", id)}) {
        if (!st.ok()) fail(st.ToString());
      }
      timed(start);
    }
  });
  for (std::thread& t : threads) t.join();
  stop_unary = true;
  unary.join();
  EXPECT_EQ(failures.load(), 0) << first_error;
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->caches(1).sequences(), 0);  // everything dropped: no pages leaked
  EXPECT_EQ(info->caches(1).pages_used(), 0);
  std::printf(
      "%lld stream messages from %d streams equal their replay; slowest call %.1f ms; "
      "resident %lld -> %lld MiB\n",
      static_cast<long long>(replayed.load()), kStreams, max_call_us.load() / 1e3,
      static_cast<long long>(rss_start / 1024), static_cast<long long>(ResidentKib() / 1024));
}

TEST(CallExecutor, RunsEveryAcceptedCallAndRefusesPastItsBounds) {
  service::ExecutorOptions options;
  options.threads = 2;
  options.max_pending = 3;
  options.max_pending_bytes = 100;
  service::CallExecutor executor(options);
  absl::Notification release;
  std::atomic<int> ran{0};
  // Two calls block both threads; a third queues; a fourth is refused.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(executor
                    .Submit(10,
                            [&] {
                              release.WaitForNotification();
                              ++ran;
                            })
                    .ok());
  }
  const absl::Status refused = executor.Submit(10, [&] { ++ran; });
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("3 calls pending"));
  EXPECT_EQ(executor.GetStats().rejected, 1u);
  release.Notify();
  while (executor.GetStats().completed < 3) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(ran.load(), 3);
  // Bytes: one call over the byte bound runs alone, but not beside another.
  absl::Notification hold;
  ASSERT_TRUE(executor.Submit(500, [&] { hold.WaitForNotification(); }).ok());
  const absl::Status too_big = executor.Submit(1, [] {});
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_big.message(), HasSubstr("max_pending_bytes"));
  hold.Notify();
}

TEST(CallExecutor, ABlockedCallDoesNotStallTheOthers) {
  service::ExecutorOptions options;
  options.threads = 2;
  service::CallExecutor executor(options);
  absl::Notification release, other_ran;
  ASSERT_TRUE(executor.Submit(0, [&] { release.WaitForNotification(); }).ok());
  ASSERT_TRUE(executor.Submit(0, [&] { other_ran.Notify(); }).ok());
  EXPECT_TRUE(other_ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  release.Notify();
}

}  // namespace
}  // namespace tqkv
