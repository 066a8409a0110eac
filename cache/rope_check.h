// Does a layer's keys' shared part rotate like the cache's RoPE says?
//
// Pre-RoPE centering (kernels/key_centering.h) subtracts R_t m from the key
// at position t, with R_t the cache's RoPE. When the model rotated its keys
// with another RoPE (another base or scaling, the other pair layout: a
// config hand-copied from another model), the keys' shared part seen through
// the cache's R_t^-1 is no longer a fixed vector: it turns, pair by pair, at
// the difference of the two frequencies. The mean then captures only the
// slowest pairs, and at long positions its add-back points the wrong way.
// Nothing fails; the codec just loses most of the gain (SmolLM2 served with
// Llama-3.1's RoPE: +14.4% perplexity where its own RoPE gives +9.5%).
//
// The check, on the keys of a layer's first append for a sequence (the ones
// the mean is estimated from, plus up to kMaxTokens after them): per (KV head,
// rotary pair), the complex pair w_t = R_t^-1 k_t (cache frame) and its
// autocorrelation at lag L,
//
//   rho(L) = mean_t w_{t+L} conj(w_t).
//
// For keys w_t = m e^{i D t} + noise (m the shared part, D the pair's residual
// rotation per token, 0 when the RoPE is right) rho(L) = |m|^2 e^{i D L}: the
// magnitude keeps the shared energy however fast it turns (a mean over the
// window would average it away), the phase measures the turn. Noise adds
// only ~e / sqrt(tokens - L) (e the pair's energy), so pairs below
// kSignificance times that are left out: noise-only keys have no shared part
// to judge. Over the significant pairs of a layer, at lags 8, 16, ..., 128
// (up to tokens / 2):
//
//   shared(L)    = sum |rho| / key energy on the rotary pairs
//   coherence(L) = mean of cos(arg rho)     (1: the shared part stays put)
//
// A mismatch is shared(L) >= kMinShared and coherence(L) < kMaxCoherence at
// some lag. Every significant pair counts the same in the coherence: the
// slowest pairs carry most of the shared energy and barely turn under any
// RoPE over a few hundred tokens, so an energy-weighted mean would hide the
// mid-frequency pairs where a wrong RoPE shows. Measured on SmolLM2-135M's
// keys (30 layers; the first 256 tokens of GPL-3, Apache-2.0 and a C++
// file; tools: a capture of transformers' keys through the same
// arithmetic): its own RoPE 0.97-1.00, Llama-3.1's 0.35-0.63, base 10000
// 0.26-0.55, the other pair layout 0.24-0.51; over 128 tokens its own
// 0.94-1.00 and Llama-3.1's 0.27-0.63; over 64 tokens Llama-3.1's reads
// 0.76-0.95 and is partly missed. On synthetic keys (a shared part of 0.3 to
// 0.7 of the energy, plus noise) the right RoPE gives 0.99-1.00 and every
// wrong one 0.08-0.75 over 256 tokens. A residual turn under ~1 / 128 rad
// per token goes unreported: the check warns about the mismatches it can
// measure, it does not prove a RoPE right.
//
// Cost: tokens x lags x rotary pairs x heads complex multiply-adds (256 x 5 x
// 64 x 8 for d = 128 and 8 KV heads: 4 ms per layer on one core of the
// shared 2-core EPYC the tests run on), on at most kChecksPerLayer sequences
// per layer: the RoPE is the model's, not the sequence's, so the first few
// say it.
//
// Thread safety: RopeCheck is thread-safe (atomics); the function is pure.
#ifndef TQKV_CACHE_ROPE_CHECK_H_
#define TQKV_CACHE_ROPE_CHECK_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/key_centering.h"

namespace tqkv {

struct RopeCoherence {
  int64_t tokens = 0;      // tokens measured; 0: too few (under kMinTokens), no verdict
  int lag = 0;             // the lag of the lowest coherence among those with a shared part
  double shared = 0.0;     // shared(lag)
  double coherence = 1.0;  // coherence(lag)
  bool mismatch = false;
};

struct RopeCheckLimits {
  static constexpr int64_t kMinTokens = 64;
  static constexpr int64_t kMaxTokens = 256;
  // Tokens left out at position 0 when the window starts there: the first
  // tokens' keys (attention sinks) are outliers in every model measured.
  static constexpr int64_t kSkipFirst = 4;
  static constexpr double kSignificance = 4.0;
  static constexpr double kMinShared = 0.2;
  static constexpr double kMaxCoherence = 0.8;
  static constexpr int kChecksPerLayer = 4;
};

// Measures rows [begin, end) (at most kMaxTokens of them; row t at keys +
// t * stride, position angles.first_position + t, heads head_dim apart) in
// the frame of `rope`. No verdict (tokens 0) for a table without pairs or
// fewer than kMinTokens rows. REQUIRES: end <= angles.n.
RopeCoherence MeasureRopeCoherence(const RopeTable& rope, const RopeAngles& angles, const float* keys, int64_t begin,
                                   int64_t end, int64_t stride, int heads, int head_dim);

class RopeCheck {
 public:
  // `cache`: the name the log line gives.
  RopeCheck(std::string cache, int layers);
  RopeCheck(const RopeCheck&) = delete;
  RopeCheck& operator=(const RopeCheck&) = delete;

  // MeasureRopeCoherence on one sequence's first keys of `layer`, while the
  // layer has had fewer than kChecksPerLayer verdicts; a mismatch is counted,
  // and the layer's first one logged (one line to stderr).
  void Observe(int layer, const RopeTable& rope, const RopeAngles& angles, const float* keys, int64_t begin,
               int64_t end, int64_t stride, int heads, int head_dim);

  // Mismatches counted so far.
  uint64_t mismatches() const { return mismatches_.load(std::memory_order_relaxed); }

 private:
  const std::string cache_;
  const int layers_;
  std::unique_ptr<std::atomic<int>[]> verdicts_;  // per layer
  std::unique_ptr<std::atomic<bool>[]> logged_;   // per layer
  std::atomic<uint64_t> mismatches_{0};
};

}  // namespace tqkv

#endif  // TQKV_CACHE_ROPE_CHECK_H_
