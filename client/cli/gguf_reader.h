// A reader of the metadata of GGUF files (the model format of llama.cpp):
// the header, the typed key-value pairs and the tensor infos. Tensor data is
// not read, except one float32 tensor on request (ReadGgufF32Tensor: the
// rope_freqs tensor in which converted Llama-3.1 weights carry their RoPE
// scaling).
//
// The format, versions 2 and 3 (version 1, with 32-bit counts, is refused),
// all little-endian:
//
//   "GGUF"  uint32 version  uint64 tensor_count  uint64 kv_count
//   kv_count x     { string key, uint32 type, value }
//   tensor_count x { string name, uint32 n_dims, uint64 dims[n_dims],
//                    uint32 ggml_type, uint64 offset }
//   padding to general.alignment (default 32), then the tensor data; a
//   tensor's offset counts from there.
//
// A string is a uint64 byte count and the bytes (no terminator); an array is
// a uint32 element type, a uint64 count and the elements. Value types: see
// GgufType.
//
// Every count and length is checked against the bytes the file has left, so
// a truncated or corrupt file is an error, never a huge allocation. Nothing
// here is thread-affine; a GgufFile is a plain value.
#ifndef TQKV_CLIENT_CLI_GGUF_READER_H_
#define TQKV_CLIENT_CLI_GGUF_READER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tqkv {
namespace cli {

// The value types of GGUF metadata, with their numbers in the file.
enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// "uint32", "string", ... for messages.
absl::string_view GgufTypeName(GgufType type);

// One metadata value.
struct GgufValue {
  GgufType type = GgufType::kUint8;
  // Integers and bools (0/1) exactly; uint64 values above INT64_MAX are
  // refused by the reader.
  int64_t integer = 0;
  // Every number and bool, as a double (floats widened exactly).
  double number = 0.0;
  std::string text;  // kString
  // kArray: the elements' type and count; `numbers` holds numeric and bool
  // elements (as doubles). String elements and nested arrays are counted,
  // not kept (a tokenizer's vocabulary is most of a file's metadata).
  GgufType element_type = GgufType::kUint8;
  uint64_t array_size = 0;
  std::vector<double> numbers;

  bool is_integer() const;  // an integer or bool scalar
  bool is_number() const;   // any numeric or bool scalar
};

struct GgufTensorInfo {
  std::vector<uint64_t> dims;  // innermost first, as ggml orders them
  uint32_t ggml_type = 0;      // 0: F32, 1: F16, ... (ggml's numbering)
  uint64_t offset = 0;         // from the start of the data section
};

struct GgufFile {
  std::string path;
  uint32_t version = 0;
  std::map<std::string, GgufValue, std::less<>> metadata;
  std::map<std::string, GgufTensorInfo, std::less<>> tensors;
  uint64_t data_offset = 0;  // where the tensor data starts in the file
  uint64_t file_size = 0;

  const GgufValue* Find(absl::string_view key) const;
  // INVALID_ARGUMENT naming the key when it is absent or of another kind.
  absl::StatusOr<int64_t> Int(absl::string_view key) const;    // integer or bool
  absl::StatusOr<double> Number(absl::string_view key) const;  // any number
  absl::StatusOr<std::string> String(absl::string_view key) const;
};

// Reads the header, the metadata and the tensor infos of `path`.
// NOT_FOUND when the file cannot be opened; INVALID_ARGUMENT for a file that
// is not GGUF ("bad magic"), a version other than 2 or 3, a big-endian file,
// an unknown value type, or a count or length that runs past the end of the
// file (each message names what was being read and, for metadata, the key).
absl::StatusOr<GgufFile> ReadGgufFile(const std::string& path);

// The elements of a float32 (ggml type 0) tensor of `file`, read from
// file.path. NOT_FOUND when there is no such tensor; INVALID_ARGUMENT for
// another type or data past the end of the file.
absl::StatusOr<std::vector<float>> ReadGgufF32Tensor(const GgufFile& file, absl::string_view name);

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_GGUF_READER_H_
