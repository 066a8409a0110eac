// Kernel bodies and launchers of kernels/cuda/attend_kernels.cuh, written once for two compilers:
// nvcc (the .cu file of the same name includes this) and the host emulation
// of tests/gpu (kernels/cuda/emulation/), which runs the same source on CPU
// fibers. Device features come from device_compat.cuh only. The kernels
// live in attend_common_impl.cuh (what both read tokens with),
// attend_simt_impl.cuh (fp32 decode, merge, score) and attend_mma_impl.cuh
// (tensor cores); this file picks an instance and launches it.
#ifndef TQKV_KERNELS_CUDA_ATTEND_KERNELS_IMPL_CUH_
#define TQKV_KERNELS_CUDA_ATTEND_KERNELS_IMPL_CUH_

#include "kernels/cuda/attend_simt_impl.cuh"
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

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue>
cudaError_t LaunchAttendMmaDims(const AttendKernelParams& params, cudaStream_t stream) {
  const AttendKernelFunction kernel = AttendMmaKernelFor<kKey, kValue>(params.view.head_dim);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((params.num_blocks + kMmaWarps - 1) / kMmaWarps));
  TQKV_LAUNCH(kernel, grid, kMmaWarps * 32, 0, stream, params);
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
cudaError_t AttendInstanceBlocksPerSm(bool mma, int block_rows, int head_dim, int* blocks) {
  AttendKernelFunction kernel = nullptr;
  if (!mma) {
    kernel = AttendKernelFor<kKey, kValue>(block_rows);
  } else if constexpr (kHasMma) {
    kernel = AttendMmaKernelFor<kKey, kValue>(head_dim);
  }
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const int threads = mma ? kMmaWarps * 32 : kAttendThreads;
  const size_t shared = mma ? 0 : AttendSharedBytes(block_rows, head_dim);
  int thread_blocks = 0;
  const cudaError_t error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &thread_blocks, reinterpret_cast<const void*>(kernel), threads, shared);
  if (error != cudaSuccess) return error;
  *blocks = thread_blocks * (mma ? kMmaWarps : 1);
  return cudaSuccess;
}

}  // namespace

bool ScoreSupported(DeviceFieldFormat key) { return FamilyInfo(key).reads_keys; }

bool AttendMmaSupported(const DeviceField& key, const DeviceField& value, int head_dim) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return false;
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

cudaError_t LaunchAttendMma(FormatPair pair, const AttendKernelParams& params, cudaStream_t stream) {
  if (params.num_blocks == 0) return cudaSuccess;
  return TQKV_CUDA_DISPATCH_FORMAT_PAIR(pair, kKey, kValue, kTensorCores, {
    if constexpr (kTensorCores) {
      return LaunchAttendMmaDims<kKey, kValue>(params, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  });
}

cudaError_t AttendBlocksPerSm(FormatPair pair, bool mma, int block_rows, int head_dim, int* blocks) {
  return TQKV_CUDA_DISPATCH_FORMAT_PAIR(
      pair, kKey, kValue, kTensorCores,
      return AttendInstanceBlocksPerSm<kKey, kValue, kTensorCores>(mma, block_rows, head_dim, blocks););
}

cudaError_t LaunchMerge(const MergeParams& params, cudaStream_t stream) {
  if (params.num_units == 0) return cudaSuccess;
  const int64_t warps = static_cast<int64_t>(params.num_units) * kMaxBlockRows;
  TQKV_LAUNCH(MergeKernel, static_cast<unsigned>((warps + kWarps - 1) / kWarps), kAttendThreads, 0, stream, params);
  return cudaGetLastError();
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
