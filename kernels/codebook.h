// Lloyd-Max scalar codebooks for TurboQuant.
//
// After a random rotation, each coordinate t of a unit vector in R^d follows the
// exact marginal of the uniform distribution on the sphere S^{d-1}:
//
//   f_d(t) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) * (1 - t^2)^((d-3)/2),  t in [-1, 1]
//
// (close to N(0, 1/d) for large d, but not equal to it; tqkv uses the exact one).
// The codebook is the MSE-optimal quantizer with 2^bits levels for that density,
// found by Lloyd-Max iteration in float64 to a tight fixed point. It depends only
// on (head_dim, bits): no calibration data, no per-block scale or zero point.
//
// Codebooks are part of the stored format. They are computed, not shipped, so
// a build yields bit-identical float centroids for the same (head_dim, bits);
// the float64 solution agrees across math libraries to ~1e-12/sqrt(d), far
// below float resolution, so a differing rounding is possible but rare.
// Within one process every backend reads the same tables (the CUDA backend
// copies them from the host), so store and score always agree.
#ifndef TQKV_KERNELS_CODEBOOK_H_
#define TQKV_KERNELS_CODEBOOK_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace tqkv {

// Range of dimensions a codebook can be built for. Head dims of models are
// 32..512; the outlier-split codecs also need codebooks for channel subsets
// (e.g. 16 of 64 channels), hence the wider range.
inline constexpr int kMinCodebookDim = 3;
inline constexpr int kMaxCodebookDim = 8192;

struct Codebook {
  int dim = 0;   // d: the dimension of the sphere the coordinate comes from.
  int bits = 0;  // 1..8: 2^bits levels.

  // 2^bits centroids in coordinate units (a coordinate of a *unit* vector, so
  // typical magnitudes are ~1/sqrt(dim)), strictly ascending, symmetric about 0.
  std::vector<float> centroids;
  // 2^bits - 1 decision boundaries (midpoints of adjacent centroids), ascending.
  std::vector<float> boundaries;
  // The same centroids in float64, as converged.
  std::vector<double> centroids_f64;

  // D_mse = E ||u - Q(u)||^2 for a uniform unit vector u in R^dim, i.e. dim
  // times the per-coordinate mean squared error under f_d. Dimensionless.
  double distortion = 0.0;
  // Solver steps used to converge (Newton steps on the Lloyd-Max fixed-point
  // equations, with plain Lloyd steps as a fallback).
  int iterations = 0;

  int levels() const { return 1 << bits; }
};

// Returns the process-wide codebook for (dim, bits), computing it on first use
// (under a millisecond) and caching it for the life of the process. Thread-safe; the
// returned pointer stays valid forever.
// Fails with INVALID_ARGUMENT unless kMinCodebookDim <= dim <= kMaxCodebookDim
// and 1 <= bits <= 8.
absl::StatusOr<const Codebook*> GetCodebook(int dim, int bits);

// Computes a codebook from scratch, uncached. Same arguments and errors as
// GetCodebook; deterministic.
absl::StatusOr<Codebook> ComputeCodebook(int dim, int bits);

// The normalized density f_d(t) above, in float64. 0 outside [-1, 1].
double SphereCoordinateDensity(int dim, double t);

// Index of the codebook level for coordinate value y: the number of boundaries
// strictly below y. REQUIRES: num_boundaries + 1 is a power of two (a
// codebook's boundaries). NaN maps to level 0 (codecs reject NaN earlier). A value exactly on a boundary maps to the
// lower level; the CUDA store kernel follows the same rule so that both produce the same bytes.
inline uint32_t QuantizeToLevel(const float* boundaries, int num_boundaries, float y) {
  // Branch-free binary search (the comparison feeds an add, not a jump):
  // quantization decisions are data-dependent and would mispredict.
  uint32_t lo = 0;
  for (int step = (num_boundaries + 1) >> 1; step > 0; step >>= 1) {
    lo += (y > boundaries[lo + step - 1]) ? static_cast<uint32_t>(step) : 0u;
  }
  return lo;
}

// QuantizeToLevel for n coordinates at once: levels[i] = #{boundaries < y[i]}.
// For up to 4 bits this counts comparisons against every boundary, a loop the
// compiler vectorizes; wider codebooks use the binary search per coordinate.
void QuantizeToLevels(const Codebook& codebook, const float* y, int n, uint8_t* levels);

}  // namespace tqkv

#endif  // TQKV_KERNELS_CODEBOOK_H_
