#include "eval/calibration.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "client/cli/npy.h"
#include "eval/synthetic.h"
#include "kernels/key_centering.h"
#include "kernels/preset.h"
#include "base/random.h"

namespace tqkv {
namespace eval {
namespace {

constexpr int kOutlierLayer = 1;

// 3 layers, 96 tokens, 4 query heads over 2 KV heads, head_dim 32. Gaussian
// queries and keys, values with a per-channel offset (real values have a
// mean; zero-mean ones make diffuse attention outputs vanish), except the
// keys of kOutlierLayer: 4 channels x30 and a per-channel offset, the
// pattern of the long-range layers with 30-60x outlier channels that
// position-based protection misses (docs/turboquant.md section 7).
CaptureMeta SmallMeta() { return {3, 4, 2, 32, 96}; }

std::vector<LayerCapture> SyntheticLayers(const CaptureMeta& m) {
  std::vector<LayerCapture> layers(m.layers);
  const int64_t kv_rows = m.tokens * m.num_kv_heads;
  for (int l = 0; l < m.layers; ++l) {
    LayerCapture& c = layers[l];
    c.queries = Queries(m.tokens * m.num_query_heads, m.head_dim, DeriveSeed(7, l, 1));
    OutlierKeyOptions values, outliers;
    values.hot_channels = 0;
    outliers.hot_scale = 30.0;
    c.values = OutlierKeys(kv_rows, m.head_dim, DeriveSeed(7, l, 2), values);
    c.keys = l == kOutlierLayer ? OutlierKeys(kv_rows, m.head_dim, DeriveSeed(7, l, 3), outliers)
                                : GaussianVectors(kv_rows, m.head_dim, DeriveSeed(7, l, 3));
  }
  return layers;
}

// A fresh directory under TEST_TMPDIR or /tmp, removed with what it holds
// when the test ends.
class ScopedTempDir {
 public:
  ScopedTempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    path_ = std::string(base ? base : "/tmp") + "/calibration_test_XXXXXX";
    EXPECT_NE(mkdtemp(path_.data()), nullptr);
  }
  ~ScopedTempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void WriteText(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::vector<const Preset*> Presets(const std::string& names) { return *ParsePresetList(names); }

std::vector<LayerCalibration> CalibrateAll(const CaptureMeta& m, const std::vector<LayerCapture>& layers,
                                           const std::string& presets) {
  CalibrationOptions options;
  options.positions = 16;
  options.layout.page_tokens = 8;
  std::vector<LayerCalibration> out;
  for (int l = 0; l < m.layers; ++l) {
    absl::StatusOr<LayerCalibration> layer = CalibrateLayer(m, l, layers[l], Presets(presets), options);
    EXPECT_TRUE(layer.ok()) << layer.status();
    if (layer.ok()) out.push_back(*layer);
  }
  return out;
}

// ---------------------------------------------------------------------------
// The capture format.

TEST(CaptureMeta, ReadsTheFlatObjectAndIgnoresOtherMembers) {
  absl::StatusOr<CaptureMeta> meta = ParseCaptureMeta(
      R"({"model": "SmolLM2-135M", "layers": 30, "num_query_heads": 9, "num_kv_heads": 3,
          "head_dim": 64, "tokens": 1024, "rope": {"base": 10000, "dims": [0, 64]},
          "note": "a \"quoted\" } brace"})");
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ(meta->layers, 30);
  EXPECT_EQ(meta->num_query_heads, 9);
  EXPECT_EQ(meta->num_kv_heads, 3);
  EXPECT_EQ(meta->head_dim, 64);
  EXPECT_EQ(meta->tokens, 1024);
  absl::StatusOr<CaptureMeta> again = ParseCaptureMeta(CaptureMetaJson(*meta));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tokens, 1024);
}

TEST(CaptureMeta, NamesWhatIsWrong) {
  const std::string good_tail = R"("num_kv_heads": 2, "head_dim": 32, "tokens": 96})";
  struct Case {
    std::string json, message;
  } cases[] = {
      {R"({"num_query_heads": 4, )" + good_tail, "missing member \"layers\""},
      {R"({"layers": 2.5, "num_query_heads": 4, )" + good_tail, "\"layers\" must be an integer, got '2.5'"},
      {R"({"layers": 2, "num_query_heads": 3, )" + good_tail,
       "\"num_query_heads\" 3 is not a positive multiple of \"num_kv_heads\" 2"},
      {R"({"layers": 2, "num_query_heads": 4, "num_kv_heads": 2, "head_dim": 2, "tokens": 9})", "\"head_dim\" is 2"},
      {R"({"layers": 2, "num_query_heads": 4, "num_kv_heads": 2, "head_dim": 32, "tokens": 1})",
       "\"tokens\" must be >= 2"},
      {R"({"layers" 2})", "expected ':' at byte 10"},
      {R"([1, 2])", "expected '{' at byte 0"},
      {R"({"layers": 2} x)", "trailing text"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<CaptureMeta> meta = ParseCaptureMeta(c.json);
    ASSERT_FALSE(meta.ok()) << c.json;
    EXPECT_EQ(meta.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(meta.status().message().find(c.message), std::string::npos) << meta.status() << " lacks " << c.message;
  }
}

TEST(Capture, WriteThenReadGivesTheSameTensors) {
  const CaptureMeta m = SmallMeta();
  const std::vector<LayerCapture> layers = SyntheticLayers(m);
  const ScopedTempDir temp;
  const std::string& dir = temp.path();
  ASSERT_TRUE(WriteCapture(dir, m, layers).ok());
  absl::StatusOr<CaptureMeta> meta = ReadCaptureMeta(dir);
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ(meta->head_dim, 32);
  absl::StatusOr<LayerCapture> layer = ReadCaptureLayer(dir, *meta, 2);
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_EQ(layer->queries, layers[2].queries);
  EXPECT_EQ(layer->keys, layers[2].keys);
  EXPECT_EQ(layer->values, layers[2].values);
}

TEST(Capture, MissingFilesAreNamed) {
  const ScopedTempDir temp;
  const std::string& dir = temp.path();
  absl::StatusOr<CaptureMeta> meta = ReadCaptureMeta(dir);
  EXPECT_EQ(meta.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(meta.status().message().find(dir + "/meta.json"), std::string::npos) << meta.status();

  const CaptureMeta m = SmallMeta();
  ASSERT_TRUE(WriteCapture(dir, m, SyntheticLayers(m)).ok());
  std::remove(CaptureTensorPath(dir, 1, 'v').c_str());
  absl::StatusOr<LayerCapture> layer = ReadCaptureLayer(dir, m, 1);
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(layer.status().message().find("layer_001_v.npy"), std::string::npos) << layer.status();
}

TEST(Capture, AShapeOtherThanMetaSaysIsRejectedWithBoth) {
  const ScopedTempDir temp;
  const std::string& dir = temp.path();
  const CaptureMeta m = SmallMeta();
  ASSERT_TRUE(WriteCapture(dir, m, SyntheticLayers(m)).ok());
  // Keys with 3 KV heads instead of 2.
  std::vector<float> keys(m.tokens * 3 * m.head_dim, 0.5f);
  ASSERT_TRUE(WriteNpy(CaptureTensorPath(dir, 0, 'k'), {m.tokens, 3, m.head_dim}, keys.data()).ok());
  absl::StatusOr<LayerCapture> layer = ReadCaptureLayer(dir, m, 0);
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(layer.status().message().find("layer_000_k.npy has shape [96, 3, 32], want [tokens 96, num_kv_heads 2, "
                                          "head_dim 32] from meta.json"),
            std::string::npos)
      << layer.status();
}

TEST(Capture, AHeadDimThatDiffersFromMetaIsRejected) {
  const ScopedTempDir temp;
  const std::string& dir = temp.path();
  const CaptureMeta m = SmallMeta();
  ASSERT_TRUE(WriteCapture(dir, m, SyntheticLayers(m)).ok());
  WriteText(dir + "/meta.json", R"({"layers": 3, "num_query_heads": 4, "num_kv_heads": 2,
                                    "head_dim": 64, "tokens": 96})");
  absl::StatusOr<CaptureMeta> meta = ReadCaptureMeta(dir);
  ASSERT_TRUE(meta.ok()) << meta.status();
  absl::StatusOr<LayerCapture> layer = ReadCaptureLayer(dir, *meta, 0);
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(layer.status().message().find("layer_000_q.npy has shape [96, 4, 32], want "
                                          "[tokens 96, num_query_heads 4, head_dim 64]"),
            std::string::npos)
      << layer.status();
}

TEST(Capture, NonFiniteEntriesAreRejected) {
  const ScopedTempDir temp;
  const std::string& dir = temp.path();
  CaptureMeta m = SmallMeta();
  std::vector<LayerCapture> layers = SyntheticLayers(m);
  layers[0].values[5] = NAN;
  ASSERT_TRUE(WriteCapture(dir, m, layers).ok());
  absl::StatusOr<LayerCapture> layer = ReadCaptureLayer(dir, m, 0);
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(layer.status().message().find("layer_000_v.npy: entry 5 is not finite"), std::string::npos)
      << layer.status();
}

// ---------------------------------------------------------------------------
// Measurement.

TEST(SamplePositions, SpreadsOverTheSecondHalfWithBothEnds) {
  const std::vector<int64_t> p = SamplePositions(100, 5);
  EXPECT_EQ(p, (std::vector<int64_t>{50, 62, 75, 87, 99}));
  EXPECT_EQ(SamplePositions(10, 64).size(), 5u);  // only 5, 6, 7, 8, 9
  EXPECT_EQ(SamplePositions(10, 1), std::vector<int64_t>{9});
  EXPECT_TRUE(SamplePositions(1, 4).empty());
}

TEST(CalibrateLayer, Fp16IsExactUpToRounding) {
  const CaptureMeta m = SmallMeta();
  const std::vector<LayerCapture> layers = SyntheticLayers(m);
  for (const LayerCalibration& layer : CalibrateAll(m, layers, "fp16")) {
    const PresetError& e = layer.presets[0];
    EXPECT_LT(e.output_rel_error, 2e-3) << "layer " << layer.layer;
    EXPECT_LT(e.logit_rmse, 5e-3);
    EXPECT_LT(e.tv_distance, 2e-3);
    EXPECT_LT(e.kl_divergence, 1e-5);
    EXPECT_EQ(e.token_bytes, e.token_bytes_bf16);  // 2 bytes a coordinate, like bf16
    EXPECT_EQ(e.token_bytes, 2 * 2 * m.num_kv_heads * m.head_dim);
  }
}

TEST(CalibrateLayer, MoreBitsGiveLessErrorAndTheOutlierLayerIsWorst) {
  const CaptureMeta m = SmallMeta();
  const std::vector<LayerCalibration> layers = CalibrateAll(m, SyntheticLayers(m), "turboquant_k3v4_nc,tqkv_k4v4,fp16");
  ASSERT_EQ(layers.size(), 3u);
  for (const LayerCalibration& layer : layers) {
    EXPECT_EQ(layer.positions.size(), 16u);
    EXPECT_GT(layer.presets[0].output_rel_error, layer.presets[1].output_rel_error);
    EXPECT_GT(layer.presets[1].output_rel_error, layer.presets[2].output_rel_error);
    EXPECT_GT(layer.presets[0].kl_divergence, layer.presets[1].kl_divergence);
    EXPECT_LT(layer.presets[0].token_bytes, layer.presets[1].token_bytes);
  }
  const double outlier = layers[kOutlierLayer].presets[0].output_rel_error;
  EXPECT_GT(outlier, 2 * layers[0].presets[0].output_rel_error);
  EXPECT_GT(outlier, 2 * layers[2].presets[0].output_rel_error);
}

TEST(CalibrateLayer, TensorsOfTheWrongSizeAreRejected) {
  const CaptureMeta m = SmallMeta();
  std::vector<LayerCapture> layers = SyntheticLayers(m);
  layers[0].keys.pop_back();
  absl::StatusOr<LayerCalibration> layer = CalibrateLayer(m, 0, layers[0], Presets("fp16"), CalibrationOptions());
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(layer.status().message().find("layer 0: tensors hold"), std::string::npos) << layer.status();
}

TEST(CalibrateLayer, RecentTokensOverTheWholeTextMakeEveryPresetExact) {
  // The recipe reaches the measured cache: with every token among the exact
  // recent tokens, 3-bit keys measure like fp16.
  const CaptureMeta m = SmallMeta();
  const std::vector<LayerCapture> layers = SyntheticLayers(m);
  CalibrationOptions options;
  options.positions = 8;
  options.layout.page_tokens = 8;
  options.layout.exact_recent_tokens = static_cast<int>(m.tokens);
  absl::StatusOr<LayerCalibration> layer =
      CalibrateLayer(m, kOutlierLayer, layers[kOutlierLayer], Presets("turboquant_k3v4_nc"), options);
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_LT(layer->presets[0].output_rel_error, 2e-3);
  EXPECT_LT(layer->presets[0].kl_divergence, 1e-5);
  EXPECT_EQ(layer->presets[0].exact_tokens, m.tokens);
  EXPECT_EQ(layer->presets[0].fixed_bytes, 0);
  EXPECT_EQ(layer->presets[0].key_centering, "none");
}

TEST(CalibrateLayer, CenteringLowersTheErrorOfKeysWithASharedOffset) {
  // Keys = noise + a large per-channel offset shared by every token: the
  // codec's error scales with the whole key, attention uses only the noise.
  CaptureMeta m = SmallMeta();
  m.layers = 1;
  LayerCapture capture = SyntheticLayers(m)[0];
  OutlierKeyOptions shared;
  shared.hot_channels = 0;
  shared.offset_std = 5.0;
  capture.keys = OutlierKeys(m.tokens * m.num_kv_heads, m.head_dim, 5, shared);
  CalibrationOptions plain, centered;
  plain.positions = centered.positions = 8;
  centered.layout.key_centering = KeyCentering::kPostRope;
  centered.layout.centering_tokens = 32;
  const auto presets = Presets("turboquant_k3v4_nc");
  absl::StatusOr<LayerCalibration> a = CalibrateLayer(m, 0, capture, presets, plain);
  absl::StatusOr<LayerCalibration> b = CalibrateLayer(m, 0, capture, presets, centered);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_LT(b->presets[0].kl_divergence, 0.5 * a->presets[0].kl_divergence);
  EXPECT_LT(b->presets[0].logit_rmse, 0.5 * a->presets[0].logit_rmse);
  EXPECT_EQ(b->presets[0].key_centering, "post_rope");
  EXPECT_EQ(b->presets[0].fixed_bytes, 4 * m.num_kv_heads * m.head_dim);  // fp32 means
}

// ---------------------------------------------------------------------------
// Planning.

class PlanTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    meta_ = new CaptureMeta(SmallMeta());
    layers_ = new std::vector<LayerCalibration>(
        CalibrateAll(*meta_, SyntheticLayers(*meta_), "turboquant_k3v4_nc,tqkv_k3v4,tqkv_k4v4,fp8,fp16"));
  }
  static void TearDownTestSuite() {
    delete meta_;
    delete layers_;
  }
  static absl::StatusOr<ProtectionPlan> Plan(double budget_bits) {
    PlanOptions options;
    options.budget_bits = budget_bits;
    options.context = 1024;
    return PlanProtection(*meta_, *layers_, options);
  }
  // layers_ with every preset holding `exact_tokens` and `fixed_bytes` too.
  static std::vector<LayerCalibration> WithSequenceBytes(int64_t exact_tokens, int64_t fixed_bytes) {
    std::vector<LayerCalibration> layers = *layers_;
    for (LayerCalibration& layer : layers) {
      for (PresetError& e : layer.presets) {
        e.exact_tokens = exact_tokens;
        e.fixed_bytes = fixed_bytes;
      }
    }
    return layers;
  }
  static CaptureMeta* meta_;
  static std::vector<LayerCalibration>* layers_;
};
CaptureMeta* PlanTest::meta_ = nullptr;
std::vector<LayerCalibration>* PlanTest::layers_ = nullptr;

TEST_F(PlanTest, ProtectsTheOutlierLayerFirst) {
  // Base: 3-bit keys + 4-bit uniform values, 4.25 bits at d=32 (the fp16
  // scalars weigh more at a small head dim); tqkv_k4v4 takes 4.5.
  absl::StatusOr<ProtectionPlan> plan = Plan(4.5);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_FALSE(plan->steps.empty());
  // The first paid step (free ones, if any, come before) goes to the outlier layer.
  const PlanStep* first_paid = nullptr;
  for (const PlanStep& s : plan->steps) {
    if (s.extra_bits > 1e-9 && !first_paid) first_paid = &s;
  }
  ASSERT_NE(first_paid, nullptr);
  EXPECT_EQ(first_paid->layer, kOutlierLayer);
  EXPECT_NE(plan->layer_presets[kOutlierLayer]->name, "turboquant_k3v4_nc");
  EXPECT_LT(plan->total_error, plan->base_error);
}

TEST_F(PlanTest, RespectsEveryBudget) {
  double previous_error = 1e300;
  for (double budget : {4.25, 4.5, 5.0, 6.0, 8.0, 12.0, 16.0}) {
    absl::StatusOr<ProtectionPlan> plan = Plan(budget);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_LE(plan->bits_per_coordinate, budget + 1e-9) << budget;
    EXPECT_NEAR(plan->ratio_vs_bf16, 16.0 / plan->bits_per_coordinate, 1e-9);
    EXPECT_LE(plan->total_error, previous_error + 1e-12) << budget;
    previous_error = plan->total_error;
  }
  // 16 bits buys fp16 everywhere: no error left beyond rounding.
  absl::StatusOr<ProtectionPlan> all = Plan(16.0);
  for (const Preset* p : all->layer_presets) EXPECT_EQ(p->name, "fp16");
}

TEST_F(PlanTest, ExactTokensAreCountedAtFp16) {
  PlanOptions options;
  options.budget_bits = 16.0 + 16.0 * 0.25;
  options.context = 1024;
  absl::StatusOr<ProtectionPlan> plain = PlanProtection(*meta_, *layers_, options);
  absl::StatusOr<ProtectionPlan> windowed = PlanProtection(*meta_, WithSequenceBytes(256, 0), options);
  ASSERT_TRUE(plain.ok() && windowed.ok());
  // 256 exact tokens over a context of 1024: a quarter more fp16 bytes.
  EXPECT_NEAR(windowed->base_bits, plain->base_bits + 16.0 * 0.25, 1e-9);
}

TEST_F(PlanTest, FixedBytesPerLayerAreSpreadOverTheContext) {
  PlanOptions options;
  options.budget_bits = 16.0;
  options.context = 1024;
  absl::StatusOr<ProtectionPlan> plain = PlanProtection(*meta_, *layers_, options);
  absl::StatusOr<ProtectionPlan> means =
      PlanProtection(*meta_, WithSequenceBytes(0, 4 * meta_->num_kv_heads * meta_->head_dim), options);
  ASSERT_TRUE(plain.ok() && means.ok());
  // fp32 key means: 4 bytes per key coordinate (2 per K+V coordinate) of one
  // token, once per 1024 tokens: 16 / 1024 bits.
  EXPECT_NEAR(means->base_bits, plain->base_bits + 16.0 / 1024, 1e-9);
}

TEST_F(PlanTest, ABudgetBelowTheBaseIsRefusedWithBothFigures) {
  absl::StatusOr<ProtectionPlan> plan = Plan(3.0);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("budget of 3.000 bits per coordinate is below"), std::string::npos)
      << plan.status();
}

TEST_F(PlanTest, TheBasePresetMustHaveBeenMeasured) {
  PlanOptions options;
  options.base_preset = "tqkv_k3v3";
  absl::StatusOr<ProtectionPlan> plan = PlanProtection(*meta_, *layers_, options);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("base preset tqkv_k3v3 was not measured"), std::string::npos);
}

TEST(ProtectionConfigText, GroupsLayersPerPreset) {
  ProtectionPlan plan;
  const Preset* base = *FindPreset("turboquant_k3v4_nc");
  const Preset* k4 = *FindPreset("tqkv_k4v4");
  const Preset* fp16 = *FindPreset("fp16");
  plan.base = base;
  plan.layer_presets = {fp16, base, base, k4, k4, base, fp16};
  plan.bits_per_coordinate = 5.0;
  plan.ratio_vs_bf16 = 3.2;
  PlanOptions options;
  options.context = 8192;
  EXPECT_EQ(ProtectionConfigText(plan, options),
            "preset: \"turboquant_k3v4_nc\"\n"
            "boundary_layers: 0\n"
            "protected_layers { layers: [0, 6] preset: \"fp16\" }\n"
            "protected_layers { layers: [3, 4] preset: \"tqkv_k4v4\" }\n"
            "# 5.000 bits per coordinate, 3.20x vs bf16 at context 8192 (exact tokens and key means "
            "included)\n");
}

TEST(ProtectionConfigText, NamesThePresetMostLayersUseAsTheCachePreset) {
  ProtectionPlan plan;
  const Preset* base = *FindPreset("turboquant_k3v4_nc");
  const Preset* k4 = *FindPreset("tqkv_k4v4");
  plan.base = base;
  plan.layer_presets = {k4, k4, base, k4};
  const std::string text = ProtectionConfigText(plan, PlanOptions());
  EXPECT_EQ(text.substr(0, text.find('#')),
            "preset: \"tqkv_k4v4\"\n"
            "boundary_layers: 0\n"
            "protected_layers { layers: [2] preset: \"turboquant_k3v4_nc\" }\n");
}

}  // namespace
}  // namespace eval
}  // namespace tqkv
