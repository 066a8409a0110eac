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
#include "kernels/cpu_features.h"
#include "kernels/float_formats.h"
#include "kernels/kv_layout.h"
#include "kernels/random.h"
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
  SCOPED_TRACE(c.preset + " d=" + std::to_string(c.head_dim) + " page=" +
               std::to_string(c.page_tokens) + " gqa=" + std::to_string(c.query_heads / c.kv_heads));
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
        options.hot_channels.push_back(
            ChooseHotChannels(head_keys.data(), tokens, d, preset->key.HotChannels(d)));
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
  const bool integer = integer_attention && ActiveSimdLevel() == SimdLevel::kAvx512Vnni &&
                       cpu_internal::AttendHeadAvx512VnniSupported(
                           cpu_internal::DescribeField(layout.key_codec(0, 0)),
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
  for (const Preset& preset : AllPresets()) CheckStoreThenAttend({std::string(preset.name), 128, 16, 2, 8}, 70, 1, true);
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
    const bool split = key.format == cpu_internal::FieldFormat::kSplitCentroids;
    EXPECT_EQ(cpu_internal::AttendHeadAvx512Supported(key, value, 128), !split);
    EXPECT_TRUE(cpu_internal::AttendHeadAvx2Supported(key, value, 128));
  }
}

// Every format pair the fused kernels accept (including ones no preset uses:
// 2-bit codes, 8-bit uniform values), at both SIMD widths and in the integer
// kernel, against float64 attention over what the bytes stand for: random
// bytes in scattered pages, planes laid out as KvLayout lays them out, rows
// with different visible lengths. The integer kernel is held to what it
// reads (its query and codebooks rounded as attend_kernels.h states); its
// error against exact attention is bounded in the budget test below.
TEST(AttendKernels, EveryFormatAgainstFloat64OverTheBytes) {
  using cpu_internal::FieldFormat;
  std::vector<std::pair<std::string, cpu_internal::AttendKernel>> kernels;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    kernels.push_back({"avx2", cpu_internal::AttendHeadAvx2});
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    kernels.push_back({"avx512", cpu_internal::AttendHeadAvx512});
  }
  if (DetectedSimdLevel() >= SimdLevel::kAvx512Vnni) {
    kernels.push_back({"avx512_vnni", cpu_internal::AttendHeadAvx512Vnni});
  }
  if (kernels.empty()) GTEST_SKIP() << "no AVX2";
  Random rng(11);
  const auto field = [&](FieldFormat format, int bits, int cold_bits = 0) {
    SyntheticField f{format, bits, {}, 0, {}};
    if (format == FieldFormat::kCentroids || format == FieldFormat::kSplitCentroids) {
      for (int i = 0; i < (1 << bits); ++i) f.centroids.push_back(static_cast<float>(rng.NextGaussian()));
    }
    f.cold_bits = cold_bits;
    for (int i = 0; i < (cold_bits > 0 ? 1 << cold_bits : 0); ++i) {
      f.cold_centroids.push_back(static_cast<float>(rng.NextGaussian()));
    }
    return f;
  };
  std::vector<SyntheticField> keys, values;
  for (int bits : {2, 3, 4}) keys.push_back(field(FieldFormat::kCentroids, bits));
  keys.push_back(field(FieldFormat::kFp16, 16));
  keys.push_back(field(FieldFormat::kBf16, 16));
  keys.push_back(field(FieldFormat::kFp8, 8));
  for (auto [hot, cold] : {std::pair{4, 3}, {4, 2}, {3, 2}}) keys.push_back(field(FieldFormat::kSplitCentroids, hot, cold));
  for (int bits : {2, 3, 4}) values.push_back(field(FieldFormat::kCentroids, bits));
  for (int bits : {2, 3, 4, 8}) values.push_back(field(FieldFormat::kUniform, bits));
  values.push_back(field(FieldFormat::kFp16, 16));
  values.push_back(field(FieldFormat::kBf16, 16));
  values.push_back(field(FieldFormat::kFp8, 8));

  const int tokens = 150, rows = 7;  // row tiles of 4, 2 and 1
  for (int d : {64, 80, 128, 256}) {
    for (int page_tokens : {7, 16}) {
      for (const SyntheticField& kf : keys) {
        for (const SyntheticField& vf : values) {
          SCOPED_TRACE("d=" + std::to_string(d) + " page=" + std::to_string(page_tokens) + " key " +
                       std::to_string(static_cast<int>(kf.format)) + "/" + std::to_string(kf.bits) + " value " +
                       std::to_string(static_cast<int>(vf.format)) + "/" + std::to_string(vf.bits));
          // One (layer, head)'s four planes per page, each 32-byte aligned.
          const auto align = [](size_t n) { return (n + 31) / 32 * 32; };
          cpu_internal::FieldReader key, value;
          key.format = kf.format;
          key.bits = kf.bits;
          key.centroids = kf.centroids.data();
          key.code_bytes = kf.CodeBytes(d);
          key.num_scalars = kf.NumScalars();
          if (kf.split()) {
            key.hot_dims = d / 2;
            key.cold_bits = kf.cold_bits;
            key.cold_centroids = kf.cold_centroids.data();
            key.cold_code_offset = PackedBytes(d / 2, kf.bits);
          }
          value.format = vf.format;
          value.bits = vf.bits;
          value.centroids = vf.centroids.data();
          value.code_bytes = vf.CodeBytes(d);
          value.num_scalars = vf.NumScalars();
          key.codes_offset = 0;
          key.scalars_offset = align(key.codes_offset + static_cast<size_t>(page_tokens) * key.code_bytes);
          value.codes_offset = align(key.scalars_offset + static_cast<size_t>(page_tokens) * 2 * key.num_scalars);
          value.scalars_offset = align(value.codes_offset + static_cast<size_t>(page_tokens) * value.code_bytes);
          const size_t page_bytes = align(value.scalars_offset + static_cast<size_t>(page_tokens) * 2 * value.num_scalars);
          const int pages = (tokens + page_tokens - 1) / page_tokens + 2;
          std::vector<uint8_t> pool(page_bytes * pages);
          std::vector<int32_t> block_table(pages);
          std::iota(block_table.begin(), block_table.end(), 0);
          for (int i = pages - 1; i > 0; --i) std::swap(block_table[i], block_table[rng.NextBelow(i + 1)]);
          // Packed codes planes are tiled (kernels/code_tiles.h), as KvLayout
          // lays them out. The bytes are filled token-major into `written`
          // (which the float64 reference reads), then put into their tiles.
          const auto tiled = [](FieldFormat format) {
            return format == FieldFormat::kCentroids || format == FieldFormat::kUniform ||
                   format == FieldFormat::kSplitCentroids;
          };
          key.tiled = tiled(kf.format);
          value.tiled = tiled(vf.format);
          std::vector<uint8_t> written(pool.size());
          const auto at = [&](const cpu_internal::FieldReader& f, int t, bool scalars) {
            uint8_t* page = written.data() + static_cast<size_t>(block_table[t / page_tokens]) * page_bytes;
            const int slot = t % page_tokens;
            return scalars ? page + f.scalars_offset + static_cast<size_t>(slot) * 2 * f.num_scalars
                           : page + f.codes_offset + static_cast<size_t>(slot) * f.code_bytes;
          };
          const auto scalars_at = [&](const cpu_internal::FieldReader& f, int t) {
            return reinterpret_cast<uint16_t*>(at(f, t, true));
          };
          for (int t = 0; t < tokens; ++t) {
            kf.Fill(rng, d, at(key, t, false), scalars_at(key, t));
            vf.Fill(rng, d, at(value, t, false), scalars_at(value, t));
          }
          pool = written;
          for (const cpu_internal::FieldReader* f : {&key, &value}) {
            if (!f->tiled) continue;
            const CodePlane plane{page_tokens, f->code_bytes, true};
            for (int page = 0; page < pages; ++page) {
              for (int slot = 0; slot < page_tokens; ++slot) {
                const size_t codes = static_cast<size_t>(page) * page_bytes + f->codes_offset;
                ScatterCodes(written.data() + codes + static_cast<size_t>(slot) * f->code_bytes, plane, slot,
                             pool.data() + codes);
              }
            }
          }
          std::vector<float> queries = Gaussian(static_cast<size_t>(rows) * d, rng.NextU64());
          for (float& q : queries) q *= 0.3f;
          const std::vector<int64_t> visible = {tokens, tokens - 1, 1, 64, 17, 100, 65};

          cpu_internal::HeadAttendParams params;
          params.head_dim = d;
          params.page_tokens = page_tokens;
          params.pool_base = pool.data();
          params.page_bytes = page_bytes;
          params.block_table = block_table.data();
          params.key = key;
          params.value = value;
          params.rows = rows;
          params.queries = queries.data();
          params.visible = visible.data();
          // What the integer kernel computes exactly (attend_kernels.h): the
          // query rounded to int8 per row, the key and value codebooks to
          // int8 units. Only its fixed-point weights are left out (8 bits per
          // row and block, held to their bound below).
          SyntheticField kf_int = kf, vf_int = vf;
          std::vector<float> queries_int = queries;
          {
            // Split keys: each part's codebook and query coordinates on their own.
            for (auto [from, to] : {std::pair{&kf.centroids, &kf_int.centroids}, {&kf.cold_centroids, &kf_int.cold_centroids}}) {
              if (from->empty()) continue;
              const float unit = cpu_internal::IntegerKeyUnit(from->data(), static_cast<int>(from->size()));
              for (float& c : *to) c = std::lrint(c / unit) * unit;
            }
            if (!vf.centroids.empty()) {
              const float unit = cpu_internal::ValueUnit(vf.centroids.data(), static_cast<int>(vf.centroids.size()));
              for (float& c : vf_int.centroids) c = std::lrint(c / unit) * unit;
            }
            const int hot = kf.split() ? d / 2 : d;
            for (int r = 0; r < rows; ++r) {
              for (auto [begin, end] : {std::pair{0, hot}, {hot, d}}) {
                float max_q = 0;
                for (int j = begin; j < end; ++j) max_q = std::max(max_q, std::fabs(queries[r * d + j]));
                for (int j = begin; j < end; ++j) {
                  queries_int[r * d + j] = std::lrint(queries[r * d + j] / (max_q / 127)) * (max_q / 127);
                }
              }
            }
          }
          for (const auto& [name, kernel] : kernels) {
            SCOPED_TRACE(name);
            if (name == "avx512" && kf.split()) {  // the AVX2 kernel serves these on AVX-512 machines
              EXPECT_FALSE(cpu_internal::AttendHeadAvx512Supported(key, value, d));
              continue;
            }
            const bool integer = name == "avx512_vnni";
            if (integer) {  // TurboQuant keys (parts of 64 or k * 128 coordinates), values of at most 4 bits
              const auto whole = [](int dims) { return dims == 64 || dims % 128 == 0; };
              const bool takes = (key.format == FieldFormat::kCentroids ? whole(d)
                                  : key.format == FieldFormat::kSplitCentroids ? whole(d / 2)
                                                                               : false) &&
                                 (value.format == FieldFormat::kCentroids ||
                                  (value.format == FieldFormat::kUniform && value.bits <= 4));
              ASSERT_EQ(cpu_internal::AttendHeadAvx512VnniSupported(key, value, d), takes);
              if (!takes) continue;
            }
            if (kf.split() && (d / 2) % 16 != 0) {  // parts of whole 16-coordinate blocks only
              EXPECT_FALSE(cpu_internal::AttendHeadAvx2Supported(key, value, d));
              continue;
            }
            ASSERT_TRUE(name == "avx2"  ? cpu_internal::AttendHeadAvx2Supported(key, value, d)
                        : integer       ? true
                                        : cpu_internal::AttendHeadAvx512Supported(key, value, d));
            std::vector<float> out(static_cast<size_t>(rows) * d), lse(rows);
            params.out = out.data();
            params.lse = lse.data();
            kernel(params);
            const SyntheticField& kr = integer ? kf_int : kf;
            const SyntheticField& vr = integer ? vf_int : vf;
            const std::vector<float>& qr = integer ? queries_int : queries;
            for (int r = 0; r < rows; ++r) {
              std::vector<double> logits(visible[r]);
              double max_logit = -1e300;
              for (int t = 0; t < visible[r]; ++t) {
                double dot = 0;
                for (int j = 0; j < d; ++j) {
                  dot += qr[static_cast<size_t>(r) * d + j] * kr.Decode(at(key, t, false), scalars_at(key, t), j, d);
                }
                logits[t] = dot;
                max_logit = std::max(max_logit, dot);
              }
              double denominator = 0;
              for (double& l : logits) denominator += (l = std::exp(l - max_logit));
              // The integer kernel's weights, as attend_kernels.h states
              // them: per block of 64 tokens, 8-bit fixed point in units of
              // the block's largest weight x value scale / 255, the rounding
              // error carried over the block's tokens in the kernel's order
              // (lane-major: t % 16, then t / 16); the rest in float64.
              const auto value_zero = [&](int t) {
                return vf.format == FieldFormat::kUniform ? HalfToFloat(scalars_at(value, t)[1]) : 0.0;
              };
              std::vector<double> fixed_weight(visible[r], 0.0);  // what the kernel weighs value / scale by
              double weights_bound = 0, flips_bound = 0;
              if (integer) {
                for (int b0 = 0; b0 < visible[r]; b0 += 64) {
                  const int b1 = std::min<int>(b0 + 64, static_cast<int>(visible[r]));
                  double top = 0, unscaled = 0, largest = 0;
                  for (int t = b0; t < b1; ++t) {
                    const double scale = HalfToFloat(scalars_at(value, t)[0]);
                    top = std::max(top, logits[t] * scale);
                    double sq = 0;
                    for (int j = 0; j < d; ++j) {
                      const double v = vr.Decode(at(value, t, false), scalars_at(value, t), j, d) - value_zero(t);
                      sq += v * v;
                    }
                    unscaled += std::sqrt(sq) / scale;
                    largest = std::max(largest, std::sqrt(sq) / scale);
                  }
                  int64_t sum_to = 0;
                  for (int lane = 0; lane < 16; ++lane) {
                    for (int t = b0 + lane; t < b1; t += 16) {
                      const double scale = HalfToFloat(scalars_at(value, t)[0]);
                      const int64_t w = std::max<int64_t>(0, std::llrint(logits[t] * scale * 65280 / top));
                      sum_to += w;
                      fixed_weight[t] = static_cast<double>(((sum_to + 128) >> 8) - ((sum_to - w + 128) >> 8)) * top / 255;
                    }
                  }
                  // What the kernel may differ by from this model: its fp32
                  // weights may round a few of the 1/256 steps the other way,
                  // moving a unit between neighbours in that order.
                  weights_bound += 1.25 * top / 255 * unscaled;
                  flips_bound += 4 * top / 255 * largest;
                }
              }
              double error = 0, norm = 0, model_error = 0;
              for (int j = 0; j < d; ++j) {
                double expected = 0, modelled = 0;
                for (int t = 0; t < visible[r]; ++t) {
                  const double v = vr.Decode(at(value, t, false), scalars_at(value, t), j, d);
                  expected += logits[t] / denominator * v;
                  if (integer) {
                    const double scale = HalfToFloat(scalars_at(value, t)[0]);
                    modelled += (fixed_weight[t] * (v - value_zero(t)) / scale + logits[t] * value_zero(t)) / denominator;
                  }
                }
                const double got = out[static_cast<size_t>(r) * d + j];
                error += (got - expected) * (got - expected);
                model_error += (got - modelled) * (got - modelled);
                norm += expected * expected;
              }
              if (integer) {
                EXPECT_LE(std::sqrt(error), weights_bound / denominator + 1e-4 * std::sqrt(norm) + 1e-7) << "row " << r;
                EXPECT_LE(std::sqrt(model_error), flips_bound / denominator + 1e-4 * std::sqrt(norm) + 1e-7)
                    << "row " << r;
              } else {
                EXPECT_LE(std::sqrt(error), 1e-5 * std::sqrt(norm) + 1e-7) << "row " << r;
              }
              EXPECT_NEAR(lse[r], max_logit + std::log(denominator), 1e-5 * std::max(1.0, std::fabs(max_logit)))
                  << "row " << r;
            }
          }
        }
      }
    }
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
