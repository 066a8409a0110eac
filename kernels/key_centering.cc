#include "kernels/key_centering.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/base/call_once.h"
#include "absl/strings/str_format.h"

namespace tqkv {
namespace {

constexpr double kPi = 3.14159265358979323846;

// Llama-3.1's frequency rescaling (wavelengths beyond original / low_freq
// divided by the factor, below original / high_freq kept, blended between).
double Llama3Frequency(const RopeOptions& o, double inv_freq) {
  const double wavelength = 2.0 * kPi / inv_freq;
  const double low_wavelength = o.original_max_position / o.low_freq_factor;
  const double high_wavelength = o.original_max_position / o.high_freq_factor;
  if (wavelength < high_wavelength) return inv_freq;
  if (wavelength > low_wavelength) return inv_freq / o.scaling_factor;
  const double smooth =
      (o.original_max_position / wavelength - o.low_freq_factor) / (o.high_freq_factor - o.low_freq_factor);
  return (1.0 - smooth) * inv_freq / o.scaling_factor + smooth * inv_freq;
}

}  // namespace

absl::StatusOr<RopeTable> RopeTable::Create(const RopeOptions& o, int head_dim) {
  const int dims = o.rotary_dims == 0 ? head_dim : o.rotary_dims;
  if (dims < 2 || dims > head_dim || dims % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rope rotary_dims is %d; want an even number in [2, head_dim = %d] (0 means head_dim)",
                        o.rotary_dims, head_dim));
  }
  const int pairs = dims / 2;
  std::vector<double> inv_freq;
  if (!o.inv_freq.empty()) {
    if (static_cast<int>(o.inv_freq.size()) != pairs) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rope inv_freq has %d entries; want rotary_dims / 2 = %d", o.inv_freq.size(), pairs));
    }
    inv_freq = o.inv_freq;
  } else {
    if (!(o.base > 1.0) || !std::isfinite(o.base)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rope base is %g; want a finite value > 1 (e.g. 10000)", o.base));
    }
    for (int i = 0; i < pairs; ++i) inv_freq.push_back(std::pow(o.base, -2.0 * i / dims));
    if (o.scaling != RopeScaling::kNone && (!(o.scaling_factor > 0.0) || !std::isfinite(o.scaling_factor))) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rope scaling_factor is %g; want a finite value > 0", o.scaling_factor));
    }
    if (o.scaling == RopeScaling::kLinear) {
      for (double& f : inv_freq) f /= o.scaling_factor;
    } else if (o.scaling == RopeScaling::kLlama3) {
      if (!(o.low_freq_factor > 0.0) || !(o.high_freq_factor > o.low_freq_factor) || o.original_max_position < 1) {
        return absl::InvalidArgumentError(
            absl::StrFormat("llama3 rope scaling wants 0 < low_freq_factor < high_freq_factor and "
                            "original_max_position >= 1; got %g, %g, %d",
                            o.low_freq_factor, o.high_freq_factor, o.original_max_position));
      }
      for (double& f : inv_freq) f = Llama3Frequency(o, f);
    }
  }
  for (int i = 0; i < pairs; ++i) {
    if (!(inv_freq[i] > 0.0) || !std::isfinite(inv_freq[i])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rope frequency of pair %d is %g; want a finite value > 0", i, inv_freq[i]));
    }
  }
  RopeTable table;
  table.inv_freq_ = std::move(inv_freq);
  table.digits_ = std::make_shared<DigitTables>();
  table.pair_of_.assign(head_dim, -1);
  for (int i = 0; i < pairs; ++i) {
    const int a = o.pair_layout == RopePairLayout::kInterleaved ? 2 * i : i;
    const int b = o.pair_layout == RopePairLayout::kInterleaved ? 2 * i + 1 : i + pairs;
    table.first_.push_back(a);
    table.second_.push_back(b);
    table.pair_of_[a] = table.pair_of_[b] = i;
  }
  return table;
}

struct RopeTable::DigitTables {
  absl::once_flag once;
  std::vector<double> rotations;
};

namespace {

constexpr int kDigitBits = 4;
constexpr int kDigitLevels = 6;  // positions below 16^6 = 2^24
constexpr int64_t kDigitPositions = int64_t{1} << (kDigitBits * kDigitLevels);

}  // namespace

const std::vector<double>& RopeTable::Digits() const {
  absl::call_once(digits_->once, [this] {
    const int pairs = num_pairs();
    std::vector<double>& r = digits_->rotations;
    r.resize(static_cast<size_t>(kDigitLevels) * 16 * pairs * 2);
    for (int k = 0; k < kDigitLevels; ++k) {
      for (int digit = 0; digit < 16; ++digit) {
        const double steps = static_cast<double>(digit) * static_cast<double>(int64_t{1} << (kDigitBits * k));
        for (int i = 0; i < pairs; ++i) {
          double* at = r.data() + ((static_cast<size_t>(k) * 16 + digit) * pairs + i) * 2;
          at[0] = std::cos(steps * inv_freq_[i]);
          at[1] = std::sin(steps * inv_freq_[i]);
        }
      }
    }
  });
  return digits_->rotations;
}

void RopeTable::Angles(int64_t position, double* c, double* s) const {
  const int pairs = num_pairs();
  if (position < 0 || position >= kDigitPositions || digits_ == nullptr) {
    for (int i = 0; i < pairs; ++i) {
      const double angle = static_cast<double>(position) * inv_freq_[i];
      c[i] = std::cos(angle);
      s[i] = std::sin(angle);
    }
    return;
  }
  const std::vector<double>& r = Digits();
  for (int i = 0; i < pairs; ++i) {
    c[i] = 1.0;
    s[i] = 0.0;
  }
  // Lowest digit first: every position takes the same products in the same order.
  for (int k = 0; k < kDigitLevels && (position >> (kDigitBits * k)) != 0; ++k) {
    const int digit = static_cast<int>((position >> (kDigitBits * k)) & 15);
    if (digit == 0) continue;
    const double* at = r.data() + (static_cast<size_t>(k) * 16 + digit) * pairs * 2;
    for (int i = 0; i < pairs; ++i) {
      const double dc = at[2 * i], ds = at[2 * i + 1];
      const double nc = c[i] * dc - s[i] * ds;
      s[i] = s[i] * dc + c[i] * ds;
      c[i] = nc;
    }
  }
}

void RopeTable::Rotate(int64_t position, double* x, bool inverse) const {
  for (int i = 0; i < num_pairs(); ++i) {
    const double angle = static_cast<double>(position) * inv_freq_[i];
    const double c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
    const double xa = x[first_[i]], xb = x[second_[i]];
    x[first_[i]] = xa * c - xb * s;
    x[second_[i]] = xa * s + xb * c;
  }
}

double AddBackTerms::At(int64_t position) const {
  double sum = constant;
  for (size_t i = 0; i < pairs.size(); ++i) {
    const double angle = static_cast<double>(position) * inv_freq[i];
    sum += a[i] * std::cos(angle) + b[i] * std::sin(angle);
  }
  return sum;
}

std::vector<int> ActivePairs(const RopeTable& rope, const float* mean) {
  std::vector<int> pairs;
  for (int i = 0; i < rope.num_pairs(); ++i) {
    if (mean[rope.first(i)] != 0.0f || mean[rope.second(i)] != 0.0f) pairs.push_back(i);
  }
  return pairs;
}

AddBackTerms MakeAddBackTerms(const RopeTable& rope, const float* mean, const float* query, int head_dim,
                              double scale) {
  AddBackTerms terms;
  for (int j = 0; j < head_dim; ++j) {
    if (rope.num_pairs() == 0 || rope.pair_of(j) < 0) {
      terms.constant += static_cast<double>(query[j]) * mean[j];
    }
  }
  terms.constant *= scale;
  for (int i : ActivePairs(rope, mean)) {
    const double qa = query[rope.first(i)], qb = query[rope.second(i)];
    const double ma = mean[rope.first(i)], mb = mean[rope.second(i)];
    terms.pairs.push_back(i);
    terms.inv_freq.push_back(rope.inv_freq(i));
    terms.a.push_back(scale * (qa * ma + qb * mb));
    terms.b.push_back(scale * (qb * ma - qa * mb));
  }
  return terms;
}

RopeAngles ComputeRopeAngles(const RopeTable& rope, int64_t first_position, int64_t n) {
  RopeAngles angles;
  angles.first_position = first_position;
  angles.n = n;
  angles.pairs = rope.num_pairs();
  angles.cos.resize(static_cast<size_t>(n) * angles.pairs);
  angles.sin.resize(angles.cos.size());
  for (int64_t t = 0; t < n; ++t) {
    rope.Angles(first_position + t, angles.cos.data() + t * angles.pairs, angles.sin.data() + t * angles.pairs);
  }
  return angles;
}

void EstimateKeyMean(const RopeTable& rope, const RopeAngles& angles, const float* keys, int64_t begin, int64_t end,
                     int64_t stride, int keep_pairs, int head_dim, float* mean) {
  std::vector<double> sum(head_dim, 0.0);
  for (int64_t t = begin; t < end; ++t) {
    const float* k = keys + t * stride;
    for (int j = 0; j < head_dim; ++j) {
      if (rope.num_pairs() == 0 || rope.pair_of(j) < 0) sum[j] += k[j];
    }
    for (int i = 0; i < rope.num_pairs(); ++i) {
      // R_t^-1 rotates by -angle.
      const double c = angles.cos[t * angles.pairs + i], s = angles.sin[t * angles.pairs + i];
      const double ka = k[rope.first(i)], kb = k[rope.second(i)];
      sum[rope.first(i)] += ka * c + kb * s;
      sum[rope.second(i)] += kb * c - ka * s;
    }
  }
  const double inv = 1.0 / static_cast<double>(end - begin);
  for (int j = 0; j < head_dim; ++j) mean[j] = static_cast<float>(sum[j] * inv);
  const int pairs = rope.num_pairs();
  if (keep_pairs <= 0 || keep_pairs >= pairs) return;
  std::vector<int> order(pairs);
  std::iota(order.begin(), order.end(), 0);
  const auto energy = [&](int i) {
    const double a = mean[rope.first(i)], b = mean[rope.second(i)];
    return a * a + b * b;
  };
  // Ties go to the lower pair so the choice is deterministic.
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return energy(x) > energy(y); });
  for (int k = keep_pairs; k < pairs; ++k) {
    mean[rope.first(order[k])] = 0.0f;
    mean[rope.second(order[k])] = 0.0f;
  }
}

void SubtractKeyMean(const RopeTable& rope, const RopeAngles& angles, const float* mean, const float* keys,
                     int64_t stride, int head_dim, float* out) {
  // The mean's non-zero pairs (ActivePairs, without its allocation: a
  // one-token append calls this once per layer and head) and whether any
  // coordinate lies outside the rotary dims.
  const int pairs = rope.num_pairs();
  constexpr int kLocalPairs = 256;
  int local[kLocalPairs];
  std::vector<int> heap;
  int* active = local;
  if (pairs > kLocalPairs) {
    heap.resize(pairs);
    active = heap.data();
  }
  int count = 0;
  for (int i = 0; i < pairs; ++i) {
    if (mean[rope.first(i)] != 0.0f || mean[rope.second(i)] != 0.0f) active[count++] = i;
  }
  const bool outside = pairs == 0 || 2 * pairs < head_dim;
  for (int64_t t = 0; t < angles.n; ++t) {
    const float* k = keys + t * stride;
    float* o = out + t * stride;
    if (outside) {
      for (int j = 0; j < head_dim; ++j) {
        o[j] = pairs == 0 || rope.pair_of(j) < 0 ? static_cast<float>(static_cast<double>(k[j]) - mean[j]) : k[j];
      }
    } else if (o != k) {
      std::copy(k, k + head_dim, o);
    }
    const double* cos = angles.cos.data() + t * angles.pairs;
    const double* sin = angles.sin.data() + t * angles.pairs;
    for (int n = 0; n < count; ++n) {
      const int i = active[n];
      const double c = cos[i], s = sin[i];
      const double ma = mean[rope.first(i)], mb = mean[rope.second(i)];
      o[rope.first(i)] = static_cast<float>(k[rope.first(i)] - (ma * c - mb * s));
      o[rope.second(i)] = static_cast<float>(k[rope.second(i)] - (ma * s + mb * c));
    }
  }
}

void EstimateKeyScales(const RopeTable& rope, const float* residual, int64_t begin, int64_t end, int64_t stride,
                       int head_dim, float* scales) {
  std::vector<double> power(head_dim, 0.0);
  for (int64_t t = begin; t < end; ++t) {
    const float* r = residual + t * stride;
    for (int j = 0; j < head_dim; ++j) power[j] += static_cast<double>(r[j]) * r[j];
  }
  for (int i = 0; i < rope.num_pairs(); ++i) {
    const double joint = 0.5 * (power[rope.first(i)] + power[rope.second(i)]);
    power[rope.first(i)] = power[rope.second(i)] = joint;
  }
  // s = rms^(1/2) = (power / n)^(1/4); a coordinate that never moved gets the
  // smallest scale the range allows, not a zero.
  const double largest = *std::max_element(power.begin(), power.end());
  double log_sum = 0.0;
  std::vector<double> s(head_dim);
  for (int j = 0; j < head_dim; ++j) {
    s[j] = std::pow(std::max(power[j], largest * 1e-12) / static_cast<double>(end - begin) + 1e-300, 0.25);
    log_sum += std::log(s[j]);
  }
  const double geometric_mean = std::exp(log_sum / head_dim);
  for (int j = 0; j < head_dim; ++j) {
    scales[j] = std::clamp(static_cast<float>(s[j] / geometric_mean), 1.0f / kKeyScaleRange, kKeyScaleRange);
  }
}

}  // namespace tqkv
