// `tqkv config`: a server config for a model, from its Hugging Face
// config.json or its GGUF file (client/cli/model_config.h).
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/cli/command_util.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "client/cli/model_config.h"
#include "kernels/preset.h"

namespace tqkv {
namespace cli {

int RunConfig(int argc, const char* const* argv) {
  FlagSet flags("config",
                "Prints the tqkv-server config (text-format tqkv.v1.ServerConfig) of one cache for a model:\n"
                "layers, heads, head dim, RoPE (pair layout, base, scaling) and sliding-window layers, read\n"
                "from a Hugging Face config.json or a GGUF file. Save it and pass it to tqkv-server --config.");
  std::string hf, gguf, rope_of = "sliding";
  ModelConfigOptions options;
  int64_t page_tokens = options.page_tokens;
  flags.AddString("from-hf", &hf, "a Hugging Face config.json, or the model directory holding it");
  flags.AddString("from-gguf", &gguf, "a GGUF model file (its metadata is read, not its weights)");
  flags.AddString("preset", &options.preset, "the cache's preset (see `tqkv presets`)");
  flags.AddString("name", &options.cache_name, "the cache's name (clients pass it as --cache)");
  flags.AddInt("page-tokens", &page_tokens, "tokens per page");
  flags.AddString("rope-of", &rope_of,
                  "sliding | full: whose RoPE is the cache's `rope` when the model's sliding-window and "
                  "full-attention layers rotate differently (Gemma 3); the others get theirs in `layer_ropes`");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (hf.empty() == gguf.empty()) return UsageError("tqkv config: give exactly one of --from-hf and --from-gguf");
  if (rope_of != "sliding" && rope_of != "full") {
    return UsageError(absl::StrCat("--rope-of is '", rope_of, "'; want sliding or full"));
  }
  if (page_tokens < 1 || page_tokens > 4096) return UsageError("--page-tokens must be in [1, 4096]");
  if (absl::StatusOr<const Preset*> preset = FindPreset(options.preset); !preset.ok()) {
    return UsageError(std::string(preset.status().message()));
  }
  options.rope_of = rope_of == "full" ? RopeOf::kFull : RopeOf::kSliding;
  options.page_tokens = static_cast<int>(page_tokens);

  absl::StatusOr<DerivedConfig> derived =
      hf.empty() ? CacheConfigFromGgufPath(gguf, options) : CacheConfigFromHfPath(hf, options);
  if (!derived.ok()) return Fail(derived.status());
  fputs(FormatServerConfig(*derived).c_str(), stdout);
  return 0;
}

}  // namespace cli
}  // namespace tqkv
