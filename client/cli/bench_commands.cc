// Benchmarks: `tqkv bench attend`, `tqkv bench store`,
// `tqkv bench transport`. Figures are printed side by side with the uncompressed
// bf16 baseline measured in the same run, never asserted.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/bandwidth_probe.h"
#include "client/cli/command_util.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "client/cli/model_layouts.h"
#include "client/cli/served_layer.h"
#include "client/cli/transport_floor.h"
#include "eval/synthetic.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"
#include "base/random.h"

namespace tqkv {
namespace cli {
namespace {

double Seconds() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Median seconds per call of `body`, after one warm-up call, over at least
// three calls and at least `min_seconds` in total.
template <typename Body>
double MedianSeconds(double min_seconds, Body body) {
  body();
  std::vector<double> times;
  const double start = Seconds();
  while (times.size() < 3 || (Seconds() - start < min_seconds && times.size() < 10000)) {
    const double t0 = Seconds();
    body();
    times.push_back(Seconds() - t0);
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// Times bodies in rounds (a, b, c, a, b, c, ...) so that all of them see the
// same machine state, over at least 5 rounds and `min_seconds`.
class InterleavedTimes {
 public:
  InterleavedTimes(double min_seconds, const std::vector<std::function<void()>>& bodies) : times_(bodies.size()) {
    for (const auto& body : bodies) body();  // warm-up
    const double start = Seconds();
    while (times_[0].size() < 5 || (Seconds() - start < min_seconds && times_[0].size() < 10000)) {
      for (size_t i = 0; i < bodies.size(); ++i) {
        const double t0 = Seconds();
        bodies[i]();
        times_[i].push_back(Seconds() - t0);
      }
    }
  }
  // Body i's median seconds per call.
  double Median(size_t i) const { return MedianOf(times_[i]); }
  // The median over rounds of body i's time over body j's.
  double MedianRatio(size_t i, size_t j) const {
    std::vector<double> ratios;
    for (size_t k = 0; k < times_[i].size(); ++k) ratios.push_back(times_[i][k] / times_[j][k]);
    return MedianOf(ratios);
  }

 private:
  static double MedianOf(std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  }
  std::vector<std::vector<double>> times_;
};

// Hot channels for split presets: from the synthetic keys' own statistics,
// the way a deployment calibrates from a prefill.
std::vector<std::vector<int>> CalibrateFromSample(const Preset& preset, const ModelShape& shape, uint64_t seed) {
  std::vector<std::vector<int>> hot;
  if (!preset.NeedsCalibration()) return hot;
  for (int layer = 0; layer < shape.num_layers; ++layer) {
    for (int head = 0; head < shape.num_kv_heads; ++head) {
      std::vector<float> sample = eval::OutlierKeys(512, shape.head_dim, DeriveSeed(seed, head));
      hot.push_back(ChooseHotChannels(sample.data(), 512, shape.head_dim, preset.key.HotChannels(shape.head_dim)));
    }
  }
  return hot;
}

// Keys with outlier channels per head plus a shared component, Gaussian
// values; [n, heads, d], tokens t0... of the synthetic sequence.
void SyntheticTokens(const ModelShape& shape, int64_t t0, int64_t n, uint64_t seed, std::vector<float>* keys,
                     std::vector<float>* values) {
  const int row = shape.num_kv_heads * shape.head_dim;
  keys->assign(n * row, 0.0f);
  *values = eval::GaussianVectors(n * shape.num_kv_heads, shape.head_dim, DeriveSeed(seed, 1000 + t0));
  for (int head = 0; head < shape.num_kv_heads; ++head) {
    std::vector<float> head_keys = eval::OutlierKeys(n, shape.head_dim, DeriveSeed(seed, head), {});
    // Distinct tokens per chunk: add chunk-seeded noise to the shared pattern.
    Random rng(DeriveSeed(seed, 2000 + t0, head));
    for (int64_t t = 0; t < n; ++t) {
      for (int j = 0; j < shape.head_dim; ++j) {
        (*keys)[(t * shape.num_kv_heads + head) * shape.head_dim + j] =
            head_keys[t * shape.head_dim + j] + 0.1f * static_cast<float>(rng.NextGaussian());
      }
    }
  }
}

// Recipe overrides from the command line (--key-centering, --sinks, --recent,
// --centering-pairs); unset, the served layout's.
struct RecipeOverrides {
  std::string centering;
  int64_t sinks = -1;
  int64_t recent = -1;
  int64_t pairs = -1;
};
RecipeOverrides g_recipe;
// CpuBackendOptions::integer_attention of the benches' backends (--integer-attention).
bool g_integer_attention = true;

absl::Status ApplyRecipeOverrides(KvLayoutOptions* options) {
  if (g_recipe.centering == "none") {
    options->key_centering = KeyCentering::kNone;
  } else if (g_recipe.centering == "post_rope") {
    options->key_centering = KeyCentering::kPostRope;
  } else if (g_recipe.centering == "pre_rope") {
    options->key_centering = KeyCentering::kPreRope;
  } else if (!g_recipe.centering.empty()) {
    return absl::InvalidArgumentError("--key-centering must be none, post_rope or pre_rope");
  }
  if (g_recipe.sinks >= 0) options->exact_sink_tokens = static_cast<int>(g_recipe.sinks);
  if (g_recipe.recent >= 0) options->exact_recent_tokens = static_cast<int>(g_recipe.recent);
  if (g_recipe.pairs >= 0) options->centering_pairs = static_cast<int>(g_recipe.pairs);
  return absl::OkStatus();
}

// The layout a bench runs `preset` in: the server's for one layer
// (ServedLayoutOptions: its RoPE, centering defaults and the preset's
// recipe), hot channels calibrated from the synthetic keys, and the command
// line's recipe overrides (never on the bf16 baseline).
absl::StatusOr<KvLayoutOptions> BenchLayoutOptions(const Preset& preset, const ModelShape& shape, int page_tokens,
                                                   uint64_t seed) {
  KvLayoutOptions options = ServedLayoutOptions(preset.name, shape, page_tokens);
  options.hot_channels =
      CalibrateFromSample(preset, {shape.name, 1, shape.num_kv_heads, shape.num_query_heads, shape.head_dim}, seed);
  if (preset.name != "bf16") {
    if (absl::Status status = ApplyRecipeOverrides(&options); !status.ok()) return status;
  }
  return options;
}

// One layer of a model, stored with a preset, `tokens` long, in a CPU pool:
// the store path's speed (`tqkv bench store`).
struct StoredLayer {
  std::shared_ptr<const KvLayout> layout;
  std::unique_ptr<Backend> backend;
  PagePool pool;
  double store_seconds = 0.0;

  ~StoredLayer() {
    if (backend && pool.base) backend->FreePool(pool);
  }
};

std::unique_ptr<Backend> BenchBackend(int threads) {
  CpuBackendOptions backend_options;
  backend_options.num_threads = threads;
  backend_options.integer_attention = g_integer_attention;
  return MakeCpuBackend(backend_options);
}

absl::StatusOr<std::unique_ptr<StoredLayer>> StoreSyntheticLayer(const Preset& preset, const ModelShape& shape,
                                                                 int page_tokens, int64_t tokens, uint64_t seed,
                                                                 int threads) {
  auto stored = std::make_unique<StoredLayer>();
  absl::StatusOr<KvLayoutOptions> options = BenchLayoutOptions(preset, shape, page_tokens, seed);
  if (!options.ok()) return options.status();
  absl::StatusOr<std::shared_ptr<const KvLayout>> layout = KvLayout::Create(*options);
  if (!layout.ok()) return layout.status();
  stored->layout = *layout;
  stored->backend = BenchBackend(threads);
  const int32_t pages = static_cast<int32_t>((tokens + page_tokens - 1) / page_tokens);
  absl::StatusOr<PagePool> pool = stored->backend->AllocatePool(**layout, pages);
  if (!pool.ok()) return pool.status();
  stored->pool = *pool;
  // A warm pool, as a running server's: the first touch of fresh pages (page
  // faults, zeroing) is not the store path's cost.
  memset(stored->pool.base, 0, stored->pool.page_bytes * static_cast<size_t>(stored->pool.num_pages));
  // Store in chunks so that the float inputs stay small.
  const int64_t chunk = 2048;
  std::vector<int32_t> slots;
  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const int64_t n = std::min(chunk, tokens - t0);
    std::vector<float> keys, values;
    SyntheticTokens(shape, t0, n, seed, &keys, &values);
    slots.resize(n);
    for (int64_t t = 0; t < n; ++t) slots[t] = static_cast<int32_t>(t0 + t);
    StoreParams params{stored->layout.get(), stored->pool, 0, 1, n, slots.data(), keys.data(), values.data()};
    const double start = Seconds();
    absl::Status status = stored->backend->Store(params);
    stored->store_seconds += Seconds() - start;
    if (!status.ok()) return status;
  }
  return stored;
}

// One layer of a model with a preset, as a server holds it at each context
// the bench reads (served_layer.h: appended through a KvCache, so the key
// mean, its pairs, the exact sinks and recent tokens are the server's), every
// context's pages side by side in one CPU pool.
struct ServedContexts {
  std::shared_ptr<const KvLayout> layout;
  std::unique_ptr<Backend> backend;
  PagePool pool;
  std::vector<int64_t> contexts;
  std::vector<PlacedTables> tables;           // per context
  std::vector<std::vector<float>> key_means;  // per context; empty without centering
  std::vector<ServedRecipe> recipes;          // per context

  ~ServedContexts() {
    if (backend && pool.base) backend->FreePool(pool);
  }
};

absl::StatusOr<std::unique_ptr<ServedContexts>> ServeSyntheticLayer(const Preset& preset, const ModelShape& shape,
                                                                    int page_tokens,
                                                                    const std::vector<int64_t>& contexts, uint64_t seed,
                                                                    int threads) {
  absl::StatusOr<KvLayoutOptions> options = BenchLayoutOptions(preset, shape, page_tokens, seed);
  if (!options.ok()) return options.status();
  auto served = std::make_unique<ServedContexts>();
  served->backend = BenchBackend(threads);
  absl::StatusOr<ServedLayer> layer = BuildServedLayer(
      *options, *served->backend, contexts, [&](int64_t t0, int64_t n, std::vector<float>* k, std::vector<float>* v) {
        SyntheticTokens(shape, t0, n, seed, k, v);
      });
  if (!layer.ok()) return layer.status();
  served->layout = layer->layout;
  served->contexts = contexts;
  int32_t pages = 0;
  for (const ServedState& state : layer->states) pages += state.num_pages;
  absl::StatusOr<PagePool> pool = served->backend->AllocatePool(*served->layout, pages);
  if (!pool.ok()) return pool.status();
  served->pool = *pool;
  int32_t first_page = 0;
  for (ServedState& state : layer->states) {
    absl::StatusOr<PlacedTables> placed = PlaceServedState(*served->backend, served->pool, state, first_page);
    if (!placed.ok()) return placed.status();
    first_page += state.num_pages;
    served->tables.push_back(*std::move(placed));
    served->recipes.push_back(DescribeServedState(*served->layout, state));
    served->key_means.push_back(std::move(state.key_mean));
  }
  return served;
}

// The Attend params of `batch` items over context `index` of `served` (all
// items read the same stored sequence), one query token each.
struct AttendCall {
  std::vector<float> queries, outputs, lse;
  std::vector<AttendItem> items;
  AttendParams params;
};

std::unique_ptr<AttendCall> MakeAttendCall(const ServedContexts& served, size_t index, int batch) {
  const KvLayout& layout = *served.layout;
  const PlacedTables& tables = served.tables[index];
  auto call = std::make_unique<AttendCall>();
  const size_t q_size = static_cast<size_t>(layout.num_query_heads()) * layout.head_dim();
  call->queries = eval::GaussianVectors(batch * layout.num_query_heads(), layout.head_dim(), 77);
  call->outputs.resize(call->queries.size());
  call->lse.resize(static_cast<size_t>(batch) * layout.num_query_heads());
  call->items.resize(batch);
  for (int b = 0; b < batch; ++b) {
    AttendItem& item = call->items[b];
    item = AttendItem{tables.block_table.data(),
                      served.contexts[index],
                      0,
                      1,
                      call->queries.data() + b * q_size,
                      call->outputs.data() + b * q_size,
                      call->lse.data() + b * layout.num_query_heads()};
    if (!tables.exact_block_table.empty()) item.exact_block_table = tables.exact_block_table.data();
    if (!served.key_means[index].empty()) item.key_mean = served.key_means[index].data();
  }
  call->params =
      AttendParams{&layout, served.pool, call->items, 1.0f / std::sqrt(static_cast<float>(layout.head_dim()))};
  return call;
}

// Flags every benchmark takes, and their resolved values.
struct BenchCommon {
  std::string preset_names = "all";
  std::string layout_name = "llama3-8b";
  int64_t page_tokens = 16;
  int64_t seed = 1;
  bool json = false;
  std::vector<const Preset*> presets;
  ModelShape shape{};

  void AddFlags(FlagSet& flags) {
    flags.AddString("preset", &preset_names, "a preset, a comma-separated list, or all");
    flags.AddString("key-centering", &g_recipe.centering,
                    "override the presets' key centering: none, post_rope or pre_rope (Llama-3.1 RoPE, as served)");
    flags.AddInt("sinks", &g_recipe.sinks, "override the exact sink tokens (-1: the preset's)");
    flags.AddInt("recent", &g_recipe.recent, "override the exact recent tokens (-1: the preset's)");
    flags.AddDeprecatedAlias("window", "recent");
    flags.AddInt("centering-pairs", &g_recipe.pairs,
                 "override the pre-RoPE frequency pairs of the mean kept (0: all; -1: the server's)");
    flags.AddString("layout", &layout_name, "model shape (see `tqkv capacity --help`)");
    flags.AddInt("page-tokens", &page_tokens, "tokens per page");
    flags.AddInt("seed", &seed, "synthetic data seed");
    flags.AddBool("json", &json, "print JSON instead of a table");
  }

  // After parsing: resolves presets and shape, checks ranges.
  absl::Status Resolve() {
    absl::StatusOr<std::vector<const Preset*>> parsed = ParsePresetList(preset_names);
    if (!parsed.ok()) return parsed.status();
    presets = *parsed;
    absl::StatusOr<ModelShape> found = FindModelShape(layout_name);
    if (!found.ok()) return found.status();
    shape = *found;
    if (page_tokens < 1 || page_tokens > 1024) {
      return absl::InvalidArgumentError("--page-tokens must be in [1, 1024]");
    }
    return absl::OkStatus();
  }
};

// One row of `tqkv bench attend`: a preset at one context, timed in rounds
// with the bf16 baseline (and the preset without its recipe).
struct AttendRow {
  double seconds = 0.0, baseline_seconds = 0.0, speedup = 0.0;
  double plain_seconds = 0.0, vs_plain = 0.0;  // with a plain layer
};

AttendRow TimeAttendRow(const ServedContexts& baseline, const ServedContexts& served, const ServedContexts* plain,
                        size_t index, int batch, double min_seconds) {
  const std::unique_ptr<AttendCall> base_call = MakeAttendCall(baseline, index, batch);
  const std::unique_ptr<AttendCall> call = MakeAttendCall(served, index, batch);
  std::unique_ptr<AttendCall> plain_call;
  std::vector<std::function<void()>> bodies = {[&] { (void)baseline.backend->Attend(base_call->params); },
                                               [&] { (void)served.backend->Attend(call->params); }};
  if (plain != nullptr) {
    plain_call = MakeAttendCall(*plain, index, batch);
    bodies.push_back([&] { (void)plain->backend->Attend(plain_call->params); });
  }
  const InterleavedTimes timed(min_seconds, bodies);
  AttendRow row;
  row.seconds = timed.Median(1);
  row.baseline_seconds = timed.Median(0);
  row.speedup = timed.MedianRatio(0, 1);
  if (plain != nullptr) {
    row.plain_seconds = timed.Median(2);
    row.vs_plain = timed.MedianRatio(1, 2);
  }
  return row;
}

// What every row of one `tqkv bench attend` run shares.
struct AttendRun {
  ModelShape shape;
  int batch = 1;
  double read_bandwidth = 0.0;  // bytes per second
  bool json = false;
  bool compare_plain = false;
};

void ReportAttendRow(const AttendRun& run, const Preset& preset, const ServedContexts& served, size_t index,
                     const AttendRow& row, Json* rows) {
  const int64_t context = served.contexts[index];
  const double read_bytes = static_cast<double>(served.layout->token_bytes(0)) * context * run.batch;
  const double bound_seconds = run.read_bandwidth > 0 ? read_bytes / run.read_bandwidth : 0.0;
  const int bytes = preset.BytesPerTokenHead(run.shape.head_dim);
  if (!run.json) {
    printf("%-20s %8lld %7d %10.3f %10.3f %8.2f %10.2f %9.2f %9.3f %6.0f%%", std::string(preset.name).c_str(),
           static_cast<long long>(context), bytes, row.seconds * 1e3, row.baseline_seconds * 1e3, row.speedup,
           context * run.batch / row.seconds / 1e6, read_bytes / row.seconds / 1e9, bound_seconds * 1e3,
           100.0 * bound_seconds / row.seconds);
    if (run.compare_plain) printf(" %10.3f %8.3f", row.plain_seconds * 1e3, row.vs_plain);
    printf("\n");
    fflush(stdout);
    return;
  }
  const ServedRecipe& recipe = served.recipes[index];
  Json out = {{"preset", std::string(preset.name)},
              {"context", context},
              {"batch", run.batch},
              {"bytes_per_token_head", bytes},
              {"reads", recipe.Describe()},
              {"mean_pairs", recipe.mean_pairs},
              {"exact_sinks", recipe.sinks},
              {"exact_recent", recipe.recent},
              {"attend_ms", row.seconds * 1e3},
              {"bf16_ms", row.baseline_seconds * 1e3},
              {"speedup_vs_bf16", row.speedup},
              {"tokens_per_second", context * run.batch / row.seconds},
              {"cache_gb_per_second", read_bytes / row.seconds / 1e9},
              {"memory_bound_ms", bound_seconds * 1e3},
              {"fraction_of_memory_bound", bound_seconds / row.seconds}};
  if (run.compare_plain) {
    out["plain_ms"] = row.plain_seconds * 1e3;
    out["vs_plain"] = row.vs_plain;
  }
  rows->push_back(std::move(out));
}

// The preset's layer as served at every context, and (compare_plain) the
// same codecs without centering or exact tokens: the recipe's cost.
absl::Status ServePreset(const Preset& preset, const AttendRun& run, int page_tokens,
                         const std::vector<int64_t>& contexts, uint64_t seed, int threads,
                         std::unique_ptr<ServedContexts>* served, std::unique_ptr<ServedContexts>* plain) {
  auto layer = ServeSyntheticLayer(preset, run.shape, page_tokens, contexts, seed, threads);
  if (!layer.ok()) return layer.status();
  *served = *std::move(layer);
  if (!run.compare_plain) return absl::OkStatus();
  const RecipeOverrides given = g_recipe;
  g_recipe = {"none", 0, 0, -1};
  layer = ServeSyntheticLayer(preset, run.shape, page_tokens, contexts, seed, threads);
  g_recipe = given;
  if (!layer.ok()) return layer.status();
  *plain = *std::move(layer);
  return absl::OkStatus();
}

int RunBenchAttend(int argc, const char* const* argv) {
  FlagSet flags("bench attend",
                "Decode attention time for one layer of a model (default Llama-3.1-8B: 8 KV heads,\n"
                "32 query heads, d=128), per preset and context, next to an uncompressed bf16\n"
                "cache attended by tqkv's own SIMD kernel, the two timed alternately (A B A B ...;\n"
                "speedup_vs_bf16 is the median of the per-round ratios), and next to the memory\n"
                "bound: the bytes each call reads over the read bandwidth measured at start-up\n"
                "with as many threads (bound_ms, and %bound = bound_ms / attend_ms).\n"
                "Each layer is what a server holds at that context: appended through the cache with\n"
                "the server's layout (its RoPE, the mean's pairs, the preset's exact sinks and recent tokens).\n"
                "CPU backend; the items of a batch read one stored sequence.");
  BenchCommon common;
  std::vector<int64_t> contexts = {1024, 8192, 32768};
  int64_t batch = 1, threads = 1;
  double min_seconds = 0.5;
  common.AddFlags(flags);
  flags.AddIntList("context", &contexts, "context lengths in tokens, comma-separated");
  flags.AddInt("batch", &batch, "items per Attend call");
  flags.AddDouble("min-seconds", &min_seconds, "measuring time per figure");
  flags.AddInt("threads", &threads, "CPU backend threads (KV heads and items run in parallel)");
  flags.AddBool("integer-attention", &g_integer_attention,
                "TurboQuant attention through the integer kernel where the CPU has AVX-512 VNNI + VBMI + VBMI2,\n"
                "as the server by default (its --cpu_integer_attention)");
  AttendRun run;
  flags.AddBool("compare-plain", &run.compare_plain,
                "also time each preset without centering and exact tokens, alternating calls with the\n"
                "recipe, and print the median ratio recipe / plain (vs_plain: the recipe's cost)");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (absl::Status status = common.Resolve(); !status.ok()) return Fail(status);
  if (threads < 1 || threads > 256) return Fail(absl::InvalidArgumentError("--threads must be in [1, 256]"));
  if (batch < 1 || batch > 1024) return Fail(absl::InvalidArgumentError("--batch must be in [1, 1024]"));
  for (int64_t c : contexts) {
    if (c < 1 || c > (int64_t{1} << 22))
      return Fail(absl::InvalidArgumentError("--context values must be in [1, 4194304]"));
  }
  run.shape = common.shape;
  run.batch = static_cast<int>(batch);
  run.json = common.json;
  const int page_tokens = static_cast<int>(common.page_tokens);

  // The baseline, kept for the whole run and timed alternately with each
  // preset, so that one disturbed baseline cannot move every ratio.
  absl::StatusOr<const Preset*> bf16 = FindPreset("bf16");
  auto baseline = ServeSyntheticLayer(**bf16, run.shape, page_tokens, contexts, common.seed, static_cast<int>(threads));
  if (!baseline.ok()) return Fail(baseline.status());
  const std::string device = (*baseline)->backend->device();
  run.read_bandwidth = MeasureReadBandwidth(size_t{256} << 20, static_cast<int>(threads), 0.5);

  Json rows = Json::array();
  if (!run.json) {
    printf("layout %s, one layer (%d KV heads, %d query heads, d=%d), batch %lld, page %d tokens, %s\n",
           std::string(run.shape.name).c_str(), run.shape.num_kv_heads, run.shape.num_query_heads, run.shape.head_dim,
           static_cast<long long>(batch), page_tokens, device.c_str());
    printf("read bandwidth %.1f GB/s (%lld threads, measured in this run); bf16 timed alternately with each row\n",
           run.read_bandwidth / 1e9, static_cast<long long>(threads));
  }
  for (const Preset* preset : common.presets) {
    std::unique_ptr<ServedContexts> served, plain;
    if (absl::Status s =
            ServePreset(*preset, run, page_tokens, contexts, common.seed, static_cast<int>(threads), &served, &plain);
        !s.ok()) {
      return Fail(s);
    }
    if (!run.json) {
      // What the rows read, from the served state itself at the longest
      // context (a shorter one may hold fewer exact tokens).
      const size_t longest = std::max_element(contexts.begin(), contexts.end()) - contexts.begin();
      printf("%s reads: %s%s\n", std::string(preset->name).c_str(), served->recipes[longest].Describe().c_str(),
             plain ? absl::StrCat("; plain: ", plain->recipes[longest].Describe()).c_str() : "");
      printf("%-20s %8s %7s %10s %10s %8s %10s %9s %9s %7s%s\n", "preset", "context", "bytes", "attend_ms", "bf16_ms",
             "speedup", "Mtok/s", "GB/s", "bound_ms", "%bound", run.compare_plain ? "   plain_ms vs_plain" : "");
    }
    for (size_t i = 0; i < contexts.size(); ++i) {
      const AttendRow row = TimeAttendRow(**baseline, *served, plain.get(), i, run.batch, min_seconds);
      ReportAttendRow(run, *preset, *served, i, row, &rows);
    }
  }
  if (run.json) {
    PrintJson(Json{{"layout", std::string(run.shape.name)},
                   {"device", device},
                   {"read_gb_per_second", run.read_bandwidth / 1e9},
                   {"batch", batch},
                   {"page_tokens", page_tokens},
                   {"results", rows}});
  }
  return 0;
}

int RunBenchStore(int argc, const char* const* argv) {
  FlagSet flags("bench store",
                "Tokens per second stored (quantize + pack, every KV head of one layer) per preset,\n"
                "next to copying the same tokens' bf16 bytes. CPU backend, one thread.");
  BenchCommon common;
  int64_t tokens = 16384;
  common.AddFlags(flags);
  flags.AddInt("tokens", &tokens, "tokens to store");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (absl::Status status = common.Resolve(); !status.ok()) return Fail(status);
  if (tokens < 1 || tokens > (1 << 22)) return Fail(absl::InvalidArgumentError("--tokens must be in [1, 4194304]"));
  const std::vector<const Preset*>* presets = &common.presets;
  const ModelShape* shape = &common.shape;
  const int64_t page_tokens = common.page_tokens, seed = common.seed;
  const bool json = common.json;

  // Baseline: the bf16 bytes of the same tokens, copied into place.
  const size_t bf16_bytes = static_cast<size_t>(tokens) * shape->num_kv_heads * shape->head_dim * 4;
  std::vector<uint8_t> source(bf16_bytes, 1), destination(bf16_bytes);
  const double copy_seconds = MedianSeconds(0.3, [&] { memcpy(destination.data(), source.data(), bf16_bytes); });
  const double copy_rate = tokens / copy_seconds;

  Json rows = Json::array();
  if (!json) {
    printf("layout %s, one layer, %lld tokens; bf16 memcpy: %.2f Mtok/s (%.1f GB/s)\n",
           std::string(shape->name).c_str(), static_cast<long long>(tokens), copy_rate / 1e6,
           bf16_bytes / copy_seconds / 1e9);
    printf("%-20s %7s %12s %14s\n", "preset", "bytes", "Mtok/s", "vs_bf16_copy");
  }
  for (const Preset* preset : *presets) {
    auto stored = StoreSyntheticLayer(*preset, *shape, static_cast<int>(page_tokens), tokens, seed, 1);
    if (!stored.ok()) return Fail(stored.status());
    const double rate = tokens / (*stored)->store_seconds;
    if (json) {
      rows.push_back(Json{{"preset", std::string(preset->name)},
                          {"bytes_per_token_head", preset->BytesPerTokenHead(shape->head_dim)},
                          {"tokens_per_second", rate},
                          {"bf16_copy_tokens_per_second", copy_rate},
                          {"ratio_to_bf16_copy", rate / copy_rate}});
    } else {
      printf("%-20s %7d %12.3f %14.4f\n", std::string(preset->name).c_str(), preset->BytesPerTokenHead(shape->head_dim),
             rate / 1e6, rate / copy_rate);
      fflush(stdout);
    }
  }
  if (json) {
    PrintJson(Json{{"layout", std::string(shape->name)}, {"tokens", tokens}, {"results", rows}});
  }
  return 0;
}

int RunBenchTransport(int argc, const char* const* argv) {
  FlagSet flags("bench transport",
                "The transport floor of the decode loop: round trips through gRPC alone (no\n"
                "protobuf, cache or kernel) of a tiny message and of one decode-step message pair\n"
                "(an AppendAttend of --batch sequences of --layout and its answer, in --wire-dtype),\n"
                "on one stream and with a call per message, to a loopback echo server in a child\n"
                "process that hands each message to a worker thread as tqkv-server does.\n"
                "`tqkv load` reports the time outside the kernels per layer; it cannot go below\n"
                "the stream's figure here.");
  std::string layout_name = "llama3-8b";
  std::string wire = "f32";
  int64_t batch = 8;
  int64_t messages = 2000;
  bool json = false;
  flags.AddString("layout", &layout_name, "model shape (see `tqkv capacity --help`)");
  flags.AddInt("batch", &batch, "sequences per decode-step message");
  flags.AddString("wire-dtype", &wire, "f32, f16 or bf16");
  flags.AddInt("messages", &messages, "round trips timed per row");
  flags.AddBool("json", &json, "print JSON instead of a table");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<ModelShape> shape = FindModelShape(layout_name);
  if (!shape.ok()) return Fail(shape.status());
  if (wire != "f32" && wire != "f16" && wire != "bf16") {
    return UsageError("--wire-dtype must be f32, f16 or bf16");
  }
  if (batch < 1 || batch > 4096) return UsageError("--batch must be in [1, 4096]");
  if (messages < 10 || messages > 1000000) return UsageError("--messages must be in [10, 1000000]");
  const int64_t elem = wire == "f32" ? 4 : 2;
  const int64_t kv = int64_t{shape->num_kv_heads} * shape->head_dim;
  const int64_t q = int64_t{shape->num_query_heads} * shape->head_dim;
  struct Row {
    std::string what;
    bool unary;
    int64_t request, response;
  };
  const std::string step = absl::StrFormat("decode step, batch %d %s", batch, wire);
  const Row rows[] = {{"tiny message", false, 8, 0},
                      {step, false, batch * (2 * kv + q) * elem, batch * q * elem},
                      {"tiny message", true, 8, 0},
                      {step, true, batch * (2 * kv + q) * elem, batch * q * elem}};
  // Forked before this process touches gRPC.
  absl::StatusOr<std::unique_ptr<EchoServerProcess>> echo = EchoServerProcess::Start();
  if (!echo.ok()) return Fail(echo.status());
  Json results = Json::array();
  if (!json) {
    printf(
        "layout %s, loopback to a child process, a worker-thread hop per message, %lld round "
        "trips per row\n",
        std::string(shape->name).c_str(), static_cast<long long>(messages));
    printf("%-32s %-8s %12s %12s %9s %9s %9s\n", "message", "shape", "request_B", "response_B", "p50_us", "p90_us",
           "p99_us");
  }
  for (const Row& row : rows) {
    TransportFloorOptions options;
    options.request_bytes = row.request;
    options.response_bytes = row.response;
    options.messages = messages;
    options.unary = row.unary;
    absl::StatusOr<TransportFloor> floor = MeasureTransportFloor((*echo)->port(), options);
    if (!floor.ok()) return Fail(floor.status());
    const char* how = row.unary ? "call" : "stream";
    if (json) {
      results.push_back(Json{{"message", row.what},
                             {"shape", std::string(how)},
                             {"request_bytes", row.request},
                             {"response_bytes", row.response},
                             {"p50_us", floor->p50_us},
                             {"p90_us", floor->p90_us},
                             {"p99_us", floor->p99_us}});
    } else {
      printf("%-32s %-8s %12lld %12lld %9.0f %9.0f %9.0f\n", row.what.c_str(), how, static_cast<long long>(row.request),
             static_cast<long long>(row.response), floor->p50_us, floor->p90_us, floor->p99_us);
      fflush(stdout);
    }
  }
  if (json) {
    PrintJson(Json{{"layout", std::string(shape->name)}, {"batch", batch}, {"wire_dtype", wire}, {"results", results}});
  }
  return 0;
}

}  // namespace

int RunBench(int argc, const char* const* argv) {
  const std::string what = argc > 0 ? argv[0] : "";
  if (what == "attend") return RunBenchAttend(argc - 1, argv + 1);
  if (what == "store") return RunBenchStore(argc - 1, argv + 1);
  if (what == "transport") return RunBenchTransport(argc - 1, argv + 1);
  if (what == "move") return RunBenchMove(argc - 1, argv + 1);
  const bool help = what == "--help" || what == "-h";
  if (!help && !what.empty()) {
    const std::string closest = ClosestMatch(what, {"attend", "store", "transport", "move"});
    fprintf(stderr, "tqkv: unknown bench subcommand '%s'%s\n", what.c_str(),
            closest.empty() ? "" : absl::StrCat("; did you mean '", closest, "'?").c_str());
  }
  fprintf(help ? stdout : stderr, "usage: tqkv bench attend|store|transport|move [flags]  (--help for each)\n");
  return help ? 0 : kExitUsage;
}

}  // namespace cli
}  // namespace tqkv
