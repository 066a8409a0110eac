// The store path (VectorCodec::Encode and the kernels behind it) must write
// the same bytes at every SIMD level: the stored format does not depend on the
// machine. Encodes random and edge-case vectors with every codec at every
// level the CPU supports and compares against the scalar level byte by byte.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bitpack.h"
#include "kernels/blocked_sums.h"
#include "kernels/codebook.h"
#include "kernels/codec.h"
#include "kernels/simd/encode_kernels.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/float_formats.h"
#include "base/random.h"
#include "tests/kernels/simd_level_guard.h"

namespace tqkv {
namespace {

std::vector<SimdLevel> NonScalarLevels() {
  std::vector<SimdLevel> levels;
  for (SimdLevel level : SupportedSimdLevels()) {
    if (level != SimdLevel::kScalar) levels.push_back(level);
  }
  return levels;
}

float Bits(uint32_t u) { return BitsToFloat(u); }

// Edge values: signed zeros, float subnormals, fp16 / bf16 / fp8 rounding
// ties and their neighbours, range limits.
std::vector<float> EdgeValues() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          0.5f,
                          65504.0f,
                          -65504.0f,
                          65519.0f,
                          -65519.0f,
                          65505.0f,
                          65512.0f,
                          448.0f,
                          -448.0f,
                          464.0f,
                          479.0f,
                          480.0f,
                          1e6f,
                          -1e6f,
                          1e30f,
                          -1e30f,
                          3.0e38f,
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min(),
                          -std::numeric_limits<float>::denorm_min(),
                          1e-30f,
                          1e-8f,
                          6e-8f,
                          3e-8f};
  // fp16: ties at the midpoint between halves (mantissa bit 12 set, lower
  // zero), for even and odd half mantissas, normal and subnormal.
  for (uint32_t e : {103u, 110u, 112u, 113u, 120u, 127u, 140u, 142u}) {
    for (uint32_t m : {0x1000u, 0x3000u, 0x2000u, 0x0fffu, 0x1001u, 0x7fffffu, 0x7ff000u}) {
      v.push_back(Bits((e << 23) | m));
      v.push_back(-Bits((e << 23) | m));
    }
  }
  // bf16 ties and fp8 ties (mantissa bit 15 / bit 19).
  for (uint32_t e : {1u, 100u, 117u, 118u, 120u, 121u, 127u, 134u, 135u, 200u, 254u}) {
    for (uint32_t m : {0x8000u, 0x18000u, 0x7fffu, 0x8001u, 0x80000u, 0x180000u, 0x7ffffu, 0x80001u, 0x380000u}) {
      v.push_back(Bits((e << 23) | m));
      v.push_back(-Bits((e << 23) | m));
    }
  }
  // fp16 / fp8 subnormal ties: odd multiples of half the smallest step.
  for (int k = 1; k < 40; k += 2) {
    v.push_back(std::ldexp(static_cast<float>(k), -25));
    v.push_back(-std::ldexp(static_cast<float>(k), -10));
  }
  return v;
}

std::vector<std::vector<float>> TestVectors(int d, uint64_t seed) {
  std::vector<std::vector<float>> out;
  Random rng(seed);
  auto gaussian = [&](double scale) {
    std::vector<float> x(d);
    for (float& v : x) v = static_cast<float>(scale * rng.NextGaussian());
    return x;
  };
  for (double scale : {1.0, 1e-30, 1e-20, 1e-6, 0.01, 30.0, 1e3, 4e3, 6e4, 1e7, 1e20}) {
    for (int rep = 0; rep < 4; ++rep) out.push_back(gaussian(scale));
  }
  out.push_back(std::vector<float>(d, 0.0f));
  out.push_back(std::vector<float>(d, -0.0f));
  for (int first_negative : {0, 1}) {  // mixed signed zeros, either first
    std::vector<float> x(d);
    for (int i = 0; i < d; ++i) x[i] = ((i + first_negative) % 2) ? -0.0f : 0.0f;
    out.push_back(x);
    for (int i = 0; i < d; ++i) x[i] = (i == d - 1) ? (first_negative ? -0.0f : 0.0f) : 0.0f;
    out.push_back(x);
    std::vector<float> y(d, first_negative ? -0.0f : 0.0f);
    y[d / 2] = 1.0f;
    out.push_back(y);
    y[d / 2] = -1.0f;
    out.push_back(y);
  }
  out.push_back(std::vector<float>(d, 1.0f));
  out.push_back(std::vector<float>(d, -3.5f));
  {
    std::vector<float> x(d, 0.0f);
    x[0] = 1.0f;
    out.push_back(x);
    x[0] = 1e-40f;
    out.push_back(x);
  }
  // Edge values, in windows of d.
  const std::vector<float> edges = EdgeValues();
  for (size_t start = 0; start < edges.size(); start += d / 2 + 1) {
    std::vector<float> x = gaussian(1.0);
    for (int i = 0; i < d; ++i) x[i] = edges[(start + i) % edges.size()];
    out.push_back(x);
  }
  // Uniform codec: values that land exactly on the rounding points
  // zero + (k + 0.5) * scale, and on the codes.
  for (int bits : {2, 3, 4, 8}) {
    const int max_code = (1 << bits) - 1;
    std::vector<float> x(d);
    for (int i = 0; i < d; ++i) x[i] = static_cast<float>(i % (2 * max_code + 1)) * 0.5f;
    x[0] = 0.0f;
    x[1] = static_cast<float>(max_code);
    out.push_back(x);
    for (int i = 0; i < d; ++i) x[i] = -1.0f + static_cast<float>(i % (2 * max_code + 1)) * 0.125f;
    out.push_back(x);
  }
  // Non-finite and out-of-range vectors: the error must not depend on the level.
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(), 7e4f, -1e5f, 1e30f}) {
    std::vector<float> x = gaussian(1.0);
    x[d - 1] = bad;
    out.push_back(x);
    x[d - 1] = 0.0f;
    x[0] = bad;
    out.push_back(x);
  }
  return out;
}

struct Encoded {
  std::string status;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scalars;
};

Encoded EncodeOnce(const VectorCodec& codec, const std::vector<float>& x) {
  Encoded e;
  e.codes.assign(codec.code_bytes(), 0xa5);
  e.scalars.assign(codec.num_scalars() + 1, 0xa5a5);
  absl::Status s = codec.Encode(x.data(), e.codes.data(), e.scalars.data());
  e.status = s.ToString();
  if (!s.ok()) {  // Nothing useful is written on failure.
    e.codes.clear();
    e.scalars.clear();
  }
  return e;
}

struct SpecAndDims {
  CodecSpec spec;
  std::vector<int> dims;
};

// The codec of a case, with hot channels chosen without data for split ones.
absl::StatusOr<std::unique_ptr<VectorCodec>> MakeTestCodec(const CodecSpec& spec, int d) {
  CodecOptions options;
  options.head_dim = d;
  options.seed = 11 + d;
  if (spec.NeedsCalibration()) {
    const int hot = spec.HotChannels(d);
    for (int i = 0; i < hot; ++i) options.hot_channels.push_back((i * 7 + 3) % d);
    std::sort(options.hot_channels.begin(), options.hot_channels.end());
    options.hot_channels.erase(std::unique(options.hot_channels.begin(), options.hot_channels.end()),
                               options.hot_channels.end());
    for (int ch = 0; static_cast<int>(options.hot_channels.size()) < hot; ++ch) {
      if (!std::binary_search(options.hot_channels.begin(), options.hot_channels.end(), ch)) {
        options.hot_channels.push_back(ch);
        std::sort(options.hot_channels.begin(), options.hot_channels.end());
      }
    }
  }
  return MakeCodec(spec, options);
}

// Every codec, at dims each must support.
std::vector<SpecAndDims> AllCases() {
  // Free dims for the per-coordinate codecs; Hadamard dims (bit-identical
  // rotations at every level) for the rotated ones.
  const std::vector<int> any_dims = {4, 5, 13, 16, 17, 33, 64, 100, 128, 130, 256, 512};
  const std::vector<int> hadamard_dims = {16, 24, 48, 64, 80, 96, 128, 192, 256, 512};
  std::vector<SpecAndDims> cases = {
      {CodecSpec::Fp16(), any_dims}, {CodecSpec::Bf16(), any_dims}, {CodecSpec::Fp8(), any_dims}};
  for (int bits = 1; bits <= 8; ++bits) cases.push_back({CodecSpec::Uniform(bits), any_dims});
  for (int bits = 1; bits <= 8; ++bits) {
    cases.push_back({CodecSpec::TurboQuant(bits, false), hadamard_dims});
    cases.push_back({CodecSpec::TurboQuant(bits, true), hadamard_dims});
  }
  cases.push_back({CodecSpec::OutlierSplit(4, 3, 2, true), {64, 128, 256}});
  cases.push_back({CodecSpec::OutlierSplit(3, 2, 2, true), {64, 128, 256}});
  cases.push_back({CodecSpec::OutlierSplit(3, 2, 4, false), {64, 128, 256}});
  cases.push_back({CodecSpec::Qjl(3), {64, 128}});
  cases.push_back({CodecSpec::Qjl(4), {128}});

  return cases;
}

TEST(EncodeEquivalenceTest, EveryCodecEveryLevelMatchesScalar) {
  const std::vector<SimdLevel> levels = NonScalarLevels();
  if (levels.empty()) GTEST_SKIP() << "no SIMD level beyond scalar on this CPU";
  SimdLevelGuard guard;
  const std::vector<SpecAndDims> cases = AllCases();
  int compared = 0;
  for (const SpecAndDims& c : cases) {
    for (int d : c.dims) {
      auto codec = MakeTestCodec(c.spec, d);
      ASSERT_TRUE(codec.ok()) << c.spec.Name() << " d=" << d << ": " << codec.status();
      const std::vector<std::vector<float>> inputs = TestVectors(d, 1000 + d);
      std::vector<Encoded> reference;
      SetActiveSimdLevel(SimdLevel::kScalar);
      for (const auto& x : inputs) reference.push_back(EncodeOnce(**codec, x));
      for (SimdLevel level : levels) {
        ASSERT_EQ(SetActiveSimdLevel(level), level);
        for (size_t v = 0; v < inputs.size(); ++v) {
          const Encoded got = EncodeOnce(**codec, inputs[v]);
          const Encoded& want = reference[v];
          ASSERT_EQ(got.status, want.status)
              << c.spec.Name() << " d=" << d << " vector " << v << " level " << SimdLevelName(level);
          ASSERT_EQ(got.codes, want.codes)
              << c.spec.Name() << " d=" << d << " vector " << v << " level " << SimdLevelName(level);
          ASSERT_EQ(got.scalars, want.scalars)
              << c.spec.Name() << " d=" << d << " vector " << v << " level " << SimdLevelName(level);
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 0);
}

// EncodeMany (the store path's batched form) writes what Encode writes, in
// runs of every length around its internal batch, and names the first
// failing vector of a run.
TEST(EncodeEquivalenceTest, EncodeManyMatchesEncodeAtEveryLevel) {
  SimdLevelGuard guard;
  for (SimdLevel level : SupportedSimdLevels()) {
    ASSERT_EQ(SetActiveSimdLevel(level), level);
    for (const SpecAndDims& c : AllCases()) {
      for (int d : c.dims) {
        SCOPED_TRACE(c.spec.Name() + " d=" + std::to_string(d) + " level " + std::string(SimdLevelName(level)));
        auto codec = MakeTestCodec(c.spec, d);
        ASSERT_TRUE(codec.ok()) << codec.status();
        const VectorCodec& k = **codec;
        std::vector<std::vector<float>> good, bad;
        for (auto& x : TestVectors(d, 2000 + d)) (EncodeOnce(k, x).status == "OK" ? good : bad).push_back(x);
        const size_t vb = k.bytes_per_vector();
        std::vector<uint8_t> codes(good.size() * vb, 0xa5);
        std::vector<uint16_t> scalars(good.size() * (k.num_scalars() + 1), 0xa5a5);
        std::vector<const float*> in;
        std::vector<uint8_t*> code_at;
        std::vector<uint16_t*> scalar_at;
        for (size_t v = 0; v < good.size(); ++v) {
          in.push_back(good[v].data());
          code_at.push_back(codes.data() + v * vb);
          scalar_at.push_back(scalars.data() + v * (k.num_scalars() + 1));
        }
        // Runs of 1, 2, ..., so that every length up to 20 is seen; then the
        // whole set in one call.
        ASSERT_GT(good.size(), 20u);
        for (int pass = 0; pass < 2; ++pass) {
          SCOPED_TRACE(pass == 0 ? "short runs" : "one run");
          std::fill(codes.begin(), codes.end(), 0xa5);
          const size_t longest = pass == 0 ? 20 : good.size();
          for (size_t at = 0, run = 1; at < good.size(); at += run, run = run % longest + 1) {
            const int n = static_cast<int>(std::min(pass == 0 ? run : longest, good.size() - at));
            int failed = -1;
            ASSERT_TRUE(k.EncodeMany(n, in.data() + at, code_at.data() + at, scalar_at.data() + at, &failed).ok());
            if (pass == 1) break;
          }
          for (size_t v = 0; v < good.size(); ++v) {
            const Encoded want = EncodeOnce(k, good[v]);
            ASSERT_EQ(std::vector<uint8_t>(code_at[v], code_at[v] + k.code_bytes()), want.codes) << "vector " << v;
            for (int j = 0; j < k.num_scalars(); ++j) ASSERT_EQ(scalar_at[v][j], want.scalars[j]) << "vector " << v;
          }
        }
        // A run with a bad vector third: its error, its index.
        for (const auto& x : bad) {
          const float* run_in[5] = {good[0].data(), good[1].data(), x.data(), good[2].data(), good[3].data()};
          std::vector<uint8_t> scratch(5 * vb);
          std::vector<uint16_t> scratch_scalars(5 * (k.num_scalars() + 1));
          uint8_t* run_codes[5];
          uint16_t* run_scalars[5];
          for (int v = 0; v < 5; ++v) {
            run_codes[v] = scratch.data() + v * vb;
            run_scalars[v] = scratch_scalars.data() + v * (k.num_scalars() + 1);
          }
          int failed = -1;
          const absl::Status status = k.EncodeMany(5, run_in, run_codes, run_scalars, &failed);
          EXPECT_EQ(status.ToString(), EncodeOnce(k, x).status);
          EXPECT_EQ(failed, 2);
        }
      }
    }
  }
}

// The stored scale's sums follow the documented blocked order at every level:
// terms where order matters (1 + 2^-53 vanishes against 1 but not against
// 2^-52) give one answer in that order and another sequentially.
TEST(EncodeEquivalenceTest, StoredScaleSumsFollowTheBlockedOrder) {
  SimdLevelGuard guard;
  for (int n : {1, 5, 16, 17, 40, 128, 131}) {
    std::vector<float> x(n);
    Random rng(300 + n);
    for (int i = 0; i < n; ++i) x[i] = i % 7 == 0 ? 1.0f : std::ldexp(1.0f + static_cast<float>(rng.NextDouble()), -27);
    // The definition, written out: partial j over j, j + 16, ...; folds by halves.
    double partial[16] = {};
    for (int j = 0; j < 16; ++j) {
      for (int i = j; i < n; i += 16) partial[j] += static_cast<double>(x[i]) * x[i];
    }
    for (int w = 8; w > 0; w /= 2) {
      for (int j = 0; j < w; ++j) partial[j] += partial[j + w];
    }
    double sequential = 0.0;
    for (int i = 0; i < n; ++i) sequential += static_cast<double>(x[i]) * x[i];
    if (n == 128) {
      EXPECT_NE(sequential, partial[0]) << "the inputs do not tell the orders apart";
    }
    for (SimdLevel level : SupportedSimdLevels()) {
      ASSERT_EQ(SetActiveSimdLevel(level), level);
      SCOPED_TRACE("n=" + std::to_string(n) + " level " + std::string(SimdLevelName(level)));
      const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels();
      double sum = BlockedSum<double>(n, [&](int i) { return static_cast<double>(x[i]) * x[i]; });
      EXPECT_EQ(sum, partial[0]);
      if (simd != nullptr) {
        ASSERT_TRUE(simd->sum_of_squares(x.data(), n, &sum));
        EXPECT_EQ(sum, partial[0]);
        // Codeword sums: levels into a 3-bit table with a large and tiny entries.
        const float centroids[8] = {1.0f, 1e-4f, 3e-4f, 7e-5f, 2e-4f, 1e-4f, 5e-5f, 9e-5f};
        std::vector<uint8_t> levels(n);
        for (int i = 0; i < n; ++i) levels[i] = static_cast<uint8_t>(i % 7 == 0 ? 0 : 1 + rng.NextBelow(7));
        float fpartial[16] = {};
        for (int j = 0; j < 16; ++j) {
          for (int i = j; i < n; i += 16) fpartial[j] += centroids[levels[i]] * centroids[levels[i]];
        }
        for (int w = 8; w > 0; w /= 2) {
          for (int j = 0; j < w; ++j) fpartial[j] += fpartial[j + w];
        }
        EXPECT_EQ(simd->codeword_sum(centroids, 3, levels.data(), n), fpartial[0]);
      }
    }
  }
}

// Values exactly on codebook boundaries and their float neighbours.
TEST(EncodeEquivalenceTest, QuantizeToLevelsOnBoundariesMatchesScalar) {
  const std::vector<SimdLevel> levels = NonScalarLevels();
  if (levels.empty()) GTEST_SKIP() << "no SIMD level beyond scalar on this CPU";
  SimdLevelGuard guard;
  Random rng(5);
  for (int dim : {16, 64, 128, 100}) {
    for (int bits = 1; bits <= 8; ++bits) {
      auto cb = GetCodebook(dim, bits);
      ASSERT_TRUE(cb.ok());
      std::vector<float> y;
      for (float b : (*cb)->boundaries) {
        y.push_back(b);
        y.push_back(std::nextafter(b, -1.0f));
        y.push_back(std::nextafter(b, 1.0f));
      }
      for (float c : (*cb)->centroids) y.push_back(c);
      for (float s : {0.0f, -0.0f, 1.0f, -1.0f, 1e30f, -1e30f, std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
        y.push_back(s);
      }
      for (int i = 0; i < 300; ++i) {
        y.push_back(static_cast<float>(rng.NextGaussian() / std::sqrt(static_cast<double>(dim))));
      }
      // Every n up to a few vectors' worth exercises the tails.
      for (int n : {1, 3, 15, 16, 17, 31, 33, static_cast<int>(y.size())}) {
        SetActiveSimdLevel(SimdLevel::kScalar);
        std::vector<uint8_t> want(n + 8, 0xcc);
        QuantizeToLevels(**cb, y.data(), n, want.data());
        for (int i = 0; i < n; ++i) {
          ASSERT_EQ(want[i],
                    QuantizeToLevel((*cb)->boundaries.data(), static_cast<int>((*cb)->boundaries.size()), y[i]));
        }
        for (SimdLevel level : levels) {
          SetActiveSimdLevel(level);
          std::vector<uint8_t> got(n + 8, 0xcc);
          QuantizeToLevels(**cb, y.data(), n, got.data());
          ASSERT_EQ(got, want) << "dim " << dim << " bits " << bits << " n " << n << " level " << SimdLevelName(level);
        }
      }
    }
  }
}

TEST(EncodeEquivalenceTest, PackBitsMatchesScalar) {
  const std::vector<SimdLevel> levels = NonScalarLevels();
  if (levels.empty()) GTEST_SKIP() << "no SIMD level beyond scalar on this CPU";
  SimdLevelGuard guard;
  Random rng(9);
  for (int bits = 1; bits <= 8; ++bits) {
    for (int n = 1; n <= 200; ++n) {
      std::vector<uint8_t> codes(n);
      // Full bytes: bits above `bits` must be masked off.
      for (uint8_t& c : codes) c = static_cast<uint8_t>(rng.NextU64());
      SetActiveSimdLevel(SimdLevel::kScalar);
      std::vector<uint8_t> want(PackedBytes(n, bits) + 16, 0x5a);
      PackBits(codes.data(), n, bits, want.data());
      for (SimdLevel level : levels) {
        SetActiveSimdLevel(level);
        std::vector<uint8_t> got(PackedBytes(n, bits) + 16, 0x5a);
        PackBits(codes.data(), n, bits, got.data());
        ASSERT_EQ(got, want) << "bits " << bits << " n " << n << " level " << SimdLevelName(level);
      }
    }
  }
}

// The fp16 / bf16 / fp8 codecs against the scalar conversions over a sweep of
// bit patterns (every exponent, many mantissas).
TEST(EncodeEquivalenceTest, FloatFormatCodecsMatchScalarConversions) {
  SimdLevelGuard guard;
  std::vector<float> values;
  for (uint32_t e = 0; e < 255; ++e) {
    for (uint32_t m = 0; m < (1u << 23); m += 0x1fff + (e & 7) * 0x101) {
      values.push_back(Bits((e << 23) | m));
      values.push_back(Bits(0x80000000u | (e << 23) | m));
    }
    for (uint32_t low : {0x0fffu, 0x1000u, 0x1001u, 0x3000u, 0x7fffu, 0x8000u, 0x8001u, 0x18000u, 0x7ffffu, 0x80000u,
                         0x80001u, 0x180000u}) {
      values.push_back(Bits((e << 23) | low));
      values.push_back(Bits((e << 23) | 0x7fe000u | low));
    }
  }
  const int d = 128;
  CodecOptions options;
  options.head_dim = d;
  auto fp16 = MakeCodec(CodecSpec::Fp16(), options);
  auto bf16 = MakeCodec(CodecSpec::Bf16(), options);
  auto fp8 = MakeCodec(CodecSpec::Fp8(), options);
  ASSERT_TRUE(fp16.ok() && bf16.ok() && fp8.ok());
  for (SimdLevel level : SupportedSimdLevels()) {
    SetActiveSimdLevel(level);
    for (size_t start = 0; start + d <= values.size(); start += d) {
      const float* x = &values[start];
      std::vector<uint8_t> codes(2 * d);
      // fp16 rejects |x| > 65519; clamp such windows into range first.
      std::vector<float> in_range(x, x + d);
      for (float& v : in_range) {
        if (!(std::fabs(v) <= 65519.0f)) v = std::copysign(65519.0f, v);
      }
      ASSERT_TRUE((*fp16)->Encode(in_range.data(), codes.data(), nullptr).ok());
      for (int i = 0; i < d; ++i) {
        const uint16_t h = static_cast<uint16_t>(codes[2 * i] | (codes[2 * i + 1] << 8));
        ASSERT_EQ(h, FloatToHalf(in_range[i])) << in_range[i] << " " << SimdLevelName(level);
      }
      std::vector<float> finite(x, x + d);
      for (float& v : finite) {
        if (!std::isfinite(v)) v = 1.0f;
      }
      ASSERT_TRUE((*bf16)->Encode(finite.data(), codes.data(), nullptr).ok());
      for (int i = 0; i < d; ++i) {
        const uint16_t h = static_cast<uint16_t>(codes[2 * i] | (codes[2 * i + 1] << 8));
        ASSERT_EQ(h, FloatToBf16(finite[i])) << finite[i] << " " << SimdLevelName(level);
      }
      ASSERT_TRUE((*fp8)->Encode(finite.data(), codes.data(), nullptr).ok());
      for (int i = 0; i < d; ++i) {
        ASSERT_EQ(codes[i], FloatToFp8E4m3(finite[i])) << finite[i] << " " << SimdLevelName(level);
      }
    }
  }
}

}  // namespace
}  // namespace tqkv
