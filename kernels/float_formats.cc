#include "kernels/float_formats.h"

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

}  // namespace tqkv
