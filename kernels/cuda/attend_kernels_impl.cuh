// Kernel bodies and launchers of kernels/cuda/attend_kernels.cuh, written once for two compilers:
// nvcc (the .cu file of the same name includes this) and the host emulation
// of tests/gpu (kernels/cuda/emulation/), which runs the same source on CPU
// fibers. Device features come from device_compat.cuh only. The kernels
// live in attend_common_impl.cuh (what they all read tokens with, and the
// merge they end with), attend_simt_impl.cuh (fp32 decode, score),
// attend_mma_impl.cuh (TF32 tensor cores) and attend_hmma_impl.cuh (fp16
// tensor cores); this file picks an instance and launches it.
#ifndef TQKV_KERNELS_CUDA_ATTEND_KERNELS_IMPL_CUH_
#define TQKV_KERNELS_CUDA_ATTEND_KERNELS_IMPL_CUH_

#include <mutex>
#include <set>
#include <tuple>

#include "kernels/cuda/attend_simt_impl.cuh"
#include "kernels/cuda/attend_hmma_impl.cuh"
#include "kernels/cuda/attend_mma_impl.cuh"

namespace tqkv {
namespace cuda {
namespace {

using AttendKernelFunction = void (*)(AttendKernelParams);

// The tensor-core kernel's instance for a head dim; null for other dims.
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
AttendKernelFunction AttendMmaKernelFor(int head_dim) {
  switch (head_dim) {
    case 64:
      return AttendMmaKernel<kKey, kValue, 64>;
    case 128:
      return AttendMmaKernel<kKey, kValue, 128>;
    case 256:
      return AttendMmaKernel<kKey, kValue, 256>;
    default:
      return nullptr;
  }
}

// The fp16 tensor-core kernel's instances: which pairs have one, and the
// instance for a head dim and an AttendHmmaShape code (key bits * 32 + value
// bits); null where there is none.
constexpr bool HasHmma(DeviceFieldFormat key, DeviceFieldFormat value) {
  using F = DeviceFieldFormat;
  return (key == F::kFp16 && value == F::kFp16) || (key == F::kBf16 && value == F::kBf16) ||
         (key == F::kFp8 && (value == F::kFp8 || value == F::kUniform)) ||
         (key == F::kTurboQuant && (value == F::kUniform || value == F::kTurboQuant));
}

// The code widths with an instance: TurboQuant values only at the
// presets' widths, 3-4 bits with single-part keys of 3-4 bits, 3 bits with
// split keys of 4 | 3 and 3 | 2 bits (SplitKeyBits); any other
// pair at all (AttendHmmaShape checks the ranges).
constexpr bool HasHmmaBits(DeviceFieldFormat key, DeviceFieldFormat value, int key_bits, int value_bits) {
  if (KeyParts(key, key_bits) == 2) {
    return value == DeviceFieldFormat::kTurboQuant && value_bits == 3 &&
           (key_bits == SplitKeyBits(4, 3) || key_bits == SplitKeyBits(3, 2));
  }
  return value != DeviceFieldFormat::kTurboQuant || (key_bits >= 3 && value_bits >= 3);
}

template <DeviceFieldFormat kFormat>
constexpr int RawBits() {
  return kFormat == DeviceFieldFormat::kFp8 ? 8 : 16;
}

// The loop variant a launch takes (AttendHmmaKernel's kLoop): the one-tile
// loops where pages hold one tile, no cap applies and the mma add-back
// covers every head's pairs.
int HmmaLoopFor(const AttendKernelParams& p) {
  if (p.view.page_tokens != kHmmaTile || p.softcap > 0.0f || p.addback.max_pairs > kAddBackMmaPairs) {
    return kHmmaGeneral;
  }
  return p.addback.heads == nullptr || p.addback.max_pairs == 0 ? kHmmaOneTilePlain : kHmmaOneTileAddBack;
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, int kDim, int kKeyBits, int kValueBits>
AttendKernelFunction AttendHmmaLoop(int loop) {
  switch (loop) {
    case kHmmaOneTilePlain:
      return AttendHmmaKernel<kKey, kValue, kDim, kKeyBits, kValueBits, kHmmaOneTilePlain>;
    case kHmmaOneTileAddBack:
      return AttendHmmaKernel<kKey, kValue, kDim, kKeyBits, kValueBits, kHmmaOneTileAddBack>;
    default:
      return AttendHmmaKernel<kKey, kValue, kDim, kKeyBits, kValueBits, kHmmaGeneral>;
  }
}

// An instance, or null where HasHmmaBits says there is none.
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, int kDim, int kKeyBits, int kValueBits>
AttendKernelFunction AttendHmmaBits(int loop) {
  if constexpr (HasHmmaBits(kKey, kValue, kKeyBits, kValueBits)) {
    return AttendHmmaLoop<kKey, kValue, kDim, kKeyBits, kValueBits>(loop);
  } else {
    return nullptr;
  }
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, int kDim, int kKeyBits>
AttendKernelFunction AttendHmmaValueBits(int value_bits, int loop) {
  if constexpr (kValue == DeviceFieldFormat::kUniform || kValue == DeviceFieldFormat::kTurboQuant) {
    switch (value_bits) {
      case 2:
        return AttendHmmaBits<kKey, kValue, kDim, kKeyBits, 2>(loop);
      case 3:
        return AttendHmmaBits<kKey, kValue, kDim, kKeyBits, 3>(loop);
      case 4:
        return AttendHmmaBits<kKey, kValue, kDim, kKeyBits, 4>(loop);
      default:
        return nullptr;
    }
  } else {
    return value_bits == RawBits<kValue>() ? AttendHmmaLoop<kKey, kValue, kDim, kKeyBits, RawBits<kValue>()>(loop)
                                           : nullptr;
  }
}

// `shape`: an AttendHmmaShape code plus the loop variant times kHmmaLoopUnit.
constexpr int kHmmaLoopUnit = 4096;

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, int kDim>
AttendKernelFunction AttendHmmaKeyBits(int shape) {
  const int loop = shape / kHmmaLoopUnit, key_bits = (shape % kHmmaLoopUnit) >> 5, value_bits = shape & 31;
  if constexpr (kKey == DeviceFieldFormat::kTurboQuant) {
    switch (key_bits) {
      case 2:
        return AttendHmmaValueBits<kKey, kValue, kDim, 2>(value_bits, loop);
      case 3:
        return AttendHmmaValueBits<kKey, kValue, kDim, 3>(value_bits, loop);
      case 4:
        return AttendHmmaValueBits<kKey, kValue, kDim, 4>(value_bits, loop);
      case SplitKeyBits(3, 2):
        return AttendHmmaValueBits<kKey, kValue, kDim, SplitKeyBits(3, 2)>(value_bits, loop);
      case SplitKeyBits(4, 3):
        return AttendHmmaValueBits<kKey, kValue, kDim, SplitKeyBits(4, 3)>(value_bits, loop);
      default:
        return nullptr;
    }
  } else {
    return key_bits == RawBits<kKey>() ? AttendHmmaValueBits<kKey, kValue, kDim, RawBits<kKey>()>(value_bits, loop)
                                       : nullptr;
  }
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
AttendKernelFunction AttendHmmaKernelFor(int head_dim, int shape) {
  if constexpr (!HasHmma(kKey, kValue)) {
    return nullptr;
  } else {
    switch (head_dim) {
      case 64:
        return AttendHmmaKeyBits<kKey, kValue, 64>(shape);
      case 128:
        return AttendHmmaKeyBits<kKey, kValue, 128>(shape);
      case 256:
        return AttendHmmaKeyBits<kKey, kValue, 256>(shape);
      default:
        return nullptr;
    }
  }
}

// Whether the TF32 kernel reads the pair (raw fields of 16 bits or codes).
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
constexpr bool HasTf32Mma() {
  return kKey != DeviceFieldFormat::kFp8 && kValue != DeviceFieldFormat::kFp8;
}

// The tensor-core kernel that reads a launch's blocks: the fp16 one for a
// shape code >= 0, else the TF32 one; null where the pair has none.
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
AttendKernelFunction AttendTensorKernelFor(int head_dim, int shape) {
  if (shape >= 0) return AttendHmmaKernelFor<kKey, kValue>(head_dim, shape);
  if constexpr (HasTf32Mma<kKey, kValue>()) {
    return AttendMmaKernelFor<kKey, kValue>(head_dim);
  } else {
    return nullptr;
  }
}

static_assert(kMmaWarps == kHmmaWarps, "both tensor-core kernels run one AttendBlock per warp, four a block");

// Opts `kernel` in to `bytes` of dynamic shared memory on the current
// device: cudaFuncSetAttribute once per (device, kernel, bytes), not per
// launch (the attribute lasts as long as the device's context, which the
// backend never resets).
cudaError_t OptInDynamicShared(const void* kernel, int bytes) {
  int device = 0;
  const cudaError_t current = cudaGetDevice(&device);
  if (current != cudaSuccess) return current;
  static std::mutex mu;
  static auto* done = new std::set<std::tuple<int, const void*, int>>();
  const std::tuple<int, const void*, int> key(device, kernel, bytes);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (done->count(key) != 0) return cudaSuccess;
  }
  const cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (error == cudaSuccess) {
    std::lock_guard<std::mutex> lock(mu);
    done->insert(key);
  }
  return error;
}

// The dynamic shared memory of a tensor-core instance (shape as for
// LaunchAttendMma): the fp16 kernel's pair tables where a warp has more
// than one (HmmaTablesBytes), after opting the kernel in to more than 48
// KiB; else none.
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
cudaError_t HmmaDynamicShared(AttendKernelFunction kernel, int shape, size_t* shared) {
  *shared = 0;
  if (shape < 0) return cudaSuccess;
  *shared = HmmaTablesBytes(HmmaTables(kKey, kValue, (shape % kHmmaLoopUnit) >> 5));
  if (*shared == 0) return cudaSuccess;
  return OptInDynamicShared(reinterpret_cast<const void*>(kernel), static_cast<int>(*shared));
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
cudaError_t LaunchAttendMmaDims(int shape, const AttendKernelParams& params, cudaStream_t stream) {
  const int variant = shape >= 0 ? shape + HmmaLoopFor(params) * kHmmaLoopUnit : shape;
  const AttendKernelFunction kernel = AttendTensorKernelFor<kKey, kValue>(params.view.head_dim, variant);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  size_t shared = 0;
  const cudaError_t opt_in = HmmaDynamicShared<kKey, kValue>(kernel, shape, &shared);
  if (opt_in != cudaSuccess) return opt_in;
  const dim3 grid(static_cast<unsigned>((params.num_blocks + kMmaWarps - 1) / kMmaWarps));
  TQKV_LAUNCH(kernel, grid, kMmaWarps * 32, shared, stream, params);
  return cudaGetLastError();
}

// The fp32 kernel's instance for a block row count; null for other counts.
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
AttendKernelFunction AttendKernelFor(int block_rows) {
  switch (block_rows) {
    case 1:
      return AttendKernel<kKey, kValue, 1>;
    case 2:
      return AttendKernel<kKey, kValue, 2>;
    case 4:
      return AttendKernel<kKey, kValue, 4>;
    case 8:
      return AttendKernel<kKey, kValue, 8>;
    default:
      return nullptr;
  }
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
cudaError_t LaunchAttendRows(int block_rows, const AttendKernelParams& params, cudaStream_t stream) {
  const size_t shared = AttendSharedBytes(block_rows, params.view.head_dim);
  const dim3 grid(static_cast<unsigned>(params.num_blocks));
  const AttendKernelFunction kernel = AttendKernelFor<kKey, kValue>(block_rows);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  TQKV_LAUNCH(kernel, grid, kAttendThreads, shared, stream, params);
  return cudaGetLastError();
}

template <DeviceFieldFormat kKey>
cudaError_t LaunchScoreRows(int block_rows, const ScoreKernelParams& params, cudaStream_t stream) {
  const int group = params.view.num_query_heads / params.view.num_kv_heads;
  const int chunks = (group + block_rows - 1) / block_rows;
  const int tokens = params.token_end - params.token_begin;
  const dim3 grid(static_cast<unsigned>((tokens + kAttendTile - 1) / kAttendTile),
                  static_cast<unsigned>(params.view.num_kv_heads * chunks));
  // Score blocks hold no output accumulator, but the layout is shared.
  const size_t shared = AttendSharedBytes(block_rows, params.view.head_dim);
  void (*kernel)(ScoreKernelParams) = nullptr;
  switch (block_rows) {
    case 1:
      kernel = ScoreKernel<kKey, 1>;
      break;
    case 2:
      kernel = ScoreKernel<kKey, 2>;
      break;
    case 4:
      kernel = ScoreKernel<kKey, 4>;
      break;
    case 8:
      kernel = ScoreKernel<kKey, 8>;
      break;
    default:
      return cudaErrorInvalidValue;
  }
  TQKV_LAUNCH(kernel, grid, kAttendThreads, shared, stream, params);
  return cudaGetLastError();
}

// AttendBlocks of one (key, value) instance resident per SM, from the
// occupancy API; kHasMma: the pair has a tensor-core instance.
template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, bool kHasMma>
cudaError_t AttendInstanceBlocksPerSm(bool mma, int shape, int block_rows, int head_dim, int* blocks) {
  AttendKernelFunction kernel = nullptr;
  if (!mma) {
    kernel = AttendKernelFor<kKey, kValue>(block_rows);
  } else if constexpr (kHasMma) {
    kernel = AttendTensorKernelFor<kKey, kValue>(head_dim, shape);
  }
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const int threads = mma ? kMmaWarps * 32 : kAttendThreads;
  size_t shared = mma ? 0 : AttendSharedBytes(block_rows, head_dim);
  if (mma) {
    const cudaError_t opt_in = HmmaDynamicShared<kKey, kValue>(kernel, shape, &shared);
    if (opt_in != cudaSuccess) return opt_in;
  }
  int thread_blocks = 0;
  const cudaError_t error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &thread_blocks, reinterpret_cast<const void*>(kernel), threads, shared);
  if (error != cudaSuccess) return error;
  *blocks = thread_blocks * (mma ? kMmaWarps : 1);
  return cudaSuccess;
}

}  // namespace

bool ScoreSupported(DeviceFieldFormat key) { return FamilyInfo(key).reads_keys; }

namespace {

// A single-part TurboQuant field's bits, or -1.
int TurboQuantBits(const DeviceField& f, int head_dim) {
  const DevicePart& part = f.parts[0];
  return f.tiled != 0 && f.num_parts == 1 && part.dim == head_dim && part.code_offset == 0 &&
                 part.channels == nullptr && part.bits >= 2 && part.bits <= 4 &&
                 f.code_bytes * 8 == head_dim * part.bits && f.code_bytes % 4 == 0 && f.num_scalars == 1 &&
                 part.scalar_index == 0
             ? part.bits
             : -1;
}

// Split TurboQuant keys as the kernel reads them: two halves of the state
// (part 0 first), each part's codes whole words (part 1's right after part
// 0's), norms (part 0's, part 1's) per token. Key bits SplitKeyBits(part
// 0's, part 1's), or -1. The parts' channels are the query preparation's.
int SplitKeyWidth(const DeviceField& f, int head_dim) {
  const int half = head_dim / 2;
  for (int p = 0; p < 2; ++p) {
    const DevicePart& part = f.parts[p];
    if (part.dim != half || part.bits < 2 || part.bits > 4 || part.scalar_index != p || part.state_offset != p * half) {
      return -1;
    }
  }
  const int part0_bytes = half * f.parts[0].bits / 8;
  if (f.tiled == 0 || f.num_scalars != 2 || f.parts[0].code_offset != 0 || f.parts[1].code_offset != part0_bytes ||
      part0_bytes % 4 != 0 || f.code_bytes * 8 != half * (f.parts[0].bits + f.parts[1].bits) || f.code_bytes % 4 != 0) {
    return -1;
  }
  return SplitKeyBits(f.parts[0].bits, f.parts[1].bits);
}

}  // namespace

int AttendHmmaShape(const DeviceField& key, const DeviceField& value, int head_dim, int page_tokens) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return -1;
  if (page_tokens <= 0 || page_tokens % kHmmaTile != 0) return -1;
  FormatPair pair;
  if (!FindFormatPair(key.format, value.format, &pair) || !PairInfo(pair).tensor_cores ||
      !HasHmma(key.format, value.format)) {
    return -1;
  }
  // Raw fields token-major at their natural size; codes tiled, whole words,
  // one part covering every coordinate in order.
  auto bits_of = [&](const DeviceField& f) {
    switch (f.format) {
      case DeviceFieldFormat::kFp16:
      case DeviceFieldFormat::kBf16:
        return f.tiled == 0 && f.code_bytes == 2 * head_dim ? 16 : -1;
      case DeviceFieldFormat::kFp8:
        return f.tiled == 0 && f.code_bytes == head_dim ? 8 : -1;
      case DeviceFieldFormat::kUniform:
        return f.tiled != 0 && f.bits >= 2 && f.bits <= 4 && f.code_bytes * 8 == head_dim * f.bits &&
                       f.code_bytes % 4 == 0 && f.num_scalars == 2
                   ? f.bits
                   : -1;
      case DeviceFieldFormat::kTurboQuant:
        return f.num_parts == 2 ? SplitKeyWidth(f, head_dim) : TurboQuantBits(f, head_dim);
    }
    return -1;
  };
  const int key_bits = bits_of(key), value_bits = bits_of(value);
  if (key_bits < 0 || value_bits < 0) return -1;
  if (!HasHmmaBits(key.format, value.format, key_bits, value_bits)) return -1;
  return key_bits * 32 + value_bits;
}

bool AttendMmaSupported(const DeviceField& key, const DeviceField& value, int head_dim) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return false;
  if (key.format == DeviceFieldFormat::kFp8 || value.format == DeviceFieldFormat::kFp8) return false;
  FormatPair pair;
  if (!FindFormatPair(key.format, value.format, &pair) || !PairInfo(pair).tensor_cores) return false;
  // Coded fields: one part of 2-4 bits (the kernel's per-lane code runs).
  auto small_codes = [](const DeviceField& f) {
    switch (f.format) {
      case DeviceFieldFormat::kFp16:
      case DeviceFieldFormat::kBf16:
      case DeviceFieldFormat::kFp8:
        return true;
      case DeviceFieldFormat::kUniform:
      case DeviceFieldFormat::kTurboQuant:
        // Whole 4-byte words per token (true at these dims and bits): the
        // kernel reads tiled planes a word at a time (LoadTokenRuns).
        return f.bits >= 2 && f.bits <= 4 && (f.format != DeviceFieldFormat::kTurboQuant || f.num_parts == 1) &&
               f.code_bytes % 4 == 0;
    }
    return false;
  };
  return small_codes(key) && small_codes(value);
}

cudaError_t LaunchAttend(FormatPair pair, int block_rows, const AttendKernelParams& params, cudaStream_t stream) {
  if (params.num_blocks == 0) return cudaSuccess;
  return TQKV_CUDA_DISPATCH_FORMAT_PAIR(pair, kKey, kValue, kTensorCores,
                                        return LaunchAttendRows<kKey, kValue>(block_rows, params, stream););
}

cudaError_t LaunchAttendMma(FormatPair pair, int shape, const AttendKernelParams& params, cudaStream_t stream) {
  if (params.num_blocks == 0) return cudaSuccess;
  return TQKV_CUDA_DISPATCH_FORMAT_PAIR(pair, kKey, kValue, kTensorCores, {
    if constexpr (kTensorCores) {
      return LaunchAttendMmaDims<kKey, kValue>(shape, params, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  });
}

cudaError_t AttendBlocksPerSm(FormatPair pair, bool mma, int shape, int block_rows, int head_dim, int* blocks) {
  return TQKV_CUDA_DISPATCH_FORMAT_PAIR(
      pair, kKey, kValue, kTensorCores,
      return AttendInstanceBlocksPerSm<kKey, kValue, kTensorCores>(mma, shape, block_rows, head_dim, blocks););
}

cudaError_t LaunchScore(DeviceFieldFormat key, const ScoreKernelParams& params, cudaStream_t stream) {
  if (params.token_end <= params.token_begin) return cudaSuccess;
  const int group = params.view.num_query_heads / params.view.num_kv_heads;
  const int block_rows = BlockRowsFor(group);
  return TQKV_CUDA_DISPATCH_KEY_FORMAT(key, kKey, return LaunchScoreRows<kKey>(block_rows, params, stream););
}

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_ATTEND_KERNELS_IMPL_CUH_
