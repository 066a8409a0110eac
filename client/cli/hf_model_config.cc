// A CacheConfig from a Hugging Face config.json (model_config.h).
//
// config.json leaves out what equals the model class's default (Gemma 3's
// published configs have no rope_theta), so each family below carries the
// defaults of its transformers configuration class for the fields read here.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "client/cli/model_config.h"
#include "base/status_macros.h"

namespace tqkv {
namespace cli {
namespace {

using Json = nlohmann::json;

// Which layers slide, by family, when config.json has no layer_types.
enum class WindowRule {
  kNone,        // every layer full attention
  kEveryLayer,  // sliding_window, when set, on every layer (Mistral, Mixtral, Phi-3)
  kQwen,        // with use_sliding_window: layers >= max_window_layers
  kPattern,     // layer i is full attention when (i + 1) % pattern == 0, else sliding
};

struct HfFamily {
  absl::string_view model_type;
  double rope_theta;  // when config.json omits rope_theta
  WindowRule windows;
  int pattern;              // kPattern, when config.json has no sliding_window_pattern
  int default_window;       // when config.json omits sliding_window (0: none)
  double local_rope_theta;  // sliding layers' base when omitted (Gemma 3); 0: one RoPE
  double softcap;           // attn_logit_softcapping when omitted (Gemma 2); 0: none
  bool learned_sinks;       // gpt-oss
  bool mha_by_default;      // no num_key_value_heads means one KV head per query head
};

// The defaults of transformers' configuration classes.
constexpr HfFamily kFamilies[] = {
    {"llama", 10000.0, WindowRule::kNone, 0, 0, 0.0, 0.0, false, true},
    {"mistral", 10000.0, WindowRule::kEveryLayer, 0, 4096, 0.0, 0.0, false, false},
    {"mixtral", 1e6, WindowRule::kEveryLayer, 0, 0, 0.0, 0.0, false, false},
    {"qwen2", 10000.0, WindowRule::kQwen, 0, 4096, 0.0, 0.0, false, false},
    {"qwen2_moe", 10000.0, WindowRule::kQwen, 0, 4096, 0.0, 0.0, false, false},
    {"qwen3", 10000.0, WindowRule::kQwen, 0, 4096, 0.0, 0.0, false, false},
    {"qwen3_moe", 10000.0, WindowRule::kQwen, 0, 4096, 0.0, 0.0, false, false},
    {"phi3", 10000.0, WindowRule::kEveryLayer, 0, 0, 0.0, 0.0, false, false},
    {"gemma", 10000.0, WindowRule::kNone, 0, 0, 0.0, 0.0, false, false},
    {"gemma2", 10000.0, WindowRule::kPattern, 2, 4096, 0.0, 50.0, false, false},
    {"gemma3_text", 1e6, WindowRule::kPattern, 6, 4096, 10000.0, 0.0, false, false},
    {"gpt_oss", 150000.0, WindowRule::kPattern, 2, 128, 0.0, 0.0, true, false},
};

// Typed reads of one JSON object's members, with errors that name the field
// as `file: prefix.key`.
class Fields {
 public:
  Fields(const Json& object, std::string file, std::string prefix)
      : j_(&object), file_(std::move(file)), prefix_(std::move(prefix)) {}

  const std::string& file() const { return file_; }
  std::string Name(absl::string_view key) const { return absl::StrCat(prefix_, key); }
  std::string Where(absl::string_view key) const { return absl::StrCat(file_, ": ", prefix_, key); }
  // Present (null counts as present: HF reads null as None).
  bool Contains(absl::string_view key) const { return j_->contains(std::string(key)); }
  bool Has(absl::string_view key) const { return Contains(key) && !At(key).is_null(); }
  const Json& At(absl::string_view key) const { return j_->at(std::string(key)); }
  Fields Object(absl::string_view key) const { return Fields(At(key), file_, absl::StrCat(prefix_, key, ".")); }

  absl::Status Error(absl::string_view key, absl::string_view want) const {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(key), Has(key) ? absl::StrCat(" is ", At(key).dump()) : " is missing", "; want ", want));
  }
  absl::StatusOr<int64_t> Int(absl::string_view key) const {
    if (!Has(key)) return Error(key, "an integer");
    const Json& v = At(key);
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() && std::abs(v.get<double>()) < 1e15) {
      return static_cast<int64_t>(v.get<double>());
    }
    return Error(key, "an integer");
  }
  absl::StatusOr<int64_t> IntOr(absl::string_view key, int64_t fallback) const {
    if (!Has(key)) return fallback;
    return Int(key);
  }
  absl::StatusOr<double> Number(absl::string_view key) const {
    if (!Has(key) || !At(key).is_number()) return Error(key, "a number");
    return At(key).get<double>();
  }
  absl::StatusOr<double> NumberOr(absl::string_view key, double fallback) const {
    if (!Has(key)) return fallback;
    return Number(key);
  }
  absl::StatusOr<bool> BoolOr(absl::string_view key, bool fallback) const {
    if (!Has(key)) return fallback;
    if (!At(key).is_boolean()) return Error(key, "true or false");
    return At(key).get<bool>();
  }
  absl::StatusOr<std::string> StringOr(absl::string_view key, std::string fallback) const {
    if (!Has(key)) return fallback;
    if (!At(key).is_string()) return Error(key, "a string");
    return At(key).get<std::string>();
  }

 private:
  const Json* j_;  // not owned
  std::string file_;
  std::string prefix_;
};

absl::StatusOr<const HfFamily*> FindFamily(const std::string& model_type, const std::string& where) {
  std::vector<absl::string_view> known;
  for (const HfFamily& f : kFamilies) {
    if (f.model_type == model_type) return &f;
    known.push_back(f.model_type);
  }
  return absl::InvalidArgumentError(absl::StrCat(where, ": model_type '", model_type,
                                                 "' is not one tqkv config derives (its RoPE pair layout, windows and "
                                                 "defaults are not known); known: ",
                                                 absl::StrJoin(known, ", ")));
}

// sliding_window as HF reads it: absent -> the class default, null -> none.
absl::StatusOr<int> WindowSize(const Fields& f, const HfFamily& family) {
  if (!f.Contains("sliding_window")) return family.default_window;
  if (f.At("sliding_window").is_null()) return 0;
  ASSIGN_OR_RETURN(const int64_t w, f.Int("sliding_window"));
  if (w < 1 || w > (int64_t{1} << 30)) return f.Error("sliding_window", "null or a window of 1 .. 2^30 tokens");
  return static_cast<int>(w);
}

// Per layer, the window (0: full attention).
absl::StatusOr<std::vector<int>> HfWindows(const Fields& f, const HfFamily& family, int layers) {
  ASSIGN_OR_RETURN(const int window, WindowSize(f, family));
  std::vector<int> windows(layers, 0);
  if (f.Has("layer_types")) {
    const Json& types = f.At("layer_types");
    if (!types.is_array() || static_cast<int>(types.size()) != layers) {
      return f.Error("layer_types", absl::StrCat("a list of num_hidden_layers = ", layers, " layer types"));
    }
    for (int i = 0; i < layers; ++i) {
      const std::string type = types[i].is_string() ? types[i].get<std::string>() : types[i].dump();
      if (type == "sliding_attention") {
        if (window == 0) return f.Error("sliding_window", "a window for the sliding_attention layers");
        windows[i] = window;
      } else if (type != "full_attention") {
        return absl::InvalidArgumentError(
            absl::StrCat(f.Where("layer_types"), "[", i, "] is '", type,
                         "'; tqkv serves 'full_attention' and 'sliding_attention' layers only"));
      }
    }
    return windows;
  }
  switch (family.windows) {
    case WindowRule::kNone:
      return windows;
    case WindowRule::kEveryLayer:
      windows.assign(layers, window);
      return windows;
    case WindowRule::kQwen: {
      ASSIGN_OR_RETURN(const bool use, f.BoolOr("use_sliding_window", false));
      ASSIGN_OR_RETURN(const int64_t from, f.IntOr("max_window_layers", 28));
      if (!use) return windows;
      for (int i = 0; i < layers; ++i) windows[i] = i >= from ? window : 0;
      return windows;
    }
    case WindowRule::kPattern: {
      int64_t pattern = family.pattern;
      for (const char* key : {"sliding_window_pattern", "_sliding_window_pattern"}) {
        if (f.Has(key)) {
          ASSIGN_OR_RETURN(pattern, f.Int(key));
        }
      }
      if (pattern < 1) return f.Error("sliding_window_pattern", "an integer >= 1");
      if (window == 0) return windows;
      for (int i = 0; i < layers; ++i) windows[i] = (i + 1) % pattern != 0 ? window : 0;
      return windows;
    }
  }
  return windows;
}

// rope_scaling (or a rope_parameters entry) -> `rope`'s scaling fields.
absl::Status ReadScaling(const Fields& s, const Fields& top, ModelRope* rope) {
  ASSIGN_OR_RETURN(std::string type, s.StringOr("rope_type", ""));
  if (type.empty()) {
    ASSIGN_OR_RETURN(type, s.StringOr("type", "default"));
  }
  if (type == "default" && s.Has("mrope_section")) type = "mrope";
  if (type == "default") return absl::OkStatus();
  if (type == "linear" || type == "llama3" || type == "yarn") {
    ASSIGN_OR_RETURN(rope->factor, s.Number("factor"));
  }
  if (type == "linear") {
    rope->scaling = ModelRope::Scaling::kLinear;
  } else if (type == "llama3") {
    rope->scaling = ModelRope::Scaling::kLlama3;
    ASSIGN_OR_RETURN(rope->low_freq_factor, s.Number("low_freq_factor"));
    ASSIGN_OR_RETURN(rope->high_freq_factor, s.Number("high_freq_factor"));
    ASSIGN_OR_RETURN(rope->original_max_position, s.Int("original_max_position_embeddings"));
  } else if (type == "yarn") {
    rope->scaling = ModelRope::Scaling::kYarn;
    if (s.Has("original_max_position_embeddings")) {
      ASSIGN_OR_RETURN(rope->original_max_position, s.Int("original_max_position_embeddings"));
    } else {
      ASSIGN_OR_RETURN(rope->original_max_position, top.Int("max_position_embeddings"));
    }
    // HF: `get("beta_fast") or 32`: 0 and null take the default too.
    ASSIGN_OR_RETURN(rope->beta_fast, s.NumberOr("beta_fast", 32.0));
    ASSIGN_OR_RETURN(rope->beta_slow, s.NumberOr("beta_slow", 1.0));
    if (rope->beta_fast == 0.0) rope->beta_fast = 32.0;
    if (rope->beta_slow == 0.0) rope->beta_slow = 1.0;
    ASSIGN_OR_RETURN(rope->truncate, s.BoolOr("truncate", true));
  } else if (type == "dynamic" || type == "longrope" || type == "su" || type == "mrope") {
    return absl::InvalidArgumentError(
        absl::StrCat(s.Where("rope_type"), " '", type, "' is not supported: ",
                     type == "dynamic" ? "dynamic NTK scaling changes the frequencies with the sequence length"
                     : type == "mrope" ? "multimodal RoPE rotates by several position ids per token"
                                       : "LongRoPE switches between two frequency sets with the sequence length",
                     ", which one CacheConfig rope cannot express; want default, linear, llama3 or yarn"));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(s.Where("rope_type"), " '", type, "' is not supported; want default, linear, llama3 or yarn"));
  }
  return absl::OkStatus();
}

// The RoPE of the sliding (or full-attention) layers.
absl::StatusOr<ModelRope> HfRope(const Fields& f, const HfFamily& family, bool sliding, int head_dim) {
  ModelRope rope;
  rope.pair_layout = v1::RotaryEmbedding::HALF_SPLIT;  // transformers' rotate_half, every family here
  ASSIGN_OR_RETURN(double partial, f.NumberOr("partial_rotary_factor", 1.0));
  if (f.Has("rope_parameters") && f.At("rope_parameters").is_object()) {
    // transformers v5: one dict, or one per layer type.
    Fields p = f.Object("rope_parameters");
    const char* type = sliding ? "sliding_attention" : "full_attention";
    const bool per_type = p.Has("sliding_attention") || p.Has("full_attention");
    if (per_type) {
      if (!p.Has(type)) return p.Error(type, "the RoPE of these layers");
      p = p.Object(type);
    }
    const bool local = per_type && sliding && family.local_rope_theta > 0.0;
    ASSIGN_OR_RETURN(const double fallback, local ? f.NumberOr("rope_local_base_freq", family.local_rope_theta)
                                                  : f.NumberOr("rope_theta", family.rope_theta));
    ASSIGN_OR_RETURN(rope.base, p.NumberOr("rope_theta", fallback));
    ASSIGN_OR_RETURN(partial, p.NumberOr("partial_rotary_factor", partial));
    RETURN_IF_ERROR(ReadScaling(p, f, &rope));
  } else if (sliding && family.local_rope_theta > 0.0) {
    ASSIGN_OR_RETURN(rope.base, f.NumberOr("rope_local_base_freq", family.local_rope_theta));
  } else {
    ASSIGN_OR_RETURN(rope.base, f.NumberOr("rope_theta", family.rope_theta));
    if (f.Has("rope_scaling")) {
      if (!f.At("rope_scaling").is_object()) return f.Error("rope_scaling", "null or an object");
      RETURN_IF_ERROR(ReadScaling(f.Object("rope_scaling"), f, &rope));
    }
  }
  if (!(partial > 0.0 && partial <= 1.0)) return f.Error("partial_rotary_factor", "a value in (0, 1]");
  rope.rotary_dims = static_cast<int>(head_dim * partial);
  if (rope.rotary_dims % 2 != 0) {
    return f.Error("partial_rotary_factor", absl::StrCat("an even number of rotary dims (head_dim ", head_dim,
                                                         " x factor gives ", rope.rotary_dims, ")"));
  }
  return rope;
}

std::string DescribeRope(const ModelRope& r) {
  const std::string s = absl::StrCat("base ", ShortestDecimal(r.base));
  switch (r.scaling) {
    case ModelRope::Scaling::kNone:
      return s + ", unscaled";
    case ModelRope::Scaling::kLinear:
      return absl::StrCat(s, ", linear scaling ", ShortestDecimal(r.factor));
    case ModelRope::Scaling::kLlama3:
      return absl::StrCat(s, ", llama3 scaling ", ShortestDecimal(r.factor));
    case ModelRope::Scaling::kYarn:
      return absl::StrCat(s, ", yarn scaling ", ShortestDecimal(r.factor));
  }
  return s;
}

// The shape fields of `f` into `cache`.
absl::Status HfShape(const Fields& f, const HfFamily& family, v1::CacheConfig* cache) {
  ASSIGN_OR_RETURN(const int64_t layers, f.Int("num_hidden_layers"));
  ASSIGN_OR_RETURN(const int64_t heads, f.Int("num_attention_heads"));
  int64_t kv_heads = heads;
  if (f.Has("num_key_value_heads") || !family.mha_by_default) {
    ASSIGN_OR_RETURN(kv_heads, f.Int("num_key_value_heads"));
  }
  int64_t head_dim = 0;
  if (f.Has("head_dim")) {
    ASSIGN_OR_RETURN(head_dim, f.Int("head_dim"));
  } else {
    ASSIGN_OR_RETURN(const int64_t hidden, f.Int("hidden_size"));
    if (heads < 1 || hidden % heads != 0) {
      return f.Error("hidden_size",
                     absl::StrCat("a multiple of num_attention_heads = ", heads, " (there is no head_dim)"));
    }
    head_dim = hidden / heads;
  }
  return WriteShape({layers, f.Name("num_hidden_layers")}, {heads, f.Name("num_attention_heads")},
                    {kv_heads, f.Name("num_key_value_heads")}, {head_dim, f.Name("head_dim")}, f.file(), cache);
}

// The cache's RoPE; when the model has two, the other layers' in
// layer_ropes, with a note.
absl::Status HfCacheRope(const Fields& f, const HfFamily& family, const std::vector<int>& windows,
                         const ModelConfigOptions& options, DerivedConfig* out) {
  const int layers = static_cast<int>(windows.size());
  const int sliding = static_cast<int>(std::count_if(windows.begin(), windows.end(), [](int w) { return w > 0; }));
  const int head_dim = out->cache.head_dim();
  ASSIGN_OR_RETURN(const ModelRope full_rope, HfRope(f, family, false, head_dim));
  ModelRope rope = full_rope;
  if (sliding > 0) {
    ASSIGN_OR_RETURN(const ModelRope sliding_rope, HfRope(f, family, true, head_dim));
    if (sliding == layers) {
      rope = sliding_rope;
    } else if (!(sliding_rope == full_rope)) {
      const bool take_sliding = options.rope_of == RopeOf::kSliding;
      rope = take_sliding ? sliding_rope : full_rope;
      out->rope_notes.push_back(absl::StrFormat(
          "Per-layer RoPE: the %d sliding-window layers rotate with %s, the %d full-attention layers with %s: "
          "`rope` is the %s layers', `layer_ropes` gives the %s layers theirs (--rope-of %s swaps them), so "
          "pre-RoPE centering uses every layer's own.",
          sliding, DescribeRope(sliding_rope), layers - sliding, DescribeRope(full_rope),
          take_sliding ? "sliding-window" : "full-attention", take_sliding ? "full-attention" : "sliding-window",
          take_sliding ? "full" : "sliding"));
      RETURN_IF_ERROR(WriteLayerRopes(take_sliding ? full_rope : sliding_rope, windows, !take_sliding, f.Where("rope"),
                                      &out->cache, &out->rope_notes));
    }
  }
  out->rope_notes.push_back(
      "Pair layout HALF_SPLIT: Hugging Face weights rotate pairs (i, i + rotary_dims/2) (rotate_half); keys from "
      "a GGUF conversion of a llama-type model arrive INTERLEAVED instead (tqkv config --from-gguf).");
  return WriteRope(rope, f.Where("rope"), out->cache.mutable_rope(), &out->rope_notes);
}

// What a CacheConfig cannot hold, as comments.
absl::Status HfNotes(const Fields& f, const HfFamily& family, DerivedConfig* out) {
  if (family.learned_sinks) {
    out->notes.push_back(
        "Learned attention sinks: each layer has one sink logit per query head (the weights' self_attn.sinks). "
        "A CacheConfig holds none: send them with every Attend / AppendAttend (DecodeStream) as sink_logits, "
        "[query_heads] f32. (exact_sink_tokens is another thing: the first tokens kept at fp16.)");
  }
  double softcap = family.softcap;
  if (f.Contains("attn_logit_softcapping")) {
    ASSIGN_OR_RETURN(softcap, f.NumberOr("attn_logit_softcapping", 0.0));
  }
  if (softcap > 0.0) {
    out->notes.push_back(absl::StrFormat(
        "Logit soft-capping: attn_logit_softcapping %g. A CacheConfig holds none: pass logit_softcap = %g with "
        "every Attend / AppendAttend (DecodeStream) step, and with ScoreQuery for capped logits.",
        softcap, softcap));
  }
  if (f.Has("query_pre_attn_scalar")) {
    ASSIGN_OR_RETURN(const double scalar, f.Number("query_pre_attn_scalar"));
    if (scalar != out->cache.head_dim()) {
      out->notes.push_back(absl::StrFormat(
          "Attention scale: query_pre_attn_scalar %g, so pass scale = 1/sqrt(%g) = %.9g on Attend (0 means "
          "1/sqrt(head_dim %d)).",
          scalar, scalar, 1.0 / std::sqrt(scalar), out->cache.head_dim()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DerivedConfig> CacheConfigFromHfJson(const Json& config, const std::string& where,
                                                    const ModelConfigOptions& options) {
  if (!config.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": want a JSON object"));
  const bool wrapped = config.contains("text_config") && config.at("text_config").is_object();
  const Fields top(config, where, "");
  const Fields f = wrapped ? top.Object("text_config") : top;
  ASSIGN_OR_RETURN(const std::string outer_type, top.StringOr("model_type", ""));
  ASSIGN_OR_RETURN(std::string model_type, f.StringOr("model_type", wrapped ? outer_type + "_text" : outer_type));
  if (model_type.empty()) return f.Error("model_type", "the model's type, e.g. \"llama\"");
  ASSIGN_OR_RETURN(const HfFamily* family, FindFamily(model_type, where));

  DerivedConfig out;
  out.source = absl::StrCat("the Hugging Face config ", where, " (model_type \"", model_type, "\"",
                            wrapped ? absl::StrCat(", the text_config of \"", outer_type, "\"") : "", ")");
  RETURN_IF_ERROR(HfShape(f, *family, &out.cache));
  ASSIGN_OR_RETURN(const std::vector<int> windows, HfWindows(f, *family, out.cache.num_layers()));
  WriteWindows(windows, &out.cache);
  if (out.cache.sliding_window_layers_size() > 0) {
    out.window_notes.push_back(
        absl::StrCat("Sliding-window layers (", f.Has("layer_types") ? "layer_types" : "the family's layer pattern",
                     "): a query at position p sees tokens [p+1-window, p+1), as transformers masks them."));
  }
  RETURN_IF_ERROR(HfCacheRope(f, *family, windows, options, &out));
  RETURN_IF_ERROR(HfNotes(f, *family, &out));
  RETURN_IF_ERROR(FinishCache(options, where, &out.cache));
  return out;
}

absl::StatusOr<DerivedConfig> CacheConfigFromHfPath(const std::string& path, const ModelConfigOptions& options) {
  std::error_code error;
  const std::string file = std::filesystem::is_directory(path, error) ? path + "/config.json" : path;
  std::ifstream in(file);
  std::stringstream text;
  if (!in || !(text << in.rdbuf())) {
    return absl::NotFoundError(
        absl::StrCat("cannot read '", path, "' (want a config.json or a directory holding one)"));
  }
  Json config;
  try {
    config = Json::parse(text.str());
  } catch (const Json::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(file, " is not JSON: ", e.what()));
  }
  return CacheConfigFromHfJson(config, file, options);
}

}  // namespace cli
}  // namespace tqkv
