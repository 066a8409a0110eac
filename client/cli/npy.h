// A reader and writer for NumPy .npy files, small enough to own: the CLI reads
// K/V tensors that people dump with numpy.save() and writes results back the
// same way, with no Python at run time.
//
// Format (numpy.lib.format): the magic "\x93NUMPY", a major and minor version
// byte, a little-endian header length (2 bytes in version 1.0, 4 bytes in 2.0
// and 3.0), then the header: a Python dict literal such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// padded with spaces and ended by '\n'. The raw array data follows.
//
// Only what tqkv needs is supported: little-endian float32 ('<f4') and float16
// ('<f2'), C (row-major) order. Everything else is rejected with a message
// that says what was found and what is wanted, never silently converted.
//
// Thread safety: the functions keep no state; concurrent calls on different
// paths are safe.
#ifndef TQKV_CLIENT_CLI_NPY_H_
#define TQKV_CLIENT_CLI_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tqkv {

// A dense float32 array in C order. A rank-0 array (a scalar, shape ()) has
// an empty `shape` and exactly one element; an array with a zero in its shape
// has no elements. Invariant after ReadNpy: data.size() == product of shape.
struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// Number of elements of an array with this shape (1 for shape ()). REQUIRES:
// every dimension >= 0 and the product fits in int64_t.
int64_t NpyNumElements(const std::vector<int64_t>& shape);

// Reads the .npy file at `path`, which may use a version 1.0, 2.0 or 3.0
// header. dtype '<f4' is copied as is; '<f2' (IEEE half) is converted to
// float32 exactly (every half value, including subnormals, infinities and
// NaN, is representable in float32).
//
// Errors:
//   NOT_FOUND         the file does not exist.
//   INVALID_ARGUMENT  the file is not a .npy file (bad magic, unknown version,
//                     malformed header), has a dtype other than '<f4'/'<f2'
//                     (e.g. '<f8', '>f4', '<i4', a structured dtype), has
//                     fortran_order True, or holds fewer or more data bytes
//                     than the shape says. The message names the file.
//   other codes       the file exists but cannot be opened or read
//                     (e.g. PERMISSION_DENIED), as mapped from errno.
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);

// Writes `data` (NpyNumElements(shape) floats in C order, not owned; may be null
// when that count is 0) to `path` as a version 1.0 '<f4' C-order .npy file,
// replacing any existing file. The header is laid out byte for byte as
// numpy.save() (numpy >= 1.24) lays it out: the dict with sorted keys, spare
// spaces for growing the first axis, and padding so that the data starts at a
// multiple of 64 bytes.
//
// Errors: INVALID_ARGUMENT for a negative dimension, an element count that
// overflows, or null `data` with a non-zero element count; the errno-mapped
// code (e.g. NOT_FOUND for a missing directory, PERMISSION_DENIED) when the
// file cannot be created or written. A failed write may leave a partial file.
absl::Status WriteNpy(const std::string& path, const std::vector<int64_t>& shape, const float* data);

}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_NPY_H_
