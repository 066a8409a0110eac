#include "kernels/preset.h"

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_cat.h"

namespace tqkv {
namespace {

constexpr PresetRecipe kCenteredSinksRecent{KeyCentering::kPreRope, 4, 64, /*sequence_key_scales=*/true};

const std::vector<Preset>& PresetTable() {
  static const std::vector<Preset> table = {
      {"fp16", CodecSpec::Fp16(), CodecSpec::Fp16(), "uncompressed fp16 keys and values"},
      {"bf16", CodecSpec::Bf16(), CodecSpec::Bf16(), "uncompressed bf16 keys and values: the speed baseline"},
      {"fp8", CodecSpec::Fp8(), CodecSpec::Fp8(), "fp8 e4m3 keys and values, no scale"},
      {"turboquant_k8v4", CodecSpec::Fp8(), CodecSpec::Uniform(4), "vLLM preset: fp8 keys, 4-bit uniform values"},
      {"turboquant_4bit_nc", CodecSpec::TurboQuant(4, true), CodecSpec::Uniform(4),
       "vLLM preset: 4-bit TurboQuant keys with norm correction, 4-bit uniform values"},
      {"turboquant_k3v4_nc", CodecSpec::TurboQuant(3, true), CodecSpec::Uniform(4),
       "vLLM preset: 3-bit TurboQuant keys with norm correction, 4-bit uniform values"},
      {"turboquant_3bit_nc", CodecSpec::TurboQuant(3, true), CodecSpec::Uniform(3),
       "vLLM preset: 3-bit TurboQuant keys with norm correction, 3-bit uniform values"},
      {"tqkv_k4v4", CodecSpec::TurboQuant(4, true), CodecSpec::TurboQuant(4, true),
       "4-bit TurboQuant keys and values (values accumulated in the rotated basis)"},
      {"tqkv_k3v4", CodecSpec::TurboQuant(3, true), CodecSpec::TurboQuant(4, true),
       "3-bit TurboQuant keys, 4-bit TurboQuant values"},
      {"tqkv_k3p5v3", CodecSpec::OutlierSplit(4, 3, 2, true), CodecSpec::TurboQuant(3, true),
       "3.5-bit keys (hot half of the channels at 4 bits, the rest at 3), 3-bit TurboQuant values"},
      {"tqkv_k3v3", CodecSpec::TurboQuant(3, true), CodecSpec::TurboQuant(3, true), "3-bit TurboQuant keys and values"},
      {"tqkv_k2p5v3", CodecSpec::OutlierSplit(3, 2, 2, true), CodecSpec::TurboQuant(3, true),
       "2.5-bit keys (hot half of the channels at 3 bits, the rest at 2), 3-bit TurboQuant values"},
      {"eval_qjl_k3v4", CodecSpec::Qjl(3), CodecSpec::Uniform(4),
       "evaluation only: 2-bit TurboQuant + 1-bit QJL keys, 4-bit uniform values", true},
      // Recipes: the codecs of the preset before them plus centering and
      // exact tokens (docs/cache.md, "Centering and exact tokens").
      {"tqkv_k3v4u_csw", CodecSpec::TurboQuant(3, true), CodecSpec::Uniform(4),
       "turboquant_k3v4_nc's codecs with pre-RoPE key centering, per-sequence key scales, 4 exact sink and 64 exact "
       "recent tokens",
       false, kCenteredSinksRecent},
      {"tqkv_k3v3u_csw", CodecSpec::TurboQuant(3, true), CodecSpec::Uniform(3),
       "turboquant_3bit_nc's codecs with pre-RoPE key centering, per-sequence key scales, 4 exact sink and 64 exact "
       "recent tokens",
       false, kCenteredSinksRecent},
      {"tqkv_k3v4_csw", CodecSpec::TurboQuant(3, true), CodecSpec::TurboQuant(4, true),
       "tqkv_k3v4's codecs with pre-RoPE key centering, per-sequence key scales, 4 exact sink and 64 exact recent "
       "tokens",
       false, kCenteredSinksRecent},
      {"tqkv_k4v4u_csw", CodecSpec::TurboQuant(4, true), CodecSpec::Uniform(4),
       "turboquant_4bit_nc's codecs with pre-RoPE key centering, per-sequence key scales, 4 exact sink and 64 exact "
       "recent tokens",
       false, kCenteredSinksRecent},
  };
  return table;
}

}  // namespace

absl::Span<const Preset> AllPresets() { return PresetTable(); }

std::string PresetRecipe::Describe() const {
  std::vector<std::string> parts;
  if (key_centering == KeyCentering::kPreRope) parts.push_back("pre-RoPE key centering");
  if (key_centering == KeyCentering::kPostRope) parts.push_back("post-RoPE key centering");
  if (exact_sink_tokens > 0) parts.push_back(absl::StrCat(exact_sink_tokens, " exact sink tokens"));
  if (exact_recent_tokens > 0) parts.push_back(absl::StrCat(exact_recent_tokens, " exact recent tokens"));
  if (sequence_key_scales) parts.push_back("per-sequence key scales");
  return absl::StrJoin(parts, ", ");
}

std::string PresetNames() {
  std::vector<std::string> names;
  for (const Preset& preset : PresetTable()) names.emplace_back(preset.name);
  return absl::StrJoin(names, ", ");
}

absl::StatusOr<const Preset*> FindPreset(std::string_view name) {
  for (const Preset& preset : PresetTable()) {
    if (preset.name == name) return &preset;
  }
  return absl::NotFoundError(absl::StrCat("unknown preset '", std::string(name), "'; known presets: ", PresetNames()));
}

absl::StatusOr<std::vector<const Preset*>> ParsePresetList(std::string_view names) {
  std::vector<const Preset*> out;
  if (names == "all") {
    for (const Preset& preset : PresetTable()) out.push_back(&preset);
    return out;
  }
  // Debian's abseil has its own string_view type, hence the conversions.
  for (absl::string_view name : absl::StrSplit(absl::string_view(names.data(), names.size()), ',', absl::SkipEmpty())) {
    absl::StatusOr<const Preset*> preset = FindPreset(std::string_view(name.data(), name.size()));
    if (!preset.ok()) return preset.status();
    out.push_back(*preset);
  }
  if (out.empty()) return absl::InvalidArgumentError("no preset named; use 'all' or a name");
  return out;
}

}  // namespace tqkv
