// The parts of the model-config derivation that both formats share: RoPE and
// windows into the proto, the fields no model carries, and the text output.
#include "client/cli/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/preset.h"

namespace tqkv {
namespace cli {
namespace {

constexpr size_t kCommentColumns = 92;
constexpr size_t kListColumns = 96;

bool Positive(double x) { return std::isfinite(x) && x > 0.0; }

std::string Shortest(double x);

// `text` as comment lines of at most kCommentColumns, each starting with
// `indent` "# ".
void AppendComment(const std::string& indent, const std::string& text, std::string* out) {
  std::string line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && indent.size() + 2 + line.size() + 1 + word.size() > kCommentColumns) {
      absl::StrAppend(out, indent, "# ", line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(out, indent, "# ", line, "\n");
}

// `name: [a, b, ...]`, wrapped under the bracket when long.
template <typename T, typename Format>
void AppendList(const std::string& indent, const char* name, const T& values, Format format, std::string* out) {
  std::string line = absl::StrCat(indent, name, ": [");
  const std::string hanging(line.size(), ' ');
  for (int i = 0; i < static_cast<int>(values.size()); ++i) {
    std::string item = format(values[i]);
    if (i + 1 < static_cast<int>(values.size())) item += ",";
    if (i > 0 && line.size() + 1 + item.size() > kListColumns) {
      absl::StrAppend(out, line, "\n");
      line = hanging;
    } else if (i > 0) {
      line += " ";
    }
    line += item;
  }
  absl::StrAppend(out, line, "]\n");
}

// `indent` is the block's own indentation; its fields go two spaces deeper.
void AppendRope(const v1::RotaryEmbedding& r, const std::string& indent, std::string* out) {
  const std::string in = indent + "  ";
  absl::StrAppend(out, indent, "rope {\n", in, "rotary_dims: ", r.rotary_dims(), "\n", in,
                  "pair_layout: ", v1::RotaryEmbedding::PairLayout_Name(r.pair_layout()), "\n", in,
                  "base: ", Shortest(r.base()), "\n");
  if (!r.scaling_type().empty()) {
    absl::StrAppend(out, in, "scaling_type: \"", absl::CEscape(r.scaling_type()), "\"\n", in,
                    "scaling_factor: ", Shortest(r.scaling_factor()), "\n");
  }
  if (r.scaling_type() == "llama3") {
    absl::StrAppend(out, in, "low_freq_factor: ", Shortest(r.low_freq_factor()), "\n", in,
                    "high_freq_factor: ", Shortest(r.high_freq_factor()), "\n", in,
                    "original_max_position: ", r.original_max_position(), "\n");
  }
  if (r.inv_freq_size() > 0) AppendList(in, "inv_freq", r.inv_freq(), Shortest, out);
  absl::StrAppend(out, indent, "}\n");
}

std::string Shortest(double x) { return ShortestDecimal(x); }

}  // namespace

std::string ShortestDecimal(double x) {
  char buffer[40];
  if (std::isfinite(x) && std::floor(x) == x && std::abs(x) < 1e15) {
    std::snprintf(buffer, sizeof buffer, "%.0f", x);
    return buffer;
  }
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof buffer, "%.*g", precision, x);
    if (std::strtod(buffer, nullptr) == x) break;
  }
  return buffer;
}

bool ModelRope::operator==(const ModelRope& o) const {
  return rotary_dims == o.rotary_dims && pair_layout == o.pair_layout && base == o.base && scaling == o.scaling &&
         factor == o.factor && low_freq_factor == o.low_freq_factor && high_freq_factor == o.high_freq_factor &&
         original_max_position == o.original_max_position && beta_fast == o.beta_fast && beta_slow == o.beta_slow &&
         truncate == o.truncate && inv_freq == o.inv_freq;
}

std::vector<double> YarnInvFreq(const ModelRope& rope) {
  const int dim = rope.rotary_dims;
  // The pair index at which a wavelength turns `rotations` times over the
  // original context.
  auto correction_dim = [&](double rotations) {
    return dim * std::log(static_cast<double>(rope.original_max_position) / (rotations * 2.0 * M_PI)) /
           (2.0 * std::log(rope.base));
  };
  double low = correction_dim(rope.beta_fast);
  double high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // as both implementations do
  std::vector<double> inv_freq(dim / 2);
  for (int i = 0; i < dim / 2; ++i) {
    const double extrapolation = std::pow(rope.base, -2.0 * i / dim);
    const double interpolation = extrapolation / rope.factor;
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double keep = 1.0 - ramp;  // the share of the unscaled frequency
    inv_freq[i] = interpolation * (1.0 - keep) + extrapolation * keep;
  }
  return inv_freq;
}

absl::Status WriteRope(const ModelRope& rope, const std::string& where, v1::RotaryEmbedding* out,
                       std::vector<std::string>* notes) {
  if (rope.rotary_dims <= 0 || rope.rotary_dims % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": rotary dims are ", rope.rotary_dims, "; want an even number > 0"));
  }
  if (!Positive(rope.base)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": rope base is ", rope.base, "; want a finite value > 0"));
  }
  if (rope.scaling != ModelRope::Scaling::kNone && !Positive(rope.factor)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": rope scaling factor is ", rope.factor, "; want a finite value > 0"));
  }
  out->set_rotary_dims(rope.rotary_dims);
  out->set_pair_layout(rope.pair_layout);
  out->set_base(rope.base);
  if (!rope.inv_freq.empty()) {
    if (static_cast<int>(rope.inv_freq.size()) != rope.rotary_dims / 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", rope.inv_freq.size(), " rope frequencies; want rotary_dims / 2 = ", rope.rotary_dims / 2));
    }
    for (double f : rope.inv_freq) out->add_inv_freq(f);
    return absl::OkStatus();
  }
  switch (rope.scaling) {
    case ModelRope::Scaling::kNone:
      break;
    case ModelRope::Scaling::kLinear:
      out->set_scaling_type("linear");
      out->set_scaling_factor(rope.factor);
      break;
    case ModelRope::Scaling::kLlama3:
      if (!(rope.low_freq_factor > 0.0) || !(rope.high_freq_factor > rope.low_freq_factor) ||
          rope.original_max_position < 1) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: llama3 rope scaling wants 0 < low_freq_factor < high_freq_factor and "
                            "original_max_position_embeddings >= 1; got %g, %g, %d",
                            where, rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position));
      }
      out->set_scaling_type("llama3");
      out->set_scaling_factor(rope.factor);
      out->set_low_freq_factor(rope.low_freq_factor);
      out->set_high_freq_factor(rope.high_freq_factor);
      out->set_original_max_position(rope.original_max_position);
      break;
    case ModelRope::Scaling::kYarn:
      if (rope.original_max_position < 1 || !Positive(rope.beta_fast) || !Positive(rope.beta_slow)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: yarn rope scaling wants original_max_position_embeddings >= 1 and beta_fast, beta_slow > 0; "
            "got %d, %g, %g",
            where, rope.original_max_position, rope.beta_fast, rope.beta_slow));
      }
      for (double f : YarnInvFreq(rope)) out->add_inv_freq(f);
      notes->push_back(absl::StrFormat(
          "YaRN (factor %s, beta_fast %s, beta_slow %s, original context %d, ramp ends %s): the proto has no "
          "yarn scaling, so its frequencies are written out as inv_freq (over base). Its attention factor "
          "scales q and k alike, not their directions: centering does not need it.",
          Shortest(rope.factor), Shortest(rope.beta_fast), Shortest(rope.beta_slow), rope.original_max_position,
          rope.truncate ? "rounded" : "not rounded"));
      break;
  }
  return absl::OkStatus();
}

absl::Status WriteLayerRopes(const ModelRope& rope, const std::vector<int>& windows, bool sliding,
                             const std::string& where, v1::CacheConfig* cache, std::vector<std::string>* notes) {
  v1::LayerRope* entry = cache->add_layer_ropes();
  for (int layer = 0; layer < static_cast<int>(windows.size()); ++layer) {
    if ((windows[layer] > 0) == sliding) entry->add_layers(layer);
  }
  return WriteRope(rope, where, entry->mutable_rope(), notes);
}

void WriteWindows(const std::vector<int>& windows, v1::CacheConfig* cache) {
  for (size_t layer = 0; layer < windows.size(); ++layer) {
    if (windows[layer] == 0) continue;
    v1::SlidingWindowLayers* group = nullptr;
    for (v1::SlidingWindowLayers& g : *cache->mutable_sliding_window_layers()) {
      if (g.window() == windows[layer]) group = &g;
    }
    if (group == nullptr) {
      group = cache->add_sliding_window_layers();
      group->set_window(windows[layer]);
    }
    group->add_layers(static_cast<int32_t>(layer));
  }
}

absl::Status WriteShape(const ShapeField& layers, const ShapeField& query_heads, const ShapeField& kv_heads,
                        const ShapeField& head_dim, const std::string& where, v1::CacheConfig* cache) {
  for (const ShapeField* field : {&layers, &query_heads, &kv_heads, &head_dim}) {
    if (field->value < 1 || field->value > (int64_t{1} << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", field->name, " is ", field->value, "; want 1 .. 2^20"));
    }
  }
  cache->set_num_layers(static_cast<int32_t>(layers.value));
  cache->set_num_query_heads(static_cast<int32_t>(query_heads.value));
  cache->set_num_kv_heads(static_cast<int32_t>(kv_heads.value));
  cache->set_head_dim(static_cast<int32_t>(head_dim.value));
  return absl::OkStatus();
}

absl::Status FinishCache(const ModelConfigOptions& options, const std::string& where, v1::CacheConfig* cache) {
  if (cache->num_layers() < 1 || cache->num_kv_heads() < 1 || cache->num_query_heads() < 1 || cache->head_dim() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": layers, KV heads, query heads and head dim must all be >= 1; got ", cache->num_layers(),
                     ", ", cache->num_kv_heads(), ", ", cache->num_query_heads(), ", ", cache->head_dim()));
  }
  if (cache->num_query_heads() % cache->num_kv_heads() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", cache->num_query_heads(),
                                                   " query heads are not a multiple of ", cache->num_kv_heads(),
                                                   " KV heads; want grouped-query attention"));
  }
  absl::StatusOr<const Preset*> preset = FindPreset(options.preset);
  if (!preset.ok()) return preset.status();
  if (options.page_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("page tokens are ", options.page_tokens, "; want >= 1"));
  }
  cache->set_name(options.cache_name);
  cache->set_preset(options.preset);
  cache->set_page_tokens(options.page_tokens);
  cache->set_boundary_layers(0);
  return absl::OkStatus();
}

std::string FormatServerConfig(const DerivedConfig& derived) {
  const v1::CacheConfig& c = derived.cache;
  std::string out;
  AppendComment(
      "", absl::StrCat("tqkv-server --config FILE: one cache derived by `tqkv config` from ", derived.source, "."),
      &out);
  for (const std::string& note : derived.notes) AppendComment("", note, &out);
  AppendComment("",
                "memory_budget_bytes is left 0: the cache takes an equal share of the server's "
                "--memory_budget_gib. boundary_layers 0: every layer at the preset (windowed layouts want 0, "
                "docs/cache.md).",
                &out);
  absl::StrAppend(&out, "caches {\n  name: \"", absl::CEscape(c.name()), "\"\n  num_layers: ", c.num_layers(),
                  "\n  num_kv_heads: ", c.num_kv_heads(), "\n  num_query_heads: ", c.num_query_heads(),
                  "\n  head_dim: ", c.head_dim(), "\n  page_tokens: ", c.page_tokens(), "\n  preset: \"",
                  absl::CEscape(c.preset()), "\"\n  boundary_layers: ", c.boundary_layers(), "\n");
  if (c.has_rope()) {
    for (const std::string& note : derived.rope_notes) AppendComment("  ", note, &out);
    AppendRope(c.rope(), "  ", &out);
  }
  for (const v1::LayerRope& r : c.layer_ropes()) {
    absl::StrAppend(&out, "  layer_ropes {\n");
    AppendList(
        "    ", "layers", r.layers(), [](int32_t layer) { return absl::StrCat(layer); }, &out);
    AppendRope(r.rope(), "    ", &out);
    absl::StrAppend(&out, "  }\n");
  }
  for (const std::string& note : derived.window_notes) AppendComment("  ", note, &out);
  for (const v1::SlidingWindowLayers& w : c.sliding_window_layers()) {
    absl::StrAppend(&out, "  sliding_window_layers {\n");
    AppendList(
        "    ", "layers", w.layers(), [](int32_t layer) { return absl::StrCat(layer); }, &out);
    absl::StrAppend(&out, "    window: ", w.window(), "\n  }\n");
  }
  absl::StrAppend(&out, "}\n");
  return out;
}

}  // namespace cli
}  // namespace tqkv
