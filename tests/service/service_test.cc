// Integration tests: the real server (service::Server) on an ephemeral
// loopback port, spoken to by the real tqkv::Client (and, where a test must
// send bytes the client would refuse to build, the raw generated stub).
#include <string>
#include <thread>
#include <vector>

#include "tests/service/service_fixture.h"

namespace tqkv {
namespace service_test {
namespace {

using ::testing::HasSubstr;

TEST_F(ServiceTest, GetServerInfoDescribesBackendCachesAndPresets) {
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_FALSE(info->device().empty());
  ASSERT_EQ(info->caches_size(), 2);
  const v1::CacheInfo& c = info->caches(0);
  EXPECT_EQ(c.config().name(), "default");
  EXPECT_EQ(c.config().num_layers(), kLayers);
  EXPECT_EQ(c.config().preset(), "turboquant_k3v4_nc");
  EXPECT_EQ(c.config().boundary_preset(), "fp16");
  EXPECT_EQ(c.page_bytes(), static_cast<int64_t>(page_bytes_));
  EXPECT_EQ(c.pages_total(), static_cast<int>((4u << 20) / page_bytes_));
  EXPECT_EQ(info->caches(1).pages_total(), 3);
  // At the cache's own head dim (64): 3-bit keys 24 + 2 bytes, 4-bit uniform
  // values 32 + 4; a token: 2 fp16 boundary layers and 2 compressed ones.
  EXPECT_EQ(c.bytes_per_token_head(), 62);
  EXPECT_EQ(c.bytes_per_token(), kKvHeads * (2 * 4 * kHeadDim + 2 * 62));
  bool found = false;
  for (const v1::PresetInfo& p : info->presets()) {
    if (p.name() == "turboquant_k3v4_nc") {
      found = true;
      EXPECT_LE(p.bytes_per_token_head(), 118);
    }
  }
  EXPECT_TRUE(found);
}

// The proto's rules for zero sizes and open layer ranges (its "Zero sizes"
// convention and AppendRequest.layer_end).
TEST_F(ServiceTest, ZeroSizesAndOpenLayerRangesFollowTheProto) {
  // layer_end 0 with layer_begin 1: layers [1, kLayers).
  const Kv kv = MakeKv(2, 5, kLayers - 1);
  v1::AppendRequest append;
  append.set_sequence_id("open");
  append.set_layer_begin(1);
  for (auto [t, data] : {std::pair{append.mutable_keys(), &kv.keys}, {append.mutable_values(), &kv.values}}) {
    t->set_dtype(v1::DTYPE_F32);
    for (int64_t d : {kLayers - 1, 2, kKvHeads, kHeadDim}) t->add_shape(d);
    t->set_data(reinterpret_cast<const char*>(data->data()), data->size() * 4);
  }
  {
    grpc::ClientContext context;
    v1::AppendResponse response;
    ASSERT_TRUE(stub_->Append(&context, append, &response).ok());
  }
  std::vector<int64_t> want(kLayers, 2);
  want[0] = 0;
  EXPECT_EQ(MustGet("open").layer_tokens, want);

  // Empty lists: OK with no results.
  {
    grpc::ClientContext context;
    v1::AttendResponse response;
    const grpc::Status status = stub_->Attend(&context, v1::AttendRequest(), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.results_size(), 0);
  }
  {
    grpc::ClientContext context;
    v1::AppendAttendResponse response;
    v1::AppendAttendRequest request;
    request.set_layer(1);
    const grpc::Status status = stub_->AppendAttend(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.results_size(), 0);
  }
  // A tensor of the call's own data may not be empty: 0 query tokens.
  {
    grpc::ClientContext context;
    v1::AttendResponse response;
    v1::AttendRequest request;
    v1::AttendItem* item = request.add_items();
    item->set_sequence_id("open");
    item->set_layer(1);
    item->mutable_queries()->set_dtype(v1::DTYPE_F32);
    for (int64_t d : {0, kQueryHeads, kHeadDim}) item->mutable_queries()->add_shape(d);
    const grpc::Status status = stub_->Attend(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("query_tokens is 0, want at least 1"));
  }
}

TEST_F(ServiceTest, AppendCreatesTheSequenceAndReportsItsBytes) {
  const Kv kv = MakeKv(5, 1);
  absl::StatusOr<AppendResult> r = client_->Append(MakeAppend("s", 0, kv));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sequence.sequence_id, "s");
  EXPECT_EQ(r->sequence.cache, "default");
  EXPECT_EQ(r->sequence.layer_tokens, std::vector<int64_t>(kLayers, 5));
  EXPECT_EQ(r->sequence.pages, 2);
  EXPECT_EQ(r->stored_bytes_bf16, 5 * kLayers * 2 * 2 * kKvHeads * kHeadDim);
  EXPECT_GT(r->stored_bytes, 0);
  EXPECT_LT(r->stored_bytes, r->stored_bytes_bf16);
  const v1::CacheInfo stats = CacheStats("default");
  EXPECT_EQ(stats.sequences(), 1);
  EXPECT_EQ(stats.tokens(), 5);
  EXPECT_EQ(stats.stored_bytes(), r->stored_bytes);

  // Layer-by-layer append, then the next token.
  const Kv layer0 = MakeKv(1, 2, /*layers=*/1);
  r = client_->Append(MakeAppend("s", 5, layer0, /*layer_begin=*/0));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sequence.layer_tokens, (std::vector<int64_t>{6, 5, 5, 5}));
}

TEST_F(ServiceTest, AppendAcceptsF16AndBf16OnTheWire) {
  for (v1::DType dtype : {v1::DTYPE_F16, v1::DTYPE_BF16}) {
    const std::string id = absl::StrCat("w", static_cast<int>(dtype));
    const Kv kv = MakeKv(3, 3);
    AppendArgs a = MakeAppend(id, 0, kv);
    a.wire_dtype = dtype;
    absl::StatusOr<AppendResult> r = client_->Append(a);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->sequence.layer_tokens, std::vector<int64_t>(kLayers, 3));
  }
}

TEST_F(ServiceTest, AttendEqualsTheLibraryExactly) {
  std::unique_ptr<KvCache> reference = Reference();
  ASSERT_NE(reference, nullptr);
  // Two sequences, appended in two calls each.
  const Kv a1 = MakeKv(7, 10), a2 = MakeKv(3, 11), b1 = MakeKv(9, 12);
  ASSERT_TRUE(client_->Append(MakeAppend("a", 0, a1)).ok());
  ASSERT_TRUE(client_->Append(MakeAppend("a", 7, a2)).ok());
  ASSERT_TRUE(client_->Append(MakeAppend("b", 0, b1)).ok());
  ReferenceAppend(*reference, "a", 0, a1);
  ReferenceAppend(*reference, "a", 7, a2);
  ReferenceAppend(*reference, "b", 0, b1);

  // Item 0: one query token in layer 0 (fp16 boundary); item 1: three query
  // tokens (causal) in layer 2 (compressed).
  const std::vector<float> q0 = RandomFloats(1 * kQueryHeads * kHeadDim, 20);
  const std::vector<float> q1 = RandomFloats(3 * kQueryHeads * kHeadDim, 21);
  std::vector<float> default_scale_output;
  for (const float scale : {0.0f, 0.05f}) {
    AttendArgs args;
    args.items = {{"a", 0, {1, kQueryHeads, kHeadDim}, q0}, {"b", 2, {3, kQueryHeads, kHeadDim}, q1}};
    args.return_lse = true;
    args.scale = scale;
    absl::StatusOr<std::vector<AttendOutput>> out = client_->Attend(args);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), 2u);

    std::vector<float> want0(q0.size()), want1(q1.size()), lse0(kQueryHeads), lse1(3 * kQueryHeads);
    AttendRequestItem items[2];
    items[0] = {"a", 0, 1, q0.data(), want0.data(), lse0.data()};
    items[1] = {"b", 2, 3, q1.data(), want1.data(), lse1.data()};
    ASSERT_TRUE(reference->Attend(items, scale).ok());
    EXPECT_EQ((*out)[0].output, want0);
    EXPECT_EQ((*out)[1].output, want1);
    EXPECT_EQ((*out)[0].lse, lse0);
    EXPECT_EQ((*out)[1].lse, lse1);
    EXPECT_EQ((*out)[1].shape, (std::array<int64_t, 3>{3, kQueryHeads, kHeadDim}));
    // The scale reaches the kernel: 0.05 is not 1/sqrt(64).
    if (scale == 0.0f) {
      default_scale_output = want1;
    } else {
      EXPECT_NE(want1, default_scale_output);
    }

    // Half-precision outputs are the f32 outputs rounded.
    args.output_dtype = v1::DTYPE_BF16;
    args.return_lse = false;
    out = client_->Attend(args);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < want1.size(); ++i) {
      ASSERT_EQ((*out)[1].output[i], Bf16ToFloat(FloatToBf16(want1[i])));
    }
    EXPECT_TRUE((*out)[1].lse.empty());
  }

  // Placed queries: 5 new tokens after sequence b's 9 (a prefill over it;
  // a negative position is refused: tests/python/test_client.py).
  const std::vector<float> q5 = RandomFloats(5 * kQueryHeads * kHeadDim, 22);
  AttendArgs placed;
  placed.items = {{"b", 2, {5, kQueryHeads, kHeadDim}, q5, 9}};
  placed.return_lse = true;
  absl::StatusOr<std::vector<AttendOutput>> out = client_->Attend(placed);
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<float> want(q5.size()), lse(5 * kQueryHeads);
  AttendRequestItem item{"b", 2, 5, q5.data(), want.data(), lse.data()};
  item.first_query_position = 9;
  ASSERT_TRUE(reference->Attend({&item, 1}).ok());
  EXPECT_EQ((*out)[0].output, want);
  EXPECT_EQ((*out)[0].lse, lse);
  placed.items[0].first_query_position = 3;  // inside: causal up to each position
  out = client_->Attend(placed);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_NE((*out)[0].output, want);
}

TEST_F(ServiceTest, ScoreQueryEqualsTheLibraryAndRanksTopK) {
  std::unique_ptr<KvCache> reference = Reference();
  ASSERT_NE(reference, nullptr);
  const Kv kv = MakeKv(11, 30);
  ASSERT_TRUE(client_->Append(MakeAppend("s", 0, kv)).ok());
  ReferenceAppend(*reference, "s", 0, kv);
  const std::vector<float> q = RandomFloats(kQueryHeads * kHeadDim, 31);

  ScoreArgs args;
  args.sequence_id = "s";
  args.layer = 1;
  args.shape = {kQueryHeads, kHeadDim};
  args.queries = q;
  absl::StatusOr<ScoreResult> all = client_->Score(args);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->query_heads, kQueryHeads);
  EXPECT_EQ(all->columns, 11);
  std::vector<float> want(kQueryHeads * 11);
  ASSERT_TRUE(reference->Score("s", 1, 0, -1, q.data(), want.data()).ok());
  EXPECT_EQ(all->logits, want);

  // A range, and the top 3 of it.
  args.token_begin = 2;
  args.token_end = 9;
  args.top_k = 3;
  absl::StatusOr<ScoreResult> top = client_->Score(args);
  ASSERT_TRUE(top.ok()) << top.status();
  ASSERT_EQ(top->columns, 3);
  ASSERT_EQ(top->positions.size(), static_cast<size_t>(kQueryHeads * 3));
  for (int h = 0; h < kQueryHeads; ++h) {
    std::vector<float> row(want.begin() + h * 11 + 2, want.begin() + h * 11 + 9);
    std::vector<float> sorted = row;
    std::sort(sorted.rbegin(), sorted.rend());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(top->logits[h * 3 + i], sorted[i]);
      EXPECT_EQ(want[h * 11 + top->positions[h * 3 + i]], sorted[i]);
    }
  }
  // top_k larger than the range returns the whole range, sorted.
  args.top_k = 100;
  top = client_->Score(args);
  ASSERT_TRUE(top.ok());
  EXPECT_EQ(top->columns, 7);
}

// A range beyond the layer is refused before the logits are sized from it:
// a 16 KB request cannot make the server allocate gigabytes.
TEST_F(ServiceTest, ScoreQueryChecksItsRangeBeforeSizingAnything) {
  const Kv kv = MakeKv(20, 30);
  ASSERT_TRUE(client_->Append(MakeAppend("s", 0, kv)).ok());
  ScoreArgs args;
  args.sequence_id = "s";
  args.layer = 1;
  args.shape = {kQueryHeads, kHeadDim};
  args.queries = RandomFloats(kQueryHeads * kHeadDim, 31);
  for (const int64_t end : {int64_t{21}, int64_t{16000000}, int64_t{1} << 40}) {
    args.token_end = end;
    const absl::Time start = absl::Now();
    absl::StatusOr<ScoreResult> r = client_->Score(args);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange) << end << ": " << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("which holds 20 tokens"));
    EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << end;
  }
  args.token_begin = 21;
  args.token_end = 0;  // the layer's length: begins beyond it
  EXPECT_EQ(client_->Score(args).status().code(), absl::StatusCode::kOutOfRange);

  // An empty range inside the layer: OK, no logits, with or without top_k.
  for (const int top_k : {0, 3}) {
    args.token_begin = 5;
    args.token_end = 5;
    args.top_k = top_k;
    absl::StatusOr<ScoreResult> empty = client_->Score(args);
    ASSERT_TRUE(empty.ok()) << empty.status();
    EXPECT_EQ(empty->query_heads, kQueryHeads);
    EXPECT_EQ(empty->columns, 0);
    EXPECT_TRUE(empty->logits.empty());
    EXPECT_TRUE(empty->positions.empty());
  }
}

TEST_F(ServiceTest, SequenceLifecycleCreateForkGetDrop) {
  absl::StatusOr<SequenceState> created = client_->CreateSequence("", "p");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->layer_tokens, std::vector<int64_t>(kLayers, 0));
  EXPECT_EQ(client_->CreateSequence("", "p").status().code(), absl::StatusCode::kAlreadyExists);
  const Kv p = MakeKv(6, 40), c = MakeKv(1, 41);
  ASSERT_TRUE(client_->Append(MakeAppend("p", 0, p)).ok());

  absl::StatusOr<SequenceState> child = client_->ForkSequence("default", "p", "c");
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->layer_tokens, std::vector<int64_t>(kLayers, 6));
  EXPECT_EQ(child->pages, 2);
  EXPECT_EQ(client_->ForkSequence("", "p", "c").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client_->ForkSequence("", "nope", "d").status().code(), absl::StatusCode::kNotFound);
  // The child grows on its own.
  ASSERT_TRUE(client_->Append(MakeAppend("c", 6, c)).ok());
  EXPECT_EQ(MustGet("c").layer_tokens, std::vector<int64_t>(kLayers, 7));
  EXPECT_EQ(MustGet("p").layer_tokens, std::vector<int64_t>(kLayers, 6));

  ASSERT_TRUE(client_->DropSequence("", "p").ok());
  EXPECT_EQ(client_->GetSequence("", "p").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DropSequence("", "p").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MustGet("c").layer_tokens, std::vector<int64_t>(kLayers, 7));
}

TEST_F(ServiceTest, AppendStreamStoresALongPrefillInChunks) {
  std::unique_ptr<KvCache> reference = Reference();
  ASSERT_NE(reference, nullptr);
  std::vector<Kv> chunks;
  std::vector<AppendArgs> args;
  for (int i = 0; i < 12; ++i) chunks.push_back(MakeKv(8, 100 + i));
  for (int i = 0; i < 12; ++i) {
    args.push_back(MakeAppend("long", 8 * i, chunks[i]));
    ReferenceAppend(*reference, "long", 8 * i, chunks[i]);
  }
  absl::StatusOr<AppendResult> r = client_->AppendStream(args);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sequence.layer_tokens, std::vector<int64_t>(kLayers, 96));
  EXPECT_EQ(r->sequence.pages, 24);
  EXPECT_EQ(r->stored_bytes_bf16, 96 * kLayers * 4 * kKvHeads * kHeadDim);

  const std::vector<float> q = RandomFloats(kQueryHeads * kHeadDim, 5);
  AttendArgs attend;
  attend.items = {{"long", 3, {1, kQueryHeads, kHeadDim}, q}};
  absl::StatusOr<std::vector<AttendOutput>> out = client_->Attend(attend);
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<float> want(q.size());
  AttendRequestItem item{"long", 3, 1, q.data(), want.data(), nullptr};
  ASSERT_TRUE(reference->Attend({&item, 1}).ok());
  EXPECT_EQ((*out)[0].output, want);
}

TEST_F(ServiceTest, AppendStreamStopsAtTheFirstBadChunkAndKeepsTheOnesBefore) {
  const Kv kv = MakeKv(4, 50), other = MakeKv(4, 51);
  // Chunk 2 starts where chunk 1 did with other tokens: a wrong position.
  // (The same tokens again would be the same append, answered already_stored.)
  std::vector<AppendArgs> args = {MakeAppend("t", 0, kv), MakeAppend("t", 4, kv), MakeAppend("t", 4, other),
                                  MakeAppend("t", 8, kv)};
  absl::StatusOr<AppendResult> r = client_->AppendStream(args);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("chunk 2"));
  EXPECT_EQ(MustGet("t").layer_tokens, std::vector<int64_t>(kLayers, 8));

  // A stream with no chunk, and one that switches sequence.
  EXPECT_EQ(client_->AppendStream({}).status().code(), absl::StatusCode::kInvalidArgument);
  args = {MakeAppend("t", 8, kv), MakeAppend("u", 0, kv)};
  r = client_->AppendStream(args);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MustGet("t").layer_tokens, std::vector<int64_t>(kLayers, 12));
  EXPECT_EQ(client_->GetSequence("", "u").status().code(), absl::StatusCode::kNotFound);
}

// Every malformed request: the canonical code, a message saying what was
// expected, and no change to the sequence or the cache.
TEST_F(ServiceTest, MalformedRequestsGetCanonicalCodesAndChangeNothing) {
  const Kv first = MakeKv(5, 60);
  ASSERT_TRUE(client_->Append(MakeAppend("s", 0, first)).ok());
  const SequenceState before = MustGet("s");
  const v1::CacheInfo stats_before = CacheStats("default");

  const auto expect_unchanged = [&](const char* what) {
    const SequenceState after = MustGet("s");
    EXPECT_EQ(after.layer_tokens, before.layer_tokens) << what;
    EXPECT_EQ(after.pages, before.pages) << what;
    const v1::CacheInfo stats = CacheStats("default");
    EXPECT_EQ(stats.pages_used(), stats_before.pages_used()) << what;
    EXPECT_EQ(stats.sequences(), stats_before.sequences()) << what;
    EXPECT_EQ(stats.stored_bytes(), stats_before.stored_bytes()) << what;
  };
  const auto expect_append_error = [&](const char* what, v1::AppendRequest request, grpc::StatusCode code,
                                       const char* substring) {
    grpc::ClientContext context;
    v1::AppendResponse response;
    const grpc::Status status = stub_->Append(&context, request, &response);
    EXPECT_EQ(status.error_code(), code) << what << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(substring)) << what;
    expect_unchanged(what);
  };

  // A valid request for the next token, to break one field at a time.
  const Kv next = MakeKv(1, 61);
  v1::AppendRequest good;
  good.set_sequence_id("s");
  good.set_start_position(5);
  for (v1::Tensor* t : {good.mutable_keys(), good.mutable_values()}) {
    t->set_dtype(v1::DTYPE_F32);
    for (int64_t d : {kLayers, 1, kKvHeads, kHeadDim}) t->add_shape(d);
    t->set_data(reinterpret_cast<const char*>(next.keys.data()), next.keys.size() * 4);
  }
  v1::AppendRequest bad = good;
  bad.mutable_keys()->clear_shape();
  for (int64_t d : {kLayers, kKvHeads, kHeadDim}) bad.mutable_keys()->add_shape(d);
  expect_append_error("rank", bad, grpc::StatusCode::INVALID_ARGUMENT,
                      "keys has 3 dims, want [layers, tokens, kv_heads, head_dim]");
  bad = good;
  bad.mutable_values()->set_shape(2, 1);
  expect_append_error("shape", bad, grpc::StatusCode::INVALID_ARGUMENT, "axis kv_heads is 1, want 2");
  bad = good;
  bad.mutable_values()->set_shape(1, 2);
  expect_append_error("tokens", bad, grpc::StatusCode::INVALID_ARGUMENT, "axis tokens is 2, want 1");
  bad = good;
  bad.mutable_keys()->set_dtype(v1::DTYPE_UNSPECIFIED);
  expect_append_error("dtype", bad, grpc::StatusCode::INVALID_ARGUMENT, "want DTYPE_F32");
  bad = good;
  bad.mutable_keys()->set_dtype(static_cast<v1::DType>(9));
  expect_append_error("dtype 9", bad, grpc::StatusCode::INVALID_ARGUMENT, "want DTYPE_F32");
  bad = good;
  bad.mutable_keys()->mutable_data()->resize(100);
  expect_append_error("bytes", bad, grpc::StatusCode::INVALID_ARGUMENT, "keys has 100 bytes, want 2048");
  bad = good;
  const float nan = std::nanf("");
  std::memcpy(bad.mutable_values()->mutable_data()->data() + 4 * 77, &nan, 4);
  expect_append_error("nan", bad, grpc::StatusCode::INVALID_ARGUMENT, "values[0, 0, 1, 13] is nan");
  bad = good;
  bad.set_cache("nope");
  expect_append_error("cache", bad, grpc::StatusCode::NOT_FOUND, "cache 'nope' not found");
  bad = good;
  bad.set_layer_end(kLayers + 1);
  expect_append_error("layers", bad, grpc::StatusCode::INVALID_ARGUMENT, "want 0 <= layer_begin");
  bad = good;
  bad.set_start_position(4);
  expect_append_error("position", bad, grpc::StatusCode::FAILED_PRECONDITION, "5");
  bad = good;
  bad.set_start_position(-1);
  expect_append_error("negative position", bad, grpc::StatusCode::INVALID_ARGUMENT, ">= 0");
  bad = good;
  bad.set_sequence_id("");
  expect_append_error("empty id", bad, grpc::StatusCode::INVALID_ARGUMENT, "1..256 bytes");
  bad = good;
  bad.set_sequence_id("other");
  bad.set_start_position(0);
  bad.set_do_not_create(true);
  expect_append_error("do_not_create", bad, grpc::StatusCode::NOT_FOUND, "other");
  bad = good;
  for (v1::Tensor* t : {bad.mutable_keys(), bad.mutable_values()}) {
    t->set_shape(1, 0);
    t->clear_data();
  }
  expect_append_error("0 tokens", bad, grpc::StatusCode::INVALID_ARGUMENT, "axis tokens is 0, want at least 1");
  EXPECT_EQ(client_->GetSequence("", "other").status().code(), absl::StatusCode::kNotFound);

  // Oversized: more than the server's 1 MiB limit.
  const Kv big = MakeKv(300, 62);
  EXPECT_EQ(client_->Append(MakeAppend("s", 5, big)).status().code(), absl::StatusCode::kResourceExhausted);
  expect_unchanged("oversized");

  // Reads.
  const std::vector<float> q = RandomFloats(2 * kQueryHeads * kHeadDim, 63);
  const auto attend = [&](AttendItemArgs item, v1::DType dtype = v1::DTYPE_F32) {
    AttendArgs args;
    args.items = {item};
    args.output_dtype = dtype;
    return client_->Attend(args).status();
  };
  const std::array<int64_t, 3> one = {1, kQueryHeads, kHeadDim};
  constexpr size_t kQ = kQueryHeads * kHeadDim;
  EXPECT_EQ(attend({"s", 0, one, {q.data(), kQ}}).code(), absl::StatusCode::kOk);
  EXPECT_EQ(attend({"x", 0, one, {q.data(), kQ}}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(attend({"s", kLayers, one, {q.data(), kQ}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(attend({"s", 0, {1, kKvHeads, 2 * kHeadDim}, {q.data(), kQ}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(attend({"s", 0, one, {q.data(), kQ}}, static_cast<v1::DType>(7)).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> q6 = RandomFloats(6 * kQueryHeads * kHeadDim, 64);
  absl::Status too_many = attend({"s", 0, {6, kQueryHeads, kHeadDim}, q6});
  EXPECT_EQ(too_many.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_many.message(), HasSubstr("holds 5 tokens"));
  q6[17] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(attend({"s", 0, {2, kQueryHeads, kHeadDim}, {q6.data(), 2 * kQ}}).code(),
            absl::StatusCode::kInvalidArgument);
  AttendArgs bad_scale;
  bad_scale.items = {{"s", 0, one, {q.data(), kQ}}};
  bad_scale.scale = -1;
  EXPECT_EQ(client_->Attend(bad_scale).status().code(), absl::StatusCode::kInvalidArgument);

  ScoreArgs score;
  score.sequence_id = "s";
  score.shape = {kQueryHeads, kHeadDim};
  score.queries = {q.data(), kQueryHeads * kHeadDim};
  score.layer = -1;
  EXPECT_EQ(client_->Score(score).status().code(), absl::StatusCode::kInvalidArgument);
  score.layer = 0;
  score.token_end = 6;
  EXPECT_EQ(client_->Score(score).status().code(), absl::StatusCode::kOutOfRange);
  score.token_begin = 7;
  score.token_end = 0;
  EXPECT_EQ(client_->Score(score).status().code(), absl::StatusCode::kOutOfRange);
  score.token_begin = 3;
  score.token_end = 2;
  EXPECT_EQ(client_->Score(score).status().code(), absl::StatusCode::kInvalidArgument);
  score.token_begin = 0;
  score.token_end = 0;
  score.top_k = -1;
  EXPECT_EQ(client_->Score(score).status().code(), absl::StatusCode::kInvalidArgument);
  score.top_k = 0;
  score.sequence_id = "x";
  EXPECT_EQ(client_->Score(score).status().code(), absl::StatusCode::kNotFound);
  score.sequence_id = "s";
  score.shape = {kKvHeads, kHeadDim};
  score.queries = {q.data(), kKvHeads * kHeadDim};
  EXPECT_EQ(client_->Score(score).status().code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(client_->GetSequence("nope", "s").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DropSequence("", "x").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ForkSequence("", "s", "").status().code(), absl::StatusCode::kInvalidArgument);
  expect_unchanged("reads");
}

// A response above the server's message limit (1 MiB here) is refused from
// the sizes the request fixes, before any work: f16 queries asking for f32
// outputs double in size on the way back.
TEST_F(ServiceTest, AnOversizedResponseIsRefusedBeforeTheWork) {
  const Kv kv = MakeKv(4, 80);
  ASSERT_TRUE(client_->Append(MakeAppend("big", 0, kv)).ok());
  const int64_t query_tokens = 1100;  // 1100 x 4 x 64 x 2 = 563 KB in, 1.1 MB out
  v1::AttendRequest request;
  request.set_output_dtype(v1::DTYPE_F32);
  v1::AttendItem* item = request.add_items();
  item->set_sequence_id("big");
  item->mutable_queries()->set_dtype(v1::DTYPE_F16);
  for (int64_t d : {query_tokens, int64_t{kQueryHeads}, int64_t{kHeadDim}}) item->mutable_queries()->add_shape(d);
  item->mutable_queries()->mutable_data()->assign(query_tokens * kQueryHeads * kHeadDim * 2, '\0');
  grpc::ClientContext context;
  v1::AttendResponse response;
  const grpc::Status status = stub_->Attend(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("the response would be about"));
  EXPECT_THAT(status.error_message(), HasSubstr("--max_message_bytes"));
  // The same in f16 fits.
  request.set_output_dtype(v1::DTYPE_F16);
  grpc::ClientContext again;
  const grpc::Status fits = stub_->Attend(&again, request, &response);
  EXPECT_NE(fits.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << fits.error_message();
}

// Appends carry an idempotency key (the client derives it from their
// content): a resend of one that landed is answered already_stored, even
// after another writer appended; another append under a used key is
// INVALID_ARGUMENT; without a key a resend is FAILED_PRECONDITION.
TEST_F(ServiceTest, ARetriedAppendLearnsWhetherItsOwnAppendLanded) {
  const Kv first = MakeKv(3, 90), second = MakeKv(2, 91), third = MakeKv(2, 92);
  absl::StatusOr<AppendResult> r = client_->Append(MakeAppend("idem", 0, first));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->already_stored);
  const int64_t bytes = CacheStats("default").stored_bytes();
  ASSERT_TRUE(client_->Append(MakeAppend("idem", 3, second)).ok());  // someone else's append
  r = client_->Append(MakeAppend("idem", 0, first));                 // the first one, resent
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->already_stored);
  EXPECT_EQ(r->stored_bytes, 0);
  EXPECT_EQ(r->sequence.layer_tokens, std::vector<int64_t>(kLayers, 5));
  EXPECT_GT(CacheStats("default").stored_bytes(), bytes);
  // An append at the landed one's position that it never sent: not landed.
  r = client_->Append(MakeAppend("idem", 0, third));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  // The same key for another append.
  AppendArgs reused = MakeAppend("idem", 5, third);
  reused.request_id = "mine";
  ASSERT_TRUE(client_->Append(reused).ok());
  AppendArgs clash = MakeAppend("idem", 7, third);
  clash.request_id = "mine";
  r = client_->Append(clash);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("request_id 'mine' already named an append"));
  // Raw, without a key: a resend is refused by position.
  v1::AppendRequest raw;
  raw.set_sequence_id("idem");
  raw.set_start_position(5);
  for (auto [t, data] : {std::pair{raw.mutable_keys(), &third.keys}, {raw.mutable_values(), &third.values}}) {
    t->set_dtype(v1::DTYPE_F32);
    for (int64_t d : {kLayers, 2, kKvHeads, kHeadDim}) t->add_shape(d);
    t->set_data(reinterpret_cast<const char*>(data->data()), data->size() * 4);
  }
  grpc::ClientContext context;
  v1::AppendResponse response;
  EXPECT_EQ(stub_->Append(&context, raw, &response).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(MustGet("idem").layer_tokens, std::vector<int64_t>(kLayers, 7));
}

TEST_F(ServiceTest, AFullPoolIsResourceExhaustedAndChangesNothing) {
  // "tiny" holds three 4-token pages.
  const Kv ten = MakeKv(10, 70), two = MakeKv(2, 72);
  AppendArgs a = MakeAppend("f", 0, ten);
  a.cache = "tiny";
  ASSERT_TRUE(client_->Append(a).ok());
  const v1::CacheInfo before = CacheStats("tiny");
  EXPECT_EQ(before.pages_used(), 3);
  const Kv more = MakeKv(3, 71);
  a = MakeAppend("f", 10, more);
  a.cache = "tiny";
  absl::StatusOr<AppendResult> r = client_->Append(a);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  a.sequence_id = "g";
  a.start_position = 0;
  EXPECT_EQ(client_->Append(a).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(client_->GetSequence("tiny", "g").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MustGet("f", "tiny").layer_tokens, std::vector<int64_t>(kLayers, 10));
  const v1::CacheInfo after = CacheStats("tiny");
  EXPECT_EQ(after.pages_used(), 3);
  EXPECT_EQ(after.stored_bytes(), before.stored_bytes());
  // Two tokens still fit in the last page.
  a = MakeAppend("f", 10, two);
  a.cache = "tiny";
  EXPECT_TRUE(client_->Append(a).ok());
}

TEST_F(ServiceTest, HealthCheckReportsServing) {
  const grpc::internal::RpcMethod check("/grpc.health.v1.Health/Check", grpc::internal::RpcMethod::NORMAL_RPC);
  for (const char* service : {"", "tqkv.v1.KvCache"}) {
    grpc::ClientContext context;
    testing::HealthCheckRequest request;
    request.set_service(service);
    testing::HealthCheckResponse response;
    const grpc::Status status =
        grpc::internal::BlockingUnaryCall<testing::HealthCheckRequest, testing::HealthCheckResponse>(
            channel_.get(), check, &context, request, &response);
    ASSERT_TRUE(status.ok()) << service << ": " << status.error_message();
    EXPECT_EQ(response.status(), testing::HealthCheckResponse::SERVING) << service;
  }
}

TEST_F(ServiceTest, ReflectionListsTheService) {
  const grpc::internal::RpcMethod info("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                       grpc::internal::RpcMethod::BIDI_STREAMING);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<testing::ServerReflectionRequest, testing::ServerReflectionResponse>> stream(
      grpc::internal::ClientReaderWriterFactory<testing::ServerReflectionRequest,
                                                testing::ServerReflectionResponse>::Create(channel_.get(), info,
                                                                                           &context));
  testing::ServerReflectionRequest request;
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  testing::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> names;
  for (const auto& s : response.list_services_response().service()) names.push_back(s.name());
  EXPECT_THAT(names, ::testing::Contains("tqkv.v1.KvCache"));
  EXPECT_THAT(names, ::testing::Contains("grpc.health.v1.Health"));
  while (stream->Read(&response)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServiceTest, GracefulShutdownFinishesACallInFlight) {
  // A stream is open and has delivered one chunk when shutdown starts; it
  // may still send the rest and gets its answer.
  grpc::ClientContext context;
  v1::AppendResponse response;
  auto writer = stub_->AppendStream(&context, &response);
  const Kv kv = MakeKv(4, 80);
  v1::AppendRequest chunk;
  chunk.set_sequence_id("inflight");
  for (v1::Tensor* t : {chunk.mutable_keys(), chunk.mutable_values()}) {
    t->set_dtype(v1::DTYPE_F32);
    for (int64_t d : {kLayers, 4, kKvHeads, kHeadDim}) t->add_shape(d);
    t->set_data(reinterpret_cast<const char*>(kv.keys.data()), kv.keys.size() * 4);
  }
  ASSERT_TRUE(writer->Write(chunk));
  // Wait until the server has stored it, so the call is surely in flight.
  for (int i = 0; i < 200; ++i) {
    v1::GetSequenceRequest get;
    get.set_sequence_id("inflight");
    v1::SequenceInfo info;
    if (server_->service().DoGetSequence(service::Caller::Admin(), get, &info).ok()) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  std::thread shutdown([&] { server_->Shutdown(absl::Now() + absl::Seconds(10)); });
  absl::SleepFor(absl::Milliseconds(100));
  // New calls are refused while the old one finishes.
  EXPECT_EQ(client_->GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
  chunk.set_start_position(4);
  EXPECT_TRUE(writer->Write(chunk));
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  shutdown.join();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.sequence().layer_tokens(0), 8);
}

TEST_F(ServiceTest, ConcurrentClientsReadBackExactlyWhatTheLibraryComputes) {
  constexpr int kClients = 8;
  constexpr int kSteps = 12;
  std::unique_ptr<KvCache> reference = Reference();
  ASSERT_NE(reference, nullptr);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  std::vector<std::vector<std::vector<float>>> outputs(kClients);
  const std::vector<float> q = RandomFloats(kQueryHeads * kHeadDim, 90);
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      const std::string id = absl::StrCat("c", c);
      for (int step = 0; step < kSteps; ++step) {
        const Kv kv = MakeKv(1 + step % 3, 1000 * c + step);
        const int64_t start = step == 0 ? 0 : MustGet(id).layer_tokens[0];
        if (!client_->Append(MakeAppend(id, start, kv)).ok()) ++failures;
        AttendArgs args;
        args.items = {{id, step % kLayers, {1, kQueryHeads, kHeadDim}, q}};
        absl::StatusOr<std::vector<AttendOutput>> out = client_->Attend(args);
        if (!out.ok()) {
          ++failures;
        } else {
          outputs[c].push_back((*out)[0].output);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  // Replay each client's calls on the library, in order.
  for (int c = 0; c < kClients; ++c) {
    const std::string id = absl::StrCat("c", c);
    int64_t start = 0;
    for (int step = 0; step < kSteps; ++step) {
      const Kv kv = MakeKv(1 + step % 3, 1000 * c + step);
      ReferenceAppend(*reference, id, start, kv);
      start += kv.tokens;
      std::vector<float> want(q.size());
      AttendRequestItem item{id, step % kLayers, 1, q.data(), want.data(), nullptr};
      ASSERT_TRUE(reference->Attend({&item, 1}).ok());
      ASSERT_EQ(outputs[c][step], want) << "client " << c << " step " << step;
    }
  }
}

}  // namespace
}  // namespace service_test
}  // namespace tqkv
