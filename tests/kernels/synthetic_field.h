// Synthetic page fields for the fused attention kernels' tests: random valid
// bytes of one format, and what they stand for, in float64.
#ifndef TQKV_TESTS_KERNELS_SYNTHETIC_FIELD_H_
#define TQKV_TESTS_KERNELS_SYNTHETIC_FIELD_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/bitpack.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/float_formats.h"
#include "base/random.h"

namespace tqkv {

// One field of synthetic pages: its format and what its bytes mean.
struct SyntheticField {
  FormatFamily format;
  int bits;
  std::vector<float> centroids;  // kTurboQuant (the hot part when split): 2^bits
  int cold_bits = 0;             // two-part kTurboQuant: the cold part, on the last d - d/2 coordinates
  std::vector<float> cold_centroids;

  // Random codebooks for TurboQuant (two parts with cold_bits > 0).
  static SyntheticField Make(FormatFamily format, int bits, int cold_bits, Random& rng) {
    SyntheticField f{format, bits, {}, cold_bits, {}};
    if (format == FormatFamily::kTurboQuant) {
      for (int i = 0; i < (1 << bits); ++i) f.centroids.push_back(static_cast<float>(rng.NextGaussian()));
      for (int i = 0; i < (cold_bits > 0 ? 1 << cold_bits : 0); ++i) {
        f.cold_centroids.push_back(static_cast<float>(rng.NextGaussian()));
      }
    }
    return f;
  }

  bool split() const { return format == FormatFamily::kTurboQuant && cold_bits > 0; }
  // Packed codes planes are tiled (kernels/code_tiles.h), as KvLayout lays
  // them out.
  bool tiled() const { return format == FormatFamily::kTurboQuant || format == FormatFamily::kUniform; }
  // How the kernels read it at head dim d; plane offsets left at 0.
  cpu_internal::FieldReader Reader(int d) const {
    cpu_internal::FieldReader f;
    f.readable = true;
    f.format = format;
    f.bits = bits;
    f.centroids = centroids.data();
    f.code_bytes = CodeBytes(d);
    f.num_scalars = NumScalars();
    f.tiled = tiled();
    if (split()) {
      f.parts = 2;
      f.hot_dims = d / 2;
      f.cold_bits = cold_bits;
      f.cold_centroids = cold_centroids.data();
      f.cold_code_offset = PackedBytes(d / 2, bits);
    }
    return f;
  }
  int CodeBytes(int d) const {
    if (split()) return PackedBytes(d / 2, bits) + PackedBytes(d - d / 2, cold_bits);
    return bits == 16 ? 2 * d : bits == 8 ? d : PackedBytes(d, bits);
  }
  int NumScalars() const {
    return format == FormatFamily::kUniform || split() ? 2 : format == FormatFamily::kTurboQuant ? 1 : 0;
  }
  // Random valid bytes for one token.
  void Fill(Random& rng, int d, uint8_t* codes, uint16_t* scalars) const {
    if (bits == 16) {
      for (int j = 0; j < d; ++j) {
        const float x = static_cast<float>(rng.NextGaussian());
        const uint16_t h = format == FormatFamily::kFp16 ? FloatToHalf(x) : FloatToBf16(x);
        memcpy(codes + 2 * j, &h, 2);
      }
      return;
    }
    if (format == FormatFamily::kFp8) {  // |x| < 4, subnormals included
      for (int j = 0; j < d; ++j) codes[j] = static_cast<uint8_t>(rng.NextBelow(0x48) | (rng.NextBelow(2) << 7));
      return;
    }
    std::vector<uint8_t> raw(d);
    if (split()) {
      const int hot = d / 2;
      for (int j = 0; j < d; ++j) raw[j] = static_cast<uint8_t>(rng.NextBelow(1u << (j < hot ? bits : cold_bits)));
      PackBits(raw.data(), hot, bits, codes);
      PackBits(raw.data() + hot, d - hot, cold_bits, codes + PackedBytes(hot, bits));
      scalars[0] = FloatToHalf(static_cast<float>(0.5 + rng.NextDouble()));
      scalars[1] = FloatToHalf(static_cast<float>(0.5 + rng.NextDouble()));
      return;
    }
    for (int j = 0; j < d; ++j) raw[j] = static_cast<uint8_t>(rng.NextBelow(1u << bits));
    PackBits(raw.data(), d, bits, codes);
    if (format == FormatFamily::kTurboQuant) {
      scalars[0] = FloatToHalf(static_cast<float>(0.5 + rng.NextDouble()));
    } else {
      scalars[0] = FloatToHalf(static_cast<float>((0.5 + rng.NextDouble()) / (1 << bits)));
      scalars[1] = FloatToHalf(static_cast<float>(rng.NextDouble() - 0.5));
    }
  }
  // What the bytes stand for (coordinate j of a d-dim vector).
  double Decode(const uint8_t* codes, const uint16_t* scalars, int j, int d) const {
    if (split()) {
      const int hot = d / 2;
      if (j < hot) return static_cast<double>(HalfToFloat(scalars[0])) * centroids[PackedCodeAt(codes, j, bits)];
      return static_cast<double>(HalfToFloat(scalars[1])) *
             cold_centroids[PackedCodeAt(codes + PackedBytes(hot, bits), j - hot, cold_bits)];
    }
    switch (format) {
      case FormatFamily::kFp16: {
        uint16_t h;
        memcpy(&h, codes + 2 * j, 2);
        return HalfToFloat(h);
      }
      case FormatFamily::kBf16: {
        uint16_t h;
        memcpy(&h, codes + 2 * j, 2);
        return Bf16ToFloat(h);
      }
      case FormatFamily::kFp8:
        return Fp8E4m3ToFloat(codes[j]);
      case FormatFamily::kTurboQuant:
        return static_cast<double>(HalfToFloat(scalars[0])) * centroids[PackedCodeAt(codes, j, bits)];
      default:
        return static_cast<double>(HalfToFloat(scalars[0])) * PackedCodeAt(codes, j, bits) + HalfToFloat(scalars[1]);
    }
  }
};

}  // namespace tqkv

#endif  // TQKV_TESTS_KERNELS_SYNTHETIC_FIELD_H_
