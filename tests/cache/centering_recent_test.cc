// Key centering and exact tokens through the real cache and CPU backend,
// against float64 attention over what the cache stores: the compressed
// residual k_t - R_t m (decoded), or its fp16 copy while the token is a sink
// or among the recent tokens, plus the mean added back exactly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/float_formats.h"
#include "kernels/key_centering.h"
#include "kernels/kv_layout.h"
#include "base/random.h"

namespace tqkv {
namespace {

constexpr int kLayers = 2;
constexpr int kKvHeads = 2;
constexpr int kQueryHeads = 4;

// Keys with a large shared pre-RoPE component, rotated by the layout's RoPE
// (as a model's keys come), and ordinary values. [layers, tokens, heads, d].
struct Data {
  std::vector<float> keys, values;
};

Data MakeData(const KvLayout& layout, int64_t first_position, int64_t tokens, uint64_t seed) {
  const int d = layout.head_dim();
  Random rng(seed);
  Random shared(77);  // the same shared direction for every call
  std::vector<double> common(static_cast<size_t>(kLayers) * kKvHeads * d);
  for (double& c : common) c = 3.0 * shared.NextGaussian();
  RopeOptions rope;
  rope.base = 10000.0;
  auto table = RopeTable::Create(rope, d);
  Data data;
  data.keys.resize(static_cast<size_t>(kLayers) * tokens * kKvHeads * d);
  data.values.resize(data.keys.size());
  std::vector<double> k(d);
  for (int l = 0; l < kLayers; ++l) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int h = 0; h < kKvHeads; ++h) {
        for (int j = 0; j < d; ++j) {
          k[j] = common[(static_cast<size_t>(l) * kKvHeads + h) * d + j] + rng.NextGaussian();
        }
        table->Rotate(first_position + t, k.data(), /*inverse=*/false);
        const size_t row = ((static_cast<size_t>(l) * tokens + t) * kKvHeads + h) * d;
        for (int j = 0; j < d; ++j) {
          data.keys[row + j] = static_cast<float>(k[j]);
          data.values[row + j] = static_cast<float>(rng.NextGaussian());
        }
      }
    }
  }
  return data;
}

KvLayoutOptions Options(const std::string& preset, KeyCentering centering, int sinks, int recent) {
  KvLayoutOptions o;
  o.num_layers = kLayers;
  o.num_kv_heads = kKvHeads;
  o.num_query_heads = kQueryHeads;
  o.head_dim = 64;
  o.page_tokens = 16;
  o.preset = preset;
  o.boundary_layers = 0;
  o.key_centering = centering;
  o.rope.base = 10000.0;
  o.centering_tokens = 24;
  o.centering_pairs = 6;
  o.exact_sink_tokens = sinks;
  o.exact_recent_tokens = recent;
  return o;
}

struct Fixture {
  std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  std::unique_ptr<KvCache> cache;

  explicit Fixture(const KvLayoutOptions& layout, size_t budget = size_t{16} << 20) {
    CacheOptions o;
    o.layout = layout;
    o.memory_budget_bytes = budget;
    auto made = KvCache::Create(o, backend.get());
    EXPECT_TRUE(made.ok()) << made.status();
    if (made.ok()) cache = std::move(*made);
  }

  absl::Status Append(const std::string& id, int64_t start, const Data& data, int64_t tokens) {
    AppendRequest r;
    r.sequence_id = id;
    r.start_position = start;
    r.layer_begin = 0;
    r.layer_end = kLayers;
    r.num_tokens = tokens;
    r.keys = data.keys.data();
    r.values = data.values.data();
    return cache->Append(r);
  }
};

// What the cache holds for one sequence, rebuilt independently of it: the
// tokens as keys and values, the mean rule applied to the first append.
class Reference {
 public:
  explicit Reference(const KvLayout& layout) : layout_(layout) {}

  void Append(const Data& data, int64_t tokens) {
    const int d = layout_.head_dim();
    const KvLayoutOptions& o = layout_.options();
    const int64_t first = length_;
    for (int l = 0; l < kLayers; ++l) {
      for (int h = 0; h < kKvHeads; ++h) {
        const float* k = data.keys.data() + (static_cast<size_t>(l) * tokens * kKvHeads + h) * d;
        std::vector<float>& mean = means_[l * kKvHeads + h];
        if (mean.empty()) {
          mean.assign(d, 0.0f);
          if (layout_.key_centering() != KeyCentering::kNone) {
            const RopeAngles angles = ComputeRopeAngles(layout_.rope(l), first, tokens);
            int64_t begin = o.centering_includes_sinks ? 0 : std::min<int64_t>(o.exact_sink_tokens, tokens);
            if (begin >= tokens) begin = 0;
            EstimateKeyMean(layout_.rope(l), angles, k, begin, std::min<int64_t>(tokens, begin + o.centering_tokens),
                            kKvHeads * d, o.centering_pairs, d, mean.data());
            if (layout_.sequence_key_scales()) {
              scales_[l * kKvHeads + h] = SequenceScales(layout_.rope(l), mean, k, first, begin, tokens);
            }
          }
        }
        for (int64_t t = 0; t < tokens; ++t) {
          Token token;
          const size_t row = ((static_cast<size_t>(l) * tokens + t) * kKvHeads + h) * d;
          token.key = std::vector<float>(data.keys.begin() + row, data.keys.begin() + row + d);
          token.value = std::vector<float>(data.values.begin() + row, data.values.begin() + row + d);
          tokens_[l * kKvHeads + h].push_back(token);
        }
      }
    }
    length_ += tokens;
  }

  // Keys and values as attention reads them at the current length, in double.
  void Read(int layer, int head, std::vector<std::vector<double>>* keys,
            std::vector<std::vector<double>>* values) const {
    const int d = layout_.head_dim();
    const std::vector<Token>& tokens = tokens_[layer * kKvHeads + head];
    const std::vector<float>& mean = means_[layer * kKvHeads + head];
    const ExactRanges ranges = layout_.has_exact_tokens() ? layout_.exact_ranges(length_) : ExactRanges{0, length_};
    const VectorCodec& kc = layout_.key_codec(layer, head);
    const VectorCodec& vc = layout_.value_codec(layer, head);
    std::vector<uint8_t> codes(std::max(kc.code_bytes(), vc.code_bytes()));
    std::vector<uint16_t> scalars(std::max(kc.num_scalars(), vc.num_scalars()) + 1);
    std::vector<float> residual(d), decoded(d);
    keys->clear();
    values->clear();
    for (int64_t t = 0; t < length_; ++t) {
      const bool exact = t < ranges.sink_end || t >= ranges.recent_begin;
      // r_t = k_t - R_t m, as the cache computes it.
      const RopeAngles angles = ComputeRopeAngles(layout_.rope(layer), t, 1);
      SubtractKeyMean(layout_.rope(layer), angles, mean.data(), tokens[t].key.data(), d, d, residual.data());
      // Key scales: the cache stores residual / s; reading it with q * s is
      // reading residual-as-stored * s with q.
      const float* s =
          layout_.sequence_key_scales() ? scales_[layer * kKvHeads + head].data() : layout_.key_scales(layer, head);
      if (s != nullptr) {
        for (int j = 0; j < d; ++j) residual[j] /= s[j];
      }
      std::vector<double> key(d), value(d);
      if (exact) {
        for (int j = 0; j < d; ++j) {
          decoded[j] = HalfToFloat(FloatToHalf(residual[j]));
          value[j] = HalfToFloat(FloatToHalf(tokens[t].value[j]));
        }
      } else {
        EXPECT_TRUE(kc.Encode(residual.data(), codes.data(), scalars.data()).ok());
        kc.Decode(codes.data(), scalars.data(), decoded.data());
        std::vector<float> v(d);
        EXPECT_TRUE(vc.Encode(tokens[t].value.data(), codes.data(), scalars.data()).ok());
        vc.Decode(codes.data(), scalars.data(), v.data());
        for (int j = 0; j < d; ++j) value[j] = v[j];
      }
      // + R_t m, in double.
      std::vector<double> rotated_mean(mean.begin(), mean.end());
      layout_.rope(layer).Rotate(t, rotated_mean.data(), /*inverse=*/false);
      if (layout_.key_centering() == KeyCentering::kNone) std::fill(rotated_mean.begin(), rotated_mean.end(), 0.0);
      for (int j = 0; j < d; ++j) {
        key[j] = static_cast<double>(decoded[j]) * (s != nullptr ? s[j] : 1.0) + rotated_mean[j];
      }
      keys->push_back(key);
      values->push_back(value);
    }
  }

  int64_t length() const { return length_; }

  // The sequence key scales rule, in double: over the first append's tokens
  // [begin, tokens) after centering, s_j = sqrt(rms_j), a rotary pair's two
  // coordinates sharing their joint rms; over their geometric mean; within
  // [1/16, 16].
  std::vector<float> SequenceScales(const RopeTable& rope, const std::vector<float>& mean, const float* keys,
                                    int64_t first, int64_t begin, int64_t tokens) const {
    const int d = layout_.head_dim();
    std::vector<double> power(d, 0.0);
    std::vector<float> r(d);
    for (int64_t t = begin; t < tokens; ++t) {
      // The residual in float, as the cache stores it before the scales.
      SubtractKeyMean(rope, ComputeRopeAngles(rope, first + t, 1), mean.data(), keys + t * kKvHeads * d, d, d,
                      r.data());
      for (int j = 0; j < d; ++j) power[j] += static_cast<double>(r[j]) * r[j];
    }
    for (int i = 0; i < rope.num_pairs(); ++i) {
      const double joint = (power[rope.first(i)] + power[rope.second(i)]) / 2;
      power[rope.first(i)] = power[rope.second(i)] = joint;
    }
    double log_mean = 0;
    for (double& p : power) log_mean += std::log(p = std::sqrt(std::sqrt(p / (tokens - begin)))) / d;
    std::vector<float> s(d);
    for (int j = 0; j < d; ++j) s[j] = static_cast<float>(std::clamp(power[j] / std::exp(log_mean), 1.0 / 16, 16.0));
    return s;
  }

 private:
  struct Token {
    std::vector<float> key, value;
  };
  const KvLayout& layout_;
  int64_t length_ = 0;
  std::vector<std::vector<float>> means_ = std::vector<std::vector<float>>(kLayers * kKvHeads);
  std::vector<std::vector<float>> scales_ = std::vector<std::vector<float>>(kLayers * kKvHeads);
  std::vector<std::vector<Token>> tokens_ = std::vector<std::vector<Token>>(kLayers * kKvHeads);
};

std::vector<float> Queries(int tokens, int d, uint64_t seed) {
  Random rng(seed);
  std::vector<float> q(static_cast<size_t>(tokens) * kQueryHeads * d);
  for (float& x : q) x = static_cast<float>(rng.NextGaussian());
  return q;
}

// Attend (several causal query tokens) and Score against float64 over the
// reference's vectors, at every SIMD level (the fused kernels and the
// reference path).
void CheckAgainstReference(Fixture& f, const Reference& ref, const std::string& id) {
  const KvLayout& layout = f.cache->layout();
  const int d = layout.head_dim();
  const int group = kQueryHeads / kKvHeads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const int num_query = 3;
  const std::vector<float> q = Queries(num_query, d, 5);
  const SimdLevel original = ActiveSimdLevel();
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (SetActiveSimdLevel(level) != level) continue;
    SCOPED_TRACE(std::string("simd ") + std::string(SimdLevelName(level)));
    for (int layer = 0; layer < kLayers; ++layer) {
      std::vector<float> out(q.size()), lse(num_query * kQueryHeads);
      AttendRequestItem item;
      item.sequence_id = id;
      item.layer = layer;
      item.num_query_tokens = num_query;
      item.queries = q.data();
      item.output = out.data();
      item.lse = lse.data();
      ASSERT_TRUE(f.cache->Attend({item}).ok());
      for (int h = 0; h < kQueryHeads; ++h) {
        std::vector<std::vector<double>> keys, values;
        ref.Read(layer, h / group, &keys, &values);
        // Score of the last query token over every token.
        std::vector<float> logits(static_cast<size_t>(kQueryHeads) * ref.length());
        ASSERT_TRUE(f.cache->Score(id, layer, 0, -1, q.data() + (num_query - 1) * kQueryHeads * d, logits.data()).ok());
        for (int i = 0; i < num_query; ++i) {
          const float* qi = q.data() + (static_cast<size_t>(i) * kQueryHeads + h) * d;
          const int64_t visible = ref.length() - num_query + 1 + i;
          std::vector<double> w(visible);
          double top = -1e300;
          for (int64_t t = 0; t < visible; ++t) {
            double dot = 0;
            for (int j = 0; j < d; ++j) dot += qi[j] * keys[t][j];
            w[t] = scale * dot;
            top = std::max(top, w[t]);
            if (i == num_query - 1) {
              ASSERT_NEAR(logits[h * ref.length() + t], w[t], 2e-4 * (1 + std::abs(w[t])))
                  << "layer " << layer << " head " << h << " token " << t;
            }
          }
          double sum = 0;
          for (double& x : w) sum += (x = std::exp(x - top));
          std::vector<double> want(d, 0.0);
          for (int64_t t = 0; t < visible; ++t) {
            for (int j = 0; j < d; ++j) want[j] += w[t] / sum * values[t][j];
          }
          const float* got = out.data() + (static_cast<size_t>(i) * kQueryHeads + h) * d;
          double err = 0, norm = 0;
          for (int j = 0; j < d; ++j) {
            err += (got[j] - want[j]) * (got[j] - want[j]);
            norm += want[j] * want[j];
          }
          EXPECT_LE(std::sqrt(err / norm), 1e-4) << "layer " << layer << " head " << h << " query " << i;
          EXPECT_NEAR(lse[i * kQueryHeads + h], top + std::log(sum), 2e-4 * (1 + std::abs(top)));
        }
      }
    }
  }
  SetActiveSimdLevel(original);
}

struct RecipeCase {
  std::string preset;
  KeyCentering centering;
  int sinks;
  int recent;
  bool layer_rope = false;       // layer 1 rotates with a RoPE of its own (layer_ropes)
  bool key_scales = false;       // per-channel key scales in [0.5, 2]
  bool sequence_scales = false;  // each sequence's own key scales
};

void PrintTo(const RecipeCase& c, std::ostream* os) {
  *os << c.preset << " centering " << static_cast<int>(c.centering) << " sinks " << c.sinks << " recent " << c.recent
      << (c.layer_rope ? " layer rope" : "") << (c.key_scales ? " key scales" : "")
      << (c.sequence_scales ? " sequence key scales" : "");
}

// Layer 1's own RoPE in the layer_rope cases: another base.
RopeOptions OtherRope() {
  RopeOptions rope;
  rope.base = 1e6;
  rope.pair_layout = RopePairLayout::kHalfSplit;
  return rope;
}

class RecipeTest : public ::testing::TestWithParam<RecipeCase> {};

TEST_P(RecipeTest, AttendAndScoreEqualFloat64OverTheStoredResidualPlusTheMean) {
  const RecipeCase& c = GetParam();
  KvLayoutOptions o = Options(c.preset, c.centering, c.sinks, c.recent);
  if (c.layer_rope) {
    o.layer_ropes.assign(kLayers, RopeOptions());
    o.layer_ropes[1] = OtherRope();
  }
  if (c.key_scales) {
    Random rng(21);
    o.key_scales.resize(static_cast<size_t>(kLayers) * kKvHeads * o.head_dim);
    for (float& s : o.key_scales) s = static_cast<float>(std::exp2(2.0 * rng.NextDouble() - 1.0));
  }
  o.sequence_key_scales = c.sequence_scales;
  Fixture f(o);
  ASSERT_NE(f.cache, nullptr);
  Reference ref(f.cache->layout());
  // A prefill, then decode steps, then a chunk: the recent tokens move over page
  // boundaries of both kinds of page.
  Data prefill = MakeData(f.cache->layout(), 0, 45, 1);
  ASSERT_TRUE(f.Append("s", 0, prefill, 45).ok());
  ref.Append(prefill, 45);
  CheckAgainstReference(f, ref, "s");
  for (int step = 0; step < 7; ++step) {
    Data token = MakeData(f.cache->layout(), ref.length(), 1, 100 + step);
    ASSERT_TRUE(f.Append("s", ref.length(), token, 1).ok());
    ref.Append(token, 1);
  }
  Data chunk = MakeData(f.cache->layout(), ref.length(), 30, 9);
  ASSERT_TRUE(f.Append("s", ref.length(), chunk, 30).ok());
  ref.Append(chunk, 30);
  CheckAgainstReference(f, ref, "s");
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, RecipeTest,
    ::testing::Values(RecipeCase{"turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16},
                      RecipeCase{"turboquant_k3v4_nc", KeyCentering::kPreRope, 0, 0},
                      RecipeCase{"turboquant_k3v4_nc", KeyCentering::kPostRope, 0, 0},
                      RecipeCase{"turboquant_3bit_nc", KeyCentering::kNone, 4, 16},
                      RecipeCase{"tqkv_k3v4", KeyCentering::kPreRope, 2, 9},
                      RecipeCase{"fp8", KeyCentering::kPreRope, 4, 16},
                      RecipeCase{"turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16, true},
                      RecipeCase{"turboquant_k3v4_nc", KeyCentering::kPreRope, 0, 0, true},
                      RecipeCase{"turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16, true, true},
                      RecipeCase{"turboquant_k3v4_nc", KeyCentering::kPostRope, 0, 0, false, true},
                      RecipeCase{"tqkv_k3v4", KeyCentering::kPreRope, 2, 9, false, true},
                      RecipeCase{"turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16, true, false, true},
                      RecipeCase{"turboquant_k3v4_nc", KeyCentering::kPostRope, 0, 0, false, false, true},
                      RecipeCase{"fp16", KeyCentering::kPreRope, 2, 9, false, false, true}),
    [](const ::testing::TestParamInfo<RecipeCase>& info) {
      const RecipeCase& c = info.param;
      const char* centering = c.centering == KeyCentering::kPreRope    ? "pre"
                              : c.centering == KeyCentering::kPostRope ? "post"
                                                                       : "none";
      return c.preset + "_" + centering + "_s" + std::to_string(c.sinks) + "_r" + std::to_string(c.recent) +
             (c.layer_rope ? "_layer_rope" : "") + (c.key_scales ? "_key_scales" : "") +
             (c.sequence_scales ? "_sequence_scales" : "");
    });

// A layer centered with the RoPE its keys were rotated with loses far less
// to the codec than one centered with another RoPE: the keys come rotated by
// base 1e4 (MakeData); the cache's RoPE is another (base 1e6), layer 1's own
// (layer_ropes) the keys'. Score's logits against float64 q . k over the
// compressed tokens.
TEST(CenteringTest, EachLayerCentersWithItsOwnRope) {
  KvLayoutOptions o = Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 0, 0);
  o.centering_pairs = 0;
  o.rope = OtherRope();
  o.rope.pair_layout = RopePairLayout::kInterleaved;
  o.layer_ropes.assign(kLayers, RopeOptions());
  o.layer_ropes[1].base = 10000.0;
  Fixture f(o);
  ASSERT_NE(f.cache, nullptr);
  EXPECT_EQ(f.cache->layout().rope(1).inv_freq(1), std::pow(10000.0, -2.0 / 64));
  EXPECT_EQ(f.cache->layout().rope(0).inv_freq(1), std::pow(1e6, -2.0 / 64));
  const int tokens = 200;
  const int d = 64;
  Data data = MakeData(f.cache->layout(), 0, tokens, 3);
  ASSERT_TRUE(f.Append("s", 0, data, tokens).ok());
  const std::vector<float> q = Queries(1, d, 11);
  double err[kLayers];
  for (int layer = 0; layer < kLayers; ++layer) {
    std::vector<float> logits(static_cast<size_t>(kQueryHeads) * tokens);
    ASSERT_TRUE(f.cache->Score("s", layer, 0, -1, q.data(), logits.data()).ok());
    double sum = 0;
    for (int h = 0; h < kQueryHeads; ++h) {
      for (int t = 0; t < tokens; ++t) {
        const size_t row = ((static_cast<size_t>(layer) * tokens + t) * kKvHeads + h / 2) * d;
        double dot = 0;
        for (int j = 0; j < d; ++j) dot += static_cast<double>(q[h * d + j]) * data.keys[row + j];
        const double e = logits[h * tokens + t] - dot / 8.0;
        sum += e * e;
      }
    }
    err[layer] = std::sqrt(sum / (kQueryHeads * tokens));
  }
  EXPECT_LT(err[1], 0.5 * err[0]) << "own RoPE " << err[1] << ", another RoPE " << err[0];
}

TEST(CenteringTest, KeyScalesNeedCenteringAndOnePositiveValuePerChannel) {
  KvLayoutOptions o = Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 0, 0);
  o.key_scales.assign(static_cast<size_t>(kLayers) * kKvHeads * o.head_dim, 1.5f);
  ASSERT_TRUE(KvLayout::Create(o).ok());
  auto layout = KvLayout::Create(o);
  EXPECT_EQ((*layout)->key_scales(1, 1)[63], 1.5f);
  o.key_scales.back() = 0.0f;
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.key_scales.back() = 1.0f;
  o.key_scales.pop_back();
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.key_scales.push_back(1.0f);
  o.key_centering = KeyCentering::kNone;
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.key_scales.clear();
  auto plain = KvLayout::Create(o);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->key_scales(0, 0), nullptr);
}

TEST(CenteringTest, LayerRopesNeedOneEntryPerLayerAndValidRopes) {
  KvLayoutOptions o = Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 0, 0);
  o.layer_ropes.assign(kLayers + 1, RopeOptions());
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.layer_ropes.assign(kLayers, RopeOptions());
  o.layer_ropes[0].base = 1e4;
  o.layer_ropes[0].rotary_dims = 65;
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.layer_ropes[0].rotary_dims = 32;
  auto layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ((*layout)->rope(0).num_pairs(), 16);
  EXPECT_EQ((*layout)->rope(1).num_pairs(), 32);
}

TEST(CenteringTest, PreRopeCenteringWithoutARopeFallsBackToPostRope) {
  KvLayoutOptions o = Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 0, 0);
  o.rope = RopeOptions();
  auto layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ((*layout)->key_centering(), KeyCentering::kPostRope);
}

TEST(CenteringTest, CenteringLowersTheScoreErrorOnKeysWithASharedComponent) {
  // The point of it all, on keys whose shared part dominates.
  double err[2];
  for (int centered = 0; centered < 2; ++centered) {
    // Every pair: this data spreads its shared part evenly over the pairs
    // (real keys put most of it in a few).
    KvLayoutOptions o = Options("turboquant_k3v4_nc", centered ? KeyCentering::kPreRope : KeyCentering::kNone, 0, 0);
    o.centering_pairs = 0;
    Fixture f(o);
    Data data = MakeData(f.cache->layout(), 0, 64, 3);
    ASSERT_TRUE(f.Append("s", 0, data, 64).ok());
    const int d = 64;
    const std::vector<float> q = Queries(1, d, 8);
    std::vector<float> logits(kQueryHeads * 64);
    ASSERT_TRUE(f.cache->Score("s", 0, 0, -1, q.data(), logits.data()).ok());
    double sq = 0;
    for (int h = 0; h < kQueryHeads; ++h) {
      for (int t = 0; t < 64; ++t) {
        double exact = 0;
        for (int j = 0; j < d; ++j) exact += q[h * d + j] * data.keys[(t * kKvHeads + h / 2) * d + j];
        exact /= std::sqrt(64.0);
        sq += (logits[h * 64 + t] - exact) * (logits[h * 64 + t] - exact);
      }
    }
    err[centered] = std::sqrt(sq / (kQueryHeads * 64));
  }
  EXPECT_LT(err[1], 0.5 * err[0]) << "plain " << err[0] << " centered " << err[1];
}

TEST(ExactRecentTest, ATokenIsReadExactWhileRecentAndCompressedAfter) {
  // Same seed and preset with and without exact recent tokens: before the
  // last 8 the two caches read the same compressed bytes, within them the
  // recent one reads fp16.
  Fixture recent(Options("turboquant_3bit_nc", KeyCentering::kNone, 2, 8));
  Fixture plain(Options("turboquant_3bit_nc", KeyCentering::kNone, 0, 0));
  const int d = 64;
  const std::vector<float> q = Queries(1, d, 4);
  std::vector<Data> steps;
  for (int64_t t = 0; t < 30; ++t) {
    Data token = MakeData(recent.cache->layout(), t, 1, 200 + t);
    ASSERT_TRUE(recent.Append("s", t, token, 1).ok());
    ASSERT_TRUE(plain.Append("s", t, token, 1).ok());
    steps.push_back(token);
    const int64_t length = t + 1;
    std::vector<float> a(kQueryHeads * length), b(kQueryHeads * length);
    ASSERT_TRUE(recent.cache->Score("s", 1, 0, -1, q.data(), a.data()).ok());
    ASSERT_TRUE(plain.cache->Score("s", 1, 0, -1, q.data(), b.data()).ok());
    for (int64_t u = 0; u < length; ++u) {
      const bool exact = u < 2 || u >= length - 8;
      double want = 0;
      const float* k = steps[u].keys.data() + (static_cast<size_t>(1) * kKvHeads + 0) * d;  // layer 1, head 0
      for (int j = 0; j < d; ++j) want += q[j] * HalfToFloat(FloatToHalf(k[j]));
      want /= std::sqrt(64.0);
      if (exact) {
        EXPECT_NEAR(a[u], want, 1e-4 * (1 + std::abs(want))) << "token " << u << " at length " << length;
      } else {
        EXPECT_EQ(a[u], b[u]) << "token " << u << " at length " << length;
      }
    }
  }
}

TEST(ExactRecentTest, ForksShareTheRecentTokensAndCopyOnWrite) {
  Fixture f(Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 3, 10));
  Reference parent(f.cache->layout());
  Data prefill = MakeData(f.cache->layout(), 0, 20, 11);
  ASSERT_TRUE(f.Append("p", 0, prefill, 20).ok());
  parent.Append(prefill, 20);
  ASSERT_TRUE(f.cache->Fork("p", "c").ok());
  Reference child = parent;
  // Different continuations, written into the shared partial pages.
  for (int step = 0; step < 5; ++step) {
    Data a = MakeData(f.cache->layout(), parent.length(), 1, 300 + step);
    Data b = MakeData(f.cache->layout(), child.length(), 1, 400 + step);
    ASSERT_TRUE(f.Append("p", parent.length(), a, 1).ok());
    parent.Append(a, 1);
    ASSERT_TRUE(f.Append("c", child.length(), b, 1).ok());
    child.Append(b, 1);
  }
  EXPECT_GT(f.cache->Stats().copy_on_writes, 0u);
  CheckAgainstReference(f, parent, "p");
  CheckAgainstReference(f, child, "c");
  ASSERT_TRUE(f.cache->Drop("p").ok());
  CheckAgainstReference(f, child, "c");
  ASSERT_TRUE(f.cache->Drop("c").ok());
  EXPECT_EQ(f.cache->Stats().pages_used, 0);
}

TEST(ExactRecentTest, PagesOfNoLongerRecentTokensAreReleasedAndBytesAreCounted) {
  const KvLayoutOptions o = Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16);
  Fixture f(o);
  const KvLayout& layout = f.cache->layout();
  int32_t most_exact_pages = 0;
  for (int64_t t = 0; t < 300; ++t) {
    Data token = MakeData(layout, t, 1, 500 + t);
    ASSERT_TRUE(f.Append("s", t, token, 1).ok());
    auto info = f.cache->GetSequence("s");
    ASSERT_TRUE(info.ok());
    most_exact_pages = std::max(most_exact_pages, info->exact_pages);
    uint64_t want = 0;
    for (int l = 0; l < kLayers; ++l) want += layout.layer_bytes(l, t + 1);
    ASSERT_EQ(info->stored_bytes, want);
    ASSERT_EQ(f.cache->Stats().stored_bytes, want);
  }
  // Sinks plus 16 recent tokens: a bounded number of exact pages, whatever the length.
  const int per_page = layout.exact_page_tokens();
  EXPECT_LE(most_exact_pages, (4 + per_page - 1) / per_page + (16 + per_page - 1) / per_page + 1);
  const int64_t compressed_pages = (300 + 15) / 16;
  EXPECT_EQ(f.cache->Stats().pages_used, compressed_pages + f.cache->GetSequence("s")->exact_pages);
  // 300 tokens: 300 compressed, 4 + 16 exact per layer, plus the means.
  const size_t want = kLayers * (300 * layout.token_bytes(0) + 20 * layout.exact_layout()->token_bytes(0) +
                                 sizeof(float) * layout.mean_floats());
  EXPECT_EQ(f.cache->Stats().stored_bytes, want);
  ASSERT_TRUE(f.cache->Drop("s").ok());
  EXPECT_EQ(f.cache->Stats().pages_used, 0);
  EXPECT_EQ(f.cache->Stats().stored_bytes, 0u);
}

TEST(ExactRecentTest, LruEvictionFreesExactPagesToo) {
  KvLayoutOptions o = Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16);
  auto layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok());
  CacheOptions co;
  co.layout = o;
  co.memory_budget_bytes = (*layout)->page_bytes() * 12;
  co.evict_lru = true;
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  auto cache = KvCache::Create(co, backend.get());
  ASSERT_TRUE(cache.ok());
  Data data = MakeData(**layout, 0, 40, 1);
  for (int i = 0; i < 6; ++i) {
    AppendRequest r;
    r.sequence_id = "s" + std::to_string(i);
    r.layer_begin = 0;
    r.layer_end = kLayers;
    r.num_tokens = 40;
    r.keys = data.keys.data();
    r.values = data.values.data();
    ASSERT_TRUE((*cache)->Append(r).ok()) << i;
  }
  const CacheStats stats = (*cache)->Stats();
  EXPECT_GT(stats.evictions, 0u);
  EXPECT_LE(stats.pages_used, 12);
  for (const std::string& id : (*cache)->ListSequences()) ASSERT_TRUE((*cache)->Drop(id).ok());
  EXPECT_EQ((*cache)->Stats().pages_used, 0);
}

TEST(ExactRecentTest, AFailedAppendChangesNothing) {
  Fixture f(Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16));
  Data data = MakeData(f.cache->layout(), 0, 20, 1);
  ASSERT_TRUE(f.Append("s", 0, data, 20).ok());
  const CacheStats before = f.cache->Stats();
  Data bad = MakeData(f.cache->layout(), 20, 5, 2);
  bad.values[bad.values.size() - 1] = 1e9f;  // fp16 cannot hold it: the exact store fails
  EXPECT_FALSE(f.Append("s", 20, bad, 5).ok());
  const CacheStats after = f.cache->Stats();
  EXPECT_EQ(after.pages_used, before.pages_used);
  EXPECT_EQ(after.stored_bytes, before.stored_bytes);
  EXPECT_EQ(f.cache->GetSequence("s")->max_tokens, 20);
}

TEST(ExactRecentTest, LayoutRejectsBadSettings) {
  KvLayoutOptions o = Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16);
  o.exact_recent_tokens = -2;  // -1 means the preset's
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16);
  o.page_tokens = 1;  // a 1-token compressed page cannot hold an fp16 token
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16);
  o.rope.rotary_dims = 65;
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options("turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 16);
  o.centering_pairs = 33;
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options("turboquant_k3v4_nc", KeyCentering::kNone, 0, 0);
  o.layer_presets = {"tqkv_k4v4"};  // one entry for two layers
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.layer_presets = {"", "nope"};
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kNotFound);
  o.layer_presets = {"", "tqkv_k4v4"};
  auto layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ((*layout)->layer_preset(0).name, "turboquant_k3v4_nc");
  EXPECT_EQ((*layout)->layer_preset(1).name, "tqkv_k4v4");
}

}  // namespace
}  // namespace tqkv

namespace tqkv {
namespace {

TEST(RecipePresetTest, ARecipePresetSetsCenteringAndExactTokensUnlessTheOptionsDo) {
  KvLayoutOptions o;
  o.num_layers = 2;
  o.num_kv_heads = 2;
  o.num_query_heads = 4;
  o.head_dim = 64;
  o.boundary_layers = 0;
  o.preset = "tqkv_k3v4u_csw";
  o.rope.base = 10000.0;
  auto layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ((*layout)->key_centering(), KeyCentering::kPreRope);
  EXPECT_EQ((*layout)->options().exact_sink_tokens, 4);
  EXPECT_EQ((*layout)->options().exact_recent_tokens, 64);
  EXPECT_EQ((*layout)->layer_preset(0).key.Name(), "tq3_nc");
  o.exact_recent_tokens = 0;
  o.key_centering = KeyCentering::kNone;
  layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ((*layout)->key_centering(), KeyCentering::kNone);
  EXPECT_EQ((*layout)->options().exact_recent_tokens, 0);
  EXPECT_EQ((*layout)->options().exact_sink_tokens, 4);
  // Without the model's RoPE the recipe centers after RoPE.
  o = KvLayoutOptions();
  o.preset = "tqkv_k3v4u_csw";
  layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ((*layout)->key_centering(), KeyCentering::kPostRope);
}

}  // namespace
}  // namespace tqkv
