#include "kernels/codec.h"

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codebook.h"
#include "base/random.h"
#include "kernels/rotation.h"

namespace tqkv {
namespace {

const int kHeadDims[] = {64, 80, 96, 112, 128, 160, 192, 256};

std::vector<CodecSpec> AllSpecs() {
  return {CodecSpec::Fp16(),
          CodecSpec::Bf16(),
          CodecSpec::Fp8(),
          CodecSpec::Uniform(2),
          CodecSpec::Uniform(3),
          CodecSpec::Uniform(4),
          CodecSpec::Uniform(8),
          CodecSpec::TurboQuant(2, false),
          CodecSpec::TurboQuant(3, true),
          CodecSpec::TurboQuant(4, true),
          CodecSpec::TurboQuant(4, false),
          CodecSpec::Qjl(3),
          CodecSpec::OutlierSplit(3, 2, 2, true),
          CodecSpec::OutlierSplit(4, 3, 4, false)};
}

std::vector<float> Gaussian(int64_t n, int dim, uint64_t seed, double scale = 1.0) {
  Random rng(seed);
  std::vector<float> out(n * dim);
  for (float& v : out) v = static_cast<float>(scale * rng.NextGaussian());
  return out;
}

// Keys with a few hot channels and a per-channel offset, the pattern of real
// K caches (turboquant.md section 3).
std::vector<float> OutlierKeys(int64_t n, int dim, uint64_t seed) {
  Random rng(seed);
  std::vector<float> offset(dim);
  for (float& o : offset) o = static_cast<float>(rng.NextGaussian());
  const int hot[4] = {3, dim / 3, dim / 2 + 1, dim - 5};
  std::vector<float> out(n * dim);
  for (int64_t t = 0; t < n; ++t) {
    for (int c = 0; c < dim; ++c) out[t * dim + c] = static_cast<float>(rng.NextGaussian()) + offset[c];
    for (int h : hot) out[t * dim + h] *= 10.0f;
  }
  return out;
}

std::unique_ptr<VectorCodec> Make(const CodecSpec& spec, int dim, uint64_t seed = 42,
                                  const float* calibration = nullptr, int64_t n = 0) {
  CodecOptions options;
  options.head_dim = dim;
  options.seed = seed;
  if (spec.NeedsCalibration()) {
    std::vector<float> keys;
    if (calibration == nullptr) {
      keys = OutlierKeys(256, dim, 5);
      calibration = keys.data();
      n = 256;
    }
    options.hot_channels = ChooseHotChannels(calibration, n, dim, spec.HotChannels(dim));
  }
  auto codec = MakeCodec(spec, options);
  EXPECT_TRUE(codec.ok()) << spec.Name() << " dim " << dim << ": " << codec.status();
  return codec.ok() ? std::move(*codec) : nullptr;
}

struct Encoded {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scalars;
};

std::vector<Encoded> EncodeAll(const VectorCodec& codec, const std::vector<float>& x) {
  const int d = codec.head_dim();
  std::vector<Encoded> out(x.size() / d);
  for (size_t t = 0; t < out.size(); ++t) {
    out[t].codes.resize(codec.code_bytes());
    out[t].scalars.resize(codec.num_scalars());
    absl::Status status = codec.Encode(&x[t * d], out[t].codes.data(), out[t].scalars.data());
    EXPECT_TRUE(status.ok()) << status;
  }
  return out;
}

double RelativeError(const VectorCodec& codec, const std::vector<float>& x) {
  const int d = codec.head_dim();
  std::vector<Encoded> encoded = EncodeAll(codec, x);
  std::vector<float> decoded(d);
  double error = 0.0, energy = 0.0;
  for (size_t t = 0; t < encoded.size(); ++t) {
    codec.Decode(encoded[t].codes.data(), encoded[t].scalars.data(), decoded.data());
    for (int i = 0; i < d; ++i) {
      const double diff = static_cast<double>(decoded[i]) - x[t * d + i];
      error += diff * diff;
      energy += static_cast<double>(x[t * d + i]) * x[t * d + i];
    }
  }
  return error / energy;
}

TEST(TurboQuantCodec, GaussianRoundTripMatchesTheCodebookModelForEveryHeadDim) {
  for (int bits : {2, 3, 4}) {
    for (int dim : kHeadDims) {
      auto codec = Make(CodecSpec::TurboQuant(bits, false), dim);
      ASSERT_NE(codec, nullptr);
      const double model = (*GetCodebook(dim, bits))->distortion;
      const double measured = RelativeError(*codec, Gaussian(3000, dim, 100 + dim));
      EXPECT_NEAR(measured / model, 1.0, 0.02)
          << "bits " << bits << " dim " << dim << ": measured " << measured << " model " << model;
    }
  }
}

TEST(TurboQuantCodec, OutlierKeysLandAtOrBelowTheModelForEveryHeadDim) {
  // The rotation spreads hot channels; dense rotations (80, 96, ...) must do
  // as well as the Hadamard ones. The per-channel offset makes the vectors
  // less isotropic, so the model is an upper bound here, up to noise.
  for (int dim : kHeadDims) {
    auto codec = Make(CodecSpec::TurboQuant(3, false), dim);
    const double model = (*GetCodebook(dim, 3))->distortion;
    const double measured = RelativeError(*codec, OutlierKeys(2000, dim, 200 + dim));
    EXPECT_LT(measured / model, 1.02) << "dim " << dim << " ratio " << measured / model;
    EXPECT_GT(measured / model, 0.85) << "dim " << dim;
  }
}

TEST(TurboQuantCodec, SignDiagonalRescuesWalshFunctionInputs) {
  // x = a row of the Walsh-Hadamard matrix. Plain H maps it onto a single
  // coordinate, which the codebook clips; H D spreads it.
  const int dim = 128, bits = 3;
  const Codebook* codebook = *GetCodebook(dim, bits);
  auto rel_error = [&](Rotation::Kind kind, int row) {
    auto rotation = *Rotation::Create(dim, 9, kind);
    std::vector<float> x(dim), y(dim), q(dim), back(dim);
    for (int i = 0; i < dim; ++i) x[i] = (__builtin_popcount(row & i) & 1) ? -1.0f : 1.0f;
    double norm_sq = 0;
    for (float v : x) norm_sq += v * v;
    const float inv = static_cast<float>(1.0 / std::sqrt(norm_sq));
    for (float& v : x) v *= inv;
    rotation->Forward(x.data(), y.data());
    for (int i = 0; i < dim; ++i) {
      q[i] = codebook->centroids[QuantizeToLevel(codebook->boundaries.data(), codebook->boundaries.size(), y[i])];
    }
    rotation->Inverse(q.data(), back.data());
    double error = 0;
    for (int i = 0; i < dim; ++i) error += (back[i] - x[i]) * (back[i] - x[i]);
    return error;
  };
  double plain = 0, randomized = 0;
  for (int row = 1; row <= 16; ++row) {
    plain += rel_error(Rotation::Kind::kPlainHadamard, row) / 16;
    randomized += rel_error(Rotation::Kind::kRandomizedHadamard, row) / 16;
  }
  EXPECT_GT(plain, 0.5);         // turboquant.md: 0.68 without D
  EXPECT_LT(randomized, 0.045);  // 0.031 with D
  // The codec itself keeps D.
  std::vector<float> walsh(dim);
  for (int i = 0; i < dim; ++i) walsh[i] = (__builtin_popcount(5 & i) & 1) ? -1.0f : 1.0f;
  EXPECT_LT(RelativeError(*Make(CodecSpec::TurboQuant(3, false), dim), walsh), 0.06);
}

TEST(TurboQuantCodec, NormCorrectionStoresNormOverCodewordLength) {
  const int dim = 128;
  auto plain = Make(CodecSpec::TurboQuant(2, false), dim);
  auto corrected = Make(CodecSpec::TurboQuant(2, true), dim);
  std::vector<float> x = Gaussian(1, dim, 77, 3.0);
  std::vector<uint8_t> codes_a(plain->code_bytes()), codes_b(corrected->code_bytes());
  uint16_t scale_a, scale_b;
  ASSERT_TRUE(plain->Encode(x.data(), codes_a.data(), &scale_a).ok());
  ASSERT_TRUE(corrected->Encode(x.data(), codes_b.data(), &scale_b).ok());
  EXPECT_EQ(codes_a, codes_b);
  std::vector<float> decoded(dim);
  corrected->Decode(codes_b.data(), &scale_b, decoded.data());
  double norm_x = 0, norm_decoded = 0;
  for (int i = 0; i < dim; ++i) {
    norm_x += x[i] * x[i];
    norm_decoded += decoded[i] * decoded[i];
  }
  // Decoded length equals the original length (up to fp16), not shrunk.
  EXPECT_NEAR(std::sqrt(norm_decoded / norm_x), 1.0, 1e-3);
}

TEST(TurboQuantCodec, MseInnerProductsShrinkAndQjlOnesDoNot) {
  // turboquant.md: slope of <q, x_hat> on <q, x> is ~0.88 at 2 bits for MSE,
  // ~1.00 for the QJL variant.
  const int dim = 128;
  auto slope = [&](const VectorCodec& codec) {
    std::vector<float> keys = Gaussian(2000, dim, 31);
    std::vector<float> queries = Gaussian(20, dim, 32);
    std::vector<Encoded> encoded = EncodeAll(codec, keys);
    std::vector<float> state(codec.query_state_floats());
    double sxy = 0, sxx = 0;
    for (int qi = 0; qi < 20; ++qi) {
      codec.PrepareQuery(&queries[qi * dim], state.data());
      for (size_t t = 0; t < encoded.size(); ++t) {
        double exact = 0;
        for (int i = 0; i < dim; ++i) exact += queries[qi * dim + i] * keys[t * dim + i];
        const double approx = codec.Score(state.data(), encoded[t].codes.data(), encoded[t].scalars.data());
        sxy += exact * approx;
        sxx += exact * exact;
      }
    }
    return sxy / sxx;
  };
  EXPECT_NEAR(slope(*Make(CodecSpec::TurboQuant(2, false), dim)), 0.88, 0.02);
  EXPECT_NEAR(slope(*Make(CodecSpec::TurboQuant(3, false), dim)), 0.97, 0.015);
  EXPECT_NEAR(slope(*Make(CodecSpec::Qjl(3), dim)), 1.0, 0.03);
}

TEST(Codec, ScoreInTheCodeDomainEqualsDequantizeThenDot) {
  for (const CodecSpec& spec : AllSpecs()) {
    for (int dim : kHeadDims) {
      auto codec = Make(spec, dim);
      ASSERT_NE(codec, nullptr);
      std::vector<float> keys = OutlierKeys(40, dim, 1);
      std::vector<float> queries = Gaussian(4, dim, 2);
      std::vector<Encoded> encoded = EncodeAll(*codec, keys);
      std::vector<float> state(codec->query_state_floats()), decoded(dim);
      for (int qi = 0; qi < 4; ++qi) {
        const float* q = &queries[qi * dim];
        codec->PrepareQuery(q, state.data());
        for (const Encoded& e : encoded) {
          codec->Decode(e.codes.data(), e.scalars.data(), decoded.data());
          double dot = 0, q_norm = 0, k_norm = 0;
          for (int i = 0; i < dim; ++i) {
            dot += static_cast<double>(q[i]) * decoded[i];
            q_norm += static_cast<double>(q[i]) * q[i];
            k_norm += static_cast<double>(decoded[i]) * decoded[i];
          }
          const double score = codec->Score(state.data(), e.codes.data(), e.scalars.data());
          // Relative to |q||k|: the scale of fp32 rounding in a dot product.
          ASSERT_NEAR(score, dot, 1e-5 * std::sqrt(q_norm * k_norm) + 1e-30) << spec.Name() << " dim " << dim;
        }
      }
    }
  }
}

TEST(Codec, AccumulateInTheCodecBasisEqualsWeightedSumOfDecodedVectors) {
  for (const CodecSpec& spec : AllSpecs()) {
    for (int dim : {64, 96, 128}) {
      auto codec = Make(spec, dim);
      std::vector<float> values = Gaussian(50, dim, 3);
      std::vector<Encoded> encoded = EncodeAll(*codec, values);
      Random rng(4);
      std::vector<float> acc(codec->accumulator_floats(), 0.0f), out(dim), decoded(dim);
      std::vector<double> reference(dim, 0.0);
      double scale = 0;
      for (const Encoded& e : encoded) {
        const float w = static_cast<float>(rng.NextDouble());
        codec->Accumulate(w, e.codes.data(), e.scalars.data(), acc.data());
        codec->Decode(e.codes.data(), e.scalars.data(), decoded.data());
        for (int i = 0; i < dim; ++i) {
          reference[i] += w * static_cast<double>(decoded[i]);
          scale += std::fabs(w * decoded[i]);
        }
      }
      codec->FinishAccumulation(acc.data(), out.data());
      double ref_norm = 0, diff = 0;
      for (int i = 0; i < dim; ++i) {
        ref_norm += reference[i] * reference[i];
        diff += (out[i] - reference[i]) * (out[i] - reference[i]);
      }
      EXPECT_LT(std::sqrt(diff), 1e-5 * std::sqrt(ref_norm) + 1e-6 * scale / dim) << spec.Name() << " dim " << dim;
    }
  }
}

TEST(Codec, ZeroVectorsEncodeAndDecodeToZero) {
  for (const CodecSpec& spec : AllSpecs()) {
    for (int dim : {64, 80, 128}) {
      auto codec = Make(spec, dim);
      std::vector<float> zero(dim, 0.0f), decoded(dim, 1.0f), query = Gaussian(1, dim, 5);
      std::vector<uint8_t> codes(codec->code_bytes());
      std::vector<uint16_t> scalars(codec->num_scalars());
      ASSERT_TRUE(codec->Encode(zero.data(), codes.data(), scalars.data()).ok()) << spec.Name();
      codec->Decode(codes.data(), scalars.data(), decoded.data());
      for (int i = 0; i < dim; ++i) ASSERT_EQ(decoded[i], 0.0f) << spec.Name() << " coord " << i;
      std::vector<float> state(codec->query_state_floats());
      codec->PrepareQuery(query.data(), state.data());
      EXPECT_EQ(codec->Score(state.data(), codes.data(), scalars.data()), 0.0f) << spec.Name();
    }
  }
}

TEST(Codec, NonFiniteInputIsRejectedByEveryCodec) {
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  for (const CodecSpec& spec : AllSpecs()) {
    auto codec = Make(spec, 128);
    std::vector<uint8_t> codes(codec->code_bytes());
    std::vector<uint16_t> scalars(codec->num_scalars());
    for (float bad : bad_values) {
      for (int position : {0, 77, 127}) {
        std::vector<float> x = Gaussian(1, 128, 6);
        x[position] = bad;
        absl::Status status = codec->Encode(x.data(), codes.data(), scalars.data());
        EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << spec.Name();
        EXPECT_NE(status.message().find(std::to_string(position)), std::string::npos)
            << spec.Name() << ": " << status.message();
      }
    }
  }
}

TEST(Codec, ValuesBeyondTheFp16SideValuesAreRejectedAndFp8Saturates) {
  std::vector<float> x(128, 1.0f);
  x[5] = 1e6f;
  std::vector<uint8_t> codes(512);
  uint16_t scalars[4];
  EXPECT_EQ(Make(CodecSpec::Fp16(), 128)->Encode(x.data(), codes.data(), scalars).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Make(CodecSpec::TurboQuant(3, true), 128)->Encode(x.data(), codes.data(), scalars).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Make(CodecSpec::Uniform(4), 128)->Encode(x.data(), codes.data(), scalars).code(),
            absl::StatusCode::kInvalidArgument);
  auto fp8 = Make(CodecSpec::Fp8(), 128);
  ASSERT_TRUE(fp8->Encode(x.data(), codes.data(), scalars).ok());
  std::vector<float> decoded(128);
  fp8->Decode(codes.data(), scalars, decoded.data());
  EXPECT_EQ(decoded[5], 448.0f);
}

TEST(Codec, BytesPerVectorMatchesTheSpecFormula) {
  for (const CodecSpec& spec : AllSpecs()) {
    for (int dim : kHeadDims) {
      auto codec = Make(spec, dim);
      EXPECT_EQ(codec->bytes_per_vector(), CodecBytesPerVector(spec, dim)) << spec.Name();
    }
  }
  EXPECT_EQ(CodecBytesPerVector(CodecSpec::TurboQuant(3, true), 128), 50);
  EXPECT_EQ(CodecBytesPerVector(CodecSpec::Uniform(4), 128), 68);
  EXPECT_EQ(CodecBytesPerVector(CodecSpec::OutlierSplit(3, 2, 2, true), 128), 44);
}

TEST(Codec, EncodingIsDeterministicForASeedAndDependsOnIt) {
  std::vector<float> x = Gaussian(1, 128, 8);
  auto a = Make(CodecSpec::TurboQuant(3, true), 128, 1);
  auto b = Make(CodecSpec::TurboQuant(3, true), 128, 1);
  auto c = Make(CodecSpec::TurboQuant(3, true), 128, 2);
  std::vector<uint8_t> ca(48), cb(48), cc(48);
  uint16_t sa, sb, sc;
  ASSERT_TRUE(a->Encode(x.data(), ca.data(), &sa).ok());
  ASSERT_TRUE(b->Encode(x.data(), cb.data(), &sb).ok());
  ASSERT_TRUE(c->Encode(x.data(), cc.data(), &sc).ok());
  EXPECT_EQ(ca, cb);
  EXPECT_NE(ca, cc);
}

TEST(OutlierSplitCodec, BeatsPlainTurboQuantAtTheLowerBitWidthOnOutlierKeys) {
  const int dim = 128;
  std::vector<float> keys = OutlierKeys(2000, dim, 9);
  const double split = RelativeError(*Make(CodecSpec::OutlierSplit(3, 2, 2, false), dim, 1, keys.data(), 2000), keys);
  const double two_bit = RelativeError(*Make(CodecSpec::TurboQuant(2, false), dim), keys);
  const double three_bit = RelativeError(*Make(CodecSpec::TurboQuant(3, false), dim), keys);
  EXPECT_LT(split, two_bit);
  EXPECT_GT(split, three_bit);
}

TEST(OutlierSplitCodec, RejectsAMalformedHotChannelList) {
  CodecOptions options;
  options.head_dim = 128;
  const CodecSpec spec = CodecSpec::OutlierSplit(3, 2, 2, true);
  EXPECT_EQ(MakeCodec(spec, options).status().code(), absl::StatusCode::kInvalidArgument);
  options.hot_channels.assign(64, 0);
  for (int i = 0; i < 64; ++i) options.hot_channels[i] = i;
  EXPECT_TRUE(MakeCodec(spec, options).ok());
  options.hot_channels[3] = 2;  // duplicate
  EXPECT_EQ(MakeCodec(spec, options).status().code(), absl::StatusCode::kInvalidArgument);
  options.hot_channels[3] = 128;  // out of range
  EXPECT_EQ(MakeCodec(spec, options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Codec, InvalidSpecsAndHeadDimsAreRejected) {
  CodecOptions options;
  options.head_dim = 1024;
  EXPECT_EQ(MakeCodec(CodecSpec::TurboQuant(3, true), options).status().code(), absl::StatusCode::kInvalidArgument);
  options.head_dim = 128;
  EXPECT_EQ(MakeCodec(CodecSpec::TurboQuant(9, true), options).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeCodec(CodecSpec::Qjl(1), options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChooseHotChannels, PicksTheLargestMeanMagnitudeChannels) {
  std::vector<float> keys = OutlierKeys(500, 128, 10);
  std::vector<int> hot = ChooseHotChannels(keys.data(), 500, 128, 4);
  EXPECT_EQ(hot, (std::vector<int>{3, 128 / 3, 128 / 2 + 1, 128 - 5}));
}

}  // namespace
}  // namespace tqkv
