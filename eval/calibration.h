// Calibration: which layers to protect, and with which preset, chosen by
// measurement (docs/turboquant.md section 7: "protection must be chosen by
// measurement, not by position"). The engine of `tqkv calibrate`;
// docs/calibrate.md is the user's guide.
//
// Capture directory. What one model's attention saw on one text, written by
// the quality report (tools/quality) or by WriteCapture below:
//
//   meta.json            {"layers": L, "num_query_heads": Hq,
//                         "num_kv_heads": Hkv, "head_dim": D, "tokens": T}
//                        (a flat JSON object; other members, nested ones
//                        included, are ignored)
//   layer_%03d_q.npy     [T, Hq, D]   queries, for layer 0..L-1
//   layer_%03d_k.npy     [T, Hkv, D]  keys
//   layer_%03d_v.npy     [T, Hkv, D]  values
//
// float32 (float16 is read too), C order, after RoPE: exactly the vectors
// the attention of that layer multiplies, query head q reading KV head
// q / (Hq / Hkv).
//
// Measurement. For one layer and one preset, the layer's K/V go into a real
// KvCache over the CPU backend, one layer of the model's shape with that
// preset and the caller's KvLayoutOptions otherwise (page size, seed, and
// whatever key centering or exact recent tokens the server will run), appended in
// order the way a server receives them, and at each sampled position p the
// query of token p attends over tokens [0, p] (Attend after the append that
// brings the layer to p + 1 tokens, the decode path) and is scored over them
// (Score). Both are compared with exact float64 causal attention over the
// uncompressed K/V.
//
// Planning. Every layer starts at a base preset; a greedy loop then applies
// the (layer, preset) upgrade with the largest error reduction per extra
// byte that still fits the budget, until none does.
//
// Functions keep no state and are safe to call concurrently.
#ifndef TQKV_EVAL_CALIBRATION_H_
#define TQKV_EVAL_CALIBRATION_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"

namespace tqkv {
namespace eval {

// ---------------------------------------------------------------------------
// The capture format.

struct CaptureMeta {
  int layers = 0;
  int num_query_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t tokens = 0;
};

// One layer's tensors, row-major, shapes as in the file comment.
struct LayerCapture {
  std::vector<float> queries;  // [tokens, num_query_heads, head_dim]
  std::vector<float> keys;     // [tokens, num_kv_heads, head_dim]
  std::vector<float> values;   // [tokens, num_kv_heads, head_dim]
};

// Parses meta.json's text. INVALID_ARGUMENT, naming the member or the byte
// offset, for text that is not one JSON object, a missing member, a member
// that is not an integer, or an inconsistent shape: layers < 1, tokens < 2,
// head_dim outside [kMinHeadDim, kMaxHeadDim], num_kv_heads < 1, or
// num_query_heads not a positive multiple of num_kv_heads.
absl::StatusOr<CaptureMeta> ParseCaptureMeta(std::string_view json);

// meta.json's text for `meta` (ParseCaptureMeta reads it back).
std::string CaptureMetaJson(const CaptureMeta& meta);

// "<dir>/layer_007_k.npy" for layer 7, tensor 'k' ('q', 'k' or 'v').
std::string CaptureTensorPath(const std::string& dir, int layer, char tensor);

// Reads and checks <dir>/meta.json. NOT_FOUND when it is missing; otherwise
// ParseCaptureMeta's errors, prefixed with the path.
absl::StatusOr<CaptureMeta> ReadCaptureMeta(const std::string& dir);

// Reads one layer's three files (one layer at a time keeps memory at one
// layer's worth). NOT_FOUND naming a missing file; INVALID_ARGUMENT naming
// the file for a shape other than the one meta.json implies ("has shape
// [12, 2, 64], want [tokens 16, num_kv_heads 2, head_dim 64] from
// meta.json"), for a bad .npy, or for a NaN or infinite entry.
// REQUIRES: 0 <= layer < meta.layers.
absl::StatusOr<LayerCapture> ReadCaptureLayer(const std::string& dir, const CaptureMeta& meta, int layer);

// Writes meta.json and every layer's files into `dir` (which must exist).
// INVALID_ARGUMENT when layers.size() != meta.layers or a tensor has the
// wrong number of elements; I/O errors as WriteNpy reports them.
absl::Status WriteCapture(const std::string& dir, const CaptureMeta& meta, absl::Span<const LayerCapture> layers);

// ---------------------------------------------------------------------------
// Measuring one layer.

struct CalibrationOptions {
  // The layout the server will run. Its shape fields, num_layers, preset,
  // boundary_layers and hot_channels are replaced per measurement (one layer
  // of the capture's shape, boundary_layers 0, hot channels chosen from the
  // layer's own keys for split presets); everything else (page_tokens,
  // rotation_seed, and key centering or exact-token settings) is used as
  // given, so that a preset's error is measured under the recipe it will
  // serve with.
  KvLayoutOptions layout;
  // Query positions sampled per layer, spread evenly over the second half of
  // the text (SamplePositions). More positions: steadier figures, longer run.
  int positions = 64;
  // CPU backend threads; 0 means the hardware concurrency.
  int threads = 1;
};

// `count` distinct positions in [tokens / 2, tokens), evenly spaced,
// including both ends, in increasing order; fewer when the half is shorter.
// Empty when tokens < 2 or count < 1.
std::vector<int64_t> SamplePositions(int64_t tokens, int count);

// One preset's error on one layer, over every (sampled position, query head).
struct PresetError {
  const Preset* preset = nullptr;
  // sqrt(sum ||o - o_exact||^2 / sum ||o_exact||^2) of the Attend outputs.
  double output_rel_error = 0.0;
  // sqrt(mean (logit - exact logit)^2) over every scored (query, key) pair,
  // logits scaled by 1 / sqrt(head_dim).
  double logit_rmse = 0.0;
  // Means over (position, query head) rows of the attention distributions'
  // total-variation distance and KL(exact || approximate), in nats.
  double tv_distance = 0.0;
  double kl_divergence = 0.0;
  // Compressed bytes one token takes in this layer, all KV heads
  // (KvLayout::token_bytes), and the same in bf16.
  int64_t token_bytes = 0;
  int64_t token_bytes_bf16 = 0;
  // What the measured layout holds per sequence besides its tokens, as in
  // effect (the caller's settings, or the preset's own recipe where they
  // leave it to the preset): the tokens also kept exact at fp16 (sinks plus
  // recent tokens), the fp32 key-mean bytes with centering, and the centering
  // ("none", "post_rope", "pre_rope").
  int64_t exact_tokens = 0;
  int64_t fixed_bytes = 0;
  std::string key_centering = "none";
};

struct LayerCalibration {
  int layer = 0;
  std::vector<int64_t> positions;
  std::vector<PresetError> presets;  // in the order the presets were given
};

// Measures every preset on one layer. Errors: INVALID_ARGUMENT when the
// tensors do not match `meta` or options are out of range (positions < 1,
// page_tokens outside the layout's range); whatever KvLayout::Create and
// KvCache return otherwise (e.g. NOT_FOUND for an unknown preset), prefixed
// with the layer and preset.
absl::StatusOr<LayerCalibration> CalibrateLayer(const CaptureMeta& meta, int layer, const LayerCapture& capture,
                                                absl::Span<const Preset* const> presets,
                                                const CalibrationOptions& options);

// ---------------------------------------------------------------------------
// Planning protection for a byte budget.

// What the plan minimizes: the sum over layers of this PresetError field.
enum class CalibrationMetric { kOutputError, kKlDivergence, kTvDistance, kLogitRmse };

// "output" | "kl" | "tv" | "logit"; INVALID_ARGUMENT otherwise.
absl::StatusOr<CalibrationMetric> ParseCalibrationMetric(std::string_view name);
double MetricValue(const PresetError& error, CalibrationMetric metric);

struct PlanOptions {
  // Every layer starts here. Must be among each layer's measured presets.
  std::string base_preset = "turboquant_k3v4_nc";
  // Average bits per coordinate over all layers, keys and values together,
  // that the plan may spend (16 is bf16). Exact tokens and key means
  // included.
  double budget_bits = 4.0;
  // The context length a sequence's exact tokens and key means are spread
  // over (LayerBitsPerToken).
  int64_t context = 8192;
  CalibrationMetric metric = CalibrationMetric::kOutputError;
  // The serving recipe the errors were measured under ("key centering
  // pre_rope, 4 sink + 64 recent tokens exact"), for ProtectionConfigText's
  // comment; "" for none.
  std::string recipe;
};

struct PlanStep {
  int layer = 0;
  const Preset* from = nullptr;
  const Preset* to = nullptr;
  double error_before = 0.0;  // the metric on that layer
  double error_after = 0.0;
  double extra_bits = 0.0;  // added to the model's average bits per coordinate
};

struct ProtectionPlan {
  std::vector<const Preset*> layer_presets;  // one per layer
  std::vector<PlanStep> steps;               // the upgrades, in the order taken
  const Preset* base = nullptr;
  double base_error = 0.0;   // sum of the metric over layers, all at base
  double total_error = 0.0;  // the same for the plan
  double base_bits = 0.0;    // average bits per coordinate, all at base
  double bits_per_coordinate = 0.0;
  double ratio_vs_bf16 = 0.0;  // 16 / bits_per_coordinate
};

// Bytes per token of one layer at a preset, at context length `context`:
//   token_bytes + (min(exact_tokens, context) * fp16 token bytes
//                  + fixed_bytes) / context
// (exact tokens keep their compressed copy too; fp16 and bf16 tokens are the
// same size).
double LayerBytesPerToken(const PresetError& error, int64_t context);

// Average bits per coordinate, keys and values, of a model whose layer i uses
// `layers[i]`. REQUIRES: layers non-empty, context >= 1.
double AverageBitsPerCoordinate(absl::Span<const PresetError* const> layers, const CaptureMeta& meta, int64_t context);

// Greedy plan over `layers` (one LayerCalibration per layer of the model, in
// order, each with the same presets). Upgrades that cost no bytes and lower
// the error come first. Errors (INVALID_ARGUMENT): no layers, layers not
// numbered 0..n-1 or measured with different presets, the base preset not
// measured, context < 1, or a budget below what the base preset alone takes
// (the message gives both).
absl::StatusOr<ProtectionPlan> PlanProtection(const CaptureMeta& meta, absl::Span<const LayerCalibration> layers,
                                              const PlanOptions& options);

// The plan as cache-config lines in protobuf text format, ready to paste
// into a CacheConfig: `preset:` the one most layers use (the base on a
// tie), boundary_layers: 0, and one `protected_layers { layers: [3, 17]
// preset: "tqkv_k4v4" }` per other preset, layers ascending, in order of
// first use; '#' comments give the recipe the
// plan was measured under and the bits per coordinate and ratio vs bf16 at
// the plan's context.
std::string ProtectionConfigText(const ProtectionPlan& plan, const PlanOptions& options);

}  // namespace eval
}  // namespace tqkv

#endif  // TQKV_EVAL_CALIBRATION_H_
