#include "client/cli/npy.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace tqkv {
namespace {

// Array data is copied between the file and memory without byte swapping.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "npy.cc assumes a little-endian host");

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
// numpy aligns the start of the data to this many bytes (numpy >= 1.14).
constexpr size_t kAlign = 64;
// numpy leaves room in the header for the first axis to grow to this many
// digits, so that appending rows can rewrite the header in place.
constexpr size_t kGrowthAxisMaxDigits = 21;
// A header larger than this is not something numpy writes for a plain array;
// refusing it keeps a corrupt length from causing a huge allocation.
constexpr uint32_t kMaxHeaderLen = 1 << 20;

// IEEE half bits -> float. Every half value is exactly representable.
float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {
      // Subnormal: shift the leading 1 up to the implicit-bit position and
      // lower the exponent once per shift.
      int e = 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --e;
      }
      mantissa &= 0x3ffu;
      bits = sign | (static_cast<uint32_t>(e - 15 + 127) << 23) | (mantissa << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, or NaN with payload
  } else {
    bits = sign | ((exponent - 15 + 127) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Python repr of a shape tuple: (), (3,), (2, 3).
std::string ShapeRepr(const std::vector<int64_t>& shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

// Product of `shape`, or an error naming `what` when a dimension is negative or
// the product (times `item_size` bytes) overflows.
absl::StatusOr<int64_t> CheckedNumElements(const std::vector<int64_t>& shape, int64_t item_size,
                                           absl::string_view what) {
  bool has_zero = false;
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "shape ", ShapeRepr(shape), " has a negative dimension; want all >= 0"));
    }
    has_zero |= dim == 0;
  }
  // (2^40, 2^40, 0) is a valid empty array even though a prefix overflows.
  if (has_zero) return 0;
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (count > std::numeric_limits<int64_t>::max() / item_size / dim) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "shape ", ShapeRepr(shape), " has too many elements to address"));
    }
    count *= dim;
  }
  return count;
}

// The values a .npy header dict can hold that we care about.
struct HeaderValue {
  enum class Kind { kString, kBool, kTuple, kOther };
  Kind kind = Kind::kOther;
  std::string text;  // kString: the string; kOther: the raw source text
  bool flag = false;
  std::vector<int64_t> ints;
};

// Parses the Python dict literal numpy writes as the header. It accepts the
// subset numpy produces (quoted keys; string, True/False, tuple-of-int values;
// any bracketed value is kept as raw text so that a structured descr gets a
// precise error) and nothing else.
class HeaderParser {
 public:
  explicit HeaderParser(absl::string_view text) : text_(text) {}

  // On success fills `entries` in header order.
  absl::Status Parse(std::vector<std::pair<std::string, HeaderValue>>* entries) {
    SkipSpace();
    if (!Consume('{')) return Error("expected '{' at the start of the header");
    while (true) {
      SkipSpace();
      if (Consume('}')) break;
      std::string key;
      if (!ParseString(&key)) return Error("expected a quoted key");
      SkipSpace();
      if (!Consume(':')) return Error("expected ':' after a key");
      SkipSpace();
      HeaderValue value;
      absl::Status status = ParseValue(&value);
      if (!status.ok()) return status;
      entries->emplace_back(std::move(key), std::move(value));
      SkipSpace();
      if (Consume(',')) continue;
      if (Consume('}')) break;
      return Error("expected ',' or '}' after a value");
    }
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the closing '}'");
    return absl::OkStatus();
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("malformed header (", what, " at offset ", pos_, "): '",
                                                   absl::StripTrailingAsciiWhitespace(text_.substr(0, 200)), "'"));
  }

  void SkipSpace() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  bool ConsumeWord(absl::string_view word) {
    if (text_.substr(pos_, word.size()) == word) {
      pos_ += word.size();
      return true;
    }
    return false;
  }

  // A '...' or "..." string without escapes (numpy never writes any).
  bool ParseString(std::string* out) {
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) return false;
    const char quote = text_[pos_];
    const size_t end = text_.find(quote, pos_ + 1);
    if (end == absl::string_view::npos) return false;
    const absl::string_view body = text_.substr(pos_ + 1, end - pos_ - 1);
    if (body.find('\\') != absl::string_view::npos) return false;
    *out = std::string(body);
    pos_ = end + 1;
    return true;
  }

  absl::Status ParseValue(HeaderValue* value) {
    if (pos_ >= text_.size()) return Error("expected a value");
    const char c = text_[pos_];
    if (c == '\'' || c == '"') {
      value->kind = HeaderValue::Kind::kString;
      if (!ParseString(&value->text)) return Error("unterminated string");
      return absl::OkStatus();
    }
    if (ConsumeWord("True")) {
      value->kind = HeaderValue::Kind::kBool;
      value->flag = true;
      return absl::OkStatus();
    }
    if (ConsumeWord("False")) {
      value->kind = HeaderValue::Kind::kBool;
      value->flag = false;
      return absl::OkStatus();
    }
    if (c == '(') return ParseTuple(value);
    if (c == '[' || c == '{') return SkipBracketed(value);
    return Error("expected a string, True, False or a tuple");
  }

  // (), (3,), (2, 3), (2, 3,); Python 2 "3L" suffixes are accepted.
  absl::Status ParseTuple(HeaderValue* value) {
    value->kind = HeaderValue::Kind::kTuple;
    ++pos_;  // '('
    while (true) {
      SkipSpace();
      if (Consume(')')) return absl::OkStatus();
      if (pos_ >= text_.size() || text_[pos_] < '0' || text_[pos_] > '9') {
        return Error("expected a non-negative integer in the shape tuple");
      }
      int64_t n = 0;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
        const int digit = text_[pos_] - '0';
        if (n > (std::numeric_limits<int64_t>::max() - digit) / 10) {
          return Error("shape dimension does not fit in 64 bits");
        }
        n = n * 10 + digit;
        ++pos_;
      }
      Consume('L');
      value->ints.push_back(n);
      SkipSpace();
      if (Consume(',')) continue;
      if (Consume(')')) return absl::OkStatus();
      return Error("expected ',' or ')' in the shape tuple");
    }
  }

  // Keeps a [...] or {...} value (a structured dtype's descr) as raw text.
  absl::Status SkipBracketed(HeaderValue* value) {
    const size_t start = pos_;
    int depth = 0;
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c == '\'' || c == '"') {
        std::string ignored;
        if (!ParseString(&ignored)) return Error("unterminated string");
        continue;
      }
      ++pos_;
      if (c == '[' || c == '{' || c == '(') ++depth;
      if (c == ']' || c == '}' || c == ')') {
        if (--depth == 0) {
          value->kind = HeaderValue::Kind::kOther;
          value->text = std::string(text_.substr(start, pos_ - start));
          return absl::OkStatus();
        }
      }
    }
    return Error("unbalanced brackets");
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

absl::StatusOr<Header> ParseHeader(absl::string_view text) {
  std::vector<std::pair<std::string, HeaderValue>> entries;
  absl::Status status = HeaderParser(text).Parse(&entries);
  if (!status.ok()) return status;

  Header header;
  bool have_descr = false, have_fortran = false, have_shape = false;
  for (const auto& [key, value] : entries) {
    bool* seen = nullptr;
    if (key == "descr") {
      seen = &have_descr;
      if (value.kind == HeaderValue::Kind::kString) {
        header.descr = value.text;
      } else if (value.kind == HeaderValue::Kind::kOther) {
        return absl::InvalidArgumentError(
            absl::StrCat("structured dtype ", value.text, " not supported; want float32 ('<f4') or float16 ('<f2')"));
      } else {
        return absl::InvalidArgumentError("header 'descr' is not a dtype string");
      }
    } else if (key == "fortran_order") {
      seen = &have_fortran;
      if (value.kind != HeaderValue::Kind::kBool) {
        return absl::InvalidArgumentError("header 'fortran_order' is not True or False");
      }
      header.fortran_order = value.flag;
    } else if (key == "shape") {
      seen = &have_shape;
      if (value.kind != HeaderValue::Kind::kTuple) {
        return absl::InvalidArgumentError("header 'shape' is not a tuple of integers");
      }
      header.shape = value.ints;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("header has unexpected key '", key, "'; want exactly 'descr', 'fortran_order' and 'shape'"));
    }
    if (*seen) {
      return absl::InvalidArgumentError(absl::StrCat("header repeats key '", key, "'"));
    }
    *seen = true;
  }
  if (!have_descr || !have_fortran || !have_shape) {
    return absl::InvalidArgumentError("header lacks one of the keys 'descr', 'fortran_order', 'shape'");
  }
  return header;
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

// absl::ErrnoToStatus maps 0 to OK; a failed call that left errno unset must
// still be an error.
absl::Status ErrnoError(int error_number, absl::string_view message) {
  if (error_number == 0) return absl::UnknownError(message);
  return absl::ErrnoToStatus(error_number, message);
}

// Prefixes every error from parsing with the path, so that the message always
// names the file.
absl::Status WithPath(const std::string& path, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(path, ": ", status.message()));
}

absl::StatusOr<NpyArray> ReadNpyFile(std::FILE* file, uint64_t file_size) {
  unsigned char prefix[12];
  if (file_size < kMagicLen + 4 || std::fread(prefix, 1, kMagicLen + 2, file) != kMagicLen + 2 ||
      std::memcmp(prefix, kMagic, kMagicLen) != 0) {
    return absl::InvalidArgumentError("not a .npy file: it does not start with the magic \"\\x93NUMPY\"");
  }
  const int major = prefix[6], minor = prefix[7];
  if ((major != 1 && major != 2 && major != 3) || minor != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(".npy format version ", major, ".", minor, " not supported; want 1.0, 2.0 or 3.0"));
  }
  const size_t len_bytes = major == 1 ? 2 : 4;
  if (std::fread(prefix + 8, 1, len_bytes, file) != len_bytes) {
    return absl::InvalidArgumentError("truncated: the file ends inside the header length");
  }
  uint32_t header_len = 0;
  for (size_t i = 0; i < len_bytes; ++i) header_len |= uint32_t{prefix[8 + i]} << (8 * i);
  const uint64_t data_offset = 8 + len_bytes + header_len;
  if (header_len > kMaxHeaderLen) {
    return absl::InvalidArgumentError(
        absl::StrCat("header length ", header_len, " is implausible; want at most ", kMaxHeaderLen));
  }
  if (data_offset > file_size) {
    return absl::InvalidArgumentError(absl::StrCat("truncated: the header says it is ", header_len,
                                                   " bytes but the file has only ", file_size - (8 + len_bytes),
                                                   " bytes after the header length"));
  }
  std::string header_text(header_len, '\0');
  if (std::fread(header_text.data(), 1, header_len, file) != header_len) {
    return absl::DataLossError("could not read the header");
  }
  absl::StatusOr<Header> header = ParseHeader(header_text);
  if (!header.ok()) return header.status();

  int64_t item_size;
  if (header->descr == "<f4") {
    item_size = 4;
  } else if (header->descr == "<f2") {
    item_size = 2;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype '", header->descr, "' not supported; want float32 ('<f4') or float16 ('<f2')"));
  }
  if (header->fortran_order) {
    return absl::InvalidArgumentError(absl::StrCat("fortran_order is True (column-major, shape ",
                                                   ShapeRepr(header->shape),
                                                   "); want C order: save np.ascontiguousarray(x)"));
  }
  absl::StatusOr<int64_t> count = CheckedNumElements(header->shape, item_size, "");
  if (!count.ok()) return count.status();

  const uint64_t want_bytes = static_cast<uint64_t>(*count) * item_size;
  const uint64_t have_bytes = file_size - data_offset;
  if (have_bytes != want_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(have_bytes < want_bytes ? "truncated: " : "trailing bytes: ", "shape ", ShapeRepr(header->shape),
                     " of '", header->descr, "' needs ", want_bytes, " data bytes, the file has ", have_bytes));
  }

  NpyArray array;
  array.shape = header->shape;
  array.data.resize(static_cast<size_t>(*count));
  if (item_size == 4) {
    if (std::fread(array.data.data(), 4, array.data.size(), file) != array.data.size()) {
      return absl::DataLossError("could not read the array data");
    }
  } else {
    std::vector<uint16_t> halves(array.data.size());
    if (std::fread(halves.data(), 2, halves.size(), file) != halves.size()) {
      return absl::DataLossError("could not read the array data");
    }
    for (size_t i = 0; i < halves.size(); ++i) array.data[i] = HalfBitsToFloat(halves[i]);
  }
  return array;
}

}  // namespace

int64_t NpyNumElements(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  FilePtr file(std::fopen(path.c_str(), "rb"));
  if (file == nullptr) {
    return ErrnoError(errno, absl::StrCat(path, ": cannot open for reading"));
  }
  struct stat info;
  if (fstat(fileno(file.get()), &info) != 0) {
    return ErrnoError(errno, absl::StrCat(path, ": cannot stat"));
  }
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file; want a .npy file"));
  }
  absl::StatusOr<NpyArray> array = ReadNpyFile(file.get(), static_cast<uint64_t>(info.st_size));
  if (!array.ok()) return WithPath(path, array.status());
  return array;
}

absl::Status WriteNpy(const std::string& path, const std::vector<int64_t>& shape, const float* data) {
  absl::StatusOr<int64_t> count = CheckedNumElements(shape, 4, absl::StrCat(path, ": "));
  if (!count.ok()) return count.status();
  if (data == nullptr && *count != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": data is null but shape ", ShapeRepr(shape), " has ", *count, " elements"));
  }

  // Laid out exactly as numpy.lib.format._write_array_header (numpy 1.24).
  std::string dict = absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': ", ShapeRepr(shape), ", }");
  if (!shape.empty()) {
    dict.append(kGrowthAxisMaxDigits - absl::StrCat(shape[0]).size(), ' ');
  }
  const size_t unpadded = kMagicLen + 2 + 2 + dict.size() + 1;  // + '\n'
  // numpy pads by a full kAlign when already aligned; match it byte for byte.
  dict.append(kAlign - unpadded % kAlign, ' ');
  dict.push_back('\n');
  if (dict.size() > 0xffff) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": shape ", ShapeRepr(shape), " needs a header too long for format 1.0"));
  }
  std::string prefix(kMagic, kMagicLen);
  prefix.push_back('\x01');
  prefix.push_back('\x00');
  prefix.push_back(static_cast<char>(dict.size() & 0xff));
  prefix.push_back(static_cast<char>(dict.size() >> 8));

  errno = 0;
  FilePtr file(std::fopen(path.c_str(), "wb"));
  if (file == nullptr) {
    return ErrnoError(errno, absl::StrCat(path, ": cannot open for writing"));
  }
  const size_t n = static_cast<size_t>(*count);
  errno = 0;
  if (std::fwrite(prefix.data(), 1, prefix.size(), file.get()) != prefix.size() ||
      std::fwrite(dict.data(), 1, dict.size(), file.get()) != dict.size() ||
      (n > 0 && std::fwrite(data, sizeof(float), n, file.get()) != n)) {
    return ErrnoError(errno, absl::StrCat(path, ": write failed"));
  }
  if (std::fclose(file.release()) != 0) {
    return ErrnoError(errno, absl::StrCat(path, ": close failed"));
  }
  return absl::OkStatus();
}

}  // namespace tqkv
