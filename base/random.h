// Deterministic pseudo-random numbers for everything that is part of the stored
// format (rotation signs, dense rotations, sketch matrices) and for synthetic
// test data. std::*_distribution is implementation-defined, so tqkv uses its own
// generator and transforms: the same seed gives the same numbers everywhere.
#ifndef TQKV_BASE_RANDOM_H_
#define TQKV_BASE_RANDOM_H_

#include <cstdint>

namespace tqkv {

// SplitMix64 step: a strong 64-bit mixer, used to expand and derive seeds.
uint64_t SplitMix64(uint64_t& state);

// Derives an independent seed for a component (a layer, a part of a codec)
// from a base seed and up to two small identifiers.
uint64_t DeriveSeed(uint64_t base, uint64_t a, uint64_t b = 0);

// xoshiro256** (Blackman & Vigna), seeded through SplitMix64. Not thread-safe;
// use one per thread.
class Random {
 public:
  explicit Random(uint64_t seed);

  uint64_t NextU64();
  // Uniform in [0, 1) with 53 random bits.
  double NextDouble();
  // Standard normal (Box-Muller on NextDouble, caching the second value).
  double NextGaussian();
  // +1 or -1 with equal probability.
  float NextSign() { return (NextU64() >> 63) ? -1.0f : 1.0f; }
  // Uniform integer in [0, n). REQUIRES: n > 0.
  uint64_t NextBelow(uint64_t n);

 private:
  uint64_t s_[4];
  bool has_spare_ = false;
  double spare_ = 0.0;
};

}  // namespace tqkv

#endif  // TQKV_BASE_RANDOM_H_
