#include "kernels/bitpack.h"

#include <cstring>

#include "kernels/simd/encode_kernels.h"

namespace tqkv {

void PackBits(const uint8_t* codes, int n, int bits, uint8_t* out) {
  if (const encode_internal::EncodeKernels* simd = encode_internal::ActiveEncodeKernels()) {
    simd->pack_bits(codes, n, bits, out);
    return;
  }
  const uint32_t mask = (1u << bits) - 1u;
  if (bits == 8) {
    memcpy(out, codes, n);
    return;
  }
  // Eight codes of b bits fill exactly b bytes: whole groups go through one
  // 64-bit word; the tail through a draining accumulator.
  int j = 0;
  int written = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t word = 0;
    for (int k = 0; k < 8; ++k) word |= static_cast<uint64_t>(codes[j + k] & mask) << (k * bits);
    for (int k = 0; k < bits; ++k) out[written + k] = static_cast<uint8_t>(word >> (8 * k));
    written += bits;
  }
  uint64_t acc = 0;
  int acc_bits = 0;
  for (; j < n; ++j) {
    acc |= static_cast<uint64_t>(codes[j] & mask) << acc_bits;
    acc_bits += bits;
    while (acc_bits >= 8) {
      out[written++] = static_cast<uint8_t>(acc);
      acc >>= 8;
      acc_bits -= 8;
    }
  }
  if (acc_bits > 0) out[written] = static_cast<uint8_t>(acc);
}

void UnpackBits(const uint8_t* packed, int n, int bits, uint8_t* codes) {
  if (bits == 8) {
    memcpy(codes, packed, n);
    return;
  }
  const uint32_t mask = (1u << bits) - 1u;
  int j = 0;
  int read = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t word = 0;
    for (int k = 0; k < bits; ++k) word |= static_cast<uint64_t>(packed[read + k]) << (8 * k);
    for (int k = 0; k < 8; ++k) codes[j + k] = static_cast<uint8_t>((word >> (k * bits)) & mask);
    read += bits;
  }
  uint64_t acc = 0;
  int acc_bits = 0;
  for (; j < n; ++j) {
    if (acc_bits < bits) {
      acc |= static_cast<uint64_t>(packed[read++]) << acc_bits;
      acc_bits += 8;
    }
    codes[j] = static_cast<uint8_t>(acc & mask);
    acc >>= bits;
    acc_bits -= bits;
  }
}

}  // namespace tqkv
