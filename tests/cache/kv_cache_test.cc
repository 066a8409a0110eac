// KvCache: sequences, appends (all or nothing, retries), a full pool,
// eviction (LRU, TTL) and accounts. Forks and reads: kv_cache_read_test.cc.
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

TEST_F(KvCacheTest, CreateSizesThePoolFromTheBudget) {
  CacheOptions options = SmallCacheOptions(7);
  options.memory_budget_bytes += testing_util::PageBytes(options.layout) - 1;  // not a whole page
  std::unique_ptr<KvCache> cache = NewCache(options);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(cache->Stats().pages_total, 7);
  EXPECT_EQ(cache->Stats().pages_used, 0);
  EXPECT_EQ(cache->options().name, "default");
}

TEST_F(KvCacheTest, CreateRejectsBadOptions) {
  CacheOptions tiny = SmallCacheOptions(1);
  tiny.memory_budget_bytes -= 1;
  absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(tiny, backend_.get());
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(cache.status().message(), HasSubstr("holds no page"));

  CacheOptions bad_heads = SmallCacheOptions(4);
  bad_heads.layout.num_query_heads = 3;
  EXPECT_EQ(KvCache::Create(bad_heads, backend_.get()).status().code(), absl::StatusCode::kInvalidArgument);

  CacheOptions bad_preset = SmallCacheOptions(4);
  bad_preset.layout.preset = "no_such_preset";
  EXPECT_EQ(KvCache::Create(bad_preset, backend_.get()).status().code(), absl::StatusCode::kNotFound);

  CacheOptions bad_ttl = SmallCacheOptions(4);
  bad_ttl.idle_ttl = absl::ZeroDuration();
  EXPECT_EQ(KvCache::Create(bad_ttl, backend_.get()).status().code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(KvCache::Create(SmallCacheOptions(4), nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(KvCacheTest, CreateAppendGetDrop) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(8));
  ASSERT_NE(cache, nullptr);
  const KvLayout& layout = cache->layout();

  ASSERT_TRUE(cache->CreateSequence("a").ok());
  EXPECT_EQ(cache->CreateSequence("a").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(cache->CreateSequence("").code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<SequenceInfo> empty = cache->GetSequence("a");
  ASSERT_TRUE(empty.ok());
  EXPECT_THAT(empty->layer_tokens, ElementsAre(0, 0, 0, 0));
  EXPECT_EQ(empty->pages, 0);

  ASSERT_TRUE(AppendAll(*cache, "a", 0, 6).ok());
  ASSERT_TRUE(AppendAll(*cache, "b", 0, 1).ok());  // created by its first append
  absl::StatusOr<SequenceInfo> a = cache->GetSequence("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->id, "a");
  EXPECT_THAT(a->layer_tokens, ElementsAre(6, 6, 6, 6));
  EXPECT_EQ(a->max_tokens, 6);
  EXPECT_EQ(a->pages, 2);
  EXPECT_THAT(cache->ListSequences(), ElementsAre("a", "b"));

  uint64_t bytes_per_token = 0;
  for (int layer = 0; layer < layout.num_layers(); ++layer) bytes_per_token += layout.token_bytes(layer);
  CacheStats stats = cache->Stats();
  EXPECT_EQ(stats.pages_used, 3);
  EXPECT_EQ(stats.sequences, 2);
  EXPECT_EQ(stats.tokens, 7);
  EXPECT_EQ(stats.stored_bytes, 7 * bytes_per_token);
  EXPECT_EQ(stats.stored_bytes_bf16, 7 * 4 * layout.token_bytes_bf16());
  EXPECT_LT(stats.stored_bytes, stats.stored_bytes_bf16);
  ExpectAttendMatchesReference(*cache, "a", 1);

  ASSERT_TRUE(cache->Drop("a").ok());
  EXPECT_EQ(cache->GetSequence("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->Drop("a").code(), absl::StatusCode::kNotFound);
  stats = cache->Stats();
  EXPECT_EQ(stats.pages_used, 1);
  EXPECT_EQ(stats.sequences, 1);
  EXPECT_EQ(stats.tokens, 1);
  EXPECT_EQ(stats.stored_bytes, bytes_per_token);
  ASSERT_TRUE(cache->Drop("b").ok());
  EXPECT_EQ(cache->Stats().pages_used, 0);
  EXPECT_EQ(cache->Stats().stored_bytes, 0u);
  EXPECT_TRUE(cache->ListSequences().empty());
}

TEST_F(KvCacheTest, AppendsLayerByLayerKeepPerLayerLengths) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(8));
  ASSERT_NE(cache, nullptr);
  const KvLayout& layout = cache->layout();
  ASSERT_TRUE(AppendRandom(*cache, "s", 0, 0, 1, 5).ok());
  ASSERT_TRUE(AppendRandom(*cache, "s", 0, 1, 3, 5).ok());
  ASSERT_TRUE(AppendRandom(*cache, "s", 0, 3, 4, 3).ok());
  absl::StatusOr<SequenceInfo> info = cache->GetSequence("s");
  ASSERT_TRUE(info.ok());
  EXPECT_THAT(info->layer_tokens, ElementsAre(5, 5, 5, 3));
  EXPECT_EQ(info->max_tokens, 5);
  EXPECT_EQ(info->pages, 2);
  EXPECT_EQ(cache->Stats().tokens, 5);
  EXPECT_EQ(cache->Stats().stored_bytes,
            5 * (layout.token_bytes(0) + layout.token_bytes(1) + layout.token_bytes(2)) + 3 * layout.token_bytes(3));

  // The short layer catches up inside pages the other layers already filled.
  ASSERT_TRUE(AppendRandom(*cache, "s", 3, 3, 4, 4).ok());
  info = cache->GetSequence("s");
  ASSERT_TRUE(info.ok());
  EXPECT_THAT(info->layer_tokens, ElementsAre(5, 5, 5, 7));
  EXPECT_EQ(info->max_tokens, 7);
  EXPECT_EQ(info->pages, 2);
  ExpectAttendMatchesReference(*cache, "s", 1);
  ExpectAttendMatchesReference(*cache, "s", 3);
}

TEST_F(KvCacheTest, WrongStartPositionIsFailedPreconditionAndChangesNothing) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(8));
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "s", 0, 5).ok());
  ASSERT_TRUE(AppendRandom(*cache, "s", 5, 0, 2, 2).ok());  // layers 0-1 at 7, 2-3 at 5
  const Snapshot before = Take(*cache);

  // A retried append (too low).
  absl::Status status = AppendAll(*cache, "s", 0, 5);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("layer 0 holds 7 tokens; an append must start at 7, got 0"));
  // A gap (too high).
  status = AppendRandom(*cache, "s", 9, 0, 2, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("must start at 7, got 9"));
  // Right for layers 2-3, wrong for layer 1.
  status = AppendRandom(*cache, "s", 5, 1, 4, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("layer 1 holds 7 tokens"));
  // A new sequence starts at 0.
  status = AppendAll(*cache, "new", 3, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("must start at 0, got 3"));

  ExpectSame(before, Take(*cache));
  ExpectAttendMatchesReference(*cache, "s", 1);
}

TEST_F(KvCacheTest, InvalidAppendsChangeNothing) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(4));
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "s", 0, 3).ok());
  const Snapshot before = Take(*cache);
  const std::vector<float> data = RandomTensor(4, 20, cache->layout(), 7);

  struct Case {
    std::string name;
    AppendRequest request;
    absl::StatusCode code;
  };
  auto valid = [&] {
    AppendRequest r;
    r.sequence_id = "s";
    r.start_position = 3;
    r.layer_begin = 0;
    r.layer_end = 4;
    r.num_tokens = 1;
    r.keys = data.data();
    r.values = data.data();
    return r;
  };
  std::vector<Case> cases;
  cases.push_back({"empty id", valid(), absl::StatusCode::kInvalidArgument});
  cases.back().request.sequence_id = "";
  cases.push_back({"negative layer_begin", valid(), absl::StatusCode::kInvalidArgument});
  cases.back().request.layer_begin = -1;
  cases.push_back({"layer_end beyond layout", valid(), absl::StatusCode::kInvalidArgument});
  cases.back().request.layer_end = 5;
  cases.push_back({"empty layer range", valid(), absl::StatusCode::kInvalidArgument});
  cases.back().request.layer_begin = 2;
  cases.back().request.layer_end = 2;
  cases.push_back({"no tokens", valid(), absl::StatusCode::kInvalidArgument});
  cases.back().request.num_tokens = 0;
  cases.push_back({"negative tokens", valid(), absl::StatusCode::kInvalidArgument});
  cases.back().request.num_tokens = -2;
  cases.push_back({"null keys", valid(), absl::StatusCode::kInvalidArgument});
  cases.back().request.keys = nullptr;
  cases.push_back({"null values", valid(), absl::StatusCode::kInvalidArgument});
  cases.back().request.values = nullptr;
  cases.push_back({"negative start", valid(), absl::StatusCode::kInvalidArgument});
  cases.back().request.start_position = -1;
  cases.push_back({"start far beyond the pool", valid(), absl::StatusCode::kFailedPrecondition});
  cases.back().request.start_position = int64_t{1} << 62;
  cases.push_back({"unknown, no create", valid(), absl::StatusCode::kNotFound});
  cases.back().request.sequence_id = "nobody";
  cases.back().request.start_position = 0;
  cases.back().request.create_if_missing = false;
  cases.push_back({"more than the pool holds", valid(), absl::StatusCode::kResourceExhausted});
  cases.back().request.num_tokens = 14;  // 17 tokens > 4 pages x 4
  cases.push_back({"pool full", valid(), absl::StatusCode::kResourceExhausted});
  cases.back().request.num_tokens = 13;  // 4 pages; s holds one of the 4
  cases.back().request.sequence_id = "other";
  cases.back().request.start_position = 0;

  for (const Case& c : cases) {
    const absl::Status status = cache->Append(c.request);
    EXPECT_EQ(status.code(), c.code) << c.name << ": " << status;
    EXPECT_FALSE(status.message().empty()) << c.name;
    ExpectSame(before, Take(*cache));
  }
  EXPECT_EQ(cache->GetSequence("nobody").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->GetSequence("other").status().code(), absl::StatusCode::kNotFound);
  ExpectAttendMatchesReference(*cache, "s", 1);
}

// An append whose last token is bad fails as a whole, whether the cache or
// the store kernel finds the problem, and whether the sequence exists or the
// append would have created it.
TEST_F(KvCacheTest, FailedAppendIsAllOrNothing) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(8));
  ASSERT_NE(cache, nullptr);
  const KvLayout& layout = cache->layout();
  ASSERT_TRUE(AppendAll(*cache, "s", 0, 3).ok());  // a partial page
  ASSERT_TRUE(cache->Fork("s", "child").ok());     // ... shared: the next append copies it
  const Snapshot before = Take(*cache);

  const int64_t n = 6;
  const size_t per_layer = static_cast<size_t>(n) * layout.num_kv_heads() * layout.head_dim();
  struct Poison {
    std::string name;
    bool keys;
    float value;
  };
  // 1e6 is finite but beyond fp16, so the store kernel (not the cache's
  // finiteness check) rejects it in the fp16 boundary layer 3.
  const std::vector<Poison> poisons = {{"nan value", false, std::nanf("")},
                                       {"inf key", true, INFINITY},
                                       {"key beyond fp16", true, 1e6f},
                                       {"value beyond fp16", false, -1e6f}};
  for (const std::string id : {"s", "child", "fresh"}) {
    const int64_t start = id == "fresh" ? 0 : 3;
    for (const Poison& poison : poisons) {
      std::vector<float> keys = RandomTensor(4, n, layout, 11);
      std::vector<float> values = RandomTensor(4, n, layout, 12);
      (poison.keys ? keys : values)[3 * per_layer + per_layer - 1] = poison.value;
      AppendRequest request;
      request.sequence_id = id;
      request.start_position = start;
      request.layer_begin = 0;
      request.layer_end = 4;
      request.num_tokens = n;
      request.keys = keys.data();
      request.values = values.data();
      const absl::Status status = cache->Append(request);
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << id << ", " << poison.name;
      ExpectSame(before, Take(*cache));
    }
  }
  EXPECT_EQ(cache->GetSequence("fresh").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->Stats().copy_on_writes, 0u);

  // Nothing half-written shows: the same positions take good data afterwards.
  ASSERT_TRUE(AppendAll(*cache, "s", 3, n).ok());
  ASSERT_TRUE(AppendAll(*cache, "fresh", 0, n).ok());
  ExpectAttendMatchesReference(*cache, "s", 2);
  ExpectAttendMatchesReference(*cache, "fresh", 2);
}

TEST_F(KvCacheTest, FullPoolIsResourceExhaustedAndChangesNothing) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(4));
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "a", 0, 10).ok());  // 3 pages
  const Snapshot before = Take(*cache);
  const absl::Status status = AppendAll(*cache, "b", 0, 8);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("cache 'default' is full: need 2 pages, 1 free of 4"));
  EXPECT_EQ(AppendAll(*cache, "a", 10, 7).code(), absl::StatusCode::kResourceExhausted);
  ExpectSame(before, Take(*cache));
  // What fits still goes in: 2 more tokens fill a's last page, 4 the free one.
  EXPECT_TRUE(AppendAll(*cache, "a", 10, 6).ok());
  EXPECT_EQ(cache->Stats().pages_used, 4);
  ExpectAttendMatchesReference(*cache, "a", 1);
}

TEST_F(KvCacheTest, LruEvictsTheLeastRecentlyUsedIdleSequence) {
  FakeClock clock;
  CacheOptions options = SmallCacheOptions(4);
  options.evict_lru = true;
  options.clock = clock.AsFunction();
  std::unique_ptr<KvCache> cache = NewCache(options);
  ASSERT_NE(cache, nullptr);
  for (const std::string id : {"a", "b", "c"}) {
    ASSERT_TRUE(AppendAll(*cache, id, 0, 4).ok());
    clock.Advance(absl::Seconds(1));
  }
  // Reading a makes b the least recently used.
  const std::vector<float> q = Queries(*cache, 1);
  AttendOne(*cache, "a", 1, q, 1);
  clock.Advance(absl::Seconds(1));

  ASSERT_TRUE(AppendAll(*cache, "d", 0, 8).ok());  // 2 pages, 1 free
  EXPECT_THAT(cache->ListSequences(), ElementsAre("a", "c", "d"));
  EXPECT_EQ(cache->Stats().evictions, 1u);
  EXPECT_EQ(cache->Stats().pages_used, 4);
  EXPECT_EQ(cache->Stats().sequences, 3);
  ExpectAttendMatchesReference(*cache, "a", 1);
  ExpectAttendMatchesReference(*cache, "c", 1);
  ExpectAttendMatchesReference(*cache, "d", 1);

  // c needs 2 more pages: a and d go (least recently used first), never c.
  clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(AppendAll(*cache, "c", 4, 8).ok());
  EXPECT_THAT(cache->ListSequences(), ElementsAre("c"));
  EXPECT_EQ(cache->Stats().evictions, 3u);
  ExpectAttendMatchesReference(*cache, "c", 1);

  // An evicted sequence is NOT_FOUND saying when and why; one that never
  // existed is not; reusing the id forgets the eviction.
  clock.Advance(absl::Seconds(2));
  absl::StatusOr<SequenceInfo> gone = cache->GetSequence("a");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(gone.status().message()), HasSubstr("it was evicted 2s ago (least recently used"));
  EXPECT_EQ(cache->Stats().evicted_lookups, 1u);
  absl::StatusOr<SequenceInfo> never = cache->GetSequence("never");
  EXPECT_EQ(never.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(never.status().message(), Not(HasSubstr("evicted")));
  EXPECT_EQ(cache->Fork("b", "b2").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->Stats().evicted_lookups, 2u);
  ASSERT_TRUE(cache->CreateSequence("a").ok());
  ASSERT_TRUE(cache->Drop("a").ok());
  EXPECT_THAT(cache->GetSequence("a").status().message(), Not(HasSubstr("evicted")));
}

TEST_F(KvCacheTest, LruNeverEvictsTheTargetAndEvictsNothingWhenItCannotFit) {
  FakeClock clock;
  CacheOptions options = SmallCacheOptions(4);
  options.evict_lru = true;
  options.clock = clock.AsFunction();
  std::unique_ptr<KvCache> cache = NewCache(options);
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "target", 0, 2).ok());  // P0, partial
  clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(cache->Fork("target", "twin").ok());  // shares P0
  refs_.emplace("twin", Ref(*cache, "target"));
  clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(AppendAll(*cache, "other", 0, 4).ok());  // P1
  clock.Advance(absl::Seconds(1));
  std::vector<float> logits(4 * 2);
  ASSERT_TRUE(cache->Score("twin", 0, 0, -1, Queries(*cache, 1).data(), logits.data()).ok());
  clock.Advance(absl::Seconds(1));
  // LRU order: target (never a victim of its own append), other, twin.
  const Snapshot before = Take(*cache);

  // 14 more tokens: 3 new pages and a copy of P0, 2 free. Dropping other
  // frees 1, dropping twin none (target still holds P0): not enough, so
  // nobody goes.
  absl::Status status = AppendAll(*cache, "target", 2, 14);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("need 4 pages, 2 free of 4"));
  EXPECT_THAT(status.message(), HasSubstr("would free only 1"));
  ExpectSame(before, Take(*cache));

  // 10 more tokens: 2 new pages and the copy; dropping other suffices.
  ASSERT_TRUE(AppendAll(*cache, "target", 2, 10).ok());
  EXPECT_THAT(cache->ListSequences(), ElementsAre("target", "twin"));
  EXPECT_EQ(cache->Stats().evictions, 1u);
  EXPECT_EQ(cache->Stats().copy_on_writes, 1u);
  EXPECT_EQ(cache->Stats().pages_used, 4);
  ExpectAttendMatchesReference(*cache, "target", 1);
  ExpectAttendMatchesReference(*cache, "twin", 1);
}

TEST_F(KvCacheTest, LruCountsSharedPagesOnlyWhenTheirLastHolderGoes) {
  FakeClock clock;
  CacheOptions options = SmallCacheOptions(4);
  options.evict_lru = true;
  options.clock = clock.AsFunction();
  std::unique_ptr<KvCache> cache = NewCache(options);
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "parent", 0, 8).ok());
  clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(cache->Fork("parent", "child").ok());  // touches both
  clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(AppendAll(*cache, "newer", 0, 4).ok());
  clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(AppendAll(*cache, "parent", 8, 1).ok());  // parent is now newer than child
  clock.Advance(absl::Seconds(1));
  // 4 pages: 2 shared, newer 1, parent's third page 1. Two pages for `x`:
  // child (LRU) frees nothing, newer frees 1, parent frees 3.
  ASSERT_TRUE(AppendAll(*cache, "x", 0, 8).ok());
  EXPECT_THAT(cache->ListSequences(), ElementsAre("x"));
  EXPECT_EQ(cache->Stats().evictions, 3u);
  EXPECT_EQ(cache->Stats().pages_used, 2);
}

// Accounts (usage_account.h): a sequence's pages, itself and its tokens are
// charged to the account it was created with, until it is dropped or
// evicted; a call past the account's limits is refused before anything is
// allocated and changes nothing, whatever the pool has free.
TEST_F(KvCacheTest, AccountsChargeWhatTheirSequencesHoldAndRefuseBeyondTheirLimits) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(16));
  ASSERT_NE(cache, nullptr);
  const uint64_t page = cache->layout().page_bytes();
  auto a = std::make_shared<UsageAccount>("tenant 'a'", 3 * page, 2);
  auto b = std::make_shared<UsageAccount>("tenant 'b'", 0, 0);

  ASSERT_TRUE(AppendAll(*cache, "a:1", 0, 6, a).ok());  // 2 pages
  EXPECT_EQ(a->bytes(), 2 * page);
  EXPECT_EQ(a->sequences(), 1);
  EXPECT_EQ(a->tokens(), 6);

  // 8 more tokens need 2 more pages: 4 > 3.
  Snapshot before = Take(*cache);
  absl::Status status = AppendAll(*cache, "a:1", 6, 8);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()), HasSubstr("tenant 'a' is at its quota"));
  ExpectSame(before, Take(*cache));
  EXPECT_EQ(a->bytes(), 2 * page);
  EXPECT_EQ(a->refusals(), 1u);
  // An existing sequence keeps its own account, whatever the call passes.
  EXPECT_EQ(AppendAll(*cache, "a:1", 6, 8, b).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(AppendAll(*cache, "a:1", 6, 6).ok());  // 3 pages: at the limit
  EXPECT_EQ(a->bytes(), 3 * page);
  EXPECT_EQ(a->tokens(), 12);

  // A fork is charged for every page it shares.
  EXPECT_EQ(cache->Fork("a:1", "a:2", a).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(a->sequences(), 1);
  EXPECT_EQ(cache->GetSequence("a:2").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(cache->Fork("a:1", "b:1", b).ok());
  refs_.emplace("b:1", Ref(*cache, "a:1"));
  EXPECT_EQ(b->bytes(), 3 * page);
  EXPECT_EQ(b->sequences(), 1);
  EXPECT_EQ(b->tokens(), 12);

  // max_sequences counts creations, forks and first appends alike.
  ASSERT_TRUE(cache->CreateSequence("a:empty", a).ok());
  EXPECT_EQ(a->sequences(), 2);
  EXPECT_EQ(cache->CreateSequence("a:3", a).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(AppendAll(*cache, "a:4", 0, 1, a).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache->GetSequence("a:4").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a->sequences(), 2);

  // Dropping gives everything back; pages shared with b stay b's.
  ASSERT_TRUE(cache->Drop("a:1").ok());
  EXPECT_EQ(a->bytes(), 0u);
  EXPECT_EQ(a->sequences(), 1);
  EXPECT_EQ(a->tokens(), 0);
  EXPECT_EQ(b->bytes(), 3 * page);
  ASSERT_TRUE(AppendAll(*cache, "b:1", 12, 4).ok());  // one fresh page, no copy (b:1 holds them alone)
  EXPECT_EQ(b->bytes(), 4 * page);
  EXPECT_EQ(b->tokens(), 16);
  ExpectAttendMatchesReference(*cache, "b:1", 1);
  ASSERT_TRUE(cache->Drop("b:1").ok());
  ASSERT_TRUE(cache->Drop("a:empty").ok());
  EXPECT_EQ(b->bytes(), 0u);
  EXPECT_EQ(a->sequences(), 0);
  EXPECT_EQ(cache->Stats().pages_used, 0);
}

TEST_F(KvCacheTest, AFullPoolOrAnEvictionGivesTheAccountItsBytesBack) {
  FakeClock clock;
  CacheOptions options = SmallCacheOptions(3);
  options.evict_lru = true;
  options.clock = clock.AsFunction();
  std::unique_ptr<KvCache> cache = NewCache(options);
  ASSERT_NE(cache, nullptr);
  auto account = std::make_shared<UsageAccount>("tenant 'x'", 0, 0);
  // 4 pages never fit: refused, nothing charged.
  EXPECT_EQ(AppendAll(*cache, "x:big", 0, 16, account).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(account->bytes(), 0u);
  EXPECT_EQ(account->sequences(), 0);
  ASSERT_TRUE(AppendAll(*cache, "x:old", 0, 8, account).ok());
  EXPECT_EQ(account->bytes(), 2 * cache->layout().page_bytes());
  clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(AppendAll(*cache, "other", 0, 8).ok());  // evicts x:old
  EXPECT_EQ(cache->GetSequence("x:old").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(account->bytes(), 0u);
  EXPECT_EQ(account->sequences(), 0);
  EXPECT_EQ(account->tokens(), 0);
}

// request_id: a key the sequence remembers answers the same append
// already_stored (after another writer's append too) and refuses another one;
// a sequence remembers its last kRememberedAppends keys.
TEST_F(KvCacheTest, RequestIdsMakeRetriedAppendsIdempotent) {
  std::unique_ptr<KvCache> cache = NewCache(SmallCacheOptions(64));
  ASSERT_NE(cache, nullptr);
  const int layers = cache->layout().num_layers();
  const std::vector<float> keys = RandomTensor(layers, 1, cache->layout(), 7);
  const auto append = [&](const std::string& request_id, int64_t start, AppendOutcome* outcome) {
    AppendRequest request;
    request.sequence_id = "s";
    request.start_position = start;
    request.layer_end = layers;
    request.num_tokens = 1;
    request.keys = keys.data();
    request.values = keys.data();
    request.request_id = request_id;
    return cache->Append(request, outcome);
  };
  AppendOutcome outcome;
  ASSERT_TRUE(append("r0", 0, &outcome).ok());
  EXPECT_FALSE(outcome.already_stored);
  ASSERT_TRUE(append("", 1, &outcome).ok());  // another writer, no key
  ASSERT_TRUE(append("r0", 0, &outcome).ok());
  EXPECT_TRUE(outcome.already_stored);
  EXPECT_EQ(cache->GetSequence("s")->layer_tokens, std::vector<int64_t>(layers, 2));
  absl::Status status = append("r0", 2, &outcome);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("request_id 'r0' already named an append"));
  EXPECT_EQ(append("r-unknown", 0, &outcome).code(), absl::StatusCode::kFailedPrecondition);
  for (int i = 0; i < kRememberedAppends; ++i) {
    ASSERT_TRUE(append("n" + std::to_string(i), 2 + i, &outcome).ok());
  }
  // r0 is forgotten now: a resend is refused by position, like any stale append.
  EXPECT_EQ(append("r0", 0, &outcome).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(append("n1", 3, &outcome).ok());
  EXPECT_TRUE(outcome.already_stored);
}

TEST_F(KvCacheTest, EvictExpiredDropsOnlySequencesIdleLongerThanTheTtl) {
  FakeClock clock;
  CacheOptions options = SmallCacheOptions(8);
  options.idle_ttl = absl::Seconds(10);
  options.clock = clock.AsFunction();
  std::unique_ptr<KvCache> cache = NewCache(options);
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(AppendAll(*cache, "old", 0, 2).ok());
  clock.Advance(absl::Seconds(4));
  ASSERT_TRUE(AppendAll(*cache, "mid", 0, 2).ok());
  clock.Advance(absl::Seconds(4));
  ASSERT_TRUE(cache->CreateSequence("young").ok());
  EXPECT_EQ(cache->EvictExpired(), 0);

  clock.Advance(absl::Seconds(2));  // old: exactly 10 s, not longer
  EXPECT_EQ(cache->EvictExpired(), 0);
  clock.Advance(absl::Seconds(1));  // old: 11 s
  EXPECT_EQ(cache->EvictExpired(), 1);
  EXPECT_THAT(cache->ListSequences(), ElementsAre("mid", "young"));
  EXPECT_EQ(cache->Stats().evictions, 1u);
  EXPECT_THAT(std::string(cache->GetSequence("old").status().message()), HasSubstr("evicted 0s ago (idle longer than"));
  EXPECT_EQ(cache->Stats().pages_used, 1);

  // A read keeps mid alive; an append sweeps the expired ones first.
  const std::vector<float> q = Queries(*cache, 1);
  AttendOne(*cache, "mid", 0, q, 1);
  clock.Advance(absl::Seconds(9));  // young: 12 s, mid: 9 s
  ASSERT_TRUE(AppendAll(*cache, "fresh", 0, 1).ok());
  EXPECT_THAT(cache->ListSequences(), ElementsAre("fresh", "mid"));
  EXPECT_EQ(cache->Stats().evictions, 2u);
  ExpectAttendMatchesReference(*cache, "mid", 1);
}

}  // namespace
}  // namespace cache_test
}  // namespace tqkv
