#include "service/tensor_codec.h"

#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/float_formats.h"

namespace tqkv {
namespace service {
namespace {

// Wire tensors are little-endian; so is every host tqkv builds for.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "tqkv assumes a little-endian host");

// No tensor the service accepts comes near this; it keeps products exact.
constexpr int64_t kMaxElements = int64_t{1} << 40;

std::string AxisNames(absl::Span<const Axis> axes) {
  return absl::StrCat("[", absl::StrJoin(axes, ", ", [](std::string* s, const Axis& a) { absl::StrAppend(s, a.name); }),
                      "]");
}

std::string ShapeString(absl::Span<const int64_t> shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

std::string IndexString(int64_t flat, absl::Span<const int64_t> shape) {
  std::vector<int64_t> index(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    index[i] = flat % shape[i];
    flat /= shape[i];
  }
  return ShapeString(index);
}

}  // namespace

int DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return 4;
    case v1::DTYPE_F16:
    case v1::DTYPE_BF16:
      return 2;
    default:
      return 0;
  }
}

std::string_view DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return "f32";
    case v1::DTYPE_F16:
      return "f16";
    case v1::DTYPE_BF16:
      return "bf16";
    default:
      return "unspecified";
  }
}

namespace {

// Checks dtype, rank, axes and byte length; the element count in `count`.
absl::Status CheckTensor(const v1::Tensor& tensor, std::string_view name, absl::Span<const Axis> axes,
                         std::vector<int64_t>* dims, int64_t* count) {
  const int elem_bytes = DTypeBytes(tensor.dtype());
  if (elem_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s has dtype %d (%s); want DTYPE_F32, DTYPE_F16 or DTYPE_BF16",
                                                      name, static_cast<int>(tensor.dtype()),
                                                      DTypeName(tensor.dtype())));
  }
  if (tensor.shape_size() != static_cast<int>(axes.size())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s has %d dims, want %s", name, tensor.shape_size(), AxisNames(axes)));
  }
  dims->assign(tensor.shape().begin(), tensor.shape().end());
  int64_t n = 1;
  for (size_t i = 0; i < axes.size(); ++i) {
    const int64_t d = (*dims)[i];
    if (axes[i].size != Axis::kAnySize && d != axes[i].size) {
      return absl::InvalidArgumentError(absl::StrFormat("%s axis %s is %d, want %d (shape %s, axes %s)", name,
                                                        axes[i].name, d, axes[i].size, ShapeString(*dims),
                                                        AxisNames(axes)));
    }
    if (d < 1) {
      return absl::InvalidArgumentError(absl::StrFormat("%s axis %s is %d, want at least 1 (shape %s, axes %s)", name,
                                                        axes[i].name, d, ShapeString(*dims), AxisNames(axes)));
    }
    if (d > kMaxElements / n) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s shape %s has more than 2^40 elements", name, ShapeString(*dims)));
    }
    n *= d;
  }
  const int64_t want_bytes = n * elem_bytes;
  if (static_cast<int64_t>(tensor.data().size()) != want_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat("%s has %d bytes, want %d (shape %s x %d bytes of %s)", name,
                                                      tensor.data().size(), want_bytes, ShapeString(*dims), elem_bytes,
                                                      DTypeName(tensor.dtype())));
  }
  *count = n;
  return absl::OkStatus();
}

// Widens f16 / bf16 elements to float32.
void WidenHalves(const char* src, v1::DType dtype, int64_t count, float* dst) {
  HalfBytesToFloats(src, static_cast<size_t>(count), dtype == v1::DTYPE_BF16, dst);
}

// INVALID_ARGUMENT naming the first NaN/Inf element, if any.
absl::Status CheckFinite(const float* data, int64_t count, std::string_view name, absl::Span<const int64_t> dims) {
  // One branch-free pass; the index is looked for only when there is one.
  if (AllFinite(data, static_cast<size_t>(count))) return absl::OkStatus();
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(data[i])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s%s is %f; want finite values", name, IndexString(i, dims), data[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeTensor(const v1::Tensor& tensor, std::string_view name, absl::Span<const Axis> axes,
                          std::vector<float>* out, std::vector<int64_t>* shape) {
  std::vector<int64_t> dims;
  int64_t count = 0;
  if (absl::Status s = CheckTensor(tensor, name, axes, &dims, &count); !s.ok()) return s;
  out->resize(static_cast<size_t>(count));
  if (tensor.dtype() == v1::DTYPE_F32) {
    std::memcpy(out->data(), tensor.data().data(), static_cast<size_t>(count) * sizeof(float));
  } else {
    WidenHalves(tensor.data().data(), tensor.dtype(), count, out->data());
  }
  if (absl::Status s = CheckFinite(out->data(), count, name, dims); !s.ok()) return s;
  if (shape != nullptr) *shape = std::move(dims);
  return absl::OkStatus();
}

absl::Status DecodeTensorView(const v1::Tensor& tensor, std::string_view name, absl::Span<const Axis> axes,
                              FloatTensor* out, std::vector<int64_t>* shape) {
  std::vector<int64_t> dims;
  int64_t count = 0;
  if (absl::Status s = CheckTensor(tensor, name, axes, &dims, &count); !s.ok()) return s;
  const char* src = tensor.data().data();
  if (tensor.dtype() == v1::DTYPE_F32 && reinterpret_cast<uintptr_t>(src) % alignof(float) == 0) {
    out->storage.clear();
    out->values = absl::MakeConstSpan(reinterpret_cast<const float*>(src), static_cast<size_t>(count));
  } else {
    out->storage.resize(static_cast<size_t>(count));
    if (tensor.dtype() == v1::DTYPE_F32) {
      std::memcpy(out->storage.data(), src, static_cast<size_t>(count) * sizeof(float));
    } else {
      WidenHalves(src, tensor.dtype(), count, out->storage.data());
    }
    out->values = out->storage;
  }
  if (absl::Status s = CheckFinite(out->values.data(), count, name, dims); !s.ok()) return s;
  if (shape != nullptr) *shape = std::move(dims);
  return absl::OkStatus();
}

absl::Status EncodeTensor(absl::Span<const float> data, absl::Span<const int64_t> shape, v1::DType dtype,
                          v1::Tensor* out) {
  if (dtype == v1::DTYPE_UNSPECIFIED) dtype = v1::DTYPE_F32;
  const int elem_bytes = DTypeBytes(dtype);
  if (elem_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "output dtype %d is unknown; want DTYPE_F32, DTYPE_F16 or DTYPE_BF16", static_cast<int>(dtype)));
  }
  out->set_dtype(dtype);
  out->clear_shape();
  for (int64_t d : shape) out->add_shape(d);
  std::string* bytes = out->mutable_data();
  bytes->resize(data.size() * elem_bytes);
  char* dst = bytes->data();
  if (dtype == v1::DTYPE_F32) {
    if (!data.empty()) std::memcpy(dst, data.data(), data.size() * sizeof(float));
  } else {
    FloatsToHalfBytes(data.data(), data.size(), dtype == v1::DTYPE_BF16, dst);
  }
  return absl::OkStatus();
}

float* PrepareF32Tensor(absl::Span<const int64_t> shape, v1::Tensor* out) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  out->set_dtype(v1::DTYPE_F32);
  out->clear_shape();
  for (int64_t d : shape) out->add_shape(d);
  std::string* bytes = out->mutable_data();
  bytes->resize(static_cast<size_t>(count) * sizeof(float));
  char* data = bytes->data();
  if (reinterpret_cast<uintptr_t>(data) % alignof(float) != 0) return nullptr;
  return reinterpret_cast<float*>(data);
}

}  // namespace service
}  // namespace tqkv
