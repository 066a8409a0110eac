// Quality through the backend (store, then Score and Attend over the page
// pool) against exact attention over the original vectors matches what
// `tqkv eval` reports for the same data: the paged kernels add no error of
// their own that matters.
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

#include "eval/preset_eval.h"
#include "eval/quality.h"
#include "eval/synthetic.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/kv_layout.h"
#include "tests/kernels/one_head_layout.h"

namespace tqkv {
namespace {

TEST(BackendQuality, MatchesTheEvalFiguresForEveryPreset) {
  const int d = 128, n = 1024, nq = 48;
  const std::vector<float> keys = eval::OutlierKeys(n, d, 1);
  const std::vector<float> values = eval::GaussianVectors(n, d, 2);
  const std::vector<float> queries = eval::Queries(nq, d, 3);
  auto backend = MakeCpuBackend(2);
  for (const Preset& preset : AllPresets()) {
    SCOPED_TRACE(std::string(preset.name));
    auto layout = *KvLayout::Create(OneHeadLayoutOptions(preset, 1, d, keys.data(), n));
    auto pool = *backend->AllocatePool(*layout, n / 16);
    std::vector<int32_t> slots(n), block_table(n / 16);
    std::iota(slots.begin(), slots.end(), 0);
    std::iota(block_table.begin(), block_table.end(), 0);
    ASSERT_TRUE(backend->Store({layout.get(), pool, 0, 1, n, slots.data(), keys.data(), values.data()}).ok());

    // Logits through Score, outputs through Attend, one query at a time.
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<double> approx_logits(static_cast<size_t>(nq) * n), approx_outputs(static_cast<size_t>(nq) * d);
    std::vector<float> logits(n), output(d);
    float lse;
    for (int q = 0; q < nq; ++q) {
      ASSERT_TRUE(
          backend->Score({layout.get(), pool, 0, block_table.data(), 0, n, &queries[q * d], scale, logits.data()})
              .ok());
      std::copy(logits.begin(), logits.end(), approx_logits.begin() + static_cast<size_t>(q) * n);
      AttendItem item{block_table.data(), n, 0, 1, &queries[q * d], output.data(), &lse};
      ASSERT_TRUE(backend->Attend({layout.get(), pool, {&item, 1}, scale}).ok());
      std::copy(output.begin(), output.end(), approx_outputs.begin() + static_cast<size_t>(q) * d);
    }
    auto exact_logits = *eval::ScaledLogits(nq, n, d, queries, keys);
    std::vector<double> exact_values(values.begin(), values.end());
    auto exact_outputs = *eval::SoftmaxWeightedOutputs(nq, n, d, exact_logits, exact_values);
    auto through_backend =
        *eval::MeasureAttentionQuality(nq, n, exact_logits, approx_logits, exact_outputs, approx_outputs);

    eval::EvalInputs inputs;
    inputs.head_dim = d;
    inputs.num_keys = n;
    inputs.num_queries = nq;
    inputs.keys = keys.data();
    inputs.queries = queries.data();
    inputs.values = values.data();
    inputs.seed = 99;  // a different rotation: the figures must agree within noise
    auto offline = *eval::EvaluatePreset(preset, inputs);
    const eval::AttentionQuality& expected = offline.quality;
    // Within noise (different rotations): 15% relative for logits and TV, 20%
    // for the noisier output error, with floors for the near-lossless presets.
    EXPECT_NEAR(through_backend.logit_rmse, expected.logit_rmse, 0.15 * expected.logit_rmse + 0.01);
    EXPECT_NEAR(through_backend.tv_distance, expected.tv_distance, 0.15 * expected.tv_distance + 0.005);
    EXPECT_NEAR(through_backend.output_rel_error, expected.output_rel_error, 0.2 * expected.output_rel_error + 0.01);
    backend->FreePool(pool);
  }
}

// The integer attention kernel (SimdLevel::kAvx512Vnni) rounds the query and
// the key and value codebooks to int8 and the weights to 8-bit fixed point
// per row and block (attend_kernels.h). Over the
// same stored pages, its output error against exact attention over the
// original vectors must stay within 2% of the fp32 kernel's (the codec's own
// error), with GQA 4 so that its 4-row tiles run.
TEST(BackendQuality, IntegerKernelStaysInsideTheCodecsErrorBudget) {
  if (DetectedSimdLevel() < SimdLevel::kAvx512Vnni) GTEST_SKIP() << "no AVX-512 VNNI + VBMI + VBMI2 on this CPU";
  const int d = 128, n = 2048, nq = 64, heads = 4;
  const std::vector<float> keys = eval::OutlierKeys(n, d, 1);
  const std::vector<float> values = eval::GaussianVectors(n, d, 2);
  const std::vector<float> queries = eval::Queries(nq * heads, d, 3);
  const auto exact_logits = *eval::ScaledLogits(nq * heads, n, d, queries, keys);
  const std::vector<double> exact_values(values.begin(), values.end());
  const auto exact_outputs = *eval::SoftmaxWeightedOutputs(nq * heads, n, d, exact_logits, exact_values);
  CpuBackendOptions integer;
  integer.num_threads = 2;
  std::unique_ptr<Backend> backends[2] = {MakeCpuBackend(2), MakeCpuBackend(integer)};  // fp32, integer
  for (const char* name : {"turboquant_3bit_nc", "turboquant_4bit_nc", "turboquant_k3v4_nc", "tqkv_k3v3", "tqkv_k3v4",
                           "tqkv_k3p5v3", "tqkv_k2p5v3"}) {
    SCOPED_TRACE(name);
    const Preset& preset = **FindPreset(name);
    auto layout = *KvLayout::Create(OneHeadLayoutOptions(preset, heads, d, keys.data(), n));
    std::vector<int32_t> slots(n), block_table(n / 16);
    std::iota(slots.begin(), slots.end(), 0);
    std::iota(block_table.begin(), block_table.end(), 0);
    double error[2];
    for (int i = 0; i < 2; ++i) {
      Backend* backend = backends[i].get();
      auto pool = *backend->AllocatePool(*layout, n / 16);
      ASSERT_TRUE(backend->Store({layout.get(), pool, 0, 1, n, slots.data(), keys.data(), values.data()}).ok());
      std::vector<double> outputs(static_cast<size_t>(nq) * heads * d);
      std::vector<float> output(heads * d), lse(heads);
      for (int q = 0; q < nq; ++q) {
        AttendItem item{block_table.data(), n,         0, 1, &queries[static_cast<size_t>(q) * heads * d],
                        output.data(),      lse.data()};
        ASSERT_TRUE(backend->Attend({layout.get(), pool, {&item, 1}, 1.0f / std::sqrt(static_cast<float>(d))}).ok());
        std::copy(output.begin(), output.end(), outputs.begin() + static_cast<size_t>(q) * heads * d);
      }
      double err = 0, norm = 0;
      for (size_t j = 0; j < outputs.size(); ++j) {
        err += (outputs[j] - exact_outputs[j]) * (outputs[j] - exact_outputs[j]);
        norm += exact_outputs[j] * exact_outputs[j];
      }
      error[i] = std::sqrt(err / norm);
      backend->FreePool(pool);
    }
    std::printf("%-20s output error: fp32 kernel %.4f, integer kernel %.4f\n", name, error[0], error[1]);
    EXPECT_LE(error[1], 1.02 * error[0]);
  }
}

}  // namespace
}  // namespace tqkv
