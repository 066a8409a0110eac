#include "cache/kv_cache.h"

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/cache/cache_test_util.h"

namespace tqkv {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using testing_util::CountMismatches;
using testing_util::FakeClock;
using testing_util::GatedBackend;
using testing_util::RandomTensor;
using testing_util::ReferenceSequence;
using testing_util::SmallCacheOptions;
using testing_util::SmallLayout;

// Everything a caller can observe without reading tokens.
struct Snapshot {
  std::vector<std::string> ids;
  std::vector<SequenceInfo> infos;
  CacheStats stats;
};

Snapshot Take(KvCache& cache) {
  Snapshot s;
  s.ids = cache.ListSequences();
  for (const std::string& id : s.ids) {
    absl::StatusOr<SequenceInfo> info = cache.GetSequence(id);
    EXPECT_TRUE(info.ok()) << info.status();
    if (info.ok()) s.infos.push_back(*info);
  }
  s.stats = cache.Stats();
  return s;
}

void ExpectSame(const Snapshot& before, const Snapshot& after) {
  EXPECT_EQ(before.ids, after.ids);
  ASSERT_EQ(before.infos.size(), after.infos.size());
  for (size_t i = 0; i < before.infos.size(); ++i) {
    EXPECT_EQ(before.infos[i].id, after.infos[i].id);
    EXPECT_EQ(before.infos[i].layer_tokens, after.infos[i].layer_tokens) << before.infos[i].id;
    EXPECT_EQ(before.infos[i].max_tokens, after.infos[i].max_tokens) << before.infos[i].id;
    EXPECT_EQ(before.infos[i].pages, after.infos[i].pages) << before.infos[i].id;
    EXPECT_EQ(before.infos[i].last_access, after.infos[i].last_access) << before.infos[i].id;
  }
  const CacheStats& a = before.stats;
  const CacheStats& b = after.stats;
  EXPECT_EQ(a.pages_total, b.pages_total);
  EXPECT_EQ(a.pages_used, b.pages_used);
  EXPECT_EQ(a.sequences, b.sequences);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.stored_bytes, b.stored_bytes);
  EXPECT_EQ(a.stored_bytes_bf16, b.stored_bytes_bf16);
  EXPECT_EQ(a.evictions, b.evictions);
  EXPECT_EQ(a.copy_on_writes, b.copy_on_writes);
}

class KvCacheTest : public ::testing::Test {
 protected:
  void SetUp() override { backend_ = MakeCpuBackend(1); }

  std::unique_ptr<KvCache> NewCache(const CacheOptions& options) {
    absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(options, backend_.get());
    EXPECT_TRUE(cache.ok()) << cache.status();
    return cache.ok() ? std::move(*cache) : nullptr;
  }

  ReferenceSequence& Ref(KvCache& cache, const std::string& id) {
    auto it = refs_.find(id);
    if (it == refs_.end()) it = refs_.emplace(id, ReferenceSequence(&cache.layout())).first;
    return it->second;
  }

  // Appends n random tokens to layers [begin, end) of `id` at `start` and, on
  // success, records their decoded vectors in the reference.
  absl::Status AppendRandom(KvCache& cache, const std::string& id, int64_t start, int begin,
                            int end, int64_t n, std::shared_ptr<UsageAccount> account = nullptr) {
    const std::vector<float> keys = RandomTensor(end - begin, n, cache.layout(), ++seed_);
    const std::vector<float> values = RandomTensor(end - begin, n, cache.layout(), ++seed_);
    AppendRequest request;
    request.sequence_id = id;
    request.start_position = start;
    request.layer_begin = begin;
    request.layer_end = end;
    request.num_tokens = n;
    request.keys = keys.data();
    request.values = values.data();
    request.account = std::move(account);
    absl::Status status = cache.Append(request);
    if (status.ok()) Ref(cache, id).Append(begin, end, n, keys.data(), values.data());
    return status;
  }
  absl::Status AppendAll(KvCache& cache, const std::string& id, int64_t start, int64_t n,
                         std::shared_ptr<UsageAccount> account = nullptr) {
    return AppendRandom(cache, id, start, 0, cache.layout().num_layers(), n, std::move(account));
  }

  std::vector<float> Queries(const KvCache& cache, int num_query_tokens) {
    return testing_util::RandomQueries(num_query_tokens, cache.layout(), ++seed_ + 1000000);
  }

  // Attends `id`'s layer and returns the output (and lse when asked).
  std::vector<float> AttendOne(KvCache& cache, const std::string& id, int layer,
                               const std::vector<float>& queries, int num_query_tokens,
                               std::vector<float>* lse = nullptr) {
    std::vector<float> output(queries.size(), std::numeric_limits<float>::quiet_NaN());
    if (lse != nullptr) {
      lse->assign(static_cast<size_t>(num_query_tokens) * cache.layout().num_query_heads(), 0.0f);
    }
    AttendRequestItem item;
    item.sequence_id = id;
    item.layer = layer;
    item.num_query_tokens = num_query_tokens;
    item.queries = queries.data();
    item.output = output.data();
    item.lse = lse == nullptr ? nullptr : lse->data();
    const absl::Status status = cache.Attend({item});
    EXPECT_TRUE(status.ok()) << status;
    return output;
  }

  // Checks Attend on every layer of `id` against the float64 reference.
  void ExpectAttendMatchesReference(KvCache& cache, const std::string& id, int num_query_tokens) {
    const ReferenceSequence& ref = Ref(cache, id);
    for (int layer = 0; layer < cache.layout().num_layers(); ++layer) {
      if (ref.tokens(layer) < num_query_tokens) continue;
      const std::vector<float> q = Queries(cache, num_query_tokens);
      std::vector<float> lse;
      const std::vector<float> got = AttendOne(cache, id, layer, q, num_query_tokens, &lse);
      std::vector<double> want_out, want_lse;
      ref.Attend(layer, num_query_tokens, q.data(), &want_out, &want_lse);
      EXPECT_EQ(CountMismatches(got.data(), want_out, 1e-4, id + " output"), 0)
          << "layer " << layer;
      EXPECT_EQ(CountMismatches(lse.data(), want_lse, 1e-4, id + " lse"), 0) << "layer " << layer;
    }
  }

  std::unique_ptr<Backend> backend_;
  std::map<std::string, ReferenceSequence> refs_;
  uint32_t seed_ = 1;
};

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
  EXPECT_EQ(KvCache::Create(bad_heads, backend_.get()).status().code(),
            absl::StatusCode::kInvalidArgument);

  CacheOptions bad_preset = SmallCacheOptions(4);
  bad_preset.layout.preset = "no_such_preset";
  EXPECT_EQ(KvCache::Create(bad_preset, backend_.get()).status().code(),
            absl::StatusCode::kNotFound);

  CacheOptions bad_ttl = SmallCacheOptions(4);
  bad_ttl.idle_ttl = absl::ZeroDuration();
  EXPECT_EQ(KvCache::Create(bad_ttl, backend_.get()).status().code(),
            absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(KvCache::Create(SmallCacheOptions(4), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
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
  for (int layer = 0; layer < layout.num_layers(); ++layer)
    bytes_per_token += layout.token_bytes(layer);
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
            5 * (layout.token_bytes(0) + layout.token_bytes(1) + layout.token_bytes(2)) +
                3 * layout.token_bytes(3));

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
  EXPECT_THAT(status.message(),
              HasSubstr("layer 0 holds 7 tokens; an append must start at 7, got 0"));
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
    EXPECT_EQ(AttendOne(*cache, "p", layer, q, 2, &lse_p),
              AttendOne(*cache, "c", layer, q, 2, &lse_c));
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
      Ref(*cache, batch[i].id)
          .Attend(batch[i].layer, batch[i].n, q[i].data(), &want_out, &want_lse);
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
  const size_t row =
      static_cast<size_t>(cache->layout().num_query_heads()) * cache->layout().head_dim();
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
  cases.push_back(
      {"more query tokens than the layer holds", good, absl::StatusCode::kInvalidArgument});
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
  EXPECT_EQ(cache->Score("s", 0, 5, 4, q.data(), logits.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("s", 0, -1, 4, q.data(), logits.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("s", 0, 0, -2, q.data(), logits.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("s", 0, 0, 11, q.data(), logits.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(cache->Score("s", 0, 11, -1, q.data(), logits.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(cache->Score("s", 4, 0, -1, q.data(), logits.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("s", 0, 0, -1, nullptr, logits.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("s", 0, 0, -1, q.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Score("nobody", 0, 0, -1, q.data(), logits.data()).code(),
            absl::StatusCode::kNotFound);
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
}  // namespace tqkv
