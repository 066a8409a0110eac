#include "cache/rope_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

namespace tqkv {

RopeCoherence MeasureRopeCoherence(const RopeTable& rope, const RopeAngles& angles, const float* keys, int64_t begin,
                                   int64_t end, int64_t stride, int heads, int head_dim) {
  using L = RopeCheckLimits;
  RopeCoherence out;
  const int pairs = rope.num_pairs();
  if (begin == 0 && end - begin > L::kMinTokens + L::kSkipFirst) begin = L::kSkipFirst;
  end = std::min(end, begin + L::kMaxTokens);
  const int64_t n = end - begin;
  if (pairs == 0 || n < L::kMinTokens) return out;
  out.tokens = n;
  // re/im[(h * pairs + i) * n + t]: the pair in the cache's pre-RoPE frame.
  const size_t rows = static_cast<size_t>(heads) * pairs;
  std::vector<double> re(rows * n), im(rows * n), energy(rows, 0.0);
  double total = 0.0;
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < pairs; ++i) {
      const size_t row = static_cast<size_t>(h) * pairs + i;
      double e = 0.0;
      for (int64_t t = 0; t < n; ++t) {
        const float* k = keys + (begin + t) * stride + static_cast<int64_t>(h) * head_dim;
        const double c = angles.cos[(begin + t) * angles.pairs + i];
        const double s = angles.sin[(begin + t) * angles.pairs + i];
        const double a = k[rope.first(i)], b = k[rope.second(i)];
        re[row * n + t] = a * c + b * s;
        im[row * n + t] = b * c - a * s;
        e += a * a + b * b;
      }
      energy[row] = e / n;
      total += e / n;
    }
  }
  if (total <= 0.0) return out;
  for (int lag = 8; lag <= n / 2; lag *= 2) {
    double magnitude = 0.0, cosines = 0.0;
    int significant = 0;
    const double noise = L::kSignificance / std::sqrt(static_cast<double>(n - lag));
    for (size_t row = 0; row < rows; ++row) {
      // rho = mean_t w_{t+lag} conj(w_t)
      const double* x = re.data() + row * n;
      const double* y = im.data() + row * n;
      double rho_re = 0.0, rho_im = 0.0;
      for (int64_t t = 0; t + lag < n; ++t) {
        rho_re += x[t + lag] * x[t] + y[t + lag] * y[t];
        rho_im += y[t + lag] * x[t] - x[t + lag] * y[t];
      }
      const double abs = std::hypot(rho_re, rho_im) / static_cast<double>(n - lag);
      if (abs <= noise * energy[row]) continue;
      magnitude += abs;
      cosines += rho_re / (abs * static_cast<double>(n - lag));
      ++significant;
    }
    const double shared = magnitude / total;
    if (shared < L::kMinShared) continue;
    const double coherence = cosines / significant;
    if (out.lag == 0 || coherence < out.coherence) {
      out.lag = lag;
      out.shared = shared;
      out.coherence = coherence;
    }
  }
  out.mismatch = out.lag != 0 && out.coherence < L::kMaxCoherence;
  return out;
}

RopeCheck::RopeCheck(std::string cache, int layers)
    : cache_(std::move(cache)), layers_(layers), verdicts_(new std::atomic<int>[layers]),
      logged_(new std::atomic<bool>[layers]) {
  for (int l = 0; l < layers; ++l) {
    verdicts_[l].store(0, std::memory_order_relaxed);
    logged_[l].store(false, std::memory_order_relaxed);
  }
}

void RopeCheck::Observe(int layer, const RopeTable& rope, const RopeAngles& angles, const float* keys, int64_t begin,
                        int64_t end, int64_t stride, int heads, int head_dim) {
  if (layer < 0 || layer >= layers_) return;
  if (verdicts_[layer].load(std::memory_order_relaxed) >= RopeCheckLimits::kChecksPerLayer) return;
  const RopeCoherence r = MeasureRopeCoherence(rope, angles, keys, begin, end, stride, heads, head_dim);
  if (r.tokens == 0) return;
  // Concurrent first appends may all pass the test above; only the first
  // kChecksPerLayer verdicts count.
  if (verdicts_[layer].fetch_add(1, std::memory_order_relaxed) >= RopeCheckLimits::kChecksPerLayer) return;
  if (!r.mismatch) return;
  mismatches_.fetch_add(1, std::memory_order_relaxed);
  if (logged_[layer].exchange(true, std::memory_order_relaxed)) return;
  std::fprintf(stderr,
               "tqkv-server: cache '%s' layer %d: the keys do not rotate like the cache's RoPE says "
               "(coherence %.2f at lag %d over %lld tokens; shared part %.2f of the key energy): pre-RoPE "
               "centering gains less; derive the config from the model (tqkv config --from-hf or --from-gguf). "
               "Logged once per layer, counted in tqkv_cache_rope_mismatches_total\n",
               cache_.c_str(), layer, r.coherence, r.lag, static_cast<long long>(r.tokens), r.shared);
}

}  // namespace tqkv
