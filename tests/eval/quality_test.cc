#include "eval/quality.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tqkv {
namespace eval {
namespace {

using ::testing::HasSubstr;

constexpr double kTol = 1e-12;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

TEST(MeasureAttentionQuality, IdenticalInputsArePerfect) {
  const std::vector<double> logits = {1, 2, 3, 4, 5, 6};  // [2, 3]
  const std::vector<double> outputs = {0.5, -1, 2, 3};    // [2, 2]
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(2, 3, logits, logits, outputs, outputs);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->logit_rmse, 0.0);
  // Mean 3.5; squared deviations 6.25, 2.25, 0.25 twice; 17.5 / 6.
  EXPECT_NEAR(q->logit_std, std::sqrt(17.5 / 6), kTol);
  EXPECT_EQ(q->top1_agreement, 1.0);
  EXPECT_EQ(q->top8_agreement, 1.0);
  EXPECT_EQ(q->tv_distance, 0.0);
  EXPECT_EQ(q->output_rel_error, 0.0);
  EXPECT_EQ(q->num_queries, 2);
  EXPECT_EQ(q->num_keys, 3);
}

TEST(MeasureAttentionQuality, OutputErrorIsNanWithoutOutputs) {
  const std::vector<double> logits = {0, 1};
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(1, 2, logits, logits);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(std::isnan(q->output_rel_error));
}

TEST(MeasureAttentionQuality, KnownPerturbationGivesKnownRmse) {
  // Two of four logits move by 2: mean squared error 8 / 4 = 2.
  const std::vector<double> exact = {0, 1, 2, 3};
  const std::vector<double> approx = {2, 1, 2, 1};
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(2, 2, exact, approx);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_NEAR(q->logit_rmse, std::sqrt(2.0), kTol);
  // Row 0: argmax moves from key 1 to key 0; row 1: from key 1 to key 0.
  EXPECT_EQ(q->top1_agreement, 0.0);
}

TEST(MeasureAttentionQuality, ConstantShiftChangesRmseButNotAttention) {
  const std::vector<double> exact = {0.1, -2, 3.5, 0.7, 1, 2};
  std::vector<double> approx = exact;
  for (double& x : approx) x += 0.25;
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(2, 3, exact, approx);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_NEAR(q->logit_rmse, 0.25, kTol);
  EXPECT_EQ(q->top1_agreement, 1.0);
  EXPECT_EQ(q->top8_agreement, 1.0);
  EXPECT_NEAR(q->tv_distance, 0.0, kTol);
}

TEST(MeasureAttentionQuality, SwappedTopKeyGivesTop1Zero) {
  const std::vector<double> exact = {0, 1, 5};
  const std::vector<double> approx = {0, 5, 1};
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(1, 3, exact, approx);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->top1_agreement, 0.0);
  // With 3 keys top-k uses k = 3: every key is in both sets.
  EXPECT_EQ(q->top8_agreement, 1.0);
}

TEST(MeasureAttentionQuality, Top1IsAFractionOfQueries) {
  // Query 0 agrees, query 1 does not, queries 2 and 3 agree.
  const std::vector<double> exact = {1, 0, 0, 1, 3, 2, 5, 6};
  const std::vector<double> approx = {2, 0, 1, 0, 3, 1, 4, 9};
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(4, 2, exact, approx);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->top1_agreement, 0.75);
}

TEST(MeasureAttentionQuality, Top8CountsTheOverlapOfTheEightLargest) {
  // Exact ranks keys 9..2 highest, approx ranks 0..7 highest: overlap
  // {2, ..., 7}, 6 of 8.
  std::vector<double> exact(10), approx(10);
  for (int k = 0; k < 10; ++k) {
    exact[k] = k;
    approx[k] = 9 - k;
  }
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(1, 10, exact, approx);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->top8_agreement, 0.75);
  EXPECT_EQ(q->top1_agreement, 0.0);
}

TEST(MeasureAttentionQuality, TiesBreakTowardTheLowerIndex) {
  // Both rows tie between keys 0 and 2; the lower index wins in both.
  const std::vector<double> exact = {4, 1, 4};
  const std::vector<double> approx = {3, 1, 3};
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(1, 3, exact, approx);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->top1_agreement, 1.0);
}

TEST(MeasureAttentionQuality, TvDistanceOfKnownDistributions) {
  // Query 0: (1/2, 1/2) vs (3/4, 1/4): TV 1/4.
  // Query 1: (0.1, 0.2, 0.7) vs (0.3, 0.3, 0.4) needs 3 keys, so it is a
  // separate call: TV 0.5 * (0.2 + 0.1 + 0.3) = 0.3.
  {
    const std::vector<double> exact = {0, 0};
    const std::vector<double> approx = {std::log(3.0), 0};
    absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(1, 2, exact, approx);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_NEAR(q->tv_distance, 0.25, kTol);
  }
  {
    const std::vector<double> exact = {std::log(0.1), std::log(0.2), std::log(0.7)};
    const std::vector<double> approx = {std::log(3.0), std::log(3.0), std::log(4.0)};
    absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(1, 3, exact, approx);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_NEAR(q->tv_distance, 0.3, kTol);
  }
  {
    // The mean over queries: (1/4 + 0) / 2.
    const std::vector<double> exact = {0, 0, 1, 2};
    const std::vector<double> approx = {std::log(3.0), 0, 1, 2};
    absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(2, 2, exact, approx);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_NEAR(q->tv_distance, 0.125, kTol);
  }
}

TEST(MeasureAttentionQuality, SoftmaxIsStableForLargeLogits) {
  const std::vector<double> exact = {1000, 1000};
  const std::vector<double> approx = {1000 + std::log(3.0), 1000};
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(1, 2, exact, approx);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_NEAR(q->tv_distance, 0.25, 1e-9);
}

TEST(MeasureAttentionQuality, OutputRelativeErrorPoolsAllQueries) {
  const std::vector<double> logits = {0, 0};
  {
    // ||(0, 0.5)|| / ||(3, 4)|| = 0.1.
    const std::vector<double> exact = {3, 4};
    const std::vector<double> approx = {3, 4.5};
    absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(1, 2, logits, logits, exact, approx);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_NEAR(q->output_rel_error, 0.1, kTol);
  }
  {
    // Pooled, not averaged per query: sqrt(1 / (1 + 4)).
    const std::vector<double> logits2 = {0, 0, 0, 0};
    const std::vector<double> exact = {1, 0, 0, 2};
    const std::vector<double> approx = {1, 1, 0, 2};
    absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(2, 2, logits2, logits2, exact, approx);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_NEAR(q->output_rel_error, std::sqrt(0.2), kTol);
  }
}

TEST(MeasureAttentionQuality, ZeroExactOutputs) {
  const std::vector<double> logits = {0};
  const std::vector<double> zero = {0, 0};
  const std::vector<double> nonzero = {0, 1e-3};
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(1, 1, logits, logits, zero, zero);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->output_rel_error, 0.0);
  q = MeasureAttentionQuality(1, 1, logits, logits, zero, nonzero);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(std::isinf(q->output_rel_error));
}

TEST(MeasureAttentionQuality, RejectsBadShapes) {
  const std::vector<double> six(6, 0.0), five(5, 0.0), four(4, 0.0), three(3, 0.0);
  absl::Status status = MeasureAttentionQuality(2, 3, six, five).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(status), "approx_logits has 5 values; want [num_queries, num_keys] = 2 * 3 = 6");
  status = MeasureAttentionQuality(0, 3, {}, {}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(status), "num_queries is 0; want >= 1");
  status = MeasureAttentionQuality(1, 0, {}, {}).status();
  EXPECT_EQ(Message(status), "num_keys is 0; want >= 1");
  // Only one of the outputs.
  status = MeasureAttentionQuality(2, 3, six, six, four, {}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("want both exact and approximate outputs"));
  // Outputs whose size is not a multiple of num_queries.
  status = MeasureAttentionQuality(2, 3, six, six, three, three).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("not a multiple of num_queries = 2"));
  // Outputs of different sizes.
  status = MeasureAttentionQuality(2, 3, six, six, four, six).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("approx_outputs has 6 values"));
}

TEST(MeasureAttentionQuality, RejectsNonFiniteValuesNamingTheEntry) {
  std::vector<double> exact(6, 0.0), approx(6, 0.0);
  approx[4] = std::nan("");
  absl::Status status = MeasureAttentionQuality(2, 3, exact, approx).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(status), "approx_logits[1, 1] is nan; want a finite value");
  approx[4] = 0;
  exact[2] = -INFINITY;
  status = MeasureAttentionQuality(2, 3, exact, approx).status();
  EXPECT_THAT(Message(status), HasSubstr("exact_logits[0, 2] is -inf"));
}

TEST(SoftmaxWeightedOutputs, WeighsValuesBySoftmax) {
  // Query 0: weights (1/4, 3/4); query 1: (1/2, 1/2).
  const std::vector<double> logits = {0, std::log(3.0), 7, 7};
  const std::vector<double> values = {2, 4, 6, 8};  // [2 keys, 2 dims]
  absl::StatusOr<std::vector<double>> out = SoftmaxWeightedOutputs(2, 2, 2, logits, values);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 4u);
  EXPECT_NEAR((*out)[0], 5, kTol);
  EXPECT_NEAR((*out)[1], 7, kTol);
  EXPECT_NEAR((*out)[2], 4, kTol);
  EXPECT_NEAR((*out)[3], 6, kTol);
}

TEST(SoftmaxWeightedOutputs, IsStableForLargeLogits) {
  const std::vector<double> logits = {-800, 900, 900};
  const std::vector<double> values = {100, 1, 3};  // [3 keys, 1 dim]
  absl::StatusOr<std::vector<double>> out = SoftmaxWeightedOutputs(1, 3, 1, logits, values);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_NEAR((*out)[0], 2.0, kTol);
}

TEST(SoftmaxWeightedOutputs, RejectsBadShapes) {
  const std::vector<double> four(4, 0.0), three(3, 0.0);
  absl::Status status = SoftmaxWeightedOutputs(2, 2, 2, four, three).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(status), "values has 3 values; want [num_keys, head_dim] = 2 * 2 = 4");
  status = SoftmaxWeightedOutputs(2, 2, 0, four, {}).status();
  EXPECT_EQ(Message(status), "head_dim is 0; want >= 1");
  status = SoftmaxWeightedOutputs(1, 2, 2, four, four).status();
  EXPECT_THAT(Message(status), HasSubstr("logits has 4 values"));
}

TEST(ScaledLogits, DividesDotProductsBySqrtHeadDim) {
  const std::vector<float> queries = {1, 2, 3, 4};               // [1, 4]
  const std::vector<float> keys = {1, 1, 1, 1, 0, 0, 0.5f, -2};  // [2, 4]
  absl::StatusOr<std::vector<double>> logits = ScaledLogits(1, 2, 4, queries, keys);
  ASSERT_TRUE(logits.ok()) << logits.status();
  ASSERT_EQ(logits->size(), 2u);
  EXPECT_NEAR((*logits)[0], 10.0 / 2.0, kTol);
  EXPECT_NEAR((*logits)[1], (1.5 - 8.0) / 2.0, kTol);
  EXPECT_EQ(ScaledLogits(1, 2, 4, queries, queries).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(ScaledLogits(1, 2, 4, queries, queries).status()),
              HasSubstr("keys has 4 values; want [num_keys, head_dim] = 2 * 4 = 8"));
}

TEST(AttentionQualityPipeline, ExactAgainstItselfThroughOutputsIsPerfect) {
  const std::vector<float> queries = {0.3f, -1, 2, 0.5f, 1, 1};  // [3, 2]
  const std::vector<float> keys = {1, 0, 0, 1, -1, 0.5f, 2, 2};  // [4, 2]
  const std::vector<double> values = {1, 2, 3, 4, 5, 6, 7, 8};   // [4, 2]
  absl::StatusOr<std::vector<double>> logits = ScaledLogits(3, 4, 2, queries, keys);
  ASSERT_TRUE(logits.ok()) << logits.status();
  absl::StatusOr<std::vector<double>> outputs = SoftmaxWeightedOutputs(3, 4, 2, *logits, values);
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  absl::StatusOr<AttentionQuality> q = MeasureAttentionQuality(3, 4, *logits, *logits, *outputs, *outputs);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->tv_distance, 0.0);
  EXPECT_EQ(q->output_rel_error, 0.0);
  EXPECT_EQ(q->top8_agreement, 1.0);
}

}  // namespace
}  // namespace eval
}  // namespace tqkv
