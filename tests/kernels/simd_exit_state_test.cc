// Every SIMD kernel that baseline (SSE) code calls returns with the upper
// halves of the vector registers in their initial state, as vzeroupper
// leaves them. A kernel that returns them dirty makes every SSE instruction
// its caller runs afterwards pay for it: on the Xeon this project measured, a
// Hadamard transform that returned through a tail jump into a function
// without vzeroupper made the whole TurboQuant store 1.8x slower. GCC omits
// vzeroupper in functions that take or return vector values, so the bug
// comes back easily; this test sees it.
//
// XGETBV with ECX = 1 reads XINUSE: bit 2 is set while the upper 128 bits of
// ymm0-15 are in use, bit 6 the upper 256 bits of zmm0-15 (zmm16-31, bit 7,
// are out of SSE's reach). Kernels are called through the code that calls
// them in the product: Rotation, the codecs, the CPU backend on one thread
// with calls small enough to run on the caller.
#include <cpuid.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"
#include "base/random.h"
#include "kernels/rotation.h"
#include "tests/kernels/one_head_layout.h"
#include "tests/kernels/simd_level_guard.h"

namespace tqkv {
namespace {

bool CanReadInUse() {
  unsigned a, b, c, d;
  if (__get_cpuid_max(0, nullptr) < 0xd) return false;
  __cpuid_count(1, 0, a, b, c, d);
  if (!(c & (1u << 27))) return false;  // OSXSAVE
  __cpuid_count(0xd, 1, a, b, c, d);
  return (a & (1u << 2)) != 0;  // XGETBV with ECX = 1
}

uint64_t InUse() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

constexpr uint64_t kUpperHalves = (1u << 2) | (1u << 6);

bool UpperClean() { return (InUse() & kUpperHalves) == 0; }

std::vector<SimdLevel> VectorLevels() {
  std::vector<SimdLevel> levels;
  for (SimdLevel level : SupportedSimdLevels()) {
    if (level >= SimdLevel::kAvx2) levels.push_back(level);
  }
  return levels;
}

std::vector<float> Gaussian(size_t n, uint64_t seed) {
  Random rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.NextGaussian());
  return v;
}

// The probe itself: a ymm write is seen, vzeroupper clears it.
TEST(SimdExitState, TheProbeSeesADirtyUpperHalf) {
  if (!CanReadInUse() || !__builtin_cpu_supports("avx2")) GTEST_SKIP() << "no XGETBV with ECX = 1 or no AVX2";
  __asm__ volatile("vzeroupper");
  EXPECT_TRUE(UpperClean());
  __asm__ volatile("vpcmpeqd %%ymm1, %%ymm1, %%ymm1" ::: "xmm1");
  EXPECT_FALSE(UpperClean());
  __asm__ volatile("vzeroupper");
  EXPECT_TRUE(UpperClean());
}

TEST(SimdExitState, RotationsReturnClean) {
  if (!CanReadInUse() || VectorLevels().empty()) GTEST_SKIP() << "no XGETBV with ECX = 1 or no AVX2";
  SimdLevelGuard guard;
  // Power-of-two dims in one block and in stride passes, Kronecker forms, a
  // dense matrix.
  for (int dim : {16, 64, 128, 256, 1024, 80, 96, 160, 100}) {
    auto rotation = Rotation::Create(dim, 7);
    ASSERT_TRUE(rotation.ok()) << rotation.status();
    std::vector<float> x = Gaussian(dim, dim), y(dim);
    for (SimdLevel level : VectorLevels()) {
      SetActiveSimdLevel(level);
      SCOPED_TRACE("dim " + std::to_string(dim) + " level " + std::string(SimdLevelName(level)));
      __asm__ volatile("vzeroupper");
      (*rotation)->Forward(x.data(), y.data());
      EXPECT_TRUE(UpperClean()) << "Forward";
      __asm__ volatile("vzeroupper");
      (*rotation)->Inverse(y.data(), x.data());
      EXPECT_TRUE(UpperClean()) << "Inverse";
    }
  }
}

// Store and attend through the CPU backend, every preset, every level.
TEST(SimdExitState, StoreAndAttendReturnClean) {
  if (!CanReadInUse() || VectorLevels().empty()) GTEST_SKIP() << "no XGETBV with ECX = 1 or no AVX2";
  SimdLevelGuard guard;
  const int d = 128, n = 48, heads = 4;
  const std::vector<float> keys = Gaussian(static_cast<size_t>(n) * d, 1);
  const std::vector<float> values = Gaussian(static_cast<size_t>(n) * d, 2);
  const std::vector<float> queries = Gaussian(static_cast<size_t>(heads) * d, 3);
  for (SimdLevel level : VectorLevels()) {
    SetActiveSimdLevel(level);
    CpuBackendOptions options;
    options.num_threads = 1;  // and calls this small run on their caller
    std::unique_ptr<Backend> backend = MakeCpuBackend(options);
    for (const Preset& preset : AllPresets()) {
      SCOPED_TRACE(std::string(preset.name) + " level " + std::string(SimdLevelName(level)));
      auto layout = KvLayout::Create(OneHeadLayoutOptions(preset, heads, d, keys.data(), n));
      ASSERT_TRUE(layout.ok()) << layout.status();
      auto pool = backend->AllocatePool(**layout, n / 16);
      ASSERT_TRUE(pool.ok()) << pool.status();
      std::vector<int32_t> slots(n), block_table(n / 16);
      std::iota(slots.begin(), slots.end(), 0);
      std::iota(block_table.begin(), block_table.end(), 0);
      __asm__ volatile("vzeroupper");
      ASSERT_TRUE(backend->Store({layout->get(), *pool, 0, 1, n, slots.data(), keys.data(), values.data()}).ok());
      EXPECT_TRUE(UpperClean()) << "Store";
      std::vector<float> output(static_cast<size_t>(heads) * d), lse(heads);
      AttendItem item{block_table.data(), n, 0, 1, queries.data(), output.data(), lse.data()};
      __asm__ volatile("vzeroupper");
      ASSERT_TRUE(backend->Attend({layout->get(), *pool, {&item, 1}, 0.088f}).ok());
      EXPECT_TRUE(UpperClean()) << "Attend";
      backend->FreePool(*pool);
    }
  }
}

}  // namespace
}  // namespace tqkv
