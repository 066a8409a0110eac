#include "kernels/codec.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/bitpack.h"
#include "kernels/codec_internal.h"
#include "kernels/blocked_sums.h"
#include "kernels/simd/encode_kernels.h"
#include "kernels/float_formats.h"
#include "base/random.h"
#include "base/status_macros.h"

namespace tqkv {
namespace codec_internal {

// OK if every coordinate is finite, else NonFiniteError. `simd`: the store
// kernels to use, or nullptr.
absl::Status CheckAllFinite(const float* x, int n, const encode_internal::EncodeKernels* simd) {
  if (simd) {
    if (simd->all_finite_within(x, n, __builtin_inff())) return absl::OkStatus();
    return NonFiniteError(x, n);
  }
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return NonFiniteError(x, n);
  }
  return absl::OkStatus();
}

absl::Status NonFiniteError(const float* x, int n) {
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) {
      return absl::InvalidArgumentError(absl::StrFormat("coordinate %d is %f; vectors must be finite", i, x[i]));
    }
  }
  return absl::InvalidArgumentError("vector is not finite");
}

absl::Status CheckFiniteAndInRange(const float* x, int n, float limit, const char* format,
                                   const encode_internal::EncodeKernels* simd) {
  // The vector check only answers "all fine"; the loop below finds the error.
  if (simd && simd->all_finite_within(x, n, limit)) return absl::OkStatus();
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return NonFiniteError(x, n);
    if (std::fabs(x[i]) > limit) {
      return absl::InvalidArgumentError(
          absl::StrFormat("coordinate %d is %g, beyond the %s range (|x| <= %g)", i, x[i], format, limit));
    }
  }
  return absl::OkStatus();
}

}  // namespace codec_internal

namespace {

using codec_internal::CheckAllFinite;
using codec_internal::CheckFiniteAndInRange;
using codec_internal::NonFiniteError;

static_assert(encode_internal::kMaxEncodeDim == kMaxHeadDim, "the store kernels take every head");

// Seed streams for the sub-components a codec derives from its seed.
constexpr uint64_t kHotPartStream = 1;
constexpr uint64_t kColdPartStream = 2;
constexpr uint64_t kSketchStream = 3;

// sum x^2 in double in the blocked order (blocked_sums.h), and whether every
// coordinate is finite: squares of floats cannot overflow a double, so the sum
// is finite exactly when every coordinate is (NaN and infinities propagate
// into it).
bool SumOfSquares(const float* x, int n, double* sum) {
  if (const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels()) {
    return simd->sum_of_squares(x, n, sum);
  }
  *sum = BlockedSum<double>(n, [x](int i) { return static_cast<double>(x[i]) * x[i]; });
  return std::isfinite(*sum);
}

// sum c^2 in float in the blocked order, c = centroids[levels[i]]: the
// codeword's squared norm that norm correction divides by.
float CodewordSum(const float* centroids, int bits, const uint8_t* levels, int n) {
  if (const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels()) {
    return simd->codeword_sum(centroids, bits, levels, n);
  }
  return BlockedSum<float>(n, [centroids, levels](int i) {
    const float c = centroids[levels[i]];
    return c * c;
  });
}

// Asks for the cache lines of x[0, n).
void PrefetchVector(const float* x, int n) {
  const char* bytes = reinterpret_cast<const char*>(x);
  for (int offset = 0; offset < n * static_cast<int>(sizeof(float)); offset += 64) __builtin_prefetch(bytes + offset);
}

// ---------------------------------------------------------------------------
// TurboQuant-MSE over a set of channels: the building block of kTurboQuant
// (all channels) and kOutlierSplit (two parts). Works on gathered channels.

class TurboQuantQuantizer {
 public:
  TurboQuantQuantizer(int dim, int bits, bool norm_correction, const Codebook* codebook,
                      std::shared_ptr<const Rotation> rotation)
      : dim_(dim), bits_(bits), norm_correction_(norm_correction), codebook_(codebook), rotation_(std::move(rotation)),
        tables_(encode_internal::MakeQuantizeTables(codebook->boundaries.data(),
                                                    norm_correction ? codebook->centroids.data() : nullptr, bits)) {
    const Rotation::Kind kind = rotation_->kind();
    fused_hadamard_ = (kind == Rotation::Kind::kRandomizedHadamard || kind == Rotation::Kind::kPlainHadamard) &&
                      rotation_->hadamard_factor_order() == 1 && encode_internal::CanRotateQuantizePack(dim, bits);
  }

  int dim() const { return dim_; }
  int code_bytes() const { return PackedBytes(dim_, bits_); }
  const Codebook* codebook() const { return codebook_; }
  const std::shared_ptr<const Rotation>& rotation() const { return rotation_; }

  // x: dim_ finite floats. Writes packed codes and the fp16 scale.
  absl::Status Encode(const float* x, uint8_t* codes, uint16_t* scale_out) const {
    double sum_sq;
    SumOfSquares(x, dim_, &sum_sq);
    return EncodeWithSumOfSquares(x, sum_sq, codes, scale_out);
  }

  // Encode with sum_sq = SumOfSquares(x) already computed (finite).
  absl::Status EncodeWithSumOfSquares(const float* x, double sum_sq, uint8_t* codes, uint16_t* scale_out) const {
    const double norm = std::sqrt(sum_sq);
    if (norm == 0.0) return WriteZero(codes, scale_out);
    float y[kMaxHeadDim];
    uint8_t packed[kMaxHeadDim];
    const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels();
    const float codeword_sq = RotateQuantizePack(simd, x, norm, y, packed);
    return Finish(norm, codeword_sq, packed, codes, scale_out);
  }

  // Encode of n vectors (VectorCodec::EncodeMany), the same bytes. Each step
  // runs over a batch of vectors before the next: one vector's encode is a
  // chain of dependent steps (sum, square root, division, rotation, search,
  // sum, square root, division), while a step's work for different vectors
  // is independent, so the core overlaps vectors instead of waiting.
  absl::Status EncodeMany(int n, const float* const* x, uint8_t* const* codes, uint16_t* const* scale_out,
                          int* failed) const {
    constexpr int kBatch = 8;
    alignas(64) float y[kBatch * kMaxHeadDim];
    uint8_t packed[kBatch * kMaxHeadDim];
    const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels();
    for (int k0 = 0; k0 < n; k0 += kBatch) {
      const int m = std::min(kBatch, n - k0);
      // The next batch's inputs start arriving while this one is encoded.
      for (int v = k0 + kBatch; v < std::min(n, k0 + 2 * kBatch); ++v) PrefetchVector(x[v], dim_);
      double norm[kBatch];
      float codeword_sq[kBatch];
      int good = m;  // vectors before the first that is not finite
      for (int v = 0; v < m; ++v) {
        double sum_sq;
        if (!SumOfSquares(x[k0 + v], dim_, &sum_sq)) {
          good = v;
          break;
        }
        norm[v] = std::sqrt(sum_sq);
      }
      if (Fuses(simd)) {
        for (int v = 0; v < good; ++v) {
          if (norm[v] != 0.0) codeword_sq[v] = RotateQuantizePack(simd, x[k0 + v], norm[v], y, packed + v * dim_);
        }
      } else {
        for (int v = 0; v < good; ++v) {
          if (norm[v] != 0.0) Rotate(simd, x[k0 + v], norm[v], y + v * dim_);
        }
        for (int v = 0; v < good; ++v) {
          if (norm[v] != 0.0) codeword_sq[v] = QuantizePack(simd, y + v * dim_, packed + v * dim_);
        }
      }
      for (int v = 0; v < good; ++v) {
        absl::Status status =
            norm[v] == 0.0 ? WriteZero(codes[k0 + v], scale_out[k0 + v])
                           : Finish(norm[v], codeword_sq[v], packed + v * dim_, codes[k0 + v], scale_out[k0 + v]);
        if (!status.ok()) {
          *failed = k0 + v;
          return status;
        }
      }
      if (good < m) {
        *failed = k0 + good;
        return NonFiniteError(x[k0 + good], dim_);
      }
    }
    return absl::OkStatus();
  }

  // Rotated-domain decode: y[i] = scale * centroid[code_i].
  void DecodeRotated(const uint8_t* codes, uint16_t scale_h, float* y) const {
    const float scale = HalfToFloat(scale_h);
    uint8_t levels[kMaxHeadDim];
    UnpackBits(codes, dim_, bits_, levels);
    const float* centroids = codebook_->centroids.data();
    for (int i = 0; i < dim_; ++i) y[i] = scale * centroids[levels[i]];
  }

  // <rotated_query, scale * centroids[codes]>.
  float Score(const float* rotated_query, const uint8_t* codes, uint16_t scale_h) const {
    uint8_t levels[kMaxHeadDim];
    UnpackBits(codes, dim_, bits_, levels);
    const float* centroids = codebook_->centroids.data();
    float dot = 0.0f;
    for (int i = 0; i < dim_; ++i) dot += rotated_query[i] * centroids[levels[i]];
    return HalfToFloat(scale_h) * dot;
  }

  void Accumulate(float weight, const uint8_t* codes, uint16_t scale_h, float* acc) const {
    const float scale = weight * HalfToFloat(scale_h);
    uint8_t levels[kMaxHeadDim];
    UnpackBits(codes, dim_, bits_, levels);
    const float* centroids = codebook_->centroids.data();
    for (int i = 0; i < dim_; ++i) acc[i] += scale * centroids[levels[i]];
  }

 private:
  absl::Status WriteZero(uint8_t* codes, uint16_t* scale_out) const {
    std::fill(codes, codes + code_bytes(), 0);
    *scale_out = 0;  // decodes to exactly zero whatever the codes
    return absl::OkStatus();
  }

  // y = rotation(x * (float)(1 / norm)), norm > 0. `simd`: the store
  // kernels (ActiveEncodeKernels()), or nullptr for the portable code.
  void Rotate(const encode_internal::EncodeKernels* simd, const float* x, double norm, float* y) const {
    const float inv_norm = static_cast<float>(1.0 / norm);
    if (simd) {
      simd->scale(x, dim_, inv_norm, y);
    } else {
      for (int i = 0; i < dim_; ++i) y[i] = x[i] * inv_norm;
    }
    rotation_->Forward(y, y);
  }

  // Whether RotateQuantizePack runs as one kernel of `simd`.
  bool Fuses(const encode_internal::EncodeKernels* simd) const {
    return simd != nullptr && simd->rotate_quantize_pack != nullptr && fused_hadamard_;
  }

  // Rotate, then QuantizePack: the packed levels of x / norm rotated, in one
  // kernel where the store kernels have it for this rotation (`y`: dim_
  // floats of scratch otherwise).
  float RotateQuantizePack(const encode_internal::EncodeKernels* simd, const float* x, double norm, float* y,
                           uint8_t* packed) const {
    if (Fuses(simd)) {
      const float* pre = rotation_->signs().empty() ? nullptr : rotation_->signs().data();
      return simd->rotate_quantize_pack(x, static_cast<float>(1.0 / norm), pre, dim_, tables_, packed);
    }
    Rotate(simd, x, norm, y);
    return QuantizePack(simd, y, packed);
  }

  // The packed levels of y; returns the codeword's squared norm with norm
  // correction, else 0.
  float QuantizePack(const encode_internal::EncodeKernels* simd, const float* y, uint8_t* packed) const {
    const float* centroids = codebook_->centroids.data();
    if (simd) {
      return simd->quantize_pack(tables_, y, dim_, packed);
    }
    uint8_t levels[kMaxHeadDim];
    QuantizeToLevels(*codebook_, y, dim_, levels);
    PackBits(levels, dim_, bits_, packed);
    return norm_correction_ ? CodewordSum(centroids, bits_, levels, dim_) : 0.0f;
  }

  // The stored scale from the norm (and the codeword's squared norm); writes
  // the packed codes only when it fits in fp16.
  absl::Status Finish(double norm, float codeword_sq, const uint8_t* packed, uint8_t* codes,
                      uint16_t* scale_out) const {
    double scale = norm;
    if (norm_correction_) scale /= std::sqrt(static_cast<double>(codeword_sq));
    if (!(scale <= kHalfMax)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("vector norm %g is beyond the fp16 range of the stored norm (<= %g)", norm, kHalfMax));
    }
    std::copy_n(packed, code_bytes(), codes);
    *scale_out = FloatToHalf(static_cast<float>(scale));
    return absl::OkStatus();
  }

  int dim_;
  int bits_;
  bool norm_correction_;
  const Codebook* codebook_;
  std::shared_ptr<const Rotation> rotation_;
  encode_internal::QuantizeTables tables_;  // of *codebook_, for the store kernels
  // rotation_ is a power-of-two Hadamard that RotateQuantizePack fuses.
  bool fused_hadamard_ = false;
};

absl::StatusOr<TurboQuantQuantizer> MakeQuantizer(int dim, int bits, bool norm_correction, uint64_t seed) {
  ASSIGN_OR_RETURN(const Codebook* codebook, GetCodebook(dim, bits));
  ASSIGN_OR_RETURN(std::shared_ptr<const Rotation> rotation, Rotation::Create(dim, seed));
  return TurboQuantQuantizer(dim, bits, norm_correction, codebook, std::move(rotation));
}

class TurboQuantCodec final : public VectorCodec {
 public:
  TurboQuantCodec(const CodecSpec& spec, int head_dim, TurboQuantQuantizer quantizer)
      : VectorCodec(spec, head_dim), quantizer_(std::move(quantizer)) {
    code_bytes_ = quantizer_.code_bytes();
    num_scalars_ = 1;
    query_state_floats_ = head_dim;
    accumulator_floats_ = head_dim;
    TurboQuantPart part;
    part.channels.resize(head_dim);
    std::iota(part.channels.begin(), part.channels.end(), 0);
    part.codebook = quantizer_.codebook();
    part.rotation = quantizer_.rotation();
    parts_.push_back(std::move(part));
  }

  absl::Status Encode(const float* x, uint8_t* codes, uint16_t* scalars) const override {
    // The sum of squares is finite exactly when every coordinate is: one pass
    // checks and measures.
    double sum_sq;
    if (!SumOfSquares(x, head_dim_, &sum_sq)) return NonFiniteError(x, head_dim_);
    return quantizer_.EncodeWithSumOfSquares(x, sum_sq, codes, &scalars[0]);
  }

  absl::Status EncodeMany(int n, const float* const* x, uint8_t* const* codes, uint16_t* const* scalars,
                          int* failed) const override {
    return quantizer_.EncodeMany(n, x, codes, scalars, failed);  // one scalar per vector: the scale
  }

  void Decode(const uint8_t* codes, const uint16_t* scalars, float* x) const override {
    quantizer_.DecodeRotated(codes, scalars[0], x);
    quantizer_.rotation()->Inverse(x, x);
  }

  void PrepareQuery(const float* q, float* state) const override { quantizer_.rotation()->Forward(q, state); }

  float Score(const float* state, const uint8_t* codes, const uint16_t* scalars) const override {
    return quantizer_.Score(state, codes, scalars[0]);
  }

  void Accumulate(float weight, const uint8_t* codes, const uint16_t* scalars, float* acc) const override {
    quantizer_.Accumulate(weight, codes, scalars[0], acc);
  }

  void FinishAccumulation(const float* acc, float* out) const override { quantizer_.rotation()->Inverse(acc, out); }

 private:
  TurboQuantQuantizer quantizer_;
};

// ---------------------------------------------------------------------------
// Outlier split: hot channels and cold channels as two TurboQuant parts.
// codes = [hot codes | cold codes], scalars = [hot scale, cold scale].

class OutlierSplitCodec final : public VectorCodec {
 public:
  OutlierSplitCodec(const CodecSpec& spec, int head_dim, std::vector<int> hot, std::vector<int> cold,
                    TurboQuantQuantizer hot_part, TurboQuantQuantizer cold_part)
      : VectorCodec(spec, head_dim), hot_(std::move(hot)), cold_(std::move(cold)), hot_part_(std::move(hot_part)),
        cold_part_(std::move(cold_part)) {
    code_bytes_ = hot_part_.code_bytes() + cold_part_.code_bytes();
    num_scalars_ = 2;
    query_state_floats_ = head_dim;  // [Pi_hot q_hot | Pi_cold q_cold]
    accumulator_floats_ = head_dim;
    TurboQuantPart hot_desc{hot_, 0, 0, hot_part_.codebook(), hot_part_.rotation()};
    TurboQuantPart cold_desc{cold_, hot_part_.code_bytes(), 1, cold_part_.codebook(), cold_part_.rotation()};
    parts_.push_back(std::move(hot_desc));
    parts_.push_back(std::move(cold_desc));
  }

  absl::Status Encode(const float* x, uint8_t* codes, uint16_t* scalars) const override {
    RETURN_IF_ERROR(CheckAllFinite(x, head_dim_, encode_internal::ActiveEncodeKernels()));
    float gathered[kMaxHeadDim];
    Gather(x, hot_, gathered);
    RETURN_IF_ERROR(hot_part_.Encode(gathered, codes, &scalars[0]));
    Gather(x, cold_, gathered);
    return cold_part_.Encode(gathered, codes + hot_part_.code_bytes(), &scalars[1]);
  }

  void Decode(const uint8_t* codes, const uint16_t* scalars, float* x) const override {
    float part[kMaxHeadDim];
    hot_part_.DecodeRotated(codes, scalars[0], part);
    hot_part_.rotation()->Inverse(part, part);
    Scatter(part, hot_, x);
    cold_part_.DecodeRotated(codes + hot_part_.code_bytes(), scalars[1], part);
    cold_part_.rotation()->Inverse(part, part);
    Scatter(part, cold_, x);
  }

  void PrepareQuery(const float* q, float* state) const override {
    const int h = static_cast<int>(hot_.size());
    Gather(q, hot_, state);
    hot_part_.rotation()->Forward(state, state);
    Gather(q, cold_, state + h);
    cold_part_.rotation()->Forward(state + h, state + h);
  }

  float Score(const float* state, const uint8_t* codes, const uint16_t* scalars) const override {
    const int h = static_cast<int>(hot_.size());
    return hot_part_.Score(state, codes, scalars[0]) +
           cold_part_.Score(state + h, codes + hot_part_.code_bytes(), scalars[1]);
  }

  void Accumulate(float weight, const uint8_t* codes, const uint16_t* scalars, float* acc) const override {
    const int h = static_cast<int>(hot_.size());
    hot_part_.Accumulate(weight, codes, scalars[0], acc);
    cold_part_.Accumulate(weight, codes + hot_part_.code_bytes(), scalars[1], acc + h);
  }

  void FinishAccumulation(const float* acc, float* out) const override {
    const int h = static_cast<int>(hot_.size());
    float part[kMaxHeadDim];
    hot_part_.rotation()->Inverse(acc, part);
    Scatter(part, hot_, out);
    cold_part_.rotation()->Inverse(acc + h, part);
    Scatter(part, cold_, out);
  }

 private:
  static void Gather(const float* x, const std::vector<int>& channels, float* out) {
    for (size_t i = 0; i < channels.size(); ++i) out[i] = x[channels[i]];
  }
  static void Scatter(const float* part, const std::vector<int>& channels, float* x) {
    for (size_t i = 0; i < channels.size(); ++i) x[channels[i]] = part[i];
  }

  std::vector<int> hot_;
  std::vector<int> cold_;
  TurboQuantQuantizer hot_part_;
  TurboQuantQuantizer cold_part_;
};

// ---------------------------------------------------------------------------
// QJL: (bits-1)-bit MSE codes of the rotated unit vector y, plus the signs of
// S r for the residual r = y - c[idx] (S a seeded Gaussian head_dim x head_dim
// matrix) and ||r||. <q, x> is estimated without bias as
//   n * (<Pi q, c[idx]> + ||r|| * sqrt(pi/2) / d * <S Pi q, sign(S r)>).
// codes = [MSE codes | sign bits], scalars = [norm, residual norm].

class QjlCodec final : public VectorCodec {
 public:
  QjlCodec(const CodecSpec& spec, int head_dim, TurboQuantQuantizer mse, std::vector<float> sketch)
      : VectorCodec(spec, head_dim), mse_(std::move(mse)), sketch_(std::move(sketch)) {
    code_bytes_ = mse_.code_bytes() + PackedBytes(head_dim, 1);
    num_scalars_ = 2;
    query_state_floats_ = 2 * head_dim;  // [Pi q | S Pi q]
    accumulator_floats_ = 2 * head_dim;  // [sum w n c | sum w n |r| k sign]
    sketch_gain_ = static_cast<float>(std::sqrt(M_PI / 2.0) / head_dim);
    TurboQuantPart part;
    part.channels.resize(head_dim);
    std::iota(part.channels.begin(), part.channels.end(), 0);
    part.codebook = mse_.codebook();
    part.rotation = mse_.rotation();
    parts_.push_back(std::move(part));
  }

  absl::Status Encode(const float* x, uint8_t* codes, uint16_t* scalars) const override {
    const int d = head_dim_;
    double sum_sq;
    if (!SumOfSquares(x, d, &sum_sq)) return NonFiniteError(x, d);
    const double norm = std::sqrt(sum_sq);
    uint8_t* sign_codes = codes + mse_.code_bytes();
    if (norm == 0.0) {
      std::fill(codes, codes + code_bytes_, 0);
      scalars[0] = scalars[1] = 0;
      return absl::OkStatus();
    }
    if (norm > kHalfMax) {
      return absl::InvalidArgumentError(
          absl::StrFormat("vector norm %g is beyond the fp16 range of the stored norm (<= %g)", norm, kHalfMax));
    }
    // The MSE part quantizes the unit vector; its stored scale is then 1.
    float unit[kMaxHeadDim];
    const float inv_norm = static_cast<float>(1.0 / norm);
    for (int i = 0; i < d; ++i) unit[i] = x[i] * inv_norm;
    uint16_t unit_scale;
    RETURN_IF_ERROR(mse_.Encode(unit, codes, &unit_scale));
    float y[kMaxHeadDim], c[kMaxHeadDim], residual[kMaxHeadDim];
    mse_.rotation()->Forward(unit, y);
    mse_.DecodeRotated(codes, FloatToHalf(1.0f), c);
    double residual_sq = 0.0;
    for (int i = 0; i < d; ++i) {
      residual[i] = y[i] - c[i];
      residual_sq += static_cast<double>(residual[i]) * residual[i];
    }
    uint8_t signs[kMaxHeadDim];
    for (int row = 0; row < d; ++row) {
      const float* s = &sketch_[static_cast<size_t>(row) * d];
      float projection = 0.0f;
      for (int i = 0; i < d; ++i) projection += s[i] * residual[i];
      signs[row] = projection >= 0.0f ? 1 : 0;
    }
    PackBits(signs, d, 1, sign_codes);
    scalars[0] = FloatToHalf(static_cast<float>(norm));
    scalars[1] = FloatToHalf(static_cast<float>(std::sqrt(residual_sq)));
    return absl::OkStatus();
  }

  void Decode(const uint8_t* codes, const uint16_t* scalars, float* x) const override {
    std::vector<float> acc(2 * head_dim_, 0.0f);
    Accumulate(1.0f, codes, scalars, acc.data());
    FinishAccumulation(acc.data(), x);
  }

  void PrepareQuery(const float* q, float* state) const override {
    const int d = head_dim_;
    mse_.rotation()->Forward(q, state);
    for (int row = 0; row < d; ++row) {
      const float* s = &sketch_[static_cast<size_t>(row) * d];
      float projection = 0.0f;
      for (int i = 0; i < d; ++i) projection += s[i] * state[i];
      state[d + row] = projection;
    }
  }

  float Score(const float* state, const uint8_t* codes, const uint16_t* scalars) const override {
    const int d = head_dim_;
    const float norm = HalfToFloat(scalars[0]);
    const float residual_norm = HalfToFloat(scalars[1]);
    const float mse_dot = mse_.Score(state, codes, FloatToHalf(1.0f));
    const uint8_t* sign_codes = codes + mse_.code_bytes();
    float sketch_dot = 0.0f;
    for (int i = 0; i < d; ++i) {
      const float projection = state[d + i];
      sketch_dot += PackedCodeAt(sign_codes, i, 1) ? projection : -projection;
    }
    return norm * (mse_dot + residual_norm * sketch_gain_ * sketch_dot);
  }

  void Accumulate(float weight, const uint8_t* codes, const uint16_t* scalars, float* acc) const override {
    const int d = head_dim_;
    const float norm = HalfToFloat(scalars[0]);
    const float residual_norm = HalfToFloat(scalars[1]);
    mse_.Accumulate(weight * norm, codes, FloatToHalf(1.0f), acc);
    const float sign_weight = weight * norm * residual_norm * sketch_gain_;
    const uint8_t* sign_codes = codes + mse_.code_bytes();
    for (int i = 0; i < d; ++i) {
      acc[d + i] += PackedCodeAt(sign_codes, i, 1) ? sign_weight : -sign_weight;
    }
  }

  void FinishAccumulation(const float* acc, float* out) const override {
    const int d = head_dim_;
    float y[kMaxHeadDim];
    std::copy(acc, acc + d, y);
    // y += S^T (accumulated signed sketch weights).
    for (int row = 0; row < d; ++row) {
      const float w = acc[d + row];
      const float* s = &sketch_[static_cast<size_t>(row) * d];
      for (int i = 0; i < d; ++i) y[i] += w * s[i];
    }
    mse_.rotation()->Inverse(y, out);
  }

 private:
  TurboQuantQuantizer mse_;
  std::vector<float> sketch_;  // row-major d x d, iid N(0, 1)
  float sketch_gain_;
};

absl::Status ValidateHotChannels(const std::vector<int>& hot, int expected, int head_dim) {
  if (static_cast<int>(hot.size()) != expected) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outlier split needs %d hot channels for head_dim %d, got %d", expected, head_dim, hot.size()));
  }
  std::vector<bool> seen(head_dim, false);
  for (int channel : hot) {
    if (channel < 0 || channel >= head_dim) {
      return absl::InvalidArgumentError(absl::StrFormat("hot channel %d is out of range [0, %d)", channel, head_dim));
    }
    if (seen[channel]) {
      return absl::InvalidArgumentError(absl::StrFormat("hot channel %d is listed twice", channel));
    }
    seen[channel] = true;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status VectorCodec::EncodeMany(int n, const float* const* x, uint8_t* const* codes, uint16_t* const* scalars,
                                     int* failed) const {
  for (int k = 0; k < n; ++k) {
    // The next vector's lines start arriving while this one is encoded: a
    // store's inputs are mostly not in cache, and one vector's encode is a
    // chain of dependent steps that hides no miss of its own.
    if (k + 1 < n) PrefetchVector(x[k + 1], head_dim_);
    absl::Status status = Encode(x[k], codes[k], scalars[k]);
    if (!status.ok()) {
      *failed = k;
      return status;
    }
  }
  return absl::OkStatus();
}

std::string CodecSpec::Name() const {
  switch (kind) {
    case CodecKind::kFp16:
      return "fp16";
    case CodecKind::kBf16:
      return "bf16";
    case CodecKind::kFp8:
      return "fp8";
    case CodecKind::kTurboQuant:
      return absl::StrCat("tq", bits, norm_correction ? "_nc" : "");
    case CodecKind::kUniform:
      return absl::StrCat("uniform", bits);
    case CodecKind::kQjl:
      return absl::StrCat("qjl", bits);
    case CodecKind::kOutlierSplit:
      return absl::StrCat("tq", hot_bits, "/", bits, "_split", hot_divisor, norm_correction ? "_nc" : "");
  }
  return "unknown";
}

absl::Status CodecSpec::Validate() const {
  switch (kind) {
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      if (bits != 16) return absl::InvalidArgumentError("16-bit float codecs have 16 bits");
      return absl::OkStatus();
    case CodecKind::kFp8:
      if (bits != 8) return absl::InvalidArgumentError("fp8 codec has 8 bits");
      return absl::OkStatus();
    case CodecKind::kTurboQuant:
      if (bits < 1 || bits > 8) {
        return absl::InvalidArgumentError(absl::StrFormat("TurboQuant bits must be in [1, 8], got %d", bits));
      }
      return absl::OkStatus();
    case CodecKind::kUniform:
      if (bits < 1 || bits > 8) {
        return absl::InvalidArgumentError(absl::StrFormat("uniform bits must be in [1, 8], got %d", bits));
      }
      return absl::OkStatus();
    case CodecKind::kQjl:
      if (bits < 2 || bits > 8) {
        return absl::InvalidArgumentError(
            absl::StrFormat("QJL bits must be in [2, 8] (1 goes to the sign), got %d", bits));
      }
      return absl::OkStatus();
    case CodecKind::kOutlierSplit:
      if (bits < 1 || bits > 8 || hot_bits < 1 || hot_bits > 8) {
        return absl::InvalidArgumentError(
            absl::StrFormat("outlier split bits must be in [1, 8], got hot %d cold %d", hot_bits, bits));
      }
      if (hot_divisor < 2) {
        return absl::InvalidArgumentError(
            absl::StrFormat("outlier split hot_divisor must be >= 2, got %d", hot_divisor));
      }
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError("unknown codec kind");
}

int CodecSpec::HotChannels(int head_dim) const {
  if (kind != CodecKind::kOutlierSplit || hot_divisor <= 0) return 0;
  return std::max(1, head_dim / hot_divisor);
}

int CodecBytesPerVector(const CodecSpec& spec, int head_dim) {
  switch (spec.kind) {
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      return 2 * head_dim;
    case CodecKind::kFp8:
      return head_dim;
    case CodecKind::kTurboQuant:
      return PackedBytes(head_dim, spec.bits) + 2;
    case CodecKind::kUniform:
      return PackedBytes(head_dim, spec.bits) + 4;
    case CodecKind::kQjl:
      return PackedBytes(head_dim, spec.bits - 1) + PackedBytes(head_dim, 1) + 4;
    case CodecKind::kOutlierSplit: {
      const int hot = spec.HotChannels(head_dim);
      return PackedBytes(hot, spec.hot_bits) + PackedBytes(head_dim - hot, spec.bits) + 4;
    }
  }
  return 0;
}

absl::StatusOr<std::unique_ptr<VectorCodec>> MakeCodec(const CodecSpec& spec, const CodecOptions& options) {
  RETURN_IF_ERROR(spec.Validate());
  const int d = options.head_dim;
  if (d < kMinHeadDim || d > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("head_dim must be in [%d, %d], got %d", kMinHeadDim, kMaxHeadDim, d));
  }
  switch (spec.kind) {
    case CodecKind::kFp16:
      return codec_internal::MakeFloat16Codec(spec, d, /*brain=*/false);
    case CodecKind::kBf16:
      return codec_internal::MakeFloat16Codec(spec, d, /*brain=*/true);
    case CodecKind::kFp8:
      return codec_internal::MakeFp8Codec(spec, d);
    case CodecKind::kUniform:
      return codec_internal::MakeUniformCodec(spec, d);
    case CodecKind::kTurboQuant: {
      ASSIGN_OR_RETURN(TurboQuantQuantizer quantizer, MakeQuantizer(d, spec.bits, spec.norm_correction, options.seed));
      return std::make_unique<TurboQuantCodec>(spec, d, std::move(quantizer));
    }
    case CodecKind::kQjl: {
      ASSIGN_OR_RETURN(TurboQuantQuantizer quantizer,
                       MakeQuantizer(d, spec.bits - 1, /*norm_correction=*/false, options.seed));
      std::vector<float> sketch(static_cast<size_t>(d) * d);
      Random rng(DeriveSeed(options.seed, kSketchStream));
      for (float& s : sketch) s = static_cast<float>(rng.NextGaussian());
      return std::make_unique<QjlCodec>(spec, d, std::move(quantizer), std::move(sketch));
    }
    case CodecKind::kOutlierSplit: {
      const int hot_count = spec.HotChannels(d);
      if (hot_count < kMinCodebookDim || d - hot_count < kMinCodebookDim) {
        return absl::InvalidArgumentError(
            absl::StrFormat("head_dim %d is too small to split %d hot channels", d, hot_count));
      }
      RETURN_IF_ERROR(ValidateHotChannels(options.hot_channels, hot_count, d));
      std::vector<int> hot = options.hot_channels;
      std::sort(hot.begin(), hot.end());
      std::vector<int> cold;
      for (int c = 0, h = 0; c < d; ++c) {
        if (h < hot_count && hot[h] == c) {
          ++h;
        } else {
          cold.push_back(c);
        }
      }
      ASSIGN_OR_RETURN(TurboQuantQuantizer hot_part, MakeQuantizer(hot_count, spec.hot_bits, spec.norm_correction,
                                                                   DeriveSeed(options.seed, kHotPartStream)));
      ASSIGN_OR_RETURN(TurboQuantQuantizer cold_part, MakeQuantizer(d - hot_count, spec.bits, spec.norm_correction,
                                                                    DeriveSeed(options.seed, kColdPartStream)));
      return std::make_unique<OutlierSplitCodec>(spec, d, std::move(hot), std::move(cold), std::move(hot_part),
                                                 std::move(cold_part));
    }
  }
  return absl::InvalidArgumentError("unknown codec kind");
}

std::vector<int> ChooseHotChannels(const float* keys, int64_t n, int head_dim, int count) {
  std::vector<double> mean_abs(head_dim, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    const float* k = keys + t * head_dim;
    for (int c = 0; c < head_dim; ++c) mean_abs[c] += std::fabs(k[c]);
  }
  std::vector<int> order(head_dim);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return mean_abs[a] > mean_abs[b]; });
  order.resize(count);
  std::sort(order.begin(), order.end());
  return order;
}

}  // namespace tqkv
