// Which store-path kernels run (kernels/cpu/encode_kernels.h). Compiled for
// the baseline ISA: it only picks.
#include "kernels/simd/encode_kernels.h"
#include "kernels/simd/cpu_features.h"

namespace tqkv {
namespace encode_internal {
namespace {

constexpr EncodeKernels kAvx512{
    "avx512",           AllFiniteWithinAvx512,    ScaleAvx512,        QuantizeToLevelsAvx512,
    PackBitsAvx512,     FloatToHalfAvx512,        FloatToBf16Avx512,  FloatToFp8E4m3Avx512,
    MinMaxAvx512,       UniformLevelsAvx512,      SumOfSquaresAvx512, CodewordSumAvx512,
    QuantizePackAvx512, RotateQuantizePackAvx512, UniformRangeAvx512, UniformPackAvx512};
constexpr EncodeKernels kAvx2{"avx2",           AllFiniteWithinAvx2,    ScaleAvx2,        QuantizeToLevelsAvx2,
                              PackBitsBmi2,     FloatToHalfAvx2,        FloatToBf16Avx2,  FloatToFp8E4m3Avx2,
                              MinMaxAvx2,       UniformLevelsAvx2,      SumOfSquaresAvx2, CodewordSumAvx2,
                              QuantizePackAvx2, RotateQuantizePackAvx2, UniformRangeAvx2, UniformPackAvx2};

}  // namespace

QuantizeTables MakeQuantizeTables(const float* boundaries, const float* centroids, int bits) {
  QuantizeTables t;
  t.boundaries = boundaries;
  t.centroids = centroids;
  t.bits = bits;
  if (bits < 2 || bits > 4) return t;  // the search tables serve 2-4 bits
  const int num_boundaries = (1 << bits) - 1;
  float table[16] = {};
  for (int k = 0; k < num_boundaries; ++k) table[k] = boundaries[k];
  if (centroids != nullptr) {
    for (int k = 0; k < (1 << bits); ++k) t.squares[k] = centroids[k] * centroids[k];
  }
  t.first = (num_boundaries + 1) >> 1;
  t.first_bound = table[t.first - 1];
  for (int step = t.first >> 1; step > 0; step >>= 1, ++t.later) {
    for (int k = 0; k < 16; ++k) t.shifted[t.later][k] = k + step - 1 < 16 ? table[k + step - 1] : 0.0f;
  }
  return t;
}

const EncodeKernels* ActiveEncodeKernels() {
  static const bool bmi2 = __builtin_cpu_supports("bmi2");
  if (!bmi2) return nullptr;
  // ActiveSimdLevel() never exceeds what the CPU has (cpu_features.h); kAvx2
  // includes FMA and F16C.
  switch (ActiveSimdLevel()) {
    case SimdLevel::kAvx512:
    case SimdLevel::kAvx512Vnni:
      return &kAvx512;
    case SimdLevel::kAvx2:
      return &kAvx2;
    default:
      return nullptr;
  }
}

}  // namespace encode_internal
}  // namespace tqkv
