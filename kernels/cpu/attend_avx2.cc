// The fused float attention kernel (attend_body.h) on AVX2 + FMA + F16C:
// simd::Avx2, 8 lanes and 16 registers, so score tiles of 2 tokens x 4 rows
// (4 x 2, 8 x 1) and value tiles of 4 rows x 16 coordinates (2 x 32, 1 x 64),
// 8 accumulators each. Compiled with -mavx2 -mfma -mf16c; called only when
// ActiveSimdLevel() allows it. It reads every pair of the format table, split
// keys included: on an AVX-512 machine the dispatch falls back to it for them.
#include "kernels/cpu/attend_body.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/simd/simd_mappings.h"

namespace tqkv {
namespace cpu_internal {

bool AttendHeadAvx2Supported(const FieldReader& key, const FieldReader& value, int head_dim) {
  return attend_body::Supported<simd::Avx2, /*kSplitKeys=*/true>(key, value, head_dim);
}

void AttendHeadAvx2(const HeadAttendParams& params) { attend_body::Attend<simd::Avx2, /*kSplitKeys=*/true>(params); }

}  // namespace cpu_internal
}  // namespace tqkv
