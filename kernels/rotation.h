// Orthogonal rotations applied before scalar quantization.
//
// TurboQuant rotates each unit vector u to y = Pi u so that every coordinate of
// y follows the sphere marginal the codebook was built for, and outlier channels
// are spread over all coordinates.
//
//  * Power-of-two dims: the randomized Hadamard transform Pi = H D / sqrt(d),
//    D a seeded +-1 diagonal, H the Walsh-Hadamard matrix, applied as an
//    O(d log d) butterfly with SIMD. The sign diagonal is kept on purpose:
//    without it, inputs that correlate with Walsh functions concentrate their
//    energy in one coordinate and the codebook clips it.
//  * Other dims (80, 96, 112, 160, 192, ...): a dense seeded random orthogonal
//    matrix (QR of a Gaussian matrix, computed in float64). A block-diagonal
//    Hadamard would not mix energy across blocks; the dense matrix reaches the
//    same error as the model on isotropic and outlier-channel inputs.
//
// A Rotation is immutable after Create and safe to use from many threads.
// The (dim, seed, kind) triple fully determines it on every machine: the
// rotation is part of the stored format.
#ifndef TQKV_KERNELS_ROTATION_H_
#define TQKV_KERNELS_ROTATION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

namespace tqkv {

inline constexpr int kMaxRotationDim = 8192;

class Rotation {
 public:
  enum class Kind {
    kAuto,           // kRandomizedHadamard for powers of two, else kDense.
    kRandomizedHadamard,
    kDense,
    kPlainHadamard,  // H / sqrt(d) without the sign diagonal: for tests that show why D matters.
  };

  // Fails with INVALID_ARGUMENT if dim is outside [1, kMaxRotationDim], or if a
  // Hadamard kind is asked for a dim that is not a power of two.
  static absl::StatusOr<std::shared_ptr<const Rotation>> Create(int dim, uint64_t seed,
                                                                Kind kind = Kind::kAuto);

  int dim() const { return dim_; }
  uint64_t seed() const { return seed_; }
  Kind kind() const { return kind_; }  // never kAuto

  // y = Pi x. x and y are dim() floats; x == y (in place) is allowed.
  void Forward(const float* x, float* y) const;
  // x = Pi^T y. In place allowed.
  void Inverse(const float* y, float* x) const;

  // kRandomizedHadamard: the diagonal of D (+1.0f / -1.0f), dim() entries.
  // Empty for other kinds.
  const std::vector<float>& signs() const { return signs_; }
  // kDense: Pi, row-major dim() x dim() (y_i = sum_j matrix[i*dim+j] x_j).
  // Empty for other kinds.
  const std::vector<float>& matrix() const { return matrix_; }

 private:
  Rotation(int dim, uint64_t seed, Kind kind) : dim_(dim), seed_(seed), kind_(kind) {}

  int dim_;
  uint64_t seed_;
  Kind kind_;
  std::vector<float> signs_;
  std::vector<float> matrix_;
};

// In-place orthonormal fast Walsh-Hadamard transform of n floats
// (x <- H x / sqrt(n), natural/Sylvester order, so it is its own inverse).
// REQUIRES: n is a power of two, 1 <= n <= kMaxRotationDim.
// Dispatches on ActiveSimdLevel().
void FastWalshHadamard(float* x, int n);

// The per-ISA implementations behind FastWalshHadamard, exposed so tests can
// check each against the scalar one. Each REQUIRES what FastWalshHadamard does;
// the AVX variants REQUIRE the CPU to support them (see cpu_features.h).
void FastWalshHadamardScalar(float* x, int n);
void FastWalshHadamardAvx2(float* x, int n);
void FastWalshHadamardAvx512(float* x, int n);

}  // namespace tqkv

#endif  // TQKV_KERNELS_ROTATION_H_
