#include "kernels/rotation.h"

#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/simd/rotation_kernels.h"
#include "kernels/simd/cpu_features.h"
#include "base/random.h"

// This file is compiled for baseline x86-64: it holds no intrinsics and reaches
// the AVX code only through ActiveSimdLevel().

namespace tqkv {
namespace {

constexpr char kHadamardDims[] = "dim = 2^k * m with m in {1, 12, 20, 28}";

// chi(a mod q) for a prime q: 0 for 0, +1 for nonzero squares, -1 otherwise.
int QuadraticCharacter(int a, int q) {
  a = ((a % q) + q) % q;
  if (a == 0) return 0;
  for (int x = 1; x < q; ++x) {
    if (x * x % q == a) return 1;
  }
  return -1;
}

// [[0, 1^T], [lower * 1, Q]], order q + 1, row-major; Q the Jacobsthal matrix
// Q_ij = chi(j - i).
std::vector<int> BorderedJacobsthal(int q, int lower) {
  const int n = q + 1;
  std::vector<int> k(static_cast<size_t>(n * n), 0);
  for (int j = 1; j < n; ++j) {
    k[j] = 1;
    k[j * n] = lower;
  }
  for (int i = 0; i < q; ++i) {
    for (int j = 0; j < q; ++j) k[(i + 1) * n + (j + 1)] = QuadraticCharacter(j - i, q);
  }
  return k;
}

// P_m as documented at Rotation::hadamard_factor(), row-major.
std::vector<float> PaleyHadamard(int m) {
  std::vector<float> p(static_cast<size_t>(m * m));
  if (m == 28) {  // Paley II, q = 13
    const int n = 14;
    const std::vector<int> c = BorderedJacobsthal(13, 1);
    const int a[2][2] = {{1, 1}, {1, -1}};
    const int b[2][2] = {{1, -1}, {-1, -1}};
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        for (int s = 0; s < 2; ++s) {
          for (int t = 0; t < 2; ++t) {
            const int v = c[i * n + j] * a[s][t] + (i == j ? b[s][t] : 0);
            p[(2 * i + s) * m + (2 * j + t)] = static_cast<float>(v);
          }
        }
      }
    }
  } else {  // Paley I, q = m - 1 = 11 or 19
    const std::vector<int> k = BorderedJacobsthal(m - 1, -1);
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < m; ++j) {
        p[i * m + j] = static_cast<float>(k[i * m + j] + (i == j ? 1 : 0));
      }
    }
  }
  return p;
}

struct HadamardFactor {
  std::vector<float> p;   // P_m
  std::vector<float> pt;  // P_m^T
};

HadamardFactor MakeHadamardFactor(int m) {
  HadamardFactor f;
  f.p = PaleyHadamard(m);
  f.pt.resize(f.p.size());
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < m; ++j) f.pt[j * m + i] = f.p[i * m + j];
  }
  return f;
}

// The tables for m = 12, 20, 28, built on first use and never destroyed.
const HadamardFactor& GetHadamardFactor(int m) {
  static const std::array<HadamardFactor, 3>* const factors =
      new std::array<HadamardFactor, 3>{MakeHadamardFactor(12), MakeHadamardFactor(20), MakeHadamardFactor(28)};
  return (*factors)[m == 12 ? 0 : m == 20 ? 1 : 2];
}

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
// Q diag(sign(diag(R))), i.e. the Q of the unique QR with R_ii > 0. The steps
// are plain double arithmetic in a fixed order; the float result can only move
// if libm's log/sin/cos (inside NextGaussian) or FMA contraction change the
// float64 values by enough to cross a float rounding boundary. The
// StoredFormatIsPinned test watches for that.
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
    case SimdLevel::kAvx512Vnni:
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
    case SimdLevel::kAvx512Vnni:
      return rotation_internal::DenseInverseAvx512(m, y, x, dim);
    case SimdLevel::kAvx2:
      return rotation_internal::DenseInverseAvx2(m, y, x, dim);
    case SimdLevel::kScalar:
      break;
  }
  DenseInverseScalar(m, y, x, dim);
}

// y = diag(post) H diag(pre) x / sqrt(n) on the active level.
void SignedFwht(const float* x, float* y, int n, const float* pre_signs, const float* post_signs) {
  switch (ActiveSimdLevel()) {
    case SimdLevel::kAvx512:
    case SimdLevel::kAvx512Vnni:
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

// The portable Kronecker transform (see KronHadamardScalar): plain loops over
// compile-time widths, in exactly the operation order that the SIMD versions
// reproduce.
template <int kM>
void KronHadamardRows(const float* x, float* y, int rows, const float* columns, const float* pre, const float* post,
                      float scale) {
  // Rows times F. Each row is read into t before its output is written, so
  // x == y is safe.
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + r * kM;
    float t[kM];
    if (pre != nullptr) {
      for (int k = 0; k < kM; ++k) t[k] = xr[k] * pre[r * kM + k];
    } else {
      for (int k = 0; k < kM; ++k) t[k] = xr[k];
    }
    float acc[kM];
    for (int c = 0; c < kM; ++c) acc[c] = t[0] * columns[c];
#pragma GCC unroll 28
    for (int k = 1; k < kM; ++k) {
      for (int c = 0; c < kM; ++c) acc[c] += t[k] * columns[k * kM + c];
    }
    float* yr = y + r * kM;
    if (rows > 1) {
      for (int c = 0; c < kM; ++c) yr[c] = acc[c];
    } else if (post != nullptr) {
      for (int c = 0; c < kM; ++c) yr[c] = acc[c] * (scale * post[c]);
    } else {
      for (int c = 0; c < kM; ++c) yr[c] = acc[c] * scale;
    }
  }
  // Walsh-Hadamard butterflies across rows, stage h = 1, 2, 4, ... rows: rows
  // [i, i + h) and [i + h, i + 2h) are contiguous spans of h * kM floats.
  // The last stage scales.
  const int n = rows * kM;
  for (int h = 1; h < rows; h *= 2) {
    const int span = h * kM;
    const bool last = 2 * h == rows;
    for (int i = 0; i < n; i += 2 * span) {
      float* __restrict a = y + i;
      float* __restrict b = y + i + span;
      if (!last) {
        for (int e = 0; e < span; ++e) {
          const float u = a[e];
          const float v = b[e];
          a[e] = u + v;
          b[e] = u - v;
        }
      } else if (post != nullptr) {
        const float* pa = post + i;
        const float* pb = post + i + span;
        for (int e = 0; e < span; ++e) {
          const float u = a[e];
          const float v = b[e];
          a[e] = (u + v) * (scale * pa[e]);
          b[e] = (u - v) * (scale * pb[e]);
        }
      } else {
        for (int e = 0; e < span; ++e) {
          const float u = a[e];
          const float v = b[e];
          a[e] = (u + v) * scale;
          b[e] = (u - v) * scale;
        }
      }
    }
  }
}

// y = diag(post) (H_rows kron F) diag(pre) x * scale on the active level.
void KronHadamard(const float* x, float* y, int rows, int m, const float* columns, const float* pre_signs,
                  const float* post_signs, float scale) {
  switch (ActiveSimdLevel()) {
    case SimdLevel::kAvx512:
    case SimdLevel::kAvx512Vnni:
      return rotation_internal::KronHadamardAvx512(x, y, rows, m, columns, pre_signs, post_signs, scale);
    case SimdLevel::kAvx2:
      return rotation_internal::KronHadamardAvx2(x, y, rows, m, columns, pre_signs, post_signs, scale);
    case SimdLevel::kScalar:
      break;
  }
  rotation_internal::KronHadamardScalar(x, y, rows, m, columns, pre_signs, post_signs, scale);
}

// Copy of `src` that stays valid while the output is written over it.
// REQUIRES: n <= kMaxDenseRotationDim.
class Scratch {
 public:
  Scratch(const float* src, int n) { std::memcpy(data_, src, static_cast<size_t>(n) * sizeof(float)); }
  const float* data() const { return data_; }

 private:
  float data_[kMaxDenseRotationDim];
};

}  // namespace

namespace rotation_internal {

void KronHadamardScalar(const float* x, float* y, int rows, int m, const float* columns, const float* pre,
                        const float* post, float scale) {
  switch (m) {
    case 12:
      return KronHadamardRows<12>(x, y, rows, columns, pre, post, scale);
    case 20:
      return KronHadamardRows<20>(x, y, rows, columns, pre, post, scale);
    case 28:
      return KronHadamardRows<28>(x, y, rows, columns, pre, post, scale);
    default:
      return;  // unreachable: Rotation::Create admits no other m
  }
}

}  // namespace rotation_internal

int HadamardFactorOrder(int dim) {
  if (dim < 1 || dim > kMaxRotationDim) return 0;
  int odd = dim;
  while (odd % 2 == 0) odd /= 2;
  switch (odd) {
    case 1:
      return 1;
    case 3:
    case 5:
    case 7:
      // m = 4 * odd; dim = 2^k * m needs at least two factors of two.
      return dim % (4 * odd) == 0 ? 4 * odd : 0;
    default:
      return 0;
  }
}

absl::StatusOr<std::shared_ptr<const Rotation>> Rotation::Create(int dim, uint64_t seed, Kind kind) {
  if (dim < 1 || dim > kMaxRotationDim) {
    return absl::InvalidArgumentError(absl::StrCat("rotation dim must be in [1, ", kMaxRotationDim, "], got ", dim));
  }
  const int order = HadamardFactorOrder(dim);
  if (kind == Kind::kAuto) {
    kind = order > 0 ? Kind::kRandomizedHadamard : Kind::kDense;
  }
  switch (kind) {
    case Kind::kRandomizedHadamard:
    case Kind::kPlainHadamard:
      if (order == 0) {
        return absl::InvalidArgumentError(absl::StrCat("Hadamard rotation needs ", kHadamardDims, ", got ", dim));
      }
      break;
    case Kind::kDense:
      if (dim > kMaxDenseRotationDim) {
        return absl::InvalidArgumentError(absl::StrCat("dense rotation supports dim <= ", kMaxDenseRotationDim,
                                                       ", got ", dim, " (Hadamard rotations support ", kHadamardDims,
                                                       ")"));
      }
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown rotation kind ", static_cast<int>(kind),
                                                     ", want kAuto, kRandomizedHadamard, kDense or kPlainHadamard"));
  }

  std::shared_ptr<Rotation> rotation(new Rotation(dim, seed, kind));
  if (kind == Kind::kDense) {
    rotation->matrix_ = HaarOrthogonal(dim, seed);
    return std::shared_ptr<const Rotation>(std::move(rotation));
  }
  rotation->factor_order_ = order;
  rotation->factor_rows_ = dim / order;
  rotation->scale_ = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim)));
  if (order > 1) {
    const HadamardFactor& factor = GetHadamardFactor(order);
    rotation->factor_ = &factor.p;
    rotation->factor_transpose_ = &factor.pt;
  }
  if (kind == Kind::kRandomizedHadamard) {
    Random random(seed);
    rotation->signs_.resize(static_cast<size_t>(dim));
    for (float& sign : rotation->signs_) sign = random.NextSign();
  }
  return std::shared_ptr<const Rotation>(std::move(rotation));
}

const std::vector<float>& Rotation::hadamard_factor() const {
  static const std::vector<float>* const empty = new std::vector<float>();
  return factor_ != nullptr ? *factor_ : *empty;
}

void Rotation::Forward(const float* x, float* y) const {
  switch (kind_) {
    case Kind::kRandomizedHadamard:
    case Kind::kPlainHadamard: {
      const float* pre = signs_.empty() ? nullptr : signs_.data();
      if (factor_ == nullptr) {
        SignedFwht(x, y, dim_, pre, nullptr);
      } else {
        // y = (H kron P) (D x): rows times P, i.e. columns given by P^T.
        KronHadamard(x, y, factor_rows_, factor_order_, factor_transpose_->data(), pre, nullptr, scale_);
      }
      return;
    }
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
    case Kind::kPlainHadamard: {
      const float* post = signs_.empty() ? nullptr : signs_.data();
      if (factor_ == nullptr) {
        SignedFwht(y, x, dim_, nullptr, post);
      } else {
        // x = D (H kron P^T) y: rows times P^T, whose columns are P's rows.
        KronHadamard(y, x, factor_rows_, factor_order_, factor_->data(), nullptr, post, scale_);
      }
      return;
    }
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
