// The CPU backend against float64 attention over the decoded vectors: the
// kernels may not add error of their own beyond float rounding.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bitpack.h"
#include "kernels/code_tiles.h"
#include "kernels/codec.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/float_formats.h"
#include "kernels/kv_layout.h"
#include "base/random.h"
#include "tests/kernels/synthetic_field.h"

namespace tqkv {
namespace {

struct Case {
  std::string preset;
  int head_dim;
  int page_tokens;
  int kv_heads;
  int query_heads;
};

std::vector<float> Gaussian(size_t n, uint64_t seed, float offset_every = 0) {
  Random rng(seed);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(rng.NextGaussian());
    if (offset_every > 0 && i % 37 == 0) out[i] *= offset_every;  // a few hot coordinates
  }
  return out;
}

// Stores `tokens` tokens of 2 layers into shuffled pages, attends with
// `num_query` causal query tokens, and compares with float64 attention over
// the vectors the codecs decode.
void CheckStoreThenAttend(const Case& c, int tokens, int num_query, bool integer_attention = false) {
  SCOPED_TRACE(c.preset + " d=" + std::to_string(c.head_dim) + " page=" + std::to_string(c.page_tokens) +
               " gqa=" + std::to_string(c.query_heads / c.kv_heads));
  KvLayoutOptions options;
  options.num_layers = 2;
  options.num_kv_heads = c.kv_heads;
  options.num_query_heads = c.query_heads;
  options.head_dim = c.head_dim;
  options.page_tokens = c.page_tokens;
  options.preset = c.preset;
  options.boundary_layers = 0;
  const int d = c.head_dim, heads = c.kv_heads, qh = c.query_heads;
  std::vector<float> keys = Gaussian(static_cast<size_t>(2) * tokens * heads * d, 1, 8.0f);
  std::vector<float> values = Gaussian(keys.size(), 2);
  const Preset* preset = *FindPreset(c.preset);
  if (preset->NeedsCalibration()) {
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < heads; ++h) {
        std::vector<float> head_keys;
        for (int t = 0; t < tokens; ++t) {
          const float* k = &keys[((static_cast<size_t>(l) * tokens + t) * heads + h) * d];
          head_keys.insert(head_keys.end(), k, k + d);
        }
        options.hot_channels.push_back(ChooseHotChannels(head_keys.data(), tokens, d, preset->key.HotChannels(d)));
      }
    }
  }
  auto layout_or = KvLayout::Create(options);
  ASSERT_TRUE(layout_or.ok()) << layout_or.status();
  const KvLayout& layout = **layout_or;
  // Three threads: the (layer, head) and (item, head) tasks run on the pool.
  CpuBackendOptions backend_options;
  backend_options.num_threads = 3;
  backend_options.integer_attention = integer_attention;
  auto backend = MakeCpuBackend(backend_options);
  const int pages = (tokens + c.page_tokens - 1) / c.page_tokens + 3;
  auto pool = backend->AllocatePool(layout, pages);
  ASSERT_TRUE(pool.ok());
  // A shuffled block table: pages need not be contiguous or in order.
  std::vector<int32_t> block_table(pages);
  std::iota(block_table.begin(), block_table.end(), 0);
  Random rng(3);
  for (int i = pages - 1; i > 0; --i) std::swap(block_table[i], block_table[rng.NextBelow(i + 1)]);
  std::vector<int32_t> slots(tokens);
  for (int t = 0; t < tokens; ++t) {
    slots[t] = block_table[t / c.page_tokens] * c.page_tokens + t % c.page_tokens;
  }
  StoreParams store{&layout, *pool, 0, 2, tokens, slots.data(), keys.data(), values.data()};
  ASSERT_TRUE(backend->Store(store).ok());

  const int layer = 1;
  std::vector<float> queries = Gaussian(static_cast<size_t>(num_query) * qh * d, 4);
  std::vector<float> output(queries.size()), lse(static_cast<size_t>(num_query) * qh);
  AttendItem item{block_table.data(), tokens, layer, num_query, queries.data(), output.data(), lse.data()};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  ASSERT_TRUE(backend->Attend(AttendParams{&layout, *pool, {&item, 1}, scale}).ok());

  // Reference: decode every stored vector, attend in float64. The integer
  // kernel (kAvx512Vnni, TurboQuant pages) rounds its query and codebooks
  // (attend_kernels.h; AttendKernels below holds it to that model within
  // 1e-2): here it is held to a bound that the plumbing it shares with the
  // exact kernels (pages, segments, rows, the add-back) would break.
  const bool integer =
      integer_attention && ActiveSimdLevel() == SimdLevel::kAvx512Vnni &&
      cpu_internal::AttendHeadAvx512VnniSupported(cpu_internal::DescribeField(layout.key_codec(0, 0)),
                                                  cpu_internal::DescribeField(layout.value_codec(0, 0)), d);
  const double output_tolerance = integer ? 0.15 : 1e-5;
  const double lse_tolerance = integer ? 0.02 : 1e-5;
  for (int h = 0; h < qh; ++h) {
    const int kv = h / (qh / heads);
    const VectorCodec& kc = layout.key_codec(layer, kv);
    const VectorCodec& vc = layout.value_codec(layer, kv);
    std::vector<std::vector<double>> k_hat(tokens), v_hat(tokens);
    std::vector<uint8_t> codes(std::max(kc.code_bytes(), vc.code_bytes()));
    std::vector<uint16_t> scalars(4);
    std::vector<float> decoded(d);
    for (int t = 0; t < tokens; ++t) {
      const size_t row = ((static_cast<size_t>(layer) * tokens + t) * heads + kv) * d;
      ASSERT_TRUE(kc.Encode(&keys[row], codes.data(), scalars.data()).ok());
      kc.Decode(codes.data(), scalars.data(), decoded.data());
      k_hat[t].assign(decoded.begin(), decoded.end());
      ASSERT_TRUE(vc.Encode(&values[row], codes.data(), scalars.data()).ok());
      vc.Decode(codes.data(), scalars.data(), decoded.data());
      v_hat[t].assign(decoded.begin(), decoded.end());
    }
    for (int i = 0; i < num_query; ++i) {
      const int visible = tokens - num_query + 1 + i;
      const float* q = &queries[(static_cast<size_t>(i) * qh + h) * d];
      std::vector<double> logits(visible);
      double max_logit = -1e300;
      for (int t = 0; t < visible; ++t) {
        double dot = 0;
        for (int j = 0; j < d; ++j) dot += q[j] * k_hat[t][j];
        logits[t] = dot / std::sqrt(static_cast<double>(d));
        max_logit = std::max(max_logit, logits[t]);
      }
      double denominator = 0;
      for (double& l : logits) denominator += (l = std::exp(l - max_logit));
      std::vector<double> expected(d, 0.0);
      for (int t = 0; t < visible; ++t) {
        for (int j = 0; j < d; ++j) expected[j] += logits[t] / denominator * v_hat[t][j];
      }
      double error = 0, norm = 0;
      const float* got = &output[(static_cast<size_t>(i) * qh + h) * d];
      for (int j = 0; j < d; ++j) {
        error += (got[j] - expected[j]) * (got[j] - expected[j]);
        norm += expected[j] * expected[j];
      }
      EXPECT_LE(std::sqrt(error), output_tolerance * std::sqrt(norm) + 1e-7) << "head " << h << " query " << i;
      EXPECT_NEAR(lse[static_cast<size_t>(i) * qh + h], max_logit + std::log(denominator),
                  lse_tolerance * std::max(1.0, std::fabs(max_logit)));
    }
  }
  backend->FreePool(*pool);
}

// Runs `body` once per SIMD level this CPU supports (the fused AVX-512
// kernels and the reference path must both hold the bound), then restores.
template <typename Body>
void ForEachSimdLevel(Body body) {
  const SimdLevel original = ActiveSimdLevel();
  for (SimdLevel level : SupportedSimdLevels()) {
    SetActiveSimdLevel(level);
    SCOPED_TRACE(std::string(SimdLevelName(level)));
    body();
  }
  SetActiveSimdLevel(original);
}

TEST(CpuBackend, StoreThenAttendEqualsFloat64AttentionOverDecodedVectors) {
  ForEachSimdLevel([] {
    for (const Preset& preset : AllPresets()) {
      CheckStoreThenAttend({std::string(preset.name), 128, 16, 2, 8}, 70, 1);
    }
  });
}

TEST(CpuBackend, EveryHeadDimPageSizeAndGqaRatio) {
  ForEachSimdLevel([] {
    for (int d : {64, 80, 96, 112, 128, 160, 192, 256}) {
      CheckStoreThenAttend({"tqkv_k3v3", d, 16, 2, 4}, 40, 1);
      CheckStoreThenAttend({"turboquant_k3v4_nc", d, 16, 2, 4}, 40, 1);
    }
    for (int page : {1, 3, 16, 64, 100}) {
      CheckStoreThenAttend({"turboquant_3bit_nc", 128, page, 2, 2}, 150, 1);
    }
    for (int gqa : {1, 2, 4, 8}) CheckStoreThenAttend({"tqkv_k2p5v3", 64, 8, 2, 2 * gqa}, 33, 1);
    for (int gqa : {1, 4, 16}) CheckStoreThenAttend({"turboquant_4bit_nc", 64, 8, 1, gqa}, 33, 2);
  });
}

// The integer kernel through the backend: every preset it takes (and the
// others, which fall back to fp32), head dims, pages, GQA ratios, several
// query tokens. Only on a CPU that has it (SimdLevel::kAvx512Vnni).
TEST(CpuBackend, IntegerAttentionThroughTheBackend) {
  if (DetectedSimdLevel() < SimdLevel::kAvx512Vnni) GTEST_SKIP() << "no AVX-512 VNNI + VBMI + VBMI2 on this CPU";
  for (const Preset& preset : AllPresets())
    CheckStoreThenAttend({std::string(preset.name), 128, 16, 2, 8}, 70, 1, true);
  for (int d : {64, 128, 256}) {
    for (int page : {1, 7, 16, 64}) CheckStoreThenAttend({"turboquant_3bit_nc", d, page, 2, 4}, 150, 1, true);
    CheckStoreThenAttend({"tqkv_k3v3", d, 16, 2, 6}, 90, 3, true);
  }
  for (int gqa : {1, 2, 3, 4, 7, 16}) CheckStoreThenAttend({"turboquant_4bit_nc", 128, 16, 1, gqa}, 65, 2, true);
}

TEST(CpuBackend, SeveralQueryTokensAreCausalAmongThemselves) {
  ForEachSimdLevel([] {
    CheckStoreThenAttend({"tqkv_k4v4", 64, 4, 2, 4}, 21, 4);
    CheckStoreThenAttend({"fp16", 64, 4, 1, 2}, 5, 5);
    CheckStoreThenAttend({"bf16", 64, 4, 1, 8}, 30, 9);  // 72 rows: more than one row block
  });
}

// The presets' formats take the fused kernels (so the tests above exercise
// them): at both SIMD widths, but split keys at AVX2 only (an AVX-512
// machine runs the AVX2 kernel for them).
TEST(CpuBackend, PresetFormatsHaveFusedKernels) {
  for (const char* name : {"bf16", "fp16", "fp8", "turboquant_k8v4", "turboquant_3bit_nc", "turboquant_4bit_nc",
                           "turboquant_k3v4_nc", "tqkv_k3v3", "tqkv_k3v4", "tqkv_k4v4", "tqkv_k3p5v3", "tqkv_k2p5v3"}) {
    SCOPED_TRACE(name);
    KvLayoutOptions options;
    options.num_layers = 1;
    options.num_kv_heads = 1;
    options.num_query_heads = 4;
    options.head_dim = 128;
    options.preset = name;
    options.boundary_layers = 0;
    const Preset* preset = *FindPreset(name);
    if (preset->NeedsCalibration()) {
      std::vector<float> keys = Gaussian(64 * 128, 5);
      options.hot_channels.push_back(ChooseHotChannels(keys.data(), 64, 128, preset->key.HotChannels(128)));
    }
    auto layout = KvLayout::Create(options);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const cpu_internal::FieldReader key = cpu_internal::DescribeField((*layout)->key_codec(0, 0));
    const cpu_internal::FieldReader value = cpu_internal::DescribeField((*layout)->value_codec(0, 0));
    const bool split = key.split();
    EXPECT_EQ(cpu_internal::AttendHeadAvx512Supported(key, value, 128), !split);
    EXPECT_TRUE(cpu_internal::AttendHeadAvx2Supported(key, value, 128));
  }
}

TEST(CpuBackend, StoreRejectsNonFiniteInputWithItsPosition) {
  KvLayoutOptions options;
  options.num_layers = 1;
  options.num_kv_heads = 1;
  options.num_query_heads = 1;
  options.head_dim = 64;
  options.page_tokens = 4;
  options.boundary_layers = 0;
  auto layout = *KvLayout::Create(options);
  auto backend = MakeCpuBackend(1);
  auto pool = *backend->AllocatePool(*layout, 2);
  std::vector<float> keys(2 * 64, 1.0f), values(2 * 64, 1.0f);
  keys[64 + 5] = NAN;
  std::vector<int32_t> slots = {0, 1};
  absl::Status status = backend->Store({layout.get(), pool, 0, 1, 2, slots.data(), keys.data(), values.data()});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("token 1"), std::string::npos) << status.message();
  backend->FreePool(pool);
}

TEST(KvLayout, PlanesAreAlignedAndPagesHoldEveryLayerAndHead) {
  KvLayoutOptions options;
  options.num_layers = 4;
  options.num_kv_heads = 2;
  options.num_query_heads = 4;
  options.head_dim = 128;
  options.page_tokens = 16;
  options.preset = "turboquant_3bit_nc";
  options.boundary_layers = 1;
  auto layout = *KvLayout::Create(options);
  EXPECT_EQ(layout->layer_preset(0).name, "fp16");
  EXPECT_EQ(layout->layer_preset(1).name, "turboquant_3bit_nc");
  EXPECT_EQ(layout->layer_preset(3).name, "fp16");
  EXPECT_EQ(layout->token_bytes(1), 2u * 102);
  EXPECT_EQ(layout->token_bytes(0), 2u * 512);
  EXPECT_EQ(layout->token_bytes_bf16(), 2u * 512);
  size_t previous_end = 0;
  for (int l = 0; l < 4; ++l) {
    for (int h = 0; h < 2; ++h) {
      const auto& planes = layout->planes(l, h);
      for (size_t offset : {planes.key_codes, planes.key_scalars, planes.value_codes, planes.value_scalars}) {
        EXPECT_EQ(offset % kPlaneAlignment, 0u);
      }
      EXPECT_GE(planes.key_codes, previous_end);
      previous_end = planes.value_scalars + 16 * 2 * layout->value_codec(l, h).num_scalars();
    }
  }
  EXPECT_GE(layout->page_bytes(), previous_end);
  EXPECT_EQ(layout->page_bytes() % kPlaneAlignment, 0u);
  // Layers get different rotations.
  EXPECT_NE(layout->HeadSeed(1, 0), layout->HeadSeed(2, 0));
}

TEST(KvLayout, RejectsInconsistentShapes) {
  KvLayoutOptions options;
  options.num_query_heads = 12;
  options.num_kv_heads = 8;
  EXPECT_EQ(KvLayout::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = {};
  options.preset = "nope";
  EXPECT_EQ(KvLayout::Create(options).status().code(), absl::StatusCode::kNotFound);
  options = {};
  options.boundary_layers = 17;
  EXPECT_EQ(KvLayout::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = {};
  options.preset = "tqkv_k2p5v3";
  EXPECT_EQ(KvLayout::Create(options).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tqkv
