// The CUDA backend against the CPU backend, the reference:
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
// items and layers per call, and workspaces small enough to split requests.
//  * Key centering (pre- and post-RoPE) and exact sink/recent tokens through
//    the real cache on each backend (prefill, fork, decode steps moving the
//    recent tokens), and the pre-RoPE add-back at positions near 1e6, against the
//    CPU within the same tolerances.
// Every test skips where no CUDA device is present. Built as
// gpu_emulation_test (TQKV_CUDA_EMULATION), the same tests run on the emulated
// device of kernels/cuda/emulation/ with fewer tokens.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/code_tiles.h"
#include "kernels/codec.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/device.h"
#if TQKV_CUDA_EMULATION
#include "kernels/cuda/emulation/call_counts.h"
#include "kernels/cuda/emulation/fault_injection.h"
#endif
#include "kernels/kv_layout.h"
#include "kernels/preset.h"
#include "base/random.h"

namespace tqkv {
namespace {

#if TQKV_CUDA_EMULATION
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

// Relative agreement with the CPU: fp32 kernels, and the tensor-core decode
// kernel (TF32 operands: 10-bit mantissas).
constexpr double kFp32Tolerance = 2e-4;
constexpr double kTensorCoreTolerance = 5e-3;

// Token counts: full on a device, about a quarter on the emulated one.
int Tokens(int device_tokens) { return kEmulated ? std::max(24, device_tokens / 4) : device_tokens; }

struct Case {
  std::string preset;
  int head_dim = 128;
  int page_tokens = 16;
  int kv_heads = 2;
  int query_heads = 8;
  int layers = 2;
  int boundary_layers = 0;
};

std::string Describe(const Case& c) {
  return c.preset + " d=" + std::to_string(c.head_dim) + " page=" + std::to_string(c.page_tokens) +
         " kv=" + std::to_string(c.kv_heads) + " q=" + std::to_string(c.query_heads);
}

std::vector<float> Gaussian(size_t n, uint64_t seed) {
  Random rng(seed);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(rng.NextGaussian());
    if (i % 37 == 0) out[i] *= 8.0f;  // a few hot coordinates
    if (i % 53 == 0) out[i] += 3.0f;  // and offsets
  }
  return out;
}

// Data, layout, a shuffled block table and a pool on each backend.
class Fixture {
 public:
  Fixture(const Case& c, int tokens, Backend* cpu, Backend* gpu) : c_(c), tokens_(tokens), cpu_(cpu), gpu_(gpu) {}
  ~Fixture() {
    if (cpu_pool_.base != nullptr) cpu_->FreePool(cpu_pool_);
    if (gpu_pool_.base != nullptr) gpu_->FreePool(gpu_pool_);
  }

  void Build() {
    const int d = c_.head_dim, heads = c_.kv_heads;
    keys_ = Gaussian(static_cast<size_t>(c_.layers) * tokens_ * heads * d, 1 + d);
    values_ = Gaussian(keys_.size(), 2 + d);
    KvLayoutOptions options;
    options.num_layers = c_.layers;
    options.num_kv_heads = heads;
    options.num_query_heads = c_.query_heads;
    options.head_dim = d;
    options.page_tokens = c_.page_tokens;
    options.preset = c_.preset;
    options.boundary_layers = c_.boundary_layers;
    const Preset* preset = *FindPreset(c_.preset);
    if (preset->NeedsCalibration()) {
      for (int l = 0; l < c_.layers; ++l) {
        for (int h = 0; h < heads; ++h) {
          std::vector<float> head_keys;
          for (int t = 0; t < tokens_; ++t) {
            const float* k = &keys_[((static_cast<size_t>(l) * tokens_ + t) * heads + h) * d];
            head_keys.insert(head_keys.end(), k, k + d);
          }
          options.hot_channels.push_back(ChooseHotChannels(head_keys.data(), tokens_, d, preset->key.HotChannels(d)));
        }
      }
    }
    auto layout = KvLayout::Create(options);
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = *layout;
    pages_ = (tokens_ + c_.page_tokens - 1) / c_.page_tokens + 3;
    auto cpu_pool = cpu_->AllocatePool(*layout_, pages_);
    ASSERT_TRUE(cpu_pool.ok()) << cpu_pool.status();
    cpu_pool_ = *cpu_pool;
    auto gpu_pool = gpu_->AllocatePool(*layout_, pages_);
    ASSERT_TRUE(gpu_pool.ok()) << gpu_pool.status();
    gpu_pool_ = *gpu_pool;
    block_table_.resize(pages_);
    std::iota(block_table_.begin(), block_table_.end(), 0);
    Random rng(3);
    for (int i = pages_ - 1; i > 0; --i) std::swap(block_table_[i], block_table_[rng.NextBelow(i + 1)]);
    slots_.resize(tokens_);
    for (int t = 0; t < tokens_; ++t) {
      slots_[t] = block_table_[t / c_.page_tokens] * c_.page_tokens + t % c_.page_tokens;
    }
  }

  StoreParams Store(const PagePool& pool) const {
    return StoreParams{layout_.get(), pool, 0, c_.layers, tokens_, slots_.data(), keys_.data(), values_.data()};
  }

  std::vector<uint8_t> DevicePoolBytes() const {
    std::vector<uint8_t> bytes(gpu_pool_.page_bytes * static_cast<size_t>(pages_));
    EXPECT_EQ(cudaMemcpy(bytes.data(), gpu_pool_.base, bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return bytes;
  }

  // Every byte of both pools set to `byte` (the CPU's small pools start
  // uninitialised).
  void FillPools(uint8_t byte) const {
    const size_t bytes = cpu_pool_.page_bytes * static_cast<size_t>(pages_);
    std::memset(cpu_pool_.base, byte, bytes);
    ASSERT_EQ(cudaMemset(gpu_pool_.base, byte, bytes), cudaSuccess);
  }

  // The CPU's bytes onto the device: both backends then read the same pages.
  void CopyCpuPagesToDevice() const {
    ASSERT_EQ(cudaMemcpy(gpu_pool_.base, cpu_pool_.base, gpu_pool_.page_bytes * static_cast<size_t>(pages_),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }

  const Case& c() const { return c_; }
  int tokens() const { return tokens_; }
  const KvLayout& layout() const { return *layout_; }
  const PagePool& cpu_pool() const { return cpu_pool_; }
  const PagePool& gpu_pool() const { return gpu_pool_; }
  const std::vector<int32_t>& block_table() const { return block_table_; }

 private:
  Case c_;
  int tokens_;
  Backend* cpu_;
  Backend* gpu_;
  std::shared_ptr<const KvLayout> layout_;
  int pages_ = 0;
  PagePool cpu_pool_;
  PagePool gpu_pool_;
  std::vector<float> keys_, values_;
  std::vector<int32_t> block_table_, slots_;
};

void ExpectClose(const std::vector<float>& gpu, const std::vector<float>& cpu, double relative,
                 const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size());
  double scale = 0.0;
  for (float v : cpu) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  size_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    ASSERT_FALSE(std::isnan(gpu[i])) << what << " [" << i << "] is NaN";
    const double error = std::fabs(static_cast<double>(gpu[i]) - cpu[i]);
    worst = std::max(worst, error);
    if (error > relative * (scale + 1e-3)) ++bad;
  }
  EXPECT_EQ(bad, 0u) << what << ": worst error " << worst << " against a scale of " << scale;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cpu_ = MakeCpuBackend(2).release();
    auto gpu = MakeCudaBackend();
    if (gpu.ok()) {
      gpu_ = gpu->release();
      CudaBackendOptions fp32;
      fp32.tensor_cores = false;
      gpu_fp32_ = MakeCudaBackend(fp32)->release();
    } else {
      why_ = std::string(gpu.status().message());
    }
  }
  static void TearDownTestSuite() {
    delete gpu_;
    delete gpu_fp32_;
    delete cpu_;
    gpu_ = gpu_fp32_ = cpu_ = nullptr;
  }

  // The reads through the fp32 kernels and through the tensor-core kernel.
  static void CompareReadsBothKernels(const Case& c, int tokens, const std::vector<int>& query_counts) {
    {
      SCOPED_TRACE("fp32 kernels");
      CompareReads(c, tokens, query_counts, gpu_fp32_);
    }
    SCOPED_TRACE("tensor-core decode");
    CompareReads(c, tokens, query_counts, gpu_, kTensorCoreTolerance);
  }
  void SetUp() override {
    if (gpu_ == nullptr) GTEST_SKIP() << "no CUDA device: " << why_;
  }

  // Stores on both and compares each (layer, head, token) vector: its codes,
  // gathered through the plane's layout (kernels/code_tiles.h), and its
  // scalars. Then the whole pools byte for byte, the differing vectors' bytes
  // taken from the device: every code byte sits where the CPU puts it and
  // nothing else was written. Returns the number of vectors that differ.
  static int CompareStore(const Case& c, int tokens, int* total, Backend* gpu = gpu_) {
    Fixture f(c, tokens, cpu_, gpu);
    f.Build();
    if (::testing::Test::HasFatalFailure()) return -1;
    f.FillPools(0x5a);  // not zeros: a stray write of zeros shows too
    if (::testing::Test::HasFatalFailure()) return -1;
    EXPECT_TRUE(cpu_->Store(f.Store(f.cpu_pool())).ok());
    const absl::Status status = gpu->Store(f.Store(f.gpu_pool()));
    EXPECT_TRUE(status.ok()) << status;
    const std::vector<uint8_t> device = f.DevicePoolBytes();
    const uint8_t* host = f.cpu_pool().base;
    std::vector<uint8_t> expected(host, host + device.size());
    const KvLayout& layout = f.layout();
    int differing = 0;
    *total = 0;
    for (int layer = 0; layer < c.layers; ++layer) {
      for (int head = 0; head < c.kv_heads; ++head) {
        const KvLayout::HeadPlanes& planes = layout.planes(layer, head);
        const struct {
          size_t codes;
          CodePlane plane;
          size_t scalars;
          int scalar_bytes;
        } fields[] = {{planes.key_codes, layout.key_code_plane(layer, head), planes.key_scalars,
                       2 * layout.key_codec(layer, head).num_scalars()},
                      {planes.value_codes, layout.value_code_plane(layer, head), planes.value_scalars,
                       2 * layout.value_codec(layer, head).num_scalars()}};
        for (int t = 0; t < tokens; ++t) {
          const size_t page = static_cast<size_t>(f.block_table()[t / c.page_tokens]) * layout.page_bytes();
          const int slot = t % c.page_tokens;
          bool same = true;
          std::vector<uint8_t> cpu_codes[2], gpu_codes[2];
          for (int i = 0; i < 2; ++i) {
            const auto& field = fields[i];
            cpu_codes[i].resize(field.plane.code_bytes);
            gpu_codes[i].resize(field.plane.code_bytes);
            GatherCodes(host + page + field.codes, field.plane, slot, cpu_codes[i].data());
            GatherCodes(device.data() + page + field.codes, field.plane, slot, gpu_codes[i].data());
            const size_t scalars = page + field.scalars + static_cast<size_t>(slot) * field.scalar_bytes;
            same = same && cpu_codes[i] == gpu_codes[i] &&
                   std::equal(host + scalars, host + scalars + field.scalar_bytes, device.data() + scalars);
          }
          if (!same) {
            ++differing;
            for (int i = 0; i < 2; ++i) {
              const auto& field = fields[i];
              ScatterCodes(gpu_codes[i].data(), field.plane, slot, expected.data() + page + field.codes);
              const size_t scalars = page + field.scalars + static_cast<size_t>(slot) * field.scalar_bytes;
              std::copy(device.data() + scalars, device.data() + scalars + field.scalar_bytes,
                        expected.data() + scalars);
            }
          }
          ++*total;
        }
      }
    }
    const auto mismatch = std::mismatch(expected.begin(), expected.end(), device.begin());
    if (mismatch.first != expected.end()) {
      const size_t at = mismatch.first - expected.begin();
      ADD_FAILURE() << Describe(c) << ": the device's pool differs from the CPU's at page " << at / layout.page_bytes()
                    << ", byte " << at % layout.page_bytes() << " (outside the vectors counted as differing)";
    }
    std::printf("  store %-40s %d of %d vectors differ\n", Describe(c).c_str(), differing, *total);
    return differing;
  }

  // Score and Attend through both backends on the CPU's pages; Attend's
  // outputs within `attend_tolerance` (relative to the largest).
  static void CompareReads(const Case& c, int tokens, const std::vector<int>& query_counts, Backend* gpu,
                           double attend_tolerance = kFp32Tolerance) {
    SCOPED_TRACE(Describe(c));
    Fixture f(c, tokens, cpu_, gpu);
    f.Build();
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_TRUE(cpu_->Store(f.Store(f.cpu_pool())).ok());
    f.CopyCpuPagesToDevice();
    const int d = c.head_dim, qh = c.query_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (int layer = 0; layer < c.layers; ++layer) {
      // ScoreQuery over everything and over an inner range.
      const std::vector<float> q = Gaussian(static_cast<size_t>(qh) * d, 7 + layer);
      for (const auto& range : {std::pair<int, int>{0, tokens}, std::pair<int, int>{tokens / 3, tokens - 5}}) {
        const int n = range.second - range.first;
        std::vector<float> cpu_logits(static_cast<size_t>(qh) * n), gpu_logits(cpu_logits.size());
        ScoreParams s{&f.layout(),  f.cpu_pool(), layer, f.block_table().data(), range.first,
                      range.second, q.data(),     scale, cpu_logits.data()};
        ASSERT_TRUE(cpu_->Score(s).ok());
        s.pool = f.gpu_pool();
        s.logits = gpu_logits.data();
        const absl::Status status = gpu->Score(s);
        ASSERT_TRUE(status.ok()) << status;
        ExpectClose(gpu_logits, cpu_logits, kFp32Tolerance, "logits layer " + std::to_string(layer));
      }
    }
    // One Attend call: items over every layer and query count, two context
    // lengths (the same pages, a shorter causal view).
    std::vector<std::vector<float>> queries, cpu_out, gpu_out, cpu_lse, gpu_lse;
    std::vector<AttendItem> items;
    for (int layer = 0; layer < c.layers; ++layer) {
      for (int n : query_counts) {
        for (int context : {tokens, std::max(n, tokens / 2 + 1)}) {
          queries.push_back(Gaussian(static_cast<size_t>(n) * qh * d, 100 + items.size()));
          cpu_out.emplace_back(queries.back().size());
          gpu_out.emplace_back(queries.back().size());
          cpu_lse.emplace_back(static_cast<size_t>(n) * qh);
          gpu_lse.emplace_back(static_cast<size_t>(n) * qh);
          items.push_back(AttendItem{f.block_table().data(), context, layer, n, nullptr, nullptr, nullptr});
        }
      }
    }
    std::vector<AttendItem> gpu_items = items;
    for (size_t i = 0; i < items.size(); ++i) {
      items[i].queries = gpu_items[i].queries = queries[i].data();
      items[i].output = cpu_out[i].data();
      items[i].lse = cpu_lse[i].data();
      gpu_items[i].output = gpu_out[i].data();
      gpu_items[i].lse = gpu_lse[i].data();
    }
    ASSERT_TRUE(cpu_->Attend(AttendParams{&f.layout(), f.cpu_pool(), items, scale}).ok());
    const absl::Status status = gpu->Attend(AttendParams{&f.layout(), f.gpu_pool(), gpu_items, scale});
    ASSERT_TRUE(status.ok()) << status;
    for (size_t i = 0; i < items.size(); ++i) {
      const std::string what = "item " + std::to_string(i) + " (layer " + std::to_string(items[i].layer) + ", " +
                               std::to_string(items[i].num_query_tokens) + " query tokens, context " +
                               std::to_string(items[i].context_tokens) + ")";
      ExpectClose(gpu_out[i], cpu_out[i], attend_tolerance, what + " output");
      ExpectClose(gpu_lse[i], cpu_lse[i], attend_tolerance, what + " lse");
    }
  }

  static Backend* cpu_;
  static Backend* gpu_;       // tensor cores where the layout allows (the default)
  static Backend* gpu_fp32_;  // fp32 kernels only
  static std::string why_;
};

Backend* CudaBackendTest::cpu_ = nullptr;
Backend* CudaBackendTest::gpu_ = nullptr;
Backend* CudaBackendTest::gpu_fp32_ = nullptr;
std::string CudaBackendTest::why_;

std::vector<std::string> ServingPresets() {
  std::vector<std::string> names;
  for (const Preset& p : AllPresets()) {
    if (!p.evaluation_only) names.emplace_back(p.name);
  }
  return names;
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
  for (int page : {1, 7, 64}) CompareReadsBothKernels({"tqkv_k3v3", 128, page, 2, 4}, 300, {1});
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

  // Attend with the last `query_tokens` tokens as queries, and Score over the
  // whole layer and an inner range, on every layer.
  void Compare(const std::string& id, int query_tokens, uint64_t seed) {
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
    {
      SCOPED_TRACE("fp32 kernels");
      RunRecipe(recipe, cpu_, gpu_fp32_, kFp32Tolerance);
    }
    SCOPED_TRACE("tensor-core decode");
    RunRecipe(recipe, cpu_, gpu_, kTensorCoreTolerance);
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
    {
      SCOPED_TRACE("fp32 kernels");
      RunRecipe(recipe, cpu_, gpu_fp32_, kFp32Tolerance);
    }
    SCOPED_TRACE("tensor-core decode");
    RunRecipe(recipe, cpu_, gpu_, kTensorCoreTolerance);
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
    {
      SCOPED_TRACE("fp32 kernels");
      RunRecipe(recipe, cpu_, gpu_fp32_, kFp32Tolerance);
    }
    SCOPED_TRACE("tensor-core decode");
    RunRecipe(recipe, cpu_, gpu_, kTensorCoreTolerance);
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
    {
      SCOPED_TRACE("fp32 kernels");
      RunRecipe(recipe, cpu_, gpu_fp32_, kFp32Tolerance);
    }
    SCOPED_TRACE("tensor-core decode");
    RunRecipe(recipe, cpu_, gpu_, kTensorCoreTolerance);
  }
}

// Recent tokens covering the whole context, and sinks only.
TEST_F(CudaBackendTest, ExactTokensCoveringTheContextOrOnlySinksMatchTheCpu) {
  for (const Recipe& recipe :
       {Recipe{"turboquant_k3v4_nc", KeyCentering::kPreRope, 2, 200},
        Recipe{"tqkv_k3v4", KeyCentering::kPostRope, 8, 0}, Recipe{"turboquant_3bit_nc", KeyCentering::kNone, 0, 5}}) {
    RunRecipe(recipe, cpu_, gpu_fp32_, kFp32Tolerance);
    RunRecipe(recipe, cpu_, gpu_, kTensorCoreTolerance);
  }
}

// The pre-RoPE add-back at positions up to ~1e6 (t * theta ~ 1e6 rad): the
// CPU's Score computes it in double; the device reduces the angle in double.
// A long block table over a few stored pages (the same pages repeated) makes
// such positions cheap.
TEST_F(CudaBackendTest, PreRopeAddBackIsExactAtLargePositions) {
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
  o.centering_pairs = 0;  // every pair, theta up to 1 rad
  auto layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const int d = 64, qh = 2, stored_pages = 8, stored = stored_pages * 16;
  const int64_t length = 1000003;
  for (Backend* gpu : {gpu_fp32_, gpu_}) {
    auto cpu_pool = cpu_->AllocatePool(**layout, stored_pages);
    auto gpu_pool = gpu->AllocatePool(**layout, stored_pages);
    ASSERT_TRUE(cpu_pool.ok() && gpu_pool.ok());
    const std::vector<float> keys = Gaussian(static_cast<size_t>(stored) * d, 5);
    const std::vector<float> values = Gaussian(keys.size(), 6);
    std::vector<int32_t> slots(stored);
    std::iota(slots.begin(), slots.end(), 0);
    ASSERT_TRUE(cpu_->Store({layout->get(), *cpu_pool, 0, 1, stored, slots.data(), keys.data(), values.data()}).ok());
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
      ASSERT_TRUE(cpu_->Score(s).ok());
      s.pool = *gpu_pool;
      s.logits = gpu_logits.data();
      ASSERT_TRUE(gpu->Score(s).ok());
      ExpectClose(gpu_logits, cpu_logits, kFp32Tolerance, "logits from " + std::to_string(begin));
    }
    // Attend over the whole context (shorter on the emulated device).
    const int64_t context = kEmulated ? 100000 : length;
    std::vector<float> cpu_out(q.size()), gpu_out(q.size()), cpu_lse(qh), gpu_lse(qh);
    AttendItem item{table.data(), context, 0, 1, q.data(), cpu_out.data(), cpu_lse.data()};
    item.key_mean = mean.data();
    ASSERT_TRUE(cpu_->Attend(AttendParams{layout->get(), *cpu_pool, {&item, 1}, scale}).ok());
    item.output = gpu_out.data();
    item.lse = gpu_lse.data();
    ASSERT_TRUE(gpu->Attend(AttendParams{layout->get(), *gpu_pool, {&item, 1}, scale}).ok());
    const double tolerance = gpu == gpu_ ? kTensorCoreTolerance : kFp32Tolerance;
    ExpectClose(gpu_out, cpu_out, tolerance, "attend output");
    ExpectClose(gpu_lse, cpu_lse, tolerance, "attend lse");
    cpu_->FreePool(*cpu_pool);
    gpu->FreePool(*gpu_pool);
  }
}

#if TQKV_CUDA_EMULATION
// A sticky error, injected through the emulated runtime where an illegal
// address would surface on a device (the next call, its synchronisation),
// marks the backend lost: that call and every later one are UNAVAILABLE
// with the first cause, even once the runtime answers again. A failure that
// is not sticky (out of memory) leaves it usable. Only the emulator can
// inject; on a device a lost context would end the test process's use of
// CUDA.
TEST(CudaBackendFaults, AStickyErrorMarksTheDeviceLostForGood) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  CudaBackendOptions options;
  options.workspaces = 1;
  options.workspace_bytes = size_t{1} << 20;
  absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(options);
  ASSERT_TRUE(made.ok()) << made.status();
  Backend& gpu = **made;
  Fixture f({"turboquant_k3v4_nc", 64, 16, 2, 4}, 20, cpu.get(), &gpu);
  f.Build();
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(gpu.Store(f.Store(f.gpu_pool())).ok());
  EXPECT_TRUE(gpu.DeviceStatus().ok());
  // Not sticky: a pool far beyond the device's memory.
  EXPECT_EQ(gpu.AllocatePool(f.layout(), 1 << 30).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(gpu.DeviceStatus().ok());

  cuda::emulation::InjectStickyError(cudaErrorIllegalAddress);
  const absl::Status failed = gpu.Store(f.Store(f.gpu_pool()));
  cuda::emulation::InjectStickyError(cudaSuccess);  // the emulator recovers; a device would not
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_TRUE(cuda::IsDeviceLost(failed)) << failed;
  EXPECT_NE(failed.message().find("cudaErrorIllegalAddress"), std::string::npos) << failed;
  EXPECT_EQ(gpu.DeviceStatus(), failed);
  // Every later call fails fast with the same status, touching nothing.
  const int32_t page = f.block_table()[0];
  std::vector<uint8_t> host(f.gpu_pool().page_bytes);
  EXPECT_EQ(gpu.Store(f.Store(f.gpu_pool())), failed);
  EXPECT_EQ(gpu.CopyPage(f.gpu_pool(), page, f.block_table()[1]), failed);
  EXPECT_EQ(gpu.ReadPages(f.gpu_pool(), {&page, 1}, host.data()), failed);
  EXPECT_EQ(gpu.WritePages(f.gpu_pool(), {&page, 1}, host.data()), failed);
  EXPECT_EQ(gpu.AllocatePool(f.layout(), 2).status(), failed);
  std::vector<float> query(4 * 64, 0.5f), output(query.size());
  AttendItem item{f.block_table().data(), 20, 0, 1, query.data(), output.data(), nullptr};
  EXPECT_EQ(gpu.Attend(AttendParams{&f.layout(), f.gpu_pool(), {&item, 1}, 0.125f}), failed);
  std::vector<float> logits(4 * 20);
  ScoreParams score;
  score.layout = &f.layout();
  score.pool = f.gpu_pool();
  score.block_table = f.block_table().data();
  score.token_end = 20;
  score.queries = query.data();
  score.scale = 0.125f;
  score.logits = logits.data();
  EXPECT_EQ(gpu.Score(score), failed);

  // Each sticky error is recognised; ordinary failures are not.
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorECCUncorrectable,
                        cudaErrorMisalignedAddress, cudaErrorAssert}) {
    EXPECT_TRUE(cuda::IsStickyError(e)) << e;
    EXPECT_TRUE(cuda::IsDeviceLost(cuda::CudaStatus(e, "call"))) << e;
  }
  for (cudaError_t e : {cudaErrorMemoryAllocation, cudaErrorInvalidValue, cudaErrorNoDevice}) {
    EXPECT_FALSE(cuda::IsStickyError(e)) << e;
    EXPECT_FALSE(cuda::IsDeviceLost(cuda::CudaStatus(e, "call"))) << e;
  }
}

// What a decode layer costs the device, from the runtime calls the emulator
// sees (not times: a budget a machine without a GPU can hold the backend
// to): one AppendAttend layer of the default recipe (pre-RoPE centering,
// exact sinks and recent tokens) at batch 8 and 64 is one copy in, one copy out and
// one synchronization, whatever the batch (Backend::StoreAndAttend), and
// answers as the CPU backend does, in 4 launches: the prologue (both
// stores, compressed and exact, and the query preparation of both layouts),
// the decode of compressed and of exact tokens, the merge. A prefill's
// Append (Backend::Store with exact copies) is one launch and one copy each
// way.
TEST(CudaBackendBudget, ADecodeLayerIsOneCopyEachWayAndOneSynchronization) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeCudaBackend(CudaBackendOptions());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  CacheOptions o;
  o.layout.num_layers = 2;
  o.layout.num_kv_heads = 2;
  o.layout.num_query_heads = 8;
  o.layout.head_dim = 64;
  o.layout.preset = "tqkv_k3v4u_csw";
  o.layout.boundary_layers = 0;
  o.layout.rope.base = 500000.0;
  o.layout.exact_recent_tokens = 8;  // the recipe's 4 sinks, fewer recent tokens: a short context passes them
  o.memory_budget_bytes = size_t{64} << 20;
  std::unique_ptr<KvCache> on_gpu = *KvCache::Create(o, gpu->get());
  std::unique_ptr<KvCache> on_cpu = *KvCache::Create(o, cpu.get());
  const KvLayout& layout = on_gpu->layout();
  const size_t row = static_cast<size_t>(layout.num_kv_heads()) * layout.head_dim();
  const size_t qrow = static_cast<size_t>(layout.num_query_heads()) * layout.head_dim();
  for (int batch : {8, 64}) {
    SCOPED_TRACE(batch);
    constexpr int64_t kContext = 20;  // past the exact recent tokens
    const auto id = [batch](int s) { return "b" + std::to_string(batch) + "-" + std::to_string(s); };
    for (int s = 0; s < batch; ++s) {
      const std::vector<float> prefill = Gaussian(layout.num_layers() * kContext * row, 100 * batch + s);
      AppendRequest r;
      r.sequence_id = id(s);
      r.layer_end = layout.num_layers();
      r.num_tokens = kContext;
      r.keys = prefill.data();
      r.values = prefill.data();
      cuda::emulation::ResetCallCounts();
      ASSERT_TRUE(on_gpu->Append(r).ok());
      const cuda::emulation::CallCounts n = cuda::emulation::GetCallCounts();
      ASSERT_TRUE(on_cpu->Append(r).ok());
      // The prefill's store, its exact copies included: one prologue.
      EXPECT_EQ(n.launches, 1);
      EXPECT_EQ(n.copies_to_device, 1);
      EXPECT_EQ(n.copies_to_host, 1);
      EXPECT_EQ(n.synchronizations, 1);
    }
    for (int layer = 0; layer < layout.num_layers(); ++layer) {
      const std::vector<float> tokens = Gaussian(batch * row, 7 + layer), queries = Gaussian(batch * qrow, 8 + layer);
      std::vector<float> gpu_out(batch * qrow), cpu_out(batch * qrow);
      std::vector<AppendRequest> appends(batch);
      std::vector<AttendRequestItem> gpu_items(batch), cpu_items(batch);
      for (int s = 0; s < batch; ++s) {
        AppendRequest& r = appends[s];
        r.sequence_id = id(s);
        r.start_position = kContext;
        r.layer_begin = layer;
        r.layer_end = layer + 1;
        r.num_tokens = 1;
        r.keys = tokens.data() + s * row;
        r.values = tokens.data() + s * row;
        gpu_items[s] = {r.sequence_id, layer, 1, queries.data() + s * qrow, gpu_out.data() + s * qrow, nullptr};
        cpu_items[s] = {r.sequence_id, layer, 1, queries.data() + s * qrow, cpu_out.data() + s * qrow, nullptr};
      }
      std::vector<absl::Status> statuses(batch);
      std::vector<AppendOutcome> outcomes(batch);
      cuda::emulation::ResetCallCounts();
      on_gpu->AppendAttend(appends, gpu_items, 0.0f, absl::MakeSpan(statuses), absl::MakeSpan(outcomes));
      const cuda::emulation::CallCounts n = cuda::emulation::GetCallCounts();
      for (const absl::Status& status : statuses) ASSERT_TRUE(status.ok()) << status;
      on_cpu->AppendAttend(appends, cpu_items, 0.0f, absl::MakeSpan(statuses), absl::MakeSpan(outcomes));
      for (const absl::Status& status : statuses) ASSERT_TRUE(status.ok()) << status;
      ExpectClose(gpu_out, cpu_out, kTensorCoreTolerance, "decode layer output");
      std::printf("batch %d layer %d: %lld launches, %lld copies in, %lld out, %lld on the device, %lld syncs\n", batch,
                  layer, static_cast<long long>(n.launches), static_cast<long long>(n.copies_to_device),
                  static_cast<long long>(n.copies_to_host), static_cast<long long>(n.copies_on_device),
                  static_cast<long long>(n.synchronizations));
      EXPECT_LE(n.launches, 4);
      EXPECT_EQ(n.copies_to_device, 1);
      EXPECT_EQ(n.copies_to_host, 1);
      EXPECT_EQ(n.copies_on_device, 0);
      EXPECT_EQ(n.synchronizations, 1);
    }
  }
}
#endif  // TQKV_CUDA_EMULATION

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
}  // namespace tqkv
