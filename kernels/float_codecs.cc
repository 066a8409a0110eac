// The codecs whose codes are plain numbers: 16-bit floats (fp16, bf16),
// fp8 e4m3, and uniform per-vector min-max (codec.h's CodecKind kFp16,
// kBf16, kFp8, kUniform).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "absl/strings/str_format.h"
#include "kernels/bitpack.h"
#include "kernels/codec.h"
#include "kernels/codec_internal.h"
#include "kernels/simd/encode_kernels.h"
#include "kernels/float_formats.h"
#include "base/status_macros.h"

namespace tqkv {
namespace codec_internal {
namespace {

// ---------------------------------------------------------------------------
// fp16 and fp8: the codes are the numbers themselves.

// 16-bit floats: fp16 (IEEE half) or bf16, little-endian, coordinate order.
template <bool kBrain>
class Float16Codec final : public VectorCodec {
 public:
  explicit Float16Codec(const CodecSpec& spec, int head_dim) : VectorCodec(spec, head_dim) {
    code_bytes_ = 2 * head_dim;
    query_state_floats_ = head_dim;
    accumulator_floats_ = head_dim;
  }

  absl::Status Encode(const float* x, uint8_t* codes, uint16_t* scalars) const override {
    // fp16: values in [65504, 65520) still round to the largest half; beyond
    // is infinity, which the cache must never hold. bf16 has float's range.
    const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels();
    if (kBrain) {
      RETURN_IF_ERROR(CheckAllFinite(x, head_dim_, simd));
    } else {
      RETURN_IF_ERROR(CheckFiniteAndInRange(x, head_dim_, 65519.0f, "fp16", simd));
    }
    if (simd) {
      if (kBrain) {
        simd->float_to_bf16(x, head_dim_, codes);
      } else {
        simd->float_to_half(x, head_dim_, codes);
      }
      return absl::OkStatus();
    }
    for (int i = 0; i < head_dim_; ++i) {
      const uint16_t h = kBrain ? FloatToBf16(x[i]) : FloatToHalf(x[i]);
      codes[2 * i] = static_cast<uint8_t>(h);
      codes[2 * i + 1] = static_cast<uint8_t>(h >> 8);
    }
    return absl::OkStatus();
  }

  void Decode(const uint8_t* codes, const uint16_t*, float* x) const override {
    for (int i = 0; i < head_dim_; ++i) x[i] = ValueAt(codes, i);
  }

  void PrepareQuery(const float* q, float* state) const override { std::copy(q, q + head_dim_, state); }

  float Score(const float* state, const uint8_t* codes, const uint16_t*) const override {
    float dot = 0.0f;
    for (int i = 0; i < head_dim_; ++i) dot += state[i] * ValueAt(codes, i);
    return dot;
  }

  void Accumulate(float weight, const uint8_t* codes, const uint16_t*, float* acc) const override {
    for (int i = 0; i < head_dim_; ++i) acc[i] += weight * ValueAt(codes, i);
  }

  void FinishAccumulation(const float* acc, float* out) const override { std::copy(acc, acc + head_dim_, out); }

 private:
  static float ValueAt(const uint8_t* codes, int i) {
    const uint16_t bits = static_cast<uint16_t>(codes[2 * i] | (codes[2 * i + 1] << 8));
    return kBrain ? Bf16ToFloat(bits) : HalfToFloat(bits);
  }
};

class Fp8Codec final : public VectorCodec {
 public:
  explicit Fp8Codec(const CodecSpec& spec, int head_dim) : VectorCodec(spec, head_dim) {
    code_bytes_ = head_dim;
    query_state_floats_ = head_dim;
    accumulator_floats_ = head_dim;
  }

  absl::Status Encode(const float* x, uint8_t* codes, uint16_t*) const override {
    // Saturating: finite values beyond +-448 become +-448.
    const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels();
    RETURN_IF_ERROR(CheckAllFinite(x, head_dim_, simd));
    if (simd) {
      simd->float_to_fp8(x, head_dim_, codes);
      return absl::OkStatus();
    }
    for (int i = 0; i < head_dim_; ++i) codes[i] = FloatToFp8E4m3(x[i]);
    return absl::OkStatus();
  }

  void Decode(const uint8_t* codes, const uint16_t*, float* x) const override {
    const float* table = Fp8E4m3Table();
    for (int i = 0; i < head_dim_; ++i) x[i] = table[codes[i]];
  }

  void PrepareQuery(const float* q, float* state) const override { std::copy(q, q + head_dim_, state); }

  float Score(const float* state, const uint8_t* codes, const uint16_t*) const override {
    const float* table = Fp8E4m3Table();
    float dot = 0.0f;
    for (int i = 0; i < head_dim_; ++i) dot += state[i] * table[codes[i]];
    return dot;
  }

  void Accumulate(float weight, const uint8_t* codes, const uint16_t*, float* acc) const override {
    const float* table = Fp8E4m3Table();
    for (int i = 0; i < head_dim_; ++i) acc[i] += weight * table[codes[i]];
  }

  void FinishAccumulation(const float* acc, float* out) const override { std::copy(acc, acc + head_dim_, out); }
};

// ---------------------------------------------------------------------------
// Uniform per-vector min-max: x ~ zero + scale * code, code in [0, 2^bits).

class UniformCodec final : public VectorCodec {
 public:
  UniformCodec(const CodecSpec& spec, int head_dim) : VectorCodec(spec, head_dim) {
    code_bytes_ = PackedBytes(head_dim, spec.bits);
    num_scalars_ = 2;                    // [scale, zero]
    query_state_floats_ = head_dim + 1;  // q, then sum(q) for the zero point
    accumulator_floats_ = head_dim;
  }

  absl::Status Encode(const float* x, uint8_t* codes, uint16_t* scalars) const override {
    const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels();
    float lo, hi;
    RETURN_IF_ERROR(Range(simd, x, &lo, &hi));
    Pack(simd, x, Parameters(lo, hi), codes, scalars);
    return absl::OkStatus();
  }

  // Each step over a batch of vectors before the next, so that the core
  // overlaps one vector's chain of dependent steps (min/max, reductions,
  // fp16 rounding, division) with the next's; the same bytes as Encode.
  absl::Status EncodeMany(int n, const float* const* x, uint8_t* const* codes, uint16_t* const* scalars,
                          int* failed) const override {
    constexpr int kBatch = 8;
    const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels();
    for (int k0 = 0; k0 < n; k0 += kBatch) {
      const int m = std::min(kBatch, n - k0);
      float lo[kBatch], hi[kBatch];
      for (int v = 0; v < m; ++v) {
        absl::Status status = Range(simd, x[k0 + v], &lo[v], &hi[v]);
        if (!status.ok()) {
          *failed = k0 + v;
          return status;
        }
      }
      Params params[kBatch];
      for (int v = 0; v < m; ++v) params[v] = Parameters(lo[v], hi[v]);
      for (int v = 0; v < m; ++v) Pack(simd, x[k0 + v], params[v], codes[k0 + v], scalars[k0 + v]);
    }
    return absl::OkStatus();
  }

  void Decode(const uint8_t* codes, const uint16_t* scalars, float* x) const override {
    const float scale = HalfToFloat(scalars[0]);
    const float zero = HalfToFloat(scalars[1]);
    uint8_t unpacked[kMaxHeadDim];
    UnpackBits(codes, head_dim_, spec_.bits, unpacked);
    for (int i = 0; i < head_dim_; ++i) x[i] = zero + scale * static_cast<float>(unpacked[i]);
  }

  void PrepareQuery(const float* q, float* state) const override {
    float sum = 0.0f;
    for (int i = 0; i < head_dim_; ++i) {
      state[i] = q[i];
      sum += q[i];
    }
    state[head_dim_] = sum;
  }

  float Score(const float* state, const uint8_t* codes, const uint16_t* scalars) const override {
    uint8_t unpacked[kMaxHeadDim];
    UnpackBits(codes, head_dim_, spec_.bits, unpacked);
    float dot = 0.0f;
    for (int i = 0; i < head_dim_; ++i) dot += state[i] * static_cast<float>(unpacked[i]);
    return HalfToFloat(scalars[0]) * dot + HalfToFloat(scalars[1]) * state[head_dim_];
  }

  void Accumulate(float weight, const uint8_t* codes, const uint16_t* scalars, float* acc) const override {
    const float scale = weight * HalfToFloat(scalars[0]);
    const float zero = weight * HalfToFloat(scalars[1]);
    uint8_t unpacked[kMaxHeadDim];
    UnpackBits(codes, head_dim_, spec_.bits, unpacked);
    for (int i = 0; i < head_dim_; ++i) acc[i] += zero + scale * static_cast<float>(unpacked[i]);
  }

  void FinishAccumulation(const float* acc, float* out) const override { std::copy(acc, acc + head_dim_, out); }

 private:
  // Quantize against the fp16-rounded scale and zero that decode will use.
  struct Params {
    uint16_t zero_h, scale_h;
    float zero, inv_scale;
  };

  // min and max of x, after checking it is finite and within fp16 range.
  // `simd`: the store kernels, or nullptr for the portable code (also Pack).
  absl::Status Range(const encode_internal::EncodeKernels* simd, const float* x, float* lo, float* hi) const {
    if (simd && simd->uniform_range(x, head_dim_, lo, hi)) return absl::OkStatus();
    RETURN_IF_ERROR(CheckFiniteAndInRange(x, head_dim_, kHalfMax, "fp16 scale/zero", simd));
    if (simd) {
      simd->min_max(x, head_dim_, lo, hi);
      return absl::OkStatus();
    }
    *lo = *hi = x[0];
    for (int i = 1; i < head_dim_; ++i) {
      *lo = std::min(*lo, x[i]);
      *hi = std::max(*hi, x[i]);
    }
    return absl::OkStatus();
  }

  Params Parameters(float lo, float hi) const {
    const int max_code = (1 << spec_.bits) - 1;
    Params p;
    p.zero_h = FloatToHalf(lo);
    p.scale_h = FloatToHalf((hi - lo) / static_cast<float>(max_code));
    p.zero = HalfToFloat(p.zero_h);
    const float scale = HalfToFloat(p.scale_h);
    p.inv_scale = scale > 0.0f ? 1.0f / scale : 0.0f;
    return p;
  }

  void Pack(const encode_internal::EncodeKernels* simd, const float* x, const Params& p, uint8_t* codes,
            uint16_t* scalars) const {
    if (simd) {
      simd->uniform_pack(x, head_dim_, p.zero, p.inv_scale, spec_.bits, codes);
    } else {
      const int max_code = (1 << spec_.bits) - 1;
      uint8_t unpacked[kMaxHeadDim];
      for (int i = 0; i < head_dim_; ++i) {
        const float level = std::floor((x[i] - p.zero) * p.inv_scale + 0.5f);
        unpacked[i] = static_cast<uint8_t>(std::clamp(level, 0.0f, static_cast<float>(max_code)));
      }
      PackBits(unpacked, head_dim_, spec_.bits, codes);
    }
    scalars[0] = p.scale_h;
    scalars[1] = p.zero_h;
  }
};

}  // namespace

std::unique_ptr<VectorCodec> MakeFloat16Codec(const CodecSpec& spec, int head_dim, bool brain) {
  if (brain) return std::make_unique<Float16Codec<true>>(spec, head_dim);
  return std::make_unique<Float16Codec<false>>(spec, head_dim);
}

std::unique_ptr<VectorCodec> MakeFp8Codec(const CodecSpec& spec, int head_dim) {
  return std::make_unique<Fp8Codec>(spec, head_dim);
}

std::unique_ptr<VectorCodec> MakeUniformCodec(const CodecSpec& spec, int head_dim) {
  return std::make_unique<UniformCodec>(spec, head_dim);
}

}  // namespace codec_internal
}  // namespace tqkv
