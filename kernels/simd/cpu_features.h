// Run-time SIMD dispatch for the CPU backend.
//
// Kernels with intrinsics are compiled per ISA in their own translation units
// (foo_avx2.cc, foo_avx512.cc) and chosen at run time from ActiveSimdLevel().
// Tests force each level the machine supports to cover every path.
#ifndef TQKV_KERNELS_SIMD_CPU_FEATURES_H_
#define TQKV_KERNELS_SIMD_CPU_FEATURES_H_

#include <string_view>
#include <vector>

namespace tqkv {

enum class SimdLevel {
  kScalar = 0,  // portable C++ (the compiler may still auto-vectorize for SSE2)
  kAvx2 = 1,    // AVX2 + FMA + F16C
  kAvx512 = 2,  // AVX-512 F/BW/VL
  // AVX-512 with VNNI, VBMI and VBMI2: as kAvx512, but TurboQuant attention takes
  // the integer kernel (int8 scores and values; its error bound is in
  // kernels/cpu/attend_kernels.h). kAvx512 keeps fp32 attention.
  kAvx512Vnni = 3,
};

std::string_view SimdLevelName(SimdLevel level);

// The best level this CPU supports (cached after the first call).
SimdLevel DetectedSimdLevel();

// Every level this CPU can run, ascending (always includes kScalar).
std::vector<SimdLevel> SupportedSimdLevels();

// The level kernels dispatch on: DetectedSimdLevel() unless overridden by
// SetActiveSimdLevel() or the TQKV_SIMD environment variable
// (scalar | avx2 | avx512 | avx512_vnni), read once at first use. Thread-safe (atomic).
SimdLevel ActiveSimdLevel();

// Overrides the active level, clamped to DetectedSimdLevel(); returns the level
// actually set. Intended for tests and benchmarks; not for concurrent use with
// running kernels that expect a stable choice.
SimdLevel SetActiveSimdLevel(SimdLevel level);

}  // namespace tqkv

#endif  // TQKV_KERNELS_SIMD_CPU_FEATURES_H_
