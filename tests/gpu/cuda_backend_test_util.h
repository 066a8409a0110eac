// Shared by the CUDA backend tests (cuda_backend_test.cc, cuda_recipe_test.cc,
// cuda_faults_test.cc): deterministic data, a store-and-read fixture over a
// pool on each backend, the relative comparison with the CPU, and the test
// class holding one CPU and two CUDA backends (tensor cores, fp32 only) for
// its suite. Built into gpu_test (a real device) and gpu_emulation_test
// (TQKV_CUDA_EMULATION: the emulated device, fewer tokens).
#ifndef TQKV_TESTS_GPU_CUDA_BACKEND_TEST_UTIL_H_
#define TQKV_TESTS_GPU_CUDA_BACKEND_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/kv_layout.h"

namespace tqkv {
namespace cuda_test {

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
inline int Tokens(int device_tokens) { return kEmulated ? std::max(24, device_tokens / 4) : device_tokens; }

struct Case {
  std::string preset;
  int head_dim = 128;
  int page_tokens = 16;
  int kv_heads = 2;
  int query_heads = 8;
  int layers = 2;
  int boundary_layers = 0;
};

std::string Describe(const Case& c);

// n Gaussian values from `seed`, with a few hot coordinates and offsets.
std::vector<float> Gaussian(size_t n, uint64_t seed);

// Data, layout, a shuffled block table and a pool on each backend. Build()
// fails the test (fatally) where the layout or a pool cannot be made.
class Fixture {
 public:
  Fixture(const Case& c, int tokens, Backend* cpu, Backend* gpu) : c_(c), tokens_(tokens), cpu_(cpu), gpu_(gpu) {}
  ~Fixture();
  Fixture(const Fixture&) = delete;
  Fixture& operator=(const Fixture&) = delete;

  void Build();

  StoreParams Store(const PagePool& pool) const {
    return StoreParams{layout_.get(), pool, 0, c_.layers, tokens_, slots_.data(), keys_.data(), values_.data()};
  }

  std::vector<uint8_t> DevicePoolBytes() const;
  // Every byte of both pools set to `byte` (the CPU's small pools start
  // uninitialised).
  void FillPools(uint8_t byte) const;
  // The CPU's bytes onto the device: both backends then read the same pages.
  void CopyCpuPagesToDevice() const;

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

// Every `gpu` value within `relative` of the largest |cpu| value (plus 1e-3)
// of its `cpu` value, and none NaN.
void ExpectClose(const std::vector<float>& gpu, const std::vector<float>& cpu, double relative,
                 const std::string& what);

// One CPU backend and two CUDA ones for the suite; each test skips where no
// CUDA device is present.
class CudaBackendTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite();
  static void TearDownTestSuite();
  void SetUp() override {
    if (gpu_ == nullptr) GTEST_SKIP() << "no CUDA device: " << why_;
  }

  // The reads through the fp32 kernels and through the tensor-core kernel.
  static void CompareReadsBothKernels(const Case& c, int tokens, const std::vector<int>& query_counts);

  // Stores on both and compares each (layer, head, token) vector: its codes,
  // gathered through the plane's layout (kernels/code_tiles.h), and its
  // scalars. Then the whole pools byte for byte, the differing vectors' bytes
  // taken from the device: every code byte sits where the CPU puts it and
  // nothing else was written. Returns the number of vectors that differ.
  static int CompareStore(const Case& c, int tokens, int* total, Backend* gpu = gpu_);

  // Score and Attend through both backends on the CPU's pages; Attend's
  // outputs within `attend_tolerance` (relative to the largest).
  static void CompareReads(const Case& c, int tokens, const std::vector<int>& query_counts, Backend* gpu,
                           double attend_tolerance = kFp32Tolerance);

  static Backend* cpu_;
  static Backend* gpu_;       // tensor cores where the layout allows (the default)
  static Backend* gpu_fp32_;  // fp32 kernels only
  static std::string why_;
};

}  // namespace cuda_test
}  // namespace tqkv

#endif  // TQKV_TESTS_GPU_CUDA_BACKEND_TEST_UTIL_H_
