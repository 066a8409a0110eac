// AppendBatch and AppendAttend: a batch does what its requests would do one
// by one (Append, then Attend), bit for bit, each request all-or-nothing on
// its own, in one backend Store (and one StoreAndAttend) per layer range.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/forwarding_backend.h"
#include "tests/cache/cache_test_util.h"

namespace tqkv {
namespace {

using testing_util::RandomQueries;
using testing_util::RandomTensor;

// Counts the calls the cache makes.
class CountingBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Store(const StoreParams& p) override {
    ++stores;
    return inner().Store(p);
  }
  absl::Status Attend(const AttendParams& p) override {
    ++attends;
    return inner().Attend(p);
  }
  absl::Status StoreAndAttend(const StoreParams& s, const AttendParams& a) override {
    ++store_and_attends;
    return inner().StoreAndAttend(s, a);
  }
  int stores = 0, attends = 0, store_and_attends = 0;
};

struct Case {
  const char* name;
  KvLayoutOptions layout;
};

std::vector<Case> Cases() {
  KvLayoutOptions recipe = testing_util::SmallLayout("turboquant_k3v4_nc");
  recipe.key_centering = KeyCentering::kPreRope;
  recipe.rope.base = 10000.0;
  recipe.exact_sink_tokens = 4;
  recipe.exact_recent_tokens = 6;
  KvLayoutOptions windowed = recipe;
  windowed.boundary_layers = 0;
  windowed.layer_windows = {9, 0, 9, 0};
  return {{"plain", testing_util::SmallLayout("tqkv_k3v3")}, {"recipe", recipe}, {"windowed", windowed}};
}

class AppendBatchTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    auto counting = std::make_unique<CountingBackend>(MakeCpuBackend(1));
    counter_ = counting.get();
    backend_ = std::move(counting);
    CacheOptions o;
    o.layout = GetParam().layout;
    o.memory_budget_bytes = testing_util::PageBytes(o.layout) * 512;
    one_by_one_ = *KvCache::Create(o, backend_.get());
    batched_ = *KvCache::Create(o, backend_.get());
  }

  // Request i of a step: 1..3 tokens of `layers` (a prefill) or one layer.
  AppendRequest Request(const KvCache& cache, const std::string& id, int64_t start, int64_t n, int begin, int end,
                        uint32_t seed) {
    data_.push_back(RandomTensor(end - begin, n, cache.layout(), seed));
    data_.push_back(RandomTensor(end - begin, n, cache.layout(), seed + 7));
    AppendRequest r;
    r.sequence_id = id;
    r.start_position = start;
    r.layer_begin = begin;
    r.layer_end = end;
    r.num_tokens = n;
    r.keys = data_[data_.size() - 2].data();
    r.values = data_.back().data();
    return r;
  }

  std::unique_ptr<Backend> backend_;
  CountingBackend* counter_ = nullptr;
  std::unique_ptr<KvCache> one_by_one_, batched_;
  std::vector<std::vector<float>> data_;
};

TEST_P(AppendBatchTest, ADecodeLayerIsWhatItsItemsDoOneByOneInOneBackendCall) {
  const KvLayout& layout = batched_->layout();
  // Six sequences: four prefilled to various lengths, two new.
  for (KvCache* cache : {one_by_one_.get(), batched_.get()}) {
    for (int s = 0; s < 4; ++s) {
      ASSERT_TRUE(cache->Append(Request(*cache, absl::StrCat("s", s), 0, 3 + 5 * s, 0, 4, 10 + s)).ok());
    }
  }
  for (int step = 0; step < 12; ++step) {
    for (int layer = 0; layer < layout.num_layers(); ++layer) {
      SCOPED_TRACE(absl::StrCat("step ", step, " layer ", layer));
      std::vector<AppendRequest> appends;
      for (int s = 0; s < 6; ++s) {
        const std::string id = absl::StrCat("s", s);
        const int64_t length = s < 4 ? 3 + 5 * s : 0;
        const int64_t n = step == 0 && s >= 4 ? 2 : 1;  // the new ones start with two tokens
        const int64_t start = s < 4 ? length + step : (step == 0 ? 0 : step + 1);
        appends.push_back(Request(*batched_, id, start, n, layer, layer + 1, 1000 * step + 10 * layer + s));
      }
      // One item at a wrong position, one retried: their own statuses.
      appends[1].start_position += 1;
      appends[2].request_id = absl::StrCat("r", step, "-", layer);
      std::vector<std::vector<float>> q(appends.size()), out_a(appends.size()), out_b(appends.size());
      std::vector<AttendRequestItem> attends(appends.size());
      for (size_t i = 0; i < appends.size(); ++i) {
        q[i] = RandomQueries(static_cast<int>(appends[i].num_tokens), layout, 77 * step + i);
        out_a[i].assign(q[i].size(), 0.0f);
        out_b[i].assign(q[i].size(), 0.0f);
        attends[i] = {appends[i].sequence_id, layer,  static_cast<int>(appends[i].num_tokens), q[i].data(),
                      out_b[i].data(),        nullptr};
      }
      // One by one: Append, then Attend of what landed.
      std::vector<absl::Status> want(appends.size());
      for (size_t i = 0; i < appends.size(); ++i) {
        want[i] = one_by_one_->Append(appends[i]);
        if (!want[i].ok()) continue;
        AttendRequestItem a = attends[i];
        a.output = out_a[i].data();
        ASSERT_TRUE(one_by_one_->Attend({a}).ok());
      }
      const int calls = counter_->stores + counter_->attends + counter_->store_and_attends;
      std::vector<absl::Status> got(appends.size());
      std::vector<AppendOutcome> outcomes(appends.size());
      batched_->AppendAttend(appends, attends, 0.0f, absl::MakeSpan(got), absl::MakeSpan(outcomes));
      EXPECT_EQ(counter_->stores + counter_->attends + counter_->store_and_attends, calls + 1);
      for (size_t i = 0; i < appends.size(); ++i) {
        EXPECT_EQ(got[i].code(), want[i].code()) << i << ": " << got[i] << " vs " << want[i];
        if (!got[i].ok()) continue;
        EXPECT_EQ(std::memcmp(out_a[i].data(), out_b[i].data(), out_a[i].size() * 4), 0) << "item " << i;
      }
      EXPECT_EQ(got[1].code(), absl::StatusCode::kFailedPrecondition);
      // The retry: stored once, answered already_stored with its attention.
      std::vector<absl::Status> again(1);
      std::vector<AppendOutcome> retried(1);
      std::vector<float> out_c(out_b[2].size());
      AttendRequestItem retry = attends[2];
      retry.output = out_c.data();
      batched_->AppendAttend({appends[2]}, {retry}, 0.0f, absl::MakeSpan(again), absl::MakeSpan(retried));
      ASSERT_TRUE(again[0].ok()) << again[0];
      EXPECT_TRUE(retried[0].already_stored);
      EXPECT_EQ(std::memcmp(out_c.data(), out_b[2].data(), out_c.size() * 4), 0);
    }
  }
  const CacheStats a = one_by_one_->Stats(), b = batched_->Stats();
  EXPECT_EQ(a.pages_used, b.pages_used);
  EXPECT_EQ(a.stored_bytes, b.stored_bytes);
  EXPECT_EQ(a.tokens, b.tokens);
}

TEST_P(AppendBatchTest, ABatchOfPrefillsIsWhatItsRequestsDoOneByOne) {
  const KvLayout& layout = batched_->layout();
  std::vector<AppendRequest> batch = {
      Request(*batched_, "a", 0, 11, 0, 4, 1),  // every layer
      Request(*batched_, "b", 0, 5, 0, 2, 2),   // a prefix of the layers
      Request(*batched_, "c", 0, 7, 0, 4, 3),
      Request(*batched_, "a", 11, 2, 0, 4, 4),  // the same sequence twice: refused
      Request(*batched_, "d", 3, 2, 0, 4, 5),   // a gap: refused
  };
  std::vector<absl::Status> got(batch.size());
  batched_->AppendBatch(batch, absl::MakeSpan(got));
  EXPECT_TRUE(got[0].ok() && got[1].ok() && got[2].ok()) << got[0] << got[1] << got[2];
  EXPECT_EQ(got[3].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(got[4].code(), absl::StatusCode::kFailedPrecondition);
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(one_by_one_->Append(batch[i]).ok());
  EXPECT_EQ(batched_->ListSequences(), (std::vector<std::string>{"a", "b", "c"}));
  for (const std::string id : {"a", "b", "c"}) {
    for (int layer = 0; layer < layout.num_layers(); ++layer) {
      const SequenceInfo info = *batched_->GetSequence(id);
      EXPECT_EQ(info.layer_tokens, one_by_one_->GetSequence(id)->layer_tokens);
      if (info.layer_tokens[layer] == 0) continue;
      const std::vector<float> q = RandomQueries(1, layout, layer);
      std::vector<float> x(q.size()), y(q.size());
      ASSERT_TRUE(one_by_one_->Attend({{id, layer, 1, q.data(), x.data(), nullptr}}).ok());
      ASSERT_TRUE(batched_->Attend({{id, layer, 1, q.data(), y.data(), nullptr}}).ok());
      EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0) << id << " layer " << layer;
    }
  }
  EXPECT_EQ(batched_->Stats().pages_used, one_by_one_->Stats().pages_used);
}

INSTANTIATE_TEST_SUITE_P(Layouts, AppendBatchTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tqkv
