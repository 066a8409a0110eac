// The stored format as the CUDA kernels see it: plain structs of device
// pointers and byte offsets, one DeviceHead per (layer, KV head), built once
// per page pool from the KvLayout's codecs (cuda_backend.cc) and copied to the
// device. Shared by the host code (g++) and the kernels (nvcc); no CUDA or
// abseil types, so both compilers read the same definitions.
//
// Every field here mirrors something the CPU codecs define (codec.h,
// rotation.h, kv_layout.h); the kernels reproduce the CPU's float operations
// in the same order so that the store kernel writes the same bytes.
#ifndef TQKV_KERNELS_CUDA_DEVICE_FORMAT_H_
#define TQKV_KERNELS_CUDA_DEVICE_FORMAT_H_

#include <cstdint>

#include "kernels/format_table.h"

namespace tqkv {
namespace cuda {

// The largest head dim the CUDA kernels take (every model in use has
// 64..256); larger layouts are refused when the pool is created.
inline constexpr int kMaxDeviceHeadDim = 256;

// How a field is stored: the shared format table's families
// (kernels/format_table.h: kFp16, kBf16, kFp8, kUniform, kTurboQuant), so
// that both backends and their dispatches name the same formats.
using DeviceFieldFormat = ::tqkv::FormatFamily;

enum class DeviceRotationKind : int32_t {
  kHadamard = 0,  // y = H_n D x / sqrt(n), n a power of two
  kKron = 1,      // y = (H_a kron P_m) D x / sqrt(n), m in {12, 20, 28}
  kDense = 2,     // y = M x, M a dense orthogonal matrix
};

// A Rotation (rotation.h) on the device.
struct DeviceRotation {
  DeviceRotationKind kind = DeviceRotationKind::kHadamard;
  int32_t dim = 0;
  int32_t factor_order = 0;         // kKron: m
  int32_t factor_rows = 0;          // kKron: a = dim / m
  float scale = 0.0f;               // Hadamard kinds: float(1 / sqrt(dim))
  const float* signs = nullptr;     // Hadamard kinds: D, dim entries of +-1
  const float* factor = nullptr;    // kKron: P_m row-major (columns of the inverse)
  const float* factor_t = nullptr;  // kKron: P_m^T row-major (columns of the forward)
  const float* matrix = nullptr;    // kDense: M row-major dim x dim
};

// One TurboQuant-MSE part of a field: channels[] of the vector (all of them,
// in order, for a single part), normalised, rotated, quantized with one
// codebook; its codes start at byte code_offset of the field's codes, its
// scale is scalar number scalar_index. In the query state and in the value
// accumulator the part's coordinates sit at [state_offset, state_offset + dim).
struct DevicePart {
  int32_t dim = 0;
  int32_t bits = 0;
  int32_t code_offset = 0;
  int32_t scalar_index = 0;
  int32_t state_offset = 0;
  int32_t norm_correction = 0;
  const float* centroids = nullptr;   // 2^bits, ascending
  const float* boundaries = nullptr;  // 2^bits - 1, ascending
  const int32_t* channels = nullptr;  // dim channel indices; null: 0..dim-1
  DeviceRotation rotation;
};

inline constexpr int kMaxDeviceParts = 2;

// How one field (keys or values) of one (layer, KV head) is stored and read.
struct DeviceField {
  DeviceFieldFormat format = DeviceFieldFormat::kFp16;
  int32_t bits = 16;       // kUniform: code bits; 16 / 8 for the raw formats
  int32_t code_bytes = 0;  // per token
  // Non-zero: the codes plane is tiled (kernels/code_tiles.h; packed codecs,
  // TiledCodes), else token-major (raw fp16 / bf16 / fp8).
  int32_t tiled = 0;
  int32_t num_scalars = 0;    // fp16 scalars per token
  int32_t num_parts = 0;      // kTurboQuant: 1 or 2
  uint64_t codes_offset = 0;  // plane offsets from the start of a page
  uint64_t scalars_offset = 0;
  // kTurboQuant keys: the fp16 tensor-core kernel's pair tables hold part
  // p's centroids times pair_scale[p] and its query fragments the state
  // over it (PairTableScale in device_tables.h: the centroids' fp16
  // rounding at its smallest). Here, not in DevicePart: it takes what was
  // padding, and the struct keeps its size (256 bytes).
  float pair_scale[kMaxDeviceParts] = {1.0f, 1.0f};
  DevicePart parts[kMaxDeviceParts];
};
static_assert(sizeof(DeviceField) == 256, "the kernels' budget rules name DeviceHead offsets (gpu_budget)");

struct DeviceHead {
  DeviceField key;
  DeviceField value;
};

// Store-kernel failure, reported through a device word: the first failing
// vector wins. Mirrors the CPU codecs' INVALID_ARGUMENT cases.
enum class StoreError : int32_t {
  kNone = 0,
  kNotFinite = 1,     // a NaN or infinite coordinate
  kOutOfRange = 2,    // beyond what fp16 (codes or side scalars) can hold
  kNormTooLarge = 3,  // the stored fp16 norm would overflow
};

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_DEVICE_FORMAT_H_
