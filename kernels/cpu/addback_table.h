// Internal to the CPU backend: cos and sin of t * theta_i for the tokens of
// one online-softmax block, for the pre-RoPE add-back (kernels/key_centering.h)
// inside the fused attention kernels.
//
// The kernels walk blocks of kAddBackBlock tokens in order. Each block's
// angles come from the block's base angle and fixed in-block offsets:
//   cos((t0 + j) theta) = cos(t0 theta) cos(j theta) - sin(t0 theta) sin(j theta)
// with the base advanced from block to block by a complex multiply in double
// (drift about 1e-16 per block, nothing at any context length) instead of a
// libm call per pair and block. The tables are float: the add-back enters a
// float logit.
#ifndef TQKV_KERNELS_CPU_ADDBACK_TABLE_H_
#define TQKV_KERNELS_CPU_ADDBACK_TABLE_H_

#include <cmath>
#include <cstdint>
#include <vector>

namespace tqkv {
namespace cpu_internal {

inline constexpr int kAddBackBlock = 64;

class AddBackTable {
 public:
  // `pairs` frequencies; the first block starts at `first_position`.
  AddBackTable(int pairs, const double* inv_freq, int64_t first_position) : pairs_(pairs) {
    if (pairs_ == 0) return;
    thread_local std::vector<double> state;
    thread_local std::vector<float> floats;
    state.resize(4 * static_cast<size_t>(pairs_));
    floats.resize(4 * static_cast<size_t>(pairs_) * kAddBackBlock);
    base_c_ = state.data();
    base_s_ = base_c_ + pairs_;
    step_c_ = base_s_ + pairs_;
    step_s_ = step_c_ + pairs_;
    offset_c_ = floats.data();
    offset_s_ = offset_c_ + pairs_ * kAddBackBlock;
    cos_ = offset_s_ + pairs_ * kAddBackBlock;
    sin_ = cos_ + pairs_ * kAddBackBlock;
    // Four libm calls per pair; the in-block offsets e^{i j theta} by
    // complex multiplication in double (64 steps: error ~1e-14).
    for (int i = 0; i < pairs_; ++i) {
      const double theta = inv_freq[i];
      base_c_[i] = std::cos(static_cast<double>(first_position) * theta);
      base_s_[i] = std::sin(static_cast<double>(first_position) * theta);
      const double c1 = std::cos(theta), s1 = std::sin(theta);
      double c = 1.0, s = 0.0;
      for (int j = 0; j < kAddBackBlock; ++j) {
        offset_c_[i * kAddBackBlock + j] = static_cast<float>(c);
        offset_s_[i * kAddBackBlock + j] = static_cast<float>(s);
        const double next_c = c * c1 - s * s1;
        s = s * c1 + c * s1;
        c = next_c;
      }
      step_c_[i] = c;  // e^{i 64 theta}
      step_s_[i] = s;
    }
  }

  int pairs() const { return pairs_; }

  // Fills cos(i) and sin(i) for the current block, then moves to the next.
  void Next() {
    for (int i = 0; i < pairs_; ++i) {
      const float c = static_cast<float>(base_c_[i]), s = static_cast<float>(base_s_[i]);
      const float* oc = offset_c_ + i * kAddBackBlock;
      const float* os = offset_s_ + i * kAddBackBlock;
      float* tc = cos_ + i * kAddBackBlock;
      float* ts = sin_ + i * kAddBackBlock;
      for (int j = 0; j < kAddBackBlock; ++j) {
        tc[j] = c * oc[j] - s * os[j];
        ts[j] = s * oc[j] + c * os[j];
      }
      const double nc = base_c_[i] * step_c_[i] - base_s_[i] * step_s_[i];
      base_s_[i] = base_s_[i] * step_c_[i] + base_c_[i] * step_s_[i];
      base_c_[i] = nc;
    }
  }

  // The current block's cos / sin of pair i, kAddBackBlock floats.
  const float* cos(int i) const { return cos_ + i * kAddBackBlock; }
  const float* sin(int i) const { return sin_ + i * kAddBackBlock; }

 private:
  int pairs_;
  double* base_c_ = nullptr;
  double* base_s_ = nullptr;
  double* step_c_ = nullptr;
  double* step_s_ = nullptr;
  float* offset_c_ = nullptr;
  float* offset_s_ = nullptr;
  float* cos_ = nullptr;
  float* sin_ = nullptr;
};

}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_ADDBACK_TABLE_H_
