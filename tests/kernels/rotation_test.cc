#include "kernels/rotation.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_features.h"
#include "kernels/random.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSeed = 0x5EED;

std::vector<int> PowerOfTwoDims() {
  std::vector<int> dims;
  for (int d = 1; d <= 512; d *= 2) dims.push_back(d);
  return dims;
}

// Non-powers of two (the head dims models use, plus odd ones) and one power of
// two, all as kDense.
std::vector<int> DenseDims() { return {1, 3, 7, 64, 80, 96, 100, 112, 160, 192}; }

struct Case {
  int dim;
  Rotation::Kind kind;
};

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (int d : PowerOfTwoDims()) {
    cases.push_back({d, Rotation::Kind::kRandomizedHadamard});
    cases.push_back({d, Rotation::Kind::kPlainHadamard});
  }
  for (int d : DenseDims()) cases.push_back({d, Rotation::Kind::kDense});
  return cases;
}

std::shared_ptr<const Rotation> MustCreate(int dim, uint64_t seed, Rotation::Kind kind) {
  auto rotation = Rotation::Create(dim, seed, kind);
  EXPECT_TRUE(rotation.ok()) << rotation.status();
  return rotation.ok() ? *rotation : nullptr;
}

std::vector<float> GaussianVector(int n, uint64_t seed) {
  Random random(seed);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = static_cast<float>(random.NextGaussian());
  return x;
}

double Norm(const std::vector<float>& x) {
  double s = 0.0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}

float MaxAbs(const std::vector<float>& x) {
  float m = 0.0f;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  return a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Sets the active SIMD level for one scope and restores the previous one.
class ScopedSimdLevel {
 public:
  explicit ScopedSimdLevel(SimdLevel level) : saved_(ActiveSimdLevel()) {
    SetActiveSimdLevel(level);
  }
  ~ScopedSimdLevel() { SetActiveSimdLevel(saved_); }

 private:
  SimdLevel saved_;
};

bool Supports(SimdLevel level) {
  const std::vector<SimdLevel> levels = SupportedSimdLevels();
  return std::find(levels.begin(), levels.end(), level) != levels.end();
}

// ---------------------------------------------------------------------------
// Create

TEST(RotationCreate, RejectsDimZero) {
  auto rotation = Rotation::Create(0, kSeed);
  ASSERT_FALSE(rotation.ok());
  EXPECT_EQ(rotation.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rotation.status().message(), HasSubstr("rotation dim must be in [1, 8192], got 0"));
}

TEST(RotationCreate, RejectsDimAboveMax) {
  auto rotation = Rotation::Create(kMaxRotationDim + 1, kSeed, Rotation::Kind::kDense);
  ASSERT_FALSE(rotation.ok());
  EXPECT_EQ(rotation.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rotation.status().message(), HasSubstr("got 8193"));
}

TEST(RotationCreate, RejectsHadamardForNonPowerOfTwoDim) {
  for (Rotation::Kind kind : {Rotation::Kind::kRandomizedHadamard, Rotation::Kind::kPlainHadamard}) {
    auto rotation = Rotation::Create(96, kSeed, kind);
    ASSERT_FALSE(rotation.ok());
    EXPECT_EQ(rotation.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(rotation.status().message(),
                HasSubstr("Hadamard rotation needs a power-of-two dim, got 96"));
  }
}

TEST(RotationCreate, AutoPicksHadamardForPowersOfTwoAndDenseOtherwise) {
  auto hadamard = MustCreate(128, kSeed, Rotation::Kind::kAuto);
  EXPECT_EQ(hadamard->kind(), Rotation::Kind::kRandomizedHadamard);
  EXPECT_EQ(hadamard->dim(), 128);
  EXPECT_EQ(hadamard->seed(), kSeed);
  EXPECT_EQ(hadamard->signs().size(), 128u);
  EXPECT_TRUE(hadamard->matrix().empty());
  for (float s : hadamard->signs()) EXPECT_TRUE(s == 1.0f || s == -1.0f);

  auto dense = MustCreate(96, kSeed, Rotation::Kind::kAuto);
  EXPECT_EQ(dense->kind(), Rotation::Kind::kDense);
  EXPECT_EQ(dense->matrix().size(), 96u * 96u);
  EXPECT_TRUE(dense->signs().empty());

  auto plain = MustCreate(64, kSeed, Rotation::Kind::kPlainHadamard);
  EXPECT_TRUE(plain->signs().empty());
  EXPECT_TRUE(plain->matrix().empty());
}

// FNV-1a over the float bit patterns.
uint64_t Fingerprint(const std::vector<float>& values) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (float v : values) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    for (int k = 0; k < 4; ++k) {
      h ^= (bits >> (8 * k)) & 0xFFu;
      h *= 0x100000001B3ull;
    }
  }
  return h;
}

TEST(RotationCreate, StoredFormatIsPinned) {
  // The rotation is part of the stored format: a change here makes every
  // stored cache undecodable. Update these values only with a format bump.
  EXPECT_EQ(Fingerprint(MustCreate(128, 1, Rotation::Kind::kRandomizedHadamard)->signs()),
            0xFC7C61388B10C125ull);
  EXPECT_EQ(Fingerprint(MustCreate(96, 1, Rotation::Kind::kDense)->matrix()),
            0x458B78E9F3E6D1A1ull);
}

TEST(RotationCreate, SignsComeFromTheSeededGeneratorInOrder) {
  auto rotation = MustCreate(256, kSeed, Rotation::Kind::kRandomizedHadamard);
  Random random(kSeed);
  for (float s : rotation->signs()) ASSERT_EQ(s, random.NextSign());
}

// ---------------------------------------------------------------------------
// Algebra, for every kind and dim

TEST(Rotation, IsOrthogonal) {
  for (const Case& c : AllCases()) {
    SCOPED_TRACE(testing::Message() << "dim " << c.dim << " kind " << static_cast<int>(c.kind));
    auto rotation = MustCreate(c.dim, kSeed, c.kind);
    const int d = c.dim;
    // columns[j] = Pi e_j.
    std::vector<std::vector<float>> columns(d, std::vector<float>(d));
    std::vector<float> e(d, 0.0f);
    for (int j = 0; j < d; ++j) {
      e[j] = 1.0f;
      rotation->Forward(e.data(), columns[j].data());
      e[j] = 0.0f;
    }
    // (Pi^T Pi)_jk = <Pi e_j, Pi e_k>; for a square matrix that is I iff Pi Pi^T is.
    double worst = 0.0;
    for (int j = 0; j < d; ++j) {
      for (int k = j; k < d; ++k) {
        double dot = 0.0;
        for (int i = 0; i < d; ++i) dot += static_cast<double>(columns[j][i]) * columns[k][i];
        worst = std::max(worst, std::fabs(dot - (j == k ? 1.0 : 0.0)));
      }
    }
    EXPECT_LT(worst, 1e-5);
  }
}

TEST(Rotation, InverseUndoesForward) {
  for (const Case& c : AllCases()) {
    SCOPED_TRACE(testing::Message() << "dim " << c.dim << " kind " << static_cast<int>(c.kind));
    auto rotation = MustCreate(c.dim, kSeed, c.kind);
    const std::vector<float> x = GaussianVector(c.dim, c.dim);
    std::vector<float> y(c.dim);
    std::vector<float> back(c.dim);
    rotation->Forward(x.data(), y.data());
    rotation->Inverse(y.data(), back.data());
    const double scale = Norm(x);
    for (int i = 0; i < c.dim; ++i) ASSERT_NEAR(back[i], x[i], 1e-5 * scale) << "at " << i;
  }
}

TEST(Rotation, PreservesNorm) {
  for (const Case& c : AllCases()) {
    SCOPED_TRACE(testing::Message() << "dim " << c.dim << " kind " << static_cast<int>(c.kind));
    auto rotation = MustCreate(c.dim, kSeed, c.kind);
    const std::vector<float> x = GaussianVector(c.dim, 1000 + c.dim);
    std::vector<float> y(c.dim);
    rotation->Forward(x.data(), y.data());
    EXPECT_NEAR(Norm(y) / Norm(x), 1.0, 1e-5);
    rotation->Inverse(x.data(), y.data());
    EXPECT_NEAR(Norm(y) / Norm(x), 1.0, 1e-5);
  }
}

TEST(Rotation, InPlaceMatchesOutOfPlaceBitForBit) {
  std::vector<Case> cases = AllCases();
  cases.push_back({2048, Rotation::Kind::kRandomizedHadamard});
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "dim " << c.dim << " kind " << static_cast<int>(c.kind));
    auto rotation = MustCreate(c.dim, kSeed, c.kind);
    const std::vector<float> x = GaussianVector(c.dim, 2000 + c.dim);

    std::vector<float> out(c.dim);
    std::vector<float> in_place = x;
    rotation->Forward(x.data(), out.data());
    rotation->Forward(in_place.data(), in_place.data());
    EXPECT_TRUE(BitEqual(out, in_place)) << "Forward";

    in_place = x;
    rotation->Inverse(x.data(), out.data());
    rotation->Inverse(in_place.data(), in_place.data());
    EXPECT_TRUE(BitEqual(out, in_place)) << "Inverse";
  }
}

TEST(Rotation, SameSeedGivesSameRotation) {
  for (const Case& c : AllCases()) {
    SCOPED_TRACE(testing::Message() << "dim " << c.dim << " kind " << static_cast<int>(c.kind));
    auto a = MustCreate(c.dim, kSeed, c.kind);
    auto b = MustCreate(c.dim, kSeed, c.kind);
    EXPECT_TRUE(BitEqual(a->signs(), b->signs()));
    EXPECT_TRUE(BitEqual(a->matrix(), b->matrix()));
    const std::vector<float> x = GaussianVector(c.dim, 3);
    std::vector<float> ya(c.dim);
    std::vector<float> yb(c.dim);
    a->Forward(x.data(), ya.data());
    b->Forward(x.data(), yb.data());
    EXPECT_TRUE(BitEqual(ya, yb));
  }
}

TEST(Rotation, DifferentSeedsGiveDifferentRotations) {
  for (const Case& c : AllCases()) {
    if (c.kind == Rotation::Kind::kPlainHadamard || c.dim < 3) continue;  // nothing random
    SCOPED_TRACE(testing::Message() << "dim " << c.dim << " kind " << static_cast<int>(c.kind));
    auto a = MustCreate(c.dim, kSeed, c.kind);
    auto b = MustCreate(c.dim, kSeed + 1, c.kind);
    const std::vector<float> x = GaussianVector(c.dim, 4);
    std::vector<float> ya(c.dim);
    std::vector<float> yb(c.dim);
    a->Forward(x.data(), ya.data());
    b->Forward(x.data(), yb.data());
    EXPECT_FALSE(BitEqual(ya, yb));
  }
}

TEST(Rotation, DenseMatrixIsTheTransposeOfInverse) {
  // matrix() is documented as Pi row-major: Forward must use it as y = M x.
  auto rotation = MustCreate(80, kSeed, Rotation::Kind::kDense);
  const std::vector<float>& m = rotation->matrix();
  const std::vector<float> x = GaussianVector(80, 5);
  std::vector<float> y(80);
  rotation->Forward(x.data(), y.data());
  for (int i = 0; i < 80; ++i) {
    double expect = 0.0;
    for (int j = 0; j < 80; ++j) expect += static_cast<double>(m[i * 80 + j]) * x[j];
    EXPECT_NEAR(y[i], expect, 1e-5);
  }
}

TEST(Rotation, HadamardForwardMatchesExplicitMatrixProduct) {
  for (int d : PowerOfTwoDims()) {
    for (Rotation::Kind kind : {Rotation::Kind::kRandomizedHadamard, Rotation::Kind::kPlainHadamard}) {
      SCOPED_TRACE(testing::Message() << "dim " << d << " kind " << static_cast<int>(kind));
      auto rotation = MustCreate(d, kSeed, kind);
      const std::vector<float> x = GaussianVector(d, 6);
      std::vector<float> y(d);
      rotation->Forward(x.data(), y.data());
      const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(d));
      for (int i = 0; i < d; ++i) {
        double expect = 0.0;
        for (int j = 0; j < d; ++j) {
          const double h = (__builtin_popcount(i & j) & 1) ? -1.0 : 1.0;  // Sylvester order
          const double sign = rotation->signs().empty() ? 1.0 : rotation->signs()[j];
          expect += h * sign * x[j];
        }
        ASSERT_NEAR(y[i], expect * inv_sqrt_d, 1e-5) << "at " << i;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Mixing: why the rotation exists

TEST(Rotation, SpreadsHotChannelsOverAllCoordinates) {
  // All energy in 4 channels, like the outlier channels of real keys.
  for (const Case& c : std::vector<Case>{{128, Rotation::Kind::kRandomizedHadamard},
                                         {256, Rotation::Kind::kRandomizedHadamard},
                                         {112, Rotation::Kind::kDense},
                                         {160, Rotation::Kind::kDense},
                                         {192, Rotation::Kind::kDense}}) {
    SCOPED_TRACE(testing::Message() << "dim " << c.dim << " kind " << static_cast<int>(c.kind));
    auto rotation = MustCreate(c.dim, kSeed, c.kind);
    std::vector<float> x(c.dim, 0.0f);
    for (int hot : {3, 17, 40, 99}) x[hot] = 0.5f;  // unit norm
    std::vector<float> y(c.dim);
    rotation->Forward(x.data(), y.data());
    // Hadamard: every |y_i| is at most 4 * 0.5 / sqrt(d). Dense: each y_i is
    // close to N(0, 1/d), whose maximum over d <= 256 draws is about 3.3/sqrt(d).
    const float bound = (c.kind == Rotation::Kind::kDense ? 5.0f : 2.0f) /
                        std::sqrt(static_cast<float>(c.dim));
    EXPECT_LE(MaxAbs(y), bound);
    EXPECT_NEAR(Norm(y), 1.0, 1e-5);
  }
}

TEST(Rotation, PlainHadamardConcentratesWalshRowsAndSignDiagonalSpreadsThem) {
  for (int d : {64, 128, 256}) {
    auto plain = MustCreate(d, kSeed, Rotation::Kind::kPlainHadamard);
    auto randomized = MustCreate(d, kSeed, Rotation::Kind::kRandomizedHadamard);
    const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
    for (int r : {1, 5, d / 2 + 3, d - 1}) {
      SCOPED_TRACE(testing::Message() << "dim " << d << " Walsh row " << r);
      std::vector<float> x(d);  // row r of H / sqrt(d): a unit Walsh function
      for (int j = 0; j < d; ++j) x[j] = (__builtin_popcount(r & j) & 1) ? -inv_sqrt_d : inv_sqrt_d;
      std::vector<float> y(d);
      plain->Forward(x.data(), y.data());
      EXPECT_NEAR(y[r], 1.0f, 1e-5f);
      EXPECT_NEAR(MaxAbs(y), 1.0f, 1e-5f);
      randomized->Forward(x.data(), y.data());
      EXPECT_LT(MaxAbs(y), 0.5f);
    }
  }
}

// ---------------------------------------------------------------------------
// Fast Walsh-Hadamard: every SIMD path, bit for bit

using FwhtFn = void (*)(float*, int);

struct FwhtPath {
  SimdLevel level;
  FwhtFn fn;
};

void ExpectPathMatchesScalar(const FwhtPath& path) {
  if (!Supports(path.level)) {
    GTEST_SKIP() << "CPU lacks " << SimdLevelName(path.level);
  }
  for (int n = 1; n <= kMaxRotationDim; n *= 2) {
    SCOPED_TRACE(testing::Message() << "n " << n);
    const std::vector<float> x = GaussianVector(n, 7000 + n);
    std::vector<float> expect = x;
    std::vector<float> got = x;
    FastWalshHadamardScalar(expect.data(), n);
    path.fn(got.data(), n);
    EXPECT_TRUE(BitEqual(expect, got));
  }
}

TEST(FastWalshHadamard, Avx2MatchesScalarBitForBit) {
  ExpectPathMatchesScalar({SimdLevel::kAvx2, FastWalshHadamardAvx2});
}

TEST(FastWalshHadamard, Avx512MatchesScalarBitForBit) {
  ExpectPathMatchesScalar({SimdLevel::kAvx512, FastWalshHadamardAvx512});
}

TEST(FastWalshHadamard, DispatchMatchesScalarAtEveryActiveLevel) {
  for (SimdLevel level : SupportedSimdLevels()) {
    SCOPED_TRACE(SimdLevelName(level));
    ScopedSimdLevel scoped(level);
    ASSERT_EQ(ActiveSimdLevel(), level);
    for (int n = 1; n <= kMaxRotationDim; n *= 2) {
      SCOPED_TRACE(testing::Message() << "n " << n);
      const std::vector<float> x = GaussianVector(n, 8000 + n);
      std::vector<float> expect = x;
      std::vector<float> got = x;
      FastWalshHadamardScalar(expect.data(), n);
      FastWalshHadamard(got.data(), n);
      EXPECT_TRUE(BitEqual(expect, got));
    }
  }
}

TEST(FastWalshHadamard, IsItsOwnInverse) {
  for (int n = 1; n <= kMaxRotationDim; n *= 2) {
    SCOPED_TRACE(testing::Message() << "n " << n);
    const std::vector<float> x = GaussianVector(n, 9000 + n);
    std::vector<float> y = x;
    FastWalshHadamard(y.data(), n);
    FastWalshHadamard(y.data(), n);
    for (int i = 0; i < n; ++i) ASSERT_NEAR(y[i], x[i], 1e-5f) << "at " << i;
  }
}

TEST(Rotation, HadamardOutputIsBitIdenticalAtEveryLevel) {
  // The sign diagonal is fused into the SIMD transforms; results must still
  // match the scalar "multiply, transform, multiply" sequence exactly.
  for (int d = 1; d <= kMaxRotationDim; d *= 2) {
    for (Rotation::Kind kind : {Rotation::Kind::kRandomizedHadamard, Rotation::Kind::kPlainHadamard}) {
      auto rotation = MustCreate(d, kSeed, kind);
      const std::vector<float> x = GaussianVector(d, 11 + d);
      std::vector<float> forward(d);
      std::vector<float> inverse(d);
      {
        ScopedSimdLevel scoped(SimdLevel::kScalar);
        rotation->Forward(x.data(), forward.data());
        rotation->Inverse(x.data(), inverse.data());
      }
      for (SimdLevel level : SupportedSimdLevels()) {
        SCOPED_TRACE(testing::Message() << "dim " << d << " kind " << static_cast<int>(kind) << " "
                                        << SimdLevelName(level));
        ScopedSimdLevel scoped(level);
        std::vector<float> y(d);
        rotation->Forward(x.data(), y.data());
        EXPECT_TRUE(BitEqual(forward, y)) << "Forward";
        rotation->Inverse(x.data(), y.data());
        EXPECT_TRUE(BitEqual(inverse, y)) << "Inverse";
        y = x;
        rotation->Forward(y.data(), y.data());
        EXPECT_TRUE(BitEqual(forward, y)) << "Forward in place";
        y = x;
        rotation->Inverse(y.data(), y.data());
        EXPECT_TRUE(BitEqual(inverse, y)) << "Inverse in place";
      }
    }
  }
}

TEST(Rotation, DenseAgreesWithScalarAtEveryLevel) {
  // The SIMD matrix-vector products use FMA and another summation order, so
  // they match the scalar path to rounding, not bit for bit.
  for (int d : DenseDims()) {
    auto rotation = MustCreate(d, kSeed, Rotation::Kind::kDense);
    const std::vector<float> x = GaussianVector(d, 12 + d);
    std::vector<float> forward(d);
    std::vector<float> inverse(d);
    {
      ScopedSimdLevel scoped(SimdLevel::kScalar);
      rotation->Forward(x.data(), forward.data());
      rotation->Inverse(x.data(), inverse.data());
    }
    const float tolerance = 1e-6f * static_cast<float>(Norm(x));
    for (SimdLevel level : SupportedSimdLevels()) {
      SCOPED_TRACE(testing::Message() << "dim " << d << " " << SimdLevelName(level));
      ScopedSimdLevel scoped(level);
      std::vector<float> y(d);
      rotation->Forward(x.data(), y.data());
      for (int i = 0; i < d; ++i) ASSERT_NEAR(y[i], forward[i], tolerance) << "Forward at " << i;
      rotation->Inverse(x.data(), y.data());
      for (int i = 0; i < d; ++i) ASSERT_NEAR(y[i], inverse[i], tolerance) << "Inverse at " << i;
    }
  }
}

// ---------------------------------------------------------------------------
// CPU features

TEST(CpuFeatures, NamesEveryLevel) {
  EXPECT_EQ(SimdLevelName(SimdLevel::kScalar), "scalar");
  EXPECT_EQ(SimdLevelName(SimdLevel::kAvx2), "avx2");
  EXPECT_EQ(SimdLevelName(SimdLevel::kAvx512), "avx512");
}

TEST(CpuFeatures, SupportedLevelsAscendFromScalarToDetected) {
  const std::vector<SimdLevel> levels = SupportedSimdLevels();
  ASSERT_FALSE(levels.empty());
  EXPECT_EQ(levels.front(), SimdLevel::kScalar);
  EXPECT_EQ(levels.back(), DetectedSimdLevel());
  for (size_t i = 1; i < levels.size(); ++i) {
    EXPECT_LT(static_cast<int>(levels[i - 1]), static_cast<int>(levels[i]));
  }
}

TEST(CpuFeatures, SetActiveLevelClampsToDetected) {
  ScopedSimdLevel restore(ActiveSimdLevel());
  EXPECT_EQ(SetActiveSimdLevel(SimdLevel::kAvx512), DetectedSimdLevel());
  EXPECT_EQ(ActiveSimdLevel(), DetectedSimdLevel());
  EXPECT_EQ(SetActiveSimdLevel(SimdLevel::kScalar), SimdLevel::kScalar);
  EXPECT_EQ(ActiveSimdLevel(), SimdLevel::kScalar);
}

}  // namespace
}  // namespace tqkv
