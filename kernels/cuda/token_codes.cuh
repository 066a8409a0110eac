// One token's codes inside a page's codes plane, as the CUDA kernels address
// them: tiled for packed codecs, token-major for raw numbers
// (kernels/code_tiles.h; DeviceField::tiled says which). Shared by the store
// and the read kernels (nvcc and the host emulation), so that both follow
// CodePlane::Offset, the layout the CPU backend writes.
//
// Byte b of a token's codes sits at
//   words + (b / 4) * word_stride + b % 4   for b < whole,
//   tail + (b - whole)                      otherwise,
// which is CodePlane::Offset(slot, b) from the plane's start: in a tiled plane
// `whole` is the bytes in whole 4-byte words and word_stride is 4 times the
// tile's tokens; in a token-major plane whole = code_bytes and word_stride =
// 4, so byte b is simply at words + b.
//
// A tiled plane keeps every whole word of a token 4-byte aligned whatever
// code_bytes is (a tile starts 16 * code_bytes bytes after the previous one,
// planes start on 32-byte boundaries, pages are multiples of 32 bytes); a
// token-major plane only when code_bytes is a multiple of 4.
#ifndef TQKV_KERNELS_CUDA_TOKEN_CODES_CUH_
#define TQKV_KERNELS_CUDA_TOKEN_CODES_CUH_

#include "kernels/cuda/device_compat.cuh"

#include <cstdint>

#include "kernels/code_tiles.h"
#include "kernels/cuda/device_format.h"

namespace tqkv {
namespace cuda {

// Byte is uint8_t for the store kernel, const uint8_t for the readers.
template <typename Byte>
struct TokenCodes {
  Byte* words = nullptr;  // byte 0 of the token's word 0
  Byte* tail = nullptr;   // byte `whole` of the token (unused when whole == code_bytes)
  int word_stride = 0;
  int whole = 0;
  int code_bytes = 0;
  bool aligned = false;  // words at byte offsets b % 4 == 0, b + 4 <= whole, are 4-byte aligned
};

// The codes of the token in `slot` of `page` (pages of page_tokens tokens).
template <typename Byte>
__device__ __forceinline__ TokenCodes<Byte> FieldTokenCodes(const DeviceField& f, Byte* page, int page_tokens,
                                                            int slot) {
  const CodePlane plane{page_tokens, f.code_bytes, f.tiled != 0};
  Byte* base = page + f.codes_offset;
  TokenCodes<Byte> c;
  c.code_bytes = f.code_bytes;
  c.whole = plane.tiled ? f.code_bytes - f.code_bytes % kTileWordBytes : f.code_bytes;
  c.word_stride = plane.tiled ? kTileWordBytes * plane.TileSize(slot) : kTileWordBytes;
  c.words = base + plane.Offset(slot, 0);
  c.tail = c.whole < f.code_bytes ? base + plane.Offset(slot, c.whole) : c.words + c.whole;
  c.aligned = plane.tiled || f.code_bytes % kTileWordBytes == 0;
  return c;
}

// Where byte b (0 <= b < code_bytes) of the token's codes sits.
template <typename Byte>
__device__ __forceinline__ Byte* CodeByte(const TokenCodes<Byte>& c, int b) {
  return b < c.whole ? c.words + (b >> 2) * c.word_stride + (b & 3) : c.tail + (b - c.whole);
}

// The token's bytes [b, b + 4) as a little-endian word, zeros for bytes at or
// past code_bytes: one 32-bit load for an aligned whole word, else bytes.
__device__ __forceinline__ uint32_t LoadCodeWord(const TokenCodes<const uint8_t>& c, int b) {
  if ((b & 3) == 0 && b + 4 <= c.whole && c.aligned) {
    return *reinterpret_cast<const uint32_t*>(c.words + (b >> 2) * c.word_stride);
  }
  uint32_t w = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (b + k < c.code_bytes) w |= static_cast<uint32_t>(*CodeByte(c, b + k)) << (8 * k);
  }
  return w;
}

// The token's bytes [b, b + kBytes) in the low bytes of the result (what lies
// above them is unspecified), read as the one or two words they fall in.
// REQUIRES: b % 4 + kBytes <= 8.
template <int kBytes>
__device__ __forceinline__ uint64_t LoadCodeBytes(const TokenCodes<const uint8_t>& c, int b) {
  const int shift = b & 3;
  uint64_t w = LoadCodeWord(c, b - shift);
  if (shift + kBytes > 4) w |= static_cast<uint64_t>(LoadCodeWord(c, b - shift + 4)) << 32;
  return w >> (8 * shift);
}

// w[k] = the token's bytes [first + 4k, first + 4k + 4) for 4k < bytes, 0
// beyond; bytes past `bytes` inside the last word are unspecified. Reads
// only the aligned words that hold the run, shifting when `first` is not a
// multiple of 4. REQUIRES: c.aligned, first + bytes <= c.whole (every byte of
// the run in a whole word).
template <int kWords>
__device__ __forceinline__ void LoadWordRun(const TokenCodes<const uint8_t>& c, int first, int bytes,
                                            uint32_t (&w)[kWords]) {
  const int shift = first & 3;
  const uint8_t* at = c.words + (first >> 2) * c.word_stride;
  uint32_t lo = *reinterpret_cast<const uint32_t*>(at);
#pragma unroll
  for (int k = 0; k < kWords; ++k) {
    if (4 * k < bytes) {
      const uint32_t hi =
          4 * k + 4 - shift < bytes ? *reinterpret_cast<const uint32_t*>(at + (k + 1) * c.word_stride) : 0u;
      w[k] = __funnelshift_r(lo, hi, 8 * shift);
      lo = hi;
    } else {
      w[k] = 0;
    }
  }
}

// As LoadWordRun for any run inside the token's codes (first + bytes <=
// code_bytes): runs that reach tail bytes, or a token-major plane whose
// words are not aligned, are read through LoadCodeWord.
template <int kWords>
__device__ __forceinline__ void LoadCodeRun(const TokenCodes<const uint8_t>& c, int first, int bytes,
                                            uint32_t (&w)[kWords]) {
  if (c.aligned && first + bytes <= c.whole) return LoadWordRun<kWords>(c, first, bytes, w);
  const int shift = first & 3;
  const int at = first - shift;
  uint32_t lo = LoadCodeWord(c, at);
#pragma unroll
  for (int k = 0; k < kWords; ++k) {
    if (4 * k < bytes) {
      const uint32_t hi = 4 * k + 4 - shift < bytes ? LoadCodeWord(c, at + 4 * k + 4) : 0u;
      w[k] = __funnelshift_r(lo, hi, 8 * shift);
      lo = hi;
    } else {
      w[k] = 0;
    }
  }
}

// Code j (`bits` <= 8 bits, LSB-first as bitpack.h packs) of the bit stream
// that starts at byte `offset` of the token's codes.
__device__ __forceinline__ uint32_t PackedCodeIn(const TokenCodes<const uint8_t>& c, int offset, int j, int bits) {
  const int bit = j * bits;
  const uint64_t w = LoadCodeBytes<2>(c, offset + (bit >> 3));
  return static_cast<uint32_t>(w >> (bit & 7)) & ((1u << bits) - 1u);
}

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_TOKEN_CODES_CUH_
