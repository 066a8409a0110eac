// Presets: named (key codec, value codec) pairs.
//
// Names are a contract. The four vLLM names mean what they mean in vLLM's
// --kv-cache-dtype, and at head_dim 128 take no more bytes per (token, head)
// than vLLM's 196 / 134 / 118 / 102; `fp16` and `fp8` are the uncompressed and
// 8-bit baselines. The `tqkv_` presets are ours: TurboQuant-MSE values
// (accumulated in the rotated basis) instead of uniform ones, and fractional
// key bits by the outlier split. `eval_` presets exist for measurement only.
#ifndef TQKV_KERNELS_PRESET_H_
#define TQKV_KERNELS_PRESET_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codec.h"
#include "kernels/key_centering.h"

namespace tqkv {

// What a preset asks of the layout besides its codecs: key centering and
// exact tokens (kv_layout.h). Config fields that are set override it.
struct PresetRecipe {
  KeyCentering key_centering = KeyCentering::kNone;
  int exact_sink_tokens = 0;
  int exact_recent_tokens = 0;
  // Each sequence measures its own key scales (KvLayoutOptions).
  bool sequence_key_scales = false;

  bool empty() const {
    return key_centering == KeyCentering::kNone && exact_sink_tokens == 0 && exact_recent_tokens == 0 &&
           !sequence_key_scales;
  }
  // "pre-RoPE centering, 4 sink + 64 recent tokens exact", or "" when empty.
  std::string Describe() const;
};

struct Preset {
  std::string_view name;
  CodecSpec key;
  CodecSpec value;
  std::string_view description;
  // True for presets kept to measure an idea (QJL), not to serve.
  bool evaluation_only = false;
  PresetRecipe recipe = {};

  // Bytes one (token, KV head) takes for keys plus values at a head dim.
  int BytesPerTokenHead(int head_dim) const {
    return CodecBytesPerVector(key, head_dim) + CodecBytesPerVector(value, head_dim);
  }
  // Compression versus a bf16 cache (2 bytes per coordinate, keys and values).
  double CompressionVsBf16(int head_dim) const { return 4.0 * head_dim / BytesPerTokenHead(head_dim); }
  bool NeedsCalibration() const { return key.NeedsCalibration() || value.NeedsCalibration(); }
};

// Every preset, in a stable order: baselines, vLLM names, ours, evaluation.
absl::Span<const Preset> AllPresets();

// Fails with NOT_FOUND, listing the known names, for an unknown name.
absl::StatusOr<const Preset*> FindPreset(std::string_view name);

// "all" -> every preset that is not evaluation-only plus the evaluation ones
// (AllPresets()); a comma-separated list -> those presets, in order.
absl::StatusOr<std::vector<const Preset*>> ParsePresetList(std::string_view names);

// The names, comma-separated, for messages and --help.
std::string PresetNames();

}  // namespace tqkv

#endif  // TQKV_KERNELS_PRESET_H_
