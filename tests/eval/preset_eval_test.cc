#include "eval/preset_eval.h"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "eval/synthetic.h"
#include "kernels/preset.h"

namespace tqkv {
namespace eval {
namespace {

struct Data {
  std::vector<float> keys, queries, values;
  EvalInputs inputs;
};

Data OutlierData(int64_t num_keys, int64_t num_queries) {
  Data data;
  constexpr int kDim = 128;
  data.keys = OutlierKeys(num_keys, kDim, 1);
  data.queries = Queries(num_queries, kDim, 3);
  data.values = GaussianVectors(num_keys, kDim, 2);
  data.inputs.head_dim = kDim;
  data.inputs.num_keys = num_keys;
  data.inputs.num_queries = num_queries;
  data.inputs.keys = data.keys.data();
  data.inputs.queries = data.queries.data();
  data.inputs.values = data.values.data();
  return data;
}

TEST(NeedleRetrieval, LosslessKeysKeepEveryNeedleOnTopWithItsExactWeight) {
  const Data data = OutlierData(1024, 32);
  const PresetEvaluation e = *EvaluatePreset(**FindPreset("fp16"), data.inputs);
  ASSERT_EQ(e.needles.size(), 4u);
  double previous_weight = 0.0;
  for (size_t g = 0; g < e.needles.size(); ++g) {
    const NeedleResult& n = e.needles[g];
    EXPECT_EQ(n.gap, kNeedleGaps[g]);
    EXPECT_EQ(n.top1_rate, 1.0);
    EXPECT_NEAR(n.approx_weight, n.exact_weight, 2e-3 * n.exact_weight);
    // A bigger gap gives the needle more of the softmax.
    EXPECT_GT(n.exact_weight, previous_weight);
    previous_weight = n.exact_weight;
  }
  // At gap 9 over 1023 crowd keys the needle holds most of the mass.
  EXPECT_GT(e.needles[3].exact_weight, 0.8);
}

TEST(NeedleRetrieval, NoisyKeysLoseSmallGapNeedlesFirst) {
  // 2-bit + QJL keys have logit RMSE ~0.9 on this data: a needle 3 logits
  // above the crowd is sometimes beaten, one 9 above never.
  const Data data = OutlierData(4096, 64);
  const PresetEvaluation qjl = *EvaluatePreset(**FindPreset("eval_qjl_k3v4"), data.inputs);
  ASSERT_EQ(qjl.needles.size(), 4u);
  EXPECT_LT(qjl.needles[0].top1_rate, 1.0);
  EXPECT_EQ(qjl.needles[3].top1_rate, 1.0);
  // 3-bit TurboQuant keeps every needle on top, with a weight near the exact one.
  const PresetEvaluation tq3 = *EvaluatePreset(**FindPreset("turboquant_3bit_nc"), data.inputs);
  for (const NeedleResult& n : tq3.needles) {
    EXPECT_EQ(n.top1_rate, 1.0) << "gap " << n.gap;
    EXPECT_NEAR(n.approx_weight, n.exact_weight, 0.25 * n.exact_weight) << "gap " << n.gap;
  }
}

TEST(NeedleRetrieval, OneKeyHasNoCrowdAndNoNeedles) {
  Data data = OutlierData(1, 4);
  EXPECT_TRUE(EvaluatePreset(**FindPreset("fp16"), data.inputs)->needles.empty());
}

}  // namespace
}  // namespace eval
}  // namespace tqkv
