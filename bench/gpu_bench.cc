// tqkv_gpu_bench: the CUDA backend's decode and store kernels, per preset,
// next to the bf16 cache read by the same fused kernel in the same run.
//
// One Llama-3.1-8B layer (8 KV heads, 32 query heads, head_dim 128, 16-token
// pages), one query token per item, every item on its own pages (so batches
// do not share cache lines). Decode time is the device time of Attend's
// kernels (CUDA events); the wall time adds the host's staging and copies.
// Effective bandwidth counts the key and value bytes the kernels must read
// (planes of the pages a call touches), against --peak_gbps.
//
// Store: a --prefill_tokens (16384) prefill of the layer through Store;
// device time and wall time (with the host-to-device copy of the float32
// input).
//
// Every run decodes what a server holds: each context's state is built by
// appending the template's tokens through a KvCache of the server's layout
// for the preset (client/cli/served_layer.h), then copied onto each item's
// own pages. Not re-derived by hand: an earlier version passed a dense key
// mean (all 64 RoPE pairs in the add-back, where the server keeps 8) and a
// 128 exact recent tokens (the presets keep 64), and measured a recipe nobody runs.
//
// Recipe rows (--recipe_presets, default tqkv_k3v4u_csw): a preset with a
// recipe (PresetRecipe) as served, so pre-RoPE centering with the mean the
// cache estimates and trims to the layout's centering_pairs, the preset's
// exact sinks and recent tokens on fp16 exact pages ("<preset> reads: ..." says
// what the state holds), next to the same codecs without the recipe,
// "<preset> plain", in the same process: "x plain" is the recipe's kernel
// time over plain's. GB/s counts the compressed bytes only.
//
// Prints a table, or JSON with --json. Timings are printed, never asserted.
// Exits 1 when any run (a preset, plain or as served) failed: every run is
// still attempted, the failed ones are named on stderr, in the table and in
// the JSON's "failed" list.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli/served_layer.h"
#include "eval/synthetic.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"
#include "base/random.h"

ABSL_FLAG(std::string, presets,
          "bf16,fp8,turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc,tqkv_k4v4,"
          "tqkv_k3v3,tqkv_k2p5v3",
          "Presets, comma-separated (bf16 is always measured: it is the baseline).");
ABSL_FLAG(std::string, contexts, "4096,8192,16384,32768,65536,131072", "Context sweep (tokens).");
ABSL_FLAG(int, context_batch, 8, "Batch of the context sweep.");
ABSL_FLAG(std::string, batches, "1,2,4,8,16,32,64", "Batch sweep.");
ABSL_FLAG(int, batch_context, 32768, "Context of the batch sweep (tokens).");
ABSL_FLAG(double, min_seconds, 0.15, "Least time spent per measurement.");
ABSL_FLAG(double, peak_gbps, 4800.0, "The device's peak memory bandwidth, GB/s (H200: 4800).");
ABSL_FLAG(bool, json, false, "Print JSON instead of tables.");
ABSL_FLAG(int64_t, prefill_tokens, 16384,
          "Tokens stored through Store (timed), then replicated over the pool; a multiple of 16.");
ABSL_FLAG(std::string, recipe_presets, "tqkv_k3v4u_csw",
          "Presets with a recipe (centering, exact sinks and recent tokens), comma-separated, each measured as "
          "served and without its recipe ('<preset> plain'); empty: none.");
ABSL_FLAG(bool, tensor_cores, true,
          "Decode on the tensor cores where the layout allows (CudaBackendOptions::tensor_cores); false: "
          "the fp32 CUDA-core kernel.");

namespace tqkv {
namespace {

constexpr int kKvHeads = 8, kQueryHeads = 32, kHeadDim = 128, kPageTokens = 16;
const cli::ModelShape kLayer{"llama3-8b", 1, kKvHeads, kQueryHeads, kHeadDim};

// A preset as served, or (plain) its codecs without its recipe.
struct Run {
  const Preset* preset = nullptr;
  bool plain = false;
  std::string Name() const { return std::string(preset->name) + (plain ? " plain" : ""); }
};

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::vector<int64_t> ParseList(const std::string& text) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (absl::SimpleAtoi(part, &v) && v > 0) out.push_back(v);
  }
  return out;
}

// Median of the device and wall seconds of `body` (one call on `backend`,
// whose device time LastCallTiming reports), after a warm-up call.
template <typename Body>
bool Measure(const Backend& backend, double min_seconds, Body body, double* kernel, double* wall) {
  if (!body()) return false;
  std::vector<double> kernels, walls;
  const double start = Now();
  while (walls.size() < 5 || (Now() - start < min_seconds && walls.size() < 1000)) {
    const double t0 = Now();
    if (!body()) return false;
    walls.push_back(Now() - t0);
    kernels.push_back(backend.LastCallTiming().device_seconds);
  }
  std::nth_element(kernels.begin(), kernels.begin() + kernels.size() / 2, kernels.end());
  std::nth_element(walls.begin(), walls.begin() + walls.size() / 2, walls.end());
  *kernel = kernels[kernels.size() / 2];
  *wall = walls[walls.size() / 2];
  return true;
}

struct DecodeRow {
  std::string preset;
  std::string sweep;
  int64_t context = 0;
  int batch = 0;
  double kernel_us = 0, wall_us = 0, gbps = 0, peak_fraction = 0, speedup_vs_bf16 = 0;
  double vs_plain = 0;  // recipe rows: kernel time over "<preset> plain"'s at the point
};

struct StoreRow {
  std::string preset;
  double kernel_mtokens_per_s = 0, wall_mtokens_per_s = 0;
};

struct Point {
  std::string sweep;
  int64_t context;
  int batch;
};

// --prefill_tokens synthetic tokens of the layer (keys with hot channels
// and offsets per head, Gaussian values), repeated to any length: token t is
// template token t mod tokens.
struct Template {
  int64_t tokens = 0;
  std::vector<float> keys, values;             // [tokens, kv heads, head dim]
  std::vector<std::vector<int>> hot_channels;  // per KV head, for split presets
};

Template MakeTemplate(const Preset& preset) {
  Template t;
  t.tokens = absl::GetFlag(FLAGS_prefill_tokens);
  t.keys.resize(static_cast<size_t>(t.tokens) * kKvHeads * kHeadDim);
  for (int h = 0; h < kKvHeads; ++h) {
    std::vector<float> head = eval::OutlierKeys(t.tokens, kHeadDim, DeriveSeed(11, h), {});
    for (int64_t i = 0; i < t.tokens; ++i) {
      std::copy(head.begin() + i * kHeadDim, head.begin() + (i + 1) * kHeadDim,
                t.keys.begin() + (i * kKvHeads + h) * kHeadDim);
    }
    if (preset.NeedsCalibration()) {
      t.hot_channels.push_back(ChooseHotChannels(head.data(), t.tokens, kHeadDim, preset.key.HotChannels(kHeadDim)));
    }
  }
  t.values = eval::GaussianVectors(t.tokens * kKvHeads, kHeadDim, 12);
  return t;
}

// Tokens [t0, t0 + n) of the template repeated.
void TemplateTokens(const Template& t, int64_t t0, int64_t n, std::vector<float>* keys, std::vector<float>* values) {
  const size_t row = static_cast<size_t>(kKvHeads) * kHeadDim;
  keys->resize(n * row);
  values->resize(n * row);
  for (int64_t i = 0; i < n; ++i) {
    const size_t from = static_cast<size_t>((t0 + i) % t.tokens) * row;
    std::copy(t.keys.begin() + from, t.keys.begin() + from + row, keys->begin() + i * row);
    std::copy(t.values.begin() + from, t.values.begin() + from + row, values->begin() + i * row);
  }
}

// The layout a server holds the run's preset in; plain: without its recipe.
KvLayoutOptions RunLayout(const Run& run, const Template& t) {
  KvLayoutOptions options = cli::ServedLayoutOptions(run.preset->name, kLayer, kPageTokens);
  options.hot_channels = t.hot_channels;
  if (run.plain) {
    options.key_centering = KeyCentering::kNone;
    options.exact_sink_tokens = 0;
    options.exact_recent_tokens = 0;
  }
  return options;
}

// The store row: the template stored into the pool's first pages, timed.
bool TimeStore(Backend& backend, const KvLayout& layout, const PagePool& pool, const Template& t, StoreRow* store) {
  std::vector<int32_t> slots(t.tokens);
  std::iota(slots.begin(), slots.end(), 0);
  const StoreParams params{&layout, pool, 0, 1, t.tokens, slots.data(), t.keys.data(), t.values.data()};
  double kernel = 0, wall = 0;
  if (!Measure(
          backend, 0.0, [&] { return backend.Store(params).ok(); }, &kernel, &wall)) {
    std::fprintf(stderr, "Store failed: %s\n", backend.Store(params).ToString().c_str());
    return false;
  }
  store->kernel_mtokens_per_s = t.tokens / kernel * 1e-6;
  store->wall_mtokens_per_s = t.tokens / wall * 1e-6;
  return true;
}

// Which served state the pool holds, and in how many copies: copy b on pages
// [b * num_pages, (b + 1) * num_pages), one per item of a point, so that
// items never share cache lines.
struct Placed {
  int64_t context = -1;
  int copies = 0;
};

bool PlaceCopies(Backend& backend, const PagePool& pool, const cli::ServedState& state, int copies, Placed* placed) {
  if (placed->context != state.context_tokens) {
    const absl::StatusOr<cli::PlacedTables> first = cli::PlaceServedState(backend, pool, state, 0);
    if (!first.ok()) {
      std::fprintf(stderr, "placing the served state failed: %s\n", first.status().ToString().c_str());
      return false;
    }
    *placed = {state.context_tokens, 1};
  }
  const size_t bytes = static_cast<size_t>(state.num_pages) * pool.page_bytes;
  for (; placed->copies < copies; ++placed->copies) {
    if (cudaMemcpy(pool.base + placed->copies * bytes, pool.base, bytes, cudaMemcpyDeviceToDevice) != cudaSuccess) {
      std::fprintf(stderr, "page replication failed\n");
      return false;
    }
  }
  return true;
}

// One point's Attend over `copies` copies of `state`, timed into *row.
bool DecodePoint(Backend& backend, const KvLayout& layout, const PagePool& pool, const cli::ServedState& state,
                 const Point& point, DecodeRow* row) {
  std::vector<float> queries = eval::GaussianVectors(static_cast<int64_t>(point.batch) * kQueryHeads, kHeadDim, 13);
  std::vector<float> output(queries.size());
  std::vector<cli::PlacedTables> tables;
  std::vector<AttendItem> items(point.batch);
  for (int b = 0; b < point.batch; ++b) tables.push_back(cli::RenumberServedState(state, b * state.num_pages));
  for (int b = 0; b < point.batch; ++b) {
    const size_t q = static_cast<size_t>(b) * kQueryHeads * kHeadDim;
    items[b] =
        AttendItem{tables[b].block_table.data(), point.context, 0, 1, queries.data() + q, output.data() + q, nullptr};
    if (!tables[b].exact_block_table.empty()) items[b].exact_block_table = tables[b].exact_block_table.data();
    if (!state.key_mean.empty()) items[b].key_mean = state.key_mean.data();
  }
  const AttendParams params{&layout, pool, items, 1.0f / std::sqrt(static_cast<float>(kHeadDim))};
  double kernel = 0, wall = 0;
  if (!Measure(
          backend, absl::GetFlag(FLAGS_min_seconds), [&] { return backend.Attend(params).ok(); }, &kernel, &wall)) {
    std::fprintf(stderr, "Attend failed: %s\n", backend.Attend(params).ToString().c_str());
    return false;
  }
  row->sweep = point.sweep;
  row->context = point.context;
  row->batch = point.batch;
  row->kernel_us = kernel * 1e6;
  row->wall_us = wall * 1e6;
  return true;
}

// Runs one preset over every point: its store row, its decode rows, and what
// its recipe reads (*reads); false (with a message) on failure.
bool RunPreset(Backend& backend, const Run& run, const std::vector<Point>& points, std::vector<DecodeRow>* rows,
               StoreRow* store, std::string* reads) {
  const std::string name = run.Name();
  const Template t = MakeTemplate(*run.preset);
  const KvLayoutOptions options = RunLayout(run, t);
  auto layout = KvLayout::Create(options);
  if (!layout.ok()) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), layout.status().ToString().c_str());
    return false;
  }
  // The pool first (a point too large fails before anything is built).
  int64_t pages = (t.tokens + kPageTokens - 1) / kPageTokens;
  std::vector<int64_t> contexts;
  for (const Point& point : points) {
    pages = std::max(pages, point.batch * cli::ServedPagesBound(**layout, point.context));
    if (std::find(contexts.begin(), contexts.end(), point.context) == contexts.end()) contexts.push_back(point.context);
  }
  auto pool = backend.AllocatePool(**layout, static_cast<int32_t>(std::min<int64_t>(pages, INT32_MAX)));
  if (!pool.ok()) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), pool.status().ToString().c_str());
    return false;
  }
  store->preset = name;
  bool ok = TimeStore(backend, **layout, *pool, t, store);
  absl::StatusOr<cli::ServedLayer> served = absl::UnknownError("not built");
  if (ok) {
    served = cli::BuildServedLayer(
        options, backend, contexts,
        [&t](int64_t t0, int64_t n, std::vector<float>* k, std::vector<float>* v) { TemplateTokens(t, t0, n, k, v); });
    if (!served.ok()) std::fprintf(stderr, "%s: %s\n", name.c_str(), served.status().ToString().c_str());
    ok = served.ok();
  }
  const double bytes_per_token = static_cast<double>(run.preset->BytesPerTokenHead(kHeadDim)) * kKvHeads;
  Placed placed;
  for (size_t p = 0; ok && p < points.size(); ++p) {
    const size_t index = std::find(contexts.begin(), contexts.end(), points[p].context) - contexts.begin();
    const cli::ServedState& state = served->states[index];
    DecodeRow row;
    ok = PlaceCopies(backend, *pool, state, points[p].batch, &placed) &&
         DecodePoint(backend, **layout, *pool, state, points[p], &row);
    row.preset = name;
    row.gbps = bytes_per_token * points[p].batch * points[p].context / row.kernel_us * 1e-3;
    row.peak_fraction = row.gbps / absl::GetFlag(FLAGS_peak_gbps);
    if (ok) rows->push_back(row);
  }
  if (ok && !contexts.empty()) {
    const size_t longest = std::max_element(contexts.begin(), contexts.end()) - contexts.begin();
    *reads = cli::DescribeServedState(**layout, served->states[longest]).Describe();
  }
  backend.FreePool(*pool);
  return ok;
}

std::vector<Point> ParsePoints() {
  std::vector<Point> points;
  for (int64_t c : ParseList(absl::GetFlag(FLAGS_contexts))) {
    points.push_back({"context", c, absl::GetFlag(FLAGS_context_batch)});
  }
  for (int64_t b : ParseList(absl::GetFlag(FLAGS_batches))) {
    points.push_back({"batch", absl::GetFlag(FLAGS_batch_context), static_cast<int>(b)});
  }
  return points;
}

// bf16 first (the baseline), the presets, then each recipe preset plain and
// as served. INVALID_ARGUMENT for an unknown preset or a recipe preset
// without a recipe.
absl::StatusOr<std::vector<Run>> ParseRuns() {
  absl::StatusOr<std::vector<const Preset*>> presets = ParsePresetList(absl::GetFlag(FLAGS_presets));
  if (!presets.ok()) return presets.status();
  std::vector<Run> runs = {{*FindPreset("bf16"), false}};
  for (const Preset* p : *presets) {
    if (p->name != "bf16") runs.push_back({p, false});
  }
  const std::string recipe_flag = absl::GetFlag(FLAGS_recipe_presets);
  if (recipe_flag.empty()) return runs;
  absl::StatusOr<std::vector<const Preset*>> recipes = ParsePresetList(recipe_flag);
  if (!recipes.ok()) return recipes.status();
  for (const Preset* p : *recipes) {
    if (p->recipe.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--recipe_presets: ", std::string(p->name), " has no recipe"));
    }
    runs.push_back({p, true});
    runs.push_back({p, false});
  }
  return runs;
}

// Each row's speedup against bf16 and, for recipe rows, its cost against
// "<preset> plain", at the same point.
void Compare(std::vector<DecodeRow>& rows) {
  for (DecodeRow& row : rows) {
    for (const DecodeRow& base : rows) {
      if (base.sweep != row.sweep || base.context != row.context || base.batch != row.batch) continue;
      if (base.preset == "bf16") row.speedup_vs_bf16 = base.kernel_us / row.kernel_us;
      if (base.preset == row.preset + " plain") row.vs_plain = row.kernel_us / base.kernel_us;
    }
  }
}

// What every run produced.
struct Results {
  std::vector<DecodeRow> rows;
  std::vector<StoreRow> stores;
  std::vector<std::pair<std::string, std::string>> reads;  // (recipe preset, what it reads)
  std::vector<std::string> failed;
};

void PrintJson(const std::string& device, const Results& r) {
  std::printf("{\"device\": \"%s\", \"layer\": \"llama3-8b (8 kv heads, 32 query heads, d=128, page 16)\",\n",
              device.c_str());
  std::printf(" \"peak_gbps\": %.0f, \"tensor_cores\": %s,\n \"recipes\": [", absl::GetFlag(FLAGS_peak_gbps),
              absl::GetFlag(FLAGS_tensor_cores) ? "true" : "false");
  for (size_t i = 0; i < r.reads.size(); ++i) {
    std::printf("%s{\"preset\": \"%s\", \"reads\": \"%s\"}", i > 0 ? ", " : "", r.reads[i].first.c_str(),
                r.reads[i].second.c_str());
  }
  std::printf("],\n \"decode\": [\n");
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const DecodeRow& d = r.rows[i];
    std::printf(
        "  {\"preset\": \"%s\", \"sweep\": \"%s\", \"context\": %lld, \"batch\": %d, \"kernel_us\": %.2f, "
        "\"wall_us\": %.2f, \"gbps\": %.1f, \"peak_fraction\": %.3f, \"speedup_vs_bf16\": %.3f",
        d.preset.c_str(), d.sweep.c_str(), static_cast<long long>(d.context), d.batch, d.kernel_us, d.wall_us, d.gbps,
        d.peak_fraction, d.speedup_vs_bf16);
    if (d.vs_plain > 0) std::printf(", \"vs_plain\": %.3f", d.vs_plain);
    std::printf("}%s\n", i + 1 < r.rows.size() ? "," : "");
  }
  std::printf(" ],\n \"store\": [\n");
  for (size_t i = 0; i < r.stores.size(); ++i) {
    std::printf("  {\"preset\": \"%s\", \"kernel_mtokens_per_s\": %.2f, \"wall_mtokens_per_s\": %.2f}%s\n",
                r.stores[i].preset.c_str(), r.stores[i].kernel_mtokens_per_s, r.stores[i].wall_mtokens_per_s,
                i + 1 < r.stores.size() ? "," : "");
  }
  std::printf(" ],\n \"failed\": [");
  for (size_t i = 0; i < r.failed.size(); ++i) std::printf("%s\"%s\"", i > 0 ? ", " : "", r.failed[i].c_str());
  std::printf("]\n}\n");
}

void PrintTables(const std::string& device, const Results& r) {
  std::printf("device: %s; one Llama-3.1-8B layer, one query token per item, kernel time (CUDA events); %s\n",
              device.c_str(), absl::GetFlag(FLAGS_tensor_cores) ? "tensor-core decode" : "fp32 CUDA-core decode");
  for (const auto& [preset, reads] : r.reads) std::printf("%s reads: %s\n", preset.c_str(), reads.c_str());
  std::printf("\n");
  for (const char* sweep : {"context", "batch"}) {
    std::printf("%s sweep\n%-24s %8s %6s %12s %12s %9s %7s %9s %8s\n", sweep, "preset", "context", "batch", "kernel us",
                "wall us", "GB/s", "% peak", "x bf16", "x plain");
    for (const DecodeRow& d : r.rows) {
      if (d.sweep != sweep) continue;
      std::printf("%-24s %8lld %6d %12.1f %12.1f %9.0f %6.1f%% %9.2f", d.preset.c_str(),
                  static_cast<long long>(d.context), d.batch, d.kernel_us, d.wall_us, d.gbps, 100.0 * d.peak_fraction,
                  d.speedup_vs_bf16);
      if (d.vs_plain > 0) std::printf(" %8.2f", d.vs_plain);
      std::printf("\n");
    }
    std::printf("\n");
  }
  std::printf("store: %lld-token prefill of one layer (8 KV heads)\n%-24s %18s %18s\n",
              static_cast<long long>(absl::GetFlag(FLAGS_prefill_tokens)), "preset", "kernel Mtok/s", "wall Mtok/s");
  for (const StoreRow& s : r.stores) {
    std::printf("%-24s %18.2f %18.2f\n", s.preset.c_str(), s.kernel_mtokens_per_s, s.wall_mtokens_per_s);
  }
  if (!r.failed.empty()) std::printf("\nFAILED: %s\n", absl::StrJoin(r.failed, ", ").c_str());
}

int Main() {
  CudaBackendOptions options;
  options.tensor_cores = absl::GetFlag(FLAGS_tensor_cores);
  auto backend = MakeCudaBackend(options);
  if (!backend.ok()) {
    std::fprintf(stderr, "tqkv_gpu_bench: %s\n", backend.status().ToString().c_str());
    return 1;
  }
  const int64_t prefill = absl::GetFlag(FLAGS_prefill_tokens);
  if (prefill < kPageTokens || prefill % kPageTokens != 0) {
    std::fprintf(stderr, "tqkv_gpu_bench: --prefill_tokens must be a positive multiple of %d\n", kPageTokens);
    return 2;
  }
  const std::vector<Point> points = ParsePoints();
  absl::StatusOr<std::vector<Run>> runs = ParseRuns();
  if (!runs.ok()) {
    std::fprintf(stderr, "tqkv_gpu_bench: %s\n", runs.status().ToString().c_str());
    return 2;
  }
  // A failed run is reported and fails the program (after the others ran:
  // their figures help find why), never skipped silently.
  Results results;
  for (const Run& run : *runs) {
    StoreRow store;
    std::string reads;
    if (!RunPreset(**backend, run, points, &results.rows, &store, &reads)) {
      results.failed.push_back(run.Name());
      std::fprintf(stderr, "  %s FAILED\n", run.Name().c_str());
      continue;
    }
    results.stores.push_back(store);
    if (!run.preset->recipe.empty() && !run.plain) results.reads.push_back({run.Name(), reads});
    std::fprintf(stderr, "  %s done\n", run.Name().c_str());
  }
  if (!results.failed.empty()) {
    std::fprintf(stderr, "tqkv_gpu_bench: %zu of %zu runs failed: %s\n", results.failed.size(), runs->size(),
                 absl::StrJoin(results.failed, ", ").c_str());
  }
  Compare(results.rows);
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson((*backend)->device(), results);
  } else {
    PrintTables((*backend)->device(), results);
  }
  return results.failed.empty() ? 0 : 1;
}

}  // namespace
}  // namespace tqkv

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("tqkv_gpu_bench [--presets=...] [--json]");
  absl::ParseCommandLine(argc, argv);
  return tqkv::Main();
}
