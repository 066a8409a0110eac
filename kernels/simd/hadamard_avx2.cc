// The rotation kernels of rotation_kernels.h for AVX2 + FMA (8 floats): the bodies in
// hadamard_body.h on simd::Avx2. Compiled with -mavx2 -mfma; called only
// when ActiveSimdLevel() allows it.
#include "kernels/simd/hadamard_body.h"
#include "kernels/simd/rotation_kernels.h"
#include "kernels/simd/simd_mappings.h"
#include "kernels/rotation.h"

namespace tqkv {
namespace rotation_internal {

void SignedFwhtAvx2(const float* x, float* y, int n, const float* pre_signs, const float* post_signs) {
  hadamard::SignedFwht<simd::Avx2>(x, y, n, pre_signs, post_signs);
  hadamard::ZeroUpper();
}

void DenseForwardAvx2(const float* m, const float* x, float* y, int dim) {
  hadamard::DenseForward<simd::Avx2>(m, x, y, dim);
  hadamard::ZeroUpper();
}

void DenseInverseAvx2(const float* m, const float* y, float* x, int dim) {
  hadamard::DenseInverse<simd::Avx2>(m, y, x, dim);
  hadamard::ZeroUpper();
}

void KronHadamardAvx2(const float* x, float* y, int rows, int m, const float* columns, const float* pre_signs,
                      const float* post_signs, float scale) {
  hadamard::KronHadamard<simd::Avx2>(x, y, rows, m, columns, pre_signs, post_signs, scale);
  hadamard::ZeroUpper();
}

}  // namespace rotation_internal

void FastWalshHadamardAvx2(float* x, int n) { rotation_internal::SignedFwhtAvx2(x, x, n, nullptr, nullptr); }

}  // namespace tqkv
