// Wire tensors (tqkv.v1.Tensor: dtype, shape, raw little-endian bytes) to and
// from float32, with the validation every request needs before it reaches the
// cache. Messages say what was expected, naming the axes:
//   "keys has 3 dims, want [layers, tokens, kv_heads, head_dim]"
//   "keys axis kv_heads is 3, want 2 (shape [1, 4, 3, 64])"
//   "keys has 1000 bytes, want 4096 (shape [1, 4, 2, 64] x 2 bytes of f16)"
//   "keys[0, 1, 1, 17] is nan; want finite values"
// Thread safety: stateless functions.
#ifndef TQKV_SERVICE_TENSOR_CODEC_H_
#define TQKV_SERVICE_TENSOR_CODEC_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "tqkv/v1/kvcache.pb.h"

namespace tqkv {
namespace service {

// One expected axis: its name and size; kAnySize accepts any size >= 1.
struct Axis {
  static constexpr int64_t kAnySize = -1;
  const char* name;
  int64_t size;
};

// Bytes per element of a wire dtype; 0 for DTYPE_UNSPECIFIED or unknown.
int DTypeBytes(v1::DType dtype);
// "f32", "f16", "bf16", or "unspecified(N)".
std::string_view DTypeName(v1::DType dtype);

// Checks `tensor` (named `name` in messages) against `axes` and converts it
// to float32 row-major in `out` (resized); `shape` (optional) receives the
// actual shape. Every axis must be >= 1.
// INVALID_ARGUMENT: unknown dtype, wrong rank, an axis of the wrong size,
// byte length != product(shape) * sizeof(dtype), or a NaN/Inf element (the
// message gives its index). On error `out` is unspecified.
absl::Status DecodeTensor(const v1::Tensor& tensor, std::string_view name, absl::Span<const Axis> axes,
                          std::vector<float>* out, std::vector<int64_t>* shape = nullptr);

// A decoded tensor: `values` views the request's own bytes when they are
// f32 and float-aligned (no copy: the request must outlive it), else
// `storage`, which holds the conversion.
struct FloatTensor {
  std::vector<float> storage;
  absl::Span<const float> values;
};

// DecodeTensor without the copy for f32: the same checks and errors.
absl::Status DecodeTensorView(const v1::Tensor& tensor, std::string_view name, absl::Span<const Axis> axes,
                              FloatTensor* out, std::vector<int64_t>* shape = nullptr);

// Encodes float32 `data` of `shape` as `dtype` (f32 when unspecified),
// rounding to nearest even for f16 / bf16. INVALID_ARGUMENT for an unknown
// dtype. REQUIRES: data.size() == product(shape).
absl::Status EncodeTensor(absl::Span<const float> data, absl::Span<const int64_t> shape, v1::DType dtype,
                          v1::Tensor* out);

// Makes `out` an f32 tensor of `shape` and returns its bytes as floats for
// the caller to fill (zeroed), so that a kernel writes the response itself;
// null when the bytes are not float-aligned (the caller then encodes).
float* PrepareF32Tensor(absl::Span<const int64_t> shape, v1::Tensor* out);

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_TENSOR_CODEC_H_
