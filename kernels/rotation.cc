#include "kernels/rotation.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu_features.h"
#include "kernels/random.h"

// This file is compiled for baseline x86-64: it holds no intrinsics and reaches
// the AVX code only through ActiveSimdLevel().

namespace tqkv {
namespace rotation_internal {
// Per-ISA kernels, defined in hadamard_avx2.cc and hadamard_avx512.cc.
//
// SignedFwht*: y = diag(post) H diag(pre) x / sqrt(n), pre/post null for the
// identity, x == y allowed; bit-identical to the scalar sequence "multiply by
// pre, FastWalshHadamardScalar, multiply by post". REQUIRES: n a power of two.
// DenseForward*: y = M x; DenseInverse*: x = M^T y; M row-major dim x dim;
// output must not alias input. Not bit-identical to the portable versions
// below (FMA, different summation order); equal within float rounding.
void SignedFwhtAvx2(const float* x, float* y, int n, const float* pre_signs,
                    const float* post_signs);
void SignedFwhtAvx512(const float* x, float* y, int n, const float* pre_signs,
                      const float* post_signs);
void DenseForwardAvx2(const float* m, const float* x, float* y, int dim);
void DenseForwardAvx512(const float* m, const float* x, float* y, int dim);
void DenseInverseAvx2(const float* m, const float* y, float* x, int dim);
void DenseInverseAvx512(const float* m, const float* y, float* x, int dim);
}  // namespace rotation_internal

namespace {

bool IsPowerOfTwo(int n) { return n > 0 && (n & (n - 1)) == 0; }

// sum_{i in [begin, end)} a[i] * b[i] with four interleaved partial sums (so the
// loop is not bound by add latency) combined in a fixed order: the result is a
// function of the inputs alone, which keeps HaarOrthogonal reproducible.
double DotRange(const double* a, const double* b, size_t begin, size_t end) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  size_t i = begin;
  for (; i + 4 <= end; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < end; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

// Haar-distributed orthogonal matrix, row-major, from a Gaussian matrix G drawn
// row-major from Random(seed): G = QR by Householder in float64, then
// Q diag(sign(diag(R))), i.e. the Q of the unique QR with R_ii > 0. Every step
// is plain IEEE double arithmetic in a fixed order, so the result depends only
// on (dim, seed).
std::vector<float> HaarOrthogonal(int dim, uint64_t seed) {
  const size_t d = static_cast<size_t>(dim);
  // a[j * d + i] = G[i][j]: column-major, so each Householder step reads and
  // updates contiguous columns.
  std::vector<double> a(d * d);
  Random random(seed);
  for (size_t i = 0; i < d; ++i) {
    for (size_t j = 0; j < d; ++j) a[j * d + i] = random.NextGaussian();
  }

  // Reflector k is H_k = I - tau_k v_k v_k^T acting on rows k..d-1; v_k is kept
  // in v[k * d + k .. k * d + d - 1].
  std::vector<double> v(d * d, 0.0);
  std::vector<double> tau(d, 0.0);
  std::vector<double> r_sign(d, 1.0);
  for (size_t k = 0; k < d; ++k) {
    const double* col = &a[k * d];
    const double norm2 = DotRange(col, col, k, d);
    const double norm = std::sqrt(norm2);
    if (norm == 0.0) continue;  // probability zero for a Gaussian matrix: H_k = I.
    const double x0 = col[k];
    const double alpha = x0 >= 0.0 ? -norm : norm;  // R_kk
    r_sign[k] = alpha >= 0.0 ? 1.0 : -1.0;
    double* vk = &v[k * d];
    vk[k] = x0 - alpha;
    for (size_t i = k + 1; i < d; ++i) vk[i] = col[i];
    tau[k] = 2.0 / DotRange(vk, vk, k, d);
    for (size_t j = k + 1; j < d; ++j) {
      double* cj = &a[j * d];
      const double s = tau[k] * DotRange(vk, cj, k, d);
      for (size_t i = k; i < d; ++i) cj[i] -= s * vk[i];
    }
  }

  // Q = H_0 H_1 ... H_{d-1}, accumulated backwards into q (column-major).
  // Before H_k is applied, columns j < k of the partial product are still e_j,
  // which H_k leaves alone.
  std::vector<double> q(d * d, 0.0);
  for (size_t j = 0; j < d; ++j) q[j * d + j] = 1.0;
  for (size_t kk = d; kk-- > 0;) {
    if (tau[kk] == 0.0) continue;
    const double* vk = &v[kk * d];
    for (size_t j = kk; j < d; ++j) {
      double* cj = &q[j * d];
      const double s = tau[kk] * DotRange(vk, cj, kk, d);
      for (size_t i = kk; i < d; ++i) cj[i] -= s * vk[i];
    }
  }

  std::vector<float> matrix(d * d);
  for (size_t i = 0; i < d; ++i) {
    for (size_t j = 0; j < d; ++j) {
      matrix[i * d + j] = static_cast<float>(q[j * d + i] * r_sign[j]);
    }
  }
  return matrix;
}

// Dot product with 16 independent partial sums and a fixed reduction tree: the
// fixed-size inner loop is vectorised by GCC without -ffast-math, and the
// result does not depend on how wide the vectors are.
inline float Dot(const float* a, const float* b, int n) {
  float acc[16] = {};
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int k = 0; k < 16; ++k) acc[k] += a[j + k] * b[j + k];
  }
  float tail = 0.0f;
  for (; j < n; ++j) tail += a[j] * b[j];
  for (int width = 8; width >= 1; width >>= 1) {
    for (int k = 0; k < width; ++k) acc[k] += acc[k + width];
  }
  return acc[0] + tail;
}

// y = M x. REQUIRES: y does not alias x.
void DenseForwardScalar(const float* m, const float* x, float* y, int dim) {
  for (int i = 0; i < dim; ++i) y[i] = Dot(m + static_cast<size_t>(i) * dim, x, dim);
}

// x = M^T y as a sum of scaled rows (contiguous, no reduction).
// REQUIRES: x does not alias y.
void DenseInverseScalar(const float* m, const float* y, float* x, int dim) {
  for (int j = 0; j < dim; ++j) x[j] = 0.0f;
  for (int i = 0; i < dim; ++i) {
    const float* row = m + static_cast<size_t>(i) * dim;
    const float yi = y[i];
    for (int j = 0; j < dim; ++j) x[j] += row[j] * yi;
  }
}

void DenseForward(const float* m, const float* x, float* y, int dim) {
  switch (ActiveSimdLevel()) {
    case SimdLevel::kAvx512:
      return rotation_internal::DenseForwardAvx512(m, x, y, dim);
    case SimdLevel::kAvx2:
      return rotation_internal::DenseForwardAvx2(m, x, y, dim);
    case SimdLevel::kScalar:
      break;
  }
  DenseForwardScalar(m, x, y, dim);
}

void DenseInverse(const float* m, const float* y, float* x, int dim) {
  switch (ActiveSimdLevel()) {
    case SimdLevel::kAvx512:
      return rotation_internal::DenseInverseAvx512(m, y, x, dim);
    case SimdLevel::kAvx2:
      return rotation_internal::DenseInverseAvx2(m, y, x, dim);
    case SimdLevel::kScalar:
      break;
  }
  DenseInverseScalar(m, y, x, dim);
}

// y = diag(post) H diag(pre) x / sqrt(n) on the active level.
void SignedFwht(const float* x, float* y, int n, const float* pre_signs,
                const float* post_signs) {
  switch (ActiveSimdLevel()) {
    case SimdLevel::kAvx512:
      return rotation_internal::SignedFwhtAvx512(x, y, n, pre_signs, post_signs);
    case SimdLevel::kAvx2:
      return rotation_internal::SignedFwhtAvx2(x, y, n, pre_signs, post_signs);
    case SimdLevel::kScalar:
      break;
  }
  if (pre_signs != nullptr) {
    for (int i = 0; i < n; ++i) y[i] = x[i] * pre_signs[i];
  } else if (x != y) {
    std::memcpy(y, x, static_cast<size_t>(n) * sizeof(float));
  }
  FastWalshHadamardScalar(y, n);
  if (post_signs != nullptr) {
    for (int i = 0; i < n; ++i) y[i] *= post_signs[i];
  }
}

// Copy of `src` that stays valid while the output is written over it: a stack
// buffer for the usual head dims, the heap only above 1024 floats.
class Scratch {
 public:
  Scratch(const float* src, int n) {
    if (n > kStackFloats) {
      heap_ = std::make_unique<float[]>(static_cast<size_t>(n));
      data_ = heap_.get();
    } else {
      data_ = stack_;
    }
    std::memcpy(data_, src, static_cast<size_t>(n) * sizeof(float));
  }
  const float* data() const { return data_; }

 private:
  static constexpr int kStackFloats = 1024;
  float stack_[kStackFloats];
  std::unique_ptr<float[]> heap_;
  float* data_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const Rotation>> Rotation::Create(int dim, uint64_t seed,
                                                                 Kind kind) {
  if (dim < 1 || dim > kMaxRotationDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation dim must be in [1, ", kMaxRotationDim, "], got ", dim));
  }
  if (kind == Kind::kAuto) {
    kind = IsPowerOfTwo(dim) ? Kind::kRandomizedHadamard : Kind::kDense;
  }
  switch (kind) {
    case Kind::kRandomizedHadamard:
    case Kind::kPlainHadamard:
      if (!IsPowerOfTwo(dim)) {
        return absl::InvalidArgumentError(
            absl::StrCat("Hadamard rotation needs a power-of-two dim, got ", dim));
      }
      break;
    case Kind::kDense:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown rotation kind ", static_cast<int>(kind),
                       ", want kAuto, kRandomizedHadamard, kDense or kPlainHadamard"));
  }

  std::shared_ptr<Rotation> rotation(new Rotation(dim, seed, kind));
  if (kind == Kind::kRandomizedHadamard) {
    Random random(seed);
    rotation->signs_.resize(static_cast<size_t>(dim));
    for (float& sign : rotation->signs_) sign = random.NextSign();
  } else if (kind == Kind::kDense) {
    rotation->matrix_ = HaarOrthogonal(dim, seed);
  }
  return std::shared_ptr<const Rotation>(std::move(rotation));
}

void Rotation::Forward(const float* x, float* y) const {
  switch (kind_) {
    case Kind::kRandomizedHadamard:
      SignedFwht(x, y, dim_, signs_.data(), nullptr);
      return;
    case Kind::kPlainHadamard:
      SignedFwht(x, y, dim_, nullptr, nullptr);
      return;
    case Kind::kDense:
    case Kind::kAuto:  // never stored
      if (x == y) {
        Scratch copy(x, dim_);
        DenseForward(matrix_.data(), copy.data(), y, dim_);
      } else {
        DenseForward(matrix_.data(), x, y, dim_);
      }
      return;
  }
}

void Rotation::Inverse(const float* y, float* x) const {
  switch (kind_) {
    case Kind::kRandomizedHadamard:
      SignedFwht(y, x, dim_, nullptr, signs_.data());
      return;
    case Kind::kPlainHadamard:
      SignedFwht(y, x, dim_, nullptr, nullptr);
      return;
    case Kind::kDense:
    case Kind::kAuto:
      if (x == y) {
        Scratch copy(y, dim_);
        DenseInverse(matrix_.data(), copy.data(), x, dim_);
      } else {
        DenseInverse(matrix_.data(), y, x, dim_);
      }
      return;
  }
}

void FastWalshHadamardScalar(float* x, int n) {
  // Stage h = 1, 2, 4, ...: the SIMD versions perform exactly these additions
  // and subtractions, so all paths agree bit for bit.
  for (int h = 1; h < n; h <<= 1) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int i = 0; i < n; ++i) x[i] *= scale;
}

void FastWalshHadamard(float* x, int n) { SignedFwht(x, x, n, nullptr, nullptr); }

}  // namespace tqkv
