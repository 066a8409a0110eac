// Orthogonal rotations applied before scalar quantization.
//
// TurboQuant rotates each unit vector u to y = Pi u so that every coordinate of
// y follows the sphere marginal the codebook was built for, and outlier channels
// are spread over all coordinates.
//
//  * dim = a * m with a = 2^k and m in {1, 12, 20, 28} (every power of two, and
//    80, 96, 112, 160, 192, 224, 320, 384, ...): the randomized Hadamard
//    transform Pi = (H_a kron P_m) D / sqrt(dim). D is a seeded +-1 diagonal
//    (Random(seed).NextSign() in coordinate order), H_a the Sylvester
//    Walsh-Hadamard matrix, P_m a fixed Hadamard matrix of order m (P_1 = [1];
//    P_12, P_20, P_28 from the Paley constructions, see hadamard_factor()).
//    Every entry of Pi is +-1/sqrt(dim), so energy in a few hot channels is
//    spread evenly over all coordinates. Applied in O(dim (m + log a)) with
//    SIMD: coordinate i = r * m + c is row r, column c of an a x m matrix;
//    each row is multiplied by P_m, then butterflies run across the rows.
//    The sign diagonal is kept on purpose: without it, inputs that correlate
//    with the rows of H_a kron P_m concentrate their energy in one coordinate
//    and the codebook clips it.
//  * Other dims up to kMaxDenseRotationDim (100, 3, 7, ...): a dense seeded
//    random orthogonal matrix (QR of a Gaussian matrix, computed in float64).
//    Its columns are uneven, so a few hot channels give some coordinates more
//    variance than the codebook assumes: on outlier-channel keys at 3 bits it
//    measured 0.91-1.12x the codebook model's error over head dims 80-192,
//    the Hadamard rotations 0.87-0.90x. It also costs O(dim^2) per vector.
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
// kDense keeps dim^2 floats and builds them with an O(dim^3) QR.
inline constexpr int kMaxDenseRotationDim = 1024;

// The m of dim = 2^k * m with m in {1, 12, 20, 28} (1 for powers of two), or 0
// when dim has no such form or is outside [1, kMaxRotationDim]: the dims the
// Hadamard kinds support.
int HadamardFactorOrder(int dim);

class Rotation {
 public:
  enum class Kind {
    kAuto,  // kRandomizedHadamard when HadamardFactorOrder(dim) > 0, else kDense.
    kRandomizedHadamard,
    kDense,
    kPlainHadamard,  // (H_a kron P_m) / sqrt(d) without the sign diagonal: for
                     // tests that show why D matters.
  };

  // Fails with INVALID_ARGUMENT if dim is outside [1, kMaxRotationDim], if a
  // Hadamard kind is asked for a dim without the form 2^k * m, m in
  // {1, 12, 20, 28}, or if kDense (also as the kAuto choice) is asked for a
  // dim above kMaxDenseRotationDim.
  // Cost: Hadamard kinds O(dim). kDense runs an O(dim^3) float64 QR and keeps
  // dim^2 floats (about 1 ms at dim 100, 0.2 s at 576, 1 s at 1024): build it
  // once per (dim, seed), not per request.
  static absl::StatusOr<std::shared_ptr<const Rotation>> Create(int dim, uint64_t seed, Kind kind = Kind::kAuto);

  int dim() const { return dim_; }
  uint64_t seed() const { return seed_; }
  Kind kind() const { return kind_; }  // never kAuto

  // y = Pi x. x and y are dim() floats; x == y (in place) is allowed, partial
  // overlap is not. Dispatches on ActiveSimdLevel(): Hadamard kinds give
  // bit-identical results at every level (their only multiplications are by
  // +-1, which is exact, and by the float 1/sqrt(dim) at the end); kDense
  // agrees across levels only to float rounding (the SIMD paths use FMA and
  // another summation order). No allocation.
  void Forward(const float* x, float* y) const;
  // x = Pi^T y. Same aliasing, precision and allocation rules as Forward.
  void Inverse(const float* y, float* x) const;

  // kRandomizedHadamard: the diagonal of D (+1.0f / -1.0f), dim() entries, the
  // first dim() values of Random(seed()).NextSign(). Empty for other kinds.
  const std::vector<float>& signs() const { return signs_; }
  // kDense: Pi, row-major dim() x dim() (y_i = sum_j matrix[i*dim+j] x_j).
  // Empty for the Hadamard kinds, whose Pi is given by signs() and
  // hadamard_factor() (and is never materialized).
  const std::vector<float>& matrix() const { return matrix_; }

  // Hadamard kinds: m, the order of the non-power-of-two factor P_m (1 for
  // power-of-two dims; dim() = a * m with a a power of two). 0 for kDense.
  int hadamard_factor_order() const { return factor_order_; }
  // Hadamard kinds with m > 1: P_m, row-major m x m, entries +1.0f / -1.0f,
  // P_m P_m^T = m I. Fixed (independent of the seed), part of the stored
  // format. Built from a prime q and its q x q Jacobsthal matrix
  // Q_ij = chi(j - i mod q), chi the quadratic character mod q (chi(0) = 0,
  // +1 for nonzero squares mod q, else -1), bordered by a first row and
  // column (index 0; Q's index i becomes i + 1), 1 a vector of ones:
  //   m = 12, 20: Paley I, q = m - 1 = 11, 19: P = I + [[0, 1^T], [-1, Q]].
  //   m = 28: Paley II, q = 13: C = [[0, 1^T], [1, Q]] (order 14),
  //     P = C kron [[1, 1], [1, -1]] + I_14 kron [[1, -1], [-1, -1]],
  //     with (A kron B)[2i + s][2j + t] = A_ij B_st.
  // Pi[r*m + c][r'*m + c'] = H_a[r][r'] P_m[c][c'] D[r'*m + c'] / sqrt(dim),
  // H_a[r][r'] = (-1)^popcount(r & r'), D = I for kPlainHadamard.
  // Empty for m <= 1.
  const std::vector<float>& hadamard_factor() const;

 private:
  Rotation(int dim, uint64_t seed, Kind kind) : dim_(dim), seed_(seed), kind_(kind) {}

  int dim_;
  uint64_t seed_;
  Kind kind_;
  int factor_order_ = 0;
  int factor_rows_ = 0;  // a = dim / m for the Hadamard kinds
  float scale_ = 0.0f;   // float(1 / sqrt(dim)) for the Hadamard kinds
  // Static tables for m > 1 (shared by every Rotation), null otherwise.
  const std::vector<float>* factor_ = nullptr;            // P_m
  const std::vector<float>* factor_transpose_ = nullptr;  // P_m^T
  std::vector<float> signs_;
  std::vector<float> matrix_;
};

// In-place orthonormal fast Walsh-Hadamard transform of n floats
// (x <- H x / sqrt(n), natural/Sylvester order, so it is its own inverse).
// Every implementation performs the same butterflies (a + b, a - b) in the
// same stage order h = 1, 2, 4, ... and one final multiply by the float
// 1/sqrt(n), so all of them return bit-identical results.
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
