// For tests that switch SimdLevel: restores the active level when the scope
// (a test) ends.
#ifndef TQKV_TESTS_KERNELS_SIMD_LEVEL_GUARD_H_
#define TQKV_TESTS_KERNELS_SIMD_LEVEL_GUARD_H_

#include "kernels/simd/cpu_features.h"

namespace tqkv {

class SimdLevelGuard {
 public:
  SimdLevelGuard() : saved_(ActiveSimdLevel()) {}
  ~SimdLevelGuard() { SetActiveSimdLevel(saved_); }
  SimdLevelGuard(const SimdLevelGuard&) = delete;
  SimdLevelGuard& operator=(const SimdLevelGuard&) = delete;

 private:
  SimdLevel saved_;
};

}  // namespace tqkv

#endif  // TQKV_TESTS_KERNELS_SIMD_LEVEL_GUARD_H_
