// KvCache: forks (copy-on-write pages), attention and scores against
// float64, invalid reads, and pages pinned by a read across a drop.
#include <string>
#include <thread>
#include <vector>

#include "tests/cache/kv_cache_fixture.h"

namespace tqkv {
namespace cache_test {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

TEST_F(KvCacheTest, ForkSharesPagesAndTheChildReadsTheParentsTokens) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(8));
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "p", 0, 6).ok());
  const CacheStats before = cache->Stats();

  EXPECT_EQ(cache->Fork("missing", "c").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->Fork("p", "p").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(cache->Fork("p", "").code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cache->Fork("p", "c").ok());
  const CacheStats after = cache->Stats();
  EXPECT_EQ(after.pages_used, before.pages_used);
  EXPECT_EQ(after.sequences, 2);
  EXPECT_EQ(after.tokens, 2 * before.tokens);
  EXPECT_EQ(after.stored_bytes, 2 * before.stored_bytes);
  EXPECT_EQ(after.stored_bytes_bf16, 2 * before.stored_bytes_bf16);
  absl::StatusOr<SequenceInfo> child = cache->GetSequence("c");
  ASSERT_TRUE(child.ok());
  EXPECT_THAT(child->layer_tokens, ElementsAre(6, 6, 6, 6));
  EXPECT_EQ(child->pages, 2);

  for (int layer = 0; layer < 4; ++layer) {
    const std::vector<float> q = Queries(*cache, 2);
    std::vector<float> lse_p, lse_c;
    EXPECT_EQ(AttendOne(*cache, "p", layer, q, 2, &lse_p), AttendOne(*cache, "c", layer, q, 2, &lse_c));
    EXPECT_EQ(lse_p, lse_c);
  }
}

TEST_F(KvCacheTest, AppendingToAForkCopiesTheSharedPartialPageOnce) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(8));
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "p", 0, 6).ok());  // pages P0 (full), P1 (2 of 4)
  ASSERT_TRUE(cache->Fork("p", "c").ok());
  refs_.emplace("c", Ref(*cache, "p"));
  std::vector<std::vector<float>> queries;
  std::vector<std::vector<float>> parent_outputs;
  for (int layer = 0; layer < 4; ++layer) {
    queries.push_back(Queries(*cache, 1));
    parent_outputs.push_back(AttendOne(*cache, "p", layer, queries.back(), 1));
  }

  ASSERT_TRUE(AppendAll(*cache, "c", 6, 1).ok());  // copies P1
  EXPECT_EQ(cache->Stats().copy_on_writes, 1u);
  EXPECT_EQ(cache->Stats().pages_used, 3);
  ASSERT_TRUE(AppendAll(*cache, "c", 7, 1).ok());  // the copy is c's own now
  ASSERT_TRUE(AppendAll(*cache, "c", 8, 2).ok());  // a fresh page, P0 still shared
  EXPECT_EQ(cache->Stats().copy_on_writes, 1u);
  EXPECT_EQ(cache->Stats().pages_used, 4);

  // The parent reads exactly what it read before.
  for (int layer = 0; layer < 4; ++layer) {
    EXPECT_EQ(AttendOne(*cache, "p", layer, queries[layer], 1), parent_outputs[layer]);
  }
  ExpectAttendMatchesReference(*cache, "p", 1);
  ExpectAttendMatchesReference(*cache, "c", 3);

  // P1 has one holder again: the parent writes it in place.
  ASSERT_TRUE(AppendAll(*cache, "p", 6, 2).ok());
  EXPECT_EQ(cache->Stats().copy_on_writes, 1u);
  EXPECT_EQ(cache->Stats().pages_used, 4);
  ExpectAttendMatchesReference(*cache, "p", 2);
  ExpectAttendMatchesReference(*cache, "c", 2);

  // Dropping the parent frees only its own page; the child is intact.
  ASSERT_TRUE(cache->Drop("p").ok());
  EXPECT_EQ(cache->Stats().pages_used, 3);
  ExpectAttendMatchesReference(*cache, "c", 1);
}

TEST_F(KvCacheTest, LayerByLayerAppendToAForkCopiesEveryPageItWrites) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(8));
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendRandom(*cache, "p", 0, 0, 1, 8).ok());  // layer 0 fills P0, P1
  ASSERT_TRUE(AppendRandom(*cache, "p", 0, 1, 4, 2).ok());  // layers 1-3 start P0
  ASSERT_TRUE(cache->Fork("p", "c").ok());
  refs_.emplace("c", Ref(*cache, "p"));
  const std::vector<float> q = Queries(*cache, 1);
  const std::vector<float> parent_before = AttendOne(*cache, "p", 2, q, 1);

  // Layers 1-3 of c grow from 2 to 7 tokens: they write into P0 and P1, both
  // shared although P0 is full for layer 0.
  ASSERT_TRUE(AppendRandom(*cache, "c", 2, 1, 4, 5).ok());
  EXPECT_EQ(cache->Stats().copy_on_writes, 2u);
  EXPECT_EQ(cache->Stats().pages_used, 4);
  EXPECT_EQ(AttendOne(*cache, "p", 2, q, 1), parent_before);
  ExpectAttendMatchesReference(*cache, "p", 1);
  ExpectAttendMatchesReference(*cache, "c", 1);
}

TEST_F(KvCacheTest, AttendMatchesFloat64AttentionOverTheDecodedVectors) {
  for (const std::string preset : {"tqkv_k3v3", "turboquant_k3v4_nc"}) {
    SCOPED_TRACE(preset);
    CacheOptions options = SmallCacheOptions(16);
    options.layout.preset = preset;
    refs_.clear();
    std::unique_ptr<KvCache> cache = NewCache(options);
    ASSERT_NE(cache, nullptr);
    ASSERT_TRUE(AppendAll(*cache, "a", 0, 7).ok());
    ASSERT_TRUE(AppendAll(*cache, "a", 7, 4).ok());
    ASSERT_TRUE(AppendAll(*cache, "b", 0, 3).ok());
    ExpectAttendMatchesReference(*cache, "a", 1);
    ExpectAttendMatchesReference(*cache, "a", 3);
    ExpectAttendMatchesReference(*cache, "b", 3);  // every token is a query token

    // One batch over both sequences and several layers.
    struct Item {
      std::string id;
      int layer;
      int n;
    };
    const std::vector<Item> batch = {{"a", 0, 1}, {"b", 1, 2}, {"a", 2, 3}, {"a", 3, 1}};
    std::vector<std::vector<float>> q, out, lse;
    std::vector<AttendRequestItem> items;
    for (const Item& b : batch) {
      q.push_back(Queries(*cache, b.n));
      out.emplace_back(q.back().size());
      lse.emplace_back(static_cast<size_t>(b.n) * cache->layout().num_query_heads());
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      AttendRequestItem item;
      item.sequence_id = batch[i].id;
      item.layer = batch[i].layer;
      item.num_query_tokens = batch[i].n;
      item.queries = q[i].data();
      item.output = out[i].data();
      item.lse = lse[i].data();
      items.push_back(item);
    }
    ASSERT_TRUE(cache->Attend(items).ok());
    for (size_t i = 0; i < batch.size(); ++i) {
      std::vector<double> want_out, want_lse;
      Ref(*cache, batch[i].id).Attend(batch[i].layer, batch[i].n, q[i].data(), &want_out, &want_lse);
      EXPECT_EQ(CountMismatches(out[i].data(), want_out, 1e-4, "batch output"), 0) << i;
      EXPECT_EQ(CountMismatches(lse[i].data(), want_lse, 1e-4, "batch lse"), 0) << i;
    }
  }
}

TEST_F(KvCacheTest, QueryTokensDoNotSeeLaterTokens) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(8));
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "s", 0, 9).ok());
  const ReferenceSequence& ref = Ref(*cache, "s");
  const std::vector<float> q = Queries(*cache, 3);
  const std::vector<float> got = AttendOne(*cache, "s", 1, q, 3);
  std::vector<double> causal, causal_lse, full, full_lse;
  ref.Attend(1, 3, q.data(), &causal, &causal_lse, /*causal=*/true);
  ref.Attend(1, 3, q.data(), &full, &full_lse, /*causal=*/false);
  EXPECT_EQ(CountMismatches(got.data(), causal, 1e-4, "causal"), 0);
  // Query token 0 sees 7 of the 9 tokens: its output differs from attending
  // all of them, so the check above tells a causal kernel from one that is not.
  const size_t row = static_cast<size_t>(cache->layout().num_query_heads()) * cache->layout().head_dim();
  double diff = 0;
  for (size_t i = 0; i < row; ++i) diff = std::max(diff, std::fabs(causal[i] - full[i]));
  EXPECT_GT(diff, 1e-3);

  // The last query token sees everything: same as a single-token query.
  const std::vector<float> last(q.end() - row, q.end());
  const std::vector<float> single = AttendOne(*cache, "s", 1, last, 1);
  const std::vector<float> got_last(got.end() - row, got.end());
  EXPECT_EQ(CountMismatches(single.data(), got_last, 1e-4, "last query token"), 0);
}

TEST_F(KvCacheTest, InvalidAttendWritesNothing) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(8));
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "s", 0, 2).ok());
  ASSERT_TRUE(AppendRandom(*cache, "s", 2, 0, 1, 1).ok());  // layer 0 holds 3
  const std::vector<float> q = Queries(*cache, 3);
  std::vector<float> out0(q.size(), 42.0f), out1(q.size(), 42.0f);

  AttendRequestItem good;
  good.sequence_id = "s";
  good.layer = 0;
  good.num_query_tokens = 1;
  good.queries = q.data();
  good.output = out0.data();
  struct Case {
    std::string name;
    AttendRequestItem item;
    absl::StatusCode code;
  };
  std::vector<Case> cases;
  cases.push_back({"unknown sequence", good, absl::StatusCode::kNotFound});
  cases.back().item.sequence_id = "nobody";
  cases.push_back({"negative layer", good, absl::StatusCode::kInvalidArgument});
  cases.back().item.layer = -1;
  cases.push_back({"layer beyond layout", good, absl::StatusCode::kInvalidArgument});
  cases.back().item.layer = 4;
  cases.push_back({"no query tokens", good, absl::StatusCode::kInvalidArgument});
  cases.back().item.num_query_tokens = 0;
  cases.push_back({"more query tokens than the layer holds", good, absl::StatusCode::kInvalidArgument});
  cases.back().item.layer = 1;
  cases.back().item.num_query_tokens = 3;
  cases.push_back({"null queries", good, absl::StatusCode::kInvalidArgument});
  cases.back().item.queries = nullptr;
  cases.push_back({"null output", good, absl::StatusCode::kInvalidArgument});
  cases.back().item.output = nullptr;

  const Snapshot before = Take(*cache);
  for (Case& c : cases) {
    if (c.item.output != nullptr) c.item.output = out1.data();
    const absl::Status status = cache->Attend({good, c.item});
    EXPECT_EQ(status.code(), c.code) << c.name << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr("item 1")) << c.name;
  }
  // No kernel ran: the good item's output is untouched, and nothing was
  // touched (last_access) or left pinned.
  EXPECT_EQ(out0, std::vector<float>(q.size(), 42.0f));
  EXPECT_EQ(out1, std::vector<float>(q.size(), 42.0f));
  ExpectSame(before, Take(*cache));
  EXPECT_TRUE(cache->Attend({}).ok());
  ASSERT_TRUE(cache->Drop("s").ok());
  EXPECT_EQ(cache->Stats().pages_used, 0);
}

TEST_F(KvCacheTest, ScoreIsScaledDotProductsOverTheRequestedTokens) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(8));
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "s", 0, 10).ok());
  const ReferenceSequence& ref = Ref(*cache, "s");
  const int qh = cache->layout().num_query_heads();
  const std::vector<float> q = Queries(*cache, 1);
  for (int layer = 0; layer < 4; ++layer) {
    std::vector<float> logits(qh * 10);
    ASSERT_TRUE(cache->Score("s", layer, 0, -1, q.data(), logits.data()).ok());
    EXPECT_EQ(CountMismatches(logits.data(), ref.Score(layer, 0, 10, q.data()), 1e-4, "all"), 0);
    std::vector<float> part(qh * 6);
    ASSERT_TRUE(cache->Score("s", layer, 3, 9, q.data(), part.data()).ok());
    EXPECT_EQ(CountMismatches(part.data(), ref.Score(layer, 3, 9, q.data()), 1e-4, "part"), 0);
  }
  std::vector<float> logits(qh * 10, 42.0f);
  EXPECT_TRUE(cache->Score("s", 0, 4, 4, q.data(), logits.data()).ok());  // empty range
  EXPECT_TRUE(cache->Score("s", 0, 10, -1, q.data(), logits.data()).ok());
  EXPECT_EQ(cache->Score("s", 0, 5, 4, q.data(), logits.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("s", 0, -1, 4, q.data(), logits.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("s", 0, 0, -2, q.data(), logits.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("s", 0, 0, 11, q.data(), logits.data()).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(cache->Score("s", 0, 11, -1, q.data(), logits.data()).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(cache->Score("s", 4, 0, -1, q.data(), logits.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("s", 0, 0, -1, nullptr, logits.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("s", 0, 0, -1, q.data(), nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("nobody", 0, 0, -1, q.data(), logits.data()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(logits, std::vector<float>(qh * 10, 42.0f));
}

// A Drop while an Attend has the sequence's pages pinned: the read finishes
// on intact pages, which return to the pool only afterwards. A sequence with
// a read in flight is not idle, so LRU eviction passes over it.
TEST_F(KvCacheTest, PinnedPagesOutliveADropUntilTheReadEnds) {
  FakeClock clock;
  GatedBackend gated(backend_.get());
  CacheOptions options = SmallCacheOptions(4);
  options.evict_lru = true;
  options.clock = clock.AsFunction();
  absl::StatusOr<std::unique_ptr<KvCache>> created = KvCache::Create(options, &gated);
  ASSERT_TRUE(created.ok()) << created.status();
  KvCache& cache = **created;
  ASSERT_TRUE(AppendAll(cache, "read", 0, 8).ok());  // 2 pages
  ASSERT_TRUE(AppendAll(cache, "idle", 0, 4).ok());  // 1 page
  clock.Advance(absl::Seconds(1));

  const std::vector<float> q = Queries(cache, 1);
  std::vector<double> want, want_lse;
  Ref(cache, "read").Attend(2, 1, q.data(), &want, &want_lse);
  gated.ArmAttendGate();
  std::vector<float> got;
  std::thread reader([&] { got = AttendOne(cache, "read", 2, q, 1); });
  if (!gated.WaitUntilAttendEntered()) {
    gated.ReleaseAttend();
    reader.join();
    FAIL() << "the Attend never reached the backend";
  }
  // No ASSERTs until the reader is joined.

  // "read" is now the least recently used, but a read is in flight on it.
  clock.Advance(absl::Seconds(1));
  std::vector<float> logits(cache.layout().num_query_heads() * 4);
  EXPECT_TRUE(cache.Score("idle", 0, 0, -1, q.data(), logits.data()).ok());
  clock.Advance(absl::Seconds(1));
  EXPECT_TRUE(AppendAll(cache, "new", 0, 8).ok());  // 2 pages, 1 free
  EXPECT_THAT(cache.ListSequences(), ElementsAre("new", "read"));
  EXPECT_EQ(cache.Stats().evictions, 1u);

  EXPECT_TRUE(cache.Drop("read").ok());
  EXPECT_EQ(cache.Stats().pages_used, 4);  // still pinned
  EXPECT_EQ(cache.Stats().sequences, 1);
  // Pinned pages are neither free nor won by eviction: dropping "new" would
  // give 2 of the 3 pages needed, so nothing happens.
  EXPECT_EQ(AppendAll(cache, "more", 0, 12).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(cache.ListSequences(), ElementsAre("new"));

  gated.ReleaseAttend();
  reader.join();
  EXPECT_EQ(CountMismatches(got.data(), want, 1e-4, "pinned read"), 0);
  EXPECT_EQ(cache.Stats().pages_used, 2);
  ASSERT_TRUE(AppendAll(cache, "more", 0, 8).ok());
  EXPECT_EQ(cache.Stats().pages_used, 4);
  EXPECT_EQ(cache.Stats().evictions, 1u);
  ExpectAttendMatchesReference(cache, "more", 1);
  ExpectAttendMatchesReference(cache, "new", 1);
}

}  // namespace
}  // namespace cache_test
}  // namespace tqkv
