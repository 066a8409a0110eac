// A tqkv cache's CacheConfig derived from the model's own description: a
// Hugging Face config.json or a GGUF file's metadata. `tqkv config` prints it
// as the text-format tqkv.v1.ServerConfig that tqkv-server --config reads
// (service/config.h); docs/cache.md, "A cache config from the model", says
// what each field comes from.
//
// What is derived:
//   shape        num_layers, num_kv_heads, num_query_heads, head_dim (one head
//                dim for keys and values; a model whose differ is refused)
//   rope         rotary_dims, pair_layout, base and scaling. The pair layout
//                follows where the keys come from: Hugging Face weights rotate
//                pairs (i, i + rotary_dims/2) ("rotate_half") for every family
//                derived here: HALF_SPLIT. GGUF files carry the layout of
//                llama.cpp's rope type per architecture: "llama"-like
//                architectures (Llama, Mistral, SmolLM2, Granite ...) are
//                converted with Q/K rows permuted so that llama.cpp rotates
//                adjacent pairs (2i, 2i+1): INTERLEAVED; Qwen, Gemma, Phi-3,
//                gpt-oss ... keep HALF_SPLIT. Scaling "linear" and "llama3"
//                map to the proto's fields; YaRN's frequencies are written
//                out as explicit inv_freq (its attention factor scales q and
//                k, not their directions, so centering does not need it); a
//                GGUF rope_freqs tensor (Llama-3.1 converted) likewise.
//                Dynamic NTK, LongRoPE and multimodal RoPE change with the
//                sequence length or the modality: INVALID_ARGUMENT.
//   windows      sliding_window_layers from layer_types, or the family's
//                pattern (Gemma 2: even layers; Gemma 3: five of every six;
//                gpt-oss: even layers; Mistral and Phi-3: every layer when
//                sliding_window is set; Qwen: layers >= max_window_layers
//                when use_sliding_window).
//   per-layer    Gemma 3 rotates its sliding layers with rope_local_base_freq
//   RoPE         (10000, unscaled) and its full layers with rope_theta and
//                rope_scaling: `rope` is the sliding layers' (the majority;
//                --rope-of full picks the other) and `layer_ropes` gives the
//                other layers theirs, so pre-RoPE centering uses every
//                layer's own RoPE; the output says so.
//   notes        what a CacheConfig cannot hold is printed as comments: learned
//                attention sinks (gpt-oss: per-request sink_logits), logit
//                soft-capping (Gemma 2: per-request logit_softcap), the
//                attention scale (Attend's `scale`).
//
// Every error is INVALID_ARGUMENT (NOT_FOUND for a file that cannot be read)
// with a message that names the field, e.g. "config.json: rope_scaling.rope_type
// 'dynamic' is not supported: ...". Thread-safe: no state.
#ifndef TQKV_CLIENT_CLI_MODEL_CONFIG_H_
#define TQKV_CLIENT_CLI_MODEL_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/cli/gguf_reader.h"
#include "nlohmann/json.hpp"
#include "tqkv/v1/kvcache.pb.h"

namespace tqkv {
namespace cli {

// The preset of the server's embedded default cache (service/config.cc; a
// test keeps them equal).
inline constexpr char kDefaultModelPreset[] = "tqkv_k3v4u_csw";

// Which layers' RoPE is the cache's `rope` when the model rotates its
// sliding-window and full-attention layers differently (Gemma 3); the other
// layers get theirs in `layer_ropes`. Either way every layer is centered with
// its own RoPE: the choice only changes which layers are listed.
enum class RopeOf { kSliding, kFull };

struct ModelConfigOptions {
  std::string cache_name = "default";
  // Must name a preset (kernels/preset.h); the shape is not checked against
  // it here (the server's parser does: see the round-trip test).
  std::string preset = kDefaultModelPreset;
  int page_tokens = 16;
  RopeOf rope_of = RopeOf::kSliding;
};

// A derived cache and what the output says about it.
struct DerivedConfig {
  v1::CacheConfig cache;
  // One line: the file and the model type or architecture it read.
  std::string source;
  // Printed as comments: above the cache, above `rope`, above the windows.
  std::vector<std::string> notes;
  std::vector<std::string> rope_notes;
  std::vector<std::string> window_notes;
};

// From a parsed config.json (the multimodal wrappers' text_config is used
// when present). `where` prefixes messages ("config.json").
absl::StatusOr<DerivedConfig> CacheConfigFromHfJson(const nlohmann::json& config, const std::string& where,
                                                    const ModelConfigOptions& options);
// `path` is a config.json or a directory holding one. NOT_FOUND when neither
// is readable; INVALID_ARGUMENT for a file that is not JSON.
absl::StatusOr<DerivedConfig> CacheConfigFromHfPath(const std::string& path, const ModelConfigOptions& options);

// From a GGUF file's metadata (and its rope_freqs tensor, when present).
absl::StatusOr<DerivedConfig> CacheConfigFromGguf(const GgufFile& file, const ModelConfigOptions& options);
absl::StatusOr<DerivedConfig> CacheConfigFromGgufPath(const std::string& path, const ModelConfigOptions& options);

// The text-format tqkv.v1.ServerConfig with `derived` as its one cache, the
// notes as comments, every field the derivation set written out (defaults
// too, e.g. `boundary_layers: 0`), numbers exactly (shortest round-trip
// decimal). service::ParseServerConfig reads back derived.cache.
std::string FormatServerConfig(const DerivedConfig& derived);

// ---------------------------------------------------------------------------
// The pieces the two derivations share (exposed for tests).

// A model's RoPE as its format describes it, before it becomes a
// RotaryEmbedding.
struct ModelRope {
  enum class Scaling { kNone, kLinear, kLlama3, kYarn };
  int rotary_dims = 0;
  v1::RotaryEmbedding::PairLayout pair_layout = v1::RotaryEmbedding::HALF_SPLIT;
  double base = 10000.0;
  Scaling scaling = Scaling::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;       // kLlama3
  double high_freq_factor = 4.0;      // kLlama3
  int64_t original_max_position = 0;  // kLlama3, kYarn
  double beta_fast = 32.0;            // kYarn
  double beta_slow = 1.0;             // kYarn
  bool truncate = true;               // kYarn: round the ramp's ends (HF's default; llama.cpp always)
  // Explicit per-pair frequencies (rotary_dims / 2), over base and scaling.
  std::vector<double> inv_freq;

  bool operator==(const ModelRope& o) const;
};

// `x` as the shortest decimal that reads back as the same double: integers
// plainly ("500000"), others in %g style ("0.125", "1e-05").
std::string ShortestDecimal(double x);

// YaRN's per-pair frequencies as Hugging Face's _compute_yarn_parameters and
// llama.cpp's ggml_rope_yarn_corr_dims compute them (in double).
// REQUIRES: rope.scaling == kYarn, rotary_dims even and > 0.
std::vector<double> YarnInvFreq(const ModelRope& rope);

// rope -> `out`, with a note per approximation. INVALID_ARGUMENT (prefixed by
// `where`) for a non-finite or non-positive base or factor, or odd rotary dims.
absl::Status WriteRope(const ModelRope& rope, const std::string& where, v1::RotaryEmbedding* out,
                       std::vector<std::string>* notes);

// `rope` as the RoPE of the sliding-window layers (windows[l] > 0) when
// `sliding`, else of the full-attention ones: one layer_ropes entry.
// WriteRope's errors.
absl::Status WriteLayerRopes(const ModelRope& rope, const std::vector<int>& windows, bool sliding,
                             const std::string& where, v1::CacheConfig* cache, std::vector<std::string>* notes);

// Per-layer windows (0: full attention) -> sliding_window_layers, one group
// per window size in order of first layer.
void WriteWindows(const std::vector<int>& windows, v1::CacheConfig* cache);

// One shape field as the model names it, for WriteShape's messages.
struct ShapeField {
  int64_t value;
  std::string name;  // e.g. "num_key_value_heads" or "llama.attention.head_count_kv"
};

// Layers, query heads, KV heads and head dim into `cache`. INVALID_ARGUMENT
// ("<where>: <name> is 0; want 1 .. 2^20") for a value out of range.
absl::Status WriteShape(const ShapeField& layers, const ShapeField& query_heads, const ShapeField& kv_heads,
                        const ShapeField& head_dim, const std::string& where, v1::CacheConfig* cache);

// Shape checks (>= 1, query heads a multiple of KV heads) and the fields the
// derivation does not read from the model: name, preset (NOT_FOUND: unknown),
// page_tokens, boundary_layers 0. `where` prefixes messages.
absl::Status FinishCache(const ModelConfigOptions& options, const std::string& where, v1::CacheConfig* cache);

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_MODEL_CONFIG_H_
