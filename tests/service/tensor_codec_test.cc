#include "service/tensor_codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/float_formats.h"

namespace tqkv {
namespace service {
namespace {

using ::testing::HasSubstr;

v1::Tensor F32(const std::vector<int64_t>& shape, const std::vector<float>& data) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F32);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float));
  return t;
}

const Axis kAxes[] = {{"tokens", Axis::kAnySize}, {"head_dim", 2}};

TEST(TensorCodec, DecodesF32F16AndBf16ToTheSameFloats) {
  const std::vector<float> values = {1.0f, -2.5f, 0.125f, 3.0f};
  std::vector<float> out;
  std::vector<int64_t> shape;
  ASSERT_TRUE(DecodeTensor(F32({2, 2}, values), "x", kAxes, &out, &shape).ok());
  EXPECT_EQ(out, values);
  EXPECT_EQ(shape, (std::vector<int64_t>{2, 2}));
  for (v1::DType dtype : {v1::DTYPE_F16, v1::DTYPE_BF16}) {
    v1::Tensor t;
    ASSERT_TRUE(EncodeTensor(values, {2, 2}, dtype, &t).ok());
    EXPECT_EQ(t.data().size(), 8u);
    ASSERT_TRUE(DecodeTensor(t, "x", kAxes, &out).ok());
    EXPECT_EQ(out, values);  // all exactly representable
  }
}

TEST(TensorCodec, RejectsWrongRankNamingTheAxes) {
  std::vector<float> out;
  const absl::Status s = DecodeTensor(F32({4}, {1, 2, 3, 4}), "keys", kAxes, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("keys has 1 dims, want [tokens, head_dim]"));
}

TEST(TensorCodec, RejectsWrongAxisSize) {
  std::vector<float> out;
  const absl::Status s = DecodeTensor(F32({1, 4}, {1, 2, 3, 4}), "keys", kAxes, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("axis head_dim is 4, want 2"));
}

TEST(TensorCodec, RejectsZeroOrNegativeAxes) {
  std::vector<float> out;
  EXPECT_EQ(DecodeTensor(F32({0, 2}, {}), "k", kAxes, &out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeTensor(F32({-1, 2}, {}), "k", kAxes, &out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorCodec, RejectsUnknownDtype) {
  v1::Tensor t = F32({1, 2}, {1, 2});
  t.set_dtype(v1::DTYPE_UNSPECIFIED);
  std::vector<float> out;
  const absl::Status s = DecodeTensor(t, "keys", kAxes, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("want DTYPE_F32, DTYPE_F16 or DTYPE_BF16"));
}

TEST(TensorCodec, RejectsByteLengthMismatch) {
  v1::Tensor t = F32({2, 2}, {1, 2, 3, 4});
  t.mutable_data()->resize(12);
  std::vector<float> out;
  const absl::Status s = DecodeTensor(t, "keys", kAxes, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("keys has 12 bytes, want 16"));
}

TEST(TensorCodec, RejectsNanAndInfWithTheirIndex) {
  std::vector<float> out;
  absl::Status s = DecodeTensor(F32({2, 2}, {1, 2, 3, std::nanf("")}), "v", kAxes, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("v[1, 1] is nan"));
  s = DecodeTensor(F32({2, 2}, {1, std::numeric_limits<float>::infinity(), 3, 4}), "v", kAxes, &out);
  EXPECT_THAT(s.message(), HasSubstr("v[0, 1] is inf"));
  // An f16 infinity (0x7c00) is caught after conversion too.
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F16);
  t.add_shape(1);
  t.add_shape(2);
  const uint16_t half[2] = {0x3c00, 0x7c00};
  t.set_data(reinterpret_cast<const char*>(half), 4);
  EXPECT_EQ(DecodeTensor(t, "v", kAxes, &out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorCodec, RejectsShapesWhoseProductOverflows) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F32);
  t.add_shape(int64_t{1} << 40);
  t.add_shape(2);
  std::vector<float> out;
  EXPECT_EQ(DecodeTensor(t, "k", kAxes, &out).code(), absl::StatusCode::kInvalidArgument);
}

// f32 requests are read in place: the view aliases the request's bytes.
TEST(TensorCodec, ViewReadsF32InPlaceAndConvertsHalves) {
  const std::vector<float> values = {1.0f, -2.5f, 0.125f, 3.0f};
  const v1::Tensor f32 = F32({2, 2}, values);
  FloatTensor view;
  std::vector<int64_t> shape;
  ASSERT_TRUE(DecodeTensorView(f32, "x", kAxes, &view, &shape).ok());
  EXPECT_EQ(static_cast<const void*>(view.values.data()), f32.data().data());
  EXPECT_TRUE(view.storage.empty());
  EXPECT_EQ(std::vector<float>(view.values.begin(), view.values.end()), values);
  EXPECT_EQ(shape, (std::vector<int64_t>{2, 2}));
  for (v1::DType dtype : {v1::DTYPE_F16, v1::DTYPE_BF16}) {
    v1::Tensor t;
    ASSERT_TRUE(EncodeTensor(values, {2, 2}, dtype, &t).ok());
    ASSERT_TRUE(DecodeTensorView(t, "x", kAxes, &view).ok());
    EXPECT_EQ(view.values.data(), view.storage.data());
    EXPECT_EQ(view.storage, values);
  }
}

TEST(TensorCodec, ViewChecksLikeDecode) {
  FloatTensor view;
  absl::Status s = DecodeTensorView(F32({2, 2}, {1, 2, 3, std::nanf("")}), "v", kAxes, &view);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("v[1, 1] is nan"));
  s = DecodeTensorView(F32({2, 3}, {1, 2, 3, 4, 5, 6}), "v", kAxes, &view);
  EXPECT_THAT(s.message(), HasSubstr("axis head_dim is 3, want 2"));
  v1::Tensor short_bytes = F32({2, 2}, {1, 2, 3});
  EXPECT_THAT(DecodeTensorView(short_bytes, "v", kAxes, &view).message(), HasSubstr("has 12 bytes, want 16"));
}

TEST(TensorCodec, PreparedF32TensorIsWrittenInPlace) {
  v1::Tensor t;
  float* data = PrepareF32Tensor({2, 2}, &t);
  ASSERT_NE(data, nullptr);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(data[i], 0.0f);
  for (int i = 0; i < 4; ++i) data[i] = 0.5f * i;
  std::vector<float> out;
  ASSERT_TRUE(DecodeTensor(t, "x", kAxes, &out).ok());
  EXPECT_EQ(out, (std::vector<float>{0.0f, 0.5f, 1.0f, 1.5f}));
  EXPECT_EQ(t.dtype(), v1::DTYPE_F32);
}

}  // namespace
}  // namespace service
}  // namespace tqkv
