#include "eval/quality.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace tqkv {
namespace eval {
namespace {

absl::Status CheckPositive(absl::string_view name, int64_t value) {
  if (value < 1) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is ", value, "; want >= 1"));
  }
  return absl::OkStatus();
}

// Checks that `span` holds rows * cols values, all finite. `shape` names the
// dimensions for the message, e.g. "[num_queries, num_keys]".
absl::Status CheckMatrix(absl::string_view name, absl::Span<const double> span, int64_t rows, int64_t cols,
                         absl::string_view shape) {
  if (cols != 0 && rows > std::numeric_limits<int64_t>::max() / cols) {
    return absl::InvalidArgumentError(absl::StrCat(name, " ", shape, " = [", rows, ", ", cols, "] is too large"));
  }
  if (static_cast<int64_t>(span.size()) != rows * cols) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has ", span.size(), " values; want ", shape, " = ", rows,
                                                   " * ", cols, " = ", rows * cols));
  }
  for (size_t i = 0; i < span.size(); ++i) {
    if (!std::isfinite(span[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "[", i / cols, ", ", i % cols, "] is ", span[i], "; want a finite value"));
    }
  }
  return absl::OkStatus();
}

// Writes softmax(row) into `probs` (same size), max-subtracted.
void Softmax(absl::Span<const double> row, std::vector<double>& probs) {
  const double max = *std::max_element(row.begin(), row.end());
  double sum = 0.0;
  for (size_t k = 0; k < row.size(); ++k) {
    probs[k] = std::exp(row[k] - max);
    sum += probs[k];
  }
  // sum >= 1: the maximum contributes exp(0).
  for (double& p : probs) p /= sum;
}

// Indices of the `k` largest entries of `row`, ties toward the lower index,
// sorted by index. `order` is scratch of size row.size().
std::vector<int64_t> TopK(absl::Span<const double> row, int64_t k, std::vector<int64_t>& order) {
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  std::vector<int64_t> top(order.begin(), order.begin() + k);
  std::sort(top.begin(), top.end());
  return top;
}

}  // namespace

absl::StatusOr<AttentionQuality> MeasureAttentionQuality(int64_t num_queries, int64_t num_keys,
                                                         absl::Span<const double> exact_logits,
                                                         absl::Span<const double> approx_logits,
                                                         absl::Span<const double> exact_outputs,
                                                         absl::Span<const double> approx_outputs) {
  absl::Status status = CheckPositive("num_queries", num_queries);
  if (status.ok()) status = CheckPositive("num_keys", num_keys);
  if (status.ok()) {
    status = CheckMatrix("exact_logits", exact_logits, num_queries, num_keys, "[num_queries, num_keys]");
  }
  if (status.ok()) {
    status = CheckMatrix("approx_logits", approx_logits, num_queries, num_keys, "[num_queries, num_keys]");
  }
  if (!status.ok()) return status;

  const bool have_outputs = !exact_outputs.empty() || !approx_outputs.empty();
  int64_t head_dim = 0;
  if (have_outputs) {
    if (exact_outputs.empty() || approx_outputs.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("only ",
                                                     exact_outputs.empty() ? "approx_outputs" : "exact_outputs",
                                                     " given; want both exact and approximate outputs, or neither"));
    }
    if (exact_outputs.size() % num_queries != 0) {
      return absl::InvalidArgumentError(absl::StrCat("exact_outputs has ", exact_outputs.size(),
                                                     " values, not a multiple of num_queries = ", num_queries,
                                                     "; want [num_queries, head_dim]"));
    }
    head_dim = static_cast<int64_t>(exact_outputs.size()) / num_queries;
    status = CheckMatrix("exact_outputs", exact_outputs, num_queries, head_dim, "[num_queries, head_dim]");
    if (status.ok()) {
      status = CheckMatrix("approx_outputs", approx_outputs, num_queries, head_dim, "[num_queries, head_dim]");
    }
    if (!status.ok()) return status;
  }

  AttentionQuality quality;
  quality.num_queries = num_queries;
  quality.num_keys = num_keys;
  const size_t total = exact_logits.size();

  double squared_error = 0.0, mean = 0.0;
  for (size_t i = 0; i < total; ++i) {
    const double diff = approx_logits[i] - exact_logits[i];
    squared_error += diff * diff;
    mean += exact_logits[i];
  }
  mean /= static_cast<double>(total);
  double variance = 0.0;  // second pass: no cancellation for large means
  for (double x : exact_logits) variance += (x - mean) * (x - mean);
  quality.logit_rmse = std::sqrt(squared_error / static_cast<double>(total));
  quality.logit_std = std::sqrt(variance / static_cast<double>(total));

  const int64_t k = std::min<int64_t>(kTopKAgreement, num_keys);
  std::vector<double> p_exact(num_keys), p_approx(num_keys);
  std::vector<int64_t> order(num_keys);
  int64_t top1_hits = 0;
  double topk_sum = 0.0, tv_sum = 0.0;
  for (int64_t q = 0; q < num_queries; ++q) {
    const absl::Span<const double> exact = exact_logits.subspan(q * num_keys, num_keys);
    const absl::Span<const double> approx = approx_logits.subspan(q * num_keys, num_keys);

    // max_element returns the first maximum: ties go to the lower index.
    top1_hits += (std::max_element(exact.begin(), exact.end()) - exact.begin()) ==
                 (std::max_element(approx.begin(), approx.end()) - approx.begin());

    const std::vector<int64_t> top_exact = TopK(exact, k, order);
    const std::vector<int64_t> top_approx = TopK(approx, k, order);
    std::vector<int64_t> common;
    std::set_intersection(top_exact.begin(), top_exact.end(), top_approx.begin(), top_approx.end(),
                          std::back_inserter(common));
    topk_sum += static_cast<double>(common.size()) / static_cast<double>(k);

    Softmax(exact, p_exact);
    Softmax(approx, p_approx);
    double tv = 0.0;
    for (int64_t j = 0; j < num_keys; ++j) tv += std::abs(p_exact[j] - p_approx[j]);
    tv_sum += 0.5 * tv;
  }
  quality.top1_agreement = static_cast<double>(top1_hits) / static_cast<double>(num_queries);
  quality.top8_agreement = topk_sum / static_cast<double>(num_queries);
  quality.tv_distance = tv_sum / static_cast<double>(num_queries);

  if (!have_outputs) {
    quality.output_rel_error = std::numeric_limits<double>::quiet_NaN();
  } else {
    double error = 0.0, reference = 0.0;
    for (size_t i = 0; i < exact_outputs.size(); ++i) {
      const double diff = approx_outputs[i] - exact_outputs[i];
      error += diff * diff;
      reference += exact_outputs[i] * exact_outputs[i];
    }
    if (reference > 0.0) {
      quality.output_rel_error = std::sqrt(error / reference);
    } else {
      quality.output_rel_error = error == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
    }
  }
  return quality;
}

absl::StatusOr<std::vector<double>> SoftmaxWeightedOutputs(int64_t num_queries, int64_t num_keys, int64_t head_dim,
                                                           absl::Span<const double> logits,
                                                           absl::Span<const double> values) {
  absl::Status status = CheckPositive("num_queries", num_queries);
  if (status.ok()) status = CheckPositive("num_keys", num_keys);
  if (status.ok()) status = CheckPositive("head_dim", head_dim);
  if (status.ok()) {
    status = CheckMatrix("logits", logits, num_queries, num_keys, "[num_queries, num_keys]");
  }
  if (status.ok()) {
    status = CheckMatrix("values", values, num_keys, head_dim, "[num_keys, head_dim]");
  }
  if (!status.ok()) return status;
  if (num_queries > std::numeric_limits<int64_t>::max() / head_dim) {
    return absl::InvalidArgumentError("outputs [num_queries, head_dim] would be too large");
  }

  std::vector<double> outputs(static_cast<size_t>(num_queries * head_dim), 0.0);
  std::vector<double> probs(num_keys);
  for (int64_t q = 0; q < num_queries; ++q) {
    Softmax(logits.subspan(q * num_keys, num_keys), probs);
    double* out = outputs.data() + q * head_dim;
    for (int64_t j = 0; j < num_keys; ++j) {
      const double* v = values.data() + j * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) out[d] += probs[j] * v[d];
    }
  }
  return outputs;
}

absl::StatusOr<std::vector<double>> ScaledLogits(int64_t num_queries, int64_t num_keys, int64_t head_dim,
                                                 absl::Span<const float> queries, absl::Span<const float> keys) {
  absl::Status status = CheckPositive("num_queries", num_queries);
  if (status.ok()) status = CheckPositive("num_keys", num_keys);
  if (status.ok()) status = CheckPositive("head_dim", head_dim);
  if (!status.ok()) return status;
  const int64_t max = std::numeric_limits<int64_t>::max();
  if (num_queries > max / head_dim || num_keys > max / head_dim || num_queries > max / num_keys) {
    return absl::InvalidArgumentError("queries, keys or logits would be too large");
  }
  if (static_cast<int64_t>(queries.size()) != num_queries * head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("queries has ", queries.size(),
                                                   " values; want [num_queries, head_dim] = ", num_queries, " * ",
                                                   head_dim, " = ", num_queries * head_dim));
  }
  if (static_cast<int64_t>(keys.size()) != num_keys * head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("keys has ", keys.size(), " values; want [num_keys, head_dim] = ",
                                                   num_keys, " * ", head_dim, " = ", num_keys * head_dim));
  }

  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  std::vector<double> logits(static_cast<size_t>(num_queries * num_keys));
  for (int64_t q = 0; q < num_queries; ++q) {
    const float* qv = queries.data() + q * head_dim;
    for (int64_t j = 0; j < num_keys; ++j) {
      const float* kv = keys.data() + j * head_dim;
      double dot = 0.0;
      for (int64_t d = 0; d < head_dim; ++d) dot += static_cast<double>(qv[d]) * kv[d];
      logits[q * num_keys + j] = dot * scale;
    }
  }
  return logits;
}

}  // namespace eval
}  // namespace tqkv
