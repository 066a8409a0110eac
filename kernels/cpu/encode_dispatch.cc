// Which store-path kernels run (kernels/cpu/encode_kernels.h). Compiled for
// the baseline ISA: it only picks.
#include "kernels/cpu/encode_kernels.h"
#include "kernels/cpu_features.h"

namespace tqkv {
namespace encode_internal {
namespace {

constexpr EncodeKernels kAvx512{"avx512",           AllFiniteWithinAvx512, ScaleAvx512,
                                QuantizeToLevelsAvx512, PackBitsAvx512,       FloatToHalfAvx512,
                                FloatToBf16Avx512,  FloatToFp8E4m3Avx512,  MinMaxAvx512,
                                UniformLevelsAvx512,    SumOfSquaresAvx512, CodewordSumAvx512, QuantizePackAvx512, UniformRangeAvx512, UniformPackAvx512};
constexpr EncodeKernels kAvx2{"avx2",           AllFiniteWithinAvx2, ScaleAvx2,       QuantizeToLevelsAvx2,
                              PackBitsBmi2,     FloatToHalfAvx2,     FloatToBf16Avx2, FloatToFp8E4m3Avx2,
                              MinMaxAvx2,       UniformLevelsAvx2,   SumOfSquaresAvx2, CodewordSumAvx2, QuantizePackAvx2, UniformRangeAvx2, UniformPackAvx2};

}  // namespace

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
