// The fused kernels with the recipe inside their walk: exact tokens read from
// fp16 exact pages and the pre-RoPE add-back (HeadAttendParams::exact and
// addback_*), in one online softmax with the compressed tokens. Against
// float64 attention over what the bytes stand for, at the boundaries of the
// exact ranges (sinks only, recent tokens only, recent tokens or sinks covering the whole
// context, ranges inside a group, past a block), page sizes of 1 to 16, runs
// that start late (sliding windows) and rows that see different prefixes
// (several causal query tokens).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/code_tiles.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/float_formats.h"
#include "base/random.h"
#include "tests/kernels/synthetic_field.h"

namespace tqkv {
namespace {

using cpu_internal::FieldReader;

struct RecipeCase {
  int d = 128;
  int page_tokens = 16;
  int exact_page_tokens = 3;
  int tokens = 150;
  int sinks = 4;
  int recent = 64;
  int64_t token_begin = 0;
  int pairs = 8;
};

std::string Describe(const RecipeCase& c) {
  return "d=" + std::to_string(c.d) + " page=" + std::to_string(c.page_tokens) +
         " exact page=" + std::to_string(c.exact_page_tokens) + " tokens=" + std::to_string(c.tokens) +
         " sinks=" + std::to_string(c.sinks) + " recent=" + std::to_string(c.recent) +
         " begin=" + std::to_string(c.token_begin) + " pairs=" + std::to_string(c.pairs);
}

size_t Align(size_t n) { return (n + 31) / 32 * 32; }

// One head's tokens in a pool: every token's compressed codes in shuffled
// pages (planes as KvLayout lays them out), and fp16 copies of the exact
// tokens, with their own random bytes, in shuffled exact pages of the same
// pool (pages holding no exact token: -1 in the exact table).
class RecipePages {
 public:
  RecipePages(const RecipeCase& c, const SyntheticField& kf, const SyntheticField& vf, Random& rng)
      : c_(c), kf_(kf), vf_(vf) {
    DescribeFields();
    sink_end_ = std::min(c.tokens, c.sinks);
    recent_begin_ = std::max(sink_end_, c.tokens - c.recent);
    const int pages = (c.tokens + c.page_tokens - 1) / c.page_tokens + 2;
    const int exact_pages = (c.tokens + c.exact_page_tokens - 1) / c.exact_page_tokens;
    pool_.assign(page_bytes_ * (pages + exact_pages), 0);
    table_.resize(pages);
    std::iota(table_.begin(), table_.end(), 0);
    for (int i = pages - 1; i > 0; --i) std::swap(table_[i], table_[rng.NextBelow(i + 1)]);
    exact_table_.resize(exact_pages);
    std::iota(exact_table_.begin(), exact_table_.end(), pages);
    for (int i = exact_pages - 1; i > 0; --i) std::swap(exact_table_[i], exact_table_[rng.NextBelow(i + 1)]);
    for (int b = 0; b < exact_pages; ++b) {
      bool any = false;
      for (int t = b * c.exact_page_tokens; t < std::min(c.tokens, (b + 1) * c.exact_page_tokens); ++t) any |= Exact(t);
      if (!any) exact_table_[b] = -1;
    }
    FillCompressed(rng);
    FillExact(rng);
  }

  bool Exact(int t) const { return t < sink_end_ || t >= recent_begin_; }

  // The params' pages, fields and exact ranges (queries, rows and outputs
  // are the caller's).
  void Fill(cpu_internal::HeadAttendParams* p) const {
    p->head_dim = c_.d;
    p->page_tokens = c_.page_tokens;
    p->pool_base = pool_.data();
    p->page_bytes = page_bytes_;
    p->block_table = table_.data();
    p->key = key_;
    p->value = value_;
    p->token_begin = c_.token_begin;
    p->exact.sink_end = sink_end_;
    p->exact.recent_begin = recent_begin_ < c_.tokens ? recent_begin_ : INT64_MAX;
    p->exact.page_tokens = c_.exact_page_tokens;
    p->exact.block_table = exact_table_.data();
    p->exact.key_offset = 0;
    p->exact.value_offset = exact_value_offset_;
  }

  // Coordinate j of token t's key or value, as attention reads it: its
  // exact copy when the token is exact (and `exact_copies`), else what its
  // compressed bytes stand for under the field `f` (the kernel's rounded
  // codebook for the integer kernel).
  double Key(const SyntheticField& f, int t, int j, bool exact_copies) const {
    if (exact_copies && Exact(t)) return HalfToFloat(ExactAt(t, 0)[j]);
    return f.Decode(Written(key_, t, false), Scalars(key_, t), j, c_.d);
  }
  double Value(const SyntheticField& f, int t, int j, bool exact_copies) const {
    if (exact_copies && Exact(t)) return HalfToFloat(ExactAt(t, exact_value_offset_)[j]);
    return f.Decode(Written(value_, t, false), Scalars(value_, t), j, c_.d);
  }
  const uint16_t* Scalars(const FieldReader& f, int t) const {
    return reinterpret_cast<const uint16_t*>(Written(f, t, true));
  }
  const FieldReader& value_field() const { return value_; }

 private:
  void DescribeFields() {
    key_ = kf_.Reader(c_.d);
    value_ = vf_.Reader(c_.d);
    const size_t n = c_.page_tokens;
    key_.codes_offset = 0;
    key_.scalars_offset = Align(n * key_.code_bytes);
    value_.codes_offset = Align(key_.scalars_offset + n * 2 * key_.num_scalars);
    value_.scalars_offset = Align(value_.codes_offset + n * value_.code_bytes);
    exact_value_offset_ = Align(static_cast<size_t>(c_.exact_page_tokens) * 2 * c_.d);
    page_bytes_ = std::max(Align(value_.scalars_offset + n * 2 * value_.num_scalars),
                           Align(exact_value_offset_ + static_cast<size_t>(c_.exact_page_tokens) * 2 * c_.d));
  }

  // Random bytes token-major into written_ (which Key and Value read), then
  // the tiled planes' codes into their tiles in the pool.
  void FillCompressed(Random& rng) {
    written_.assign(pool_.size(), 0);
    for (int t = 0; t < c_.tokens; ++t) {
      kf_.Fill(rng, c_.d, Written(key_, t, false), const_cast<uint16_t*>(Scalars(key_, t)));
      vf_.Fill(rng, c_.d, Written(value_, t, false), const_cast<uint16_t*>(Scalars(value_, t)));
    }
    pool_ = written_;
    for (const FieldReader* f : {&key_, &value_}) {
      if (!f->tiled) continue;
      const CodePlane plane{c_.page_tokens, f->code_bytes, true};
      for (int32_t page : table_) {
        const size_t codes = static_cast<size_t>(page) * page_bytes_ + f->codes_offset;
        for (int slot = 0; slot < c_.page_tokens; ++slot) {
          ScatterCodes(written_.data() + codes + static_cast<size_t>(slot) * f->code_bytes, plane, slot,
                       pool_.data() + codes);
        }
      }
    }
  }

  void FillExact(Random& rng) {
    for (int t = 0; t < c_.tokens; ++t) {
      if (!Exact(t)) continue;
      for (size_t offset : {size_t{0}, exact_value_offset_}) {
        uint16_t* x = const_cast<uint16_t*>(ExactAt(t, offset));
        for (int j = 0; j < c_.d; ++j) x[j] = FloatToHalf(static_cast<float>(rng.NextGaussian()));
      }
    }
  }

  uint8_t* Written(const FieldReader& f, int t, bool scalars) const {
    uint8_t* page =
        const_cast<uint8_t*>(written_.data()) + static_cast<size_t>(table_[t / c_.page_tokens]) * page_bytes_;
    const size_t slot = t % c_.page_tokens;
    return scalars ? page + f.scalars_offset + slot * 2 * f.num_scalars : page + f.codes_offset + slot * f.code_bytes;
  }
  const uint16_t* ExactAt(int t, size_t offset) const {
    const uint8_t* page = pool_.data() + static_cast<size_t>(exact_table_[t / c_.exact_page_tokens]) * page_bytes_;
    return reinterpret_cast<const uint16_t*>(page + offset) + static_cast<size_t>(t % c_.exact_page_tokens) * c_.d;
  }

  const RecipeCase c_;
  const SyntheticField& kf_;
  const SyntheticField& vf_;
  FieldReader key_, value_;
  size_t exact_value_offset_ = 0;
  size_t page_bytes_ = 0;
  int sink_end_ = 0, recent_begin_ = 0;
  std::vector<uint8_t> pool_, written_;
  std::vector<int32_t> table_, exact_table_;
};

// Random add-back coefficients and frequencies for `rows` rows.
struct AddBack {
  std::vector<double> theta;
  std::vector<cpu_internal::AddBackFrequency> tables;
  std::vector<const cpu_internal::AddBackFrequency*> freq;
  std::vector<float> coef;  // [rows][2 * pairs]

  AddBack(int pairs, int rows, Random& rng) {
    for (int i = 0; i < pairs; ++i) {
      theta.push_back(std::pow(10000.0, -rng.NextDouble()) * (i % 2 == 0 ? 1.0 : 0.5));
      tables.push_back(cpu_internal::TabulateAddBackFrequency(theta.back()));
    }
    for (const auto& t : tables) freq.push_back(&t);
    for (int i = 0; i < rows * 2 * pairs; ++i) coef.push_back(static_cast<float>(0.7 * rng.NextGaussian()));
  }

  // The integer kernel's bound on its int16 rounding of row r's add-back
  // (IntegerAddBack in integer_attend.h), plus float rounding.
  double IntegerBound(int r) const {
    const int pairs = static_cast<int>(theta.size());
    double sum = 0, largest = 0;
    for (int i = 0; i < pairs; ++i) {
      const double a = coef[static_cast<size_t>(r) * 2 * pairs + i];
      const double b = coef[static_cast<size_t>(r) * 2 * pairs + pairs + i];
      sum += std::hypot(a, b);
      largest = std::max(largest, std::hypot(a, b));
    }
    if (sum == 0) return 0;
    const double scale = std::min(32767.0 / largest, 65536.0 / sum);
    return std::sqrt(2.0) * (pairs / (2 * scale) + sum / 32768) + 1e-6 * sum;
  }

  double At(int r, int64_t t) const {
    const int pairs = static_cast<int>(theta.size());
    double sum = 0;
    for (int i = 0; i < pairs; ++i) {
      sum += coef[static_cast<size_t>(r) * 2 * pairs + i] * std::cos(static_cast<double>(t) * theta[i]) +
             coef[static_cast<size_t>(r) * 2 * pairs + pairs + i] * std::sin(static_cast<double>(t) * theta[i]);
    }
    return sum;
  }
};

// What one row of the kernel must produce, in float64, and how far the
// integer kernel's 8-bit weights may move it.
struct Expected {
  std::vector<double> out;
  double lse = -std::numeric_limits<double>::infinity();
  double weights_bound = 0;  // integer kernel: over the denominator, as attend_kernels.h bounds it
  double largest_value = 0;  // the largest norm of a value the row sees
};

Expected Reference(const RecipePages& pages, const RecipeCase& c, const SyntheticField& kf, const SyntheticField& vf,
                   const float* q, const float* exact_q, double exact_scale, const AddBack& addback, int r,
                   int64_t visible) {
  Expected e;
  e.out.assign(c.d, 0.0);
  if (visible <= c.token_begin) return e;
  std::vector<double> logits(visible, 0.0);
  double top = -1e300;
  for (int64_t t = c.token_begin; t < visible; ++t) {
    const bool exact = pages.Exact(static_cast<int>(t));
    double dot = 0;
    for (int j = 0; j < c.d; ++j) {
      dot += (exact ? exact_scale * exact_q[j] : q[j]) * pages.Key(kf, static_cast<int>(t), j, true);
    }
    logits[t] = dot + (addback.theta.empty() ? 0.0 : addback.At(r, t));
    top = std::max(top, logits[t]);
  }
  double sum = 0, value_top = 0, unscaled = 0;
  for (int64_t t = c.token_begin; t < visible; ++t) {
    sum += (logits[t] = std::exp(logits[t] - top));
    if (pages.Exact(static_cast<int>(t))) continue;
    const FieldReader& vr = pages.value_field();
    const double scale = vr.num_scalars > 0 ? HalfToFloat(pages.Scalars(vr, static_cast<int>(t))[0]) : 1.0;
    const double zero =
        vr.format == FormatFamily::kUniform ? HalfToFloat(pages.Scalars(vr, static_cast<int>(t))[1]) : 0.0;
    double sq = 0;
    for (int j = 0; j < c.d; ++j) {
      const double v = pages.Value(vf, static_cast<int>(t), j, true) - zero;
      sq += v * v;
    }
    value_top = std::max(value_top, logits[t] * scale);
    unscaled += std::sqrt(sq) / scale;
  }
  for (int64_t t = c.token_begin; t < visible; ++t) {
    double sq = 0;
    for (int j = 0; j < c.d; ++j) {
      const double v = pages.Value(vf, static_cast<int>(t), j, true);
      e.out[j] += logits[t] / sum * v;
      sq += v * v;
    }
    e.largest_value = std::max(e.largest_value, std::sqrt(sq));
  }
  e.lse = top + std::log(sum);
  e.weights_bound = 1.25 * value_top / 255 * unscaled / sum;
  return e;
}

// The integer kernel's roundings of the compressed side (attend_kernels.h):
// the query per row and the key and value codebooks to int8 units.
void IntegerModel(const SyntheticField& kf, const SyntheticField& vf, int d, int rows, SyntheticField* kf_int,
                  SyntheticField* vf_int, std::vector<float>* queries) {
  *kf_int = kf;
  *vf_int = vf;
  for (auto [from, to] :
       {std::pair{&kf.centroids, &kf_int->centroids}, {&kf.cold_centroids, &kf_int->cold_centroids}}) {
    if (from->empty()) continue;
    const float unit = cpu_internal::IntegerKeyUnit(from->data(), static_cast<int>(from->size()));
    for (float& x : *to) x = std::lrint(x / unit) * unit;
  }
  if (!vf.centroids.empty()) {
    const float unit = cpu_internal::ValueUnit(vf.centroids.data(), static_cast<int>(vf.centroids.size()));
    for (float& x : vf_int->centroids) x = std::lrint(x / unit) * unit;
  }
  const int hot = kf.split() ? d / 2 : d;
  for (int r = 0; r < rows; ++r) {
    for (auto [begin, end] : {std::pair{0, hot}, {hot, d}}) {
      float max_q = 0;
      for (int j = begin; j < end; ++j) max_q = std::max(max_q, std::fabs((*queries)[r * d + j]));
      for (int j = begin; j < end; ++j) {
        (*queries)[r * d + j] = std::lrint((*queries)[r * d + j] / (max_q / 127)) * (max_q / 127);
      }
    }
  }
}

struct NamedKernel {
  std::string name;
  cpu_internal::AttendKernel kernel;
  bool (*supported)(const FieldReader&, const FieldReader&, int);
};

std::vector<NamedKernel> Kernels() {
  std::vector<NamedKernel> kernels;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    kernels.push_back({"avx2", cpu_internal::AttendHeadAvx2, cpu_internal::AttendHeadAvx2Supported});
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    kernels.push_back({"avx512", cpu_internal::AttendHeadAvx512, cpu_internal::AttendHeadAvx512Supported});
  }
  if (DetectedSimdLevel() >= SimdLevel::kAvx512Vnni) {
    kernels.push_back({"avx512_vnni", cpu_internal::AttendHeadAvx512Vnni, cpu_internal::AttendHeadAvx512VnniSupported});
  }
  return kernels;
}

// Runs every kernel that takes the formats over one case and checks each row.
void CheckCase(const RecipeCase& c, const SyntheticField& kf, const SyntheticField& vf, Random& rng) {
  SCOPED_TRACE(Describe(c) + " key " + std::to_string(static_cast<int>(kf.format)) + "/" + std::to_string(kf.bits) +
               " value " + std::to_string(static_cast<int>(vf.format)) + "/" + std::to_string(vf.bits));
  const RecipePages pages(c, kf, vf, rng);
  const int rows = 7;  // row tiles of 4, 2 and 1
  const std::vector<int64_t> visible = {c.tokens, c.tokens - 1, 1, 64, 17, std::min(100, c.tokens), 65};
  // Different queries for the exact tokens: the kernels must take those there.
  std::vector<float> queries(static_cast<size_t>(rows) * c.d), exact_queries(queries.size());
  for (float& x : queries) x = static_cast<float>(0.3 * rng.NextGaussian());
  for (float& x : exact_queries) x = static_cast<float>(0.3 * rng.NextGaussian());
  const AddBack addback(c.pairs, rows, rng);
  SyntheticField kf_int, vf_int;
  std::vector<float> queries_int = queries;
  IntegerModel(kf, vf, c.d, rows, &kf_int, &vf_int, &queries_int);
  for (const NamedKernel& k : Kernels()) {
    cpu_internal::HeadAttendParams p;
    pages.Fill(&p);
    if (!k.supported(p.key, p.value, c.d)) continue;
    SCOPED_TRACE(k.name);
    const bool integer = k.name == "avx512_vnni";
    std::vector<float> out(queries.size()), exact_out(queries.size(), NAN), lse(rows);
    p.rows = rows;
    p.queries = queries.data();
    p.visible = visible.data();
    p.addback_pairs = c.pairs;
    p.addback_freq = addback.freq.data();
    p.addback_coef = addback.coef.data();
    std::vector<const float*> exact_rows;
    for (int r = 0; r < rows; ++r) exact_rows.push_back(exact_queries.data() + r * c.d);
    p.exact.query_rows = exact_rows.data();
    p.exact.query_scale = 0.5f;
    p.exact.out = exact_out.data();
    p.out = out.data();
    p.lse = lse.data();
    k.kernel(p);
    for (int r = 0; r < rows; ++r) {
      const Expected want = Reference(pages, c, integer ? kf_int : kf, integer ? vf_int : vf,
                                      (integer ? queries_int : queries).data() + r * c.d,
                                      exact_queries.data() + r * c.d, p.exact.query_scale, addback, r, visible[r]);
      double error = 0, norm = 0;
      for (int j = 0; j < c.d; ++j) {
        const double got = out[r * c.d + j] + (p.exact.any() ? exact_out[r * c.d + j] : 0.0);
        error += (got - want.out[j]) * (got - want.out[j]);
        norm += want.out[j] * want.out[j];
      }
      // The integer kernel's add-back moves each logit by at most `shift`:
      // each weight by a factor within e^{+-2 shift} of the reference's.
      const double shift = integer ? addback.IntegerBound(r) : 0.0;
      const double bound =
          (integer ? want.weights_bound + 2.5 * shift * want.largest_value : 0.0) + 1e-5 * std::sqrt(norm) + 1e-7;
      EXPECT_LE(std::sqrt(error), bound) << "row " << r;
      if (std::isinf(want.lse)) {
        EXPECT_TRUE(std::isinf(lse[r]) && lse[r] < 0) << "row " << r << " lse " << lse[r];
      } else {
        EXPECT_NEAR(lse[r], want.lse, shift + 1e-5 * std::max(1.0, std::fabs(want.lse))) << "row " << r;
      }
    }
  }
}

std::vector<std::pair<SyntheticField, SyntheticField>> FormatPairs(Random& rng) {
  const auto field = [&](FormatFamily format, int bits, int cold_bits = 0) {
    return SyntheticField::Make(format, bits, cold_bits, rng);
  };
  return {{field(FormatFamily::kTurboQuant, 3), field(FormatFamily::kUniform, 4)},
          {field(FormatFamily::kTurboQuant, 4), field(FormatFamily::kTurboQuant, 3)},
          {field(FormatFamily::kTurboQuant, 4, 3), field(FormatFamily::kUniform, 2)},
          {field(FormatFamily::kBf16, 16), field(FormatFamily::kFp16, 16)}};
}

TEST(RecipeKernels, ExactTokensAndAddBackAgainstFloat64AtEveryBoundary) {
  if (Kernels().empty()) GTEST_SKIP() << "no AVX2";
  Random rng(21);
  const auto formats = FormatPairs(rng);
  std::vector<RecipeCase> cases;
  const auto add = [&](auto edit) {
    RecipeCase c;
    edit(c);
    cases.push_back(c);
  };
  add([](RecipeCase&) {});                                  // the default recipe's shape
  add([](RecipeCase& c) { c.recent = 0; });                 // sinks only
  add([](RecipeCase& c) { c.sinks = 0; });                  // recent tokens only
  add([](RecipeCase& c) { c.recent = 200; });               // the recent tokens cover the context
  add([](RecipeCase& c) { c.sinks = 200, c.recent = 0; });  // the sinks cover it
  add([](RecipeCase& c) { c.sinks = 70, c.recent = 17; });  // sinks past a block, recent tokens inside a group
  add([](RecipeCase& c) { c.sinks = 16, c.recent = 22, c.token_begin = 37; });  // a late start: sinks unseen
  add([](RecipeCase& c) { c.sinks = 0, c.recent = 0; });                        // the add-back alone
  add([](RecipeCase& c) { c.pairs = 0, c.page_tokens = 7, c.exact_page_tokens = 5, c.token_begin = 9; });
  add([](RecipeCase& c) {
    c.d = 64, c.page_tokens = 1, c.exact_page_tokens = 1, c.tokens = 90, c.sinks = 3, c.recent = 20, c.pairs = 2;
  });
  add([](RecipeCase& c) { c.d = 256, c.exact_page_tokens = 2, c.tokens = 130, c.pairs = 64; });
  for (const RecipeCase& c : cases) {
    for (const auto& [kf, vf] : formats) CheckCase(c, kf, vf, rng);
  }
}

}  // namespace
}  // namespace tqkv
