#include "kernels/rotation.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/simd/cpu_features.h"
#include "base/random.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSeed = 0x5EED;

std::vector<int> PowerOfTwoDims() {
  std::vector<int> dims;
  for (int d = 1; d <= 512; d *= 2) dims.push_back(d);
  return dims;
}

// Dims 2^k * m, m in {12, 20, 28}: the Kronecker Hadamard rotations (every
// non-power-of-two head dim models use, plus small and large ones).
std::vector<int> KronDims() { return {12, 20, 28, 48, 80, 96, 112, 160, 192, 224, 320, 384}; }

// Every dim 2^k * m, m in {12, 20, 28}, up to kMaxRotationDim.
std::vector<int> AllKronDims() {
  std::vector<int> dims;
  for (int m : {12, 20, 28}) {
    for (int d = m; d <= kMaxRotationDim; d *= 2) dims.push_back(d);
  }
  return dims;
}

// Dims without a Hadamard rotation, and ones that have one, all as kDense.
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
  for (int d : KronDims()) {
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

// Pi as a float64 row-major matrix, read off Forward: column j is Pi e_j.
std::vector<double> Materialize(const Rotation& rotation) {
  const int d = rotation.dim();
  std::vector<double> pi(static_cast<size_t>(d) * d);
  std::vector<float> e(d, 0.0f);
  std::vector<float> column(d);
  for (int j = 0; j < d; ++j) {
    e[j] = 1.0f;
    rotation.Forward(e.data(), column.data());
    e[j] = 0.0f;
    for (int i = 0; i < d; ++i) pi[static_cast<size_t>(i) * d + j] = column[i];
  }
  return pi;
}

// The quadratic character mod a prime q, straight from its definition.
int Chi(int a, int q) {
  a = ((a % q) + q) % q;
  if (a == 0) return 0;
  for (int x = 1; x < q; ++x) {
    if ((x * x) % q == a) return 1;
  }
  return -1;
}

// P_m as rotation.h documents it, written independently of rotation.cc.
std::vector<int> ReferencePaley(int m) {
  std::vector<int> p(static_cast<size_t>(m) * m);
  if (m == 12 || m == 20) {
    const int q = m - 1;
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < m; ++j) {
        int s;  // S = [[0, 1^T], [-1, Q]]
        if (i == 0) {
          s = j == 0 ? 0 : 1;
        } else if (j == 0) {
          s = -1;
        } else {
          s = Chi((j - 1) - (i - 1), q);
        }
        p[i * m + j] = (i == j ? 1 : 0) + s;
      }
    }
  } else if (m == 28) {
    const int q = 13, n = 14;
    auto c = [&](int i, int j) {  // C = [[0, 1^T], [1, Q]]
      if (i == 0) return j == 0 ? 0 : 1;
      if (j == 0) return 1;
      return Chi((j - 1) - (i - 1), q);
    };
    const int a[2][2] = {{1, 1}, {1, -1}};
    const int b[2][2] = {{1, -1}, {-1, -1}};
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        for (int s = 0; s < 2; ++s) {
          for (int t = 0; t < 2; ++t) {
            p[(2 * i + s) * m + 2 * j + t] = c(i, j) * a[s][t] + (i == j ? b[s][t] : 0);
          }
        }
      }
    }
  }
  return p;
}

// Pi[i][j] = H_a[r][r'] P_m[c][c'] D_j / sqrt(d) for i = r*m + c, j = r'*m + c'
// (m = 1: P_1 = [1]), in float64.
double ReferenceHadamardEntry(int d, int m, const std::vector<int>& p, const std::vector<float>& signs, int i, int j) {
  const int r = i / m, c = i % m, r2 = j / m, c2 = j % m;
  const double h = (__builtin_popcount(r & r2) & 1) ? -1.0 : 1.0;
  const double f = m == 1 ? 1.0 : p[c * m + c2];
  const double sign = signs.empty() ? 1.0 : signs[j];
  return h * f * sign / std::sqrt(static_cast<double>(d));
}

// Sets the active SIMD level for one scope and restores the previous one.
class ScopedSimdLevel {
 public:
  explicit ScopedSimdLevel(SimdLevel level) : saved_(ActiveSimdLevel()) { SetActiveSimdLevel(level); }
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

TEST(RotationCreate, RejectsHadamardForDimsWithoutTheKroneckerForm) {
  for (int dim : {100, 3, 6, 36, 44, 52, 60, 1000, 7000}) {
    for (Rotation::Kind kind : {Rotation::Kind::kRandomizedHadamard, Rotation::Kind::kPlainHadamard}) {
      SCOPED_TRACE(testing::Message() << "dim " << dim << " kind " << static_cast<int>(kind));
      auto rotation = Rotation::Create(dim, kSeed, kind);
      ASSERT_FALSE(rotation.ok());
      EXPECT_EQ(rotation.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(rotation.status().message(), HasSubstr(absl::StrCat("Hadamard rotation needs dim = 2^k * m with m in "
                                                                      "{1, 12, 20, 28}, got ",
                                                                      dim)));
    }
  }
}

TEST(RotationCreate, RejectsDenseAbove1024) {
  for (int dim : {1025, 1100, 5000, kMaxRotationDim}) {
    SCOPED_TRACE(testing::Message() << "dim " << dim);
    auto rotation = Rotation::Create(dim, kSeed, Rotation::Kind::kDense);
    ASSERT_FALSE(rotation.ok());
    EXPECT_EQ(rotation.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(rotation.status().message(), HasSubstr(absl::StrCat("dense rotation supports dim <= 1024, got ", dim)));
  }
  // kAuto falls back to kDense only where no Hadamard rotation exists.
  auto rotation = Rotation::Create(1100, kSeed, Rotation::Kind::kAuto);
  ASSERT_FALSE(rotation.ok());
  EXPECT_THAT(rotation.status().message(), HasSubstr("dense rotation supports dim <= 1024"));
  EXPECT_EQ(MustCreate(kMaxRotationDim, kSeed, Rotation::Kind::kAuto)->kind(), Rotation::Kind::kRandomizedHadamard);
  EXPECT_EQ(MustCreate(6144, kSeed, Rotation::Kind::kAuto)->hadamard_factor_order(), 12);
}

TEST(RotationCreate, HadamardFactorOrderNamesTheKroneckerForm) {
  for (int d = 1; d <= kMaxRotationDim; d *= 2) EXPECT_EQ(HadamardFactorOrder(d), 1) << d;
  for (int d : AllKronDims()) {
    int odd = d;
    while (odd % 2 == 0) odd /= 2;
    EXPECT_EQ(HadamardFactorOrder(d), 4 * odd) << d;
  }
  for (int d : {0, -4, 3, 5, 6, 7, 10, 14, 36, 44, 60, 100, 1000, kMaxRotationDim + 1, 3 * 4096}) {
    EXPECT_EQ(HadamardFactorOrder(d), 0) << d;
  }
}

TEST(RotationCreate, AutoPicksHadamardWhereTheFormAllowsAndDenseOtherwise) {
  auto hadamard = MustCreate(128, kSeed, Rotation::Kind::kAuto);
  EXPECT_EQ(hadamard->kind(), Rotation::Kind::kRandomizedHadamard);
  EXPECT_EQ(hadamard->dim(), 128);
  EXPECT_EQ(hadamard->seed(), kSeed);
  EXPECT_EQ(hadamard->signs().size(), 128u);
  EXPECT_TRUE(hadamard->matrix().empty());
  EXPECT_EQ(hadamard->hadamard_factor_order(), 1);
  EXPECT_TRUE(hadamard->hadamard_factor().empty());
  for (float s : hadamard->signs()) EXPECT_TRUE(s == 1.0f || s == -1.0f);

  for (int d : KronDims()) {
    SCOPED_TRACE(testing::Message() << "dim " << d);
    auto kron = MustCreate(d, kSeed, Rotation::Kind::kAuto);
    EXPECT_EQ(kron->kind(), Rotation::Kind::kRandomizedHadamard);
    EXPECT_EQ(kron->signs().size(), static_cast<size_t>(d));
    EXPECT_TRUE(kron->matrix().empty());
    const int m = kron->hadamard_factor_order();
    EXPECT_EQ(m, HadamardFactorOrder(d));
    EXPECT_EQ(kron->hadamard_factor().size(), static_cast<size_t>(m) * m);
  }

  for (int d : {100, 3}) {
    SCOPED_TRACE(testing::Message() << "dim " << d);
    auto dense = MustCreate(d, kSeed, Rotation::Kind::kAuto);
    EXPECT_EQ(dense->kind(), Rotation::Kind::kDense);
    EXPECT_EQ(dense->matrix().size(), static_cast<size_t>(d) * d);
    EXPECT_TRUE(dense->signs().empty());
    EXPECT_EQ(dense->hadamard_factor_order(), 0);
    EXPECT_TRUE(dense->hadamard_factor().empty());
  }

  auto plain = MustCreate(64, kSeed, Rotation::Kind::kPlainHadamard);
  EXPECT_TRUE(plain->signs().empty());
  EXPECT_TRUE(plain->matrix().empty());
  auto plain_kron = MustCreate(96, kSeed, Rotation::Kind::kPlainHadamard);
  EXPECT_TRUE(plain_kron->signs().empty());
  EXPECT_EQ(plain_kron->hadamard_factor_order(), 12);
}

TEST(RotationCreate, PaleyFactorsAreTheDocumentedHadamardMatrices) {
  for (int m : {12, 20, 28}) {
    SCOPED_TRACE(testing::Message() << "m " << m);
    auto rotation = MustCreate(2 * m, kSeed, Rotation::Kind::kRandomizedHadamard);
    const std::vector<float>& p = rotation->hadamard_factor();
    ASSERT_EQ(p.size(), static_cast<size_t>(m) * m);
    const std::vector<int> reference = ReferencePaley(m);
    for (int i = 0; i < m * m; ++i) {
      ASSERT_TRUE(p[i] == 1.0f || p[i] == -1.0f) << "at " << i;
      ASSERT_EQ(p[i], static_cast<float>(reference[i])) << "at " << i;
    }
    for (int i = 0; i < m; ++i) {  // P P^T = m I
      for (int j = 0; j < m; ++j) {
        int dot = 0;
        for (int k = 0; k < m; ++k) dot += static_cast<int>(p[i * m + k]) * p[j * m + k];
        ASSERT_EQ(dot, i == j ? m : 0) << "(" << i << ", " << j << ")";
      }
    }
    // Shared by every rotation with the same m.
    EXPECT_EQ(&MustCreate(4 * m, kSeed + 1, Rotation::Kind::kPlainHadamard)->hadamard_factor(), &p);
  }
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

std::vector<float> MaterializeFloat(const Rotation& rotation) {
  const std::vector<double> pi = Materialize(rotation);
  return std::vector<float>(pi.begin(), pi.end());
}

TEST(RotationCreate, StoredFormatIsPinned) {
  // The rotation is part of the stored format: a change here makes every
  // stored cache undecodable. Update these values only with a format bump.
  EXPECT_EQ(Fingerprint(MustCreate(128, 1, Rotation::Kind::kRandomizedHadamard)->signs()), 0xFC7C61388B10C125ull);
  EXPECT_EQ(Fingerprint(MustCreate(100, 1, Rotation::Kind::kDense)->matrix()), 0x4CAFE08ADE1F4537ull);
  // The Kronecker rotations: the fixed Paley factors, and one whole Pi (signs,
  // factor and coordinate order together), bit-identical at every SIMD level.
  EXPECT_EQ(Fingerprint(MustCreate(12, 1, Rotation::Kind::kPlainHadamard)->hadamard_factor()), 0x4FF38D3924866FA5ull);
  EXPECT_EQ(Fingerprint(MustCreate(20, 1, Rotation::Kind::kPlainHadamard)->hadamard_factor()), 0xF2CE34B55A6A57A5ull);
  EXPECT_EQ(Fingerprint(MustCreate(28, 1, Rotation::Kind::kPlainHadamard)->hadamard_factor()), 0x0E8A2520564645A5ull);
  EXPECT_EQ(Fingerprint(MaterializeFloat(*MustCreate(96, 1, Rotation::Kind::kAuto))), 0xC342CA20DCB6AB25ull);
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

TEST(Rotation, DenseForwardMultipliesByTheDocumentedMatrix) {
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

TEST(Rotation, KroneckerHadamardMatchesExplicitMatrixProduct) {
  // Forward against the documented Pi = (H_a kron P_m) D / sqrt(d) in float64,
  // with P_m from the independent reference construction; Inverse against Pi^T.
  for (int d : KronDims()) {
    for (Rotation::Kind kind : {Rotation::Kind::kRandomizedHadamard, Rotation::Kind::kPlainHadamard}) {
      SCOPED_TRACE(testing::Message() << "dim " << d << " kind " << static_cast<int>(kind));
      auto rotation = MustCreate(d, kSeed, kind);
      const int m = rotation->hadamard_factor_order();
      ASSERT_EQ(m, HadamardFactorOrder(d));
      const std::vector<int> p = ReferencePaley(m);
      const std::vector<float> x = GaussianVector(d, 6);
      std::vector<float> y(d);
      std::vector<float> back(d);
      rotation->Forward(x.data(), y.data());
      rotation->Inverse(x.data(), back.data());
      for (int i = 0; i < d; ++i) {
        double forward = 0.0;
        double inverse = 0.0;
        for (int j = 0; j < d; ++j) {
          forward += ReferenceHadamardEntry(d, m, p, rotation->signs(), i, j) * x[j];
          inverse += ReferenceHadamardEntry(d, m, p, rotation->signs(), j, i) * x[j];
        }
        ASSERT_NEAR(y[i], forward, 1e-5) << "Forward at " << i;
        ASSERT_NEAR(back[i], inverse, 1e-5) << "Inverse at " << i;
      }
    }
  }
}

TEST(Rotation, HadamardMatricesAreFlat) {
  // Every entry of Pi is +-1/sqrt(d): energy in any one channel is spread
  // evenly over all coordinates, which is what the dense matrix lacks.
  std::vector<int> dims = KronDims();
  dims.push_back(64);
  dims.push_back(128);
  for (int d : dims) {
    SCOPED_TRACE(testing::Message() << "dim " << d);
    const std::vector<double> pi = Materialize(*MustCreate(d, kSeed, Rotation::Kind::kAuto));
    const double flat = 1.0 / std::sqrt(static_cast<double>(d));
    double worst = 0.0;
    for (double v : pi) worst = std::max(worst, std::fabs(std::fabs(v) - flat));
    EXPECT_LT(worst, 1e-6);
  }
}

// ---------------------------------------------------------------------------
// Mixing: why the rotation exists

TEST(Rotation, SpreadsHotChannelsOverAllCoordinates) {
  // All energy in 4 channels, like the outlier channels of real keys.
  for (const Case& c : std::vector<Case>{{128, Rotation::Kind::kRandomizedHadamard},
                                         {256, Rotation::Kind::kRandomizedHadamard},
                                         {112, Rotation::Kind::kRandomizedHadamard},
                                         {160, Rotation::Kind::kRandomizedHadamard},
                                         {192, Rotation::Kind::kRandomizedHadamard},
                                         {100, Rotation::Kind::kDense},
                                         {112, Rotation::Kind::kDense},
                                         {192, Rotation::Kind::kDense}}) {
    SCOPED_TRACE(testing::Message() << "dim " << c.dim << " kind " << static_cast<int>(c.kind));
    auto rotation = MustCreate(c.dim, kSeed, c.kind);
    std::vector<float> x(c.dim, 0.0f);
    for (int hot : {3, 17, 40, 99}) x[hot] = 0.5f;  // unit norm
    std::vector<float> y(c.dim);
    rotation->Forward(x.data(), y.data());
    // Hadamard: every |y_i| is at most 4 * 0.5 / sqrt(d). Dense: each y_i is
    // close to N(0, 1/d), whose maximum over d <= 256 draws is about 3.3/sqrt(d).
    const float bound = (c.kind == Rotation::Kind::kDense ? 5.0f : 2.0f) / std::sqrt(static_cast<float>(c.dim));
    EXPECT_LE(MaxAbs(y), bound * 1.00001f);  // slack for float rounding
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

TEST(Rotation, PlainKroneckerHadamardConcentratesItsRowsAndSignDiagonalSpreadsThem) {
  for (int d : {48, 96, 112, 160}) {
    auto plain = MustCreate(d, kSeed, Rotation::Kind::kPlainHadamard);
    auto randomized = MustCreate(d, kSeed, Rotation::Kind::kRandomizedHadamard);
    for (int r : {1, 5, d / 2 + 3, d - 1}) {
      SCOPED_TRACE(testing::Message() << "dim " << d << " row " << r);
      std::vector<float> e(d, 0.0f);
      e[r] = 1.0f;
      std::vector<float> x(d);  // row r of the plain Pi: +-1/sqrt(d) everywhere
      plain->Inverse(e.data(), x.data());
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
// SIMD paths against the scalar ones

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
  // match the scalar "multiply, transform, multiply" sequence exactly. The
  // Kronecker transforms multiply only by +-1 (exact) before the final scale,
  // so their SIMD versions match the portable one bit for bit too.
  std::vector<int> dims = AllKronDims();
  for (int d = 1; d <= kMaxRotationDim; d *= 2) dims.push_back(d);
  for (int d : dims) {
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
  EXPECT_EQ(SimdLevelName(SimdLevel::kAvx512Vnni), "avx512_vnni");
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
  EXPECT_EQ(SetActiveSimdLevel(SimdLevel::kAvx512Vnni), DetectedSimdLevel());
  EXPECT_EQ(ActiveSimdLevel(), DetectedSimdLevel());
  EXPECT_EQ(SetActiveSimdLevel(SimdLevel::kScalar), SimdLevel::kScalar);
  EXPECT_EQ(ActiveSimdLevel(), SimdLevel::kScalar);
}

}  // namespace
}  // namespace tqkv
