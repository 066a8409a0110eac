// Per-preset attention quality on given keys, queries and (optionally) values:
// the engine of `tqkv eval`. Scores go through the codec's rotated-domain path
// and values through its accumulate path, exactly what the attention kernels
// compute, and are compared with exact float64 attention over the originals.
#ifndef TQKV_EVAL_PRESET_EVAL_H_
#define TQKV_EVAL_PRESET_EVAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "eval/quality.h"
#include "kernels/preset.h"

namespace tqkv {
namespace eval {

// Row-major float32 inputs for one head: keys and values [num_keys, head_dim],
// queries [num_queries, head_dim]. values may be empty.
struct EvalInputs {
  int head_dim = 0;
  int64_t num_keys = 0;
  int64_t num_queries = 0;
  const float* keys = nullptr;
  const float* queries = nullptr;
  const float* values = nullptr;  // optional
  // Seeds the codecs' rotations.
  uint64_t seed = 0;
  // Calibration keys for presets that need hot channels ([n, head_dim]); the
  // evaluated keys themselves when null.
  const float* calibration_keys = nullptr;
  int64_t num_calibration_keys = 0;
};

// Needle retrieval: one planted key whose exact logit stands `gap` above the
// largest logit of the crowd (the other keys) for that query, the case of a
// long context with one relevant token. Per query q, key j = (q * 7919) mod
// num_keys is replaced by
//   needle = k_j + (L - q.k_j/sqrt(d)) * sqrt(d) / ||q||^2 * q,
//   L      = max over t != j of q.k_t/sqrt(d), plus gap,
// encoded with the preset's key codec like any other key, and scored against
// the crowd's approximate logits.
inline constexpr double kNeedleGaps[] = {3.0, 5.0, 7.0, 9.0};

struct NeedleResult {
  double gap = 0.0;
  // Fraction of queries whose needle still has the largest approximate logit.
  double top1_rate = 0.0;
  // Mean over queries of the needle's softmax weight, exact and approximate.
  double exact_weight = 0.0;
  double approx_weight = 0.0;
};

struct PresetEvaluation {
  std::string preset;
  int bytes_per_token_head = 0;
  double compression_vs_bf16 = 0.0;
  // sum ||k - k_hat||^2 / sum ||k||^2 over the keys (and the same for values;
  // NaN without values).
  double key_rel_mse = 0.0;
  double value_rel_mse = 0.0;
  AttentionQuality quality;
  // One per kNeedleGaps entry (empty with fewer than 2 keys).
  std::vector<NeedleResult> needles;
};

// Fails with INVALID_ARGUMENT for empty or inconsistent inputs and whatever
// the codecs reject (non-finite values, ranges beyond fp16).
absl::StatusOr<PresetEvaluation> EvaluatePreset(const Preset& preset, const EvalInputs& inputs);

}  // namespace eval
}  // namespace tqkv

#endif  // TQKV_EVAL_PRESET_EVAL_H_
