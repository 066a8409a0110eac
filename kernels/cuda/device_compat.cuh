// The device features tqkv's kernels use, in one place, for two compilers:
// nvcc, and the host emulation (emulation/emulated_device.h) that runs the
// same kernel source on CPU fibers for the tests of machines without a GPU.
// Kernels launch with TQKV_LAUNCH, read fp16 scalars with HalfBitsToFloat,
// take dynamic shared memory from DynamicSharedFloats, and use the tensor
// cores through ToTf32 and MmaTf32. TQKV_NOINLINE keeps a device function
// out of line (nvcc's __noinline__; nothing in the emulation).
//
// MmaTf32(d, a, b): d += A B for one warp, A 16x8 and B 8x8 in TF32, d 16x8
// in fp32 (PTX mma.sync.m16n8k8.row.col.f32.tf32.tf32.f32). With g = lane / 4
// and t = lane % 4, a lane holds a[0] = A[g][t], a[1] = A[g + 8][t],
// a[2] = A[g][t + 4], a[3] = A[g + 8][t + 4]; b[0] = B[t][g], b[1] = B[t + 4][g];
// d[0] = D[g][2t], d[1] = D[g][2t + 1], d[2] = D[g + 8][2t],
// d[3] = D[g + 8][2t + 1]. ToTf32 rounds a float to TF32 (nearest, ties away
// from zero; 10 mantissa bits), returned as its 32-bit pattern.
//
// MmaF16 / MmaBf16(d, a, b): d += A B, A 16x16 and B 16x8 in fp16 / bf16
// pairs, d 16x8 in fp32 (mma.sync.m16n8k16.row.col.f32.{f16,bf16}). A
// register holds two 16-bit numbers, the lower k in its low half:
// a[0] = A[g][2t, 2t + 1], a[1] = A[g + 8][2t, 2t + 1],
// a[2] = A[g][2t + 8, 2t + 9], a[3] = A[g + 8][2t + 8, 2t + 9];
// b[0] = B[2t, 2t + 1][g], b[1] = B[2t + 8, 2t + 9][g]; d as for MmaTf32.
// PackHalf2 / PackBf162(lo, hi) round two floats to nearest even into one
// register (lo in the low half); Fp8x2ToHalf2 widens the two fp8 E4M3 bytes
// in the low 16 bits of its argument (exactly) into an fp16 pair;
// Half2Sub subtracts fp16 pairs; BytePerm is __byte_perm; FastExp2 is the
// hardware's 2^x (ex2.approx, about 2 ulp). AndOr(a, kMask, c) is
// (a & kMask) | c in one LOP3 (ptxas otherwise spends two when c is a
// constant too). SharedAddress(p) is the 32-bit
// shared-window address of shared memory at p; LoadShared32 /
// StoreShared32(anchor, address) read and write the word at such an
// address, `anchor` being any address in the same shared array (the
// emulation resolves the address against it). SinCosReduced(x, s, c): sine
// and cosine of |x| <= pi by the hardware's approximations (absolute error
// below 4e-7 there; the emulation: sinf / cosf).
#ifndef TQKV_KERNELS_CUDA_DEVICE_COMPAT_CUH_
#define TQKV_KERNELS_CUDA_DEVICE_COMPAT_CUH_

#include <cstdint>

#if defined(__CUDACC__)

#include <cuda_fp16.h>

#define TQKV_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)
#define TQKV_NOINLINE __noinline__

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

// One warp-wide mma.sync of shape SHAPE on input type TYPE (PTX names),
// fp32 accumulators, fragments as documented above.
#define TQKV_MMA_SYNC(SHAPE, TYPE, d, a, b)                                             \
  asm volatile("mma.sync.aligned." SHAPE ".row.col.f32." TYPE "." TYPE                  \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))

__device__ __forceinline__ void MmaTf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  TQKV_MMA_SYNC("m16n8k8", "tf32", d, a, b);
}

__device__ __forceinline__ void MmaF16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  TQKV_MMA_SYNC("m16n8k16", "f16", d, a, b);
}

__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  TQKV_MMA_SYNC("m16n8k16", "bf16", d, a, b);
}

#undef TQKV_MMA_SYNC

__device__ __forceinline__ uint32_t PackHalf2(float lo, float hi) {
  uint32_t out;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

__device__ __forceinline__ uint32_t PackBf162(float lo, float hi) {
  uint32_t out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

__device__ __forceinline__ uint32_t Fp8x2ToHalf2(uint32_t two) {
  uint32_t out;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(out) : "r"(two));
  return out;
}

__device__ __forceinline__ uint32_t Half2Sub(uint32_t a, uint32_t b) {
  uint32_t out;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
  return out;
}

__device__ __forceinline__ uint32_t BytePerm(uint32_t x, uint32_t y, uint32_t selector) {
  return __byte_perm(x, y, selector);
}

__device__ __forceinline__ float FastExp2(float x) {
  float out;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(out) : "f"(x));
  return out;
}

__device__ __forceinline__ void SinCosReduced(float x, float* s, float* c) { __sincosf(x, s, c); }

template <uint32_t kMask>
__device__ __forceinline__ uint32_t AndOr(uint32_t a, uint32_t c) {
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(out) : "r"(a), "n"(kMask), "r"(c));
  return out;
}

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t LoadShared32(const void*, uint32_t address) {
  uint32_t out;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(out) : "r"(address));
  return out;
}

__device__ __forceinline__ void StoreShared32(void*, uint32_t address, uint32_t value) {
  asm volatile("st.shared.u32 [%0], %1;" : : "r"(address), "r"(value) : "memory");
}

}  // namespace cuda
}  // namespace tqkv

#else  // the host emulation

#include "kernels/cuda/emulation/emulated_device.h"
#include "kernels/float_formats.h"

#define TQKV_NOINLINE

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

// m16n8k(8 kPerReg) for one warp: the fragments gathered, then each lane's
// four results summed in k order onto d. A register holds kPerReg inputs
// (1 TF32, 2 16-bit numbers); element(register, i) widens its i-th to float
// (the products are exact in fp32). A[m][k] lives in lane (m % 8) * 4 +
// (k % (4 kPerReg)) / kPerReg, register (m >= 8) + 2 (k >= 4 kPerReg);
// B[k][n] in lane n * 4 + the same, register (k >= 4 kPerReg).
template <int kPerReg, typename Element>
inline void EmulatedMma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], Element element) {
  struct Fragments {
    uint32_t a[4];
    uint32_t b[2];
  };
  constexpr int kHalfK = 4 * kPerReg;
  Fragments mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  Fragments all[32];
  emulation::WarpGather(&mine, sizeof(mine), all);
  auto a_at = [&](int m, int k) {
    const Fragments& f = all[(m % 8) * 4 + (k % kHalfK) / kPerReg];
    return element(f.a[(m >= 8 ? 1 : 0) + (k >= kHalfK ? 2 : 0)], k % kPerReg);
  };
  auto b_at = [&](int k, int n) {
    return element(all[n * 4 + (k % kHalfK) / kPerReg].b[k >= kHalfK ? 1 : 0], k % kPerReg);
  };
  const int g = emulation::Lane() / 4, t = emulation::Lane() % 4;
  const int rows[4] = {g, g, g + 8, g + 8};
  const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float sum = d[i];
    for (int k = 0; k < 2 * kHalfK; ++k) sum += a_at(rows[i], k) * b_at(k, cols[i]);
    d[i] = sum;
  }
}

// TF32 inputs: the tensor cores ignore the low 13 bits.
inline void MmaTf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  EmulatedMma<1>(d, a, b, [](uint32_t reg, int) {
    reg &= ~0x1fffu;
    float f;
    std::memcpy(&f, &reg, sizeof(f));
    return f;
  });
}

inline void MmaF16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  EmulatedMma<2>(d, a, b, [](uint32_t reg, int i) { return HalfToFloat(static_cast<uint16_t>(reg >> (16 * i))); });
}
inline void MmaBf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  EmulatedMma<2>(d, a, b, [](uint32_t reg, int i) { return Bf16ToFloat(static_cast<uint16_t>(reg >> (16 * i))); });
}

inline uint32_t PackHalf2(float lo, float hi) {
  return static_cast<uint32_t>(FloatToHalf(lo)) | (static_cast<uint32_t>(FloatToHalf(hi)) << 16);
}
inline uint32_t PackBf162(float lo, float hi) {
  return static_cast<uint32_t>(FloatToBf16(lo)) | (static_cast<uint32_t>(FloatToBf16(hi)) << 16);
}
inline uint32_t Fp8x2ToHalf2(uint32_t two) {
  return PackHalf2(Fp8E4m3ToFloat(static_cast<uint8_t>(two)), Fp8E4m3ToFloat(static_cast<uint8_t>(two >> 8)));
}
inline uint32_t Half2Sub(uint32_t a, uint32_t b) {
  return PackHalf2(HalfToFloat(static_cast<uint16_t>(a)) - HalfToFloat(static_cast<uint16_t>(b)),
                   HalfToFloat(static_cast<uint16_t>(a >> 16)) - HalfToFloat(static_cast<uint16_t>(b >> 16)));
}
inline uint32_t BytePerm(uint32_t x, uint32_t y, uint32_t selector) {
  const uint64_t both = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t out = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t pick = (selector >> (4 * k)) & 0xfu;
    uint32_t byte = static_cast<uint32_t>(both >> (8 * (pick & 7u))) & 0xffu;
    if (pick & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;  // sign replication
    out |= byte << (8 * k);
  }
  return out;
}
inline float FastExp2(float x) { return std::exp2(x); }
template <uint32_t kMask>
inline uint32_t AndOr(uint32_t a, uint32_t c) {
  return (a & kMask) | c;
}
inline void SinCosReduced(float x, float* s, float* c) {
  *s = std::sin(x);
  *c = std::cos(x);
}
inline uint32_t SharedAddress(const void* p) { return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p)); }
inline uint32_t LoadShared32(const void* anchor, uint32_t address) {
  uint32_t out;
  std::memcpy(&out, static_cast<const uint8_t*>(anchor) + (address - SharedAddress(anchor)), sizeof(out));
  return out;
}
inline void StoreShared32(void* anchor, uint32_t address, uint32_t value) {
  std::memcpy(static_cast<uint8_t*>(anchor) + (address - SharedAddress(anchor)), &value, sizeof(value));
}

}  // namespace cuda
}  // namespace tqkv

#endif

#endif  // TQKV_KERNELS_CUDA_DEVICE_COMPAT_CUH_
