// A CacheConfig from a GGUF file's metadata (model_config.h).
//
// The keys are llama.cpp's ("<arch>.block_count", "<arch>.rope.freq_base",
// ...), read with llama.cpp's defaults where a key is optional. What the file
// does not say, llama.cpp hard-codes per architecture, and so does the table
// below: the RoPE pair layout (llama_model_rope_type: NORM is INTERLEAVED,
// NEOX is HALF_SPLIT), the sliding-window layer pattern, Gemma 3's local base.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "client/cli/model_config.h"
#include "base/status_macros.h"

namespace tqkv {
namespace cli {
namespace {

constexpr auto kInterleaved = v1::RotaryEmbedding::INTERLEAVED;
constexpr auto kHalfSplit = v1::RotaryEmbedding::HALF_SPLIT;

struct GgufArch {
  absl::string_view name;  // general.architecture
  v1::RotaryEmbedding::PairLayout pair_layout;
  // llama.cpp's set_swa_pattern(n): layer i slides when i % n < n - 1 (0:
  // every layer slides). -1: llama.cpp gives this architecture no pattern.
  int swa_pattern = -1;
  double local_base = 0.0;  // sliding layers' RoPE base when no rope.freq_base_swa (Gemma 3)
  bool learned_sinks = false;
};

// Architectures whose keys are per-head standard attention with one RoPE
// (llama.cpp's NORM and NEOX rope types). Not here: DeepSeek-V2/V3 (latent
// attention), Cohere2 and SmolLM3 (layers without RoPE), multimodal RoPE.
constexpr GgufArch kArchs[] = {
    {"llama", kInterleaved},
    {"deci", kInterleaved},
    {"baichuan", kInterleaved},
    {"internlm2", kInterleaved},
    {"minicpm", kInterleaved},
    {"xverse", kInterleaved},
    {"command-r", kInterleaved},
    {"olmo", kInterleaved},
    {"arctic", kInterleaved},
    {"deepseek", kInterleaved},
    {"granite", kInterleaved},
    {"granitemoe", kInterleaved},
    {"chameleon", kInterleaved},
    {"bailingmoe", kInterleaved},
    {"arcee", kInterleaved},
    {"ernie4_5", kInterleaved},
    {"mistral3", kInterleaved},
    {"falcon", kHalfSplit},
    {"dbrx", kHalfSplit},
    {"stablelm", kHalfSplit},
    {"qwen2", kHalfSplit},
    {"qwen2moe", kHalfSplit},
    {"qwen3", kHalfSplit},
    {"qwen3moe", kHalfSplit},
    {"olmo2", kHalfSplit},
    {"olmoe", kHalfSplit},
    {"phi2", kHalfSplit},
    {"phi3", kHalfSplit},
    {"phimoe", kHalfSplit},
    {"gemma", kHalfSplit},
    {"gemma2", kHalfSplit, 2},
    {"gemma3", kHalfSplit, 6, 10000.0},
    {"starcoder2", kHalfSplit},
    {"gptneox", kHalfSplit},
    {"codeshell", kHalfSplit},
    {"orion", kHalfSplit},
    {"nemotron", kHalfSplit},
    {"exaone", kHalfSplit},
    {"gpt-oss", kHalfSplit, 2, 0.0, true},
    {"seed_oss", kHalfSplit},
};

absl::StatusOr<const GgufArch*> FindArch(const std::string& name, const std::string& where) {
  std::vector<absl::string_view> known;
  for (const GgufArch& a : kArchs) {
    if (a.name == name) return &a;
    known.push_back(a.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": general.architecture '", name,
                   "' is not one tqkv config derives (its RoPE pair layout and layer pattern are not known); known: ",
                   absl::StrJoin(known, ", ")));
}

// Metadata reads of one architecture's keys ("<arch>.<key>"), with messages
// prefixed by the file.
class ArchKeys {
 public:
  ArchKeys(const GgufFile& file, absl::string_view arch) : file_(file), arch_(arch) {}
  std::string Key(absl::string_view key) const { return absl::StrCat(arch_, ".", key); }
  bool Has(absl::string_view key) const { return file_.Find(Key(key)) != nullptr; }
  const GgufValue* Find(absl::string_view key) const { return file_.Find(Key(key)); }
  const std::string& path() const { return file_.path; }
  absl::Status Prefixed(const absl::Status& s) const {
    return absl::Status(s.code(), absl::StrCat(file_.path, ": ", s.message()));
  }
  absl::Status Error(absl::string_view key, absl::string_view message) const {
    return absl::InvalidArgumentError(absl::StrCat(file_.path, ": GGUF '", Key(key), "' ", message));
  }
  absl::StatusOr<int64_t> Int(absl::string_view key) const {
    absl::StatusOr<int64_t> v = file_.Int(Key(key));
    if (!v.ok()) return Prefixed(v.status());
    return v;
  }
  absl::StatusOr<int64_t> IntOr(absl::string_view key, int64_t fallback) const {
    if (!Has(key)) return fallback;
    return Int(key);
  }
  absl::StatusOr<double> NumberOr(absl::string_view key, double fallback) const {
    if (!Has(key)) return fallback;
    absl::StatusOr<double> v = file_.Number(Key(key));
    if (!v.ok()) return Prefixed(v.status());
    return v;
  }
  absl::StatusOr<std::string> StringOr(absl::string_view key, std::string fallback) const {
    if (!Has(key)) return fallback;
    absl::StatusOr<std::string> v = file_.String(Key(key));
    if (!v.ok()) return Prefixed(v.status());
    return v;
  }
  // A per-model count stored as one integer, or per layer as an array whose
  // entries must all be equal (one layout per cache).
  absl::StatusOr<int64_t> Uniform(absl::string_view key) const {
    const GgufValue* v = Find(key);
    if (v == nullptr || v->type != GgufType::kArray) return Int(key);
    if (v->numbers.empty()) return Error(key, "is an empty or non-numeric array; want a count");
    if (std::any_of(v->numbers.begin(), v->numbers.end(), [&](double x) { return x != v->numbers[0]; })) {
      return Error(key, "differs between layers; a tqkv cache has one shape for every layer");
    }
    return static_cast<int64_t>(v->numbers[0]);
  }

 private:
  const GgufFile& file_;
  std::string arch_;
};

absl::Status GgufShape(const ArchKeys& k, v1::CacheConfig* cache) {
  ASSIGN_OR_RETURN(const int64_t layers, k.Int("block_count"));
  ASSIGN_OR_RETURN(const int64_t heads, k.Uniform("attention.head_count"));
  int64_t kv_heads = heads;  // llama.cpp: no head_count_kv means one per query head
  if (k.Has("attention.head_count_kv")) {
    ASSIGN_OR_RETURN(kv_heads, k.Uniform("attention.head_count_kv"));
  }
  int64_t head_dim = 0;
  if (k.Has("attention.key_length")) {
    ASSIGN_OR_RETURN(head_dim, k.Int("attention.key_length"));
  } else {
    ASSIGN_OR_RETURN(const int64_t embedding, k.Int("embedding_length"));
    if (heads < 1 || embedding % heads != 0) {
      return k.Error("embedding_length", absl::StrCat("is ", embedding, "; want a multiple of head_count ", heads,
                                                      " (there is no attention.key_length)"));
    }
    head_dim = embedding / heads;
  }
  ASSIGN_OR_RETURN(const int64_t value_dim, k.IntOr("attention.value_length", head_dim));
  if (value_dim != head_dim) {
    return k.Error("attention.value_length", absl::StrCat("is ", value_dim, " and key_length ", head_dim,
                                                          "; a tqkv cache has one head dim for keys and values"));
  }
  return WriteShape({layers, k.Key("block_count")}, {heads, k.Key("attention.head_count")},
                    {kv_heads, k.Key("attention.head_count_kv")}, {head_dim, k.Key("attention.key_length")}, k.path(),
                    cache);
}

// Per layer, the window (0: full attention).
absl::StatusOr<std::vector<int>> GgufWindows(const ArchKeys& k, const GgufArch& arch, int layers) {
  std::vector<int> windows(layers, 0);
  ASSIGN_OR_RETURN(const int64_t window, k.IntOr("attention.sliding_window", 0));
  if (window == 0) return windows;
  if (window < 0 || window > (int64_t{1} << 30)) {
    return k.Error("attention.sliding_window", absl::StrCat("is ", window, "; want 1 .. 2^30"));
  }
  const GgufValue* pattern_value = k.Find("attention.sliding_window_pattern");
  if (pattern_value != nullptr && pattern_value->type == GgufType::kArray) {
    // One flag per layer, true where the layer slides.
    if (static_cast<int>(pattern_value->numbers.size()) != layers) {
      return k.Error("attention.sliding_window_pattern",
                     absl::StrCat("has ", pattern_value->numbers.size(), " entries; want one per layer, ", layers));
    }
    for (int i = 0; i < layers; ++i) windows[i] = pattern_value->numbers[i] != 0.0 ? static_cast<int>(window) : 0;
    return windows;
  }
  ASSIGN_OR_RETURN(const int64_t pattern, k.IntOr("attention.sliding_window_pattern", arch.swa_pattern));
  if (pattern < 0) {
    return k.Error("attention.sliding_window",
                   absl::StrCat("is ", window, " but tqkv config knows no sliding-window layer pattern for '",
                                arch.name, "' (and the file has no attention.sliding_window_pattern)"));
  }
  for (int i = 0; i < layers; ++i) {
    windows[i] = pattern == 0 || i % pattern < pattern - 1 ? static_cast<int>(window) : 0;
  }
  return windows;
}

// The full-attention layers' RoPE (the only one, but for Gemma 3).
absl::StatusOr<ModelRope> GgufRope(const ArchKeys& k, const GgufFile& file, const GgufArch& arch, int head_dim) {
  ModelRope rope;
  rope.pair_layout = arch.pair_layout;
  ASSIGN_OR_RETURN(const int64_t dims, k.IntOr("rope.dimension_count", head_dim));
  rope.rotary_dims = static_cast<int>(dims);
  ASSIGN_OR_RETURN(rope.base, k.NumberOr("rope.freq_base", 10000.0));
  ASSIGN_OR_RETURN(const double legacy_linear, k.NumberOr("rope.scale_linear", 0.0));
  ASSIGN_OR_RETURN(const std::string type, k.StringOr("rope.scaling.type", legacy_linear > 0 ? "linear" : "none"));
  if (type == "linear") {
    rope.scaling = ModelRope::Scaling::kLinear;
    ASSIGN_OR_RETURN(rope.factor, k.NumberOr("rope.scaling.factor", legacy_linear > 0 ? legacy_linear : 0.0));
  } else if (type == "yarn") {
    rope.scaling = ModelRope::Scaling::kYarn;
    rope.truncate = true;  // ggml_rope_yarn_corr_dims rounds the ramp's ends
    ASSIGN_OR_RETURN(rope.factor, k.NumberOr("rope.scaling.factor", 0.0));
    ASSIGN_OR_RETURN(rope.original_max_position, k.Int("rope.scaling.original_context_length"));
    ASSIGN_OR_RETURN(rope.beta_fast, k.NumberOr("rope.scaling.yarn_beta_fast", 32.0));
    ASSIGN_OR_RETURN(rope.beta_slow, k.NumberOr("rope.scaling.yarn_beta_slow", 1.0));
  } else if (type != "none") {
    return k.Error("rope.scaling.type", absl::StrCat("is '", type, "'; want none, linear or yarn (", type,
                                                     " changes the frequencies with the sequence length)"));
  }
  if (file.tensors.count("rope_freqs.weight") == 0) return rope;
  // Per-pair frequency divisors (Llama-3.1's llama3 scaling, converted):
  // llama.cpp rotates pair i by base^(-2i/d) / rope_freqs[i].
  if (rope.scaling == ModelRope::Scaling::kYarn) {
    return k.Error("rope.scaling.type", "is yarn and the file has a rope_freqs tensor; tqkv does not combine them");
  }
  ASSIGN_OR_RETURN(const std::vector<float> divisors, ReadGgufF32Tensor(file, "rope_freqs.weight"));
  if (static_cast<int>(divisors.size()) != rope.rotary_dims / 2) {
    return absl::InvalidArgumentError(absl::StrCat(file.path, ": tensor rope_freqs.weight has ", divisors.size(),
                                                   " values; want rope.dimension_count / 2 = ", rope.rotary_dims / 2));
  }
  const double linear = rope.scaling == ModelRope::Scaling::kLinear ? rope.factor : 1.0;
  for (int i = 0; i < rope.rotary_dims / 2; ++i) {
    rope.inv_freq.push_back(std::pow(rope.base, -2.0 * i / rope.rotary_dims) / divisors[i] / linear);
  }
  return rope;
}

// The cache's RoPE, with the notes that say where it came from; when the
// sliding layers rotate with another base, theirs (or the full layers') in
// layer_ropes.
absl::Status GgufCacheRope(const ArchKeys& k, const GgufFile& file, const GgufArch& arch,
                           const std::vector<int>& windows, const ModelConfigOptions& options, DerivedConfig* out) {
  ASSIGN_OR_RETURN(ModelRope rope, GgufRope(k, file, arch, out->cache.head_dim()));
  const int layers = static_cast<int>(windows.size());
  const int sliding = static_cast<int>(std::count_if(windows.begin(), windows.end(), [](int w) { return w > 0; }));
  if (!rope.inv_freq.empty()) {
    out->rope_notes.push_back(
        "The file's rope_freqs tensor divides each pair's frequency (Llama-3.1's llama3 scaling as converted): "
        "written out as inv_freq.");
  }
  if (arch.local_base > 0.0 && sliding > 0) {
    ASSIGN_OR_RETURN(const double local_base, k.NumberOr("rope.freq_base_swa", arch.local_base));
    ModelRope local = rope;
    local.base = local_base;
    local.scaling = ModelRope::Scaling::kNone;
    local.inv_freq.clear();
    const bool take_sliding = options.rope_of == RopeOf::kSliding || sliding == layers;
    if (sliding < layers && !(local == rope)) {
      out->rope_notes.push_back(absl::StrFormat(
          "Per-layer RoPE: the %d sliding-window layers rotate with base %s, unscaled, the %d full-attention "
          "layers with base %s%s: `rope` is the %s layers', `layer_ropes` gives the %s layers theirs (--rope-of "
          "%s swaps them), so pre-RoPE centering uses every layer's own.",
          sliding, ShortestDecimal(local_base), layers - sliding, ShortestDecimal(rope.base),
          rope.scaling == ModelRope::Scaling::kLinear ? ", linear scaling " + ShortestDecimal(rope.factor) : "",
          take_sliding ? "sliding-window" : "full-attention", take_sliding ? "full-attention" : "sliding-window",
          take_sliding ? "full" : "sliding"));
      RETURN_IF_ERROR(WriteLayerRopes(take_sliding ? rope : local, windows, !take_sliding, file.path, &out->cache,
                                      &out->rope_notes));
    }
    if (take_sliding) rope = local;
  }
  out->rope_notes.push_back(
      arch.pair_layout == kInterleaved
          ? absl::StrCat("Pair layout INTERLEAVED: llama.cpp rotates adjacent pairs (2i, 2i+1) for '", arch.name,
                         "' (NORM), and the GGUF converter permuted the Q/K weights to match; keys computed from "
                         "the Hugging Face weights of the same model arrive HALF_SPLIT instead.")
          : absl::StrCat("Pair layout HALF_SPLIT: llama.cpp rotates pairs (i, i + rotary_dims/2) for '", arch.name,
                         "' (NEOX), as the Hugging Face weights do."));
  return WriteRope(rope, file.path, out->cache.mutable_rope(), &out->rope_notes);
}

absl::Status GgufNotes(const ArchKeys& k, const GgufArch& arch, DerivedConfig* out) {
  if (arch.learned_sinks) {
    out->notes.push_back(
        "Learned attention sinks: each layer has one sink logit per query head (tensor blk.N.attn_sinks). A "
        "CacheConfig holds none: send them with every Attend / AppendAttend (DecodeStream) as sink_logits, "
        "[query_heads] f32. (exact_sink_tokens is another thing: the first tokens kept at fp16.)");
  }
  ASSIGN_OR_RETURN(const double softcap, k.NumberOr("attn_logit_softcapping", 0.0));
  if (softcap > 0.0) {
    out->notes.push_back(absl::StrFormat(
        "Logit soft-capping: attn_logit_softcapping %g. A CacheConfig holds none: pass logit_softcap = %g with "
        "every Attend / AppendAttend (DecodeStream) step, and with ScoreQuery for capped logits.",
        softcap, softcap));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DerivedConfig> CacheConfigFromGguf(const GgufFile& file, const ModelConfigOptions& options) {
  absl::StatusOr<std::string> arch_name = file.String("general.architecture");
  if (!arch_name.ok()) return absl::InvalidArgumentError(absl::StrCat(file.path, ": ", arch_name.status().message()));
  ASSIGN_OR_RETURN(const GgufArch* arch, FindArch(*arch_name, file.path));
  const ArchKeys k(file, *arch_name);
  DerivedConfig out;
  const GgufValue* name = file.Find("general.name");
  out.source = absl::StrCat(
      "the GGUF file ", file.path, " (architecture \"", *arch_name, "\"",
      name != nullptr && name->type == GgufType::kString ? absl::StrCat(", \"", name->text, "\"") : "", ")");
  RETURN_IF_ERROR(GgufShape(k, &out.cache));
  ASSIGN_OR_RETURN(const std::vector<int> windows, GgufWindows(k, *arch, out.cache.num_layers()));
  WriteWindows(windows, &out.cache);
  if (out.cache.sliding_window_layers_size() > 0) {
    out.window_notes.push_back(
        absl::StrCat("Sliding-window layers: ", k.Key("attention.sliding_window"),
                     " and llama.cpp's layer pattern for this architecture; a query at position p sees tokens "
                     "[p+1-window, p+1)."));
  }
  RETURN_IF_ERROR(GgufCacheRope(k, file, *arch, windows, options, &out));
  RETURN_IF_ERROR(GgufNotes(k, *arch, &out));
  RETURN_IF_ERROR(FinishCache(options, file.path, &out.cache));
  return out;
}

absl::StatusOr<DerivedConfig> CacheConfigFromGgufPath(const std::string& path, const ModelConfigOptions& options) {
  ASSIGN_OR_RETURN(const GgufFile file, ReadGgufFile(path));
  return CacheConfigFromGguf(file, options);
}

}  // namespace cli
}  // namespace tqkv
