// The rotation kernels of rotation_kernels.h for AVX-512 F (16 floats): the bodies in
// hadamard_body.h on simd::Avx512. Compiled with -mavx512f -mavx512bw -mavx512vl -mfma; called only
// when ActiveSimdLevel() allows it.
#include "kernels/simd/hadamard_body.h"
#include "kernels/simd/rotation_kernels.h"
#include "kernels/simd/simd_mappings.h"
#include "kernels/rotation.h"

namespace tqkv {
namespace rotation_internal {

void SignedFwhtAvx512(const float* x, float* y, int n, const float* pre_signs, const float* post_signs) {
  hadamard::SignedFwht<simd::Avx512>(x, y, n, pre_signs, post_signs);
  hadamard::ZeroUpper();
}

void DenseForwardAvx512(const float* m, const float* x, float* y, int dim) {
  hadamard::DenseForward<simd::Avx512>(m, x, y, dim);
  hadamard::ZeroUpper();
}

void DenseInverseAvx512(const float* m, const float* y, float* x, int dim) {
  hadamard::DenseInverse<simd::Avx512>(m, y, x, dim);
  hadamard::ZeroUpper();
}

void KronHadamardAvx512(const float* x, float* y, int rows, int m, const float* columns, const float* pre_signs,
                        const float* post_signs, float scale) {
  hadamard::KronHadamard<simd::Avx512>(x, y, rows, m, columns, pre_signs, post_signs, scale);
  hadamard::ZeroUpper();
}

}  // namespace rotation_internal

void FastWalshHadamardAvx512(float* x, int n) { rotation_internal::SignedFwhtAvx512(x, x, n, nullptr, nullptr); }

}  // namespace tqkv
