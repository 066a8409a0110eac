// The round-trip property (round_trip_property.h) on KvCaches in process,
// moved through ExportSharing / ImportSharing: random layouts x random
// operation sequences, in lockstep with an unmoved twin.
//
// The suite runs a bounded slice (kSliceRuns runs). The long run draws runs
// until TQKV_ROUND_TRIP_SECONDS have passed:
//   TQKV_ROUND_TRIP_SECONDS=1200 build/bin/round_trip_property_test
// TQKV_ROUND_TRIP_SEED=<n> repeats run n alone (a failure names its seed).
#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/cache/round_trip_property.h"

namespace tqkv {
namespace {

constexpr int kSliceRuns = 40;
constexpr int kStepsPerRun = 70;

// One run: a random layout the cache accepts, a pool of random size, with or
// without LRU eviction. Returns false on a difference.
struct Totals {
  int runs = 0, failed = 0, round_trips = 0, appends = 0, appends_stored = 0;
};

bool RunOne(uint64_t seed, Backend* backend, Totals* totals) {
  std::mt19937_64 rng(seed);
  std::shared_ptr<const KvLayout> layout;
  const CacheOptions options = round_trip::RandomCacheOptions(rng, &layout);
  absl::StatusOr<std::unique_ptr<round_trip::CacheTarget>> a = round_trip::CacheTarget::Create(options, backend);
  absl::StatusOr<std::unique_ptr<round_trip::CacheTarget>> b = round_trip::CacheTarget::Create(options, backend);
  EXPECT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  if (!a.ok() || !b.ok()) return false;
  SCOPED_TRACE(testing::Message() << "seed " << seed << ": preset " << options.layout.preset << ", "
                                  << options.layout.num_layers << " layers, page_tokens " << options.layout.page_tokens
                                  << ", sinks " << layout->options().exact_sink_tokens << ", exact recent "
                                  << layout->options().exact_recent_tokens << ", windows ["
                                  << absl::StrJoin(options.layout.layer_windows, " ") << "], evict "
                                  << options.evict_lru);
  round_trip::Lockstep run(*layout, a->get(), b->get(), seed * 7919 + 1, options.evict_lru);
  const bool ok = run.Run(kStepsPerRun);
  ++totals->runs;
  totals->failed += !ok;
  totals->round_trips += run.round_trips();
  totals->appends += run.appends();
  totals->appends_stored += run.appends_stored();
  return ok;
}

TEST(RoundTripProperty, EveryStateSurvivesMovesBitForBitWithItsSharing) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  Totals t;
  if (const char* seed = std::getenv("TQKV_ROUND_TRIP_SEED")) {
    EXPECT_TRUE(RunOne(std::strtoull(seed, nullptr, 10), backend.get(), &t));
    return;
  }
  const char* seconds = std::getenv("TQKV_ROUND_TRIP_SECONDS");
  const absl::Time until = absl::Now() + absl::Seconds(seconds == nullptr ? 0 : std::atof(seconds));
  for (uint64_t seed = 1; (t.runs < kSliceRuns || absl::Now() < until) && t.failed < 3; ++seed) {
    RunOne(seed, backend.get(), &t);
  }
  std::printf("round trip property: %d runs, %d round trips, %d of %d appends stored, %d runs failed\n", t.runs,
              t.round_trips, t.appends_stored, t.appends, t.failed);
  // The slice does move things, and most appends land.
  EXPECT_GT(t.round_trips, t.runs);
  EXPECT_GT(t.appends_stored, t.appends / 2);
}

}  // namespace
}  // namespace tqkv
