#include "eval/calibration.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cache/kv_cache.h"
#include "client/cli/npy.h"
#include "kernels/codec.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/key_centering.h"
#include "base/status_macros.h"

namespace tqkv {
namespace eval {
namespace {

// ---------------------------------------------------------------------------
// meta.json: a flat JSON object, read lightly. Scalars are kept as their
// text; nested objects and arrays are skipped.

class FlatJsonReader {
 public:
  explicit FlatJsonReader(std::string_view text) : text_(text) {}

  absl::StatusOr<std::map<std::string, std::string>> Read() {
    std::map<std::string, std::string> members;
    SkipSpace();
    if (!Consume('{')) return Error("expected '{'");
    SkipSpace();
    if (Consume('}')) return Finish(members);
    while (true) {
      SkipSpace();
      ASSIGN_OR_RETURN(std::string key, ReadString());
      SkipSpace();
      if (!Consume(':')) return Error("expected ':'");
      SkipSpace();
      ASSIGN_OR_RETURN(std::string value, ReadValue());
      members[key] = value;
      SkipSpace();
      if (Consume('}')) return Finish(members);
      if (!Consume(',')) return Error("expected ',' or '}'");
    }
  }

 private:
  absl::StatusOr<std::map<std::string, std::string>> Finish(std::map<std::string, std::string> members) {
    SkipSpace();
    if (pos_ != text_.size()) return Error("trailing text after the object");
    return members;
  }

  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrFormat("%s at byte %d", what, pos_));
  }
  void SkipSpace() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool Consume(char c) {
    if (pos_ >= text_.size() || text_[pos_] != c) return false;
    ++pos_;
    return true;
  }

  // A string; escapes are kept as written except \" and \\.
  absl::StatusOr<std::string> ReadString() {
    if (!Consume('"')) return Error("expected a string");
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (text_[pos_] == '\\' && pos_ + 1 < text_.size()) ++pos_;
      out += text_[pos_++];
    }
    if (!Consume('"')) return Error("unterminated string");
    return out;
  }

  // A scalar's text, or "" after skipping an object or array.
  absl::StatusOr<std::string> ReadValue() {
    if (pos_ >= text_.size()) return Error("expected a value");
    const char c = text_[pos_];
    if (c == '"') return ReadString();
    if (c == '{' || c == '[') return SkipNested();
    const size_t begin = pos_;
    while (pos_ < text_.size() && text_[pos_] != ',' && text_[pos_] != '}' &&
           !std::isspace(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
    }
    if (pos_ == begin) return Error("expected a value");
    return std::string(text_.substr(begin, pos_ - begin));
  }

  absl::StatusOr<std::string> SkipNested() {
    int depth = 0;
    do {
      if (pos_ >= text_.size()) return Error("unterminated object or array");
      const char c = text_[pos_];
      if (c == '"') {
        RETURN_IF_ERROR(ReadString().status());
        continue;
      }
      if (c == '{' || c == '[') ++depth;
      if (c == '}' || c == ']') --depth;
      ++pos_;
    } while (depth > 0);
    return std::string();
  }

  std::string_view text_;
  size_t pos_ = 0;
};

absl::StatusOr<int64_t> IntegerMember(const std::map<std::string, std::string>& members, const char* name) {
  auto it = members.find(name);
  if (it == members.end()) {
    return absl::InvalidArgumentError(absl::StrFormat("missing member \"%s\"", name));
  }
  const std::string& text = it->second;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("\"%s\" must be an integer, got '%s'", name, text));
  }
  return static_cast<int64_t>(value);
}

absl::Status CheckMeta(const CaptureMeta& m) {
  if (m.layers < 1) return absl::InvalidArgumentError("\"layers\" must be >= 1");
  if (m.tokens < 2) return absl::InvalidArgumentError("\"tokens\" must be >= 2");
  if (m.head_dim < kMinHeadDim || m.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("\"head_dim\" is %d, want %d..%d", m.head_dim, kMinHeadDim, kMaxHeadDim));
  }
  if (m.num_kv_heads < 1) return absl::InvalidArgumentError("\"num_kv_heads\" must be >= 1");
  if (m.num_query_heads < 1 || m.num_query_heads % m.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "\"num_query_heads\" %d is not a positive multiple of \"num_kv_heads\" %d", m.num_query_heads, m.num_kv_heads));
  }
  return absl::OkStatus();
}

absl::Status Prefixed(const absl::Status& status, const std::string& prefix) {
  return absl::Status(status.code(), absl::StrCat(prefix, ": ", status.message()));
}

std::string ShapeText(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::StatusOr<std::vector<float>> ReadTensor(const std::string& path, int64_t tokens, int heads, int head_dim,
                                              const char* heads_name) {
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  if (!array.ok()) return array.status();
  const std::vector<int64_t> want = {tokens, heads, head_dim};
  if (array->shape != want) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s has shape %s, want [tokens %d, %s %d, head_dim %d] from meta.json", path,
                        ShapeText(array->shape), tokens, heads_name, heads, head_dim));
  }
  for (size_t i = 0; i < array->data.size(); ++i) {
    if (!std::isfinite(array->data[i])) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: entry %d is not finite (%f)", path, i, array->data[i]));
    }
  }
  return std::move(array->data);
}

// ---------------------------------------------------------------------------
// Exact float64 causal attention at the sampled positions.

// Per (position, query head) row: logits over [0, p] and the output.
struct ExactReference {
  std::vector<std::vector<double>> logits;   // row = position index * Hq + head
  std::vector<std::vector<double>> outputs;  // [head_dim] per row
};

// log-softmax of a row, in place.
void LogSoftmax(std::vector<double>& row) {
  const double top = *std::max_element(row.begin(), row.end());
  double sum = 0.0;
  for (double x : row) sum += std::exp(x - top);
  const double lse = top + std::log(sum);
  for (double& x : row) x -= lse;
}

ExactReference ExactAttention(const CaptureMeta& meta, const LayerCapture& capture,
                              const std::vector<int64_t>& positions) {
  const int d = meta.head_dim, hq = meta.num_query_heads, hkv = meta.num_kv_heads;
  const int group = hq / hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  ExactReference ref;
  for (int64_t p : positions) {
    for (int h = 0; h < hq; ++h) {
      const float* q = &capture.queries[(p * hq + h) * d];
      const int g = h / group;
      std::vector<double> logits(p + 1);
      for (int64_t t = 0; t <= p; ++t) {
        const float* k = &capture.keys[(t * hkv + g) * d];
        double dot = 0.0;
        for (int i = 0; i < d; ++i) dot += static_cast<double>(q[i]) * k[i];
        logits[t] = dot * scale;
      }
      std::vector<double> log_p = logits;
      LogSoftmax(log_p);
      std::vector<double> out(d, 0.0);
      for (int64_t t = 0; t <= p; ++t) {
        const double w = std::exp(log_p[t]);
        const float* v = &capture.values[(t * hkv + g) * d];
        for (int i = 0; i < d; ++i) out[i] += w * v[i];
      }
      ref.logits.push_back(std::move(logits));
      ref.outputs.push_back(std::move(out));
    }
  }
  return ref;
}

// ---------------------------------------------------------------------------
// The approximate side: a one-layer KvCache, appended up to each position.

absl::StatusOr<std::vector<std::vector<int>>> LayerHotChannels(const CaptureMeta& meta, const LayerCapture& capture,
                                                               const Preset& preset) {
  std::vector<std::vector<int>> hot;
  if (!preset.NeedsCalibration()) return hot;
  const int d = meta.head_dim;
  std::vector<float> head_keys(meta.tokens * d);
  for (int g = 0; g < meta.num_kv_heads; ++g) {
    for (int64_t t = 0; t < meta.tokens; ++t) {
      std::copy_n(&capture.keys[(t * meta.num_kv_heads + g) * d], d, &head_keys[t * d]);
    }
    hot.push_back(ChooseHotChannels(head_keys.data(), meta.tokens, d, preset.key.HotChannels(d)));
  }
  return hot;
}

absl::StatusOr<CacheOptions> OneLayerCache(const CaptureMeta& meta, const LayerCapture& capture, const Preset& preset,
                                           const KvLayoutOptions& base) {
  CacheOptions options;
  options.name = "calibration";
  options.layout = base;
  KvLayoutOptions& layout = options.layout;
  layout.num_layers = 1;
  layout.num_kv_heads = meta.num_kv_heads;
  layout.num_query_heads = meta.num_query_heads;
  layout.head_dim = meta.head_dim;
  layout.preset = std::string(preset.name);
  layout.boundary_layers = 0;
  layout.layer_presets.clear();
  ASSIGN_OR_RETURN(layout.hot_channels, LayerHotChannels(meta, capture, preset));
  ASSIGN_OR_RETURN(std::shared_ptr<const KvLayout> created, KvLayout::Create(layout));
  // Every token's compressed copy, and the exact pages (same pool) of the
  // sink and recent tokens twice over: an append takes the new recent
  // tokens' pages before it releases the old ones.
  const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  int64_t pages = ceil_div(meta.tokens, layout.page_tokens) + 1;
  if (created->has_exact_tokens()) {
    const KvLayoutOptions& in_effect = created->options();
    const int64_t exact = std::min<int64_t>(
        meta.tokens, int64_t{std::max(0, in_effect.exact_sink_tokens)} + std::max(0, in_effect.exact_recent_tokens));
    pages += 2 * ceil_div(exact, created->exact_page_tokens()) + 4;
  }
  options.memory_budget_bytes = created->page_bytes() * pages;
  return options;
}

// Sums the approximate side's errors against the reference.
struct ErrorSums {
  double output_error = 0.0, output_energy = 0.0;
  double logit_error = 0.0;
  int64_t logit_count = 0;
  double tv = 0.0, kl = 0.0;
  int64_t rows = 0;

  void AddRow(const std::vector<double>& exact_logits, const float* approx_logits,
              const std::vector<double>& exact_output, const float* approx_output) {
    std::vector<double> log_p = exact_logits, log_q(exact_logits.size());
    for (size_t t = 0; t < log_q.size(); ++t) {
      const double diff = approx_logits[t] - exact_logits[t];
      logit_error += diff * diff;
      log_q[t] = approx_logits[t];
    }
    logit_count += static_cast<int64_t>(log_q.size());
    LogSoftmax(log_p);
    LogSoftmax(log_q);
    double row_tv = 0.0, row_kl = 0.0;
    for (size_t t = 0; t < log_p.size(); ++t) {
      const double p = std::exp(log_p[t]);
      row_tv += std::abs(p - std::exp(log_q[t]));
      row_kl += p * (log_p[t] - log_q[t]);
    }
    tv += 0.5 * row_tv;
    kl += std::max(row_kl, 0.0);
    for (size_t i = 0; i < exact_output.size(); ++i) {
      const double diff = approx_output[i] - exact_output[i];
      output_error += diff * diff;
      output_energy += exact_output[i] * exact_output[i];
    }
    ++rows;
  }

  void WriteTo(PresetError& out) const {
    out.output_rel_error =
        output_energy > 0 ? std::sqrt(output_error / output_energy) : (output_error > 0 ? INFINITY : 0.0);
    out.logit_rmse = logit_count ? std::sqrt(logit_error / logit_count) : 0.0;
    out.tv_distance = rows ? tv / rows : 0.0;
    out.kl_divergence = rows ? kl / rows : 0.0;
  }
};

const char* CenteringName(KeyCentering centering) {
  switch (centering) {
    case KeyCentering::kNone:
      return "none";
    case KeyCentering::kPostRope:
      return "post_rope";
    case KeyCentering::kPreRope:
      return "pre_rope";
  }
  return "none";
}

// Bytes and recipe of the layout as in effect.
void DescribeLayout(const KvLayout& layout, PresetError& error) {
  error.token_bytes = static_cast<int64_t>(layout.token_bytes(0));
  error.token_bytes_bf16 = static_cast<int64_t>(layout.token_bytes_bf16());
  if (layout.has_exact_tokens()) {
    error.exact_tokens =
        std::max(0, layout.options().exact_sink_tokens) + std::max(0, layout.options().exact_recent_tokens);
  }
  error.fixed_bytes = 4 * static_cast<int64_t>(layout.mean_floats());
  error.key_centering = CenteringName(layout.key_centering());
}

absl::StatusOr<PresetError> MeasurePreset(const CaptureMeta& meta, const LayerCapture& capture, const Preset& preset,
                                          const std::vector<int64_t>& positions, const ExactReference& ref,
                                          const CalibrationOptions& options) {
  ASSIGN_OR_RETURN(CacheOptions cache_options, OneLayerCache(meta, capture, preset, options.layout));
  std::unique_ptr<Backend> backend = MakeCpuBackend(options.threads);
  ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(cache_options, backend.get()));
  const int d = meta.head_dim, hq = meta.num_query_heads;
  const int64_t kv_row = static_cast<int64_t>(meta.num_kv_heads) * d;
  const std::string id = "capture";
  std::vector<float> output(static_cast<size_t>(hq) * d), logits;
  ErrorSums sums;
  int64_t stored = 0;
  for (size_t i = 0; i < positions.size(); ++i) {
    const int64_t p = positions[i];
    AppendRequest append;
    append.sequence_id = id;
    append.start_position = stored;
    append.layer_begin = 0;
    append.layer_end = 1;
    append.num_tokens = p + 1 - stored;
    append.keys = &capture.keys[stored * kv_row];
    append.values = &capture.values[stored * kv_row];
    RETURN_IF_ERROR(cache->Append(append));
    stored = p + 1;
    const float* query = &capture.queries[p * hq * d];
    AttendRequestItem item{id, 0, 1, query, output.data()};
    RETURN_IF_ERROR(cache->Attend({&item, 1}));
    logits.resize(static_cast<size_t>(hq) * (p + 1));
    RETURN_IF_ERROR(cache->Score(id, 0, 0, p + 1, query, logits.data()));
    for (int h = 0; h < hq; ++h) {
      const size_t row = i * hq + h;
      sums.AddRow(ref.logits[row], &logits[h * (p + 1)], ref.outputs[row], &output[h * d]);
    }
  }
  PresetError error;
  error.preset = &preset;
  sums.WriteTo(error);
  DescribeLayout(cache->layout(), error);
  return error;
}

absl::Status CheckCapture(const CaptureMeta& meta, const LayerCapture& capture) {
  const size_t q = static_cast<size_t>(meta.tokens) * meta.num_query_heads * meta.head_dim;
  const size_t kv = static_cast<size_t>(meta.tokens) * meta.num_kv_heads * meta.head_dim;
  if (capture.queries.size() != q || capture.keys.size() != kv || capture.values.size() != kv) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensors hold %d / %d / %d floats (q / k / v), want %d / %d / %d from the capture's shape",
                        capture.queries.size(), capture.keys.size(), capture.values.size(), q, kv, kv));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Planning.

int FindPresetIndex(const LayerCalibration& layer, std::string_view name) {
  for (size_t i = 0; i < layer.presets.size(); ++i) {
    if (layer.presets[i].preset->name == name) return static_cast<int>(i);
  }
  return -1;
}

absl::Status CheckLayers(absl::Span<const LayerCalibration> layers, const PlanOptions& options) {
  if (layers.empty()) return absl::InvalidArgumentError("no layers measured");
  if (options.context < 1) return absl::InvalidArgumentError("context must be >= 1");
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].layer != static_cast<int>(l)) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d is numbered %d; want layers 0..%d in order", l,
                                                        layers[l].layer, layers.size() - 1));
    }
    bool same = layers[l].presets.size() == layers[0].presets.size();
    for (size_t i = 0; same && i < layers[l].presets.size(); ++i) {
      same = layers[l].presets[i].preset == layers[0].presets[i].preset;
    }
    if (!same) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d was measured with other presets than layer 0", l));
    }
  }
  if (FindPresetIndex(layers[0], options.base_preset) < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("base preset %s was not measured", options.base_preset));
  }
  return absl::OkStatus();
}

// The state of the greedy loop: each layer's chosen preset index.
struct PlanState {
  absl::Span<const LayerCalibration> layers;
  const CaptureMeta* meta;
  const PlanOptions* options;
  std::vector<int> choice;

  double Bits() const {
    std::vector<const PresetError*> chosen;
    for (size_t l = 0; l < layers.size(); ++l) chosen.push_back(&layers[l].presets[choice[l]]);
    return AverageBitsPerCoordinate(chosen, *meta, options->context);
  }
  double Error(int layer, int preset) const { return MetricValue(layers[layer].presets[preset], options->metric); }
  double TotalError() const {
    double total = 0.0;
    for (size_t l = 0; l < layers.size(); ++l) total += Error(static_cast<int>(l), choice[l]);
    return total;
  }
};

// The best upgrade that fits the budget: largest error reduction per extra
// bit, free upgrades first (by reduction). False when none lowers the error.
bool BestStep(PlanState& state, PlanStep& step, int& layer_out, int& preset_out) {
  const double bits = state.Bits();
  double best_gain = 0.0;
  bool found = false;
  for (size_t l = 0; l < state.layers.size(); ++l) {
    const int current = state.choice[l];
    for (size_t i = 0; i < state.layers[l].presets.size(); ++i) {
      const double reduction = state.Error(l, current) - state.Error(l, i);
      if (!(reduction > 1e-12)) continue;
      state.choice[l] = static_cast<int>(i);
      const double extra = state.Bits() - bits;
      const bool fits = state.Bits() <= state.options->budget_bits + 1e-9;
      state.choice[l] = current;
      if (!fits) continue;
      // Free steps rank above all paid ones, then by reduction.
      const double gain = extra <= 1e-12 ? 1e12 + reduction : reduction / extra;
      if (gain > best_gain) {
        best_gain = gain;
        found = true;
        layer_out = static_cast<int>(l);
        preset_out = static_cast<int>(i);
        step = {static_cast<int>(l),
                state.layers[l].presets[current].preset,
                state.layers[l].presets[i].preset,
                state.Error(l, current),
                state.Error(l, i),
                extra};
      }
    }
  }
  return found;
}

// The preset most layers of the plan use; the base on a tie with it, else
// the one reached first in layer order.
const Preset* MostCommonPreset(const ProtectionPlan& plan) {
  auto count = [&](const Preset* p) { return std::count(plan.layer_presets.begin(), plan.layer_presets.end(), p); };
  const Preset* best = plan.base;
  for (const Preset* p : plan.layer_presets) {
    if (count(p) > count(best)) best = p;
  }
  return best;
}

}  // namespace

// ---------------------------------------------------------------------------
// Capture I/O.

absl::StatusOr<CaptureMeta> ParseCaptureMeta(std::string_view json) {
  ASSIGN_OR_RETURN(auto members, FlatJsonReader(json).Read());
  CaptureMeta meta;
  int64_t value = 0;
  const std::pair<const char*, int*> ints[] = {{"layers", &meta.layers},
                                               {"num_query_heads", &meta.num_query_heads},
                                               {"num_kv_heads", &meta.num_kv_heads},
                                               {"head_dim", &meta.head_dim}};
  for (const auto& [name, target] : ints) {
    ASSIGN_OR_RETURN(value, IntegerMember(members, name));
    if (value < 0 || value > (1 << 20)) {
      return absl::InvalidArgumentError(absl::StrFormat("\"%s\" is %d, out of range", name, value));
    }
    *target = static_cast<int>(value);
  }
  ASSIGN_OR_RETURN(meta.tokens, IntegerMember(members, "tokens"));
  if (meta.tokens > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError("\"tokens\" is above 2^24");
  }
  RETURN_IF_ERROR(CheckMeta(meta));
  return meta;
}

std::string CaptureMetaJson(const CaptureMeta& meta) {
  return absl::StrFormat(
      "{\"layers\": %d, \"num_query_heads\": %d, \"num_kv_heads\": %d, \"head_dim\": %d, "
      "\"tokens\": %d}\n",
      meta.layers, meta.num_query_heads, meta.num_kv_heads, meta.head_dim, meta.tokens);
}

std::string CaptureTensorPath(const std::string& dir, int layer, char tensor) {
  return absl::StrFormat("%s/layer_%03d_%c.npy", dir, layer, tensor);
}

absl::StatusOr<CaptureMeta> ReadCaptureMeta(const std::string& dir) {
  const std::string path = dir + "/meta.json";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<CaptureMeta> meta = ParseCaptureMeta(text.str());
  if (!meta.ok()) return Prefixed(meta.status(), path);
  return meta;
}

absl::StatusOr<LayerCapture> ReadCaptureLayer(const std::string& dir, const CaptureMeta& meta, int layer) {
  LayerCapture capture;
  ASSIGN_OR_RETURN(capture.queries, ReadTensor(CaptureTensorPath(dir, layer, 'q'), meta.tokens, meta.num_query_heads,
                                               meta.head_dim, "num_query_heads"));
  ASSIGN_OR_RETURN(capture.keys, ReadTensor(CaptureTensorPath(dir, layer, 'k'), meta.tokens, meta.num_kv_heads,
                                            meta.head_dim, "num_kv_heads"));
  ASSIGN_OR_RETURN(capture.values, ReadTensor(CaptureTensorPath(dir, layer, 'v'), meta.tokens, meta.num_kv_heads,
                                              meta.head_dim, "num_kv_heads"));
  return capture;
}

absl::Status WriteCapture(const std::string& dir, const CaptureMeta& meta, absl::Span<const LayerCapture> layers) {
  if (static_cast<int>(layers.size()) != meta.layers) {
    return absl::InvalidArgumentError(absl::StrFormat("%d layers given, meta says %d", layers.size(), meta.layers));
  }
  for (int l = 0; l < meta.layers; ++l) {
    RETURN_IF_ERROR(Prefixed(CheckCapture(meta, layers[l]), absl::StrCat("layer ", l)));
  }
  const std::string path = dir + "/meta.json";
  std::ofstream out(path);
  out << CaptureMetaJson(meta);
  if (!out.flush()) return absl::UnavailableError(absl::StrCat(path, ": cannot write"));
  const std::vector<int64_t> q_shape = {meta.tokens, meta.num_query_heads, meta.head_dim};
  const std::vector<int64_t> kv_shape = {meta.tokens, meta.num_kv_heads, meta.head_dim};
  for (int l = 0; l < meta.layers; ++l) {
    RETURN_IF_ERROR(WriteNpy(CaptureTensorPath(dir, l, 'q'), q_shape, layers[l].queries.data()));
    RETURN_IF_ERROR(WriteNpy(CaptureTensorPath(dir, l, 'k'), kv_shape, layers[l].keys.data()));
    RETURN_IF_ERROR(WriteNpy(CaptureTensorPath(dir, l, 'v'), kv_shape, layers[l].values.data()));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Measurement.

std::vector<int64_t> SamplePositions(int64_t tokens, int count) {
  std::vector<int64_t> positions;
  if (tokens < 2 || count < 1) return positions;
  const int64_t first = tokens / 2, last = tokens - 1;
  const int64_t n = std::min<int64_t>(count, last - first + 1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = n == 1 ? last : first + (i * (last - first) + (n - 1) / 2) / (n - 1);
    if (positions.empty() || p > positions.back()) positions.push_back(p);
  }
  return positions;
}

absl::StatusOr<LayerCalibration> CalibrateLayer(const CaptureMeta& meta, int layer, const LayerCapture& capture,
                                                absl::Span<const Preset* const> presets,
                                                const CalibrationOptions& options) {
  RETURN_IF_ERROR(CheckMeta(meta));
  RETURN_IF_ERROR(Prefixed(CheckCapture(meta, capture), absl::StrCat("layer ", layer)));
  if (options.positions < 1) return absl::InvalidArgumentError("positions must be >= 1");
  LayerCalibration result;
  result.layer = layer;
  result.positions = SamplePositions(meta.tokens, options.positions);
  const ExactReference ref = ExactAttention(meta, capture, result.positions);
  for (const Preset* preset : presets) {
    absl::StatusOr<PresetError> error = MeasurePreset(meta, capture, *preset, result.positions, ref, options);
    if (!error.ok()) {
      return Prefixed(error.status(), absl::StrFormat("layer %d, preset %s", layer, std::string(preset->name)));
    }
    result.presets.push_back(*error);
  }
  return result;
}

// ---------------------------------------------------------------------------
// Planning.

absl::StatusOr<CalibrationMetric> ParseCalibrationMetric(std::string_view name) {
  if (name == "output") return CalibrationMetric::kOutputError;
  if (name == "kl") return CalibrationMetric::kKlDivergence;
  if (name == "tv") return CalibrationMetric::kTvDistance;
  if (name == "logit") return CalibrationMetric::kLogitRmse;
  return absl::InvalidArgumentError(
      absl::StrCat("metric must be output, kl, tv or logit, got '", std::string(name), "'"));
}

double MetricValue(const PresetError& error, CalibrationMetric metric) {
  switch (metric) {
    case CalibrationMetric::kOutputError:
      return error.output_rel_error;
    case CalibrationMetric::kKlDivergence:
      return error.kl_divergence;
    case CalibrationMetric::kTvDistance:
      return error.tv_distance;
    case CalibrationMetric::kLogitRmse:
      return error.logit_rmse;
  }
  return error.output_rel_error;
}

double LayerBytesPerToken(const PresetError& error, int64_t context) {
  const double per_sequence =
      static_cast<double>(std::min(error.exact_tokens, context)) * error.token_bytes_bf16 + error.fixed_bytes;
  return error.token_bytes + per_sequence / context;
}

double AverageBitsPerCoordinate(absl::Span<const PresetError* const> layers, const CaptureMeta& meta, int64_t context) {
  double bytes = 0.0;
  for (const PresetError* e : layers) bytes += LayerBytesPerToken(*e, context);
  const double coordinates = 2.0 * meta.num_kv_heads * meta.head_dim * static_cast<double>(layers.size());
  return 8.0 * bytes / coordinates;
}

absl::StatusOr<ProtectionPlan> PlanProtection(const CaptureMeta& meta, absl::Span<const LayerCalibration> layers,
                                              const PlanOptions& options) {
  RETURN_IF_ERROR(CheckLayers(layers, options));
  const int base = FindPresetIndex(layers[0], options.base_preset);
  PlanState state{layers, &meta, &options, std::vector<int>(layers.size(), base)};
  ProtectionPlan plan;
  plan.base = layers[0].presets[base].preset;
  plan.base_bits = state.Bits();
  plan.base_error = state.TotalError();
  if (plan.base_bits > options.budget_bits + 1e-9) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the budget of %.3f bits per coordinate is below the %.3f that %s takes on every layer",
                        options.budget_bits, plan.base_bits, options.base_preset));
  }
  PlanStep step;
  int layer = 0, preset = 0;
  while (BestStep(state, step, layer, preset)) {
    state.choice[layer] = preset;
    plan.steps.push_back(step);
  }
  for (int choice : state.choice) plan.layer_presets.push_back(layers[0].presets[choice].preset);
  plan.total_error = state.TotalError();
  plan.bits_per_coordinate = state.Bits();
  plan.ratio_vs_bf16 = 16.0 / plan.bits_per_coordinate;
  return plan;
}

std::string ProtectionConfigText(const ProtectionPlan& plan, const PlanOptions& options) {
  const Preset* common = MostCommonPreset(plan);
  std::string text = absl::StrFormat("preset: \"%s\"\nboundary_layers: 0\n", std::string(common->name));
  std::vector<const Preset*> order;
  for (const Preset* p : plan.layer_presets) {
    if (p != common && std::find(order.begin(), order.end(), p) == order.end()) {
      order.push_back(p);
    }
  }
  for (const Preset* p : order) {
    std::vector<int> layers;
    for (size_t l = 0; l < plan.layer_presets.size(); ++l) {
      if (plan.layer_presets[l] == p) layers.push_back(static_cast<int>(l));
    }
    absl::StrAppendFormat(&text, "protected_layers { layers: [%s] preset: \"%s\" }\n", absl::StrJoin(layers, ", "),
                          std::string(p->name));
  }
  if (!options.recipe.empty()) absl::StrAppendFormat(&text, "# measured with %s\n", options.recipe);
  absl::StrAppendFormat(&text,
                        "# %.3f bits per coordinate, %.2fx vs bf16 at context %d"
                        " (exact tokens and key means included)\n",
                        plan.bits_per_coordinate, plan.ratio_vs_bf16, options.context);
  return text;
}

}  // namespace eval
}  // namespace tqkv
