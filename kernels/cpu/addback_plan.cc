#include "kernels/cpu/addback_plan.h"

#include <cmath>
#include <cstdint>

namespace tqkv {
namespace cpu_internal {

AddBackFrequency TabulateAddBackFrequency(double theta) {
  AddBackFrequency f;
  for (int j = 0; j < kAttendBlock; ++j) {
    f.cos[j] = static_cast<float>(std::cos(j * theta));
    f.sin[j] = static_cast<float>(std::sin(j * theta));
    const double unit = static_cast<double>(1 << AddBackFrequency::kRotationBits);
    const uint32_t c = static_cast<uint16_t>(static_cast<int16_t>(std::lrint(std::cos(j * theta) * unit)));
    const uint32_t s = static_cast<uint16_t>(static_cast<int16_t>(std::lrint(std::sin(j * theta) * unit)));
    f.rotation[j] = static_cast<int32_t>(c | s << 16);
  }
  f.step[0] = std::cos(kAttendBlock * theta);
  f.step[1] = std::sin(kAttendBlock * theta);
  f.theta = theta;
  return f;
}

const std::vector<AddBackFrequency>& TabulatedFrequencies(const RopeTable& rope) {
  struct Tabulated {
    bool valid = false;
    std::vector<double> freqs;
    std::vector<AddBackFrequency> table;
  };
  thread_local Tabulated kept[kKeptTables];
  thread_local int next = 0;
  for (Tabulated& t : kept) {
    if (t.valid && t.freqs == rope.inv_freqs()) return t.table;
  }
  Tabulated& t = kept[next];
  next = (next + 1) % kKeptTables;
  t.valid = true;
  t.freqs = rope.inv_freqs();
  t.table.clear();
  for (int i = 0; i < rope.num_pairs(); ++i) t.table.push_back(TabulateAddBackFrequency(rope.inv_freq(i)));
  return t.table;
}

int AddBackPairs(const RopeTable& rope, const float* mean, std::vector<int>* pairs,
                 std::vector<const AddBackFrequency*>* freq) {
  const std::vector<AddBackFrequency>& all = TabulatedFrequencies(rope);
  // Without branches: about one pair in eight is kept, in no pattern.
  pairs->resize(rope.num_pairs());
  freq->resize(rope.num_pairs());
  int n = 0;
  for (int i = 0; i < rope.num_pairs(); ++i) {
    (*pairs)[n] = i;
    (*freq)[n] = &all[i];
    n += mean[rope.first(i)] != 0.0f || mean[rope.second(i)] != 0.0f;
  }
  pairs->resize(n);
  freq->resize(n);
  return n;
}

double AddBackCoefficients(const RopeTable& rope, const float* mean, const float* query, int d, float scale,
                           const std::vector<int>& pairs, float* coef) {
  double constant = 0.0;
  // The coordinates outside the rotary dims (all of them post-RoPE; none
  // where RoPE rotates the whole head).
  for (int j = 2 * rope.num_pairs() == d ? d : 0; j < d; ++j) {
    if (rope.num_pairs() == 0 || rope.pair_of(j) < 0) constant += static_cast<double>(query[j]) * mean[j];
  }
  const int n = static_cast<int>(pairs.size());
  for (int k = 0; k < n; ++k) {
    const int i = pairs[k];
    const double qa = query[rope.first(i)], qb = query[rope.second(i)];
    const double ma = mean[rope.first(i)], mb = mean[rope.second(i)];
    coef[k] = static_cast<float>(scale * (qa * ma + qb * mb));
    coef[n + k] = static_cast<float>(scale * (qb * ma - qa * mb));
  }
  return constant * scale;
}

}  // namespace cpu_internal
}  // namespace tqkv
