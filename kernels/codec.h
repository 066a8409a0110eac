// Codecs: how one head vector (one token, one KV head, one layer; head_dim
// floats) becomes bytes, and how attention reads those bytes back.
//
// Every codec writes two fields per vector:
//   codes    code_bytes() bytes: packed indices (bitpack.h) or raw fp16/fp8
//   scalars  num_scalars() fp16 values: norms, scales, zero points
// so bytes_per_vector() = code_bytes() + 2 * num_scalars(). The page layout
// (docs/format.md) stores each field in its own plane; this interface takes the
// two field pointers separately for that reason.
//
// The read side mirrors what the attention kernels do and never needs the
// decoded vector:
//   keys    PrepareQuery once per query (rotates it for TurboQuant codecs),
//           then Score per key = <q, decoded key> straight from the codes;
//   values  Accumulate weight * decoded value into an accumulator in the
//           codec's own basis (rotated for TurboQuant), then
//           FinishAccumulation maps the sum back once.
// Decode exists for tests, tools and the round-trip CLI.
//
// Codecs are immutable after creation and safe to share between threads.
#ifndef TQKV_KERNELS_CODEC_H_
#define TQKV_KERNELS_CODEC_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codebook.h"
#include "kernels/rotation.h"

namespace tqkv {

// Head dims a codec accepts. Models use 32..512; smaller ones are allowed for
// the parts of split codecs and for tests.
inline constexpr int kMinHeadDim = 4;
inline constexpr int kMaxHeadDim = 512;

enum class CodecKind {
  kFp16,          // IEEE half per coordinate; no side scalars.
  kBf16,          // bfloat16 per coordinate; no side scalars. The uncompressed
                  // baseline that speed is measured against.
  kFp8,           // fp8 E4M3 per coordinate, saturating at +-448; no scale.
  kTurboQuant,    // TurboQuant-MSE: rotation + Lloyd-Max codebook, fp16 norm.
  kUniform,       // per-vector min-max uniform, fp16 scale and zero point.
  kQjl,           // (bits-1)-bit TurboQuant-MSE + 1-bit QJL sign sketch of the
                  // residual + fp16 residual norm. Unbiased inner products;
                  // noisier inside softmax. For evaluation.
  kOutlierSplit,  // Fractional bits: the hot channels and the rest are two
                  // TurboQuant-MSE parts, each with its own rotation and norm.
};

// What a codec is, independent of head dim and seed. Build with the factories.
struct CodecSpec {
  CodecKind kind = CodecKind::kFp16;
  // kTurboQuant, kUniform: bits per coordinate. kQjl: total bits per coordinate
  // (bits-1 for the MSE part, 1 for the sign). kOutlierSplit: bits of the cold
  // (ordinary) channels. 16 for fp16, 8 for fp8.
  int bits = 16;
  // kTurboQuant, kOutlierSplit: norm correction ("_nc"): the stored scale is
  // norm / ||codeword||, which rescales the decoded codeword to unit length
  // before multiplying by the norm. Folded into the stored fp16 scalar at
  // encode time, so reading it costs nothing.
  bool norm_correction = false;
  // kOutlierSplit: bits of the hot channels, and their count as a fraction of
  // head_dim: hot = head_dim / hot_divisor.
  int hot_bits = 0;
  int hot_divisor = 0;

  static CodecSpec Fp16() { return {CodecKind::kFp16, 16, false, 0, 0}; }
  static CodecSpec Bf16() { return {CodecKind::kBf16, 16, false, 0, 0}; }
  static CodecSpec Fp8() { return {CodecKind::kFp8, 8, false, 0, 0}; }
  static CodecSpec TurboQuant(int bits, bool norm_correction) {
    return {CodecKind::kTurboQuant, bits, norm_correction, 0, 0};
  }
  static CodecSpec Uniform(int bits) { return {CodecKind::kUniform, bits, false, 0, 0}; }
  static CodecSpec Qjl(int bits) { return {CodecKind::kQjl, bits, false, 0, 0}; }
  static CodecSpec OutlierSplit(int hot_bits, int cold_bits, int hot_divisor, bool norm_correction) {
    return {CodecKind::kOutlierSplit, cold_bits, norm_correction, hot_bits, hot_divisor};
  }

  // Short name, e.g. "fp16", "fp8", "tq3_nc", "uniform4", "qjl3", "tq4/3_split2_nc"
  // (hot channels at 4 bits, the rest at 3, head_dim / 2 hot channels).
  std::string Name() const;
  // Checks the fields (bits ranges, divisor) without a head dim.
  absl::Status Validate() const;
  // Hot channel count for a head dim (kOutlierSplit only; 0 otherwise).
  int HotChannels(int head_dim) const;
  // Whether creating the codec needs calibration (the hot channel list).
  bool NeedsCalibration() const { return kind == CodecKind::kOutlierSplit; }
};

// Per-instance parameters of a codec.
struct CodecOptions {
  int head_dim = 128;
  // Seeds the rotations (and the QJL sketch). Part of the stored format: the
  // same seed must be used to read what was written.
  uint64_t seed = 0;
  // kOutlierSplit only: the hot channels, spec.HotChannels(head_dim) distinct
  // indices in [0, head_dim). Usually from ChooseHotChannels on calibration keys.
  std::vector<int> hot_channels;
};

// A TurboQuant-MSE part of a codec, for kernels that score packed codes
// directly: channels [channels...] of the vector were normalised (norm in
// scalar `scalar_index`), rotated by `rotation` and quantized with `codebook`;
// their dim-many `codebook->bits`-bit codes start at byte `code_offset`.
struct TurboQuantPart {
  std::vector<int> channels;  // ascending; all of 0..head_dim-1 for a single part
  int code_offset = 0;
  int scalar_index = 0;
  const Codebook* codebook = nullptr;
  std::shared_ptr<const Rotation> rotation;
};

class VectorCodec {
 public:
  virtual ~VectorCodec() = default;

  const CodecSpec& spec() const { return spec_; }
  int head_dim() const { return head_dim_; }
  int code_bytes() const { return code_bytes_; }
  int num_scalars() const { return num_scalars_; }
  int bytes_per_vector() const { return code_bytes_ + 2 * num_scalars_; }

  // Encodes x[head_dim]. Writes code_bytes() bytes to `codes` and num_scalars()
  // fp16 values to `scalars`. A zero vector encodes to something that decodes
  // to exactly zero.
  // Fails with INVALID_ARGUMENT, writing nothing useful, if x has a NaN or
  // infinity, or a norm / range that the fp16 side values cannot hold.
  virtual absl::Status Encode(const float* x, uint8_t* codes, uint16_t* scalars) const = 0;

  // Encode of n vectors: x[k] into codes[k] and scalars[k], the same bytes as
  // n Encode calls (a codec may work on several vectors at once). On failure returns the error of the first failing
  // vector and sets *failed to its index; what any vector's bytes are then is unspecified.
  virtual absl::Status EncodeMany(int n, const float* const* x, uint8_t* const* codes, uint16_t* const* scalars,
                                  int* failed) const;

  // Writes what attention sees for this vector (norm correction applied) to
  // x[head_dim].
  virtual void Decode(const uint8_t* codes, const uint16_t* scalars, float* x) const = 0;

  // Query-side state for Score: query_state_floats() floats.
  int query_state_floats() const { return query_state_floats_; }
  virtual void PrepareQuery(const float* q, float* state) const = 0;
  // <q, Decode(codes, scalars)>, computed from the codes (rotated domain for
  // TurboQuant codecs) without reconstructing the vector.
  virtual float Score(const float* state, const uint8_t* codes, const uint16_t* scalars) const = 0;

  // Value side. The accumulator has accumulator_floats() floats, zeroed by the
  // caller. Accumulate adds weight * Decode(codes, scalars) in the codec's own
  // basis; FinishAccumulation writes the sum in the original basis to
  // out[head_dim]. acc and out may not alias.
  int accumulator_floats() const { return accumulator_floats_; }
  virtual void Accumulate(float weight, const uint8_t* codes, const uint16_t* scalars, float* acc) const = 0;
  virtual void FinishAccumulation(const float* acc, float* out) const = 0;

  // The TurboQuant-MSE parts (empty for codecs without one).
  const std::vector<TurboQuantPart>& turboquant_parts() const { return parts_; }

 protected:
  VectorCodec(const CodecSpec& spec, int head_dim) : spec_(spec), head_dim_(head_dim) {}

  CodecSpec spec_;
  int head_dim_;
  int code_bytes_ = 0;
  int num_scalars_ = 0;
  int query_state_floats_ = 0;
  int accumulator_floats_ = 0;
  std::vector<TurboQuantPart> parts_;
};

// Creates a codec. Fails with INVALID_ARGUMENT for an invalid spec, a head dim
// outside [kMinHeadDim, kMaxHeadDim], or a missing / malformed hot channel list.
absl::StatusOr<std::unique_ptr<VectorCodec>> MakeCodec(const CodecSpec& spec, const CodecOptions& options);

// Bytes per vector of a spec at a head dim, without building the codec.
// REQUIRES: spec.Validate().ok().
int CodecBytesPerVector(const CodecSpec& spec, int head_dim);

// The `count` channels with the largest mean |k| over n calibration keys
// (row-major [n, head_dim]), ascending. Ties go to the lower channel index.
// REQUIRES: 0 <= count <= head_dim.
std::vector<int> ChooseHotChannels(const float* keys, int64_t n, int head_dim, int count);

}  // namespace tqkv

#endif  // TQKV_KERNELS_CODEC_H_
