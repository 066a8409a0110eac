// The device features tqkv's kernels use, in one place, for two compilers:
// nvcc, and the host emulation (emulation/emulated_device.h) that runs the
// same kernel source on CPU fibers for the tests of machines without a GPU.
// Kernels launch with TQKV_LAUNCH, read fp16 scalars with HalfBitsToFloat,
// take dynamic shared memory from DynamicSharedFloats, and use the tensor
// cores through ToTf32 and MmaTf32.
//
// MmaTf32(d, a, b): d += A B for one warp, A 16x8 and B 8x8 in TF32, d 16x8
// in fp32 (PTX mma.sync.m16n8k8.row.col.f32.tf32.tf32.f32). With g = lane / 4
// and t = lane % 4, a lane holds a[0] = A[g][t], a[1] = A[g + 8][t],
// a[2] = A[g][t + 4], a[3] = A[g + 8][t + 4]; b[0] = B[t][g], b[1] = B[t + 4][g];
// d[0] = D[g][2t], d[1] = D[g][2t + 1], d[2] = D[g + 8][2t],
// d[3] = D[g + 8][2t + 1]. ToTf32 rounds a float to TF32 (nearest, ties away
// from zero; 10 mantissa bits), returned as its 32-bit pattern.
#ifndef TQKV_KERNELS_CUDA_DEVICE_COMPAT_CUH_
#define TQKV_KERNELS_CUDA_DEVICE_COMPAT_CUH_

#include <cstdint>

#if defined(__CUDACC__)

#include <cuda_fp16.h>

#define TQKV_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)

namespace tqkv {
namespace cuda {

__device__ __forceinline__ float HalfBitsToFloat(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

__device__ __forceinline__ float* DynamicSharedFloats() {
  extern __shared__ float tqkv_dynamic_shared[];
  return tqkv_dynamic_shared;
}

__device__ __forceinline__ uint32_t ToTf32(float x) {
  uint32_t out;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(out) : "f"(x));
  return out;
}

__device__ __forceinline__ void MmaTf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace cuda
}  // namespace tqkv

#else  // the host emulation

#include "kernels/cuda/emulation/emulated_device.h"
#include "kernels/float_formats.h"

namespace tqkv {
namespace cuda {

inline float HalfBitsToFloat(uint32_t bits) { return HalfToFloat(static_cast<uint16_t>(bits)); }
inline float* DynamicSharedFloats() { return emulation::DynamicShared(); }

inline uint32_t ToTf32(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  // Half of the dropped part's range added to the magnitude: ties away.
  return (bits + 0x1000u) & ~0x1fffu;
}

// The warp's fragments gathered, then each lane's four results computed in k
// order from TF32 inputs (the tensor cores ignore the low 13 bits).
inline void MmaTf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Fragments {
    uint32_t a[4];
    uint32_t b[2];
  };
  Fragments mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  Fragments all[32];
  emulation::WarpGather(&mine, sizeof(mine), all);
  auto tf32 = [](uint32_t bits) {
    bits &= ~0x1fffu;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  };
  auto a_at = [&](int m, int k) {  // A[m][k] lives in lane (m % 8) * 4 + k % 4
    const Fragments& f = all[(m % 8) * 4 + k % 4];
    return tf32(f.a[(m >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0)]);
  };
  auto b_at = [&](int k, int n) { return tf32(all[n * 4 + k % 4].b[k >= 4 ? 1 : 0]); };
  const int g = emulation::Lane() / 4, t = emulation::Lane() % 4;
  const int rows[4] = {g, g, g + 8, g + 8};
  const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float sum = d[i];
    for (int k = 0; k < 8; ++k) sum += a_at(rows[i], k) * b_at(k, cols[i]);
    d[i] = sum;
  }
}

}  // namespace cuda
}  // namespace tqkv

#endif

#endif  // TQKV_KERNELS_CUDA_DEVICE_COMPAT_CUH_
