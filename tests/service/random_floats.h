// Gaussian test data for the service suites: the same seed gives the same
// floats in every test that shares it.
#ifndef TQKV_TESTS_SERVICE_RANDOM_FLOATS_H_
#define TQKV_TESTS_SERVICE_RANDOM_FLOATS_H_

#include <cstdint>
#include <random>
#include <vector>

namespace tqkv {

inline std::vector<float> RandomFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

}  // namespace tqkv

#endif  // TQKV_TESTS_SERVICE_RANDOM_FLOATS_H_
