// Helpers shared by the cache tests: a small layout, deterministic K/V data, a
// float64 reference of attention over the decoded vectors, a settable clock,
// and a backend wrapper that can hold a read in flight.
#ifndef TQKV_TESTS_CACHE_CACHE_TEST_UTIL_H_
#define TQKV_TESTS_CACHE_CACHE_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/kv_layout.h"

namespace tqkv {
namespace testing_util {

// 4 layers (the first and last fp16, the middle two TurboQuant 3-bit keys and
// values), 2 KV heads, 4 query heads, head_dim 64, 4 tokens per page.
inline KvLayoutOptions SmallLayout(const std::string& preset = "tqkv_k3v3") {
  KvLayoutOptions o;
  o.num_layers = 4;
  o.num_kv_heads = 2;
  o.num_query_heads = 4;
  o.head_dim = 64;
  o.page_tokens = 4;
  o.preset = preset;
  o.boundary_layers = 1;
  o.boundary_preset = "fp16";
  return o;
}

inline size_t PageBytes(const KvLayoutOptions& layout) {
  auto created = KvLayout::Create(layout);
  EXPECT_TRUE(created.ok()) << created.status();
  return created.ok() ? (*created)->page_bytes() : 1;
}

// Options for a cache of exactly `pages` pages of SmallLayout().
inline CacheOptions SmallCacheOptions(int pages) {
  CacheOptions o;
  o.layout = SmallLayout();
  o.memory_budget_bytes = PageBytes(o.layout) * pages;
  return o;
}

// A clock the test moves by hand.
class FakeClock {
 public:
  absl::Time Now() {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  std::function<absl::Time()> AsFunction() {
    return [this] { return Now(); };
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::FromUnixSeconds(1000000);
};

// K or V of [layers, tokens, kv_heads, head_dim], standard normal.
inline std::vector<float> RandomTensor(int layers, int64_t tokens, const KvLayout& layout, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(layers) * tokens * layout.num_kv_heads() * layout.head_dim());
  for (float& v : x) v = normal(rng);
  return x;
}

// Queries of [num_query_tokens, num_query_heads, head_dim], standard normal.
inline std::vector<float> RandomQueries(int num_query_tokens, const KvLayout& layout, uint32_t seed) {
  return RandomTensor(1, static_cast<int64_t>(num_query_tokens) * layout.query_heads_per_kv_head(), layout, seed);
}

// What attention sees for one stored vector: Decode(Encode(x)).
inline std::vector<float> Decoded(const VectorCodec& codec, const float* x) {
  std::vector<uint8_t> codes(codec.code_bytes());
  std::vector<uint16_t> scalars(codec.num_scalars() + 1);
  std::vector<float> out(codec.head_dim());
  const absl::Status status = codec.Encode(x, codes.data(), scalars.data());
  EXPECT_TRUE(status.ok()) << status;
  codec.Decode(codes.data(), scalars.data(), out.data());
  return out;
}

// The decoded keys and values of one sequence: [layer][token][head][dim].
class ReferenceSequence {
 public:
  explicit ReferenceSequence(const KvLayout* layout)
      : layout_(layout), keys_(layout->num_layers()), values_(layout->num_layers()) {}

  int64_t tokens(int layer) const {
    return static_cast<int64_t>(keys_[layer].size()) / (layout_->num_kv_heads() * layout_->head_dim());
  }

  // Adds what an OK append of these tensors stored.
  void Append(int layer_begin, int layer_end, int64_t n, const float* keys, const float* values) {
    const int heads = layout_->num_kv_heads(), d = layout_->head_dim();
    for (int layer = layer_begin; layer < layer_end; ++layer) {
      for (int64_t t = 0; t < n; ++t) {
        for (int h = 0; h < heads; ++h) {
          const size_t row = ((static_cast<size_t>(layer - layer_begin) * n + t) * heads + h) * d;
          const std::vector<float> k = Decoded(layout_->key_codec(layer, h), keys + row);
          const std::vector<float> v = Decoded(layout_->value_codec(layer, h), values + row);
          keys_[layer].insert(keys_[layer].end(), k.begin(), k.end());
          values_[layer].insert(values_[layer].end(), v.begin(), v.end());
        }
      }
    }
  }

  const float* key(int layer, int64_t t, int head) const {
    return &keys_[layer][(t * layout_->num_kv_heads() + head) * layout_->head_dim()];
  }
  const float* value(int layer, int64_t t, int head) const {
    return &values_[layer][(t * layout_->num_kv_heads() + head) * layout_->head_dim()];
  }

  double Scale() const { return 1.0 / std::sqrt(static_cast<double>(layout_->head_dim())); }

  // Exact attention in float64 over the decoded vectors of `layer`, as
  // AttendItem defines it (query token i of n sees [0, context - n + 1 + i)).
  // With causal = false every query token sees the whole context (used to
  // show that a test tells the two apart).
  void Attend(int layer, int num_query_tokens, const float* queries, std::vector<double>* output,
              std::vector<double>* lse, bool causal = true) const {
    const int qh = layout_->num_query_heads(), d = layout_->head_dim();
    const int group = layout_->query_heads_per_kv_head();
    const int64_t context = tokens(layer);
    output->assign(static_cast<size_t>(num_query_tokens) * qh * d, 0.0);
    lse->assign(static_cast<size_t>(num_query_tokens) * qh, 0.0);
    for (int i = 0; i < num_query_tokens; ++i) {
      const int64_t visible = causal ? context - num_query_tokens + 1 + i : context;
      for (int h = 0; h < qh; ++h) {
        const float* q = queries + (static_cast<size_t>(i) * qh + h) * d;
        std::vector<double> logits(visible);
        double max_logit = -INFINITY;
        for (int64_t t = 0; t < visible; ++t) {
          double dot = 0;
          const float* k = key(layer, t, h / group);
          for (int j = 0; j < d; ++j) dot += static_cast<double>(q[j]) * k[j];
          logits[t] = dot * Scale();
          max_logit = std::max(max_logit, logits[t]);
        }
        double sum = 0;
        for (int64_t t = 0; t < visible; ++t) sum += std::exp(logits[t] - max_logit);
        double* out = &(*output)[(static_cast<size_t>(i) * qh + h) * d];
        for (int64_t t = 0; t < visible; ++t) {
          const double p = std::exp(logits[t] - max_logit) / sum;
          const float* v = value(layer, t, h / group);
          for (int j = 0; j < d; ++j) out[j] += p * v[j];
        }
        (*lse)[static_cast<size_t>(i) * qh + h] = max_logit + std::log(sum);
      }
    }
  }

  // scale * <q_h, k_t> for t in [begin, end).
  std::vector<double> Score(int layer, int64_t begin, int64_t end, const float* queries) const {
    const int qh = layout_->num_query_heads(), d = layout_->head_dim();
    const int group = layout_->query_heads_per_kv_head();
    std::vector<double> logits(static_cast<size_t>(qh) * (end - begin));
    for (int h = 0; h < qh; ++h) {
      for (int64_t t = begin; t < end; ++t) {
        double dot = 0;
        const float* k = key(layer, t, h / group);
        for (int j = 0; j < d; ++j) dot += static_cast<double>(queries[h * d + j]) * k[j];
        logits[h * (end - begin) + (t - begin)] = dot * Scale();
      }
    }
    return logits;
  }

 private:
  const KvLayout* layout_;
  std::vector<std::vector<float>> keys_;
  std::vector<std::vector<float>> values_;
};

// |got - want| <= rel * max(max |want|, 1e-3) elementwise; returns the number
// of mismatches and reports the first few.
template <typename T>
int CountMismatches(const float* got, const std::vector<T>& want, double rel, const std::string& what) {
  double max_abs = 1e-3;
  for (T w : want) max_abs = std::max(max_abs, std::fabs(static_cast<double>(w)));
  const double tol = rel * max_abs;
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    if (!(err <= tol)) {
      if (++bad <= 5) {
        ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << want[i] << " (tolerance " << tol << ")";
      }
    }
  }
  return bad;
}

// Forwards to a real backend; when armed, the next Attend announces that it
// has started (its pages pinned) and waits to be released.
class GatedBackend : public Backend {
 public:
  explicit GatedBackend(Backend* inner) : inner_(inner) {}

  // Every Store sleeps this long first: widens the window in which a second
  // append to the same sequence could slip in.
  void set_store_delay(absl::Duration delay) { store_delay_ = delay; }

  void ArmAttendGate() {
    absl::MutexLock lock(&mu_);
    armed_ = true;
  }
  // False if no gated Attend started within 10 s.
  bool WaitUntilAttendEntered() { return entered_.WaitForNotificationWithTimeout(absl::Seconds(10)); }
  void ReleaseAttend() { release_.Notify(); }

  std::string name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  absl::StatusOr<PagePool> AllocatePool(const KvLayout& layout, int32_t num_pages) override {
    return inner_->AllocatePool(layout, num_pages);
  }
  void FreePool(PagePool pool) override { inner_->FreePool(pool); }
  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    return inner_->CopyPage(pool, from, to);
  }
  absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> pages, uint8_t* host) override {
    return inner_->ReadPages(pool, pages, host);
  }
  absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> pages, const uint8_t* host) override {
    return inner_->WritePages(pool, pages, host);
  }
  absl::Status Store(const StoreParams& params) override {
    if (store_delay_ > absl::ZeroDuration()) absl::SleepFor(store_delay_);
    return inner_->Store(params);
  }
  absl::Status Score(const ScoreParams& params) override { return inner_->Score(params); }
  absl::Status Attend(const AttendParams& params) override {
    bool gated;
    {
      absl::MutexLock lock(&mu_);
      gated = armed_;
      armed_ = false;
    }
    if (gated) {
      entered_.Notify();
      release_.WaitForNotification();
    }
    return inner_->Attend(params);
  }

 private:
  Backend* inner_;
  absl::Duration store_delay_;  // set before the backend is shared
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification entered_;
  absl::Notification release_;
};

}  // namespace testing_util
}  // namespace tqkv

#endif  // TQKV_TESTS_CACHE_CACHE_TEST_UTIL_H_
