// KvCacheTest, shared by kv_cache_test.cc (sequences, appends, eviction,
// accounts) and kv_cache_read_test.cc (forks, attention, scores, pinned
// pages): a small cache on the CPU backend, with snapshots of what a caller
// can observe for all-or-nothing checks.
#ifndef TQKV_TESTS_CACHE_KV_CACHE_FIXTURE_H_
#define TQKV_TESTS_CACHE_KV_CACHE_FIXTURE_H_

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
namespace cache_test {

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

inline Snapshot Take(KvCache& cache) {
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

inline void ExpectSame(const Snapshot& before, const Snapshot& after) {
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
  absl::Status AppendRandom(KvCache& cache, const std::string& id, int64_t start, int begin, int end, int64_t n,
                            std::shared_ptr<UsageAccount> account = nullptr) {
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
  std::vector<float> AttendOne(KvCache& cache, const std::string& id, int layer, const std::vector<float>& queries,
                               int num_query_tokens, std::vector<float>* lse = nullptr) {
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
      EXPECT_EQ(CountMismatches(got.data(), want_out, 1e-4, id + " output"), 0) << "layer " << layer;
      EXPECT_EQ(CountMismatches(lse.data(), want_lse, 1e-4, id + " lse"), 0) << "layer " << layer;
    }
  }

  std::unique_ptr<Backend> backend_;
  std::map<std::string, ReferenceSequence> refs_;
  uint32_t seed_ = 1;
};

}  // namespace cache_test
}  // namespace tqkv

#endif  // TQKV_TESTS_CACHE_KV_CACHE_FIXTURE_H_
