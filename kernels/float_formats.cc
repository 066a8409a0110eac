#include "kernels/float_formats.h"

#include <cstring>

namespace tqkv {
namespace {

struct Fp8Table {
  float values[256];
  Fp8Table() {
    for (int code = 0; code < 256; ++code) values[code] = Fp8E4m3ToFloat(static_cast<uint8_t>(code));
  }
};

}  // namespace

const float* Fp8E4m3Table() {
  static const Fp8Table table;
  return table.values;
}

// An exponent of all ones is NaN or infinity. target_clones picks the widest
// clone at load time (ifunc); the loop vectorizes in each.
__attribute__((target_clones("avx512f", "avx2", "default"))) bool AllFinite(const float* x, size_t n) {
  uint32_t all_ones = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    all_ones |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return all_ones == 0;
}

}  // namespace tqkv
