// `tqkv calibrate`: per-layer attention error of candidate presets on a
// capture of a real model's Q/K/V, and a protection plan for a byte budget
// (eval/calibration.h; docs/calibrate.md).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/command_util.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "eval/calibration.h"
#include "kernels/key_centering.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"

namespace tqkv {
namespace cli {
namespace {

using eval::CalibrationMetric;
using eval::LayerCalibration;

constexpr char kDefaultPresets[] = "turboquant_k3v4_nc,tqkv_k3v4,turboquant_4bit_nc,tqkv_k4v4,turboquant_k8v4,fp8,fp16";

// The serving recipe beside the preset: key centering and exact tokens
// (kernels/kv_layout.h), passed through to the measured cache's layout so
// that each preset's error is the one the server will have.
struct RecipeFlags {
  std::string centering = "none", rope_layout = "interleaved", rope_scaling = "none";
  double rope_base = 0.0, rope_scaling_factor = 1.0;
  int64_t rotary_dims = 0, sinks = 0, recent = 0;
  int64_t centering_tokens = KvLayoutOptions().centering_tokens;
  int64_t centering_pairs = KvLayoutOptions().centering_pairs;

  void Register(FlagSet& flags) {
    flags.AddString("key-centering", &centering, "none | post_rope | pre_rope (needs --rope-base)");
    flags.AddDouble("rope-base", &rope_base, "RoPE base theta (pre_rope; 0: unknown)");
    flags.AddString("rope-layout", &rope_layout, "RoPE pairs: interleaved | half_split");
    flags.AddInt("rotary-dims", &rotary_dims, "coordinates that rotate (0: all of head_dim)");
    flags.AddString("rope-scaling", &rope_scaling, "none | linear | llama3");
    flags.AddDouble("rope-scaling-factor", &rope_scaling_factor, "RoPE scaling factor");
    flags.AddInt("centering-tokens", &centering_tokens, "tokens the key mean is taken over");
    flags.AddInt("centering-pairs", &centering_pairs, "pre_rope: mean pairs kept (0: all)");
    flags.AddInt("sinks", &sinks, "first tokens of each layer also kept exact at fp16");
    flags.AddInt("recent", &recent, "last tokens of each layer also kept exact at fp16");
    flags.AddDeprecatedAlias("window", "recent");
  }

  // Writes the recipe into `layout`; a usage error message or "". Centering
  // and exact-token counts are written only when given: left alone, the
  // layout takes each preset's own recipe.
  std::string Apply(const FlagSet& flags, KvLayoutOptions& layout) const {
    if (!flags.IsSet("key-centering")) {
      // The preset decides.
    } else if (centering == "none") {
      layout.key_centering = KeyCentering::kNone;
    } else if (centering == "post_rope") {
      layout.key_centering = KeyCentering::kPostRope;
    } else if (centering == "pre_rope") {
      layout.key_centering = KeyCentering::kPreRope;
    } else {
      return "--key-centering must be none, post_rope or pre_rope, got '" + centering + "'";
    }
    if (rope_layout == "interleaved") {
      layout.rope.pair_layout = RopePairLayout::kInterleaved;
    } else if (rope_layout == "half_split") {
      layout.rope.pair_layout = RopePairLayout::kHalfSplit;
    } else {
      return "--rope-layout must be interleaved or half_split, got '" + rope_layout + "'";
    }
    if (rope_scaling == "none") {
      layout.rope.scaling = RopeScaling::kNone;
    } else if (rope_scaling == "linear") {
      layout.rope.scaling = RopeScaling::kLinear;
    } else if (rope_scaling == "llama3") {
      layout.rope.scaling = RopeScaling::kLlama3;
    } else {
      return "--rope-scaling must be none, linear or llama3, got '" + rope_scaling + "'";
    }
    if (rope_base < 0) return "--rope-base must be >= 0";
    layout.rope.base = rope_base;
    layout.rope.scaling_factor = rope_scaling_factor;
    layout.rope.rotary_dims = static_cast<int>(rotary_dims);
    layout.centering_tokens = static_cast<int>(centering_tokens);
    layout.centering_pairs = static_cast<int>(centering_pairs);
    if (flags.IsSet("sinks")) layout.exact_sink_tokens = static_cast<int>(sinks);
    if (flags.IsSet("recent")) layout.exact_recent_tokens = static_cast<int>(recent);
    return "";
  }

  // "key centering pre_rope (base 10000, 8 pairs), 4 sink + 64 recent tokens
  // exact" for the settings given, or "" when none is.
  std::string Describe(const FlagSet& flags) const {
    std::vector<std::string> parts;
    if (flags.IsSet("key-centering")) {
      std::string part = "key centering " + centering;
      if (centering == "pre_rope") {
        absl::StrAppendFormat(&part, " (rope base %g, %s, %lld pairs)", rope_base, rope_layout,
                              static_cast<long long>(centering_pairs));
      }
      parts.push_back(part);
    }
    if (flags.IsSet("sinks") || flags.IsSet("recent")) {
      parts.push_back(absl::StrFormat("%lld sink + %lld recent tokens exact", static_cast<long long>(sinks),
                                      static_cast<long long>(recent)));
    }
    return absl::StrJoin(parts, ", ");
  }
};

// The command line, resolved.
struct CalibrateFlags {
  std::string capture, preset_names = kDefaultPresets, metric_name = "output";
  eval::PlanOptions plan;
  eval::CalibrationOptions measure;
  int64_t positions = 64, page_tokens = 16, threads = 1, context = 8192;
  int64_t rotation_seed = static_cast<int64_t>(KvLayoutOptions().rotation_seed);
  double budget_bits = 0.0, budget_ratio = 0.0;
  bool json = false;
  RecipeFlags recipe;
  std::vector<const Preset*> presets;

  void Register(FlagSet& flags) {
    flags.AddRequiredString("capture", &capture, "capture directory: meta.json and layer_NNN_{q,k,v}.npy");
    flags.AddString("presets", &preset_names, "candidate presets, comma-separated, or all");
    flags.AddString("base-preset", &plan.base_preset, "every layer starts at this preset");
    flags.AddInt("positions", &positions, "query positions sampled per layer (second half)");
    flags.AddDouble("budget-bits", &budget_bits,
                    "plan: average bits per coordinate over all layers, K and V (e.g. 4.0)");
    flags.AddDouble("budget-ratio", &budget_ratio, "plan: compression vs bf16 (e.g. 3.5)");
    flags.AddString("metric", &metric_name, "what the plan minimizes: output | kl | tv | logit");
    flags.AddInt("context", &context, "context length the exact tokens' bytes are spread over");
    flags.AddInt("page-tokens", &page_tokens, "tokens per page of the measured cache");
    flags.AddInt("rotation-seed", &rotation_seed, "rotation seed of the measured cache");
    flags.AddInt("threads", &threads, "CPU backend threads (0: all cores)");
    recipe.Register(flags);
    flags.AddBool("json", &json, "print JSON instead of markdown");
  }

  // After parsing; a usage error message, or "" when the flags are valid.
  std::string Resolve(const FlagSet& flags) {
    absl::StatusOr<std::vector<const Preset*>> parsed = ParsePresetList(preset_names);
    if (!parsed.ok()) return std::string(parsed.status().message());
    presets = *parsed;
    absl::StatusOr<const Preset*> base = FindPreset(plan.base_preset);
    if (!base.ok()) return std::string(base.status().message());
    if (std::find(presets.begin(), presets.end(), *base) == presets.end()) {
      presets.insert(presets.begin(), *base);
    }
    absl::StatusOr<CalibrationMetric> metric = eval::ParseCalibrationMetric(metric_name);
    if (!metric.ok()) return std::string(metric.status().message());
    plan.metric = *metric;
    if (budget_bits > 0 && budget_ratio > 0) return "give --budget-bits or --budget-ratio, not both";
    if (budget_bits < 0 || budget_ratio < 0) return "budgets must be positive";
    plan.budget_bits = budget_ratio > 0 ? 16.0 / budget_ratio : budget_bits;
    if (positions < 1 || positions > 100000) return "--positions must be in [1, 100000]";
    if (context < 1) return "--context must be >= 1";
    if (page_tokens < 1 || page_tokens > 1024) return "--page-tokens must be in [1, 1024]";
    if (threads < 0 || threads > 256) return "--threads must be in [0, 256]";
    plan.context = context;
    measure.positions = static_cast<int>(positions);
    measure.threads = static_cast<int>(threads);
    measure.layout.page_tokens = static_cast<int>(page_tokens);
    measure.layout.rotation_seed = static_cast<uint64_t>(rotation_seed);
    if (std::string error = recipe.Apply(flags, measure.layout); !error.empty()) return error;
    plan.recipe = recipe.Describe(flags);
    return "";
  }

  bool planning() const { return plan.budget_bits > 0; }
};

// ---------------------------------------------------------------------------
// Markdown.

// Rows of what each preset costs: bytes and bits of its tokens, and with
// centering or exact tokens in effect, the recipe and bits at `context`.
void PrintCostRows(const std::vector<eval::PresetError>& presets, const eval::CaptureMeta& meta, int64_t context) {
  const double coordinates = 2.0 * meta.num_kv_heads * meta.head_dim;
  bool recipe = false;
  printf("| bytes/token |");
  for (const eval::PresetError& e : presets) {
    printf(" %lld |", static_cast<long long>(e.token_bytes));
    recipe = recipe || e.exact_tokens > 0 || e.key_centering != "none";
  }
  printf("\n| bits/coord |");
  for (const eval::PresetError& e : presets) printf(" %.3f |", 8.0 * e.token_bytes / coordinates);
  printf("\n");
  if (!recipe) return;
  printf("| recipe |");
  for (const eval::PresetError& e : presets) {
    printf(" %s, %lld exact |", e.key_centering.c_str(), static_cast<long long>(e.exact_tokens));
  }
  printf("\n| bits/coord at %lld |", static_cast<long long>(context));
  for (const eval::PresetError& e : presets) {
    printf(" %.3f |", 8.0 * eval::LayerBytesPerToken(e, context) / coordinates);
  }
  printf("\n");
}

// `context` > 0 adds the cost rows.
void PrintMetricTable(const char* title, const std::vector<LayerCalibration>& layers, const eval::CaptureMeta& meta,
                      CalibrationMetric metric, int64_t context) {
  const std::vector<eval::PresetError>& first = layers[0].presets;
  printf("\n## %s\n\n| layer |", title);
  for (const eval::PresetError& e : first) printf(" %s |", std::string(e.preset->name).c_str());
  printf("\n|---|");
  for (size_t i = 0; i < first.size(); ++i) printf("---:|");
  printf("\n");
  if (context > 0) PrintCostRows(first, meta, context);
  for (const LayerCalibration& layer : layers) {
    printf("| %d |", layer.layer);
    for (const eval::PresetError& e : layer.presets) printf(" %.5f |", MetricValue(e, metric));
    printf("\n");
  }
}

// Presets that take no more bytes than the base and err less on every layer:
// a better base, not a protection.
void PrintBetterBases(const std::vector<LayerCalibration>& layers, const eval::ProtectionPlan& plan,
                      CalibrationMetric metric) {
  const std::vector<eval::PresetError>& first = layers[0].presets;
  int base = 0;
  while (first[base].preset != plan.base) ++base;
  for (size_t i = 0; i < first.size(); ++i) {
    bool better = first[i].token_bytes <= first[base].token_bytes && static_cast<int>(i) != base;
    for (const LayerCalibration& layer : layers) {
      better = better && MetricValue(layer.presets[i], metric) < MetricValue(layer.presets[base], metric);
    }
    if (better) {
      printf(
          "note: %s takes no more bytes than %s and errs less on every layer; consider "
          "--base-preset %s\n\n",
          std::string(first[i].preset->name).c_str(), std::string(plan.base->name).c_str(),
          std::string(first[i].preset->name).c_str());
    }
  }
}

void PrintPlan(const eval::ProtectionPlan& plan, const CalibrateFlags& flags) {
  printf(
      "\n## Protection plan\n\nbudget %.3f bits/coordinate (%.2fx vs bf16), metric %s, "
      "context %lld\n\n",
      flags.plan.budget_bits, 16.0 / flags.plan.budget_bits, flags.metric_name.c_str(),
      static_cast<long long>(flags.plan.context));
  printf("start: every layer at %s, %.3f bits/coordinate, total error %.5f\n\n", std::string(plan.base->name).c_str(),
         plan.base_bits, plan.base_error);
  int n = 0;
  for (const eval::PlanStep& s : plan.steps) {
    printf("%d. layer %d: %s -> %s, error %.5f -> %.5f, %+.4f bits/coordinate\n", ++n, s.layer,
           std::string(s.from->name).c_str(), std::string(s.to->name).c_str(), s.error_before, s.error_after,
           s.extra_bits);
  }
  if (plan.steps.empty()) printf("(no upgrade fits the budget)\n");
  printf("\nresult: %.3f bits/coordinate (%.2fx vs bf16), total error %.5f\n\n", plan.bits_per_coordinate,
         plan.ratio_vs_bf16, plan.total_error);
  printf("```\n%s```\n", eval::ProtectionConfigText(plan, flags.plan).c_str());
}

void PrintMarkdown(const std::vector<LayerCalibration>& layers, const eval::CaptureMeta& meta,
                   const CalibrateFlags& flags, const eval::ProtectionPlan* plan) {
  const std::vector<int64_t>& positions = layers[0].positions;
  printf(
      "# Calibration of %s\n\n%d layers, %lld tokens, %d query heads, %d KV heads, head_dim %d; "
      "%zu positions per layer in [%lld, %lld]\n",
      flags.capture.c_str(), meta.layers, static_cast<long long>(meta.tokens), meta.num_query_heads, meta.num_kv_heads,
      meta.head_dim, positions.size(), static_cast<long long>(positions.front()),
      static_cast<long long>(positions.back()));
  printf("serving recipe: %s\n", flags.plan.recipe.empty()
                                     ? "each preset's own (no --key-centering, --sinks or --recent given)"
                                     : flags.plan.recipe.c_str());
  PrintMetricTable("Attention output relative error per layer", layers, meta, CalibrationMetric::kOutputError,
                   flags.plan.context);
  PrintMetricTable("KL divergence of attention per layer (nats)", layers, meta, CalibrationMetric::kKlDivergence, 0);
  if (!plan) return;
  PrintPlan(*plan, flags);
  PrintBetterBases(layers, *plan, flags.plan.metric);
}

// ---------------------------------------------------------------------------
// JSON.

Json LayersJson(const std::vector<LayerCalibration>& layers) {
  Json out = Json::array();
  for (const LayerCalibration& layer : layers) {
    Json presets = Json::array();
    for (const eval::PresetError& e : layer.presets) {
      presets.push_back(Json{{"preset", std::string(e.preset->name)},
                             {"output_rel_error", e.output_rel_error},
                             {"logit_rmse", e.logit_rmse},
                             {"tv_distance", e.tv_distance},
                             {"kl_divergence", e.kl_divergence},
                             {"token_bytes", e.token_bytes},
                             {"token_bytes_bf16", e.token_bytes_bf16},
                             {"exact_tokens", e.exact_tokens},
                             {"fixed_bytes", e.fixed_bytes},
                             {"key_centering", e.key_centering}});
    }
    out.push_back(Json{{"layer", layer.layer}, {"presets", presets}});
  }
  return out;
}

Json PlanJson(const eval::ProtectionPlan& plan, const CalibrateFlags& flags) {
  Json steps = Json::array(), choice = Json::array();
  for (const eval::PlanStep& s : plan.steps) {
    steps.push_back(Json{{"layer", s.layer},
                         {"from", std::string(s.from->name)},
                         {"to", std::string(s.to->name)},
                         {"error_before", s.error_before},
                         {"error_after", s.error_after},
                         {"extra_bits", s.extra_bits}});
  }
  for (const Preset* p : plan.layer_presets) choice.push_back(std::string(p->name));
  return Json{{"budget_bits", flags.plan.budget_bits},
              {"metric", flags.metric_name},
              {"context", flags.plan.context},
              {"base_preset", std::string(plan.base->name)},
              {"base_bits", plan.base_bits},
              {"base_error", plan.base_error},
              {"steps", steps},
              {"layer_presets", choice},
              {"bits_per_coordinate", plan.bits_per_coordinate},
              {"ratio_vs_bf16", plan.ratio_vs_bf16},
              {"total_error", plan.total_error},
              {"config", eval::ProtectionConfigText(plan, flags.plan)}};
}

void PrintReportJson(const std::vector<LayerCalibration>& layers, const eval::CaptureMeta& meta,
                     const CalibrateFlags& flags, const eval::ProtectionPlan* plan) {
  Json out = Json{{"capture", flags.capture},
                  {"layers", meta.layers},
                  {"tokens", meta.tokens},
                  {"num_query_heads", meta.num_query_heads},
                  {"num_kv_heads", meta.num_kv_heads},
                  {"head_dim", meta.head_dim},
                  {"positions", layers[0].positions},
                  {"recipe", flags.plan.recipe},
                  {"per_layer", LayersJson(layers)}};
  if (plan) out["plan"] = PlanJson(*plan, flags);
  PrintJson(out);
}

// ---------------------------------------------------------------------------

absl::StatusOr<std::vector<LayerCalibration>> MeasureAll(const eval::CaptureMeta& meta, const CalibrateFlags& flags) {
  std::vector<LayerCalibration> layers;
  for (int l = 0; l < meta.layers; ++l) {
    absl::StatusOr<eval::LayerCapture> capture = eval::ReadCaptureLayer(flags.capture, meta, l);
    if (!capture.ok()) return capture.status();
    absl::StatusOr<LayerCalibration> layer = eval::CalibrateLayer(meta, l, *capture, flags.presets, flags.measure);
    if (!layer.ok()) return layer.status();
    layers.push_back(std::move(*layer));
    if (isatty(STDERR_FILENO)) {
      fprintf(stderr, "\rtqkv calibrate: layer %d/%d measured%s", l + 1, meta.layers, l + 1 == meta.layers ? "\n" : "");
    }
  }
  return layers;
}

// Builds the base preset's layout for the capture's shape with the recipe:
// a usage error message for settings the layout refuses, or "".
std::string CheckRecipe(const eval::CaptureMeta& meta, const CalibrateFlags& flags) {
  KvLayoutOptions layout = flags.measure.layout;
  layout.num_layers = 1;
  layout.num_kv_heads = meta.num_kv_heads;
  layout.num_query_heads = meta.num_query_heads;
  layout.head_dim = meta.head_dim;
  layout.preset = flags.plan.base_preset;
  layout.boundary_layers = 0;
  if (layout.key_centering == KeyCentering::kPreRope && !layout.rope.known()) {
    fprintf(stderr,
            "tqkv: --key-centering pre_rope without --rope-base: the cache centers "
            "after RoPE, and so does this measurement\n");
  }
  // Split presets need hot channels to build; the recipe check does not.
  if (FindPreset(layout.preset).value()->NeedsCalibration()) layout.preset = "fp16";
  absl::StatusOr<std::shared_ptr<const KvLayout>> created = KvLayout::Create(layout);
  if (!created.ok()) return std::string(created.status().message());
  return "";
}

}  // namespace

int RunCalibrate(int argc, const char* const* argv) {
  FlagSet flags("calibrate",
                "Attention error per layer and candidate preset on a capture of a model's Q/K/V\n"
                "(through a real KvCache on the CPU backend, against exact float64 causal\n"
                "attention), and with --budget-bits or --budget-ratio a protection plan: which\n"
                "layers to give which preset, as cache-config lines. See docs/calibrate.md.");
  CalibrateFlags options;
  options.Register(flags);
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (std::string error = options.Resolve(flags); !error.empty()) return UsageError(error);

  absl::StatusOr<eval::CaptureMeta> meta = eval::ReadCaptureMeta(options.capture);
  if (!meta.ok()) return Fail(meta.status());
  if (std::string error = CheckRecipe(*meta, options); !error.empty()) return UsageError(error);
  absl::StatusOr<std::vector<LayerCalibration>> layers = MeasureAll(*meta, options);
  if (!layers.ok()) return Fail(layers.status());
  absl::StatusOr<eval::ProtectionPlan> plan;
  if (options.planning()) plan = eval::PlanProtection(*meta, *layers, options.plan);
  const eval::ProtectionPlan* planned = plan.ok() ? &*plan : nullptr;
  if (options.json) {
    PrintReportJson(*layers, *meta, options, planned);
  } else {
    PrintMarkdown(*layers, *meta, options, planned);
  }
  if (options.planning() && !plan.ok()) return Fail(plan.status());
  return 0;
}

}  // namespace cli
}  // namespace tqkv
