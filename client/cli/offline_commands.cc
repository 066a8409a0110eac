// Offline subcommands: everything that needs no server.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "client/cli/command_util.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "client/cli/npy.h"
#include "eval/preset_eval.h"
#include "eval/synthetic.h"
#include "kernels/codebook.h"
#include "kernels/codec.h"
#include "kernels/preset.h"

namespace tqkv {
namespace cli {
namespace {

// A 2-D [rows, head_dim] view of an array whose last axis is the head dim.
struct Matrix {
  std::vector<int64_t> shape;  // as in the file
  int64_t rows = 0;
  int head_dim = 0;
  std::vector<float> data;
};

absl::StatusOr<Matrix> ReadMatrix(const std::string& path, const char* what, bool allow_higher_rank) {
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  if (!array.ok()) return array.status();
  const std::vector<int64_t>& shape = array->shape;
  if (shape.size() < 2 || (!allow_higher_rank && shape.size() != 2)) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: %s has %d dims, want [rows, head_dim]%s", path, what,
                                                      shape.size(),
                                                      allow_higher_rank ? " (or more leading dims)" : ""));
  }
  Matrix m;
  m.head_dim = static_cast<int>(shape.back());
  m.rows = shape.back() == 0 ? 0 : static_cast<int64_t>(array->data.size()) / shape.back();
  if (m.head_dim < kMinHeadDim || m.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: head_dim (last axis) is %d, want %d..%d", path, m.head_dim, kMinHeadDim, kMaxHeadDim));
  }
  if (m.rows == 0) return absl::InvalidArgumentError(absl::StrFormat("%s: %s is empty", path, what));
  m.shape = shape;
  m.data = std::move(array->data);
  return m;
}

// ---------------------------------------------------------------------------

}  // namespace

int RunDistortion(int argc, const char* const* argv) {
  FlagSet flags("distortion",
                "D_mse = E||u - Q(u)||^2 of the Lloyd-Max codebook for unit vectors in R^D,\n"
                "next to the lower bound 4^-b and the upper bound sqrt(3)*pi/2*4^-b.");
  int64_t head_dim = 128;
  bool json = false;
  flags.AddInt("head-dim", &head_dim, "head dim D");
  flags.AddBool("json", &json, "print JSON instead of a table");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;

  Json rows = Json::array();
  if (!json) {
    printf("head_dim %lld\n", static_cast<long long>(head_dim));
    printf("%-5s %-10s %-12s %-12s %-10s\n", "bits", "D_mse", "lower 4^-b", "upper", "D/lower");
  }
  for (int bits = 1; bits <= 4; ++bits) {
    absl::StatusOr<const Codebook*> codebook = GetCodebook(static_cast<int>(head_dim), bits);
    if (!codebook.ok()) return UsageError(std::string(codebook.status().message()));
    const double lower = std::pow(4.0, -bits);
    const double upper = std::sqrt(3.0) * M_PI / 2.0 * lower;
    const double d_mse = (*codebook)->distortion;
    if (json) {
      rows.push_back(Json{{"bits", bits},
                          {"d_mse", d_mse},
                          {"lower_bound", lower},
                          {"upper_bound", upper},
                          {"ratio_to_lower", d_mse / lower}});
    } else {
      printf("%-5d %-10.6f %-12.6f %-12.6f %-10.3f\n", bits, d_mse, lower, upper, d_mse / lower);
    }
  }
  if (json) {
    PrintJson(Json{{"head_dim", head_dim}, {"rows", rows}});
  }
  return 0;
}

int RunCodebook(int argc, const char* const* argv) {
  FlagSet flags("codebook",
                "Centroids and decision midpoints of the Lloyd-Max codebook for (D, B),\n"
                "in coordinate units of a unit vector (times sqrt(D) alongside).");
  int64_t head_dim = 0, bits = 0;
  bool json = false;
  flags.AddRequiredInt("head-dim", &head_dim, "head dim D");
  flags.AddRequiredInt("bits", &bits, "bits B (1..8)");
  flags.AddBool("json", &json, "print JSON instead of a table");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<const Codebook*> result = GetCodebook(static_cast<int>(head_dim), static_cast<int>(bits));
  if (!result.ok()) return UsageError(std::string(result.status().message()));
  const Codebook& codebook = **result;
  const double root_d = std::sqrt(static_cast<double>(head_dim));
  if (json) {
    PrintJson(Json{{"head_dim", head_dim},
                   {"bits", bits},
                   {"d_mse", codebook.distortion},
                   {"iterations", codebook.iterations},
                   {"centroids", FloatArray(codebook.centroids.data(), codebook.centroids.size())},
                   {"midpoints", FloatArray(codebook.boundaries.data(), codebook.boundaries.size())}});
    return 0;
  }
  printf("head_dim %lld, bits %lld: %d levels, D_mse %.6f (%d Lloyd-Max iterations)\n",
         static_cast<long long>(head_dim), static_cast<long long>(bits), codebook.levels(), codebook.distortion,
         codebook.iterations);
  printf("%-6s %-14s %-12s %-14s %-12s\n", "level", "centroid", "x sqrt(D)", "upper midpoint", "x sqrt(D)");
  for (int i = 0; i < codebook.levels(); ++i) {
    const float c = codebook.centroids[i];
    if (i + 1 < codebook.levels()) {
      const float m = codebook.boundaries[i];
      printf("%-6d %-14.8f %-12.6f %-14.8f %-12.6f\n", i, c, c * root_d, m, m * root_d);
    } else {
      printf("%-6d %-14.8f %-12.6f\n", i, c, c * root_d);
    }
  }
  return 0;
}

namespace {

absl::StatusOr<CodecSpec> PartSpec(const Preset& preset, const std::string& part) {
  if (part == "keys") return preset.key;
  if (part == "values") return preset.value;
  return absl::InvalidArgumentError(absl::StrFormat("--part must be keys or values, got '%s'", part));
}

}  // namespace

int RunRoundtrip(int argc, const char* const* argv) {
  FlagSet flags("roundtrip",
                "Encodes X [N, head_dim] (more leading dims are flattened) with one part of a\n"
                "preset and writes what attention sees after decoding (float32, same shape).");
  std::string preset_name, part, in_path, out_path, calibration_path;
  int64_t seed = 0;
  flags.AddRequiredString("preset", &preset_name, "preset name (see `tqkv presets`)");
  flags.AddRequiredString("part", &part, "keys | values");
  flags.AddRequiredString("in", &in_path, "input .npy (float32 or float16, C order)");
  flags.AddRequiredString("out", &out_path, "output .npy (float32)");
  flags.AddInt("seed", &seed, "rotation seed");
  flags.AddString("calibration", &calibration_path,
                  "keys .npy to choose hot channels from (split presets; default: the input)");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;

  absl::StatusOr<const Preset*> preset = FindPreset(preset_name);
  if (!preset.ok()) return UsageError(std::string(preset.status().message()));
  absl::StatusOr<CodecSpec> spec = PartSpec(**preset, part);
  if (!spec.ok()) return UsageError(std::string(spec.status().message()));
  absl::StatusOr<Matrix> x = ReadMatrix(in_path, "input", /*allow_higher_rank=*/true);
  if (!x.ok()) return Fail(x.status());

  CodecOptions options;
  options.head_dim = x->head_dim;
  options.seed = static_cast<uint64_t>(seed);
  if (spec->NeedsCalibration()) {
    Matrix calibration = *x;
    if (!calibration_path.empty()) {
      absl::StatusOr<Matrix> loaded = ReadMatrix(calibration_path, "calibration keys", true);
      if (!loaded.ok()) return Fail(loaded.status());
      if (loaded->head_dim != x->head_dim) {
        return Fail(absl::InvalidArgumentError(
            absl::StrFormat("calibration head_dim %d differs from the input's %d", loaded->head_dim, x->head_dim)));
      }
      calibration = std::move(*loaded);
    }
    options.hot_channels =
        ChooseHotChannels(calibration.data.data(), calibration.rows, x->head_dim, spec->HotChannels(x->head_dim));
  }
  absl::StatusOr<std::unique_ptr<VectorCodec>> codec = MakeCodec(*spec, options);
  if (!codec.ok()) return Fail(codec.status());

  const int d = x->head_dim;
  std::vector<float> decoded(x->data.size());
  std::vector<uint8_t> codes((*codec)->code_bytes());
  std::vector<uint16_t> scalars((*codec)->num_scalars() + 1);
  double error = 0.0, energy = 0.0;
  for (int64_t row = 0; row < x->rows; ++row) {
    const float* v = &x->data[row * d];
    absl::Status status = (*codec)->Encode(v, codes.data(), scalars.data());
    if (!status.ok()) {
      return Fail(absl::InvalidArgumentError(absl::StrFormat("%s: row %d: %s", in_path, row, status.message())));
    }
    (*codec)->Decode(codes.data(), scalars.data(), &decoded[row * d]);
    for (int i = 0; i < d; ++i) {
      const double diff = static_cast<double>(decoded[row * d + i]) - v[i];
      error += diff * diff;
      energy += static_cast<double>(v[i]) * v[i];
    }
  }
  absl::Status written = WriteNpy(out_path, x->shape, decoded.data());
  if (!written.ok()) return Fail(written);
  printf("preset %s, %s codec %s, head_dim %d, %lld vectors\n", preset_name.c_str(), part.c_str(), spec->Name().c_str(),
         d, static_cast<long long>(x->rows));
  printf("relative MSE %.6f\n", energy > 0 ? error / energy : 0.0);
  printf("bytes per vector %d (bf16: %d, %.2fx smaller)\n", (*codec)->bytes_per_vector(), 2 * d,
         2.0 * d / (*codec)->bytes_per_vector());
  return 0;
}

namespace {

// One preset's `tqkv eval` row as JSON.
Json EvalRowJson(const eval::PresetEvaluation& result, const Preset& preset) {
  const eval::AttentionQuality& q = result.quality;
  Json needles = Json::array();
  for (const eval::NeedleResult& n : result.needles) {
    needles.push_back(Json{{"gap", n.gap},
                           {"top1_rate", n.top1_rate},
                           {"exact_weight", n.exact_weight},
                           {"approx_weight", n.approx_weight}});
  }
  return Json{{"preset", result.preset},
              {"bytes_per_token_head", result.bytes_per_token_head},
              {"compression_vs_bf16", result.compression_vs_bf16},
              {"key_rel_mse", result.key_rel_mse},
              {"value_rel_mse", result.value_rel_mse},
              {"logit_rmse", q.logit_rmse},
              {"logit_std", q.logit_std},
              {"top1_agreement", q.top1_agreement},
              {"top8_agreement", q.top8_agreement},
              {"tv_distance", q.tv_distance},
              {"output_rel_error", q.output_rel_error},
              {"needles", needles},
              {"evaluation_only", preset.evaluation_only}};
}

// One preset's `tqkv eval` row in the table.
void PrintEvalRow(const eval::PresetEvaluation& result) {
  const eval::AttentionQuality& q = result.quality;
  std::string needle_columns;
  for (const eval::NeedleResult& n : result.needles) absl::StrAppendFormat(&needle_columns, " %5.2f", n.top1_rate);
  if (result.needles.size() > 1 && result.needles[1].exact_weight > 0) {
    absl::StrAppendFormat(&needle_columns, " %6.3f", result.needles[1].approx_weight / result.needles[1].exact_weight);
  }
  printf("%-20s %6d %6.2f %9.5f %9.4f %9.4f %7.3f %7.3f %8.5f %9s%s\n", result.preset.c_str(),
         result.bytes_per_token_head, result.compression_vs_bf16, result.key_rel_mse, q.logit_rmse, q.logit_std,
         q.top1_agreement, q.top8_agreement, q.tv_distance,
         std::isnan(q.output_rel_error) ? "-" : absl::StrFormat("%.5f", q.output_rel_error).c_str(),
         needle_columns.c_str());
}

}  // namespace

int RunEval(int argc, const char* const* argv) {
  FlagSet flags("eval",
                "Attention quality per preset against exact float64 attention: key relative MSE,\n"
                "logit RMSE and std (logits q.k/sqrt(d)), top-1/top-8 agreement, TV distance of\n"
                "the softmax, output relative error (with --values), bytes and compression,\n"
                "and needle retrieval: a planted key 3/5/7/9 logits above the crowd, whether it\n"
                "stays the top key (n3..n9: fraction of queries) and its softmax weight (w5:\n"
                "approximate / exact at gap 5; JSON has every gap).");
  std::string preset_names = "all", keys_path, queries_path, values_path, calibration_path;
  int64_t seed = 0;
  bool json = false;
  flags.AddString("preset", &preset_names, "a preset, a comma-separated list, or all");
  flags.AddRequiredString("keys", &keys_path, "keys .npy [N, head_dim]");
  flags.AddRequiredString("queries", &queries_path, "queries .npy [Q, head_dim]");
  flags.AddString("values", &values_path, "values .npy [N, head_dim] (optional)");
  flags.AddString("calibration", &calibration_path,
                  "keys .npy to choose hot channels from (split presets; default: --keys)");
  flags.AddInt("seed", &seed, "rotation seed");
  flags.AddBool("json", &json, "print JSON instead of a table");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;

  absl::StatusOr<std::vector<const Preset*>> presets = ParsePresetList(preset_names);
  if (!presets.ok()) return UsageError(std::string(presets.status().message()));
  absl::StatusOr<Matrix> keys = ReadMatrix(keys_path, "keys", false);
  if (!keys.ok()) return Fail(keys.status());
  absl::StatusOr<Matrix> queries = ReadMatrix(queries_path, "queries", false);
  if (!queries.ok()) return Fail(queries.status());
  if (queries->head_dim != keys->head_dim) {
    return Fail(absl::InvalidArgumentError(
        absl::StrFormat("queries head_dim %d differs from keys head_dim %d", queries->head_dim, keys->head_dim)));
  }
  Matrix values, calibration;
  eval::EvalInputs inputs;
  inputs.head_dim = keys->head_dim;
  inputs.num_keys = keys->rows;
  inputs.num_queries = queries->rows;
  inputs.keys = keys->data.data();
  inputs.queries = queries->data.data();
  inputs.seed = static_cast<uint64_t>(seed);
  if (!values_path.empty()) {
    absl::StatusOr<Matrix> loaded = ReadMatrix(values_path, "values", false);
    if (!loaded.ok()) return Fail(loaded.status());
    if (loaded->rows != keys->rows || loaded->head_dim != keys->head_dim) {
      return Fail(
          absl::InvalidArgumentError(absl::StrFormat("values are [%d, %d], want the keys' shape [%d, %d]", loaded->rows,
                                                     loaded->head_dim, keys->rows, keys->head_dim)));
    }
    values = std::move(*loaded);
    inputs.values = values.data.data();
  }
  if (!calibration_path.empty()) {
    absl::StatusOr<Matrix> loaded = ReadMatrix(calibration_path, "calibration keys", false);
    if (!loaded.ok()) return Fail(loaded.status());
    if (loaded->head_dim != keys->head_dim) {
      return Fail(absl::InvalidArgumentError("calibration keys have a different head_dim"));
    }
    calibration = std::move(*loaded);
    inputs.calibration_keys = calibration.data.data();
    inputs.num_calibration_keys = calibration.rows;
  }

  Json rows = Json::array();
  if (!json) {
    printf("%lld keys, %lld queries, head_dim %d%s\n", static_cast<long long>(keys->rows),
           static_cast<long long>(queries->rows), keys->head_dim, inputs.values ? ", with values" : "");
    printf("%-20s %6s %6s %9s %9s %9s %7s %7s %8s %9s %5s %5s %5s %5s %6s\n", "preset", "bytes", "x_bf16", "key_mse",
           "logit_rmse", "logit_std", "top1", "top8", "tv", "out_err", "n3", "n5", "n7", "n9", "w5");
  }
  for (const Preset* preset : *presets) {
    absl::StatusOr<eval::PresetEvaluation> result = eval::EvaluatePreset(*preset, inputs);
    if (!result.ok()) {
      return Fail(absl::Status(result.status().code(),
                               absl::StrFormat("preset %s: %s", std::string(preset->name), result.status().message())));
    }
    if (json) {
      rows.push_back(EvalRowJson(*result, *preset));
    } else {
      PrintEvalRow(*result);
    }
  }
  if (json) {
    PrintJson(Json{{"num_keys", keys->rows},
                   {"num_queries", queries->rows},
                   {"head_dim", keys->head_dim},
                   {"seed", seed},
                   {"presets", rows}});
  }
  return 0;
}

int RunSynth(int argc, const char* const* argv) {
  FlagSet flags("synth",
                "Writes deterministic synthetic vectors [rows, head_dim] as float32 .npy:\n"
                "gaussian (iid N(0,1)) or outlier-keys (N(0,1) + 4 hot channels x10 + a\n"
                "per-channel offset, the pattern reported for real K caches).");
  std::string kind = "gaussian", out_path;
  int64_t rows = 1024, head_dim = 128, seed = 0;
  flags.AddString("kind", &kind, "gaussian | outlier-keys");
  flags.AddInt("rows", &rows, "number of vectors");
  flags.AddInt("head-dim", &head_dim, "head dim");
  flags.AddInt("seed", &seed, "seed");
  std::vector<int64_t> shape;
  flags.AddIntList("shape", &shape,
                   "write this shape instead, e.g. 4,8,2,64 (last axis: head dim; overrides "
                   "--rows and --head-dim)");
  flags.AddRequiredString("out", &out_path, "output .npy");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (!shape.empty()) {
    int64_t n = 1;
    for (int64_t d : shape) {
      if (d < 1 || d > (int64_t{1} << 26) || n > (int64_t{1} << 26) / d) {
        return UsageError("--shape must have dims >= 1 and at most 2^26 elements");
      }
      n *= d;
    }
    head_dim = shape.back();
    rows = n / head_dim;
  } else {
    shape = {rows, head_dim};
  }
  if (rows < 1 || rows > (int64_t{1} << 26)) return UsageError("--rows must be in [1, 2^26]");
  if (head_dim < 1 || head_dim > 4096) return UsageError("--head-dim must be in [1, 4096]");
  std::vector<float> data;
  if (kind == "gaussian") {
    data = eval::GaussianVectors(rows, static_cast<int>(head_dim), static_cast<uint64_t>(seed));
  } else if (kind == "outlier-keys") {
    data = eval::OutlierKeys(rows, static_cast<int>(head_dim), static_cast<uint64_t>(seed));
  } else {
    return UsageError("--kind must be gaussian or outlier-keys, got '" + kind + "'");
  }
  absl::Status written = WriteNpy(out_path, shape, data.data());
  if (!written.ok()) return Fail(written);
  return 0;
}

int RunPresets(int argc, const char* const* argv) {
  FlagSet flags("presets", "Lists the presets: codecs, bytes per (token, KV head), compression.");
  int64_t head_dim = 128;
  bool json = false;
  flags.AddInt("head-dim", &head_dim, "head dim for the byte counts");
  flags.AddBool("json", &json, "print JSON instead of a table");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (head_dim < kMinHeadDim || head_dim > kMaxHeadDim) {
    return UsageError(absl::StrFormat("--head-dim must be in [%d, %d]", kMinHeadDim, kMaxHeadDim));
  }
  const int d = static_cast<int>(head_dim);
  Json rows = Json::array();
  if (!json) {
    printf("%-20s %-18s %-10s %6s %7s  %s\n", "preset", "keys", "values", "bytes", "x_bf16", "description");
  }
  for (const Preset& preset : AllPresets()) {
    if (json) {
      rows.push_back(Json{{"name", std::string(preset.name)},
                          {"keys", preset.key.Name()},
                          {"values", preset.value.Name()},
                          {"bytes_per_token_head", preset.BytesPerTokenHead(d)},
                          {"compression_vs_bf16", preset.CompressionVsBf16(d)},
                          {"evaluation_only", preset.evaluation_only},
                          {"description", std::string(preset.description)}});
    } else {
      printf("%-20s %-18s %-10s %6d %7.2f  %s\n", std::string(preset.name).c_str(), preset.key.Name().c_str(),
             preset.value.Name().c_str(), preset.BytesPerTokenHead(d), preset.CompressionVsBf16(d),
             std::string(preset.description).c_str());
    }
  }
  if (json) PrintJson(Json{{"head_dim", head_dim}, {"presets", rows}});
  return 0;
}

}  // namespace cli
}  // namespace tqkv
