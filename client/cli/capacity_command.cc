// `tqkv capacity`: how many tokens of a model's KV cache fit in a pool of a
// given size, per preset, counted as the cache holds them (cache/footprint.h):
// whole pages with their padding, the exact copies of sink and recent tokens
// in their own pages, sliding-window layers' given-back pages, at the
// sequence length asked for. Key means are held beside the pool and shown
// apart. Next to a bf16 cache of the same pool.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cache/footprint.h"
#include "client/cli/command_util.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "client/cli/model_layouts.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"

namespace tqkv {
namespace cli {
namespace {

struct CapacityOptions {
  std::string preset_names = "all", layout_name = "llama3-8b", boundary_preset = "fp16";
  double memory_gib = 40.0;
  int64_t page_tokens = 16, boundary_layers = 2, context = 8192;
  bool json = false;
};

// One preset's figures for sequences of options.context tokens.
struct CapacityRow {
  std::string preset;
  int boundary_layers = 0;
  SequenceFootprint footprint;
  size_t page_bytes = 0;
  int64_t sequences = 0;       // whole sequences the pool holds
  double bytes_per_token = 0;  // pool bytes per token held
};

absl::StatusOr<CapacityRow> RowFor(const CapacityOptions& o, const ModelShape& shape, const Preset& preset,
                                   int boundary) {
  KvLayoutOptions options;
  options.num_layers = shape.num_layers;
  options.num_kv_heads = shape.num_kv_heads;
  options.num_query_heads = shape.num_query_heads;
  options.head_dim = shape.head_dim;
  options.page_tokens = static_cast<int>(o.page_tokens);
  options.preset = std::string(preset.name);
  options.boundary_layers = boundary;
  options.boundary_preset = o.boundary_preset;
  // Sizes do not depend on the RoPE's frequencies, only on whether the
  // preset's pre-RoPE centering is in effect (it needs a known RoPE).
  options.rope.base = 500000.0;
  if (preset.NeedsCalibration()) {  // sizes do not depend on which channels are hot
    std::vector<int> hot(preset.key.HotChannels(shape.head_dim));
    std::iota(hot.begin(), hot.end(), 0);
    options.hot_channels.assign(static_cast<size_t>(shape.num_layers) * shape.num_kv_heads, hot);
  }
  absl::StatusOr<std::shared_ptr<const KvLayout>> layout = KvLayout::Create(options);
  if (!layout.ok()) return layout.status();
  CapacityRow row;
  row.preset = std::string(preset.name);
  row.boundary_layers = boundary;
  row.footprint = FootprintOf(**layout, o.context);
  row.page_bytes = (*layout)->page_bytes();
  const int64_t pool_pages = static_cast<int64_t>(o.memory_gib * 1073741824.0 / row.page_bytes);
  row.sequences = pool_pages / row.footprint.total_pages();
  row.bytes_per_token = static_cast<double>(row.footprint.pool_bytes) / o.context;
  return row;
}

void PrintTable(const CapacityOptions& o, const ModelShape& shape, const CapacityRow& bf16,
                const std::vector<CapacityRow>& rows) {
  printf(
      "layout %s (%d layers, %d KV heads, d=%d), %.1f GiB pool, sequences of %lld tokens, page %lld tokens, "
      "%lld boundary layers at %s\n",
      std::string(shape.name).c_str(), shape.num_layers, shape.num_kv_heads, shape.head_dim, o.memory_gib,
      static_cast<long long>(o.context), static_cast<long long>(o.page_tokens),
      static_cast<long long>(o.boundary_layers), o.boundary_preset.c_str());
  printf("%-20s %10s %8s %10s %12s %8s %10s\n", "preset", "KiB/token", "exact%", "sequences", "tokens", "x_bf16",
         "means_KiB");
  printf("%-20s %10.2f %8.1f %10lld %12lld %8.2f %10.1f\n", "bf16 (no boundary)", bf16.bytes_per_token / 1024, 0.0,
         static_cast<long long>(bf16.sequences), static_cast<long long>(bf16.sequences * o.context), 1.0, 0.0);
  for (const CapacityRow& r : rows) {
    const double exact = 100.0 * r.footprint.exact_pages / r.footprint.total_pages();
    printf("%-20s %10.2f %8.1f %10lld %12lld %8.2f %10.1f\n", r.preset.c_str(), r.bytes_per_token / 1024, exact,
           static_cast<long long>(r.sequences), static_cast<long long>(r.sequences * o.context),
           bf16.bytes_per_token / r.bytes_per_token, r.footprint.mean_bytes / 1024.0);
  }
  printf(
      "(KiB/token: the pool's bytes per token at this length, whole pages: padding and the exact copies'\n"
      " pages included; exact%%: their share of the pages; x_bf16: bf16's KiB/token over this one;\n"
      " means_KiB: a sequence's key means, held beside the pool)\n");
}

Json ToJson(const CapacityOptions& o, const ModelShape& shape, const CapacityRow& bf16,
            const std::vector<CapacityRow>& rows) {
  Json presets = Json::array();
  for (const CapacityRow& r : rows) {
    presets.push_back(Json{{"preset", r.preset},
                           {"boundary_layers", r.boundary_layers},
                           {"bytes_per_token", r.bytes_per_token},
                           {"pages_per_sequence", r.footprint.pages},
                           {"exact_pages_per_sequence", r.footprint.exact_pages},
                           {"page_bytes", r.page_bytes},
                           {"mean_bytes_per_sequence", r.footprint.mean_bytes},
                           {"stored_bytes_per_sequence", r.footprint.stored_bytes},
                           {"sequences", r.sequences},
                           {"tokens", r.sequences * o.context},
                           {"ratio_to_bf16", bf16.bytes_per_token / r.bytes_per_token}});
  }
  return Json{{"layout", std::string(shape.name)},
              {"memory_gib", o.memory_gib},
              {"context", o.context},
              {"page_tokens", o.page_tokens},
              {"boundary_preset", o.boundary_preset},
              {"bf16_bytes_per_token", bf16.bytes_per_token},
              {"bf16_sequences", bf16.sequences},
              {"bf16_tokens", bf16.sequences * o.context},
              {"presets", presets}};
}

}  // namespace

int RunCapacity(int argc, const char* const* argv) {
  FlagSet flags("capacity",
                "Tokens of a model's KV cache that fit in a memory pool, per preset, counted as the\n"
                "cache holds sequences of --context tokens: whole pages (padding included), the\n"
                "exact copies of sink and recent tokens in their pages, the protected boundary\n"
                "layers; next to a bf16 cache of the same pool.");
  CapacityOptions o;
  flags.AddDouble("memory-gib", &o.memory_gib, "pool size in GiB (2^30 bytes)");
  flags.AddString("preset", &o.preset_names, "a preset, a comma-separated list, or all");
  std::string layouts;
  for (const ModelShape& shape : ModelShapes()) layouts += (layouts.empty() ? "" : " | ") + std::string(shape.name);
  flags.AddString("layout", &o.layout_name, layouts);
  flags.AddInt("context", &o.context, "tokens per sequence (every layer)");
  flags.AddInt("page-tokens", &o.page_tokens, "tokens per page");
  flags.AddInt("boundary-layers", &o.boundary_layers, "first and last layers kept at --boundary-preset");
  flags.AddString("boundary-preset", &o.boundary_preset, "preset of the boundary layers");
  flags.AddBool("json", &o.json, "print JSON instead of a table");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<std::vector<const Preset*>> presets = ParsePresetList(o.preset_names);
  if (!presets.ok()) return Fail(presets.status());
  absl::StatusOr<ModelShape> shape = FindModelShape(o.layout_name);
  if (!shape.ok()) return Fail(shape.status());
  if (!(o.memory_gib > 0)) return Fail(absl::InvalidArgumentError("--memory-gib must be positive"));
  if (o.context < 1 || o.context > (int64_t{1} << 24)) {
    return Fail(absl::InvalidArgumentError("--context must be in [1, 16777216]"));
  }
  absl::StatusOr<CapacityRow> bf16 = RowFor(o, *shape, **FindPreset("bf16"), 0);
  if (!bf16.ok()) return Fail(bf16.status());
  std::vector<CapacityRow> rows;
  for (const Preset* preset : *presets) {
    const bool uncompressed = preset->name == "bf16" || preset->name == "fp16";
    absl::StatusOr<CapacityRow> row =
        RowFor(o, *shape, *preset, uncompressed ? 0 : static_cast<int>(o.boundary_layers));
    if (!row.ok()) return Fail(row.status());
    rows.push_back(*row);
  }
  if (o.json) {
    PrintJson(ToJson(o, *shape, *bf16, rows));
  } else {
    PrintTable(o, *shape, *bf16, rows);
  }
  return 0;
}

}  // namespace cli
}  // namespace tqkv
