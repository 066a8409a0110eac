// Internal to the rotation kernels: the per-ISA entry points that rotation.cc
// dispatches to on ActiveSimdLevel(), defined in hadamard_avx2.cc and
// hadamard_avx512.cc on one body (hadamard_body.h); the portable versions live
// in rotation.cc. Each returns with a clean upper register state.
#ifndef TQKV_KERNELS_SIMD_ROTATION_KERNELS_H_
#define TQKV_KERNELS_SIMD_ROTATION_KERNELS_H_

namespace tqkv {
namespace rotation_internal {

// y = diag(post) H diag(pre) x / sqrt(n), pre/post null for the identity,
// x == y allowed; bit-identical to the scalar sequence "multiply by pre,
// FastWalshHadamardScalar, multiply by post". REQUIRES: n a power of two.
void SignedFwhtAvx2(const float* x, float* y, int n, const float* pre_signs, const float* post_signs);
void SignedFwhtAvx512(const float* x, float* y, int n, const float* pre_signs, const float* post_signs);

// DenseForward*: y = M x; DenseInverse*: x = M^T y; M row-major dim x dim;
// output must not alias input. Not bit-identical to the portable versions in
// rotation.cc (FMA, different summation order); equal within float rounding.
void DenseForwardAvx2(const float* m, const float* x, float* y, int dim);
void DenseForwardAvx512(const float* m, const float* x, float* y, int dim);
void DenseInverseAvx2(const float* m, const float* y, float* x, int dim);
void DenseInverseAvx512(const float* m, const float* y, float* x, int dim);

// y = diag(post) (H_rows kron F) diag(pre) x * scale, for x, y of rows * m
// floats (coordinate r * m + c is row r, column c). F is m x m with +-1
// entries, given column by column: `columns` is F^T row-major (pass P^T for
// y = P x, P for y = P^T x). pre/post are +-1 diagonals or null; x == y
// allowed, partial overlap not. Every variant returns the same bits: each
// output element is t_0 f_0 + t_1 f_1 + ... + t_{m-1} f_{m-1} summed in
// that order (t = pre * x), then the butterflies (a + b, a - b) across rows in
// stage order h = 1, 2, 4, ..., then one multiply by (scale * post). The
// products t_k f_k are exact, so FMA and plain multiply-add agree.
// REQUIRES: m in {12, 20, 28}; rows a power of two, rows * m <= 8192.
void KronHadamardScalar(const float* x, float* y, int rows, int m, const float* columns, const float* pre_signs,
                        const float* post_signs, float scale);
void KronHadamardAvx2(const float* x, float* y, int rows, int m, const float* columns, const float* pre_signs,
                      const float* post_signs, float scale);
void KronHadamardAvx512(const float* x, float* y, int rows, int m, const float* columns, const float* pre_signs,
                        const float* post_signs, float scale);

}  // namespace rotation_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_SIMD_ROTATION_KERNELS_H_
