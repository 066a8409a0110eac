#include "eval/preset_eval.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "absl/strings/str_format.h"
#include "kernels/codec.h"
#include "base/status_macros.h"

namespace tqkv {
namespace eval {
namespace {

// A codec and what it made of n vectors, plus the relative reconstruction error.
struct EncodedSet {
  std::unique_ptr<VectorCodec> codec;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scalars;
  double rel_mse = 0.0;

  const uint8_t* codes_at(int64_t i) const { return &codes[i * codec->code_bytes()]; }
  const uint16_t* scalars_at(int64_t i) const {
    return codec->num_scalars() ? &scalars[i * codec->num_scalars()] : nullptr;
  }
};

absl::StatusOr<EncodedSet> EncodeSet(const CodecSpec& spec, const EvalInputs& in, const float* x, const char* what) {
  CodecOptions options;
  options.head_dim = in.head_dim;
  options.seed = in.seed;
  if (spec.NeedsCalibration()) {
    const float* calibration = in.calibration_keys ? in.calibration_keys : in.keys;
    const int64_t n = in.calibration_keys ? in.num_calibration_keys : in.num_keys;
    options.hot_channels = ChooseHotChannels(calibration, n, in.head_dim, spec.HotChannels(in.head_dim));
  }
  EncodedSet set;
  ASSIGN_OR_RETURN(set.codec, MakeCodec(spec, options));
  const VectorCodec& codec = *set.codec;
  const int d = in.head_dim;
  set.codes.resize(in.num_keys * codec.code_bytes());
  set.scalars.resize(in.num_keys * codec.num_scalars());
  std::vector<float> decoded(d);
  double error = 0.0, energy = 0.0;
  for (int64_t t = 0; t < in.num_keys; ++t) {
    uint16_t* scalars = codec.num_scalars() ? &set.scalars[t * codec.num_scalars()] : nullptr;
    absl::Status status = codec.Encode(x + t * d, &set.codes[t * codec.code_bytes()], scalars);
    if (!status.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("%s row %d: %s", what, t, status.message()));
    }
    codec.Decode(set.codes_at(t), set.scalars_at(t), decoded.data());
    for (int i = 0; i < d; ++i) {
      const double diff = static_cast<double>(decoded[i]) - x[t * d + i];
      error += diff * diff;
      energy += static_cast<double>(x[t * d + i]) * x[t * d + i];
    }
  }
  set.rel_mse = energy > 0 ? error / energy : 0.0;
  return set;
}

// Needle retrieval (see kNeedleGaps in the header) over the crowd's exact and
// approximate logits [nq, nk], already scaled.
absl::StatusOr<std::vector<NeedleResult>> MeasureNeedles(const EvalInputs& in, const EncodedSet& keys,
                                                         const std::vector<double>& exact,
                                                         const std::vector<double>& approx) {
  const int d = in.head_dim;
  const int64_t nk = in.num_keys, nq = in.num_queries;
  std::vector<NeedleResult> results;
  if (nk < 2) return results;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const VectorCodec& codec = *keys.codec;
  std::vector<float> needle(d), state(codec.query_state_floats());
  std::vector<uint8_t> codes(codec.code_bytes());
  std::vector<uint16_t> scalars(codec.num_scalars());
  for (double gap : kNeedleGaps) {
    NeedleResult r;
    r.gap = gap;
    int64_t counted = 0;
    for (int64_t q = 0; q < nq; ++q) {
      const float* query = in.queries + q * d;
      double qq = 0.0;
      for (int i = 0; i < d; ++i) qq += static_cast<double>(query[i]) * query[i];
      if (qq == 0.0) continue;  // a zero query cannot single out any key
      const int64_t j = (q * 7919) % nk;
      const double* e = &exact[q * nk];
      const double* a = &approx[q * nk];
      double crowd_exact = -std::numeric_limits<double>::infinity();
      double crowd_approx = crowd_exact;
      for (int64_t t = 0; t < nk; ++t) {
        if (t == j) continue;
        crowd_exact = std::max(crowd_exact, e[t]);
        crowd_approx = std::max(crowd_approx, a[t]);
      }
      const double shift = (crowd_exact + gap - e[j]) / scale / qq;
      const float* kj = in.keys + j * d;
      for (int i = 0; i < d; ++i) needle[i] = static_cast<float>(kj[i] + shift * query[i]);
      double needle_exact = 0.0;
      for (int i = 0; i < d; ++i) needle_exact += static_cast<double>(needle[i]) * query[i];
      needle_exact *= scale;
      absl::Status status = codec.Encode(needle.data(), codes.data(), scalars.empty() ? nullptr : scalars.data());
      if (!status.ok()) {
        return absl::InvalidArgumentError(absl::StrFormat("needle (gap %g, query %d): %s", gap, q, status.message()));
      }
      codec.PrepareQuery(query, state.data());
      const uint16_t* needle_scalars = scalars.empty() ? nullptr : scalars.data();
      const double needle_approx = scale * codec.Score(state.data(), codes.data(), needle_scalars);
      // Softmax weight of the needle among the crowd, max-subtracted.
      auto weight = [&](const double* row, double needle_logit) {
        double m = needle_logit;
        for (int64_t t = 0; t < nk; ++t) {
          if (t != j) m = std::max(m, row[t]);
        }
        double sum = std::exp(needle_logit - m);
        for (int64_t t = 0; t < nk; ++t) {
          if (t != j) sum += std::exp(row[t] - m);
        }
        return std::exp(needle_logit - m) / sum;
      };
      r.top1_rate += needle_approx > crowd_approx ? 1.0 : 0.0;
      r.exact_weight += weight(e, needle_exact);
      r.approx_weight += weight(a, needle_approx);
      ++counted;
    }
    if (counted > 0) {
      r.top1_rate /= counted;
      r.exact_weight /= counted;
      r.approx_weight /= counted;
    }
    results.push_back(r);
  }
  return results;
}

}  // namespace

absl::StatusOr<PresetEvaluation> EvaluatePreset(const Preset& preset, const EvalInputs& in) {
  if (in.head_dim <= 0 || in.num_keys <= 0 || in.num_queries <= 0 || !in.keys || !in.queries) {
    return absl::InvalidArgumentError("evaluation needs at least one key and one query");
  }
  const int d = in.head_dim;
  const int64_t nk = in.num_keys, nq = in.num_queries;
  PresetEvaluation result;
  result.preset = std::string(preset.name);
  result.bytes_per_token_head = preset.BytesPerTokenHead(d);
  result.compression_vs_bf16 = preset.CompressionVsBf16(d);

  ASSIGN_OR_RETURN(EncodedSet keys, EncodeSet(preset.key, in, in.keys, "keys"));
  result.key_rel_mse = keys.rel_mse;

  // Approximate logits through the rotated-domain score path.
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> approx_logits(nq * nk);
  std::vector<float> state(keys.codec->query_state_floats());
  for (int64_t q = 0; q < nq; ++q) {
    keys.codec->PrepareQuery(in.queries + q * d, state.data());
    for (int64_t t = 0; t < nk; ++t) {
      approx_logits[q * nk + t] = scale * keys.codec->Score(state.data(), keys.codes_at(t), keys.scalars_at(t));
    }
  }
  ASSIGN_OR_RETURN(std::vector<double> exact_logits, ScaledLogits(nq, nk, d, absl::MakeConstSpan(in.queries, nq * d),
                                                                  absl::MakeConstSpan(in.keys, nk * d)));

  ASSIGN_OR_RETURN(result.needles, MeasureNeedles(in, keys, exact_logits, approx_logits));

  std::vector<double> exact_outputs, approx_outputs;
  result.value_rel_mse = std::numeric_limits<double>::quiet_NaN();
  if (in.values != nullptr) {
    ASSIGN_OR_RETURN(EncodedSet values, EncodeSet(preset.value, in, in.values, "values"));
    result.value_rel_mse = values.rel_mse;
    std::vector<double> exact_values(in.values, in.values + nk * d);
    ASSIGN_OR_RETURN(exact_outputs, SoftmaxWeightedOutputs(nq, nk, d, exact_logits, exact_values));
    // Softmax of the approximate logits, values accumulated in the codec basis.
    approx_outputs.resize(nq * d);
    std::vector<float> acc(values.codec->accumulator_floats()), out(d);
    for (int64_t q = 0; q < nq; ++q) {
      const double* row = &approx_logits[q * nk];
      double max_logit = row[0];
      for (int64_t t = 1; t < nk; ++t) max_logit = std::max(max_logit, row[t]);
      double denominator = 0.0;
      for (int64_t t = 0; t < nk; ++t) denominator += std::exp(row[t] - max_logit);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < nk; ++t) {
        const float weight = static_cast<float>(std::exp(row[t] - max_logit) / denominator);
        values.codec->Accumulate(weight, values.codes_at(t), values.scalars_at(t), acc.data());
      }
      values.codec->FinishAccumulation(acc.data(), out.data());
      for (int i = 0; i < d; ++i) approx_outputs[q * d + i] = out[i];
    }
  }
  ASSIGN_OR_RETURN(result.quality,
                   MeasureAttentionQuality(nq, nk, exact_logits, approx_logits, exact_outputs, approx_outputs));
  return result;
}

}  // namespace eval
}  // namespace tqkv
