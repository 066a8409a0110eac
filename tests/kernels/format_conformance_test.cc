// The conformance of the backends to the shared format table
// (kernels/format_table.h), test-backend-ops' shape: every pair the table
// gives a backend, at every code width of its families, on every instruction
// set of this machine, against float64 attention over what the bytes stand
// for. A pair listed for a backend whose kernels do not read it fails here
// (the CPU: PickAttendKernel finds no kernel on AVX2, which reads them all);
// a served preset whose pair the table lacks fails the preset test below.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bitpack.h"
#include "kernels/code_tiles.h"
#include "kernels/codec.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/float_formats.h"
#include "kernels/format_table.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"
#include "base/random.h"
#include "tests/kernels/one_head_layout.h"
#include "tests/kernels/synthetic_field.h"

namespace tqkv {
namespace {

// Every width a field may have (SplitKeyBits for two-part keys).
constexpr int kKeyWidths[] = {2, 3, 4, 8, 16, SplitKeyBits(3, 2), SplitKeyBits(4, 2), SplitKeyBits(4, 3)};
constexpr int kValueWidths[] = {2, 3, 4, 8, 16};

std::vector<float> Gaussian(size_t n, uint64_t seed) {
  Random rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.NextGaussian());
  return v;
}

// Every served preset's fields form a pair of the table that every backend
// has a fused kernel for; every row with a CUDA kernel is some served
// preset's, so the CUDA preset tests (gpu_emulation_test in CI) run it.
TEST(FormatConformance, EveryServedPresetIsAPairOfTheTableOnEveryBackend) {
  std::vector<bool> served(kNumFormatPairs, false);
  for (const Preset& preset : AllPresets()) {
    if (preset.evaluation_only) continue;
    SCOPED_TRACE(std::string(preset.name));
    const std::vector<float> keys = Gaussian(64 * 128, 5);
    auto layout = KvLayout::Create(OneHeadLayoutOptions(preset, 4, 128, keys.data(), 64));
    ASSERT_TRUE(layout.ok()) << layout.status();
    const cpu_internal::FieldReader key = cpu_internal::DescribeField((*layout)->key_codec(0, 0));
    const cpu_internal::FieldReader value = cpu_internal::DescribeField((*layout)->value_codec(0, 0));
    FormatPair pair;
    ASSERT_TRUE(key.readable && value.readable && FindFormatPair(key.format, value.format, &pair));
    EXPECT_EQ(PairInfo(pair).fused_on, kFusedCpu | kFusedCuda) << PairInfo(pair).name;
    served[static_cast<int>(pair)] = true;
    EXPECT_TRUE(KeyFamilyHasBits(key.format, key.dispatch_bits()));
    EXPECT_TRUE(FamilyHasBits(value.format, value.bits));
  }
  for (const FormatPairInfo& info : kFormatPairs) {
    if ((info.fused_on & kFusedCuda) != 0) {
      EXPECT_TRUE(served[static_cast<int>(info.pair)]) << info.name << " runs nowhere";
    }
  }
}

// Every format pair the fused kernels accept (including ones no preset uses:
// 2-bit codes, 8-bit uniform values), at both SIMD widths and in the integer
// kernel, against float64 attention over what the bytes stand for: random
// bytes in scattered pages, planes laid out as KvLayout lays them out, rows
// with different visible lengths. The integer kernel is held to what it
// reads (its query and codebooks rounded as attend_kernels.h states); its
// error against exact attention is bounded in the budget test below.
TEST(FormatConformance, EveryCpuPairOfTheTableAtEverySimdLevelAgainstFloat64) {
  std::vector<std::pair<std::string, cpu_internal::AttendKernel>> kernels;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    kernels.push_back({"avx2", cpu_internal::AttendHeadAvx2});
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    kernels.push_back({"avx512", cpu_internal::AttendHeadAvx512});
  }
  if (DetectedSimdLevel() >= SimdLevel::kAvx512Vnni) {
    kernels.push_back({"avx512_vnni", cpu_internal::AttendHeadAvx512Vnni});
  }
  if (kernels.empty()) GTEST_SKIP() << "no AVX2";
  Random rng(11);
  // The table's CPU pairs at every width of their families.
  std::vector<std::pair<SyntheticField, SyntheticField>> pairs;
  for (const FormatPairInfo& pair : kFormatPairs) {
    if ((pair.fused_on & kFusedCpu) == 0) continue;
    for (int key_bits : kKeyWidths) {
      if (!KeyFamilyHasBits(pair.key, key_bits)) continue;
      const bool split = IsSplitKeyBits(key_bits);
      for (int value_bits : kValueWidths) {
        if (!FamilyHasBits(pair.value, value_bits)) continue;
        pairs.push_back(
            {SyntheticField::Make(pair.key, split ? key_bits / 10 : key_bits, split ? key_bits % 10 : 0, rng),
             SyntheticField::Make(pair.value, value_bits, 0, rng)});
      }
    }
  }
  ASSERT_EQ(pairs.size(), 90u) << "the table's CPU pairs and widths changed: update this count";

  const int tokens = 150, rows = 7;  // row tiles of 4, 2 and 1
  for (int d : {64, 80, 128, 256}) {
    for (int page_tokens : {7, 16}) {
      for (const auto& [kf, vf] : pairs) {
        {
          SCOPED_TRACE("d=" + std::to_string(d) + " page=" + std::to_string(page_tokens) + " key " +
                       std::to_string(static_cast<int>(kf.format)) + "/" + std::to_string(kf.bits) + " value " +
                       std::to_string(static_cast<int>(vf.format)) + "/" + std::to_string(vf.bits));
          // One (layer, head)'s four planes per page, each 32-byte aligned.
          const auto align = [](size_t n) { return (n + 31) / 32 * 32; };
          cpu_internal::FieldReader key = kf.Reader(d), value = vf.Reader(d);
          key.codes_offset = 0;
          key.scalars_offset = align(key.codes_offset + static_cast<size_t>(page_tokens) * key.code_bytes);
          value.codes_offset = align(key.scalars_offset + static_cast<size_t>(page_tokens) * 2 * key.num_scalars);
          value.scalars_offset = align(value.codes_offset + static_cast<size_t>(page_tokens) * value.code_bytes);
          const size_t page_bytes =
              align(value.scalars_offset + static_cast<size_t>(page_tokens) * 2 * value.num_scalars);
          const int pages = (tokens + page_tokens - 1) / page_tokens + 2;
          std::vector<uint8_t> pool(page_bytes * pages);
          std::vector<int32_t> block_table(pages);
          std::iota(block_table.begin(), block_table.end(), 0);
          for (int i = pages - 1; i > 0; --i) std::swap(block_table[i], block_table[rng.NextBelow(i + 1)]);
          // Packed codes planes are tiled (kernels/code_tiles.h), as KvLayout
          // lays them out. The bytes are filled token-major into `written`
          // (which the float64 reference reads), then put into their tiles.
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
            for (auto [from, to] :
                 {std::pair{&kf.centroids, &kf_int.centroids}, {&kf.cold_centroids, &kf_int.cold_centroids}}) {
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
              const bool takes = (key.split()                               ? whole(d / 2)
                                  : key.format == FormatFamily::kTurboQuant ? whole(d)
                                                                            : false) &&
                                 (value.format == FormatFamily::kTurboQuant ||
                                  (value.format == FormatFamily::kUniform && value.bits <= 4));
              ASSERT_EQ(cpu_internal::AttendHeadAvx512VnniSupported(key, value, d), takes);
              if (!takes) continue;
            }
            if (kf.split() && (d / 2) % 16 != 0) {  // parts of whole 16-coordinate blocks only
              EXPECT_FALSE(cpu_internal::AttendHeadAvx2Supported(key, value, d));
              continue;
            }
            ASSERT_TRUE(name == "avx2" ? cpu_internal::AttendHeadAvx2Supported(key, value, d)
                        : integer      ? true
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
                return vf.format == FormatFamily::kUniform ? HalfToFloat(scalars_at(value, t)[1]) : 0.0;
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
                      fixed_weight[t] =
                          static_cast<double>(((sum_to + 128) >> 8) - ((sum_to - w + 128) >> 8)) * top / 255;
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
                    modelled +=
                        (fixed_weight[t] * (v - value_zero(t)) / scale + logits[t] * value_zero(t)) / denominator;
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

}  // namespace
}  // namespace tqkv
