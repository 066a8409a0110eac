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
// Recipe rows (--recipe_presets): the same preset with pre-RoPE key
// centering (8 pairs, the add-back inside the kernels) and 4 exact sink plus
// 128 exact window tokens (two more splits per item, on fp16 exact pages),
// named "<preset>+center+window", next to the plain preset. Their GB/s
// counts the compressed bytes only, so the ratio of kernel times is the
// recipe's cost.
//
// Prints a table, or JSON with --json. Timings are printed, never asserted.
// Exits 1 when any run (a preset, or a preset's recipe) failed: every run is
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
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/eval/synthetic.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"
#include "kernels/random.h"

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
ABSL_FLAG(std::string, recipe_presets, "turboquant_k3v4_nc",
          "Presets also measured with key centering and exact sink/window tokens, comma-separated (empty: "
          "none).");
ABSL_FLAG(bool, tensor_cores, true,
          "Decode on the tensor cores where the layout allows (CudaBackendOptions::tensor_cores); false: "
          "the fp32 CUDA-core kernel.");

namespace tqkv {
namespace {

constexpr int kKvHeads = 8, kQueryHeads = 32, kHeadDim = 128, kPageTokens = 16;
// Exact pages of a recipe run, shared by every item (read only).
constexpr int kExactPages = 16;

// A serving recipe on top of a preset: centering and exact tokens.
struct Recipe {
  bool centered = false;
  int sinks = 0;
  int window = 0;
  std::string Name(const Preset& preset) const {
    return std::string(preset.name) + (centered || sinks + window > 0 ? "+center+window" : "");
  }
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

// Runs one preset over every point; false (with a message) on failure.
// The exact pages of a recipe: the template's first tokens stored through
// the exact layout into the kExactPages pages after `first_page`.
bool StoreExactPages(Backend& backend, const KvLayout& layout, const PagePool& pool, int64_t first_page,
                     const std::vector<float>& keys, const std::vector<float>& values) {
  const int ept = layout.exact_page_tokens();
  // As many tokens as the template has (the rest of the pages stays zero).
  const size_t tokens = std::min(static_cast<size_t>(kExactPages) * ept, keys.size() / (kKvHeads * kHeadDim));
  std::vector<int32_t> slots(tokens);
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(first_page * ept + i);
  const StoreParams params{layout.exact_layout(), pool, 0, 1, static_cast<int64_t>(slots.size()), slots.data(),
                           keys.data(), values.data()};
  const absl::Status status = backend.Store(params);
  if (!status.ok()) std::fprintf(stderr, "exact Store failed: %s\n", status.ToString().c_str());
  return status.ok();
}

bool RunPreset(Backend& backend, const Preset& preset, const Recipe& recipe, const std::vector<Point>& points,
               int64_t max_tokens, std::vector<DecodeRow>* rows, StoreRow* store) {
  const int64_t kTemplateTokens = absl::GetFlag(FLAGS_prefill_tokens);
  KvLayoutOptions options;
  options.num_layers = 1;
  options.num_kv_heads = kKvHeads;
  options.num_query_heads = kQueryHeads;
  options.head_dim = kHeadDim;
  options.page_tokens = kPageTokens;
  options.preset = std::string(preset.name);
  options.boundary_layers = 0;
  if (recipe.centered) {
    options.key_centering = KeyCentering::kPreRope;
    options.rope.base = 500000.0;
    options.centering_pairs = 8;
  }
  options.exact_sink_tokens = recipe.sinks;
  options.exact_window_tokens = recipe.window;
  const std::string name = recipe.Name(preset);
  // Synthetic keys: hot channels and offsets per head; values Gaussian.
  std::vector<float> keys(static_cast<size_t>(kTemplateTokens) * kKvHeads * kHeadDim);
  for (int h = 0; h < kKvHeads; ++h) {
    std::vector<float> head = eval::OutlierKeys(kTemplateTokens, kHeadDim, DeriveSeed(11, h), {});
    for (int64_t t = 0; t < kTemplateTokens; ++t) {
      std::copy(head.begin() + t * kHeadDim, head.begin() + (t + 1) * kHeadDim,
                keys.begin() + (t * kKvHeads + h) * kHeadDim);
    }
    if (preset.NeedsCalibration()) {
      options.hot_channels.push_back(
          ChooseHotChannels(head.data(), kTemplateTokens, kHeadDim, preset.key.HotChannels(kHeadDim)));
    }
  }
  const std::vector<float> values = eval::GaussianVectors(kTemplateTokens * kKvHeads, kHeadDim, 12);
  auto layout = KvLayout::Create(options);
  if (!layout.ok()) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), layout.status().ToString().c_str());
    return false;
  }
  const int64_t pages = (max_tokens + kPageTokens - 1) / kPageTokens;
  const bool exact = (*layout)->has_exact_tokens();
  auto pool = backend.AllocatePool(**layout, static_cast<int32_t>(pages + (exact ? kExactPages : 0)));
  if (!pool.ok()) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), pool.status().ToString().c_str());
    return false;
  }
  // Store the template into the first pages, timed.
  std::vector<int32_t> slots(kTemplateTokens);
  std::iota(slots.begin(), slots.end(), 0);
  const StoreParams store_params{layout->get(), *pool, 0, 1, kTemplateTokens, slots.data(), keys.data(), values.data()};
  double kernel = 0, wall = 0;
  if (!Measure(backend, 0.0, [&] { return backend.Store(store_params).ok(); }, &kernel, &wall)) {
    std::fprintf(stderr, "%s: Store failed: %s\n", name.c_str(),
                 backend.Store(store_params).ToString().c_str());
    backend.FreePool(*pool);
    return false;
  }
  store->preset = name;
  store->kernel_mtokens_per_s = kTemplateTokens / kernel * 1e-6;
  store->wall_mtokens_per_s = kTemplateTokens / wall * 1e-6;
  // Replicate the template's pages over the pool (device to device).
  const int64_t template_pages = kTemplateTokens / kPageTokens;
  const size_t page_bytes = pool->page_bytes;
  for (int64_t p = template_pages; p < pages; p += template_pages) {
    const int64_t n = std::min(template_pages, pages - p);
    if (cudaMemcpy(pool->base + p * page_bytes, pool->base, n * page_bytes, cudaMemcpyDeviceToDevice) !=
        cudaSuccess) {
      std::fprintf(stderr, "page replication failed\n");
      backend.FreePool(*pool);
      return false;
    }
  }
  std::vector<int32_t> table(pages);
  std::iota(table.begin(), table.end(), 0);
  // Recipes: exact pages cycled over each item's exact table, one key mean.
  if (exact && !StoreExactPages(backend, **layout, *pool, pages, keys, values)) {
    backend.FreePool(*pool);
    return false;
  }
  const int ept = exact ? (*layout)->exact_page_tokens() : 1;
  std::vector<int32_t> exact_table;
  const std::vector<float> key_mean = eval::GaussianVectors(kKvHeads, kHeadDim, 14);
  // Bytes of one (token, KV head): the four planes.
  const size_t token_head_bytes = static_cast<size_t>(preset.BytesPerTokenHead(kHeadDim));
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  for (const Point& point : points) {
    const int64_t pages_per_item = (point.context + kPageTokens - 1) / kPageTokens;
    std::vector<float> queries = eval::GaussianVectors(static_cast<int64_t>(point.batch) * kQueryHeads, kHeadDim, 13);
    std::vector<float> output(queries.size());
    std::vector<AttendItem> items(point.batch);
    for (int b = 0; b < point.batch; ++b) {
      items[b] = AttendItem{table.data() + b * pages_per_item, point.context, 0, 1,
                            queries.data() + static_cast<size_t>(b) * kQueryHeads * kHeadDim,
                            output.data() + static_cast<size_t>(b) * kQueryHeads * kHeadDim, nullptr};
    }
    if (exact) {
      exact_table.resize((point.context + ept - 1) / ept);
      for (size_t i = 0; i < exact_table.size(); ++i) exact_table[i] = static_cast<int32_t>(pages + i % kExactPages);
    }
    for (AttendItem& item : items) {
      item.exact_block_table = exact ? exact_table.data() : nullptr;
      item.key_mean = recipe.centered ? key_mean.data() : nullptr;
    }
    const AttendParams params{layout->get(), *pool, items, scale};
    if (!Measure(backend, absl::GetFlag(FLAGS_min_seconds), [&] { return backend.Attend(params).ok(); }, &kernel,
                 &wall)) {
      std::fprintf(stderr, "%s: Attend failed: %s\n", name.c_str(),
                   backend.Attend(params).ToString().c_str());
      backend.FreePool(*pool);
      return false;
    }
    DecodeRow row;
    row.preset = name;
    row.sweep = point.sweep;
    row.context = point.context;
    row.batch = point.batch;
    row.kernel_us = kernel * 1e6;
    row.wall_us = wall * 1e6;
    const double bytes = static_cast<double>(point.batch) * point.context * kKvHeads * token_head_bytes;
    row.gbps = bytes / kernel * 1e-9;
    row.peak_fraction = row.gbps / absl::GetFlag(FLAGS_peak_gbps);
    rows->push_back(row);
  }
  backend.FreePool(*pool);
  return true;
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
  std::vector<Point> points;
  int64_t max_tokens = prefill;
  for (int64_t c : ParseList(absl::GetFlag(FLAGS_contexts))) {
    points.push_back({"context", c, absl::GetFlag(FLAGS_context_batch)});
  }
  for (int64_t b : ParseList(absl::GetFlag(FLAGS_batches))) {
    points.push_back({"batch", absl::GetFlag(FLAGS_batch_context), static_cast<int>(b)});
  }
  for (const Point& p : points) {
    // Whole pages per item.
    max_tokens = std::max(max_tokens, p.batch * ((p.context + kPageTokens - 1) / kPageTokens * kPageTokens));
  }
  auto presets = ParsePresetList(absl::GetFlag(FLAGS_presets));
  if (!presets.ok()) {
    std::fprintf(stderr, "tqkv_gpu_bench: %s\n", presets.status().ToString().c_str());
    return 2;
  }
  std::vector<const Preset*> order = {*FindPreset("bf16")};
  for (const Preset* p : *presets) {
    if (p->name != "bf16") order.push_back(p);
  }
  const std::string recipe_flag = absl::GetFlag(FLAGS_recipe_presets);
  absl::StatusOr<std::vector<const Preset*>> recipe_presets = std::vector<const Preset*>();
  if (!recipe_flag.empty()) recipe_presets = ParsePresetList(recipe_flag);
  if (!recipe_presets.ok()) {
    std::fprintf(stderr, "tqkv_gpu_bench: %s\n", recipe_presets.status().ToString().c_str());
    return 2;
  }
  std::vector<std::pair<const Preset*, Recipe>> runs;
  for (const Preset* preset : order) {
    runs.push_back({preset, Recipe()});
    for (const Preset* r : *recipe_presets) {
      if (r == preset) runs.push_back({preset, Recipe{true, 4, 128}});
    }
  }
  std::vector<DecodeRow> rows;
  std::vector<StoreRow> stores;
  // A failed run is reported and fails the program (after the others ran:
  // their figures help find why), never skipped silently.
  std::vector<std::string> failed;
  for (const auto& [preset, recipe] : runs) {
    StoreRow store;
    if (!RunPreset(**backend, *preset, recipe, points, max_tokens, &rows, &store)) {
      failed.push_back(recipe.Name(*preset));
      std::fprintf(stderr, "  %s FAILED\n", recipe.Name(*preset).c_str());
      continue;
    }
    stores.push_back(store);
    std::fprintf(stderr, "  %s done\n", recipe.Name(*preset).c_str());
  }
  const int exit_code = failed.empty() ? 0 : 1;
  if (!failed.empty()) {
    std::fprintf(stderr, "tqkv_gpu_bench: %zu of %zu runs failed: %s\n", failed.size(), runs.size(),
                 absl::StrJoin(failed, ", ").c_str());
  }
  // Speedups against bf16 at the same point.
  for (DecodeRow& row : rows) {
    for (const DecodeRow& base : rows) {
      if (base.preset == "bf16" && base.sweep == row.sweep && base.context == row.context && base.batch == row.batch) {
        row.speedup_vs_bf16 = base.kernel_us / row.kernel_us;
      }
    }
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("{\"device\": \"%s\", \"layer\": \"llama3-8b (8 kv heads, 32 query heads, d=128, page 16)\",\n",
                (*backend)->device().c_str());
    std::printf(" \"peak_gbps\": %.0f, \"tensor_cores\": %s,\n \"decode\": [\n", absl::GetFlag(FLAGS_peak_gbps),
                absl::GetFlag(FLAGS_tensor_cores) ? "true" : "false");
    for (size_t i = 0; i < rows.size(); ++i) {
      const DecodeRow& r = rows[i];
      std::printf("  {\"preset\": \"%s\", \"sweep\": \"%s\", \"context\": %lld, \"batch\": %d, \"kernel_us\": %.2f, "
                  "\"wall_us\": %.2f, \"gbps\": %.1f, \"peak_fraction\": %.3f, \"speedup_vs_bf16\": %.3f}%s\n",
                  r.preset.c_str(), r.sweep.c_str(), static_cast<long long>(r.context), r.batch, r.kernel_us,
                  r.wall_us, r.gbps, r.peak_fraction, r.speedup_vs_bf16, i + 1 < rows.size() ? "," : "");
    }
    std::printf(" ],\n \"store\": [\n");
    for (size_t i = 0; i < stores.size(); ++i) {
      std::printf("  {\"preset\": \"%s\", \"kernel_mtokens_per_s\": %.2f, \"wall_mtokens_per_s\": %.2f}%s\n",
                  stores[i].preset.c_str(), stores[i].kernel_mtokens_per_s, stores[i].wall_mtokens_per_s,
                  i + 1 < stores.size() ? "," : "");
    }
    std::printf(" ],\n \"failed\": [");
    for (size_t i = 0; i < failed.size(); ++i) std::printf("%s\"%s\"", i > 0 ? ", " : "", failed[i].c_str());
    std::printf("]\n}\n");
    return exit_code;
  }
  std::printf("device: %s; one Llama-3.1-8B layer, one query token per item, kernel time (CUDA events); %s\n\n",
              (*backend)->device().c_str(),
              absl::GetFlag(FLAGS_tensor_cores) ? "tensor-core decode" : "fp32 CUDA-core decode");
  for (const char* sweep : {"context", "batch"}) {
    std::printf("%s sweep\n%-20s %8s %6s %12s %12s %9s %7s %9s\n", sweep, "preset", "context", "batch",
                "kernel us", "wall us", "GB/s", "% peak", "x bf16");
    for (const DecodeRow& r : rows) {
      if (r.sweep != sweep) continue;
      std::printf("%-20s %8lld %6d %12.1f %12.1f %9.0f %6.1f%% %9.2f\n", r.preset.c_str(),
                  static_cast<long long>(r.context), r.batch, r.kernel_us, r.wall_us, r.gbps,
                  100.0 * r.peak_fraction, r.speedup_vs_bf16);
    }
    std::printf("\n");
  }
  std::printf("store: %lld-token prefill of one layer (8 KV heads)\n%-20s %18s %18s\n",
              static_cast<long long>(prefill), "preset", "kernel Mtok/s", "wall Mtok/s");
  for (const StoreRow& s : stores) {
    std::printf("%-20s %18.2f %18.2f\n", s.preset.c_str(), s.kernel_mtokens_per_s, s.wall_mtokens_per_s);
  }
  if (!failed.empty()) std::printf("\nFAILED: %s\n", absl::StrJoin(failed, ", ").c_str());
  return exit_code;
}

}  // namespace
}  // namespace tqkv

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("tqkv_gpu_bench [--presets=...] [--json]");
  absl::ParseCommandLine(argc, argv);
  return tqkv::Main();
}
