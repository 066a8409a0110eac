#include "kernels/simd/cpu_features.h"

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace tqkv {
namespace {

#if defined(__x86_64__) || defined(__i386__)
// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does
// not know "f16c". The AVX2 check below already covers the OS state (XCR0).
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
}
#endif

SimdLevel Detect() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // libgcc also checks XCR0, so an OS that does not save the wider registers
  // reports the feature as absent.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
    // The integer kernel needs VNNI (vpdpbusd), VBMI (vpermb,
    // vpmultishiftqb) and VBMI2 (vpshrdd), not BF16: Ice Lake and later
    // Intel cores, Zen 4 and later.
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
        __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("avx512dq")) {
      return SimdLevel::kAvx512Vnni;
    }
    return SimdLevel::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && HasF16c()) {
    return SimdLevel::kAvx2;
  }
#endif
  return SimdLevel::kScalar;
}

SimdLevel Clamp(SimdLevel level) {
  const SimdLevel detected = DetectedSimdLevel();
  return static_cast<int>(level) > static_cast<int>(detected) ? detected : level;
}

// The level at first use: TQKV_SIMD if set and valid, else the detected one.
SimdLevel InitialLevel() {
  const char* env = std::getenv("TQKV_SIMD");
  if (env == nullptr || *env == '\0') return DetectedSimdLevel();
  std::string value(env);
  for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (value == "scalar") return SimdLevel::kScalar;
  if (value == "avx2") return Clamp(SimdLevel::kAvx2);
  if (value == "avx512") return Clamp(SimdLevel::kAvx512);
  if (value == "avx512_vnni") return Clamp(SimdLevel::kAvx512Vnni);
  std::fprintf(stderr, "tqkv: ignoring TQKV_SIMD='%s' (want scalar, avx2, avx512 or avx512_vnni)\n", env);
  return DetectedSimdLevel();
}

// Function-local static: initialised once, thread-safely, before any read or
// SetActiveSimdLevel, so the environment can never overwrite an explicit set.
std::atomic<int>& ActiveSlot() {
  static std::atomic<int> slot(static_cast<int>(InitialLevel()));
  return slot;
}

}  // namespace

std::string_view SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return "scalar";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
    case SimdLevel::kAvx512Vnni:
      return "avx512_vnni";
  }
  return "unknown";
}

SimdLevel DetectedSimdLevel() {
  static const SimdLevel detected = Detect();
  return detected;
}

std::vector<SimdLevel> SupportedSimdLevels() {
  std::vector<SimdLevel> levels;
  const int best = static_cast<int>(DetectedSimdLevel());
  for (int level = 0; level <= best; ++level) levels.push_back(static_cast<SimdLevel>(level));
  return levels;
}

SimdLevel ActiveSimdLevel() { return static_cast<SimdLevel>(ActiveSlot().load(std::memory_order_relaxed)); }

SimdLevel SetActiveSimdLevel(SimdLevel level) {
  const int requested = static_cast<int>(level);
  const SimdLevel clamped = requested < 0 ? SimdLevel::kScalar : Clamp(static_cast<SimdLevel>(requested));
  ActiveSlot().store(static_cast<int>(clamped), std::memory_order_relaxed);
  return clamped;
}

}  // namespace tqkv
