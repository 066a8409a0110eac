// Bit packing of quantization codes.
//
// Layout (part of the stored format, compatible with vLLM's TurboQuant slots):
// n codes of `bits` bits form one LSB-first bit stream, code j occupying bits
// [j*bits, (j+1)*bits) of the stream, where bit k is bit (k % 8) of byte k / 8.
// For 4 bits this puts the even coordinate in the low nibble; for 3 bits a code
// may straddle two bytes. The last byte is zero-padded.
#ifndef TQKV_KERNELS_BITPACK_H_
#define TQKV_KERNELS_BITPACK_H_

#include <cstdint>

#include "kernels/host_device.h"

namespace tqkv {

// Bytes taken by n codes of `bits` bits.
TQKV_HOST_DEVICE constexpr int PackedBytes(int n, int bits) { return (n * bits + 7) / 8; }

// Packs codes[0..n) (each < 2^bits) into PackedBytes(n, bits) bytes at `out`.
// REQUIRES: 1 <= bits <= 8; codes fit in `bits` bits (higher bits are masked off).
void PackBits(const uint8_t* codes, int n, int bits, uint8_t* out);

// Inverse of PackBits: writes n codes to `codes`.
void UnpackBits(const uint8_t* packed, int n, int bits, uint8_t* codes);

// Code j of a packed stream. For kernels that read codes one at a time.
TQKV_HOST_DEVICE uint32_t PackedCodeAt(const uint8_t* packed, int j, int bits) {
  const int bit = j * bits;
  const int byte = bit >> 3;
  const int shift = bit & 7;
  uint32_t word = packed[byte];
  if (shift + bits > 8) word |= static_cast<uint32_t>(packed[byte + 1]) << 8;
  return (word >> shift) & ((1u << bits) - 1u);
}

}  // namespace tqkv

#endif  // TQKV_KERNELS_BITPACK_H_
