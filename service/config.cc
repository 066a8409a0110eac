#include "service/config.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/text_format.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"
#include "base/status_macros.h"

namespace tqkv {
namespace service {
namespace {

constexpr char kDefaultConfig[] = R"pb(
  # Llama-3.1-8B: 32 layers, GQA 32 query / 8 KV heads, head_dim 128.
  # 3-bit TurboQuant keys and 4-bit uniform values (turboquant_k3v4_nc's
  # codecs) with the *_csw recipe: keys centered before RoPE (Llama-3.1's
  # RoPE, in the Hugging Face half-split pair layout vLLM and SGLang pass
  # keys in), the first 4 and the last 64 tokens of every layer exact at fp16.
  # No fp16 boundary layers: 4.19x the tokens of bf16 at 8k context.
  caches {
    name: "default"
    num_layers: 32
    num_kv_heads: 8
    num_query_heads: 32
    head_dim: 128
    page_tokens: 16
    preset: "tqkv_k3v4u_csw"
    boundary_layers: 0
    rope {
      pair_layout: HALF_SPLIT
      base: 500000
      scaling_type: "llama3"
      scaling_factor: 8
      low_freq_factor: 1
      high_freq_factor: 4
      original_max_position: 8192
    }
  }
)pb";

// Collects the parser's errors ("line 3:7: ...") instead of logging them.
class ErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column, const std::string& message) override {
    if (!errors_.empty()) errors_ += "; ";
    absl::StrAppend(&errors_, "line ", line + 1, ":", column + 1, ": ", message);
  }
  const std::string& errors() const { return errors_; }

 private:
  std::string errors_;
};

// Field names a config file may still use, each read as its new name. The
// field numbers did not change, so the binary form (clients, export headers,
// snapshots) needs nothing; only the text format does.
constexpr std::pair<const char*, const char*> kRenamedFields[] = {
    // "window" means sliding-window attention only (sliding_window_layers).
    {"exact_window_tokens", "exact_recent_tokens"},
};

// Ignores what the pre-scan finds wrong: the parse that follows reports it.
class QuietErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int, google::protobuf::io::ColumnNumber, const std::string&) override {}
};

// The byte offset of (line, column) as protobuf's tokenizer counts them: a
// tab advances the column to the next multiple of 8.
size_t OffsetOf(const std::string& text, int line, int column) {
  size_t i = 0;
  for (int l = 0; l < line && i < text.size(); ++i) l += text[i] == '\n';
  for (int c = 0; c < column && i < text.size(); ++i) c += text[i] == '\t' ? 8 - c % 8 : 1;
  return i;
}

// `text` with every renamed field name (an identifier followed by ':',
// outside comments and strings) replaced by its new name; a warning for each.
std::string RenameOldFields(const std::string& text, std::vector<std::string>* warnings) {
  struct Rename {
    size_t offset;
    const char* old_name;
    const char* new_name;
  };
  std::vector<Rename> renames;
  QuietErrorCollector quiet;
  google::protobuf::io::ArrayInputStream input(text.data(), static_cast<int>(text.size()));
  google::protobuf::io::Tokenizer tokenizer(&input, &quiet);
  tokenizer.set_comment_style(google::protobuf::io::Tokenizer::SH_COMMENT_STYLE);
  tokenizer.set_allow_f_after_float(true);
  tokenizer.set_require_space_after_number(false);
  tokenizer.set_allow_multiline_strings(true);
  const std::pair<const char*, const char*>* candidate = nullptr;
  size_t candidate_offset = 0;
  while (tokenizer.Next()) {
    const google::protobuf::io::Tokenizer::Token& token = tokenizer.current();
    if (candidate != nullptr && token.text == ":") {
      renames.push_back({candidate_offset, candidate->first, candidate->second});
      if (warnings != nullptr) {
        warnings->push_back(absl::StrCat("config line ", token.line + 1, ": ", candidate->first, " is deprecated; use ",
                                         candidate->second));
      }
    }
    candidate = nullptr;
    if (token.type != google::protobuf::io::Tokenizer::TYPE_IDENTIFIER) continue;
    for (const auto& renamed : kRenamedFields) {
      if (token.text != renamed.first) continue;
      const size_t offset = OffsetOf(text, token.line, token.column);
      if (text.compare(offset, token.text.size(), token.text) == 0) {
        candidate = &renamed;
        candidate_offset = offset;
      }
    }
  }
  std::string out = text;
  for (auto r = renames.rbegin(); r != renames.rend(); ++r) {
    out.replace(r->offset, std::strlen(r->old_name), r->new_name);
  }
  return out;
}

absl::Status ReadRope(const v1::RotaryEmbedding& r, RopeOptions* rope) {
  rope->rotary_dims = r.rotary_dims();
  rope->pair_layout =
      r.pair_layout() == v1::RotaryEmbedding::HALF_SPLIT ? RopePairLayout::kHalfSplit : RopePairLayout::kInterleaved;
  rope->base = r.base();
  const std::string& type = r.scaling_type();
  if (type.empty() || type == "none") {
    rope->scaling = RopeScaling::kNone;
  } else if (type == "linear") {
    rope->scaling = RopeScaling::kLinear;
  } else if (type == "llama3") {
    rope->scaling = RopeScaling::kLlama3;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("rope scaling_type is '", type, "'; want \"none\", \"linear\" or \"llama3\""));
  }
  if (rope->scaling != RopeScaling::kNone) {
    rope->scaling_factor = r.scaling_factor();
    rope->low_freq_factor = r.low_freq_factor();
    rope->high_freq_factor = r.high_freq_factor();
    rope->original_max_position = r.original_max_position();
  }
  rope->inv_freq.assign(r.inv_freq().begin(), r.inv_freq().end());
  return absl::OkStatus();
}

// The centering, exact-token and protected-layer fields; unset ones stay
// unset so that the preset's recipe fills them.
absl::Status ReadCentering(const v1::CacheConfig& c, KvLayoutOptions* layout) {
  const std::string& centering = c.key_centering();
  if (centering == "none") {
    layout->key_centering = KeyCentering::kNone;
  } else if (centering == "post_rope") {
    layout->key_centering = KeyCentering::kPostRope;
  } else if (centering == "pre_rope") {
    layout->key_centering = KeyCentering::kPreRope;
  } else if (!centering.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("key_centering is '", centering, "'; want \"none\", \"post_rope\" or \"pre_rope\""));
  }
  if (c.has_rope()) RETURN_IF_ERROR(ReadRope(c.rope(), &layout->rope));
  if (c.layer_ropes_size() > 0) layout->layer_ropes.assign(c.num_layers(), RopeOptions());
  for (const v1::LayerRope& lr : c.layer_ropes()) {
    RopeOptions rope;
    RETURN_IF_ERROR(ReadRope(lr.rope(), &rope));
    if (!rope.known()) {
      return absl::InvalidArgumentError("layer_ropes has a rope with no base or inv_freq; want e.g. base: 10000");
    }
    for (int32_t layer : lr.layers()) {
      if (layer < 0 || layer >= c.num_layers()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("layer_ropes names layer %d; want layers in [0, num_layers = %d)", layer, c.num_layers()));
      }
      if (layout->layer_ropes[layer].known()) {
        return absl::InvalidArgumentError(absl::StrFormat("layer_ropes names layer %d twice", layer));
      }
      layout->layer_ropes[layer] = rope;
    }
  }
  if (c.key_scales_size() > 0) {
    const size_t per_layer = static_cast<size_t>(c.num_kv_heads()) * c.head_dim();
    layout->key_scales.assign(per_layer * std::max(0, c.num_layers()), 1.0f);
    std::vector<bool> seen(std::max(0, c.num_layers()), false);
    for (const v1::KeyScales& k : c.key_scales()) {
      if (k.layer() < 0 || k.layer() >= c.num_layers()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "key_scales names layer %d; want layers in [0, num_layers = %d)", k.layer(), c.num_layers()));
      }
      if (seen[k.layer()]) {
        return absl::InvalidArgumentError(absl::StrFormat("key_scales names layer %d twice", k.layer()));
      }
      seen[k.layer()] = true;
      if (static_cast<size_t>(k.scales_size()) != per_layer) {
        return absl::InvalidArgumentError(
            absl::StrFormat("key_scales of layer %d has %d values; want num_kv_heads x head_dim = %d", k.layer(),
                            k.scales_size(), per_layer));
      }
      std::copy(k.scales().begin(), k.scales().end(), layout->key_scales.begin() + k.layer() * per_layer);
    }
  }
  if (c.has_centering_tokens()) layout->centering_tokens = c.centering_tokens();
  if (c.has_centering_pairs()) layout->centering_pairs = c.centering_pairs();
  if (c.has_centering_includes_sinks()) layout->centering_includes_sinks = c.centering_includes_sinks();
  if (c.has_sequence_key_scales()) layout->sequence_key_scales = c.sequence_key_scales();
  for (const auto& [has, value, name, field] :
       {std::tuple{c.has_exact_sink_tokens(), c.exact_sink_tokens(), "exact_sink_tokens", &layout->exact_sink_tokens},
        std::tuple{c.has_exact_recent_tokens(), c.exact_recent_tokens(), "exact_recent_tokens",
                   &layout->exact_recent_tokens}}) {
    if (!has) continue;
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is ", value, "; want 0..4096"));
    }
    *field = value;
  }
  if (c.protected_layers_size() > 0) layout->layer_presets.assign(c.num_layers(), "");
  for (const v1::ProtectedLayers& p : c.protected_layers()) {
    if (p.preset().empty()) {
      return absl::InvalidArgumentError("protected_layers has no preset; want e.g. preset: \"tqkv_k4v4\"");
    }
    for (int32_t layer : p.layers()) {
      if (layer < 0 || layer >= c.num_layers()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "protected_layers names layer %d; want layers in [0, num_layers = %d)", layer, c.num_layers()));
      }
      if (!layout->layer_presets[layer].empty()) {
        return absl::InvalidArgumentError(absl::StrFormat("protected_layers names layer %d twice (presets %s and %s)",
                                                          layer, layout->layer_presets[layer], p.preset()));
      }
      layout->layer_presets[layer] = p.preset();
    }
  }
  return absl::OkStatus();
}

// sliding_window_layers -> KvLayoutOptions::layer_windows (empty when none).
absl::Status ReadWindows(const v1::CacheConfig& c, KvLayoutOptions* layout) {
  if (c.sliding_window_layers_size() == 0) return absl::OkStatus();
  layout->layer_windows.assign(c.num_layers(), 0);
  for (const v1::SlidingWindowLayers& w : c.sliding_window_layers()) {
    if (w.window() < 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sliding_window_layers has window %d; want a window of at least 1 token", w.window()));
    }
    for (int32_t layer : w.layers()) {
      if (layer < 0 || layer >= c.num_layers()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "sliding_window_layers names layer %d; want layers in [0, num_layers = %d)", layer, c.num_layers()));
      }
      if (layout->layer_windows[layer] != 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("sliding_window_layers names layer %d twice (windows %d and %d)", layer,
                            layout->layer_windows[layer], w.window()));
      }
      layout->layer_windows[layer] = w.window();
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* DefaultServerConfigText() { return kDefaultConfig; }

absl::StatusOr<v1::ServerConfig> ParseServerConfig(const std::string& text, std::vector<std::string>* warnings) {
  v1::ServerConfig config;
  ErrorCollector errors;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(RenameOldFields(text, warnings), &config)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config is not a text-format tqkv.v1.ServerConfig: ", errors.errors()));
  }
  return config;
}

absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path, std::vector<std::string>* warnings) {
  if (path.empty()) return ParseServerConfig(kDefaultConfig);
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read config file '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<v1::ServerConfig> config = ParseServerConfig(text.str(), warnings);
  if (!config.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", config.status().message()));
  }
  return config;
}

absl::StatusOr<std::vector<CacheOptions>> ToCacheOptions(const v1::ServerConfig& config,
                                                         uint64_t process_budget_bytes) {
  if (config.caches_size() == 0) {
    return absl::InvalidArgumentError("config has no caches; want at least one `caches { ... }`");
  }
  int shares = 0;
  for (const v1::CacheConfig& c : config.caches()) shares += c.memory_budget_bytes() == 0;
  const uint64_t share = shares > 0 ? process_budget_bytes / shares : 0;

  std::vector<CacheOptions> out;
  absl::flat_hash_set<std::string> names;
  for (int i = 0; i < config.caches_size(); ++i) {
    const v1::CacheConfig& c = config.caches(i);
    CacheOptions options;
    options.name = c.name();
    if (options.name.empty()) {
      if (i != 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("cache %d has no name; only the first cache may omit it (\"default\")", i));
      }
      options.name = "default";
    }
    if (!names.insert(options.name).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("cache name '%s' appears twice; want unique names", options.name));
    }
    const std::string where = absl::StrCat("cache '", options.name, "': ");
    if (c.num_layers() < 1 || c.num_kv_heads() < 1 || c.num_query_heads() < 1 || c.head_dim() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "num_layers, num_kv_heads, num_query_heads and head_dim must all be >= 1; got ",
                       c.num_layers(), ", ", c.num_kv_heads(), ", ", c.num_query_heads(), ", ", c.head_dim()));
    }
    if (c.page_tokens() < 0 || c.boundary_layers() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, "page_tokens and boundary_layers must be >= 0; got ",
                                                     c.page_tokens(), ", ", c.boundary_layers()));
    }
    KvLayoutOptions& layout = options.layout;
    layout.num_layers = c.num_layers();
    layout.num_kv_heads = c.num_kv_heads();
    layout.num_query_heads = c.num_query_heads();
    layout.head_dim = c.head_dim();
    if (c.page_tokens() != 0) layout.page_tokens = c.page_tokens();
    if (!c.preset().empty()) layout.preset = c.preset();
    layout.boundary_layers = c.boundary_layers();
    if (!c.boundary_preset().empty()) layout.boundary_preset = c.boundary_preset();
    if (c.rotation_seed() != 0) layout.rotation_seed = c.rotation_seed();
    if (absl::Status status = ReadCentering(c, &layout); !status.ok()) {
      return absl::Status(status.code(), absl::StrCat(where, status.message()));
    }
    if (absl::Status status = ReadWindows(c, &layout); !status.ok()) {
      return absl::Status(status.code(), absl::StrCat(where, status.message()));
    }
    absl::StatusOr<std::shared_ptr<const KvLayout>> made = KvLayout::Create(layout);
    if (!made.ok()) {
      return absl::Status(made.status().code(), absl::StrCat(where, made.status().message()));
    }
    options.memory_budget_bytes = c.memory_budget_bytes() != 0 ? c.memory_budget_bytes() : share;
    if (options.memory_budget_bytes < (*made)->page_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%smemory budget %d bytes holds no page of %d bytes; raise memory_budget_bytes or "
                          "--memory_budget_gib",
                          where, options.memory_budget_bytes, (*made)->page_bytes()));
    }
    options.evict_lru = c.evict_lru();
    if (!(c.idle_ttl_seconds() >= 0) || std::isinf(c.idle_ttl_seconds())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "idle_ttl_seconds is ", c.idle_ttl_seconds(), "; want a finite value >= 0 (0: never)"));
    }
    if (c.idle_ttl_seconds() > 0) options.idle_ttl = absl::Seconds(c.idle_ttl_seconds());
    out.push_back(std::move(options));
  }
  return out;
}

namespace {

void WriteRope(const RopeOptions& rope, v1::RotaryEmbedding* r) {
  r->set_rotary_dims(rope.rotary_dims);
  r->set_pair_layout(rope.pair_layout == RopePairLayout::kHalfSplit ? v1::RotaryEmbedding::HALF_SPLIT
                                                                    : v1::RotaryEmbedding::INTERLEAVED);
  r->set_base(rope.base);
  if (rope.scaling != RopeScaling::kNone) {
    r->set_scaling_type(rope.scaling == RopeScaling::kLinear ? "linear" : "llama3");
    r->set_scaling_factor(rope.scaling_factor);
    r->set_low_freq_factor(rope.low_freq_factor);
    r->set_high_freq_factor(rope.high_freq_factor);
    r->set_original_max_position(rope.original_max_position);
  }
  for (double f : rope.inv_freq) r->add_inv_freq(f);
}

bool SameRope(const RopeOptions& a, const RopeOptions& b) {
  return a.rotary_dims == b.rotary_dims && a.pair_layout == b.pair_layout && a.base == b.base &&
         a.scaling == b.scaling && a.scaling_factor == b.scaling_factor && a.low_freq_factor == b.low_freq_factor &&
         a.high_freq_factor == b.high_freq_factor && a.original_max_position == b.original_max_position &&
         a.inv_freq == b.inv_freq;
}

// The effective recipe (the preset's where the config left fields unset).
void WriteCentering(const KvLayoutOptions& given, v1::CacheConfig* c) {
  // A running cache's options are resolved already (KvLayout::options());
  // only a config's own options need the preset's recipe filled in.
  std::shared_ptr<const KvLayout> layout;
  if (!given.key_centering.has_value() || given.exact_sink_tokens < 0 || given.exact_recent_tokens < 0 ||
      !given.sequence_key_scales.has_value()) {
    absl::StatusOr<std::shared_ptr<const KvLayout>> made = KvLayout::Create(given);
    if (!made.ok()) return;  // configs are validated before they get here
    layout = *made;
  }
  const KvLayoutOptions& l = layout ? layout->options() : given;
  const KeyCentering asked = l.key_centering.value_or(KeyCentering::kNone);
  c->set_key_centering(asked == KeyCentering::kPreRope    ? "pre_rope"
                       : asked == KeyCentering::kPostRope ? "post_rope"
                                                          : "none");
  if (l.rope.known()) WriteRope(l.rope, c->mutable_rope());
  // Layers of the same RoPE grouped, in layer order.
  std::vector<const RopeOptions*> ropes;
  for (size_t layer = 0; layer < l.layer_ropes.size(); ++layer) {
    const RopeOptions& rope = l.layer_ropes[layer];
    if (!rope.known()) continue;
    auto at = std::find_if(ropes.begin(), ropes.end(), [&](const RopeOptions* r) { return SameRope(*r, rope); });
    if (at == ropes.end()) {
      ropes.push_back(&rope);
      WriteRope(rope, c->add_layer_ropes()->mutable_rope());
      at = ropes.end() - 1;
    }
    c->mutable_layer_ropes(static_cast<int>(at - ropes.begin()))->add_layers(static_cast<int32_t>(layer));
  }
  if (!l.key_scales.empty()) {
    const size_t per_layer = static_cast<size_t>(l.num_kv_heads) * l.head_dim;
    for (int layer = 0; layer < l.num_layers; ++layer) {
      const auto begin = l.key_scales.begin() + layer * per_layer;
      if (std::all_of(begin, begin + per_layer, [](float s) { return s == 1.0f; })) continue;
      v1::KeyScales* k = c->add_key_scales();
      k->set_layer(layer);
      k->mutable_scales()->Add(begin, begin + per_layer);
    }
  }
  c->set_centering_tokens(l.centering_tokens);
  c->set_centering_pairs(l.centering_pairs);
  c->set_centering_includes_sinks(l.centering_includes_sinks);
  c->set_sequence_key_scales(l.sequence_key_scales.value_or(false));
  c->set_exact_sink_tokens(l.exact_sink_tokens);
  c->set_exact_recent_tokens(l.exact_recent_tokens);
  // Protected layers grouped by preset, in layer order.
  std::vector<std::string> presets;
  for (size_t layer = 0; layer < l.layer_presets.size(); ++layer) {
    const std::string& p = l.layer_presets[layer];
    if (p.empty()) continue;
    auto at = std::find(presets.begin(), presets.end(), p);
    if (at == presets.end()) {
      presets.push_back(p);
      c->add_protected_layers()->set_preset(p);
      at = presets.end() - 1;
    }
    c->mutable_protected_layers(static_cast<int>(at - presets.begin()))->add_layers(static_cast<int32_t>(layer));
  }
}

}  // namespace

v1::CacheConfig ToCacheConfig(const CacheOptions& options) {
  v1::CacheConfig c;
  const KvLayoutOptions& l = options.layout;
  c.set_name(options.name);
  c.set_num_layers(l.num_layers);
  c.set_num_kv_heads(l.num_kv_heads);
  c.set_num_query_heads(l.num_query_heads);
  c.set_head_dim(l.head_dim);
  c.set_page_tokens(l.page_tokens);
  c.set_preset(l.preset);
  c.set_boundary_layers(l.boundary_layers);
  c.set_boundary_preset(l.boundary_preset);
  c.set_rotation_seed(l.rotation_seed);
  c.set_memory_budget_bytes(options.memory_budget_bytes);
  c.set_evict_lru(options.evict_lru);
  if (options.idle_ttl != absl::InfiniteDuration()) {
    c.set_idle_ttl_seconds(absl::ToDoubleSeconds(options.idle_ttl));
  }
  WriteCentering(l, &c);
  // Sliding-window layers grouped by window, in order of first layer.
  for (size_t layer = 0; layer < l.layer_windows.size(); ++layer) {
    const int window = l.layer_windows[layer];
    if (window == 0) continue;
    v1::SlidingWindowLayers* group = nullptr;
    for (v1::SlidingWindowLayers& g : *c.mutable_sliding_window_layers()) {
      if (g.window() == window) group = &g;
    }
    if (group == nullptr) {
      group = c.add_sliding_window_layers();
      group->set_window(window);
    }
    group->add_layers(static_cast<int32_t>(layer));
  }
  return c;
}

}  // namespace service
}  // namespace tqkv
