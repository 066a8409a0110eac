// Warp-cooperative rotations (rotation.h) over a vector in shared memory:
// all 32 lanes of a warp call them together. They perform the CPU's float
// operations in the CPU's order (butterflies a + b, a - b in stage order
// h = 1, 2, 4, ...; the Kronecker factor as a sequential sum; one final
// multiply by 1/sqrt(dim)), so Forward gives the same floats as
// Rotation::Forward for the Hadamard kinds. The dense kind follows the portable
// CPU path (16 partial sums, no fused multiply-add); the CPU's AVX paths for
// it differ from that in rounding only.
//
// Power-of-two dims from 32 to kMaxDeviceHeadDim keep the vector in registers
// (dim / 32 floats per lane; stages below dim / 32 inside a lane, the others
// across lanes with shuffles). Other dims work in shared memory.
#ifndef TQKV_KERNELS_CUDA_WARP_ROTATION_CUH_
#define TQKV_KERNELS_CUDA_WARP_ROTATION_CUH_

#include <cstdint>

#include "kernels/cuda/device_format.h"

namespace tqkv {
namespace cuda {

inline constexpr unsigned kFullWarp = 0xffffffffu;

// x <- diag(post) H diag(pre) x * scale for n = 32 * kPerLane, in registers.
// pre / post may be null.
template <int kPerLane>
__device__ __forceinline__ void WarpFwhtRegisters(float* x, const float* pre, const float* post, float scale,
                                                  int lane) {
  float v[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int i = lane * kPerLane + e;
    v[e] = pre != nullptr ? __fmul_rn(x[i], pre[i]) : x[i];
  }
#pragma unroll
  for (int h = 1; h < kPerLane; h <<= 1) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      if ((e & h) == 0) {
        const float a = v[e];
        const float b = v[e + h];
        v[e] = __fadd_rn(a, b);
        v[e + h] = __fsub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int lanes = 1; lanes < 32; lanes <<= 1) {
    const bool upper = (lane & lanes) != 0;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const float other = __shfl_xor_sync(kFullWarp, v[e], lanes);
      // The lower index holds a, the upper b: a + b below, a - b above.
      v[e] = upper ? __fsub_rn(other, v[e]) : __fadd_rn(v[e], other);
    }
  }
  __syncwarp();
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int i = lane * kPerLane + e;
    float out = __fmul_rn(v[e], scale);
    if (post != nullptr) out = __fmul_rn(out, post[i]);
    x[i] = out;
  }
  __syncwarp();
}

// The same in shared memory, any power of two n.
__device__ __forceinline__ void WarpFwhtShared(float* x, int n, const float* pre, const float* post, float scale,
                                               int lane) {
  if (pre != nullptr) {
    for (int i = lane; i < n; i += 32) x[i] = __fmul_rn(x[i], pre[i]);
  }
  __syncwarp();
  for (int h = 1; h < n; h <<= 1) {
    for (int p = lane; p < n / 2; p += 32) {
      const int i = (p / h) * 2 * h + p % h;
      const float a = x[i];
      const float b = x[i + h];
      x[i] = __fadd_rn(a, b);
      x[i + h] = __fsub_rn(a, b);
    }
    __syncwarp();
  }
  for (int i = lane; i < n; i += 32) {
    float out = __fmul_rn(x[i], scale);
    if (post != nullptr) out = __fmul_rn(out, post[i]);
    x[i] = out;
  }
  __syncwarp();
}

__device__ __forceinline__ void WarpFwht(float* x, int n, const float* pre, const float* post, float scale, int lane) {
  switch (n) {
    case 32:
      return WarpFwhtRegisters<1>(x, pre, post, scale, lane);
    case 64:
      return WarpFwhtRegisters<2>(x, pre, post, scale, lane);
    case 128:
      return WarpFwhtRegisters<4>(x, pre, post, scale, lane);
    case 256:
      return WarpFwhtRegisters<8>(x, pre, post, scale, lane);
    default:
      return WarpFwhtShared(x, n, pre, post, scale, lane);
  }
}

// y = diag(post) (H_rows kron F) diag(pre) x * scale (rotation.cc's
// KronHadamardRows), in place on x; tmp holds rows * m floats.
// columns[k * m + c] is F's column c, entry k.
__device__ __forceinline__ void WarpKronHadamard(float* x, float* tmp, int rows, int m, const float* columns,
                                                 const float* pre, const float* post, float scale, int lane) {
  const int n = rows * m;
  for (int i = lane; i < n; i += 32) tmp[i] = pre != nullptr ? __fmul_rn(x[i], pre[i]) : x[i];
  __syncwarp();
  for (int i = lane; i < n; i += 32) {
    const int r = i / m;
    const int c = i - r * m;
    const float* t = tmp + r * m;
    float acc = __fmul_rn(t[0], columns[c]);
    for (int k = 1; k < m; ++k) acc = __fadd_rn(acc, __fmul_rn(t[k], columns[k * m + c]));
    if (rows == 1) {
      acc = post != nullptr ? __fmul_rn(acc, __fmul_rn(scale, post[c])) : __fmul_rn(acc, scale);
    }
    x[i] = acc;
  }
  __syncwarp();
  for (int h = 1; h < rows; h *= 2) {
    const int span = h * m;
    const bool last = 2 * h == rows;
    for (int p = lane; p < n / 2; p += 32) {
      const int i = (p / span) * 2 * span + p % span;
      const float u = x[i];
      const float v = x[i + span];
      float a = __fadd_rn(u, v);
      float b = __fsub_rn(u, v);
      if (last) {
        if (post != nullptr) {
          a = __fmul_rn(a, __fmul_rn(scale, post[i]));
          b = __fmul_rn(b, __fmul_rn(scale, post[i + span]));
        } else {
          a = __fmul_rn(a, scale);
          b = __fmul_rn(b, scale);
        }
      }
      x[i] = a;
      x[i + span] = b;
    }
    __syncwarp();
  }
}

// y = M x with rotation.cc's portable Dot (16 partial sums, fixed tree).
__device__ __forceinline__ void WarpDenseForward(float* x, float* tmp, const float* matrix, int n, int lane) {
  for (int i = lane; i < n; i += 32) {
    const float* row = matrix + static_cast<int64_t>(i) * n;
    float acc[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) acc[k] = 0.0f;
    int j = 0;
    for (; j + 16 <= n; j += 16) {
#pragma unroll
      for (int k = 0; k < 16; ++k) acc[k] = __fadd_rn(acc[k], __fmul_rn(row[j + k], x[j + k]));
    }
    float tail = 0.0f;
    for (; j < n; ++j) tail = __fadd_rn(tail, __fmul_rn(row[j], x[j]));
#pragma unroll
    for (int width = 8; width >= 1; width >>= 1) {
#pragma unroll
      for (int k = 0; k < width; ++k) acc[k] = __fadd_rn(acc[k], acc[k + width]);
    }
    tmp[i] = __fadd_rn(acc[0], tail);
  }
  __syncwarp();
  for (int i = lane; i < n; i += 32) x[i] = tmp[i];
  __syncwarp();
}

// x = M^T y as a sum of scaled rows, in row order.
__device__ __forceinline__ void WarpDenseInverse(float* y, float* tmp, const float* matrix, int n, int lane) {
  for (int j = lane; j < n; j += 32) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) {
      acc = __fadd_rn(acc, __fmul_rn(matrix[static_cast<int64_t>(i) * n + j], y[i]));
    }
    tmp[j] = acc;
  }
  __syncwarp();
  for (int j = lane; j < n; j += 32) y[j] = tmp[j];
  __syncwarp();
}

// x <- Pi x in place. x and tmp: rotation.dim floats of this warp's shared
// memory. Callers __syncwarp() after writing x.
__device__ __forceinline__ void WarpRotateForward(const DeviceRotation& r, float* x, float* tmp, int lane) {
  switch (r.kind) {
    case DeviceRotationKind::kHadamard:
      return WarpFwht(x, r.dim, r.signs, nullptr, r.scale, lane);
    case DeviceRotationKind::kKron:
      return WarpKronHadamard(x, tmp, r.factor_rows, r.factor_order, r.factor_t, r.signs, nullptr, r.scale, lane);
    case DeviceRotationKind::kDense:
      return WarpDenseForward(x, tmp, r.matrix, r.dim, lane);
  }
}

// y <- Pi^T y in place.
__device__ __forceinline__ void WarpRotateInverse(const DeviceRotation& r, float* y, float* tmp, int lane) {
  switch (r.kind) {
    case DeviceRotationKind::kHadamard:
      return WarpFwht(y, r.dim, nullptr, r.signs, r.scale, lane);
    case DeviceRotationKind::kKron:
      return WarpKronHadamard(y, tmp, r.factor_rows, r.factor_order, r.factor, nullptr, r.signs, r.scale, lane);
    case DeviceRotationKind::kDense:
      return WarpDenseInverse(y, tmp, r.matrix, r.dim, lane);
  }
}

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_WARP_ROTATION_CUH_
