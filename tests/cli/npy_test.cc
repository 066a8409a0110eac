#include "client/cli/npy.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tqkv {
namespace {

using ::testing::HasSubstr;

// Files written by real NumPy (1.24.2, Debian bookworm) with the Python call
// shown above each array, so that the reader is checked against the real
// format and not only against our own writer.
// np.save(f, np.array([[1.0, -2.5, 3.25], [0.0, 1e-3, -7.0]], dtype='<f4'))
constexpr unsigned char kNumpyF32[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63, 0x72, 0x27, 0x3a,
    0x20, 0x27, 0x3c, 0x66, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74, 0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72,
    0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73, 0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65,
    0x27, 0x3a, 0x20, 0x28, 0x32, 0x2c, 0x20, 0x33, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a, 0x00, 0x00, 0x80, 0x3f, 0x00,
    0x00, 0x20, 0xc0, 0x00, 0x00, 0x50, 0x40, 0x00, 0x00, 0x00, 0x00, 0x6f, 0x12, 0x83, 0x3a, 0x00, 0x00, 0xe0, 0xc0,
};
// np.save(f, np.array([[1, -2, 65504], [2**-14, 2**-24, -np.inf]], dtype='<f2'))
constexpr unsigned char kNumpyF16[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63, 0x72, 0x27,
    0x3a, 0x20, 0x27, 0x3c, 0x66, 0x32, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74, 0x72, 0x61, 0x6e, 0x5f,
    0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73, 0x65, 0x2c, 0x20, 0x27, 0x73, 0x68,
    0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x32, 0x2c, 0x20, 0x33, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x0a, 0x00, 0x3c, 0x00, 0xc0, 0xff, 0x7b, 0x00, 0x04, 0x01, 0x00, 0x00, 0xfc,
};
// np.lib.format.write_array(f, kNumpyF32's array, version=(2, 0))
constexpr unsigned char kNumpyF32V2[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x02, 0x00, 0x74, 0x00, 0x00, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63, 0x72,
    0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74, 0x72, 0x61, 0x6e, 0x5f,
    0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73, 0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61,
    0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x32, 0x2c, 0x20, 0x33, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a, 0x00, 0x00, 0x80, 0x3f, 0x00,
    0x00, 0x20, 0xc0, 0x00, 0x00, 0x50, 0x40, 0x00, 0x00, 0x00, 0x00, 0x6f, 0x12, 0x83, 0x3a, 0x00, 0x00, 0xe0, 0xc0,
};
// np.lib.format.write_array(f, kNumpyF32's array, version=(3, 0))
constexpr unsigned char kNumpyF32V3[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x03, 0x00, 0x74, 0x00, 0x00, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63, 0x72,
    0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74, 0x72, 0x61, 0x6e, 0x5f,
    0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73, 0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61,
    0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x32, 0x2c, 0x20, 0x33, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a, 0x00, 0x00, 0x80, 0x3f, 0x00,
    0x00, 0x20, 0xc0, 0x00, 0x00, 0x50, 0x40, 0x00, 0x00, 0x00, 0x00, 0x6f, 0x12, 0x83, 0x3a, 0x00, 0x00, 0xe0, 0xc0,
};
// np.save(f, np.asfortranarray(kNumpyF32's array))
constexpr unsigned char kNumpyFortran[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63, 0x72, 0x27, 0x3a,
    0x20, 0x27, 0x3c, 0x66, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74, 0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72,
    0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x54, 0x72, 0x75, 0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27,
    0x3a, 0x20, 0x28, 0x32, 0x2c, 0x20, 0x33, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a, 0x00, 0x00, 0x80, 0x3f, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x20, 0xc0, 0x6f, 0x12, 0x83, 0x3a, 0x00, 0x00, 0x50, 0x40, 0x00, 0x00, 0xe0, 0xc0,
};
// np.save(f, kNumpyF32's array.astype('<f8'))
constexpr unsigned char kNumpyF64[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63, 0x72, 0x27,
    0x3a, 0x20, 0x27, 0x3c, 0x66, 0x38, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74, 0x72, 0x61, 0x6e, 0x5f,
    0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73, 0x65, 0x2c, 0x20, 0x27, 0x73, 0x68,
    0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x32, 0x2c, 0x20, 0x33, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x0a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf0, 0x3f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0xc0,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x0a, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0xe0, 0x4d, 0x62, 0x50, 0x3f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1c, 0xc0,
};

// The values stored in kNumpyF32 (and, converted, kNumpyF32V2/V3/Fortran/F64).
const std::vector<float> kValues = {1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, -7.0f};

// Removes the files the tests wrote when the test process exits.
struct TempFiles {
  std::vector<std::string> paths;
  ~TempFiles() {
    for (const std::string& path : paths) std::remove(path.c_str());
  }
};

// Per-process names: ctest may run several of these tests at once.
std::string TempPath(const std::string& name) {
  static TempFiles files;
  std::string path = absl::StrCat(::testing::TempDir(), "/npy_test_", getpid(), "_", name);
  files.paths.push_back(path);
  return path;
}

std::string WriteBytes(const std::string& name, const void* data, size_t size) {
  const std::string path = TempPath(name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  EXPECT_TRUE(out.good()) << path;
  return path;
}

std::string WriteBytes(const std::string& name, const std::string& bytes) {
  return WriteBytes(name, bytes.data(), bytes.size());
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A version 1.0 (or 2.0) .npy file with an arbitrary header dict and payload.
std::string MakeNpy(const std::string& dict, const std::string& payload, int major = 1) {
  std::string header = dict;
  const size_t prefix = major == 1 ? 10 : 12;
  header.append(63 - (prefix + header.size()) % 64, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY", 6);
  out.push_back(static_cast<char>(major));
  out.push_back('\0');
  for (size_t i = 0; i < prefix - 8; ++i) {
    out.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));
  }
  return out + header + payload;
}

std::string Dict(const std::string& descr, const std::string& fortran, const std::string& shape) {
  return absl::StrCat("{'descr': '", descr, "', 'fortran_order': ", fortran, ", 'shape': ", shape, ", }");
}

std::string FloatBytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

void ExpectBitwiseEqual(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(Bits(got[i]), Bits(want[i])) << "element " << i << ": " << got[i] << " vs " << want[i];
  }
}

TEST(ReadNpy, ReadsFloat32FileWrittenByNumpy) {
  const std::string path = WriteBytes("f32.npy", kNumpyF32, sizeof(kNumpyF32));
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, (std::vector<int64_t>{2, 3}));
  ExpectBitwiseEqual(array->data, kValues);
}

TEST(ReadNpy, ConvertsFloat16FileWrittenByNumpyExactly) {
  const std::string path = WriteBytes("f16.npy", kNumpyF16, sizeof(kNumpyF16));
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, (std::vector<int64_t>{2, 3}));
  ExpectBitwiseEqual(array->data, {1.0f, -2.0f, 65504.0f, std::ldexp(1.0f, -14), std::ldexp(1.0f, -24),
                                   -std::numeric_limits<float>::infinity()});
}

TEST(ReadNpy, ReadsVersion2And3HeadersWrittenByNumpy) {
  for (const auto& [name, bytes, size] : {std::make_tuple("v2.npy", kNumpyF32V2, sizeof(kNumpyF32V2)),
                                          std::make_tuple("v3.npy", kNumpyF32V3, sizeof(kNumpyF32V3))}) {
    absl::StatusOr<NpyArray> array = ReadNpy(WriteBytes(name, bytes, size));
    ASSERT_TRUE(array.ok()) << name << ": " << array.status();
    EXPECT_EQ(array->shape, (std::vector<int64_t>{2, 3})) << name;
    ExpectBitwiseEqual(array->data, kValues);
  }
}

TEST(ReadNpy, ConvertsEveryHalfValueExactly) {
  std::vector<uint16_t> halves(65536);
  for (uint32_t i = 0; i < 65536; ++i) halves[i] = static_cast<uint16_t>(i);
  const std::string path = WriteBytes(
      "all_halves.npy", MakeNpy(Dict("<f2", "False", "(65536,)"),
                                std::string(reinterpret_cast<const char*>(halves.data()), halves.size() * 2)));
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  ASSERT_TRUE(array.ok()) << array.status();
  ASSERT_EQ(array->data.size(), 65536u);
  for (uint32_t h = 0; h < 65536; ++h) {
    // Reference by arithmetic rather than by bit manipulation.
    const int exponent = (h >> 10) & 0x1f;
    const int mantissa = h & 0x3ff;
    const float sign = (h & 0x8000) ? -1.0f : 1.0f;
    const float got = array->data[h];
    if (exponent == 31) {
      if (mantissa == 0) {
        EXPECT_EQ(got, sign * std::numeric_limits<float>::infinity()) << h;
      } else {
        EXPECT_TRUE(std::isnan(got)) << h;
        EXPECT_EQ(std::signbit(got), (h & 0x8000) != 0) << h;
      }
      continue;
    }
    const float want = exponent == 0 ? sign * std::ldexp(static_cast<float>(mantissa), -24)
                                     : sign * std::ldexp(1.0f + mantissa / 1024.0f, exponent - 15);
    EXPECT_EQ(Bits(got), Bits(want)) << "half 0x" << std::hex << h;
  }
}

TEST(WriteNpy, MatchesNumpyByteForByte) {
  const std::string path = TempPath("ours.npy");
  ASSERT_TRUE(WriteNpy(path, {2, 3}, kValues.data()).ok());
  EXPECT_EQ(ReadBytes(path), std::string(reinterpret_cast<const char*>(kNumpyF32), sizeof(kNumpyF32)));
}

TEST(WriteNpy, AlignsDataLikeNumpy) {
  // Data offsets numpy 1.24 produces for these shapes (np.save). The last one
  // hits numpy's habit of adding a full 64 bytes of padding when the header
  // would already end on a boundary.
  struct Case {
    std::vector<int64_t> shape;
    std::string shape_repr;
    size_t data_offset;
  };
  const std::vector<Case> cases = {
      {{}, "()", 128},
      {{7}, "(7,)", 128},
      {{0, 128}, "(0, 128)", 128},
      {{4096, 128}, "(4096, 128)", 128},
      {{2, 3, 4}, "(2, 3, 4)", 128},
      {std::vector<int64_t>(20, 1), "(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)", 192},
      {{0, 10, 10, 10, 10, 10, 10, 10, 10, 10, 100}, "(0, 10, 10, 10, 10, 10, 10, 10, 10, 10, 100)", 192},
  };
  for (const Case& c : cases) {
    const std::string path = TempPath("aligned.npy");
    // Only the header is compared; a zero-filled payload of the right size
    // keeps the file valid.
    std::vector<float> zeros(static_cast<size_t>(NpyNumElements(c.shape)), 0.0f);
    ASSERT_TRUE(WriteNpy(path, c.shape, zeros.data()).ok()) << c.shape_repr;
    const std::string bytes = ReadBytes(path);
    ASSERT_EQ(bytes.size(), c.data_offset + 4 * zeros.size()) << c.shape_repr;
    const std::string header = bytes.substr(10, c.data_offset - 10);
    const std::string dict = Dict("<f4", "False", c.shape_repr);
    EXPECT_EQ(header.substr(0, dict.size()), dict);
    EXPECT_EQ(header.find_first_not_of(' ', dict.size()), header.size() - 1) << c.shape_repr;
    EXPECT_EQ(header.back(), '\n');
    EXPECT_EQ(static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8,
              static_cast<int>(c.data_offset - 10));
  }
}

TEST(NpyRoundTrip, PreservesShapeAndBitsForRanksZeroToThree) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> special = {0.0f, -0.0f, 1.5f, -3.75e-39f /* subnormal */, inf, -inf, std::nanf(""), 3.4e38f};
  const std::vector<std::vector<int64_t>> shapes = {{}, {5}, {3, 4}, {2, 3, 4}};
  for (const std::vector<int64_t>& shape : shapes) {
    const int64_t n = NpyNumElements(shape);
    std::vector<float> data(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) data[i] = special[i % special.size()] + (i >= 8 ? i : 0);
    const std::string path = TempPath(absl::StrCat("rank", shape.size(), ".npy"));
    ASSERT_TRUE(WriteNpy(path, shape, data.data()).ok());
    absl::StatusOr<NpyArray> array = ReadNpy(path);
    ASSERT_TRUE(array.ok()) << array.status();
    EXPECT_EQ(array->shape, shape);
    ExpectBitwiseEqual(array->data, data);
  }
}

TEST(NpyRoundTrip, ScalarHasEmptyShapeAndOneElement) {
  const std::string path = TempPath("scalar.npy");
  const float value = 42.5f;
  ASSERT_TRUE(WriteNpy(path, {}, &value).ok());
  EXPECT_EQ(ReadBytes(path).size(), 128u + 4u);
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_TRUE(array->shape.empty());
  EXPECT_EQ(array->data, std::vector<float>{42.5f});
}

TEST(NpyRoundTrip, EmptyArrayKeepsItsShape) {
  const std::string path = TempPath("empty.npy");
  ASSERT_TRUE(WriteNpy(path, {0, 128}, nullptr).ok());
  EXPECT_EQ(ReadBytes(path).size(), 128u);
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, (std::vector<int64_t>{0, 128}));
  EXPECT_TRUE(array->data.empty());
}

TEST(NpyRoundTrip, EmptyArrayMayHaveHugeOtherDimensions) {
  const std::string path = TempPath("empty_huge.npy");
  const std::vector<int64_t> shape = {int64_t{1} << 40, int64_t{1} << 40, 0};
  ASSERT_TRUE(WriteNpy(path, shape, nullptr).ok());
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, shape);
  EXPECT_TRUE(array->data.empty());
}

TEST(ReadNpy, MissingFileIsNotFound) {
  absl::StatusOr<NpyArray> array = ReadNpy(TempPath("does_not_exist.npy"));
  EXPECT_EQ(array.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(array.status().message()), HasSubstr("does_not_exist.npy"));
}

// Expects INVALID_ARGUMENT with a message that names the file and contains
// `want_substring`.
void ExpectRejected(const std::string& name, const std::string& bytes, const std::string& want_substring) {
  const std::string path = WriteBytes(name, bytes);
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  EXPECT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument) << name << ": " << array.status();
  EXPECT_THAT(std::string(array.status().message()), HasSubstr(path)) << name;
  EXPECT_THAT(std::string(array.status().message()), HasSubstr(want_substring)) << name;
}

std::string Bytes(const unsigned char* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

TEST(ReadNpy, RejectsFloat64WithAMessageSayingWhatIsWanted) {
  const std::string path = WriteBytes("keys.npy", kNumpyF64, sizeof(kNumpyF64));
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  EXPECT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(array.status().message()), absl::StrCat(path,
                                                                ": dtype '<f8' not supported; want float32 ('<f4') or "
                                                                "float16 ('<f2')"));
}

TEST(ReadNpy, RejectsOtherDtypes) {
  const std::string payload(24, '\0');
  for (const char* descr : {">f4", ">f2", "<i4", "|u1", "<f8", "=f4", "f4", "<c8"}) {
    ExpectRejected("dtype.npy", MakeNpy(Dict(descr, "False", "(2, 3)"), payload),
                   absl::StrCat("dtype '", descr, "' not supported"));
  }
}

TEST(ReadNpy, RejectsStructuredDtype) {
  ExpectRejected("structured.npy",
                 MakeNpy("{'descr': [('a', '<f4'), ('b', '<f4')], 'fortran_order': False, "
                         "'shape': (3,), }",
                         std::string(24, '\0')),
                 "structured dtype");
}

TEST(ReadNpy, RejectsFortranOrder) {
  ExpectRejected("fortran.npy", Bytes(kNumpyFortran, sizeof(kNumpyFortran)), "fortran_order is True");
}

TEST(ReadNpy, RejectsTruncatedData) {
  ExpectRejected("truncated.npy", Bytes(kNumpyF32, sizeof(kNumpyF32) - 1),
                 "truncated: shape (2, 3) of '<f4' needs 24 data bytes, the file has 23");
  ExpectRejected("truncated16.npy", Bytes(kNumpyF16, sizeof(kNumpyF16) - 2), "needs 12 data bytes, the file has 10");
}

TEST(ReadNpy, RejectsTrailingBytes) {
  ExpectRejected("trailing.npy", Bytes(kNumpyF32, sizeof(kNumpyF32)) + "x", "trailing bytes");
}

TEST(ReadNpy, RejectsTruncatedHeader) {
  ExpectRejected("cut_header.npy", Bytes(kNumpyF32, 40), "truncated");
  ExpectRejected("cut_magic.npy", Bytes(kNumpyF32V2, 7), "not a .npy file");
  ExpectRejected("cut_length.npy", Bytes(kNumpyF32V2, 11), "ends inside the header length");
}

TEST(ReadNpy, RejectsBadMagic) {
  std::string bytes = Bytes(kNumpyF32, sizeof(kNumpyF32));
  bytes[1] = 'n';
  ExpectRejected("bad_magic.npy", bytes, "not a .npy file");
  ExpectRejected("empty_file.npy", "", "not a .npy file");
  ExpectRejected("text.npy", "1.0 2.0 3.0\n", "not a .npy file");
}

TEST(ReadNpy, RejectsUnknownVersion) {
  std::string bytes = Bytes(kNumpyF32, sizeof(kNumpyF32));
  bytes[6] = 4;
  ExpectRejected("v4.npy", bytes, "version 4.0 not supported; want 1.0, 2.0 or 3.0");
  bytes[6] = 1;
  bytes[7] = 1;
  ExpectRejected("v1_1.npy", bytes, "version 1.1 not supported");
}

TEST(ReadNpy, RejectsMalformedHeaders) {
  const std::string payload(24, '\0');
  ExpectRejected("no_shape.npy", MakeNpy("{'descr': '<f4', 'fortran_order': False, }", payload),
                 "lacks one of the keys");
  ExpectRejected("extra_key.npy", MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'x': 1}", payload),
                 "malformed header");
  ExpectRejected("unknown_key.npy",
                 MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), "
                         "'order': False}",
                         payload),
                 "unexpected key 'order'");
  ExpectRejected("repeated_key.npy",
                 MakeNpy("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, "
                         "'shape': (6,)}",
                         payload),
                 "repeats key 'descr'");
  ExpectRejected("negative_dim.npy", MakeNpy(Dict("<f4", "False", "(-2, 3)"), payload), "malformed header");
  ExpectRejected("not_a_dict.npy", MakeNpy("garbage", payload), "malformed header");
  ExpectRejected("unclosed.npy", MakeNpy("{'descr': '<f4'", payload), "malformed header");
  ExpectRejected("bad_order.npy", MakeNpy(Dict("<f4", "0", "(2, 3)"), payload), "malformed header");
  ExpectRejected("huge_shape.npy", MakeNpy(Dict("<f4", "False", "(4611686018427387904, 4)"), payload),
                 "too many elements");
  ExpectRejected("overflow_dim.npy", MakeNpy(Dict("<f4", "False", "(99999999999999999999,)"), payload),
                 "does not fit in 64 bits");
}

TEST(ReadNpy, AcceptsPython2StyleHeader) {
  // numpy under Python 2 wrote long integers with an L suffix.
  absl::StatusOr<NpyArray> array = ReadNpy(WriteBytes(
      "py2.npy", MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }", FloatBytes(kValues))));
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, (std::vector<int64_t>{2, 3}));
}

TEST(ReadNpy, AcceptsKeysInAnyOrderAndVersion2) {
  absl::StatusOr<NpyArray> array =
      ReadNpy(WriteBytes("reordered.npy", MakeNpy("{\"shape\": (6,), \"fortran_order\": False, \"descr\": \"<f4\"}",
                                                  FloatBytes(kValues), /*major=*/2)));
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, (std::vector<int64_t>{6}));
  ExpectBitwiseEqual(array->data, kValues);
}

TEST(ReadNpy, RejectsADirectory) {
  absl::StatusOr<NpyArray> array = ReadNpy(::testing::TempDir());
  EXPECT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument) << array.status();
}

TEST(WriteNpy, MissingDirectoryIsNotFound) {
  const float value = 1.0f;
  absl::Status status = WriteNpy(TempPath("no_such_dir/out.npy"), {1}, &value);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("no_such_dir/out.npy"));
}

TEST(WriteNpy, RejectsNegativeDimensionAndNullData) {
  const float value = 1.0f;
  absl::Status status = WriteNpy(TempPath("neg.npy"), {2, -1}, &value);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("negative dimension"));
  status = WriteNpy(TempPath("null.npy"), {2}, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("data is null"));
}

}  // namespace
}  // namespace tqkv
