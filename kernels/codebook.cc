#include "kernels/codebook.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/simd/encode_kernels.h"

namespace tqkv {
namespace {

constexpr double kPi = 3.14159265358979323846;

// Mass beyond |t| = 12/sqrt(d) is below exp(-70): integrating further only
// spends panels where the density is zero in double precision.
constexpr double kTruncationSigmas = 12.0;
// Quadrature: kPanels equal panels in theta (t = sin(theta)) over the support,
// each piece integrated with kGaussNodes-point Gauss-Legendre. A panel spans
// at most ~0.4 standard deviations, so the rule is exact to rounding.
constexpr int kPanels = 48;
constexpr int kGaussNodes = 12;
// Stop when no centroid would move by more than this (times 1/sqrt(d)).
constexpr double kRelativeTolerance = 1e-13;
// Newton converges in at most 6 steps for every (dim, bits) (checked for all
// dims at 8 bits); the cap only keeps a bug from becoming an endless loop.
constexpr int kMaxIterations = 100;

struct GaussLegendre {
  double node[kGaussNodes];
  double weight[kGaussNodes];
};

// Nodes and weights on [-1, 1] by Newton's method on P_n; computed rather than
// tabulated so there is no hand-copied constant to get wrong.
const GaussLegendre& GaussRule() {
  static const GaussLegendre rule = [] {
    GaussLegendre r;
    const int n = kGaussNodes;
    for (int i = 0; i < (n + 1) / 2; ++i) {
      double x = std::cos(kPi * (i + 0.75) / (n + 0.5));
      double dp = 0.0;
      for (int iter = 0; iter < 100; ++iter) {
        double p0 = 1.0, p1 = x;
        for (int k = 2; k <= n; ++k) {
          const double p2 = ((2 * k - 1) * x * p1 - (k - 1) * p0) / k;
          p0 = p1;
          p1 = p2;
        }
        dp = n * (x * p1 - p0) / (x * x - 1.0);
        const double dx = p1 / dp;
        x -= dx;
        if (std::fabs(dx) < 1e-16) break;
      }
      const double w = 2.0 / ((1.0 - x * x) * dp * dp);
      r.node[i] = -x;
      r.node[n - 1 - i] = x;
      r.weight[i] = r.weight[n - 1 - i] = w;
    }
    return r;
  }();
  return rule;
}

// Integrals of the *unnormalised* density (1 - t^2)^k, k = (d - 3)/2, over
// sub-intervals of [0, t_max]. In theta = asin(t) the integrand becomes
// cos(theta)^(d-2), an entire function, so Gauss-Legendre converges fast even
// for small d where (1 - t^2)^k has a root singularity at t = 1.
class SphereIntegrator {
 public:
  explicit SphereIntegrator(int dim) : dim_(dim), exponent_(dim - 2.0), half_exponent_t_(0.5 * (dim - 3.0)) {
    const double cut = kTruncationSigmas / std::sqrt(static_cast<double>(dim));
    if (cut < 1.0) {
      t_max_ = cut;
      theta_max_ = std::asin(cut);
    } else {
      t_max_ = 1.0;
      theta_max_ = 0.5 * kPi;
    }
    panel_width_ = theta_max_ / kPanels;
    for (int p = 0; p < kPanels; ++p) {
      panel_mass_[p] =
          Integrate([this](double th) { return ThetaWeight(th); }, p * panel_width_, (p + 1) * panel_width_);
    }
  }

  double t_max() const { return t_max_; }

  // cos(theta)^(d-2) via log1p so large d does not amplify the rounding of
  // cos(theta) (relative error would grow like d * eps with pow(cos, d-2)).
  double ThetaWeight(double theta) const {
    const double s = std::sin(0.5 * theta);
    return std::exp(exponent_ * std::log1p(-2.0 * s * s));
  }

  // (1 - t^2)^k: the unnormalised density in t.
  double Density(double t) const {
    if (half_exponent_t_ == 0.0) return 1.0;
    return std::exp(half_exponent_t_ * std::log1p(-t * t));
  }

  // Integral of (1 - t^2)^k over [a, b], 0 <= a <= b <= t_max.
  double Mass(double a, double b) const {
    return IntegratePanels([this](double th) { return ThetaWeight(th); }, a, b, true);
  }

  // Integral of t (1 - t^2)^k over [a, b], closed form
  // ((1-a^2)^((d-1)/2) - (1-b^2)^((d-1)/2)) / (d-1), written as
  // e^A * -expm1(B - A) so narrow cells do not cancel.
  double FirstMoment(double a, double b) const {
    const double h = 0.5 * (dim_ - 1.0);
    const double upper_a = std::exp(h * std::log1p(-a * a));
    // At b = 1 the ratio below rounds to just under -1; the term is exactly 0.
    if (b >= 1.0) return upper_a / (dim_ - 1.0);
    const double ratio = -(b - a) * (b + a) / (1.0 - a * a);  // (1-b^2)/(1-a^2) - 1
    return upper_a * -std::expm1(h * std::log1p(ratio)) / (dim_ - 1.0);
  }

  // Integral of (t - c)^2 (1 - t^2)^k over [a, b], integrated as one term so
  // the cell variance is not the difference of two nearly equal moments.
  double SquaredError(double a, double b, double c) const {
    return IntegratePanels(
        [this, c](double th) {
          const double e = std::sin(th) - c;
          return e * e * ThetaWeight(th);
        },
        a, b, false);
  }

  // Integral over [0, t_max]: half the (truncated) total mass.
  double HalfMass() const {
    double sum = 0.0;
    for (int p = 0; p < kPanels; ++p) sum += panel_mass_[p];
    return sum;
  }

 private:
  template <typename Fn>
  double Integrate(const Fn& fn, double lo, double hi) const {
    const GaussLegendre& rule = GaussRule();
    const double mid = 0.5 * (lo + hi);
    const double half = 0.5 * (hi - lo);
    double sum = 0.0;
    for (int i = 0; i < kGaussNodes; ++i) sum += rule.weight[i] * fn(mid + half * rule.node[i]);
    return sum * half;
  }

  // Splits [asin(a), asin(b)] at panel edges so every piece lies inside one
  // panel, where the integrand is a near-polynomial.
  template <typename Fn>
  double IntegratePanels(const Fn& fn, double a, double b, bool use_panel_mass) const {
    const double lo = a >= t_max_ ? theta_max_ : std::asin(a);
    const double hi = b >= t_max_ ? theta_max_ : std::asin(b);
    if (hi <= lo) return 0.0;
    const int first = std::min(kPanels - 1, static_cast<int>(lo / panel_width_));
    const int last = std::min(kPanels - 1, static_cast<int>(hi / panel_width_));
    if (first == last) return Integrate(fn, lo, hi);
    double sum = Integrate(fn, lo, (first + 1) * panel_width_);
    for (int p = first + 1; p < last; ++p) {
      sum += use_panel_mass ? panel_mass_[p] : Integrate(fn, p * panel_width_, (p + 1) * panel_width_);
    }
    return sum + Integrate(fn, last * panel_width_, hi);
  }

  int dim_;
  double exponent_;         // d - 2: power of cos(theta).
  double half_exponent_t_;  // (d - 3) / 2: power of (1 - t^2).
  double t_max_;
  double theta_max_;
  double panel_width_;
  double panel_mass_[kPanels];
};

// Quantile initialisation from the asymptotically optimal point density
// (Panter-Dite: proportional to f^(1/3)), which puts the start close enough
// for Newton to converge from the first step. Returns the m = L/2 positive
// centroids, ascending.
std::vector<double> InitialCentroids(int dim, int m, double t_max) {
  // f^(1/3) dt = cos(theta)^((d-3)/3 + 1) dtheta; a fine trapezoid CDF is
  // plenty for a starting point.
  constexpr int kGrid = 4096;
  const double theta_max = t_max >= 1.0 ? 0.5 * kPi : std::asin(t_max);
  const double power = (dim - 3.0) / 3.0 + 1.0;
  std::vector<double> cdf(kGrid + 1, 0.0);
  double prev = 1.0;
  for (int i = 1; i <= kGrid; ++i) {
    const double th = theta_max * i / kGrid;
    const double w = std::pow(std::cos(th), power);
    cdf[i] = cdf[i - 1] + 0.5 * (prev + w);
    prev = w;
  }
  std::vector<double> x(m);
  int i = 0;
  for (int j = 0; j < m; ++j) {
    const double target = (j + 0.5) / m * cdf[kGrid];
    while (cdf[i + 1] < target) ++i;
    const double frac = (target - cdf[i]) / (cdf[i + 1] - cdf[i]);
    x[j] = std::sin(theta_max * (i + frac) / kGrid);
  }
  return x;
}

double MaxAbsDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double r = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = std::fabs(a[i] - b[i]);
    if (!(e <= r)) r = std::isnan(e) ? HUGE_VAL : e;  // A NaN must not look converged.
  }
  return r;
}

bool StrictlyInside(const std::vector<double>& x, double t_max) {
  if (!(x.front() > 0.0) || !(x.back() < t_max)) return false;
  for (size_t i = 1; i < x.size(); ++i) {
    if (!(x[i] > x[i - 1])) return false;
  }
  return true;
}

// Centroids x of the positive half and the Lloyd map g_j = E[t | cell j] at
// x, with cells [0, e_1], [e_1, e_2], ..., [e_{m-1}, t_max] and e_j the
// midpoints, plus the tridiagonal Jacobian dg/dx for Newton.
struct LloydState {
  std::vector<double> x, g, sub, diag, super;
  double residual = 0.0;  // max |g - x|

  void Evaluate(const SphereIntegrator& in) {
    const int m = static_cast<int>(x.size());
    g.assign(m, 0.0);
    sub.assign(m, 0.0);
    diag.assign(m, 0.0);
    super.assign(m, 0.0);
    for (int j = 0; j < m; ++j) {
      const double a = j == 0 ? 0.0 : 0.5 * (x[j - 1] + x[j]);
      const double b = j == m - 1 ? in.t_max() : 0.5 * (x[j] + x[j + 1]);
      const double mass = in.Mass(a, b);
      const double mean = in.FirstMoment(a, b) / mass;
      g[j] = mean;
      // d(mean)/da = f(a) (mean - a) / mass and d(mean)/db = f(b) (b - mean)
      // / mass; each boundary moves by half of each neighbouring centroid's
      // move.
      if (j > 0) {
        const double da = in.Density(a) * (mean - a) / mass;
        sub[j] = 0.5 * da;
        diag[j] += 0.5 * da;
      }
      if (j < m - 1) {
        const double db = in.Density(b) * (b - mean) / mass;
        super[j] = 0.5 * db;
        diag[j] += 0.5 * db;
      }
    }
    residual = MaxAbsDiff(g, x);
  }
};

absl::Status ValidateArgs(int dim, int bits) {
  if (dim < kMinCodebookDim || dim > kMaxCodebookDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("codebook dim must be in [", kMinCodebookDim, ", ", kMaxCodebookDim, "], got ", dim));
  }
  if (bits < 1 || bits > 8) {
    return absl::InvalidArgumentError(absl::StrCat("codebook bits must be in [1, 8], got ", bits));
  }
  return absl::OkStatus();
}

struct CacheEntry {
  absl::once_flag once;
  absl::Status status;
  Codebook codebook;
};

struct CodebookCache {
  absl::Mutex mu;
  // Entries are never erased, so handed-out pointers stay valid.
  std::map<std::pair<int, int>, std::unique_ptr<CacheEntry>> entries ABSL_GUARDED_BY(mu);
};

}  // namespace

double SphereCoordinateDensity(int dim, double t) {
  if (!(t >= -1.0 && t <= 1.0)) return 0.0;
  const double log_norm = std::lgamma(0.5 * dim) - std::lgamma(0.5 * (dim - 1.0)) - 0.5 * std::log(kPi);
  if (dim == 3) return std::exp(log_norm);  // (1 - t^2)^0, including t = +-1.
  return std::exp(log_norm + 0.5 * (dim - 3.0) * std::log1p(-t * t));
}

absl::StatusOr<Codebook> ComputeCodebook(int dim, int bits) {
  if (absl::Status s = ValidateArgs(dim, bits); !s.ok()) return s;

  const SphereIntegrator in(dim);
  const int levels = 1 << bits;
  const int m = levels / 2;
  const double tol = kRelativeTolerance / std::sqrt(static_cast<double>(dim));

  // Solve the Lloyd-Max conditions on the positive half only: symmetry pins
  // the middle boundary at exactly 0. Plain Lloyd contracts its slowest mode
  // by only ~1 - O(1/L^2) per step (tens of thousands of steps at 8 bits), so
  // take Newton steps on g(x) - x, whose Jacobian is tridiagonal, and fall
  // back to a Lloyd step whenever Newton would not halve the residual.
  // The loop stops on the size of the step taken, not on the residual: the
  // Jacobian's condition number is ~L^2, so a small residual alone can hide
  // an error in the slow modes. In practice: 3-4 Newton steps, then one Lloyd
  // step at the rounding floor (final error ~1e-12/sqrt(d) at 8 bits).
  LloydState cur, next;
  cur.x = InitialCentroids(dim, m, in.t_max());
  cur.Evaluate(in);
  std::vector<double> cp(m), dp(m);
  int iterations = 0;
  for (;;) {
    if (iterations >= kMaxIterations) {
      return absl::InternalError(absl::StrCat("codebook for dim ", dim, " bits ", bits, " did not converge in ",
                                              kMaxIterations, " iterations (residual ", cur.residual, ")"));
    }
    ++iterations;
    // Thomas algorithm for (dg/dx - I) delta = x - g.
    for (int j = 0; j < m; ++j) {
      const double b = cur.diag[j] - 1.0 - (j > 0 ? cur.sub[j] * cp[j - 1] : 0.0);
      const double rhs = cur.x[j] - cur.g[j] - (j > 0 ? cur.sub[j] * dp[j - 1] : 0.0);
      cp[j] = cur.super[j] / b;
      dp[j] = rhs / b;
    }
    next.x = cur.x;
    double delta = dp[m - 1];
    next.x[m - 1] += delta;
    for (int j = m - 2; j >= 0; --j) {
      delta = dp[j] - cp[j] * delta;
      next.x[j] += delta;
    }
    bool accepted = false;
    if (StrictlyInside(next.x, in.t_max())) {
      next.Evaluate(in);
      // Far from the rounding floor Newton cuts the residual 20-1000x per step;
      // at the floor its steps are noise of size ~cond * eps (~5e-13 / sqrt(d)
      // at 8 bits) that barely change the residual, so they are refused.
      accepted = next.residual < 0.5 * cur.residual;
    }
    // A Lloyd step never increases distortion and keeps the order, so it is
    // the safe fallback far from the fixed point, and the last step at it.
    if (!accepted) {
      next.x = cur.g;
      next.Evaluate(in);
    }
    const double change = MaxAbsDiff(next.x, cur.x);
    std::swap(cur, next);
    if (change < tol) break;
  }
  const std::vector<double>& x = cur.x;

  Codebook cb;
  cb.dim = dim;
  cb.bits = bits;
  cb.iterations = iterations;
  cb.centroids_f64.resize(levels);
  for (int j = 0; j < m; ++j) {
    cb.centroids_f64[m + j] = x[j];
    cb.centroids_f64[m - 1 - j] = -x[j];  // Exact symmetry by construction.
  }
  cb.centroids.resize(levels);
  for (int i = 0; i < levels; ++i) cb.centroids[i] = static_cast<float>(cb.centroids_f64[i]);
  cb.boundaries.resize(levels - 1);
  for (int i = 0; i + 1 < levels; ++i) {
    cb.boundaries[i] = static_cast<float>(0.5 * (cb.centroids_f64[i] + cb.centroids_f64[i + 1]));
  }

  // D_mse = d * E[(t - Q(t))^2]. Normalised by the quadrature's own total
  // mass, which is exact to rounding; the lgamma constant loses ~1e-12 at
  // large d to the difference of two large lgammas.
  double sq = 0.0;
  for (int j = 0; j < m; ++j) {
    const double a = j == 0 ? 0.0 : 0.5 * (x[j - 1] + x[j]);
    const double b = j == m - 1 ? in.t_max() : 0.5 * (x[j] + x[j + 1]);
    sq += in.SquaredError(a, b, x[j]);
  }
  cb.distortion = dim * sq / in.HalfMass();
  return cb;
}

absl::StatusOr<const Codebook*> GetCodebook(int dim, int bits) {
  if (absl::Status s = ValidateArgs(dim, bits); !s.ok()) return s;
  static CodebookCache* const cache = new CodebookCache;  // Never destroyed.
  CacheEntry* entry;
  {
    absl::MutexLock lock(&cache->mu);
    std::unique_ptr<CacheEntry>& slot = cache->entries[{dim, bits}];
    if (slot == nullptr) slot = std::make_unique<CacheEntry>();
    entry = slot.get();
  }
  // Computed outside the map lock so different (dim, bits) build in parallel;
  // call_once makes concurrent first callers of one key wait for one build.
  absl::call_once(entry->once, [entry, dim, bits] {
    absl::StatusOr<Codebook> cb = ComputeCodebook(dim, bits);
    if (cb.ok()) {
      entry->codebook = *std::move(cb);
    } else {
      entry->status = cb.status();
    }
  });
  if (!entry->status.ok()) return entry->status;
  return &entry->codebook;
}

void QuantizeToLevels(const Codebook& codebook, const float* y, int n, uint8_t* levels) {
  const float* boundaries = codebook.boundaries.data();
  const int num_boundaries = static_cast<int>(codebook.boundaries.size());
  if (const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels()) {
    simd->quantize_to_levels(boundaries, codebook.bits, y, n, levels);
    return;
  }
  if (codebook.bits > 4) {
    for (int i = 0; i < n; ++i) levels[i] = static_cast<uint8_t>(QuantizeToLevel(boundaries, num_boundaries, y[i]));
    return;
  }
  // GCC/Clang vector extensions: portable, and lowered to SSE / AVX compares.
  // A true comparison is -1 in each lane, so subtracting it counts.
  typedef float Float4 __attribute__((vector_size(16)));
  typedef int32_t Int4 __attribute__((vector_size(16)));
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    Float4 v0, v1, v2, v3;
    memcpy(&v0, y + i, 16);
    memcpy(&v1, y + i + 4, 16);
    memcpy(&v2, y + i + 8, 16);
    memcpy(&v3, y + i + 12, 16);
    Int4 c0 = {}, c1 = {}, c2 = {}, c3 = {};
    for (int k = 0; k < num_boundaries; ++k) {
      const Float4 boundary = Float4{} + boundaries[k];
      c0 -= v0 > boundary;
      c1 -= v1 > boundary;
      c2 -= v2 > boundary;
      c3 -= v3 > boundary;
    }
    for (int j = 0; j < 4; ++j) {
      levels[i + j] = static_cast<uint8_t>(c0[j]);
      levels[i + 4 + j] = static_cast<uint8_t>(c1[j]);
      levels[i + 8 + j] = static_cast<uint8_t>(c2[j]);
      levels[i + 12 + j] = static_cast<uint8_t>(c3[j]);
    }
  }
  for (; i < n; ++i) levels[i] = static_cast<uint8_t>(QuantizeToLevel(boundaries, num_boundaries, y[i]));
}

}  // namespace tqkv
