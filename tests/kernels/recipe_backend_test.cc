// The recipe (pre-RoPE key centering, exact sink and recent tokens) through
// the CPU backend's Attend, against float64 attention over what the pages
// hold: each token's compressed residual k_t - R_t m decoded, or its fp16
// copy while it is exact, plus R_t m in double. At every SIMD level, with the
// fp32 and the integer kernels, for contexts shorter than the sinks, covered
// by the exact tokens, and longer; exact pages of 1 token and more; sliding-window
// layers; several causal query tokens; logit soft-capping (Gemma 2), which
// applies to the whole logit, the add-back's constant part included.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/float_formats.h"
#include "kernels/key_centering.h"
#include "kernels/kv_layout.h"
#include "base/random.h"

namespace tqkv {
namespace {

constexpr int kKvHeads = 2;
constexpr int kQueryHeads = 8;

struct Shape {
  int d = 128;
  int page_tokens = 16;
  int context = 150;
  int sinks = 4;
  int recent = 32;
  int layer_window = 0;  // sliding-window layer: its window, 0 none
  int query_tokens = 1;
  KeyCentering centering = KeyCentering::kPreRope;
  float softcap = 0.0f;  // AttendParams::logit_softcap
};

std::string Describe(const Shape& s) {
  return "d=" + std::to_string(s.d) + " page=" + std::to_string(s.page_tokens) +
         " context=" + std::to_string(s.context) + " sinks=" + std::to_string(s.sinks) +
         " recent=" + std::to_string(s.recent) + " layer window=" + std::to_string(s.layer_window) +
         " queries=" + std::to_string(s.query_tokens) + " centering=" + std::to_string(static_cast<int>(s.centering)) +
         " softcap=" + std::to_string(s.softcap);
}

// One layer stored as the cache stores it: the means from the first tokens,
// every token's residual compressed, the exact tokens' residuals at fp16 in
// exact pages, all in one pool.
class StoredRecipe {
 public:
  StoredRecipe(const Shape& s, Backend* backend) : s_(s), backend_(backend) {
    KvLayoutOptions o;
    o.num_layers = 1;
    o.num_kv_heads = kKvHeads;
    o.num_query_heads = kQueryHeads;
    o.head_dim = s.d;
    o.page_tokens = s.page_tokens;
    o.preset = "turboquant_k3v4_nc";
    o.boundary_layers = 0;
    o.key_centering = s.centering;
    o.rope.base = 500000.0;
    o.rope.pair_layout = RopePairLayout::kHalfSplit;
    o.centering_pairs = 8;
    o.exact_sink_tokens = s.sinks;
    o.exact_recent_tokens = s.recent;
    if (s.layer_window > 0) o.layer_windows = {s.layer_window};
    auto made = KvLayout::Create(o);
    if (!made.ok()) {
      ADD_FAILURE() << made.status();
      return;
    }
    layout_ = *made;
    MakeTokens();
    Store();
  }
  ~StoredRecipe() {
    if (pool_.base != nullptr) backend_->FreePool(pool_);
  }

  bool ok() const { return layout_ != nullptr; }
  const KvLayout& layout() const { return *layout_; }

  AttendItem Item(const float* queries, float* out, float* lse) const {
    AttendItem item{table_.data(), s_.context, 0, s_.query_tokens, queries, out, lse};
    if (layout_->has_exact_tokens()) item.exact_block_table = exact_table_.data();
    if (layout_->key_centering() != KeyCentering::kNone) item.key_mean = means_.data();
    return item;
  }
  const PagePool& pool() const { return pool_; }

  // Token t of KV head h as attention reads it, in double.
  std::vector<double> Key(int t, int h) const {
    const int d = s_.d;
    std::vector<double> k(d);
    const std::vector<float>& r = ReadAs(t, h, true);
    std::vector<double> mean(means_.begin() + h * d, means_.begin() + (h + 1) * d);
    if (layout_->key_centering() == KeyCentering::kPreRope) layout_->rope().Rotate(t, mean.data(), false);
    if (layout_->key_centering() == KeyCentering::kNone) std::fill(mean.begin(), mean.end(), 0.0);
    for (int j = 0; j < d; ++j) k[j] = r[j] + mean[j];
    return k;
  }
  std::vector<double> Value(int t, int h) const {
    const std::vector<float>& v = ReadAs(t, h, false);
    return std::vector<double>(v.begin(), v.end());
  }

 private:
  bool Exact(int t) const {
    if (!layout_->has_exact_tokens()) return false;
    const ExactRanges r = layout_->exact_ranges(s_.context);
    return t < r.sink_end || t >= r.recent_begin;
  }

  // Keys with a shared pre-RoPE component, rotated to their positions;
  // values; then the means and the residuals as the cache forms them.
  void MakeTokens() {
    const int d = s_.d, row = kKvHeads * d;
    Random rng(17);
    std::vector<double> common(row);
    for (double& c : common) c = 2.0 * rng.NextGaussian();
    keys_.resize(static_cast<size_t>(s_.context) * row);
    values_.resize(keys_.size());
    std::vector<double> k(d);
    for (int t = 0; t < s_.context; ++t) {
      for (int h = 0; h < kKvHeads; ++h) {
        for (int j = 0; j < d; ++j) k[j] = common[h * d + j] + rng.NextGaussian();
        if (layout_->rope().num_pairs() > 0) layout_->rope().Rotate(t, k.data(), false);
        for (int j = 0; j < d; ++j) {
          keys_[(static_cast<size_t>(t) * kKvHeads + h) * d + j] = static_cast<float>(k[j]);
          values_[(static_cast<size_t>(t) * kKvHeads + h) * d + j] = static_cast<float>(rng.NextGaussian());
        }
      }
    }
    means_.assign(row, 0.0f);
    residuals_ = keys_;
    if (layout_->key_centering() == KeyCentering::kNone) return;
    const RopeAngles angles = ComputeRopeAngles(layout_->rope(), 0, s_.context);
    const int64_t begin = std::min(s_.sinks, s_.context - 1);
    for (int h = 0; h < kKvHeads; ++h) {
      EstimateKeyMean(layout_->rope(), angles, keys_.data() + h * d, begin, std::min<int64_t>(s_.context, begin + 24),
                      row, 8, d, means_.data() + h * d);
      SubtractKeyMean(layout_->rope(), angles, means_.data() + h * d, keys_.data() + h * d, row, d,
                      residuals_.data() + h * d);
    }
  }

  void Store() {
    const int pages = (s_.context + s_.page_tokens - 1) / s_.page_tokens;
    const int ept = layout_->exact_page_tokens();
    const int exact_pages = ept > 0 ? (s_.context + ept - 1) / ept : 0;
    pool_ = *backend_->AllocatePool(*layout_, pages + exact_pages);
    // Shuffled pages, the exact ones after the others.
    Random rng(5);
    table_.resize(pages);
    std::iota(table_.begin(), table_.end(), 0);
    for (int i = pages - 1; i > 0; --i) std::swap(table_[i], table_[rng.NextBelow(i + 1)]);
    std::vector<int32_t> slots(s_.context);
    for (int t = 0; t < s_.context; ++t) slots[t] = table_[t / s_.page_tokens] * s_.page_tokens + t % s_.page_tokens;
    ASSERT_TRUE(
        backend_->Store({layout_.get(), pool_, 0, 1, s_.context, slots.data(), residuals_.data(), values_.data()})
            .ok());
    if (!layout_->has_exact_tokens()) return;
    exact_table_.assign(exact_pages, -1);
    std::vector<int32_t> exact_slots;
    std::vector<float> exact_keys, exact_values;
    const size_t row = static_cast<size_t>(kKvHeads) * s_.d;
    for (int t = 0; t < s_.context; ++t) {
      if (!Exact(t)) continue;
      if (exact_table_[t / ept] < 0) exact_table_[t / ept] = pages + t / ept;
      exact_slots.push_back(exact_table_[t / ept] * ept + t % ept);
      exact_keys.insert(exact_keys.end(), residuals_.begin() + t * row, residuals_.begin() + (t + 1) * row);
      exact_values.insert(exact_values.end(), values_.begin() + t * row, values_.begin() + (t + 1) * row);
    }
    if (exact_slots.empty()) return;
    ASSERT_TRUE(backend_
                    ->Store({layout_->exact_layout(), pool_, 0, 1, static_cast<int64_t>(exact_slots.size()),
                             exact_slots.data(), exact_keys.data(), exact_values.data()})
                    .ok());
  }

  // What the pages hold for token t of head h: its fp16 copy while exact,
  // else its compressed bytes decoded (codecs are deterministic: encoding
  // again gives the stored bytes).
  const std::vector<float>& ReadAs(int t, int h, bool key) const {
    thread_local std::vector<float> out;
    const int d = s_.d;
    const float* x = (key ? residuals_ : values_).data() + (static_cast<size_t>(t) * kKvHeads + h) * d;
    out.resize(d);
    if (Exact(t)) {
      for (int j = 0; j < d; ++j) out[j] = HalfToFloat(FloatToHalf(x[j]));
      return out;
    }
    const VectorCodec& codec = key ? layout_->key_codec(0, h) : layout_->value_codec(0, h);
    std::vector<uint8_t> codes(codec.code_bytes());
    std::vector<uint16_t> scalars(codec.num_scalars() + 1);
    EXPECT_TRUE(codec.Encode(x, codes.data(), scalars.data()).ok());
    codec.Decode(codes.data(), scalars.data(), out.data());
    return out;
  }

  const Shape s_;
  Backend* backend_;
  std::shared_ptr<const KvLayout> layout_;
  PagePool pool_{};
  std::vector<int32_t> table_, exact_table_;
  std::vector<float> keys_, values_, residuals_, means_;
};

// Attend through `backend` and compare every row with float64 attention.
void CheckAttend(const Shape& s, Backend* backend, double output_tolerance, double lse_tolerance) {
  StoredRecipe stored(s, backend);
  if (!stored.ok()) return;
  const KvLayout& layout = stored.layout();
  const int d = s.d, group = kQueryHeads / kKvHeads;
  Random rng(9);
  std::vector<float> q(static_cast<size_t>(s.query_tokens) * kQueryHeads * d);
  for (float& x : q) x = static_cast<float>(0.5 * rng.NextGaussian());
  std::vector<float> out(q.size()), lse(static_cast<size_t>(s.query_tokens) * kQueryHeads);
  const AttendItem item = stored.Item(q.data(), out.data(), lse.data());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  ASSERT_TRUE(backend->Attend({&layout, stored.pool(), {&item, 1}, scale, s.softcap}).ok());
  for (int h = 0; h < kQueryHeads; ++h) {
    std::vector<std::vector<double>> keys, values;
    for (int t = 0; t < s.context; ++t) {
      keys.push_back(stored.Key(t, h / group));
      values.push_back(stored.Value(t, h / group));
    }
    for (int i = 0; i < s.query_tokens; ++i) {
      const int visible = s.context - s.query_tokens + 1 + i;
      const int first = static_cast<int>(layout.WindowBegin(0, visible - 1));
      const float* qi = q.data() + (static_cast<size_t>(i) * kQueryHeads + h) * d;
      std::vector<double> w(visible, 0.0);
      double top = -1e300;
      for (int t = first; t < visible; ++t) {
        double dot = 0;
        for (int j = 0; j < d; ++j) dot += qi[j] * keys[t][j];
        w[t] = scale * dot;
        if (s.softcap > 0) w[t] = s.softcap * std::tanh(w[t] / s.softcap);
        top = std::max(top, w[t]);
      }
      double sum = 0;
      for (int t = first; t < visible; ++t) sum += (w[t] = std::exp(w[t] - top));
      double err = 0, norm = 0;
      for (int j = 0; j < d; ++j) {
        double want = 0;
        for (int t = first; t < visible; ++t) want += w[t] / sum * values[t][j];
        const double got = out[(static_cast<size_t>(i) * kQueryHeads + h) * d + j];
        err += (got - want) * (got - want);
        norm += want * want;
      }
      EXPECT_LE(std::sqrt(err / norm), output_tolerance) << "head " << h << " query " << i;
      EXPECT_NEAR(lse[i * kQueryHeads + h], top + std::log(sum), lse_tolerance * (1 + std::fabs(top)))
          << "head " << h << " query " << i;
    }
  }
}

std::vector<Shape> Shapes() {
  std::vector<Shape> shapes;
  const auto add = [&](auto edit) {
    Shape s;
    edit(s);
    shapes.push_back(s);
  };
  add([](Shape&) {});
  add([](Shape& s) { s.context = 3; });                            // shorter than the sinks
  add([](Shape& s) { s.context = 30; });                           // every token exact
  add([](Shape& s) { s.context = 37; });                           // one compressed token
  add([](Shape& s) { s.page_tokens = 4, s.query_tokens = 3; });    // exact pages of 1 token; causal queries
  add([](Shape& s) { s.layer_window = 40, s.query_tokens = 2; });  // a sliding window: sinks unseen
  add([](Shape& s) { s.d = 64, s.recent = 0; });                   // sinks only
  add([](Shape& s) { s.sinks = 0, s.recent = 70; });               // recent tokens past a block
  add([](Shape& s) { s.centering = KeyCentering::kPostRope; });
  add([](Shape& s) { s.centering = KeyCentering::kNone; });
  return shapes;
}

// Soft-capped shapes: caps that bite (the logits here reach about +-3, their
// add-back constant about +-1), with centering, exact tokens, a sliding
// window and causal query tokens, so that a cap applied without the
// add-back's constant part, or not at all, moves the output.
std::vector<Shape> SoftCapShapes() {
  std::vector<Shape> shapes;
  for (const Shape& base : Shapes()) {
    if (base.context < 100) continue;
    for (float cap : {1.0f, 2.5f}) {
      Shape s = base;
      s.softcap = cap;
      shapes.push_back(s);
    }
  }
  return shapes;
}

TEST(RecipeBackend, Fp32KernelsEqualFloat64AtEverySimdLevel) {
  const SimdLevel original = ActiveSimdLevel();
  for (SimdLevel level : SupportedSimdLevels()) {
    SetActiveSimdLevel(level);
    SCOPED_TRACE(std::string(SimdLevelName(level)));
    auto backend = MakeCpuBackend(2);  // fp32 kernels (or the reference path)
    for (const Shape& s : Shapes()) {
      SCOPED_TRACE(Describe(s));
      CheckAttend(s, backend.get(), 1e-4, 2e-5);
    }
  }
  SetActiveSimdLevel(original);
}

TEST(RecipeBackend, SoftCappedLogitsEqualFloat64AtEverySimdLevel) {
  const SimdLevel original = ActiveSimdLevel();
  for (SimdLevel level : SupportedSimdLevels()) {
    SetActiveSimdLevel(level);
    SCOPED_TRACE(std::string(SimdLevelName(level)));
    auto backend = MakeCpuBackend(2);
    for (const Shape& s : SoftCapShapes()) {
      SCOPED_TRACE(Describe(s));
      CheckAttend(s, backend.get(), 1e-4, 2e-5);
    }
  }
  SetActiveSimdLevel(original);
}

// The integer kernel rounds the query and the codebooks (attend_kernels.h):
// held to what CheckStoreThenAttend allows it, a bound the plumbing of the
// exact tokens and the add-back (a token read from the wrong copy, a missing
// or doubled add-back) would break.
TEST(RecipeBackend, IntegerKernelStaysNearFloat64) {
  if (DetectedSimdLevel() < SimdLevel::kAvx512Vnni) GTEST_SKIP() << "no AVX-512 VNNI + VBMI + VBMI2 on this CPU";
  CpuBackendOptions options;
  options.num_threads = 2;
  auto backend = MakeCpuBackend(options);
  for (const Shape& s : Shapes()) {
    SCOPED_TRACE(Describe(s));
    CheckAttend(s, backend.get(), 0.15, 0.02);
  }
}

TEST(RecipeBackend, IntegerKernelSoftCapsTheWholeLogit) {
  if (DetectedSimdLevel() < SimdLevel::kAvx512Vnni) GTEST_SKIP() << "no AVX-512 VNNI + VBMI + VBMI2 on this CPU";
  CpuBackendOptions options;
  options.num_threads = 2;
  auto backend = MakeCpuBackend(options);
  for (const Shape& s : SoftCapShapes()) {
    SCOPED_TRACE(Describe(s));
    CheckAttend(s, backend.get(), 0.15, 0.02);
  }
}

}  // namespace
}  // namespace tqkv
