// ExportSequence / ImportSequence: a sequence moved to another cache of the
// same layout reads bit for bit as it did, keeps growing the same way, keeps
// its idempotency keys; a malformed image is refused before anything is
// allocated.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache/kv_cache.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/key_centering.h"
#include "tests/cache/cache_test_util.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;
using testing_util::RandomQueries;
using testing_util::RandomTensor;

struct Case {
  const char* name;
  KvLayoutOptions layout;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  cases.push_back({"plain", testing_util::SmallLayout("tqkv_k3v3")});
  KvLayoutOptions centered = testing_util::SmallLayout("turboquant_k3v4_nc");
  centered.key_centering = KeyCentering::kPreRope;
  centered.rope.base = 10000.0;
  centered.exact_sink_tokens = 4;
  centered.exact_recent_tokens = 9;
  cases.push_back({"centered_exact", centered});
  KvLayoutOptions scaled = centered;
  scaled.sequence_key_scales = true;
  cases.push_back({"sequence_key_scales", scaled});
  KvLayoutOptions windowed = testing_util::SmallLayout("turboquant_k3v4_nc");
  windowed.boundary_layers = 0;
  windowed.layer_windows = {10, 0, 10, 10};
  windowed.exact_sink_tokens = 2;
  windowed.exact_recent_tokens = 4;
  cases.push_back({"windowed", windowed});
  return cases;
}

class SequenceImageTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    backend_ = MakeCpuBackend(1);
    a_ = NewCache(256);
    b_ = NewCache(256);
  }

  std::unique_ptr<KvCache> NewCache(int pages) { return NewCache(pages, GetParam().layout); }

  std::unique_ptr<KvCache> NewCache(int pages, const KvLayoutOptions& layout) {
    CacheOptions o;
    o.layout = layout;
    o.memory_budget_bytes = testing_util::PageBytes(o.layout) * pages;
    absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(o, backend_.get());
    EXPECT_TRUE(cache.ok()) << cache.status();
    return cache.ok() ? *std::move(cache) : nullptr;
  }

  absl::Status Append(KvCache& cache, const std::string& id, int64_t start, int64_t n, uint32_t seed,
                      const std::string& request_id = "", AppendOutcome* outcome = nullptr) {
    const int layers = cache.layout().num_layers();
    const std::vector<float> k = RandomTensor(layers, n, cache.layout(), seed);
    const std::vector<float> v = RandomTensor(layers, n, cache.layout(), seed + 1);
    AppendRequest r;
    r.sequence_id = id;
    r.start_position = start;
    r.layer_begin = 0;
    r.layer_end = layers;
    r.num_tokens = n;
    r.keys = k.data();
    r.values = v.data();
    r.request_id = request_id;
    return cache.Append(r, outcome);
  }

  // Attend and Score of every layer, as raw bytes.
  std::string Reads(KvCache& cache, const std::string& id, uint32_t seed) {
    std::string bytes;
    const KvLayout& layout = cache.layout();
    for (int layer = 0; layer < layout.num_layers(); ++layer) {
      const std::vector<float> q = RandomQueries(1, layout, seed + layer);
      std::vector<float> out(q.size()), lse(layout.num_query_heads());
      AttendRequestItem item;
      item.sequence_id = id;
      item.layer = layer;
      item.num_query_tokens = 1;
      item.queries = q.data();
      item.output = out.data();
      item.lse = lse.data();
      const absl::Status attended = cache.Attend({item});
      EXPECT_TRUE(attended.ok()) << attended;
      bytes.append(reinterpret_cast<const char*>(out.data()), out.size() * 4);
      bytes.append(reinterpret_cast<const char*>(lse.data()), lse.size() * 4);
      absl::StatusOr<SequenceInfo> info = cache.GetSequence(id);
      const int64_t begin = info->layer_held_begin[layer], end = info->layer_tokens[layer];
      std::vector<float> logits(static_cast<size_t>(layout.num_query_heads() * (end - begin)));
      const absl::Status scored = cache.Score(id, layer, begin, end, q.data(), logits.data());
      EXPECT_TRUE(scored.ok()) << scored;
      bytes.append(reinterpret_cast<const char*>(logits.data()), logits.size() * 4);
    }
    return bytes;
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<KvCache> a_, b_;
};

TEST_P(SequenceImageTest, AMovedSequenceReadsBitForBitAndKeepsGrowing) {
  ASSERT_TRUE(Append(*a_, "p", 0, 23, 1, "prefill").ok());
  for (int64_t t = 23; t < 30; ++t) ASSERT_TRUE(Append(*a_, "p", t, 1, 100 + t).ok());
  ASSERT_TRUE(a_->Fork("p", "p/child").ok());  // shares every page
  for (int64_t t = 30; t < 33; ++t) ASSERT_TRUE(Append(*a_, "p/child", t, 1, 200 + t, absl::StrCat("c", t)).ok());

  for (const std::string id : {"p", "p/child"}) {
    SCOPED_TRACE(id);
    absl::StatusOr<SequenceImage> image = a_->ExportSequence(id);
    ASSERT_TRUE(image.ok()) << image.status();
    const SequenceInfo before = *a_->GetSequence(id);
    EXPECT_EQ(image->num_pages, before.pages + before.exact_pages);
    EXPECT_EQ(image->pages.size(), image->num_pages * a_->layout().page_bytes());
    ASSERT_TRUE(b_->ImportSequence(*image).ok());
    const SequenceInfo after = *b_->GetSequence(id);
    EXPECT_EQ(after.layer_tokens, before.layer_tokens);
    EXPECT_EQ(after.layer_held_begin, before.layer_held_begin);
    EXPECT_EQ(after.pages, before.pages);
    EXPECT_EQ(after.exact_pages, before.exact_pages);
    EXPECT_EQ(after.stored_bytes, before.stored_bytes);
    EXPECT_TRUE(Reads(*a_, id, 7) == Reads(*b_, id, 7)) << "reads differ after the move";

    // Both grow the same way; a retry of an append the source remembered is
    // already stored at the destination too.
    const int64_t length = before.max_tokens;
    for (int64_t t = length; t < length + 6; ++t) {
      ASSERT_TRUE(Append(*a_, id, t, 1, 300 + t).ok());
      ASSERT_TRUE(Append(*b_, id, t, 1, 300 + t).ok());
    }
    EXPECT_TRUE(Reads(*a_, id, 9) == Reads(*b_, id, 9)) << "reads differ after growing";
    if (id == "p") {
      AppendOutcome outcome;
      ASSERT_TRUE(Append(*b_, id, 0, 23, 1, "prefill", &outcome).ok());
      EXPECT_TRUE(outcome.already_stored);
    }
    // Refused, the sequence already there is untouched.
    const std::string held = Reads(*b_, id, 11);
    const int32_t used = b_->Stats().pages_used;
    EXPECT_EQ(b_->ImportSequence(*image).code(), absl::StatusCode::kAlreadyExists);
    EXPECT_TRUE(Reads(*b_, id, 11) == held);
    EXPECT_EQ(b_->Stats().pages_used, used);
  }
  EXPECT_EQ(a_->ExportSequence("nope").status().code(), absl::StatusCode::kNotFound);

  // A pool too small for the pages refuses the import and changes nothing;
  // the account is charged only for what lands.
  std::unique_ptr<KvCache> small = NewCache(3);
  auto account = std::make_shared<UsageAccount>("tenant 't'", 0, 0);
  absl::StatusOr<SequenceImage> image = a_->ExportSequence("p");
  ASSERT_TRUE(image.ok());
  EXPECT_EQ(small->ImportSequence(*image, account).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small->Stats().pages_used, 0);
  EXPECT_EQ(small->Stats().sequences, 0);
  EXPECT_EQ(account->bytes(), 0u);
  EXPECT_EQ(account->sequences(), 0);
  image->id = "t:p";
  ASSERT_TRUE(b_->ImportSequence(*image, account).ok());
  EXPECT_EQ(account->bytes(), image->num_pages * b_->layout().page_bytes());
  EXPECT_EQ(account->sequences(), 1);
}

TEST_P(SequenceImageTest, AMalformedImageIsRefusedAndChangesNothing) {
  ASSERT_TRUE(Append(*a_, "s", 0, 27, 1).ok());
  absl::StatusOr<SequenceImage> good = a_->ExportSequence("s");
  ASSERT_TRUE(good.ok()) << good.status();
  const auto broken = [&](const char* what, auto mutate) {
    SequenceImage image = *good;
    mutate(image);
    const absl::Status status = b_->ImportSequence(image);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << what << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("does not fit this cache")) << what;
    EXPECT_EQ(b_->Stats().pages_used, 0) << what;
    EXPECT_EQ(b_->Stats().sequences, 0) << what;
  };
  broken("a layer short", [](SequenceImage& i) { i.layer_tokens.pop_back(); });
  broken("a negative length", [](SequenceImage& i) { i.layer_tokens[1] = -1; });
  broken("more tokens than the tables hold", [](SequenceImage& i) { i.layer_tokens[1] += 64; });
  broken("a missing page", [](SequenceImage& i) { i.tables[0].back() = -1; });
  broken("a page named twice", [](SequenceImage& i) { i.tables[0][1] = i.tables[0][0]; });
  broken("a page outside the image", [](SequenceImage& i) { i.tables[0][0] = static_cast<int32_t>(i.num_pages); });
  broken("page bytes cut short", [](SequenceImage& i) { i.pages.pop_back(); });
  broken("an unreferenced page", [](SequenceImage& i) {
    i.pages.resize(i.pages.size() + i.pages.size() / i.num_pages);
    ++i.num_pages;
  });
  broken("a chunk missing", [](SequenceImage& i) { i.tables.pop_back(); });
  broken("a mean of the wrong size", [](SequenceImage& i) { i.key_means[1].push_back(1.0f); });
  if (a_->layout().has_exact_tokens()) {
    broken("a missing exact page", [](SequenceImage& i) {
      for (std::vector<int32_t>& t : i.exact_tables) {
        if (!t.empty()) t.back() = -1;
      }
    });
  }
  if (a_->layout().key_centering() != KeyCentering::kNone) {
    broken("a missing mean", [](SequenceImage& i) { i.key_means[1].clear(); });
  }
  if (a_->layout().sequence_key_scales()) {
    broken("a sequence key scale of 0", [](SequenceImage& i) { i.key_means[1].back() = 0.0f; });
    broken("half the scales", [](SequenceImage& i) { i.key_means[1].resize(i.key_means[1].size() * 3 / 4); });
  }
  ASSERT_TRUE(b_->ImportSequence(*good).ok());
}

// Sequence key scales are per-sequence state: a sequence stored without
// them (an older server, or a cache without the option) moves into a cache
// that keeps them and reads as it did, with scales 1, also after more
// appends; a sequence carrying them does not fit a cache without them.
TEST_P(SequenceImageTest, SequencesWithoutKeyScalesMoveIntoACacheThatKeepsThem) {
  if (GetParam().layout.key_centering.value_or(KeyCentering::kNone) == KeyCentering::kNone) GTEST_SKIP();
  KvLayoutOptions plain = GetParam().layout, scaled = GetParam().layout;
  plain.sequence_key_scales = false;
  scaled.sequence_key_scales = true;
  std::unique_ptr<KvCache> from = NewCache(256, plain), to = NewCache(256, scaled);
  ASSERT_TRUE(Append(*from, "s", 0, 27, 1).ok());
  absl::StatusOr<SequenceImage> image = from->ExportSequence("s");
  ASSERT_TRUE(image.ok()) << image.status();
  ASSERT_TRUE(to->ImportSequence(*image).ok());
  EXPECT_TRUE(Reads(*to, "s", 5) == Reads(*from, "s", 5));
  ASSERT_TRUE(Append(*from, "s", 27, 9, 2).ok());
  ASSERT_TRUE(Append(*to, "s", 27, 9, 2).ok());
  EXPECT_TRUE(Reads(*to, "s", 6) == Reads(*from, "s", 6));
  // Measured scales store the same keys differently, and do not fit the
  // plain cache.
  ASSERT_TRUE(Append(*to, "fresh", 0, 27, 1).ok());
  ASSERT_TRUE(Append(*from, "fresh", 0, 27, 1).ok());
  EXPECT_FALSE(Reads(*to, "fresh", 5) == Reads(*from, "fresh", 5));
  ASSERT_TRUE(from->Drop("fresh").ok());
  absl::StatusOr<SequenceImage> carried = to->ExportSequence("fresh");
  ASSERT_TRUE(carried.ok()) << carried.status();
  EXPECT_EQ(from->ImportSequence(*carried).code(), absl::StatusCode::kInvalidArgument);
}

// Streaming ends: an export pins its pages while the sequence goes on
// growing (and outlives a drop); an import not committed gives its pages,
// its account charge and its id back.
TEST_P(SequenceImageTest, ExportsPinAndUncommittedImportsGiveEverythingBack) {
  ASSERT_TRUE(Append(*a_, "s", 0, 13, 1).ok());
  const std::string before = Reads(*a_, "s", 3);
  absl::StatusOr<std::unique_ptr<SequenceExport>> e = a_->BeginExport("s");
  ASSERT_TRUE(e.ok()) << e.status();
  SequenceImage image = (*e)->state();
  for (int64_t t = 13; t < 30; ++t) ASSERT_TRUE(Append(*a_, "s", t, 1, 50 + t).ok());
  ASSERT_TRUE(a_->Drop("s").ok());
  image.pages.resize(image.num_pages * a_->layout().page_bytes());
  ASSERT_TRUE((*e)->ReadPages(0, image.num_pages, image.pages.data()).ok());
  EXPECT_EQ((*e)->ReadPages(image.num_pages, 1, image.pages.data()).code(), absl::StatusCode::kInvalidArgument);
  e->reset();
  EXPECT_EQ(a_->Stats().pages_used, 0);  // the drop's pages went back with the export
  ASSERT_TRUE(b_->ImportSequence(image).ok());
  EXPECT_TRUE(Reads(*b_, "s", 3) == before) << "the export is the state it began with";

  auto account = std::make_shared<UsageAccount>("tenant 't'", 0, 0);
  image.id = "t:s";
  {
    absl::StatusOr<std::unique_ptr<SequenceImport>> import = b_->BeginImport(image, account);
    ASSERT_TRUE(import.ok()) << import.status();
    EXPECT_EQ(b_->GetSequence("t:s").status().code(), absl::StatusCode::kNotFound);  // invisible until committed
    EXPECT_GT(account->bytes(), 0u);
    ASSERT_TRUE((*import)->WritePages(0, 1, image.pages.data()).ok());
  }  // abandoned
  EXPECT_EQ(account->bytes(), 0u);
  EXPECT_EQ(account->sequences(), 0);
  EXPECT_EQ(b_->ListSequences(), std::vector<std::string>{"s"});
  ASSERT_TRUE(b_->ImportSequence(image, account).ok());
  EXPECT_TRUE(Reads(*b_, "t:s", 3) == before);
}

// A stream of several sequences carries a page they share once, and the
// import shares it again: forks move in the pages they held.
TEST_P(SequenceImageTest, ForksMoveInThePagesTheyHeld) {
  ASSERT_TRUE(Append(*a_, "p", 0, 41, 1).ok());
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(a_->Fork("p", absl::StrCat("p/", i)).ok());
  ASSERT_TRUE(Append(*a_, "p/0", 41, 3, 2).ok());  // one fork copies its last page
  const int32_t used = a_->Stats().pages_used;
  const int32_t parent_pages = a_->GetSequence("p")->pages + a_->GetSequence("p")->exact_pages;
  ASSERT_LT(used, 2 * parent_pages);
  // Room for the pages as they are shared (and an append's), not for one
  // more copy of the parent.
  const int32_t slack = parent_pages / 2;
  std::unique_ptr<KvCache> c = NewCache(used + slack);
  int64_t carried = 0;
  {
    ExportSharing out(a_.get());
    ImportSharing in(c.get());
    for (const std::string& id : a_->ListSequences()) {
      absl::StatusOr<std::unique_ptr<SequenceExport>> e = a_->BeginExport(id, &out);
      ASSERT_TRUE(e.ok()) << e.status();
      const SequenceImage& state = (*e)->state();
      std::vector<uint8_t> pages(state.carried_pages() * a_->layout().page_bytes());
      ASSERT_TRUE((*e)->ReadPages(0, state.carried_pages(), pages.data()).ok());
      carried += state.carried_pages();
      // Outside the stream, a shared page cannot be resolved.
      if (!state.shared_pages.empty()) {
        EXPECT_EQ(b_->BeginImport(state).status().code(), absl::StatusCode::kInvalidArgument);
      }
      absl::StatusOr<std::unique_ptr<SequenceImport>> import = c->BeginImport(state, nullptr, &in);
      ASSERT_TRUE(import.ok()) << id << ": " << import.status();
      ASSERT_TRUE((*import)->WritePages(0, (*import)->num_pages(), pages.data()).ok());
      ASSERT_TRUE((*import)->Commit().ok());
    }
    EXPECT_EQ(out.carried_pages(), carried);
  }
  EXPECT_EQ(carried, used);
  EXPECT_EQ(c->Stats().pages_used, used);
  EXPECT_EQ(a_->Stats().pages_used, used);  // the export's references went back
  EXPECT_EQ(c->Stats().stored_bytes, a_->Stats().stored_bytes);
  for (const std::string id : {"p", "p/0", "p/39"}) EXPECT_TRUE(Reads(*a_, id, 5) == Reads(*c, id, 5)) << id;
  // Shared again: an append into a fork's shared last page copies it, and
  // its siblings read as before.
  const std::string sibling = Reads(*c, "p/1", 6);
  const uint64_t copies = a_->Stats().copy_on_writes;
  const absl::Status appended = Append(*c, "p/2", 41, 2, 9);
  ASSERT_TRUE(appended.ok()) << appended;
  ASSERT_TRUE(Append(*a_, "p/2", 41, 2, 9).ok());
  EXPECT_TRUE(Reads(*c, "p/1", 6) == sibling);
  EXPECT_TRUE(Reads(*c, "p/2", 6) == Reads(*a_, "p/2", 6));
  EXPECT_GT(c->Stats().copy_on_writes, 0u);
  EXPECT_EQ(c->Stats().copy_on_writes, a_->Stats().copy_on_writes - copies);
}

INSTANTIATE_TEST_SUITE_P(Layouts, SequenceImageTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tqkv

namespace tqkv {
namespace {

// The states the exact-token checks used to refuse (an empty range of exact
// tokens asked for a page): every length of a sequence with exact sinks and
// a sliding window longer than the exact recent tokens, decoded token by token, and
// of one with exact sinks and no exact recent tokens, exports and imports.
class ExactStatesTest : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(ExactStatesTest, EveryLengthMovesAndReadsAsBefore) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  KvLayoutOptions layout = testing_util::SmallLayout("turboquant_k3v4_nc");
  layout.boundary_layers = 0;
  layout.key_centering = KeyCentering::kPreRope;
  layout.rope.base = 10000.0;
  layout.exact_sink_tokens = 4;
  layout.exact_recent_tokens = GetParam().empty() ? 0 : 8;
  layout.layer_windows = GetParam();
  CacheOptions options;
  options.layout = layout;
  options.memory_budget_bytes = testing_util::PageBytes(layout) * 400;
  std::unique_ptr<KvCache> a = *KvCache::Create(options, backend.get());
  const KvLayout& l = a->layout();
  for (int64_t length = 1; length <= 60; ++length) {
    SCOPED_TRACE(length);
    const std::vector<float> k = testing_util::RandomTensor(l.num_layers(), 1, l, 10 + length);
    const std::vector<float> v = testing_util::RandomTensor(l.num_layers(), 1, l, 500 + length);
    AppendRequest r;
    r.sequence_id = "s";
    r.start_position = length - 1;
    r.layer_end = l.num_layers();
    r.num_tokens = 1;
    r.keys = k.data();
    r.values = v.data();
    ASSERT_TRUE(a->Append(r).ok());
    absl::StatusOr<SequenceImage> image = a->ExportSequence("s");
    ASSERT_TRUE(image.ok()) << image.status();
    std::unique_ptr<KvCache> b = *KvCache::Create(options, backend.get());
    const absl::Status imported = b->ImportSequence(*image);
    ASSERT_TRUE(imported.ok()) << imported;
    for (int layer = 0; layer < l.num_layers(); ++layer) {
      const std::vector<float> q = testing_util::RandomQueries(1, l, layer);
      std::vector<float> out_a(q.size()), out_b(q.size());
      AttendRequestItem item{"s", layer, 1, q.data(), out_a.data(), nullptr};
      ASSERT_TRUE(a->Attend({item}).ok());
      item.output = out_b.data();
      ASSERT_TRUE(b->Attend({item}).ok());
      EXPECT_EQ(std::memcmp(out_a.data(), out_b.data(), out_a.size() * 4), 0) << "layer " << layer;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Windows, ExactStatesTest,
                         ::testing::Values(std::vector<int>{}, std::vector<int>{0, 20, 20, 0},
                                           std::vector<int>{20, 20, 20, 20}, std::vector<int>{0, 5, 0, 5}),
                         [](const ::testing::TestParamInfo<std::vector<int>>& info) {
                           return info.param.empty() ? std::string("sinks_only")
                                                     : absl::StrCat("windows_", absl::StrJoin(info.param, "_"));
                         });

}  // namespace
}  // namespace tqkv
