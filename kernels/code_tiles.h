// Where a token's codes sit inside a page's codes plane (docs/format.md,
// "Pages"), shared verbatim by the CPU backend and the CUDA kernels.
//
// A plane of raw numbers (fp16, bf16, fp8 codecs) is token-major: token slot
// s has its codes at s * code_bytes. A plane of packed codes (TurboQuant,
// its outlier split, uniform, QJL) is tiled: the page's slots fall into tiles
// of kTileTokens (the last tile of a page holds what is left, page_tokens mod
// kTileTokens tokens when that is not 0), and inside a tile of n tokens the
// codes are cut into 4-byte words, word-major: word w of the tile's token i
// sits at w * 4 n + 4 i, and the bytes past the last whole word (code_bytes
// mod 4 of them) follow all the words, token-major. A tile takes n *
// code_bytes bytes, the plane page_tokens * code_bytes, as token-major.
//
// Why: the fused kernels score 16 tokens at once with each token in its own
// 32-bit lane (kernels/cpu/attend_avx512_vnni.cc: one vpdpbusd adds four
// coordinates of 16 tokens), so a load of one word of 16 tokens is a vector
// that needs no transposing and its dot products no horizontal reduction.
#ifndef TQKV_KERNELS_CODE_TILES_H_
#define TQKV_KERNELS_CODE_TILES_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace tqkv {

inline constexpr int kTileTokens = 16;
inline constexpr int kTileWordBytes = 4;

// How one codes plane of a page is laid out.
struct CodePlane {
  int page_tokens = 0;
  int code_bytes = 0;  // per token
  bool tiled = false;

  // Tokens in the tile that holds `slot`.
  TQKV_HOST_DEVICE int TileSize(int slot) const {
    const int first = slot - slot % kTileTokens;
    return page_tokens - first < kTileTokens ? page_tokens - first : kTileTokens;
  }

  // Bytes from the plane's start to byte `byte` of the codes of the token in
  // `slot`. REQUIRES: 0 <= slot < page_tokens, 0 <= byte < code_bytes.
  TQKV_HOST_DEVICE size_t Offset(int slot, int byte) const {
    if (!tiled) return static_cast<size_t>(slot) * code_bytes + byte;
    const int i = slot % kTileTokens;
    const int n = TileSize(slot);
    const size_t tile = static_cast<size_t>(slot - i) * code_bytes;
    const int whole = code_bytes - code_bytes % kTileWordBytes;
    if (byte < whole) {
      return tile + static_cast<size_t>(byte - byte % kTileWordBytes) * n + kTileWordBytes * i + byte % kTileWordBytes;
    }
    return tile + static_cast<size_t>(whole) * n + static_cast<size_t>(code_bytes - whole) * i + (byte - whole);
  }

  // Bytes from one word of a tile's token to the same word of the next
  // token: kTileWordBytes when tiled (code_bytes when not).
  TQKV_HOST_DEVICE int TokenStride() const { return tiled ? kTileWordBytes : code_bytes; }
};

// Copies the codes of the token in `slot` out of a page's codes plane.
inline void GatherCodes(const uint8_t* plane, const CodePlane& layout, int slot, uint8_t* codes) {
  if (!layout.tiled) {
    memcpy(codes, plane + static_cast<size_t>(slot) * layout.code_bytes, layout.code_bytes);
    return;
  }
  const int n = layout.TileSize(slot), i = slot % kTileTokens;
  const uint8_t* tile = plane + static_cast<size_t>(slot - i) * layout.code_bytes;
  const int words = layout.code_bytes / kTileWordBytes, tail = layout.code_bytes % kTileWordBytes;
  for (int w = 0; w < words; ++w) {
    memcpy(codes + kTileWordBytes * w, tile + (static_cast<size_t>(w) * n + i) * kTileWordBytes, kTileWordBytes);
  }
  const uint8_t* rest = tile + static_cast<size_t>(words) * kTileWordBytes * n + static_cast<size_t>(tail) * i;
  for (int k = 0; k < tail; ++k) codes[kTileWordBytes * words + k] = rest[k];
}

// Writes the codes of the token in `slot` into a page's codes plane.
inline void ScatterCodes(const uint8_t* codes, const CodePlane& layout, int slot, uint8_t* plane) {
  if (!layout.tiled) {
    memcpy(plane + static_cast<size_t>(slot) * layout.code_bytes, codes, layout.code_bytes);
    return;
  }
  const int n = layout.TileSize(slot), i = slot % kTileTokens;
  uint8_t* tile = plane + static_cast<size_t>(slot - i) * layout.code_bytes;
  const int words = layout.code_bytes / kTileWordBytes, tail = layout.code_bytes % kTileWordBytes;
  for (int w = 0; w < words; ++w) {
    memcpy(tile + (static_cast<size_t>(w) * n + i) * kTileWordBytes, codes + kTileWordBytes * w, kTileWordBytes);
  }
  uint8_t* rest = tile + static_cast<size_t>(words) * kTileWordBytes * n + static_cast<size_t>(tail) * i;
  for (int k = 0; k < tail; ++k) rest[k] = codes[kTileWordBytes * words + k];
}

}  // namespace tqkv

#endif  // TQKV_KERNELS_CODE_TILES_H_
