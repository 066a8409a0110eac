#include "service/crc32c.h"

#include <array>
#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace tqkv {
namespace {

// The reflected Castagnoli polynomial.
constexpr uint32_t kPoly = 0x82F63B78u;

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

// Raw (unconditioned) CRC state over bytes, a table step per byte.
uint32_t RawBytes(uint32_t c, const uint8_t* p, size_t n) {
  for (; n > 0; --n, ++p) c = kTable[(c ^ *p) & 0xff] ^ (c >> 8);
  return c;
}

// a * b modulo the polynomial, both as reflected bit strings (bit 31 is x^0).
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(8 n) modulo the polynomial: what appending n zero bytes multiplies a
// CRC state by.
uint32_t ShiftFor(size_t n) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t square = 1u << 23;  // x^8: one byte
  for (; n > 0; n >>= 1) {
    if (n & 1) result = MultiplyModP(result, square);
    square = MultiplyModP(square, square);
  }
  return result;
}

#if defined(__SSE4_2__)
uint32_t RawWords(uint32_t c, const uint8_t* p, size_t words) {
  uint64_t c64 = c;
  for (size_t i = 0; i < words; ++i) {
    uint64_t word;
    std::memcpy(&word, p + 8 * i, 8);
    c64 = _mm_crc32_u64(c64, word);
  }
  return static_cast<uint32_t>(c64);
}
#endif

}  // namespace

uint32_t Crc32c(uint32_t crc, const void* data, size_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__SSE4_2__)
  // The crc32 instruction has a latency of 3 cycles and issues every cycle:
  // three independent streams over thirds of the buffer keep it busy; their
  // states are then joined (each shifted past the bytes after it).
  constexpr size_t kMinInterleaved = 3 * 4096;
  while (size >= kMinInterleaved) {
    const size_t lane_words = (size / 3) / 8;
    const size_t lane = lane_words * 8;
    uint64_t c0 = c, c1 = 0, c2 = 0;
    const uint8_t* p1 = p + lane;
    const uint8_t* p2 = p + 2 * lane;
    for (size_t i = 0; i < lane_words; ++i) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + 8 * i, 8);
      std::memcpy(&w1, p1 + 8 * i, 8);
      std::memcpy(&w2, p2 + 8 * i, 8);
      c0 = _mm_crc32_u64(c0, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    // State after lane 0 then lane 1: lane 0's shifted by lane 1's length,
    // plus lane 1's from a zero state (CRCs are linear).
    const uint32_t shift = ShiftFor(lane);
    uint32_t joined = MultiplyModP(static_cast<uint32_t>(c0), shift) ^ static_cast<uint32_t>(c1);
    joined = MultiplyModP(joined, shift) ^ static_cast<uint32_t>(c2);
    c = joined;
    p += 3 * lane;
    size -= 3 * lane;
  }
  c = RawWords(c, p, size / 8);
  p += size / 8 * 8;
  size %= 8;
  for (; size > 0; --size, ++p) c = _mm_crc32_u8(c, *p);
#else
  c = RawBytes(c, p, size);
#endif
  return ~c;
}

uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t size) {
  return ~RawBytes(~crc, static_cast<const uint8_t*>(data), size);
}

}  // namespace tqkv
