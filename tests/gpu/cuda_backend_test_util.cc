#include "tests/gpu/cuda_backend_test_util.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/code_tiles.h"
#include "kernels/codec.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/preset.h"

namespace tqkv {
namespace cuda_test {

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

Fixture::~Fixture() {
  if (cpu_pool_.base != nullptr) cpu_->FreePool(cpu_pool_);
  if (gpu_pool_.base != nullptr) gpu_->FreePool(gpu_pool_);
}

void Fixture::Build() {
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

std::vector<uint8_t> Fixture::DevicePoolBytes() const {
  std::vector<uint8_t> bytes(gpu_pool_.page_bytes * static_cast<size_t>(pages_));
  EXPECT_EQ(cudaMemcpy(bytes.data(), gpu_pool_.base, bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return bytes;
}

void Fixture::FillPools(uint8_t byte) const {
  const size_t bytes = cpu_pool_.page_bytes * static_cast<size_t>(pages_);
  std::memset(cpu_pool_.base, byte, bytes);
  ASSERT_EQ(cudaMemset(gpu_pool_.base, byte, bytes), cudaSuccess);
}

void Fixture::CopyCpuPagesToDevice() const {
  ASSERT_EQ(cudaMemcpy(gpu_pool_.base, cpu_pool_.base, gpu_pool_.page_bytes * static_cast<size_t>(pages_),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
}

void ExpectClose(const std::vector<float>& gpu, const std::vector<float>& cpu, double relative,
                 const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size());
  double scale = 0.0;
  for (float v : cpu) scale = std::isinf(v) ? scale : std::max(scale, static_cast<double>(std::fabs(v)));
  size_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    ASSERT_FALSE(std::isnan(gpu[i])) << what << " [" << i << "] is NaN";
    if (std::isinf(cpu[i]) || std::isinf(gpu[i])) {  // an lse of no tokens: -inf on both
      EXPECT_EQ(gpu[i], cpu[i]) << what << " [" << i << "]";
      continue;
    }
    const double error = std::fabs(static_cast<double>(gpu[i]) - cpu[i]);
    worst = std::max(worst, error);
    if (error > relative * (scale + 1e-3)) ++bad;
  }
  EXPECT_EQ(bad, 0u) << what << ": worst error " << worst << " against a scale of " << scale;
}

Backend* CudaBackendTest::cpu_ = nullptr;
Backend* CudaBackendTest::gpu_ = nullptr;
Backend* CudaBackendTest::gpu_fp32_ = nullptr;
std::string CudaBackendTest::why_;

void CudaBackendTest::SetUpTestSuite() {
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

void CudaBackendTest::TearDownTestSuite() {
  delete gpu_;
  delete gpu_fp32_;
  delete cpu_;
  gpu_ = gpu_fp32_ = cpu_ = nullptr;
}

void CudaBackendTest::CompareReadsBothKernels(const Case& c, int tokens, const std::vector<int>& query_counts) {
  {
    SCOPED_TRACE("fp32 kernels");
    CompareReads(c, tokens, query_counts, gpu_fp32_);
  }
  SCOPED_TRACE("tensor-core decode");
  CompareReads(c, tokens, query_counts, gpu_, kTensorCoreTolerance);
}

int CudaBackendTest::CompareStore(const Case& c, int tokens, int* total, Backend* gpu) {
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
            std::copy(device.data() + scalars, device.data() + scalars + field.scalar_bytes, expected.data() + scalars);
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

void CudaBackendTest::CompareReads(const Case& c, int tokens, const std::vector<int>& query_counts, Backend* gpu,
                                   double attend_tolerance) {
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

}  // namespace cuda_test
}  // namespace tqkv
