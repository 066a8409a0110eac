// Key centering: the math that every backend and the cache share.
//
// Every key of a head carries a large component shared by all tokens (0.6-0.9
// of the key energy before RoPE in real models). The codec's error scales with
// the whole key norm while attention only uses the part that differs between
// keys, so the cache stores residuals and adds back, inside attention, exactly
// what it subtracted:
//
//   stored key   r_t = k_t - R_t m          (t: the token's position)
//   logit        q . k_t = q . r_t + q . R_t m
//
// m is one vector per (sequence, layer, KV head), fixed once set (see
// cache/kv_cache.h for where it comes from). R_t is the cache's rotary
// embedding at position t (RopeTable), or the identity for post-RoPE
// centering. Whatever R_t is, the add-back undoes the subtraction exactly, so
// a RoPE that does not match the model's costs only part of the gain.
//
// R_t acts on pairs of coordinates (a_i, b_i) with angle t * theta_i:
//   (R_t x)_a = x_a cos - x_b sin,  (R_t x)_b = x_a sin + x_b cos
// and leaves coordinates outside the rotary dims alone. Hence
//   q . R_t m = C + sum_i A_i cos(t theta_i) + B_i sin(t theta_i)
//   A_i = q_a m_a + q_b m_b,  B_i = q_b m_a - q_a m_b,  C = sum_{j not rotary} q_j m_j
// (AddBackTerms). m is kept in the pre-RoPE frame and compacted to its
// strongest `centering_pairs` pairs (the other pairs stay in the residual), so
// the add-back costs 2 * pairs multiply-adds per (query, token).
//
// Everything here is plain host code; thread-safe (no state).
#ifndef TQKV_KERNELS_KEY_CENTERING_H_
#define TQKV_KERNELS_KEY_CENTERING_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

namespace tqkv {

enum class KeyCentering {
  kNone,      // keys stored as they come
  kPostRope,  // m constant across positions: the add-back is one q . m per row
  kPreRope,   // m in the pre-RoPE frame, rotated to each token's position
};

enum class RopePairLayout {
  kInterleaved,  // pairs (2i, 2i + 1): llama.cpp / GGUF, GPT-J
  kHalfSplit,    // pairs (i, i + rotary_dims / 2): Hugging Face Llama, Qwen, Gemma
};

enum class RopeScaling {
  kNone,
  kLinear,  // every frequency divided by scaling_factor
  kLlama3,  // Llama-3.1: low frequencies / factor, high ones kept, smooth between
};

// The model's rotary embedding, as far as the cache needs it. `base` 0 and no
// inv_freq mean "unknown": pre-RoPE centering then falls back to post-RoPE.
struct RopeOptions {
  // Coordinates that rotate: the first rotary_dims of head_dim (0: all). Even.
  int rotary_dims = 0;
  RopePairLayout pair_layout = RopePairLayout::kInterleaved;
  // theta_i = base^(-2i / rotary_dims), before scaling.
  double base = 0.0;
  RopeScaling scaling = RopeScaling::kNone;
  double scaling_factor = 1.0;
  double low_freq_factor = 1.0;          // kLlama3
  double high_freq_factor = 4.0;         // kLlama3
  int64_t original_max_position = 8192;  // kLlama3
  // Explicit per-pair frequencies (rotary_dims / 2 of them), overriding base
  // and scaling.
  std::vector<double> inv_freq;

  bool known() const { return base > 0.0 || !inv_freq.empty(); }
};

// The rotary pairs of a head dim: coordinates and frequency of each.
class RopeTable {
 public:
  // An empty table (no rotary pairs): post-RoPE centering.
  RopeTable() = default;
  // INVALID_ARGUMENT for rotary_dims odd or above head_dim, a non-positive or
  // non-finite base or frequency, an inv_freq list of the wrong length, or bad
  // scaling parameters.
  static absl::StatusOr<RopeTable> Create(const RopeOptions& options, int head_dim);

  int num_pairs() const { return static_cast<int>(inv_freq_.size()); }
  int first(int pair) const { return first_[pair]; }
  int second(int pair) const { return second_[pair]; }
  double inv_freq(int pair) const { return inv_freq_[pair]; }
  const std::vector<double>& inv_freqs() const { return inv_freq_; }
  // Which pair coordinate j belongs to, or -1 outside the rotary dims.
  int pair_of(int coordinate) const { return pair_of_[coordinate]; }

  // x <- R_t x (inverse: R_t^-1 x) in place, x[head_dim], in double.
  void Rotate(int64_t position, double* x, bool inverse) const;

  // cos and sin of position * theta_i for every pair, in double, to c[i] and
  // s[i]. For 0 <= position < 2^24 without a sine or cosine: the product of
  // tabulated rotations by each hexadecimal digit's angle (digit x 16^k x
  // theta_i), at most five complex multiplies a pair, about 1e-15 from the
  // exact values; a function of the position alone (the same bits however a
  // sequence was appended). Elsewhere std::cos and std::sin. The tables
  // (96 rotations a pair) are built on the first call; thread-safe.
  void Angles(int64_t position, double* c, double* s) const;

 private:
  // The digit rotations: [level k < 6][digit < 16][pair] as (cos, sin).
  struct DigitTables;
  const std::vector<double>& Digits() const;

  std::vector<int> first_, second_, pair_of_;
  std::vector<double> inv_freq_;
  std::shared_ptr<DigitTables> digits_;  // shared by copies, filled once
};

// The per-query constants of the add-back for one mean m (see the top of the
// file): q . R_t m = constant + sum over `pairs` of A cos(t theta) + B sin(t theta).
// Only pairs where m is non-zero are listed.
struct AddBackTerms {
  double constant = 0.0;
  std::vector<int> pairs;        // indices into the RopeTable
  std::vector<double> inv_freq;  // theta of each listed pair
  std::vector<double> a, b;      // A_i, B_i of each listed pair

  // q . R_t m, in double (the reference the kernels are tested against).
  double At(int64_t position) const;
};

// `scale` multiplies every term (the logit scale).
AddBackTerms MakeAddBackTerms(const RopeTable& rope, const float* mean, const float* query, int head_dim, double scale);

// The pairs of a mean that are non-zero, and its constant part (coordinates
// outside every pair), for kernels that build the terms themselves.
std::vector<int> ActivePairs(const RopeTable& rope, const float* mean);

// cos and sin of t * theta_i for positions [first_position, first_position + n)
// and every pair of a table, in double (RopeTable::Angles: no sine or cosine
// below 2^24): computed once per append and shared by all its layers and
// heads.
struct RopeAngles {
  int64_t first_position = 0;
  int64_t n = 0;
  int pairs = 0;
  std::vector<double> cos, sin;  // [n][pairs]
};
RopeAngles ComputeRopeAngles(const RopeTable& rope, int64_t first_position, int64_t n);

// Estimates m for one head from the keys at angles.first_position + i for i in
// [begin, end) (row i at keys + i * stride): the mean of R_t^-1 k_t; then every
// rotary pair but the `keep_pairs` with the most energy is zeroed (0 keeps
// all). With an empty table this is the plain mean.
// REQUIRES: begin < end <= angles.n.
void EstimateKeyMean(const RopeTable& rope, const RopeAngles& angles, const float* keys, int64_t begin, int64_t end,
                     int64_t stride, int keep_pairs, int head_dim, float* mean);

// out_i = k_i - R_t m at t = angles.first_position + i, for i in [0, angles.n);
// rows `stride` floats apart in keys and out (which may alias).
void SubtractKeyMean(const RopeTable& rope, const RopeAngles& angles, const float* mean, const float* keys,
                     int64_t stride, int head_dim, float* out);

// Key scales of one head measured on its own keys (the cache's
// sequence_key_scales): from the centered residual rows [begin, end) (row i
// at residual + i * stride), s_j = sqrt(rms_j) with rms over the rows, both
// coordinates of a rotary pair sharing their joint rms (each coordinate
// outside the rotary dims its own), divided by the geometric mean of the
// head's scales and clamped to [1/kKeyScaleRange, kKeyScaleRange]. Storing
// r / s spreads the codec's error evenly over the coordinates' relative
// sizes (the balance of key_scales with the queries taken as even).
// REQUIRES: begin < end.
inline constexpr float kKeyScaleRange = 16.0f;
void EstimateKeyScales(const RopeTable& rope, const float* residual, int64_t begin, int64_t end, int64_t stride,
                       int head_dim, float* scales);

}  // namespace tqkv

#endif  // TQKV_KERNELS_KEY_CENTERING_H_
