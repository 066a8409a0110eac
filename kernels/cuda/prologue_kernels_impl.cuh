// Kernel body and launcher of kernels/cuda/prologue_kernels.cuh, written once
// for two compilers: nvcc (prologue_kernels.cu includes this) and the host
// emulation of tests/gpu (kernels/cuda/emulation/), which runs the same
// source on CPU fibers. Device features come from device_compat.cuh only.
#ifndef TQKV_KERNELS_CUDA_PROLOGUE_KERNELS_IMPL_CUH_
#define TQKV_KERNELS_CUDA_PROLOGUE_KERNELS_IMPL_CUH_

#include "kernels/cuda/prologue_kernels.cuh"
#include "kernels/cuda/device_compat.cuh"

#include "kernels/cuda/store_kernels_impl.cuh"
#include "kernels/cuda/warp_rotation.cuh"

namespace tqkv {
namespace cuda {
namespace {

constexpr int kPrologueWarps = 4;

// Prepares row `row` of p by one warp, with s.y and s.tmp as its scratch.
__device__ void PrepareRow(const PrepareParams& p, int64_t row, WarpScratch& s, int lane) {
  const int d = p.view.head_dim;
  const DeviceField& key = p.view.heads[p.head_of_row[row]].key;
  const float* q = p.queries + row * d;
  float* out = p.prepared + row * d;
  if (key.format != DeviceFieldFormat::kTurboQuant) {
    for (int j = lane; j < d; j += 32) out[j] = q[j] * p.scale;
    return;
  }
  for (int part_index = 0; part_index < key.num_parts; ++part_index) {
    const DevicePart& part = key.parts[part_index];
    for (int k = lane; k < part.dim; k += 32) s.y[k] = q[part.channels != nullptr ? part.channels[k] : k];
    __syncwarp();
    WarpRotateForward(part.rotation, s.y, s.tmp, lane);
    for (int k = lane; k < part.dim; k += 32) out[part.state_offset + k] = s.y[k] * p.scale;
    __syncwarp();
  }
}

// Thread blocks [0, store_blocks) loop over the stores' vectors, numbered
// through the stores in order; each later block prepares kPrologueWarps
// rows, numbered through the preparations in order. Whole warps take each
// branch, and nothing synchronises the block.
__global__ void __launch_bounds__(kPrologueWarps * 32) PrologueKernel(PrologueParams p, int32_t store_blocks) {
  __shared__ WarpScratch scratch[kPrologueWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  WarpScratch& s = scratch[warp];
  if (static_cast<int32_t>(blockIdx.x) < store_blocks) {
    const int64_t stride = static_cast<int64_t>(store_blocks) * kPrologueWarps;
    int store = 0;
    int64_t first = 0;  // the first vector of stores[store]
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * kPrologueWarps + warp;; v += stride) {
      while (store < p.num_stores && v - first >= StoreVectors(p.stores[store])) {
        first += StoreVectors(p.stores[store]);
        ++store;
      }
      if (store == p.num_stores) return;
      StoreVector(p.stores[store], v - first, s, lane);
    }
  }
  int64_t row = static_cast<int64_t>(blockIdx.x - store_blocks) * kPrologueWarps + warp;
  for (int j = 0; j < p.num_preparations; ++j) {
    if (row < p.preparations[j].num_rows) {
      PrepareRow(p.preparations[j], row, s, lane);
      return;
    }
    row -= p.preparations[j].num_rows;
  }
}

}  // namespace

cudaError_t LaunchPrologue(const PrologueParams& params, cudaStream_t stream) {
  if (params.num_stores < 0 || params.num_stores > kMaxPrologueStores || params.num_preparations < 0 ||
      params.num_preparations > kMaxProloguePreparations) {
    return cudaErrorInvalidValue;
  }
  int64_t vectors = 0, rows = 0;
  for (int i = 0; i < params.num_stores; ++i) vectors += StoreVectors(params.stores[i]);
  for (int i = 0; i < params.num_preparations; ++i) rows += params.preparations[i].num_rows;
  int64_t store_blocks = 0;
  if (vectors > 0) {
    int device = 0, sms = 0;
    cudaError_t error = cudaGetDevice(&device);
    if (error == cudaSuccess) error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (error != cudaSuccess) return error;
    // Enough warps to fill the device several times over; each loops.
    const int64_t wanted = (vectors + kPrologueWarps - 1) / kPrologueWarps;
    store_blocks = wanted < 16ll * sms ? wanted : 16ll * sms;
  }
  const int64_t blocks = store_blocks + (rows + kPrologueWarps - 1) / kPrologueWarps;
  if (blocks == 0) return cudaSuccess;
  TQKV_LAUNCH(PrologueKernel, static_cast<unsigned>(blocks), kPrologueWarps * 32, 0, stream, params,
              static_cast<int32_t>(store_blocks));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_PROLOGUE_KERNELS_IMPL_CUH_
