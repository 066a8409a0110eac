// The fused float attention kernel (attend_body.h) on AVX-512 F/BW/VL/DQ:
// simd::Avx512, 16 lanes and 32 registers, so score tiles of 4 tokens x 4
// rows (8 x 2, 16 x 1) and value tiles of 4 rows x 64 coordinates (2 x 128,
// 1 x 256), 16 accumulators each; fp8 read exactly through binary16. Compiled
// with the AVX-512 flags; called only when ActiveSimdLevel() allows it. Split
// keys are not instantiated here: the backend falls back to the AVX2 kernel
// for them (attend_dispatch.h's Reads).
#include "kernels/cpu/attend_body.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/simd/simd_mappings.h"

namespace tqkv {
namespace cpu_internal {

bool AttendHeadAvx512Supported(const FieldReader& key, const FieldReader& value, int head_dim) {
  return attend_body::Supported<simd::Avx512, /*kSplitKeys=*/false>(key, value, head_dim);
}

void AttendHeadAvx512(const HeadAttendParams& params) {
  attend_body::Attend<simd::Avx512, /*kSplitKeys=*/false>(params);
}

}  // namespace cpu_internal
}  // namespace tqkv
