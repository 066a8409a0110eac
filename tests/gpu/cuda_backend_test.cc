// The CUDA backend against the CPU backend, the reference, page by page:
//  * Store writes the bytes the CPU writes. Randomized Hadamard head dims must
//    match exactly but for at most 1 vector in 10^3 (ties at an exact
//    midpoint, or the sign of a zero); dense-rotation dims, where the CPU's
//    AVX-512 path sums in another order with FMA, may differ in at most 2% of
//    vectors. Each case prints its count. Apart from those vectors the pools
//    are equal byte for byte, so the device lays codes out as the CPU does
//    (tiled planes, kernels/code_tiles.h, with partial tiles and tail bytes).
//  * Score and Attend on the same pages (CPU-written bytes copied to the
//    device, so only the read kernels are compared) agree within 2e-4
//    relative for the fp32 kernels (other summation order) and 5e-3 for the
//    tensor-core decode kernel (TF32 operands; 1.8e-3 seen), with no NaN.
// across presets, head dims, page sizes, GQA ratios, query counts, several
// items and layers per call, and workspaces small enough to split requests;
// and the cache's bookkeeping over the CUDA backend. The recipes (centering,
// exact tokens, sliding windows) are in cuda_recipe_test.cc, a lost device
// and the runtime calls of a decode layer in cuda_faults_test.cc; the
// fixtures in cuda_backend_test_util.h.
// Every test skips where no CUDA device is present. Built as
// gpu_emulation_test (TQKV_CUDA_EMULATION), the same tests run on the emulated
// device of kernels/cuda/emulation/ with fewer tokens.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/device_tables.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"
#include "tests/gpu/cuda_backend_test_util.h"

namespace tqkv {
namespace cuda_test {
namespace {

std::vector<std::string> ServingPresets() {
  std::vector<std::string> names;
  for (const Preset& p : AllPresets()) {
    if (!p.evaluation_only) names.emplace_back(p.name);
  }
  return names;
}

// Every served preset's layers take the fp16 tensor-core kernel at head
// dims 64, 128 and 256 on pages of 16 tokens (the kernel choice is host
// code: no device needed); split keys with hot channels that are not the
// first ones.
TEST(CudaKernelChoice, EveryServedPresetTakesTheFp16TensorCoreKernel) {
  for (const std::string& name : ServingPresets()) {
    for (int d : {64, 128, 256}) {
      KvLayoutOptions options;
      options.num_layers = 2;
      options.num_kv_heads = 2;
      options.num_query_heads = 8;
      options.head_dim = d;
      options.page_tokens = 16;
      options.preset = name;
      options.boundary_layers = 0;
      const Preset* preset = *FindPreset(name);
      if (preset->NeedsCalibration()) {
        std::vector<int> odd;
        for (int k = 1; k < d && static_cast<int>(odd.size()) < preset->key.HotChannels(d); k += 2) odd.push_back(k);
        options.hot_channels.assign(4, odd);
      }
      auto layout = KvLayout::Create(options);
      ASSERT_TRUE(layout.ok()) << layout.status();
      cuda::TableBuilder tables;
      std::vector<cuda::DeviceHead> heads;
      cuda::LayoutTables chosen;
      ASSERT_TRUE(cuda::DescribeLayout(**layout, /*tensor_cores=*/true, tables, &heads, &chosen).ok());
      for (int layer = 0; layer < 2; ++layer) {
        EXPECT_GE(chosen.layer_hmma[layer], 0) << name << " d=" << d << " layer " << layer;
      }
    }
  }
}

TEST_F(CudaBackendTest, StoreWritesTheCpuBytesForEveryPreset) {
  for (const std::string& preset : ServingPresets()) {
    int total = 0;
    const int differing = CompareStore({preset, 128, 16, 2, 8}, Tokens(300), &total);
    EXPECT_LE(differing, total / 1000) << preset;
  }
}

TEST_F(CudaBackendTest, StoreWritesTheCpuBytesForEveryHeadDimAndPageSize) {
  for (int d : {64, 80, 96, 112, 160, 192, 256}) {
    for (const char* preset : {"turboquant_k3v4_nc", "tqkv_k3v3", "tqkv_k2p5v3", "turboquant_k8v4"}) {
      int total = 0;
      const int differing = CompareStore({preset, d, 16, 2, 4}, Tokens(200), &total);
      EXPECT_LE(differing, total / 1000) << preset << " d=" << d;
    }
  }
  for (int page : {1, 5, 16, 64}) {
    int total = 0;
    const int differing = CompareStore({"turboquant_3bit_nc", 128, page, 2, 4}, Tokens(150), &total);
    EXPECT_LE(differing, total / 1000) << "page " << page;
  }
  // 104 = 8 * 13 has no Hadamard form: a dense rotation.
  int total = 0;
  const int differing = CompareStore({"tqkv_k3v4", 104, 16, 2, 4}, Tokens(200), &total);
  EXPECT_LE(differing, total / 50);
}

// Tiled code planes at their edges: partial tiles (pages of 7 tokens, and of
// 24 = 16 + 8), bytes past the last whole word (d = 80: 30 bytes of 3-bit
// codes; split keys whose second part starts inside a word), pages left
// partly empty, next to raw fp8 keys (token-major). The device's pools equal
// the CPU's byte for byte (CompareStore), and Score and Attend read them as
// the CPU does; d = 64 takes the tensor-core kernel, whose per-lane runs of
// 3-bit codes start inside words.
TEST_F(CudaBackendTest, TiledPlanesWithPartialTilesAndTailBytesMatchTheCpu) {
  const int tokens = 69;  // a partly filled last page for both page sizes
  for (int page : {7, 24}) {
    for (const char* preset : {"turboquant_3bit_nc", "tqkv_k3v3", "tqkv_k2p5v3", "turboquant_k8v4"}) {
      const Case c{preset, 80, page, 2, 4};
      int total = 0;
      const int differing = CompareStore(c, tokens, &total);
      EXPECT_LE(differing, total / 1000) << Describe(c);
      CompareReadsBothKernels(c, tokens, {1, 3});
    }
    for (const char* preset : {"turboquant_3bit_nc", "tqkv_k3v3"}) {
      const Case c{preset, 64, page, 2, 4};
      int total = 0;
      const int differing = CompareStore(c, tokens, &total);
      EXPECT_LE(differing, total / 1000) << Describe(c);
      CompareReadsBothKernels(c, tokens, {1, 2});
    }
  }
}

TEST_F(CudaBackendTest, ScoreAndAttendMatchTheCpuForEveryPreset) {
  for (const std::string& preset : ServingPresets()) CompareReadsBothKernels({preset, 128, 16, 2, 8}, 333, {1, 3});
}

TEST_F(CudaBackendTest, ScoreAndAttendMatchTheCpuAcrossShapes) {
  for (int d : {64, 80, 96, 192, 256}) CompareReadsBothKernels({"turboquant_k3v4_nc", d, 16, 2, 4}, 200, {1, 2});
  // TurboQuant values on the fp16 kernel at its other head dims; bf16 at
  // 256 (its values loaded after the logits).
  for (int d : {64, 256}) CompareReadsBothKernels({"tqkv_k3v3", d, 16, 2, 4}, 200, {1, 2});
  CompareReadsBothKernels({"bf16", 256, 16, 2, 4}, 200, {1, 2});
  // Split keys on the fp16 kernel (two key parts, three pair tables a warp)
  // at its other head dims; the general loop on pages of several tiles.
  for (int d : {64, 256}) {
    for (const char* preset : {"tqkv_k3p5v3", "tqkv_k2p5v3"})
      CompareReadsBothKernels({preset, d, 16, 2, 4}, 200, {1, 2});
  }
  CompareReadsBothKernels({"tqkv_k2p5v3", 128, 48, 2, 4}, Tokens(1000), {1, 3});
  for (int page : {1, 7, 64}) CompareReadsBothKernels({"tqkv_k3v3", 128, page, 2, 4}, 300, {1});
  // The fp16 kernel's general loop: pages of several tiles (48: not a power
  // of two), splits that start inside a page.
  for (int page : {48, 64}) CompareReadsBothKernels({"turboquant_3bit_nc", 128, page, 2, 4}, Tokens(3000), {1, 3});
  // GQA 1, 3, 8 and 16 (two row chunks of 8), several query tokens, more
  // than a piece's 32 query tokens.
  for (int qh : {2, 6, 16, 32}) CompareReadsBothKernels({"turboquant_4bit_nc", 64, 16, 2, qh}, 180, {1, 5});
  CompareReadsBothKernels({"tqkv_k4v4", 64, 8, 1, 2}, 120, {40});
  // Boundary layers: fp16 and TurboQuant layers in one call.
  CompareReadsBothKernels({"turboquant_3bit_nc", 128, 16, 2, 8, 4, 1}, 150, {1, 2});
  // Long enough for many splits per item.
  CompareReadsBothKernels({"turboquant_k3v4_nc", 128, 16, 8, 32, 1}, Tokens(20000), {1});
}

TEST_F(CudaBackendTest, SmallWorkspacesSplitEveryRequest) {
  CudaBackendOptions options;
  options.workspaces = 1;
  options.workspace_bytes = size_t{1} << 20;
  auto small = MakeCudaBackend(options);
  ASSERT_TRUE(small.ok()) << small.status();
  // Store: 2 layers x 2000 tokens x 8 heads x 128 floats x 2 = 32 MiB in
  // (a quarter emulated): many pieces of a 1 MiB workspace.
  int total = 0;
  const int differing = CompareStore({"turboquant_k3v4_nc", 128, 16, 8, 32}, Tokens(2000), &total, small->get());
  EXPECT_LE(differing, total / 1000);
  CompareReads({"turboquant_k3v4_nc", 128, 16, 8, 32}, Tokens(3000), {1, 4, 40}, small->get(), kTensorCoreTolerance);
}

TEST_F(CudaBackendTest, ConcurrentCallsGiveTheSerialResults) {
  const int tokens = Tokens(2000);
  Fixture f({"turboquant_3bit_nc", 128, 16, 8, 32, 1}, tokens, cpu_, gpu_);
  f.Build();
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(gpu_->Store(f.Store(f.gpu_pool())).ok());
  const int d = 128, qh = 32;
  const std::vector<float> q = Gaussian(static_cast<size_t>(qh) * d, 9);
  std::vector<float> expected(q.size());
  AttendItem item{f.block_table().data(), tokens, 0, 1, q.data(), expected.data(), nullptr};
  ASSERT_TRUE(gpu_->Attend(AttendParams{&f.layout(), f.gpu_pool(), {&item, 1}, 0.088f}).ok());
  std::vector<std::vector<float>> outs(kEmulated ? 3 : 8, std::vector<float>(q.size()));
  std::vector<std::thread> threads;
  std::vector<absl::Status> statuses(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    threads.emplace_back([&, i] {
      for (int repeat = 0; repeat < (kEmulated ? 2 : 5); ++repeat) {
        AttendItem mine{f.block_table().data(), tokens, 0, 1, q.data(), outs[i].data(), nullptr};
        statuses[i] = gpu_->Attend(AttendParams{&f.layout(), f.gpu_pool(), {&mine, 1}, 0.088f});
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < outs.size(); ++i) {
    EXPECT_TRUE(statuses[i].ok()) << statuses[i];
    EXPECT_EQ(outs[i], expected) << "thread " << i;  // same plan, same order: bit for bit
  }
}

TEST_F(CudaBackendTest, CopyPageCopiesWholePages) {
  Fixture f({"tqkv_k3v4", 128, 16, 2, 4}, 40, cpu_, gpu_);
  f.Build();
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(gpu_->Store(f.Store(f.gpu_pool())).ok());
  const int from = f.block_table()[0], to = f.block_table()[4];
  ASSERT_TRUE(gpu_->CopyPage(f.gpu_pool(), from, to).ok());
  const std::vector<uint8_t> bytes = f.DevicePoolBytes();
  const size_t page = f.gpu_pool().page_bytes;
  EXPECT_TRUE(std::equal(bytes.begin() + from * page, bytes.begin() + (from + 1) * page, bytes.begin() + to * page));
  EXPECT_EQ(gpu_->CopyPage(f.gpu_pool(), 0, 1 << 20).code(), absl::StatusCode::kInvalidArgument);
}

// Store, Score and Attend report their kernels' device time (CUDA events)
// and their wait for a workspace, apart; the values are not checked (timing
// belongs to benchmarks), only that they were measured.
TEST_F(CudaBackendTest, CallsReportDeviceTimeAndWaitApart) {
  Fixture f({"turboquant_k3v4_nc", 64, 16, 2, 4}, 40, cpu_, gpu_);
  f.Build();
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(gpu_->Store(f.Store(f.gpu_pool())).ok());
  CallTiming timing = gpu_->LastCallTiming();
  EXPECT_GE(timing.device_seconds, 0.0);
  EXPECT_GE(timing.wait_seconds, 0.0);
  std::vector<float> query(4 * 64, 0.5f), output(query.size());
  AttendItem item{f.block_table().data(), 40, 0, 1, query.data(), output.data(), nullptr};
  ASSERT_TRUE(gpu_->Attend(AttendParams{&f.layout(), f.gpu_pool(), {&item, 1}, 0.125f}).ok());
  timing = gpu_->LastCallTiming();
  EXPECT_GE(timing.device_seconds, 0.0);
  EXPECT_GE(timing.wait_seconds, 0.0);
  // Another thread's calls are its own.
  std::thread([&] { EXPECT_LT(gpu_->LastCallTiming().device_seconds, 0.0); }).join();
}

TEST_F(CudaBackendTest, BadInputAndUnsupportedLayoutsAreStatuses) {
  Fixture f({"turboquant_k3v4_nc", 64, 16, 2, 4}, 20, cpu_, gpu_);
  f.Build();
  ASSERT_FALSE(HasFatalFailure());
  std::vector<float> keys(static_cast<size_t>(2) * 20 * 2 * 64, 0.5f), values(keys.size(), 0.25f);
  keys[(static_cast<size_t>(1 * 20 + 7) * 2 + 1) * 64 + 3] = NAN;  // layer 1, token 7, head 1
  std::vector<int32_t> slots(20);
  std::iota(slots.begin(), slots.end(), 0);
  StoreParams store{&f.layout(), f.gpu_pool(), 0, 2, 20, slots.data(), keys.data(), values.data()};
  const absl::Status status = gpu_->Store(store);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("layer 1, token 7, KV head 1"), std::string::npos) << status;

  for (const auto& [preset, d] : {std::pair<const char*, int>{"eval_qjl_k3v4", 128}, {"tqkv_k3v4", 100}}) {
    KvLayoutOptions options;
    options.num_layers = 1;
    options.num_kv_heads = 1;
    options.num_query_heads = 1;
    options.head_dim = d;
    options.preset = preset;
    options.boundary_layers = 0;
    auto layout = KvLayout::Create(options);
    ASSERT_TRUE(layout.ok()) << layout.status();
    // Asked first, on the host: the same refusal, before any allocation.
    EXPECT_EQ(gpu_->SupportsLayout(**layout).code(), absl::StatusCode::kUnimplemented) << preset;
    EXPECT_EQ(gpu_->AllocatePool(**layout, 4).status().code(), absl::StatusCode::kUnimplemented) << preset;
  }
  EXPECT_TRUE(gpu_->SupportsLayout(f.layout()).ok());
}

// The cache's bookkeeping over the CUDA backend: appends in pieces, a fork
// whose partial last page is copied on write, appends to both, attends and
// scores, against the same operations on the CPU backend.
TEST_F(CudaBackendTest, KvCacheOverTheCudaBackendMatchesTheCpu) {
  CacheOptions options;
  options.layout.num_layers = 3;
  options.layout.num_kv_heads = 2;
  options.layout.num_query_heads = 8;
  options.layout.head_dim = 128;
  options.layout.page_tokens = 16;
  options.layout.preset = "turboquant_k3v4_nc";
  options.layout.boundary_layers = 1;
  options.memory_budget_bytes = size_t{4} << 20;
  auto on_cpu = KvCache::Create(options, cpu_);
  auto on_gpu = KvCache::Create(options, gpu_);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
  const int d = 128, heads = 2, layers = 3, qh = 8;
  auto append = [&](KvCache& cache, const std::string& id, int64_t start, int tokens, uint64_t seed) {
    const std::vector<float> k = Gaussian(static_cast<size_t>(layers) * tokens * heads * d, seed);
    const std::vector<float> v = Gaussian(k.size(), seed + 1);
    AppendRequest r;
    r.sequence_id = id;
    r.start_position = start;
    r.layer_end = layers;
    r.num_tokens = tokens;
    r.keys = k.data();
    r.values = v.data();
    return cache.Append(r);
  };
  for (KvCache* cache : {on_cpu->get(), on_gpu->get()}) {
    ASSERT_TRUE(append(*cache, "parent", 0, 40, 1).ok());
    ASSERT_TRUE(append(*cache, "parent", 40, 3, 3).ok());
    ASSERT_TRUE(cache->Fork("parent", "parent/child").ok());
    ASSERT_TRUE(append(*cache, "parent/child", 43, 5, 5).ok());  // copies the shared partial page
    ASSERT_TRUE(append(*cache, "parent", 43, 2, 7).ok());
  }
  EXPECT_EQ((*on_gpu)->Stats().copy_on_writes, (*on_cpu)->Stats().copy_on_writes);
  EXPECT_GE((*on_gpu)->Stats().copy_on_writes, 1u);
  for (const char* id : {"parent", "parent/child"}) {
    for (int layer = 0; layer < layers; ++layer) {
      SCOPED_TRACE(std::string(id) + " layer " + std::to_string(layer));
      const std::vector<float> q = Gaussian(static_cast<size_t>(2) * qh * d, 11 + layer);
      std::vector<float> cpu_out(q.size()), gpu_out(q.size());
      AttendRequestItem item{id, layer, 2, q.data(), cpu_out.data(), nullptr};
      ASSERT_TRUE((*on_cpu)->Attend({&item, 1}).ok());
      item.output = gpu_out.data();
      ASSERT_TRUE((*on_gpu)->Attend({&item, 1}).ok());
      ExpectClose(gpu_out, cpu_out, kTensorCoreTolerance, "attend");
      const int64_t length = (*on_cpu)->GetSequence(id)->layer_tokens[layer];
      std::vector<float> cpu_logits(static_cast<size_t>(qh) * length), gpu_logits(cpu_logits.size());
      ASSERT_TRUE((*on_cpu)->Score(id, layer, 0, -1, q.data(), cpu_logits.data()).ok());
      ASSERT_TRUE((*on_gpu)->Score(id, layer, 0, -1, q.data(), gpu_logits.data()).ok());
      ExpectClose(gpu_logits, cpu_logits, kFp32Tolerance, "score");
    }
  }
}

TEST(CudaBackend, NamesItsDeviceOrSaysWhyNot) {
  auto gpu = MakeCudaBackend();
  if (!gpu.ok()) {
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kUnavailable) << gpu.status();
    GTEST_SKIP() << gpu.status();
  }
  EXPECT_EQ((*gpu)->name(), "cuda");
  EXPECT_NE((*gpu)->device().find("sm_"), std::string::npos) << (*gpu)->device();
}

}  // namespace
}  // namespace cuda_test
}  // namespace tqkv
