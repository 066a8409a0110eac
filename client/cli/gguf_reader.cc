#include "client/cli/gguf_reader.h"

#include <cstring>
#include <fstream>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"

namespace tqkv {
namespace cli {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxArrayNesting = 4;
constexpr uint32_t kMaxTensorDims = 8;

// Bytes of one element of a fixed-size type; 0 for strings and arrays.
int TypeBytes(GgufType type) {
  switch (type) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool:
      return 1;
    case GgufType::kUint16:
    case GgufType::kInt16:
      return 2;
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32:
      return 4;
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64:
      return 8;
    case GgufType::kString:
    case GgufType::kArray:
      return 0;
  }
  return 0;
}

bool KnownType(uint32_t type) { return type <= static_cast<uint32_t>(GgufType::kFloat64); }

uint64_t LoadLe(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Sequential little-endian reads from a file, each checked against the bytes
// left, so that a bad count fails instead of allocating.
class Cursor {
 public:
  Cursor(std::ifstream& in, uint64_t size) : in_(in), size_(size) {}

  uint64_t offset() const { return offset_; }
  uint64_t left() const { return size_ - offset_; }

  absl::Status Bytes(void* out, uint64_t n, absl::string_view what) {
    if (n > left()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GGUF: %s needs %d bytes at offset %d, but the file has %d left (truncated?)", what, n, offset_, left()));
    }
    if (n > 0 && !in_.read(static_cast<char*>(out), static_cast<std::streamsize>(n))) {
      return absl::InvalidArgumentError(absl::StrFormat("GGUF: read error at offset %d (%s)", offset_, what));
    }
    offset_ += n;
    return absl::OkStatus();
  }

  absl::Status Skip(uint64_t n, absl::string_view what) {
    if (n > left()) return Bytes(nullptr, n, what);  // the same message
    in_.seekg(static_cast<std::streamoff>(offset_ + n));
    offset_ += n;
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> Unsigned(int bytes, absl::string_view what) {
    unsigned char buffer[8];
    RETURN_IF_ERROR(Bytes(buffer, bytes, what));
    return LoadLe(buffer, bytes);
  }

  absl::StatusOr<std::string> String(absl::string_view what) {
    ASSIGN_OR_RETURN(const uint64_t length, Unsigned(8, what));
    if (length > left()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("GGUF: %s has length %d at offset %d, past the end of the file", what, length, offset_));
    }
    std::string s(length, '\0');
    RETURN_IF_ERROR(Bytes(s.data(), length, what));
    return s;
  }

 private:
  std::ifstream& in_;
  uint64_t size_;
  uint64_t offset_ = 0;
};

// Decodes one fixed-size scalar of `type` into value->integer / number.
absl::Status ReadNumber(Cursor& cursor, GgufType type, absl::string_view what, GgufValue* value) {
  const int bytes = TypeBytes(type);
  ASSIGN_OR_RETURN(const uint64_t raw, cursor.Unsigned(bytes, what));
  switch (type) {
    case GgufType::kFloat32: {
      const uint32_t bits = static_cast<uint32_t>(raw);
      float f;
      std::memcpy(&f, &bits, sizeof f);
      value->number = f;
      return absl::OkStatus();
    }
    case GgufType::kFloat64: {
      double d;
      std::memcpy(&d, &raw, sizeof d);
      value->number = d;
      return absl::OkStatus();
    }
    case GgufType::kInt8:
    case GgufType::kInt16:
    case GgufType::kInt32:
    case GgufType::kInt64: {
      const int shift = 64 - 8 * bytes;  // sign-extend
      value->integer = static_cast<int64_t>(raw << shift) >> shift;
      break;
    }
    case GgufType::kUint64:
      if (raw > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(absl::StrFormat("GGUF: %s is %d, above the int64 range", what, raw));
      }
      value->integer = static_cast<int64_t>(raw);
      break;
    case GgufType::kBool:
      value->integer = raw != 0;
      break;
    default:
      value->integer = static_cast<int64_t>(raw);
      break;
  }
  value->number = static_cast<double>(value->integer);
  return absl::OkStatus();
}

absl::StatusOr<GgufType> ReadType(Cursor& cursor, absl::string_view what) {
  ASSIGN_OR_RETURN(const uint64_t type, cursor.Unsigned(4, what));
  if (!KnownType(static_cast<uint32_t>(type))) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF: %s has value type %d; want 0..12 (uint8 .. float64)", what, type));
  }
  return static_cast<GgufType>(type);
}

// Reads an array's elements (after its element type and count). Numbers and
// bools go to out->numbers (skipped when `out` is null); strings and nested
// arrays are only walked.
absl::Status ReadArrayElements(Cursor& cursor, GgufType element, uint64_t count, absl::string_view what, int depth,
                               GgufValue* out) {
  const int bytes = TypeBytes(element);
  if (bytes > 0) {
    if (count > cursor.left() / bytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("GGUF: %s holds %d elements of %d bytes, past the end of the file", what, count, bytes));
    }
    if (out == nullptr) return cursor.Skip(count * bytes, what);
    out->numbers.reserve(count);
    for (uint64_t i = 0; i < count; ++i) {
      GgufValue element_value;
      RETURN_IF_ERROR(ReadNumber(cursor, element, what, &element_value));
      out->numbers.push_back(element_value.number);
    }
    return absl::OkStatus();
  }
  // Each string or nested array takes at least 8 bytes (its length or its
  // type and count), which bounds a corrupt count.
  if (count > cursor.left() / 8) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF: %s holds %d elements, more than the file has bytes for", what, count));
  }
  for (uint64_t i = 0; i < count; ++i) {
    if (element == GgufType::kString) {
      ASSIGN_OR_RETURN(const uint64_t length, cursor.Unsigned(8, what));
      RETURN_IF_ERROR(cursor.Skip(length, what));
      continue;
    }
    if (depth + 1 >= kMaxArrayNesting) {
      return absl::InvalidArgumentError(
          absl::StrFormat("GGUF: %s nests arrays deeper than %d", what, kMaxArrayNesting));
    }
    ASSIGN_OR_RETURN(const GgufType inner, ReadType(cursor, what));
    ASSIGN_OR_RETURN(const uint64_t inner_count, cursor.Unsigned(8, what));
    RETURN_IF_ERROR(ReadArrayElements(cursor, inner, inner_count, what, depth + 1, nullptr));
  }
  return absl::OkStatus();
}

absl::StatusOr<GgufValue> ReadValue(Cursor& cursor, GgufType type, const std::string& key) {
  const std::string what = absl::StrCat("metadata '", key, "'");
  GgufValue value;
  value.type = type;
  if (type == GgufType::kString) {
    ASSIGN_OR_RETURN(value.text, cursor.String(what));
  } else if (type == GgufType::kArray) {
    ASSIGN_OR_RETURN(value.element_type, ReadType(cursor, what));
    ASSIGN_OR_RETURN(value.array_size, cursor.Unsigned(8, what));
    RETURN_IF_ERROR(ReadArrayElements(cursor, value.element_type, value.array_size, what, 0, &value));
  } else {
    RETURN_IF_ERROR(ReadNumber(cursor, type, what, &value));
  }
  return value;
}

absl::Status ReadHeader(Cursor& cursor, GgufFile* file, uint64_t* tensor_count, uint64_t* kv_count) {
  ASSIGN_OR_RETURN(const uint64_t magic, cursor.Unsigned(4, "the magic"));
  if (magic != kMagic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s is not a GGUF file (bad magic 0x%08x; want the bytes \"GGUF\")", file->path, magic));
  }
  ASSIGN_OR_RETURN(const uint64_t version, cursor.Unsigned(4, "the version"));
  if (version != 2 && version != 3) {
    const uint32_t swapped = __builtin_bswap32(static_cast<uint32_t>(version));
    if (swapped == 2 || swapped == 3) {
      return absl::InvalidArgumentError(
          absl::StrCat(file->path, ": big-endian GGUF is not supported; want a little-endian file"));
    }
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: GGUF version %d is not supported; want 2 or 3", file->path, version));
  }
  file->version = static_cast<uint32_t>(version);
  ASSIGN_OR_RETURN(*tensor_count, cursor.Unsigned(8, "the tensor count"));
  ASSIGN_OR_RETURN(*kv_count, cursor.Unsigned(8, "the metadata count"));
  return absl::OkStatus();
}

absl::Status ReadTensorInfos(Cursor& cursor, uint64_t count, GgufFile* file) {
  // A tensor info takes at least 24 bytes (name length, n_dims, type, offset).
  if (count > cursor.left() / 24) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF: tensor count %d is more than the file has bytes for", count));
  }
  for (uint64_t i = 0; i < count; ++i) {
    const std::string what = absl::StrCat("tensor info ", i);
    ASSIGN_OR_RETURN(std::string name, cursor.String(what));
    ASSIGN_OR_RETURN(const uint64_t n_dims, cursor.Unsigned(4, what));
    if (n_dims > kMaxTensorDims) {
      return absl::InvalidArgumentError(
          absl::StrFormat("GGUF: tensor '%s' has %d dims; want at most %d", name, n_dims, kMaxTensorDims));
    }
    GgufTensorInfo info;
    for (uint64_t d = 0; d < n_dims; ++d) {
      ASSIGN_OR_RETURN(const uint64_t dim, cursor.Unsigned(8, what));
      info.dims.push_back(dim);
    }
    ASSIGN_OR_RETURN(const uint64_t type, cursor.Unsigned(4, what));
    info.ggml_type = static_cast<uint32_t>(type);
    ASSIGN_OR_RETURN(info.offset, cursor.Unsigned(8, what));
    file->tensors[std::move(name)] = std::move(info);
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view GgufTypeName(GgufType type) {
  static constexpr absl::string_view kNames[] = {"uint8", "int8",   "uint16", "int16",  "uint32", "int32",  "float32",
                                                 "bool",  "string", "array",  "uint64", "int64",  "float64"};
  const auto index = static_cast<uint32_t>(type);
  return index < std::size(kNames) ? kNames[index] : "unknown";
}

bool GgufValue::is_integer() const { return type != GgufType::kFloat32 && type != GgufType::kFloat64 && is_number(); }

bool GgufValue::is_number() const { return type != GgufType::kString && type != GgufType::kArray; }

const GgufValue* GgufFile::Find(absl::string_view key) const {
  auto it = metadata.find(key);
  return it == metadata.end() ? nullptr : &it->second;
}

absl::StatusOr<int64_t> GgufFile::Int(absl::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return absl::InvalidArgumentError(absl::StrCat("GGUF has no '", key, "'"));
  if (!v->is_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GGUF '", key, "' is a ", GgufTypeName(v->type), "; want an integer"));
  }
  return v->integer;
}

absl::StatusOr<double> GgufFile::Number(absl::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return absl::InvalidArgumentError(absl::StrCat("GGUF has no '", key, "'"));
  if (!v->is_number()) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF '", key, "' is a ", GgufTypeName(v->type), "; want a number"));
  }
  return v->number;
}

absl::StatusOr<std::string> GgufFile::String(absl::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return absl::InvalidArgumentError(absl::StrCat("GGUF has no '", key, "'"));
  if (v->type != GgufType::kString) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF '", key, "' is a ", GgufTypeName(v->type), "; want a string"));
  }
  return v->text;
}

absl::StatusOr<GgufFile> ReadGgufFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  GgufFile file;
  file.path = path;
  file.file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  Cursor cursor(in, file.file_size);
  uint64_t tensor_count = 0, kv_count = 0;
  RETURN_IF_ERROR(ReadHeader(cursor, &file, &tensor_count, &kv_count));
  // A key-value pair takes at least 12 bytes (key length, type).
  if (kv_count > cursor.left() / 12) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: GGUF metadata count %d is more than the file has bytes for", path, kv_count));
  }
  for (uint64_t i = 0; i < kv_count; ++i) {
    ASSIGN_OR_RETURN(std::string key, cursor.String(absl::StrCat("metadata key ", i)));
    ASSIGN_OR_RETURN(const GgufType type, ReadType(cursor, absl::StrCat("metadata '", key, "'")));
    ASSIGN_OR_RETURN(GgufValue value, ReadValue(cursor, type, key));
    file.metadata[std::move(key)] = std::move(value);
  }
  RETURN_IF_ERROR(ReadTensorInfos(cursor, tensor_count, &file));
  uint64_t alignment = kDefaultAlignment;
  if (file.Find("general.alignment") != nullptr) {
    ASSIGN_OR_RETURN(const int64_t a, file.Int("general.alignment"));
    if (a <= 0 || (a & (a - 1)) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: general.alignment is %d; want a power of two", path, a));
    }
    alignment = static_cast<uint64_t>(a);
  }
  file.data_offset = (cursor.offset() + alignment - 1) / alignment * alignment;
  return file;
}

absl::StatusOr<std::vector<float>> ReadGgufF32Tensor(const GgufFile& file, absl::string_view name) {
  auto it = file.tensors.find(name);
  if (it == file.tensors.end()) {
    return absl::NotFoundError(absl::StrCat(file.path, " has no tensor '", name, "'"));
  }
  const GgufTensorInfo& info = it->second;
  if (info.ggml_type != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF tensor '%s' has ggml type %d; want 0 (F32)", std::string(name), info.ggml_type));
  }
  uint64_t count = 1;
  for (uint64_t d : info.dims) {
    if (d != 0 && count > file.file_size / d) count = file.file_size;  // saturate: fails below
    count *= d;
  }
  const uint64_t start = file.data_offset + info.offset;
  if (start < file.data_offset || start > file.file_size || count > (file.file_size - start) / 4) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "GGUF tensor '%s' (%d floats at offset %d) runs past the end of the file", std::string(name), count, start));
  }
  std::ifstream in(file.path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", file.path, "'"));
  in.seekg(static_cast<std::streamoff>(start));
  std::vector<unsigned char> bytes(count * 4);
  if (!in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()))) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF: read error in tensor '", name, "'"));
  }
  std::vector<float> out(count);
  for (uint64_t i = 0; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(LoadLe(&bytes[4 * i], 4));
    std::memcpy(&out[i], &bits, sizeof(float));
  }
  return out;
}

}  // namespace cli
}  // namespace tqkv
