// Key centering (pre- and post-RoPE), exact sink and recent tokens,
// sliding-window layers, per-layer RoPEs, key scales and logit soft-capping
// through the real cache on each backend (prefill, fork, decode steps), and
// the pre-RoPE add-back at positions near 1e6, against the CPU within the
// tolerances of cuda_backend_test.cc. Every test skips where no CUDA device
// is present.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/kv_layout.h"
#include "tests/gpu/cuda_backend_test_util.h"

namespace tqkv {
namespace cuda_test {
namespace {

// Centering and exact sink/recent tokens through the real cache on each
// backend: keys with a large shared component, a prefill, a fork, decode
// steps (one and three causal query tokens) that move the recent tokens across
// page boundaries; Attend (outputs and lse) and Score after every step.
struct Recipe {
  std::string preset;
  KeyCentering centering = KeyCentering::kNone;
  int sinks = 0;
  int recent = 0;
  // > 0: layer 0 is a sliding-window layer of this many tokens (layer 1 full).
  int sliding_window = 0;
  // Layer 1 rotates with a RoPE of its own (layer_ropes: base 1e6, half-split
  // pairs) while layer 0 keeps the cache's.
  bool layer_rope = false;
  // Per-channel key scales in [0.5, 2] (key_scales): queries staged times s.
  bool key_scales = false;
  // Key scales each sequence measures (sequence_key_scales): staged per item.
  bool sequence_key_scales = false;
  // Attend with this logit soft cap (AttendParams::logit_softcap), 0 none.
  float softcap = 0.0f;
};

std::string Describe(const Recipe& r) {
  const char* centering = r.centering == KeyCentering::kPreRope    ? "pre-RoPE"
                          : r.centering == KeyCentering::kPostRope ? "post-RoPE"
                                                                   : "no centering";
  return r.preset + ", " + centering + ", sinks " + std::to_string(r.sinks) + ", recent " + std::to_string(r.recent) +
         ", sliding window " + std::to_string(r.sliding_window) + (r.layer_rope ? ", layer 1's own RoPE" : "") +
         (r.key_scales ? ", key scales" : "") + (r.sequence_key_scales ? ", sequence key scales" : "") +
         (r.softcap > 0 ? ", softcap " + std::to_string(r.softcap) : "");
}

CacheOptions RecipeOptions(const Recipe& r) {
  CacheOptions options;
  KvLayoutOptions& o = options.layout;
  o.num_layers = 2;
  o.num_kv_heads = 2;
  o.num_query_heads = 8;
  o.head_dim = 64;
  o.page_tokens = 16;
  o.preset = r.preset;
  o.boundary_layers = 0;
  o.key_centering = r.centering;
  o.rope.base = 10000.0;
  o.centering_tokens = 24;
  o.centering_pairs = 6;
  o.exact_sink_tokens = r.sinks;
  o.exact_recent_tokens = r.recent;
  if (r.sliding_window > 0) o.layer_windows = {r.sliding_window, 0};
  if (r.layer_rope) {
    o.layer_ropes.assign(2, RopeOptions());
    o.layer_ropes[1].base = 1e6;
    o.layer_ropes[1].pair_layout = RopePairLayout::kHalfSplit;
  }
  if (r.key_scales) {
    o.key_scales.resize(static_cast<size_t>(o.num_layers) * o.num_kv_heads * o.head_dim);
    for (size_t i = 0; i < o.key_scales.size(); ++i) o.key_scales[i] = std::exp2(std::sin(0.7 * i));
  }
  o.sequence_key_scales = r.sequence_key_scales;
  options.memory_budget_bytes = size_t{8} << 20;
  return options;
}

// Keys around a shared per-(layer, head) vector, as a model's are.
std::vector<float> SharedKeys(int layers, int tokens, int heads, int d, uint64_t seed) {
  std::vector<float> keys = Gaussian(static_cast<size_t>(layers) * tokens * heads * d, seed);
  const std::vector<float> common = Gaussian(static_cast<size_t>(layers) * heads * d, 4242);
  for (int l = 0; l < layers; ++l) {
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < heads; ++h) {
        for (int j = 0; j < d; ++j) {
          keys[((static_cast<size_t>(l) * tokens + t) * heads + h) * d + j] +=
              3.0f * common[(static_cast<size_t>(l) * heads + h) * d + j];
        }
      }
    }
  }
  return keys;
}

class RecipeRun {
 public:
  RecipeRun(const Recipe& recipe, Backend* cpu, Backend* gpu, double attend_tolerance)
      : options_(RecipeOptions(recipe)), tolerance_(attend_tolerance), softcap_(recipe.softcap) {
    auto on_cpu = KvCache::Create(options_, cpu);
    auto on_gpu = KvCache::Create(options_, gpu);
    EXPECT_TRUE(on_cpu.ok()) << on_cpu.status();
    EXPECT_TRUE(on_gpu.ok()) << on_gpu.status();
    if (on_cpu.ok()) cpu_ = std::move(*on_cpu);
    if (on_gpu.ok()) gpu_ = std::move(*on_gpu);
  }
  bool ok() const { return cpu_ != nullptr && gpu_ != nullptr; }

  void Append(const std::string& id, int64_t start, int tokens, uint64_t seed) {
    const KvLayoutOptions& o = options_.layout;
    const std::vector<float> k = SharedKeys(o.num_layers, tokens, o.num_kv_heads, o.head_dim, seed);
    const std::vector<float> v = Gaussian(k.size(), seed + 1);
    AppendRequest r;
    r.sequence_id = id;
    r.start_position = start;
    r.layer_end = o.num_layers;
    r.num_tokens = tokens;
    r.keys = k.data();
    r.values = v.data();
    const absl::Status on_cpu = cpu_->Append(r);
    const absl::Status on_gpu = gpu_->Append(r);
    ASSERT_TRUE(on_cpu.ok()) << on_cpu;
    ASSERT_TRUE(on_gpu.ok()) << on_gpu;
  }

  void Fork(const std::string& parent, const std::string& child) {
    ASSERT_TRUE(cpu_->Fork(parent, child).ok());
    ASSERT_TRUE(gpu_->Fork(parent, child).ok());
  }

  // Attend with the last `query_tokens` tokens as queries (or placed at
  // `first` on), and Score over the whole layer and an inner range, on every
  // layer.
  void Compare(const std::string& id, int query_tokens, uint64_t seed, int64_t first = -1) {
    const KvLayoutOptions& o = options_.layout;
    const int qh = o.num_query_heads, d = o.head_dim;
    for (int layer = 0; layer < o.num_layers; ++layer) {
      const int64_t length = cpu_->GetSequence(id)->layer_tokens[layer];
      SCOPED_TRACE(id + " layer " + std::to_string(layer) + " length " + std::to_string(length) + ", " +
                   std::to_string(query_tokens) + " query tokens");
      const std::vector<float> q = Gaussian(static_cast<size_t>(query_tokens) * qh * d, seed + layer);
      std::vector<float> cpu_out(q.size()), gpu_out(q.size());
      std::vector<float> cpu_lse(static_cast<size_t>(query_tokens) * qh), gpu_lse(cpu_lse.size());
      AttendRequestItem item{id, layer, query_tokens, q.data(), cpu_out.data(), cpu_lse.data()};
      item.first_query_position = first;
      ASSERT_TRUE(cpu_->Attend({&item, 1}, 0.0f, softcap_).ok());
      item.output = gpu_out.data();
      item.lse = gpu_lse.data();
      const absl::Status status = gpu_->Attend({&item, 1}, 0.0f, softcap_);
      ASSERT_TRUE(status.ok()) << status;
      ExpectClose(gpu_out, cpu_out, tolerance_, "attend output");
      ExpectClose(gpu_lse, cpu_lse, tolerance_, "attend lse");
      if (softcap_ > 0.0f) ExpectTheCapBites(item, cpu_out, cpu_lse);
      // A sliding-window layer's Score starts at the oldest token it holds.
      const int64_t held = cpu_->GetSequence(id)->layer_held_begin[layer];
      for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, length}, {length / 3, length - 2}}) {
        begin = std::max(begin, held);
        if (begin >= end) continue;
        std::vector<float> cpu_logits(static_cast<size_t>(qh) * (end - begin)), gpu_logits(cpu_logits.size());
        ASSERT_TRUE(cpu_->Score(id, layer, begin, end, q.data(), cpu_logits.data()).ok());
        const absl::Status scored = gpu_->Score(id, layer, begin, end, q.data(), gpu_logits.data());
        ASSERT_TRUE(scored.ok()) << scored;
        ExpectClose(gpu_logits, cpu_logits, kFp32Tolerance,
                    "score [" + std::to_string(begin) + ", " + std::to_string(end) + ")");
      }
    }
  }

 private:
  // The CPU's attention without the cap must differ from the capped one by
  // far more than the tolerance: else the comparison says nothing of it.
  void ExpectTheCapBites(AttendRequestItem item, const std::vector<float>& capped_out,
                         const std::vector<float>& capped_lse) {
    std::vector<float> out(capped_out.size()), lse(capped_lse.size());
    item.output = out.data();
    item.lse = lse.data();
    ASSERT_TRUE(cpu_->Attend({&item, 1}).ok());
    double lse_moved = 0.0;
    for (size_t i = 0; i < lse.size(); ++i) lse_moved = std::max(lse_moved, std::fabs(double{lse[i]} - capped_lse[i]));
    EXPECT_GT(lse_moved, 20 * tolerance_) << "the soft cap hardly changes the lse";
  }

  CacheOptions options_;
  double tolerance_;
  float softcap_;
  std::unique_ptr<KvCache> cpu_, gpu_;
};

void RunRecipe(const Recipe& recipe, Backend* cpu, Backend* gpu, double tolerance) {
  SCOPED_TRACE(Describe(recipe));
  RecipeRun run(recipe, cpu, gpu, tolerance);
  ASSERT_TRUE(run.ok());
  run.Append("seq", 0, 37, 1);
  run.Compare("seq", 1, 100);
  run.Fork("seq", "seq/child");
  int64_t length = 37;
  // Decode steps: the recent tokens move over the page boundaries at 48 and 64.
  for (int step = 0; step < 6; ++step) {
    const int tokens = step % 3 == 1 ? 3 : 1 + step;
    run.Append("seq", length, tokens, 10 + step);
    length += tokens;
    run.Compare("seq", std::min(tokens, 3), 200 + step);
    if (::testing::Test::HasFatalFailure()) return;
  }
  run.Append("seq/child", 37, 4, 50);
  run.Compare("seq/child", 4, 300);
  // Queries placed over the stored tokens: straddling their end, and a
  // prefill of new tokens after them (past a sliding window: none seen).
  run.Compare("seq", 5, 400, length - 2);
  run.Compare("seq", 9, 500, length + 3);
}

// RunRecipe through the fp32 kernels, then through the tensor-core one.
void RunRecipeBothKernels(const Recipe& recipe, Backend* cpu, Backend* gpu_fp32, Backend* gpu) {
  {
    SCOPED_TRACE("fp32 kernels");
    RunRecipe(recipe, cpu, gpu_fp32, kFp32Tolerance);
  }
  SCOPED_TRACE("tensor-core decode");
  RunRecipe(recipe, cpu, gpu, kTensorCoreTolerance);
}

std::vector<Recipe> Recipes() {
  std::vector<Recipe> recipes;
  for (const char* preset : {"turboquant_k3v4_nc", "turboquant_3bit_nc", "tqkv_k3v4", "fp16"}) {
    for (KeyCentering centering : {KeyCentering::kNone, KeyCentering::kPreRope, KeyCentering::kPostRope}) {
      recipes.push_back({preset, centering, 0, 0});
      recipes.push_back({preset, centering, 4, 20});
    }
  }
  return recipes;
}

TEST_F(CudaBackendTest, CenteringAndExactTokensMatchTheCpuThroughTheCache) {
  for (const Recipe& recipe : Recipes()) {
    EXPECT_TRUE(gpu_->SupportsLayout(**KvLayout::Create(RecipeOptions(recipe).layout)).ok());
    RunRecipeBothKernels(recipe, cpu_, gpu_fp32_, gpu_);
  }
}

// Sliding-window layers: each query token masked to its own window (also
// the causal multi-token steps), pages given back, with and without exact
// tokens and centering.
TEST_F(CudaBackendTest, SlidingWindowLayersMatchTheCpuThroughTheCache) {
  for (const Recipe& recipe :
       {Recipe{"turboquant_k3v4_nc", KeyCentering::kNone, 0, 0, 20}, Recipe{"fp16", KeyCentering::kNone, 0, 0, 7},
        Recipe{"turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 20, 24},
        Recipe{"tqkv_k3v4", KeyCentering::kPostRope, 2, 8, 33}}) {
    RunRecipeBothKernels(recipe, cpu_, gpu_fp32_, gpu_);
  }
}

// Per-layer RoPEs (layer_ropes): each layer's add-back with its own
// frequencies; key scales (key_scales): stored keys read with q * s, the
// add-back with q; against the CPU's.
TEST_F(CudaBackendTest, LayerRopesAndKeyScalesMatchTheCpuThroughTheCache) {
  for (const Recipe& recipe : {Recipe{"turboquant_k3v4_nc", KeyCentering::kPreRope, 0, 0, 0, true},
                               Recipe{"tqkv_k3v4", KeyCentering::kPreRope, 4, 20, 0, true},
                               Recipe{"turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 20, 24, true},
                               Recipe{"turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 20, 0, true, true},
                               Recipe{"tqkv_k3v4", KeyCentering::kPostRope, 2, 8, 0, false, true},
                               Recipe{"fp16", KeyCentering::kPreRope, 0, 0, 33, false, true},
                               Recipe{"turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 20, 24, true, false, true},
                               Recipe{"tqkv_k3v4", KeyCentering::kPostRope, 2, 8, 0, false, false, true}}) {
    RunRecipeBothKernels(recipe, cpu_, gpu_fp32_, gpu_);
  }
}

// Logit soft-capping (Gemma 2): applied to the whole logit in both decode
// kernels, with the add-back's constant part (centering), exact tokens and
// a sliding window; a cap small enough to change every row's softmax.
TEST_F(CudaBackendTest, SoftCappedLogitsMatchTheCpuThroughTheCache) {
  for (Recipe recipe :
       {Recipe{"turboquant_k3v4_nc", KeyCentering::kPreRope, 4, 20, 24},
        Recipe{"tqkv_k3v4", KeyCentering::kPostRope, 2, 8}, Recipe{"fp16", KeyCentering::kNone, 0, 0}}) {
    recipe.softcap = 2.0f;
    RunRecipeBothKernels(recipe, cpu_, gpu_fp32_, gpu_);
  }
}

// Recent tokens covering the whole context, and sinks only.
TEST_F(CudaBackendTest, ExactTokensCoveringTheContextOrOnlySinksMatchTheCpu) {
  for (const Recipe& recipe :
       {Recipe{"turboquant_k3v4_nc", KeyCentering::kPreRope, 2, 200},
        Recipe{"tqkv_k3v4", KeyCentering::kPostRope, 8, 0}, Recipe{"turboquant_3bit_nc", KeyCentering::kNone, 0, 5}}) {
    RunRecipeBothKernels(recipe, cpu_, gpu_fp32_, gpu_);
  }
}

// The pre-RoPE add-back at positions up to ~1e6 (t * theta ~ 1e6 rad): the
// CPU's Score computes it in double; the device reduces the angle in double.
// A long block table over a few stored pages (the same pages repeated) makes
// such positions cheap.
// centering_pairs 0 keeps every pair (the per-token add-back); 8, the
// server's default, takes the fp16 tensor-core kernel's mma add-back, whose
// rotated features are re-anchored every 1024 tokens.
void CheckAddBackAtLargePositions(Backend* cpu, Backend* gpu_fp32, Backend* gpu, int centering_pairs) {
  KvLayoutOptions o;
  o.num_layers = 1;
  o.num_kv_heads = 1;
  o.num_query_heads = 2;
  o.head_dim = 64;
  o.page_tokens = 16;
  o.preset = "turboquant_k3v4_nc";
  o.boundary_layers = 0;
  o.key_centering = KeyCentering::kPreRope;
  o.rope.base = 10000.0;
  o.centering_pairs = centering_pairs;  // 0: every pair, theta up to 1 rad
  auto layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const int d = 64, qh = 2, stored_pages = 8, stored = stored_pages * 16;
  const int64_t length = 1000003;
  for (Backend* device : {gpu_fp32, gpu}) {
    auto cpu_pool = cpu->AllocatePool(**layout, stored_pages);
    auto gpu_pool = device->AllocatePool(**layout, stored_pages);
    ASSERT_TRUE(cpu_pool.ok() && gpu_pool.ok());
    const std::vector<float> keys = Gaussian(static_cast<size_t>(stored) * d, 5);
    const std::vector<float> values = Gaussian(keys.size(), 6);
    std::vector<int32_t> slots(stored);
    std::iota(slots.begin(), slots.end(), 0);
    ASSERT_TRUE(cpu->Store({layout->get(), *cpu_pool, 0, 1, stored, slots.data(), keys.data(), values.data()}).ok());
    ASSERT_EQ(cudaMemcpy(gpu_pool->base, cpu_pool->base, cpu_pool->page_bytes * stored_pages, cudaMemcpyHostToDevice),
              cudaSuccess);
    std::vector<int32_t> table((length + 15) / 16);
    for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>((i * 5) % stored_pages);
    std::vector<float> mean = Gaussian(d, 8);
    for (float& m : mean) m *= 4.0f;
    const std::vector<float> q = Gaussian(static_cast<size_t>(qh) * d, 9);
    const float scale = 0.125f;
    for (int64_t begin : {int64_t{0}, int64_t{199990}, length - 400}) {
      const int64_t end = std::min(length, begin + 400);
      std::vector<float> cpu_logits(static_cast<size_t>(qh) * (end - begin)), gpu_logits(cpu_logits.size());
      ScoreParams s{layout->get(), *cpu_pool, 0, table.data(), begin, end, q.data(), scale, cpu_logits.data()};
      s.key_mean = mean.data();
      s.length = length;
      ASSERT_TRUE(cpu->Score(s).ok());
      s.pool = *gpu_pool;
      s.logits = gpu_logits.data();
      ASSERT_TRUE(device->Score(s).ok());
      ExpectClose(gpu_logits, cpu_logits, kFp32Tolerance, "logits from " + std::to_string(begin));
    }
    // Attend over the whole context (shorter on the emulated device).
    const int64_t context = kEmulated ? 100000 : length;
    std::vector<float> cpu_out(q.size()), gpu_out(q.size()), cpu_lse(qh), gpu_lse(qh);
    AttendItem item{table.data(), context, 0, 1, q.data(), cpu_out.data(), cpu_lse.data()};
    item.key_mean = mean.data();
    ASSERT_TRUE(cpu->Attend(AttendParams{layout->get(), *cpu_pool, {&item, 1}, scale}).ok());
    item.output = gpu_out.data();
    item.lse = gpu_lse.data();
    ASSERT_TRUE(device->Attend(AttendParams{layout->get(), *gpu_pool, {&item, 1}, scale}).ok());
    const double tolerance = device == gpu ? kTensorCoreTolerance : kFp32Tolerance;
    ExpectClose(gpu_out, cpu_out, tolerance, "attend output");
    ExpectClose(gpu_lse, cpu_lse, tolerance, "attend lse");
    cpu->FreePool(*cpu_pool);
    device->FreePool(*gpu_pool);
  }
}

TEST_F(CudaBackendTest, PreRopeAddBackIsExactAtLargePositions) {
  for (int pairs : {0, 8}) {
    SCOPED_TRACE("centering pairs " + std::to_string(pairs));
    CheckAddBackAtLargePositions(cpu_, gpu_fp32_, gpu_, pairs);
  }
}

}  // namespace
}  // namespace cuda_test
}  // namespace tqkv
