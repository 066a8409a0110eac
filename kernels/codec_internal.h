// What kernels/codec.cc and the codecs in their own files share: the
// finiteness and range checks every Encode makes, and the factories of the
// codecs whose codes are plain numbers (float_codecs.cc: fp16, bf16, fp8,
// uniform min-max). MakeCodec (codec.h) is the only caller of the factories.
#ifndef TQKV_KERNELS_CODEC_INTERNAL_H_
#define TQKV_KERNELS_CODEC_INTERNAL_H_

#include <memory>

#include "absl/status/status.h"
#include "kernels/codec.h"
#include "kernels/simd/encode_kernels.h"

namespace tqkv {
namespace codec_internal {

// OK if every coordinate of x[0, n) is finite, else NonFiniteError. `simd`:
// the store kernels to use, or nullptr.
absl::Status CheckAllFinite(const float* x, int n, const encode_internal::EncodeKernels* simd);

// INVALID_ARGUMENT naming the first coordinate of x[0, n) that is NaN or
// infinite.
absl::Status NonFiniteError(const float* x, int n);

// OK if every coordinate is finite and |x| <= limit; INVALID_ARGUMENT naming
// the first that is not (`format` names the stored format in the message).
absl::Status CheckFiniteAndInRange(const float* x, int n, float limit, const char* format,
                                   const encode_internal::EncodeKernels* simd = nullptr);

// 16-bit floats (fp16, or bf16 when `brain`), fp8 e4m3 and uniform min-max
// codecs for `spec` (validated by the caller) at `head_dim`.
std::unique_ptr<VectorCodec> MakeFloat16Codec(const CodecSpec& spec, int head_dim, bool brain);
std::unique_ptr<VectorCodec> MakeFp8Codec(const CodecSpec& spec, int head_dim);
std::unique_ptr<VectorCodec> MakeUniformCodec(const CodecSpec& spec, int head_dim);

}  // namespace codec_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CODEC_INTERNAL_H_
