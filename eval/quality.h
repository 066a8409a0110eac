// Attention-quality metrics: how far attention computed over a compressed KV
// cache is from attention over the exact one. Pure math in float64, with no
// dependency on any codec, so that the same numbers come out whichever
// backend produced the approximate logits.
//
// Why these metrics (docs/turboquant.md section 3): key reconstruction MSE
// ranks codecs wrongly; what matters is the error in the logits q.k/sqrt(d)
// relative to their spread, and what softmax makes of it. So we report the
// logit RMSE next to the logit standard deviation, whether the most-attended
// keys stay the same (top-1, top-8), the total-variation distance between
// the attention distributions, and, when outputs are given, the relative
// error of the attention output.
//
// Layouts: all matrices are dense, row-major, float64:
//   logits  [num_queries, num_keys]   already scaled (q.k / sqrt(head_dim))
//   values  [num_keys, head_dim]
//   outputs [num_queries, head_dim]
// Spans are not retained past the call. Functions keep no state and are
// safe to call concurrently.
#ifndef TQKV_EVAL_QUALITY_H_
#define TQKV_EVAL_QUALITY_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace tqkv {
namespace eval {

// How many of the most-attended keys top8_agreement compares.
inline constexpr int kTopKAgreement = 8;

struct AttentionQuality {
  // sqrt(mean over all (query, key) pairs of (approx - exact)^2).
  double logit_rmse = 0.0;
  // Population standard deviation of the exact logits over all pairs; the
  // scale against which logit_rmse is read.
  double logit_std = 0.0;
  // Fraction of queries whose highest-logit key is the same in both.
  double top1_agreement = 0.0;
  // Mean over queries of |top-k(exact) intersect top-k(approx)| / k, with
  // k = min(kTopKAgreement, num_keys).
  double top8_agreement = 0.0;
  // Mean over queries of 0.5 * sum_k |softmax(exact)_k - softmax(approx)_k|,
  // in [0, 1].
  double tv_distance = 0.0;
  // sqrt(sum_q ||o_approx - o_exact||^2 / sum_q ||o_exact||^2). NaN when no
  // outputs were given; 0 when all exact outputs are zero and the approximate
  // ones equal them, +inf when all exact outputs are zero and they do not.
  double output_rel_error = 0.0;
  int64_t num_queries = 0;
  int64_t num_keys = 0;
};

// Compares approximate attention with exact attention for the same queries
// and keys. `exact_outputs` and `approx_outputs` are optional: pass both
// (each [num_queries, head_dim], head_dim >= 1 inferred from their size) or
// neither.
//
// Ties in the logits (equal values in one row) are broken toward the lower
// key index, for top-1 and top-k alike.
//
// Errors (INVALID_ARGUMENT): num_queries or num_keys < 1; a logits span whose
// size is not num_queries * num_keys; only one of the outputs given, or
// outputs of different sizes or a size that is not a positive multiple of
// num_queries; a NaN or infinite entry in any input (reported with its row
// and column).
absl::StatusOr<AttentionQuality> MeasureAttentionQuality(int64_t num_queries, int64_t num_keys,
                                                         absl::Span<const double> exact_logits,
                                                         absl::Span<const double> approx_logits,
                                                         absl::Span<const double> exact_outputs = {},
                                                         absl::Span<const double> approx_outputs = {});

// Attention outputs o[q, :] = sum_k softmax(logits[q, :])_k * values[k, :],
// with a max-subtracted softmax in float64. Returns [num_queries, head_dim].
//
// Errors (INVALID_ARGUMENT): any dimension < 1, a span of the wrong size, or
// a NaN or infinite entry.
absl::StatusOr<std::vector<double>> SoftmaxWeightedOutputs(int64_t num_queries, int64_t num_keys, int64_t head_dim,
                                                           absl::Span<const double> logits,
                                                           absl::Span<const double> values);

// Scaled logits q.k / sqrt(head_dim), accumulated in float64, from float32
// queries [num_queries, head_dim] and keys [num_keys, head_dim]. Returns
// [num_queries, num_keys]. The exact-side input of MeasureAttentionQuality.
//
// Errors (INVALID_ARGUMENT): any dimension < 1 or a span of the wrong size.
absl::StatusOr<std::vector<double>> ScaledLogits(int64_t num_queries, int64_t num_keys, int64_t head_dim,
                                                 absl::Span<const float> queries, absl::Span<const float> keys);

}  // namespace eval
}  // namespace tqkv

#endif  // TQKV_EVAL_QUALITY_H_
