#include "eval/synthetic.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "base/random.h"

namespace tqkv {
namespace eval {
namespace {

// Stream identifiers for DeriveSeed. Part of the stored recipe: never reuse
// or renumber.
constexpr uint64_t kGaussianStream = 0;
constexpr uint64_t kQueryStream = 1;
constexpr uint64_t kHotChannelStream = 2;
constexpr uint64_t kOffsetStream = 3;
constexpr uint64_t kOutlierNoiseStream = 4;

std::vector<float> StandardNormal(int64_t n, int dim, uint64_t seed) {
  if (n <= 0 || dim <= 0) return {};
  std::vector<float> out(static_cast<size_t>(n) * dim);
  Random random(seed);
  for (float& x : out) x = static_cast<float>(random.NextGaussian());
  return out;
}

}  // namespace

std::vector<float> GaussianVectors(int64_t n, int dim, uint64_t seed) {
  return StandardNormal(n, dim, DeriveSeed(seed, kGaussianStream));
}

std::vector<float> Queries(int64_t n, int dim, uint64_t seed) {
  return StandardNormal(n, dim, DeriveSeed(seed, kQueryStream));
}

std::vector<int> OutlierHotChannels(int dim, uint64_t seed, const OutlierKeyOptions& options) {
  if (dim <= 0) return {};
  const int count = std::clamp(options.hot_channels, 0, dim);
  std::vector<int> channels(dim);
  std::iota(channels.begin(), channels.end(), 0);
  Random random(DeriveSeed(seed, kHotChannelStream));
  for (int i = 0; i < count; ++i) {
    const int j = i + static_cast<int>(random.NextBelow(static_cast<uint64_t>(dim - i)));
    std::swap(channels[i], channels[j]);
  }
  channels.resize(count);
  std::sort(channels.begin(), channels.end());
  return channels;
}

std::vector<float> OutlierKeys(int64_t n, int dim, uint64_t seed, const OutlierKeyOptions& options) {
  if (n <= 0 || dim <= 0) return {};
  std::vector<double> scale(dim, 1.0);
  for (int c : OutlierHotChannels(dim, seed, options)) scale[c] = options.hot_scale;

  std::vector<double> offset(dim);
  Random offsets(DeriveSeed(seed, kOffsetStream));
  for (double& o : offset) o = options.offset_std * offsets.NextGaussian();

  std::vector<float> keys(static_cast<size_t>(n) * dim);
  Random noise(DeriveSeed(seed, kOutlierNoiseStream));
  for (int64_t i = 0; i < n; ++i) {
    float* row = keys.data() + i * dim;
    for (int c = 0; c < dim; ++c) {
      row[c] = static_cast<float>(noise.NextGaussian() * scale[c] + offset[c]);
    }
  }
  return keys;
}

}  // namespace eval
}  // namespace tqkv
