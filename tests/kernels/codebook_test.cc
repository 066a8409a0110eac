#include "kernels/codebook.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/barrier.h"
#include "gtest/gtest.h"

namespace tqkv {
namespace {

constexpr double kPi = 3.14159265358979323846;

// The checks below integrate with a plain midpoint rule on the unnormalised
// density, deliberately unlike the implementation (Gauss-Legendre in
// theta = asin(t), closed-form first moments, lgamma-free normalisation).
double RawDensity(int dim, double t) {
  if (!(t > -1.0 && t < 1.0)) return 0.0;
  return std::pow(1.0 - t * t, 0.5 * (dim - 3));
}

std::vector<double> Midpoints(const std::vector<double>& centroids) {
  std::vector<double> b;
  for (size_t i = 0; i + 1 < centroids.size(); ++i) {
    b.push_back(0.5 * (centroids[i] + centroids[i + 1]));
  }
  return b;
}

// d * E[(t - Q(t))^2] under f_dim, for any codebook (nearest-centroid cells).
double BruteForceDistortion(const std::vector<double>& centroids, int dim) {
  constexpr int kPoints = 1000000;
  const std::vector<double> bounds = Midpoints(centroids);
  const double h = 2.0 / kPoints;
  double mass = 0.0, err = 0.0;
  for (int i = 0; i < kPoints; ++i) {
    const double t = -1.0 + (i + 0.5) * h;
    const double w = RawDensity(dim, t);
    const size_t level = std::lower_bound(bounds.begin(), bounds.end(), t) - bounds.begin();
    const double e = t - centroids[level];
    mass += w;
    err += w * e * e;
  }
  return dim * err / mass;
}

const Codebook& MustGet(int dim, int bits) {
  absl::StatusOr<const Codebook*> cb = GetCodebook(dim, bits);
  EXPECT_TRUE(cb.ok()) << cb.status();
  return **cb;
}

TEST(CodebookTest, DistortionMatchesReferenceTableAtDim128) {
  const double kReference[] = {0.3609, 0.1160, 0.0340, 0.0093};
  for (int bits = 1; bits <= 4; ++bits) {
    const Codebook& cb = MustGet(128, bits);
    EXPECT_NEAR(cb.distortion, kReference[bits - 1], 0.01 * kReference[bits - 1]) << "bits " << bits;
  }
}

TEST(CodebookTest, CentroidsMatchReferenceFiguresAtDim128) {
  const double scale = std::sqrt(128.0);
  const Codebook& one = MustGet(128, 1);
  ASSERT_EQ(one.centroids_f64.size(), 2u);
  EXPECT_NEAR(one.centroids_f64[1] * scale, 0.798, 0.005 * 0.798);
  EXPECT_NEAR(one.centroids_f64[1] * scale, std::sqrt(2.0 / kPi), 0.005 * std::sqrt(2.0 / kPi));

  const Codebook& two = MustGet(128, 2);
  ASSERT_EQ(two.centroids_f64.size(), 4u);
  EXPECT_NEAR(two.centroids_f64[2] * scale, 0.452, 0.005 * 0.452);
  EXPECT_NEAR(two.centroids_f64[3] * scale, 1.505, 0.005 * 1.505);
}

TEST(CodebookTest, OneBitCodebookMatchesClosedForm) {
  // One bit: c = E[t | t > 0] = 2 Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2) (d-1)),
  // and D = d (E[t^2] - c^2) = 1 - d c^2.
  for (int dim : {3, 4, 7, 64, 128, 1000, 8192}) {
    const double c =
        2.0 * std::exp(std::lgamma(0.5 * dim) - std::lgamma(0.5 * (dim - 1)) - 0.5 * std::log(kPi)) / (dim - 1);
    const Codebook& cb = MustGet(dim, 1);
    EXPECT_NEAR(cb.centroids_f64[1], c, 1e-11 * c) << "dim " << dim;
    EXPECT_NEAR(cb.distortion, 1.0 - dim * c * c, 1e-10) << "dim " << dim;
  }
}

TEST(CodebookTest, DistortionLiesBetweenShannonLowerAndPanterDiteUpperBound) {
  for (int dim : {32, 64, 80, 96, 128, 256, 512}) {
    for (int bits = 1; bits <= 4; ++bits) {
      const double lower = std::pow(4.0, -bits);
      const double upper = std::sqrt(3.0) * kPi / 2.0 * lower;
      const Codebook& cb = MustGet(dim, bits);
      EXPECT_GT(cb.distortion, lower) << "dim " << dim << " bits " << bits;
      EXPECT_LT(cb.distortion, upper) << "dim " << dim << " bits " << bits;
    }
  }
}

TEST(CodebookTest, LargeDimApproachesGaussianLloydMax) {
  // Lloyd-Max MSE for a unit Gaussian (Max 1960): the d -> infinity limit.
  const double kGaussian[] = {1.0 - 2.0 / kPi, 0.11749, 0.03454, 0.009497};
  for (int bits = 1; bits <= 4; ++bits) {
    EXPECT_NEAR(MustGet(8192, bits).distortion, kGaussian[bits - 1], 1e-3 * kGaussian[bits - 1]) << "bits " << bits;
    // The exact sphere density has lighter tails, so smaller d quantizes better.
    EXPECT_LT(MustGet(128, bits).distortion, MustGet(8192, bits).distortion) << "bits " << bits;
  }
}

TEST(CodebookTest, CentroidsAreConditionalMeansOfTheirCells) {
  struct Case {
    int dim, bits, points_per_cell;
  };
  for (const Case& c : {Case{128, 1, 100000}, Case{128, 2, 50000}, Case{128, 3, 20000}, Case{128, 4, 10000},
                        Case{128, 8, 2000}, Case{4, 3, 20000}, Case{80, 5, 5000}}) {
    const Codebook& cb = MustGet(c.dim, c.bits);
    const std::vector<double>& x = cb.centroids_f64;
    const int levels = cb.levels();
    for (int i = 0; i < levels; ++i) {
      // The outer cells stop at 16 standard deviations (mass beyond < e^-120)
      // and get more points: the density falls steeply across them.
      const double edge = std::min(1.0, 16.0 / std::sqrt(c.dim));
      const bool outer = i == 0 || i == levels - 1;
      const int points = outer ? 200000 : c.points_per_cell;
      const double lo = i == 0 ? -edge : 0.5 * (x[i - 1] + x[i]);
      const double hi = i == levels - 1 ? edge : 0.5 * (x[i] + x[i + 1]);
      const double h = (hi - lo) / points;
      double mass = 0.0, moment = 0.0;
      for (int k = 0; k < points; ++k) {
        const double t = lo + (k + 0.5) * h;
        const double w = RawDensity(c.dim, t);
        mass += w;
        moment += w * t;
      }
      EXPECT_NEAR(x[i], moment / mass, 1e-6 * std::fabs(x[i]))
          << "dim " << c.dim << " bits " << c.bits << " level " << i;
    }
  }
}

TEST(CodebookTest, BoundariesAreRoundedMidpointsAndLevelsAreExactlySymmetric) {
  for (int bits = 1; bits <= 8; ++bits) {
    const Codebook& cb = MustGet(96, bits);
    const int levels = cb.levels();
    ASSERT_EQ(cb.centroids.size(), static_cast<size_t>(levels));
    ASSERT_EQ(cb.centroids_f64.size(), static_cast<size_t>(levels));
    ASSERT_EQ(cb.boundaries.size(), static_cast<size_t>(levels - 1));
    for (int i = 0; i < levels; ++i) {
      EXPECT_EQ(cb.centroids[i], static_cast<float>(cb.centroids_f64[i]));
      EXPECT_EQ(cb.centroids_f64[i], -cb.centroids_f64[levels - 1 - i]);
      EXPECT_EQ(cb.centroids[i], -cb.centroids[levels - 1 - i]);
    }
    for (int i = 0; i + 1 < levels; ++i) {
      EXPECT_EQ(cb.boundaries[i], static_cast<float>(0.5 * (cb.centroids_f64[i] + cb.centroids_f64[i + 1])));
      EXPECT_EQ(cb.boundaries[i], -cb.boundaries[levels - 2 - i]);
    }
    EXPECT_EQ(cb.boundaries[levels / 2 - 1], 0.0f);
  }
}

TEST(CodebookTest, DimThreeGivesTheUniformQuantizer) {
  // f_3 is uniform on [-1, 1]: levels at the cell centres of L equal cells,
  // D = 3 * (2/L)^2 / 12 = 4^-bits. The tolerance is the float64 floor of a
  // Lloyd-Max fixed point with 256 levels (condition number ~L^2).
  for (int bits = 1; bits <= 8; ++bits) {
    const Codebook& cb = MustGet(3, bits);
    const int levels = cb.levels();
    for (int i = 0; i < levels; ++i) {
      EXPECT_NEAR(cb.centroids_f64[i], (2.0 * i + 1.0) / levels - 1.0, 1e-12) << "level " << i;
    }
    EXPECT_NEAR(cb.distortion, std::pow(4.0, -bits), 1e-12 * std::pow(4.0, -bits));
  }
}

TEST(CodebookTest, DensityIntegratesToOneWithVarianceOneOverDim) {
  constexpr int kPoints = 400000;
  for (int dim : {3, 4, 5, 32, 128, 1024}) {
    const double h = 2.0 / kPoints;
    double mass = 0.0, second = 0.0, first = 0.0;
    for (int i = 0; i < kPoints; ++i) {
      const double t = -1.0 + (i + 0.5) * h;
      const double f = SphereCoordinateDensity(dim, t);
      mass += f * h;
      first += f * t * h;
      second += f * t * t * h;
    }
    EXPECT_NEAR(mass, 1.0, 1e-6) << "dim " << dim;
    EXPECT_NEAR(first, 0.0, 1e-12) << "dim " << dim;
    EXPECT_NEAR(second * dim, 1.0, 1e-6) << "dim " << dim;
  }
  EXPECT_EQ(SphereCoordinateDensity(64, 1.5), 0.0);
  EXPECT_EQ(SphereCoordinateDensity(64, -1.0001), 0.0);
  EXPECT_NEAR(SphereCoordinateDensity(3, 0.3), 0.5, 1e-15);  // Uniform on [-1, 1].
  EXPECT_EQ(SphereCoordinateDensity(128, 0.1), SphereCoordinateDensity(128, -0.1));
}

TEST(CodebookTest, ReportedDistortionMatchesBruteForce) {
  for (int bits : {1, 2, 3, 4}) {
    const Codebook& cb = MustGet(128, bits);
    EXPECT_NEAR(cb.distortion, BruteForceDistortion(cb.centroids_f64, 128), 1e-6 * cb.distortion) << "bits " << bits;
  }
}

TEST(CodebookTest, CodebookForWrongDimGivesHigherDistortion) {
  for (int bits : {2, 3}) {
    const double right = BruteForceDistortion(MustGet(128, bits).centroids_f64, 128);
    const double wrong = BruteForceDistortion(MustGet(64, bits).centroids_f64, 128);
    EXPECT_GT(wrong, 1.25 * right) << "bits " << bits;  // ~1.3-1.4x in practice.
  }
}

TEST(CodebookTest, ComputeIsDeterministicAndCacheReturnsOnePointer) {
  absl::StatusOr<Codebook> a = ComputeCodebook(112, 5);
  absl::StatusOr<Codebook> b = ComputeCodebook(112, 5);
  ASSERT_TRUE(a.ok() && b.ok());
  auto same_bits = [](const auto& u, const auto& v) {
    return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * sizeof(u[0])) == 0;
  };
  EXPECT_TRUE(same_bits(a->centroids, b->centroids));
  EXPECT_TRUE(same_bits(a->boundaries, b->boundaries));
  EXPECT_TRUE(same_bits(a->centroids_f64, b->centroids_f64));
  EXPECT_EQ(std::memcmp(&a->distortion, &b->distortion, sizeof(double)), 0);
  EXPECT_EQ(a->iterations, b->iterations);

  const Codebook* first = *GetCodebook(112, 5);
  const Codebook* second = *GetCodebook(112, 5);
  EXPECT_EQ(first, second);
  EXPECT_TRUE(same_bits(first->centroids, a->centroids));
  EXPECT_TRUE(same_bits(first->boundaries, a->boundaries));
  EXPECT_EQ(first->dim, 112);
  EXPECT_EQ(first->bits, 5);
  EXPECT_NE(first, *GetCodebook(112, 6));
}

TEST(CodebookTest, ConcurrentFirstUseReturnsOnePointer) {
  constexpr int kThreads = 8;
  // Keys no other test touches, so every thread races on a cold entry.
  std::vector<const Codebook*> same_key(kThreads, nullptr);
  std::vector<const Codebook*> own_key(kThreads, nullptr);
  absl::Barrier* start = new absl::Barrier(kThreads);  // Deletes itself.
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      if (start->Block()) delete start;
      same_key[i] = *GetCodebook(200, 7);
      own_key[i] = *GetCodebook(300 + i, 4);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_EQ(same_key[i], same_key[0]);
    ASSERT_NE(own_key[i], nullptr);
    EXPECT_EQ(own_key[i]->dim, 300 + i);
    EXPECT_EQ(own_key[i], *GetCodebook(300 + i, 4));
  }
  EXPECT_EQ(same_key[0]->levels(), 128);
}

TEST(CodebookTest, EightBitsGives256StrictlyAscendingLevels) {
  for (int dim : {3, 64, 128, 8192}) {
    const Codebook& cb = MustGet(dim, 8);
    ASSERT_EQ(cb.levels(), 256);
    ASSERT_EQ(cb.centroids.size(), 256u);
    ASSERT_EQ(cb.boundaries.size(), 255u);
    for (int i = 0; i < 255; ++i) {
      EXPECT_LT(cb.centroids[i], cb.boundaries[i]) << "dim " << dim << " level " << i;
      EXPECT_LT(cb.boundaries[i], cb.centroids[i + 1]) << "dim " << dim << " level " << i;
    }
    EXPECT_LT(cb.centroids.back(), 1.0f);
    // Plain Lloyd would need tens of thousands of steps here.
    EXPECT_GT(cb.iterations, 0);
    EXPECT_LE(cb.iterations, 20);
    // At d = 3 the density is uniform and the bound is attained (next test).
    EXPECT_GE(cb.distortion, std::pow(4.0, -8) * (1.0 - 1e-12));
    EXPECT_LT(cb.distortion, std::sqrt(3.0) * kPi / 2.0 * std::pow(4.0, -8));
  }
}

TEST(CodebookTest, InvalidDimOrBitsIsInvalidArgument) {
  for (int dim : {-1, 0, 2, kMaxCodebookDim + 1}) {
    EXPECT_EQ(GetCodebook(dim, 2).status().code(), absl::StatusCode::kInvalidArgument) << dim;
    EXPECT_EQ(ComputeCodebook(dim, 2).status().code(), absl::StatusCode::kInvalidArgument) << dim;
  }
  for (int bits : {-3, 0, 9, 16}) {
    EXPECT_EQ(GetCodebook(128, bits).status().code(), absl::StatusCode::kInvalidArgument) << bits;
    EXPECT_EQ(ComputeCodebook(128, bits).status().code(), absl::StatusCode::kInvalidArgument) << bits;
  }
  const absl::Status s = GetCodebook(128, 9).status();
  EXPECT_NE(s.message().find("[1, 8]"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("got 9"), absl::string_view::npos) << s;
  const absl::Status d = GetCodebook(2, 4).status();
  EXPECT_NE(d.message().find("got 2"), absl::string_view::npos) << d;
  EXPECT_TRUE(GetCodebook(kMinCodebookDim, 1).ok());
  EXPECT_TRUE(GetCodebook(kMaxCodebookDim, 8).ok());
}

uint32_t LinearScanLevel(const std::vector<float>& boundaries, float y) {
  uint32_t below = 0;
  for (float b : boundaries) below += b < y ? 1 : 0;
  return below;
}

TEST(CodebookTest, QuantizeToLevelAgreesWithLinearScan) {
  std::mt19937 rng(12345);
  for (int bits = 1; bits <= 8; ++bits) {
    const Codebook& cb = MustGet(128, bits);
    const std::vector<float>& b = cb.boundaries;
    const int n = static_cast<int>(b.size());
    std::normal_distribution<float> gauss(0.0f, 1.5f / std::sqrt(128.0f));
    for (int i = 0; i < 20000; ++i) {
      const float y = gauss(rng);
      ASSERT_EQ(QuantizeToLevel(b.data(), n, y), LinearScanLevel(b, y)) << "bits " << bits << " y " << y;
    }
    for (int i = 0; i < cb.levels(); ++i) {
      EXPECT_EQ(QuantizeToLevel(b.data(), n, cb.centroids[i]), static_cast<uint32_t>(i));
    }
    EXPECT_EQ(QuantizeToLevel(b.data(), n, -INFINITY), 0u);
    EXPECT_EQ(QuantizeToLevel(b.data(), n, INFINITY), static_cast<uint32_t>(n));
    EXPECT_EQ(QuantizeToLevel(b.data(), n, 2.0f), static_cast<uint32_t>(n));
  }
}

TEST(CodebookTest, ValueOnABoundaryMapsToTheLowerLevel) {
  for (int bits = 1; bits <= 8; ++bits) {
    const Codebook& cb = MustGet(64, bits);
    const std::vector<float>& b = cb.boundaries;
    const int n = static_cast<int>(b.size());
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(QuantizeToLevel(b.data(), n, b[i]), static_cast<uint32_t>(i));
      EXPECT_EQ(QuantizeToLevel(b.data(), n, std::nextafter(b[i], INFINITY)), static_cast<uint32_t>(i + 1));
    }
    // Both zeros sit on the middle boundary.
    EXPECT_EQ(QuantizeToLevel(b.data(), n, 0.0f), static_cast<uint32_t>(n / 2));
    EXPECT_EQ(QuantizeToLevel(b.data(), n, -0.0f), static_cast<uint32_t>(n / 2));
  }
}

}  // namespace
}  // namespace tqkv
