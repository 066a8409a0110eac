// Deterministic synthetic keys and queries for tests and benchmarks.
//
// Every number comes from tqkv::Random (base/random.h), never from
// std::*_distribution, so the same seed gives the same data on every
// platform and compiler, and published figures can be reproduced. The
// recipes below are part of that contract: changing one changes every
// figure measured on synthetic data.
//
// All outputs are row-major [n, dim] float32. Rows are generated in order
// from one stream, so the first m rows for (n, seed) equal the output for
// (m, seed). The three generators draw from different streams derived from
// the seed (tqkv::DeriveSeed), so GaussianVectors(n, d, s), Queries(n, d, s)
// and the noise of OutlierKeys(n, d, s) are independent of one another.
//
// Functions keep no state and are safe to call concurrently.
#ifndef TQKV_EVAL_SYNTHETIC_H_
#define TQKV_EVAL_SYNTHETIC_H_

#include <cstdint>
#include <vector>

namespace tqkv {
namespace eval {

// iid standard normal entries, [n, dim]. Returns an empty vector when n <= 0
// or dim <= 0.
std::vector<float> GaussianVectors(int64_t n, int dim, uint64_t seed);

// Gaussian queries, [n, dim]: iid N(0, 1) entries, from a stream independent
// of GaussianVectors and OutlierKeys with the same seed. Empty when n <= 0 or
// dim <= 0.
std::vector<float> Queries(int64_t n, int dim, uint64_t seed);

// The shape of the key distribution reported for real K caches
// (docs/turboquant.md section 3): a few channels much larger than the rest,
// and a per-channel offset shared by all keys.
struct OutlierKeyOptions {
  // Number of "hot" channels. Clamped to [0, dim].
  int hot_channels = 4;
  // Standard deviation of the hot channels' noise (the others have 1).
  double hot_scale = 10.0;
  // Standard deviation of the per-channel offsets. 0 gives zero-mean keys.
  double offset_std = 1.0;
};

// Keys with outlier channels, [n, dim]. The recipe:
//   hot    = OutlierHotChannels(dim, seed, options): `hot_channels` distinct
//            channels drawn uniformly (partial Fisher-Yates with
//            Random::NextBelow) from a stream seeded DeriveSeed(seed, 2).
//   offset = for c in 0..dim-1: offset[c] = offset_std * g, g drawn
//            N(0, 1) from a stream seeded DeriveSeed(seed, 3).
//   k[i, c] = g[i, c] * (c in hot ? hot_scale : 1) + offset[c], g[i, c] iid
//            N(0, 1) drawn row by row from a stream seeded DeriveSeed(seed, 4).
// So channel c has mean offset[c] and standard deviation hot_scale (hot) or 1.
// Empty when n <= 0 or dim <= 0.
std::vector<float> OutlierKeys(int64_t n, int dim, uint64_t seed, const OutlierKeyOptions& options = {});

// The hot channels OutlierKeys(n, dim, seed, options) uses, in increasing
// order. Empty when dim <= 0.
std::vector<int> OutlierHotChannels(int dim, uint64_t seed, const OutlierKeyOptions& options = {});

}  // namespace eval
}  // namespace tqkv

#endif  // TQKV_EVAL_SYNTHETIC_H_
