// AVX2 kernels behind rotation.h: the fast Walsh-Hadamard transform (with the
// sign diagonal fused into its loads and stores), the Kronecker transform for
// dims 2^k * {12, 20, 28} and the dense matrix-vector products. Compiled with
// -mavx2 -mfma; called only when ActiveSimdLevel() >= kAvx2.
//
// The transform is bit-identical to FastWalshHadamardScalar: every element sees
// the same (a + b) / (a - b) operations, stage h = 1, 2, 4, ... in order, and
// one final multiply by the same rounded 1/sqrt(n). Within a register a stage
// is a permute and an FMA against a +-1 vector: fma(v, -1, s) rounds the exact
// s - v once, so it equals the scalar subtraction. Strides of 8 and more add
// and subtract whole registers.
//
// Keep this file free of inline functions with external linkage (std::vector,
// std::min, ...): the linker could pick this file's AVX copy for baseline code.
#include <immintrin.h>

#include <cmath>
#include <cstddef>

#include "kernels/cpu/rotation_kernels.h"
#include "kernels/rotation.h"

namespace tqkv {
namespace {

constexpr int kLanes = 8;
// Floats transformed entirely in registers before strides cross memory.
constexpr int kBlockRegs = 8;
constexpr int kBlock = kLanes * kBlockRegs;

// One butterfly stage within a register: lanes whose bit is set in kUpper get
// s - v (s holds the partner lane), the others v + s.
template <int kUpper>
inline __m256 Stage(__m256 v, __m256 s) {
  const __m256 sign = _mm256_blend_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(-1.0f), kUpper);
  return _mm256_fmadd_ps(v, sign, s);
}

// Stages h = 1, 2, 4 within one register.
inline __m256 InRegisterStages(__m256 v) {
  v = Stage<0xAA>(v, _mm256_permute_ps(v, 0xB1));          // swap neighbours
  v = Stage<0xCC>(v, _mm256_permute_ps(v, 0x4E));          // swap pairs
  v = Stage<0xF0>(v, _mm256_permute2f128_ps(v, v, 0x01));  // swap 128-bit halves
  return v;
}

// Output scaling: v * scale, or v * (scale * post) with the sign diagonal
// folded in (exact, since post is +-1).
inline __m256 Finish(__m256 v, __m256 scale, const float* post, ptrdiff_t offset) {
  if (post == nullptr) return _mm256_mul_ps(v, scale);
  return _mm256_mul_ps(v, _mm256_mul_ps(scale, _mm256_loadu_ps(post + offset)));
}

// Stages of stride kHr, 2 kHr, ... < kRegs registers: whole-register butterflies.
// Compile-time strides keep v[] in registers after unrolling.
template <int kRegs, int kHr = 1>
inline void CrossRegisterStages(__m256* v) {
  if constexpr (kHr < kRegs) {
#pragma GCC unroll 16
    for (int j = 0; j < kRegs / 2; ++j) {
      const int lo = (j / kHr) * 2 * kHr + j % kHr;
      const __m256 a = v[lo];
      const __m256 b = v[lo + kHr];
      v[lo] = _mm256_add_ps(a, b);
      v[lo + kHr] = _mm256_sub_ps(a, b);
    }
    CrossRegisterStages<kRegs, 2 * kHr>(v);
  }
}

// All stages of a kRegs * 8 float block, held in registers: reads in (times
// pre when given), writes out; scales (and applies post) when finish is set.
template <int kRegs>
inline void TransformBlock(const float* in, float* out, const float* pre, const float* post,
                           bool finish, __m256 scale) {
  __m256 v[kRegs];
#pragma GCC unroll 16
  for (int r = 0; r < kRegs; ++r) v[r] = _mm256_loadu_ps(in + r * kLanes);
  if (pre != nullptr) {
#pragma GCC unroll 16
    for (int r = 0; r < kRegs; ++r) v[r] = _mm256_mul_ps(v[r], _mm256_loadu_ps(pre + r * kLanes));
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRegs; ++r) v[r] = InRegisterStages(v[r]);
  CrossRegisterStages<kRegs>(v);
  if (finish) {
#pragma GCC unroll 16
    for (int r = 0; r < kRegs; ++r) v[r] = Finish(v[r], scale, post, r * kLanes);
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRegs; ++r) _mm256_storeu_ps(out + r * kLanes, v[r]);
}

// One stage of stride h >= 8 over all of x; the last stage finishes.
void StridePass(float* x, int n, int h, const float* post, bool finish, __m256 scale) {
  for (int i = 0; i < n; i += 2 * h) {
    for (int j = i; j < i + h; j += kLanes) {
      const __m256 a = _mm256_loadu_ps(x + j);
      const __m256 b = _mm256_loadu_ps(x + j + h);
      __m256 sum = _mm256_add_ps(a, b);
      __m256 diff = _mm256_sub_ps(a, b);
      if (finish) {
        sum = Finish(sum, scale, post, j);
        diff = Finish(diff, scale, post, j + h);
      }
      _mm256_storeu_ps(x + j, sum);
      _mm256_storeu_ps(x + j + h, diff);
    }
  }
}

// Stages h and 2h (h >= 8) in one sweep: the same butterflies as two passes.
void StridePass2(float* x, int n, int h, const float* post, bool finish, __m256 scale) {
  for (int i = 0; i < n; i += 4 * h) {
    for (int j = i; j < i + h; j += kLanes) {
      const __m256 x0 = _mm256_loadu_ps(x + j);
      const __m256 x1 = _mm256_loadu_ps(x + j + h);
      const __m256 x2 = _mm256_loadu_ps(x + j + 2 * h);
      const __m256 x3 = _mm256_loadu_ps(x + j + 3 * h);
      const __m256 s01 = _mm256_add_ps(x0, x1);
      const __m256 d01 = _mm256_sub_ps(x0, x1);
      const __m256 s23 = _mm256_add_ps(x2, x3);
      const __m256 d23 = _mm256_sub_ps(x2, x3);
      __m256 y0 = _mm256_add_ps(s01, s23);
      __m256 y1 = _mm256_add_ps(d01, d23);
      __m256 y2 = _mm256_sub_ps(s01, s23);
      __m256 y3 = _mm256_sub_ps(d01, d23);
      if (finish) {
        y0 = Finish(y0, scale, post, j);
        y1 = Finish(y1, scale, post, j + h);
        y2 = Finish(y2, scale, post, j + 2 * h);
        y3 = Finish(y3, scale, post, j + 3 * h);
      }
      _mm256_storeu_ps(x + j, y0);
      _mm256_storeu_ps(x + j + h, y1);
      _mm256_storeu_ps(x + j + 2 * h, y2);
      _mm256_storeu_ps(x + j + 3 * h, y3);
    }
  }
}

// Lanes [0, count) set, for masked loads and stores of a row's tail.
inline __m256i TailMask(int count) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane);
}

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[0..3] = the horizontal sums of a0..a3, reduced together.
inline void StoreSums4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* y) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  // h = [s0 s1 s2 s3 | s0' s1' s2' s3']: the two 128-bit halves' partial sums.
  _mm_storeu_ps(y, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// The Kronecker transform (H_rows kron F) diag(pre) for m = 12, 20, 28, in the
// operation order of KronHadamardScalar (rotation.cc). A row of m floats
// takes ceil(m / 8) registers, the last one masked; kRows rows at a time stay
// in registers through the product with F and the first log2(kRows)
// butterfly stages.

// Part v of a kM-float row: a full or, for the last part, masked load.
template <int kM>
inline __m256 LoadRowPart(const float* row, int v) {
  constexpr int kParts = (kM + kLanes - 1) / kLanes;
  if (v + 1 < kParts) return _mm256_loadu_ps(row + v * kLanes);
  return _mm256_maskload_ps(row + v * kLanes, TailMask(kM - (kParts - 1) * kLanes));
}

template <int kM>
inline void StoreRowPart(float* row, int v, __m256 value) {
  constexpr int kParts = (kM + kLanes - 1) / kLanes;
  if (v + 1 < kParts) {
    _mm256_storeu_ps(row + v * kLanes, value);
  } else {
    _mm256_maskstore_ps(row + v * kLanes, TailMask(kM - (kParts - 1) * kLanes), value);
  }
}

// kRows rows (kRows * kM floats at x and y): y = (H_kRows kron F) diag(pre) x,
// times (scale * post) when finish is set. x == y allowed. No vector
// arguments: GCC then ends the function with vzeroupper even where it is
// reached by a tail call from baseline code, which otherwise pays the
// SSE/AVX transition penalty on every later SSE instruction.
template <int kM, int kRows>
void KronRowGroup(const float* x, float* y, const float* columns, const float* pre,
                  const float* post, bool finish, float scale_value) {
  constexpr int kParts = (kM + kLanes - 1) / kLanes;
  const __m256 scale = _mm256_set1_ps(scale_value);
  // The whole input is read before any output is written (x == y).
  float t[kRows * kM];
  if (pre != nullptr) {
    for (int i = 0; i < kRows * kM; ++i) t[i] = x[i] * pre[i];
  } else {
    for (int i = 0; i < kRows * kM; ++i) t[i] = x[i];
  }
  __m256 acc[kRows][kParts];
#pragma GCC unroll 4
  for (int v = 0; v < kParts; ++v) {
    const __m256 column = LoadRowPart<kM>(columns, v);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) acc[r][v] = _mm256_mul_ps(_mm256_set1_ps(t[r * kM]), column);
  }
  for (int k = 1; k < kM; ++k) {
#pragma GCC unroll 4
    for (int v = 0; v < kParts; ++v) {
      const __m256 column = LoadRowPart<kM>(columns + k * kM, v);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        acc[r][v] = _mm256_fmadd_ps(_mm256_set1_ps(t[r * kM + k]), column, acc[r][v]);
      }
    }
  }
  // Butterfly stages h = 1, 2, ... < kRows between whole rows.
#pragma GCC unroll 4
  for (int h = 1; h < kRows; h *= 2) {
#pragma GCC unroll 4
    for (int j = 0; j < kRows / 2; ++j) {
      const int lo = (j / h) * 2 * h + j % h;
#pragma GCC unroll 4
      for (int v = 0; v < kParts; ++v) {
        const __m256 a = acc[lo][v];
        const __m256 b = acc[lo + h][v];
        acc[lo][v] = _mm256_add_ps(a, b);
        acc[lo + h][v] = _mm256_sub_ps(a, b);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kParts; ++v) {
      __m256 out = acc[r][v];
      if (finish) {
        out = post == nullptr
                  ? _mm256_mul_ps(out, scale)
                  : _mm256_mul_ps(out, _mm256_mul_ps(scale, LoadRowPart<kM>(post + r * kM, v)));
      }
      StoreRowPart<kM>(y + r * kM, v, out);
    }
  }
}

// All rows: groups of kMaxRows in registers, then the remaining butterfly
// stages as whole-register passes (a group is a multiple of kLanes floats).
template <int kM, int kMaxRows>
void KronHadamardImpl(const float* x, float* y, int rows, const float* columns, const float* pre,
                      const float* post, float scale_value) {
  static_assert(kMaxRows * kM % kLanes == 0, "stride passes need whole registers");
  if (rows == 1) return KronRowGroup<kM, 1>(x, y, columns, pre, post, true, scale_value);
  if (rows == 2) return KronRowGroup<kM, 2>(x, y, columns, pre, post, true, scale_value);
  if constexpr (kMaxRows >= 4) {
    if (rows == 4) return KronRowGroup<kM, 4>(x, y, columns, pre, post, true, scale_value);
  }
  if constexpr (kMaxRows >= 8) {
    if (rows == 8) return KronRowGroup<kM, 8>(x, y, columns, pre, post, true, scale_value);
  }
  const int n = rows * kM;
  constexpr int kGroup = kMaxRows * kM;
  for (int i = 0; i < n; i += kGroup) {
    KronRowGroup<kM, kMaxRows>(x + i, y + i, columns, pre == nullptr ? nullptr : pre + i, nullptr,
                               false, scale_value);
  }
  const __m256 scale = _mm256_set1_ps(scale_value);
  int h = kGroup;
  while (h < n) {
    if (4 * h <= n) {
      StridePass2(y, n, h, post, 4 * h == n, scale);
      h *= 4;
    } else {
      StridePass(y, n, h, post, 2 * h == n, scale);
      h *= 2;
    }
  }
}

}  // namespace

namespace rotation_internal {

// y = diag(post) H diag(pre) x / sqrt(n); pre and post may be null (identity).
// x == y allowed.
void SignedFwhtAvx2(const float* x, float* y, int n, const float* pre_signs,
                    const float* post_signs) {
  if (n < kLanes) {
    for (int i = 0; i < n; ++i) y[i] = pre_signs != nullptr ? x[i] * pre_signs[i] : x[i];
    FastWalshHadamardScalar(y, n);
    if (post_signs != nullptr) {
      for (int i = 0; i < n; ++i) y[i] *= post_signs[i];
    }
    return;
  }
  const __m256 scale = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))));
  switch (n) {
    case 8:
      TransformBlock<1>(x, y, pre_signs, post_signs, true, scale);
      break;
    case 16:
      TransformBlock<2>(x, y, pre_signs, post_signs, true, scale);
      break;
    case 32:
      TransformBlock<4>(x, y, pre_signs, post_signs, true, scale);
      break;
    case 64:
      TransformBlock<8>(x, y, pre_signs, post_signs, true, scale);
      break;
    default: {
      for (int i = 0; i < n; i += kBlock) {
        TransformBlock<kBlockRegs>(x + i, y + i, pre_signs == nullptr ? nullptr : pre_signs + i,
                                   nullptr, false, scale);
      }
      int h = kBlock;
      while (h < n) {
        if (4 * h <= n) {
          StridePass2(y, n, h, post_signs, 4 * h == n, scale);
          h *= 4;
        } else {
          StridePass(y, n, h, post_signs, 2 * h == n, scale);
          h *= 2;
        }
      }
    }
  }
  // The passes' own exits leave the upper register state dirty, and a last
  // call may become a tail jump: clear it here, or the caller's SSE code runs
  // with a dirty upper state (on the Xeon, that made the whole TurboQuant
  // store 1.8x slower).
  _mm256_zeroupper();
}

// y = M x, M row-major dim x dim: four rows at a time share each load of x.
// REQUIRES: y does not alias x.
void DenseForwardAvx2(const float* m, const float* x, float* y, int dim) {
  const int body = dim / kLanes * kLanes;
  const __m256i tail_mask = TailMask(dim - body);
  int i = 0;
  for (; i + 4 <= dim; i += 4) {
    const float* r0 = m + static_cast<size_t>(i) * dim;
    const float* r1 = r0 + dim;
    const float* r2 = r1 + dim;
    const float* r3 = r2 + dim;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int j = 0; j < body; j += kLanes) {
      const __m256 xv = _mm256_loadu_ps(x + j);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + j), xv, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(r1 + j), xv, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(r2 + j), xv, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(r3 + j), xv, a3);
    }
    if (body < dim) {
      const __m256 xv = _mm256_maskload_ps(x + body, tail_mask);
      a0 = _mm256_fmadd_ps(_mm256_maskload_ps(r0 + body, tail_mask), xv, a0);
      a1 = _mm256_fmadd_ps(_mm256_maskload_ps(r1 + body, tail_mask), xv, a1);
      a2 = _mm256_fmadd_ps(_mm256_maskload_ps(r2 + body, tail_mask), xv, a2);
      a3 = _mm256_fmadd_ps(_mm256_maskload_ps(r3 + body, tail_mask), xv, a3);
    }
    StoreSums4(a0, a1, a2, a3, y + i);
  }
  for (; i < dim; ++i) {
    const float* r0 = m + static_cast<size_t>(i) * dim;
    __m256 a0 = _mm256_setzero_ps();
    for (int j = 0; j < body; j += kLanes) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + j), _mm256_loadu_ps(x + j), a0);
    }
    if (body < dim) {
      a0 = _mm256_fmadd_ps(_mm256_maskload_ps(r0 + body, tail_mask),
                           _mm256_maskload_ps(x + body, tail_mask), a0);
    }
    y[i] = HorizontalSum(a0);
  }
}

// x = M^T y as x += sum_i y_i * row_i, four rows per sweep over x.
// REQUIRES: x does not alias y.
void DenseInverseAvx2(const float* m, const float* y, float* x, int dim) {
  const int body = dim / kLanes * kLanes;
  const __m256i tail_mask = TailMask(dim - body);
  for (int j = 0; j < dim; ++j) x[j] = 0.0f;
  int i = 0;
  for (; i + 4 <= dim; i += 4) {
    const float* r0 = m + static_cast<size_t>(i) * dim;
    const float* r1 = r0 + dim;
    const float* r2 = r1 + dim;
    const float* r3 = r2 + dim;
    const __m256 y0 = _mm256_set1_ps(y[i]), y1 = _mm256_set1_ps(y[i + 1]);
    const __m256 y2 = _mm256_set1_ps(y[i + 2]), y3 = _mm256_set1_ps(y[i + 3]);
    for (int j = 0; j < body; j += kLanes) {
      __m256 acc = _mm256_loadu_ps(x + j);
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + j), y0, acc);
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(r1 + j), y1, acc);
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(r2 + j), y2, acc);
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(r3 + j), y3, acc);
      _mm256_storeu_ps(x + j, acc);
    }
    if (body < dim) {
      __m256 acc = _mm256_maskload_ps(x + body, tail_mask);
      acc = _mm256_fmadd_ps(_mm256_maskload_ps(r0 + body, tail_mask), y0, acc);
      acc = _mm256_fmadd_ps(_mm256_maskload_ps(r1 + body, tail_mask), y1, acc);
      acc = _mm256_fmadd_ps(_mm256_maskload_ps(r2 + body, tail_mask), y2, acc);
      acc = _mm256_fmadd_ps(_mm256_maskload_ps(r3 + body, tail_mask), y3, acc);
      _mm256_maskstore_ps(x + body, tail_mask, acc);
    }
  }
  for (; i < dim; ++i) {
    const float* r0 = m + static_cast<size_t>(i) * dim;
    const __m256 y0 = _mm256_set1_ps(y[i]);
    for (int j = 0; j < body; j += kLanes) {
      _mm256_storeu_ps(x + j, _mm256_fmadd_ps(_mm256_loadu_ps(r0 + j), y0, _mm256_loadu_ps(x + j)));
    }
    if (body < dim) {
      const __m256 acc = _mm256_fmadd_ps(_mm256_maskload_ps(r0 + body, tail_mask), y0,
                                         _mm256_maskload_ps(x + body, tail_mask));
      _mm256_maskstore_ps(x + body, tail_mask, acc);
    }
  }
}

// The Kronecker transform for m = 12, 20, 28. Rows in registers: at most 12
// accumulators of the 16 registers (4 x 2, 4 x 3, 2 x 4).
void KronHadamardAvx2(const float* x, float* y, int rows, int m, const float* columns,
                      const float* pre_signs, const float* post_signs, float scale) {
  switch (m) {
    case 12:
      return KronHadamardImpl<12, 4>(x, y, rows, columns, pre_signs, post_signs, scale);
    case 20:
      return KronHadamardImpl<20, 4>(x, y, rows, columns, pre_signs, post_signs, scale);
    case 28:
      return KronHadamardImpl<28, 2>(x, y, rows, columns, pre_signs, post_signs, scale);
    default:
      return;  // unreachable: Rotation::Create admits no other m
  }
}

}  // namespace rotation_internal

void FastWalshHadamardAvx2(float* x, int n) {
  rotation_internal::SignedFwhtAvx2(x, x, n, nullptr, nullptr);
}

}  // namespace tqkv
