// Writers, readers, forks and drops on one cache at once. Every token's data
// is fixed in advance, so whatever prefix a reader sees can be checked
// exactly against the float64 reference, while it is being written.
#include <atomic>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/cache/cache_test_util.h"

namespace tqkv {
namespace {

using testing_util::CountMismatches;
using testing_util::RandomQueries;
using testing_util::RandomTensor;
using testing_util::ReferenceSequence;
using testing_util::SmallCacheOptions;

constexpr int kLayers = 4;
constexpr int64_t kTokens = 192;   // per sequence and layer, in the end
constexpr int kOwnWriters = 8;     // one sequence each
constexpr int kRacingWriters = 2;  // all on one sequence
constexpr int kReaders = 4;
constexpr int kMinReads = 20;  // per reader

// The whole future content of one sequence: [layers, kTokens, heads, dim].
struct Script {
  std::string id;
  std::vector<float> keys;
  std::vector<float> values;
  std::unique_ptr<ReferenceSequence> ref;
};

// keys/values of tokens [start, start + n) of layers [begin, end), packed as
// an AppendRequest wants them.
void Slice(const KvLayout& layout, const std::vector<float>& full, int begin, int end, int64_t start, int64_t n,
           std::vector<float>* out) {
  const size_t row = static_cast<size_t>(layout.num_kv_heads()) * layout.head_dim();
  out->clear();
  for (int layer = begin; layer < end; ++layer) {
    const float* from = full.data() + (static_cast<size_t>(layer) * kTokens + start) * row;
    out->insert(out->end(), from, from + n * row);
  }
}

// Appends script's tokens [start, start + n) of layers [begin, end) to `id`.
absl::Status AppendSlice(KvCache& cache, const std::string& id, const Script& script, int begin, int end, int64_t start,
                         int64_t n, bool poison = false) {
  std::vector<float> keys, values;
  Slice(cache.layout(), script.keys, begin, end, start, n, &keys);
  Slice(cache.layout(), script.values, begin, end, start, n, &values);
  if (poison) values.back() = std::nanf("");
  AppendRequest request;
  request.sequence_id = id;
  request.start_position = start;
  request.layer_begin = begin;
  request.layer_end = end;
  request.num_tokens = n;
  request.keys = keys.data();
  request.values = values.data();
  return cache.Append(request);
}

// Scores every token a reader sees now and compares with the reference.
// Returns false (after reporting) on a mismatch.
bool CheckVisiblePrefix(KvCache& cache, const Script& script, int layer, int64_t tokens, const std::vector<float>& q) {
  if (tokens == 0) return true;
  std::vector<float> logits(cache.layout().num_query_heads() * tokens);
  const absl::Status status = cache.Score(script.id, layer, 0, tokens, q.data(), logits.data());
  if (!status.ok()) {
    ADD_FAILURE() << "Score " << script.id << " layer " << layer << ": " << status;
    return false;
  }
  return CountMismatches(logits.data(), script.ref->Score(layer, 0, tokens, q.data()), 1e-4, script.id + " logits") ==
         0;
}

TEST(KvCacheConcurrencyTest, ReadersSeeExactPrefixesWhileWritersAppendForkAndDrop) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  absl::StatusOr<std::unique_ptr<KvCache>> created = KvCache::Create(SmallCacheOptions(1024), backend.get());
  ASSERT_TRUE(created.ok()) << created.status();
  KvCache& cache = **created;
  const KvLayout& layout = cache.layout();

  std::vector<Script> scripts(kOwnWriters + 1);
  for (size_t i = 0; i < scripts.size(); ++i) {
    Script& s = scripts[i];
    s.id = i < kOwnWriters ? absl::StrCat("w", i) : "shared";
    s.keys = RandomTensor(kLayers, kTokens, layout, 100 + 2 * i);
    s.values = RandomTensor(kLayers, kTokens, layout, 101 + 2 * i);
    s.ref = std::make_unique<ReferenceSequence>(&layout);
    s.ref->Append(0, kLayers, kTokens, s.keys.data(), s.values.data());
  }
  const Script& shared = scripts[kOwnWriters];

  std::atomic<int> writers_left{kOwnWriters + kRacingWriters};
  std::atomic<bool> failed{false};
  std::atomic<int64_t> checked_reads{0};
  std::atomic<int64_t> forks{0};
  auto expect = [&](const absl::Status& status, absl::StatusCode want, const std::string& what) {
    if (status.code() != want) {
      failed = true;
      ADD_FAILURE() << what << ": got " << status << ", want " << absl::StatusCodeToString(want);
    }
  };

  // Every thread starts work together, and writers pace themselves, so that
  // reads and forks overlap the appends even on two cores. What the test
  // asserts happened does not depend on that overlap: writer 0 stops with a
  // partly filled last page until the fork thread has forked it and appended
  // to the fork (a copy-on-write of a page the parent is still filling), and
  // every reader reads kMinReads times however soon the writers finish.
  absl::Notification parent_paused, fork_done;
  std::atomic<bool> parent_held{false};
  const int num_threads = kOwnWriters + kRacingWriters + kReaders + 1;
  std::atomic<int> started{0};
  auto start_together = [&] {
    ++started;
    while (started < num_threads) std::this_thread::yield();
  };
  auto pace = [] { absl::SleepFor(absl::Microseconds(200)); };
  std::vector<std::thread> threads;
  // Each own writer: random chunks, all layers at once (even ones) or layer by
  // layer (odd ones), with poisoned and retried appends mixed in.
  for (int w = 0; w < kOwnWriters; ++w) {
    threads.emplace_back([&, w] {
      const Script& s = scripts[w];
      std::mt19937 rng(w);
      start_together();
      if (w % 4 == 0) expect(cache.CreateSequence(s.id), absl::StatusCode::kOk, "create");
      int64_t done = 0, last_chunk = 0;
      while (done < kTokens && !failed) {
        const int64_t n = std::min<int64_t>(1 + rng() % 7, kTokens - done);
        const unsigned dice = rng() % 8;
        if (dice == 0) {
          expect(AppendSlice(cache, s.id, s, 0, kLayers, done, n, /*poison=*/true), absl::StatusCode::kInvalidArgument,
                 s.id + " poisoned append");
        } else if (dice == 1 && last_chunk > 0) {
          expect(AppendSlice(cache, s.id, s, 0, kLayers, done - last_chunk, last_chunk),
                 absl::StatusCode::kFailedPrecondition, s.id + " retried append");
        }
        if (w % 2 == 0) {
          expect(AppendSlice(cache, s.id, s, 0, kLayers, done, n), absl::StatusCode::kOk, s.id);
        } else {
          for (int layer = 0; layer < kLayers; ++layer) {
            expect(AppendSlice(cache, s.id, s, layer, layer + 1, done, n), absl::StatusCode::kOk, s.id);
          }
        }
        done += n;
        last_chunk = n;
        if (w == 0 && !parent_held && done % layout.page_tokens() != 0 && !failed) {
          parent_held = true;
          parent_paused.Notify();
          fork_done.WaitForNotification();
        }
        pace();
      }
      // Only the parent's writer notifies: two writers checking then notifying could both do it.
      if (w == 0 && !parent_held) parent_paused.Notify();
      --writers_left;
    });
  }
  // Racing writers: both append the same (fixed) data to one sequence at
  // whatever position they last saw; the loser of each race is told where
  // the sequence stands.
  for (int w = 0; w < kRacingWriters; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937 rng(1000 + w);
      start_together();
      while (!failed) {
        absl::StatusOr<SequenceInfo> info = cache.GetSequence(shared.id);
        const int64_t at = info.ok() ? info->layer_tokens[0] : 0;
        if (at >= kTokens) break;
        const int64_t n = std::min<int64_t>(1 + rng() % 5, kTokens - at);
        const absl::Status status = AppendSlice(cache, shared.id, shared, 0, kLayers, at, n);
        if (!status.ok() && status.code() != absl::StatusCode::kFailedPrecondition) {
          expect(status, absl::StatusCode::kOk, "racing append");
        }
        pace();
      }
      --writers_left;
    });
  }
  // Readers: Attend (finite outputs) and Score (exact prefix) on whatever
  // the writers have published; forks come and go under them.
  for (int r = 0; r < kReaders; ++r) {
    threads.emplace_back([&, r] {
      std::mt19937 rng(2000 + r);
      start_together();
      const int qh = layout.num_query_heads(), d = layout.head_dim();
      for (int reads = 0; (writers_left > 0 || reads < kMinReads) && !failed; ++reads) {
        const bool fork = rng() % 4 == 0;
        const Script& s = scripts[rng() % scripts.size()];
        const std::string id = fork ? "fork" : s.id;
        const int layer = rng() % kLayers;
        absl::StatusOr<SequenceInfo> info = cache.GetSequence(id);
        if (!info.ok()) {
          expect(info.status(), absl::StatusCode::kNotFound, "GetSequence " + id);
          continue;
        }
        const int64_t tokens = info->layer_tokens[layer];
        if (tokens == 0) continue;
        const int n = static_cast<int>(std::min<int64_t>(tokens, 1 + rng() % 3));
        const std::vector<float> q = RandomQueries(n, layout, rng());
        std::vector<float> out(q.size(), NAN), lse(static_cast<size_t>(n) * qh, NAN);
        AttendRequestItem item;
        item.sequence_id = id;
        item.layer = layer;
        item.num_query_tokens = n;
        item.queries = q.data();
        item.output = out.data();
        item.lse = lse.data();
        const absl::Status status = cache.Attend({item});
        // The fork may be dropped, or re-forked from a shorter parent, meanwhile.
        if (fork &&
            (status.code() == absl::StatusCode::kNotFound || status.code() == absl::StatusCode::kInvalidArgument)) {
          continue;
        }
        expect(status, absl::StatusCode::kOk, "Attend " + id);
        for (size_t i = 0; i < out.size(); ++i) {
          if (!std::isfinite(out[i])) {
            failed = true;
            ADD_FAILURE() << "Attend " << id << " output[" << i << "] = " << out[i];
            break;
          }
        }
        if (!fork) {
          if (!CheckVisiblePrefix(cache, s, layer, tokens, std::vector<float>(q.begin(), q.begin() + qh * d))) {
            failed = true;
          }
          ++checked_reads;
        }
      }
    });
  }
  // Fork churn: fork a growing sequence, append to the fork (copy-on-write of
  // a page the parent is still filling), drop it while readers may hold it.
  threads.emplace_back([&] {
    std::mt19937 rng(3000);
    start_together();
    parent_paused.WaitForNotification();
    if (parent_held) {
      expect(cache.Fork(scripts[0].id, "fork"), absl::StatusCode::kOk, "Fork of the held parent");
      absl::StatusOr<SequenceInfo> info = cache.GetSequence("fork");
      expect(info.status(), absl::StatusCode::kOk, "GetSequence fork");
      if (info.ok()) {
        expect(AppendSlice(cache, "fork", scripts[0], 0, 1, info->layer_tokens[0], 1), absl::StatusCode::kOk,
               "append to the fork of the held parent");
      }
      if (cache.Stats().copy_on_writes == 0) {
        failed = true;
        ADD_FAILURE() << "an append into a shared, partly filled page made no copy";
      }
      expect(cache.Drop("fork"), absl::StatusCode::kOk, "Drop fork");
      ++forks;
    }
    fork_done.Notify();
    while (writers_left > 0 && !failed) {
      const Script& parent = scripts[rng() % kOwnWriters];
      const absl::Status forked = cache.Fork(parent.id, "fork");
      if (forked.code() == absl::StatusCode::kNotFound) continue;  // not created yet
      expect(forked, absl::StatusCode::kOk, "Fork");
      ++forks;
      if (!forked.ok()) break;
      absl::StatusOr<SequenceInfo> info = cache.GetSequence("fork");
      expect(info.status(), absl::StatusCode::kOk, "GetSequence fork");
      // The parent's next tokens (any finite data would do) into layer 0.
      const int64_t at = info.ok() ? info->layer_tokens[0] : kTokens;
      const int64_t n = std::min<int64_t>(2, kTokens - at);
      if (n > 0) {
        expect(AppendSlice(cache, "fork", parent, 0, 1, at, n), absl::StatusCode::kOk, "append to fork");
      }
      expect(cache.Drop("fork"), absl::StatusCode::kOk, "Drop fork");
    }
  });
  for (std::thread& t : threads) t.join();
  ASSERT_FALSE(failed);
  EXPECT_GT(checked_reads.load(), 0);
  EXPECT_GT(forks.load(), 0);
  EXPECT_GT(cache.Stats().copy_on_writes, 0u);

  // Every token reads back exactly.
  for (const Script& s : scripts) {
    absl::StatusOr<SequenceInfo> info = cache.GetSequence(s.id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->layer_tokens, std::vector<int64_t>(kLayers, kTokens)) << s.id;
    for (int layer = 0; layer < kLayers; ++layer) {
      const std::vector<float> q = RandomQueries(2, layout, 77 + layer);
      EXPECT_TRUE(CheckVisiblePrefix(cache, s, layer, kTokens, q)) << s.id;
      std::vector<float> out(q.size()), lse(2 * layout.num_query_heads());
      AttendRequestItem item;
      item.sequence_id = s.id;
      item.layer = layer;
      item.num_query_tokens = 2;
      item.queries = q.data();
      item.output = out.data();
      item.lse = lse.data();
      ASSERT_TRUE(cache.Attend({item}).ok());
      std::vector<double> want, want_lse;
      s.ref->Attend(layer, 2, q.data(), &want, &want_lse);
      EXPECT_EQ(CountMismatches(out.data(), want, 1e-4, s.id + " output"), 0) << layer;
      EXPECT_EQ(CountMismatches(lse.data(), want_lse, 1e-4, s.id + " lse"), 0) << layer;
    }
  }
  const CacheStats stats = cache.Stats();
  EXPECT_EQ(stats.sequences, kOwnWriters + 1);
  EXPECT_EQ(stats.tokens, (kOwnWriters + 1) * kTokens);
  EXPECT_EQ(stats.pages_used, (kOwnWriters + 1) * (kTokens / layout.page_tokens()));
}

// Several threads append the same chunks to one sequence, each at the
// position it last saw: the cache serializes them, so each position is stored
// once and the losers learn (FAILED_PRECONDITION) where the sequence stands.
TEST(KvCacheConcurrencyTest, AppendsToOneSequenceAreSerialized) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  testing_util::GatedBackend slow(cpu.get());
  slow.set_store_delay(absl::Microseconds(300));
  absl::StatusOr<std::unique_ptr<KvCache>> created = KvCache::Create(SmallCacheOptions(64), &slow);
  ASSERT_TRUE(created.ok()) << created.status();
  KvCache& cache = **created;
  const KvLayout& layout = cache.layout();
  constexpr int64_t kTotal = 48;
  Script script;
  script.id = "s";
  script.keys = RandomTensor(kLayers, kTokens, layout, 5);
  script.values = RandomTensor(kLayers, kTokens, layout, 6);
  script.ref = std::make_unique<ReferenceSequence>(&layout);
  script.ref->Append(0, kLayers, kTokens, script.keys.data(), script.values.data());

  std::atomic<int64_t> stored{0};
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      ++ready;
      while (ready < 4) std::this_thread::yield();
      while (true) {
        absl::StatusOr<SequenceInfo> info = cache.GetSequence("s");
        const int64_t at = info.ok() ? info->layer_tokens[0] : 0;
        if (at >= kTotal) break;
        const int64_t n = std::min<int64_t>(1 + at % 3, kTotal - at);  // same chunk for everyone
        const absl::Status status = AppendSlice(cache, "s", script, 0, kLayers, at, n);
        if (status.ok()) {
          stored += n;
        } else if (status.code() != absl::StatusCode::kFailedPrecondition) {
          ADD_FAILURE() << status;
          break;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(stored.load(), kTotal);
  absl::StatusOr<SequenceInfo> info = cache.GetSequence("s");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layer_tokens, std::vector<int64_t>(kLayers, kTotal));
  EXPECT_EQ(cache.Stats().pages_used, kTotal / layout.page_tokens());
  EXPECT_EQ(cache.Stats().tokens, kTotal);
  const std::vector<float> q = RandomQueries(1, layout, 9);
  for (int layer = 0; layer < kLayers; ++layer) {
    EXPECT_TRUE(CheckVisiblePrefix(cache, script, layer, kTotal, q));
  }
}

}  // namespace
}  // namespace tqkv
