// The SIMD rotation kernels behind rotation.h, written once as templates on a
// float-vector mapping S (simd_mappings.h) and instantiated by
// hadamard_avx2.cc and hadamard_avx512.cc, each compiled for its ISA: the
// fast Walsh-Hadamard transform (with the sign diagonal fused into its loads
// and stores), the Kronecker transform for dims 2^k * {12, 20, 28} and the
// dense matrix-vector products.
//
// The transform is bit-identical to FastWalshHadamardScalar: every element sees
// the same (a + b) / (a - b) operations, stage h = 1, 2, 4, ... in order, and
// one final multiply by the same rounded 1/sqrt(n). Within a register a stage
// is a permute and an FMA against a +-1 vector (S::InRegisterButterflies);
// strides of a register and more add and subtract whole registers.
//
// Include it only from files compiled for one ISA: those two, and the store
// kernels (encode_avx2.cc, encode_avx512.cc), whose fused TurboQuant kernels
// run TransformBlock's stages on their own registers (anonymous namespace:
// each file gets its own copy, see simd_mappings.h). The entry points (rotation_kernels.h) end
// with ZeroUpper: functions that take vector arguments end without
// vzeroupper, and a last call may become a tail jump, which would leave the
// caller's SSE code running with a dirty upper state (on the Xeon, that made
// the whole TurboQuant store 1.8x slower).
#ifndef TQKV_KERNELS_SIMD_HADAMARD_BODY_H_
#define TQKV_KERNELS_SIMD_HADAMARD_BODY_H_

#include <immintrin.h>

#include <cmath>
#include <cstddef>

#include "kernels/simd/simd_mappings.h"
#include "kernels/rotation.h"

namespace tqkv {
namespace hadamard {
namespace {

inline void ZeroUpper() { _mm256_zeroupper(); }

// Registers of floats transformed entirely in registers before strides cross
// memory.
constexpr int kBlockRegs = 8;

// Output scaling: v * scale, or v * (scale * post) with the sign diagonal
// folded in (exact, since post is +-1).
template <class S>
inline typename S::F32 Finish(typename S::F32 v, typename S::F32 scale, const float* post, ptrdiff_t offset) {
  if (post == nullptr) return S::Mul(v, scale);
  return S::Mul(v, S::Mul(scale, S::Load(post + offset)));
}

// Stages of stride kHr, 2 kHr, ... < kRegs registers: whole-register butterflies.
// Compile-time strides keep v[] in registers after unrolling.
template <class S, int kRegs, int kHr = 1>
inline void CrossRegisterStages(typename S::F32* v) {
  if constexpr (kHr < kRegs) {
#pragma GCC unroll 16
    for (int j = 0; j < kRegs / 2; ++j) {
      const int lo = (j / kHr) * 2 * kHr + j % kHr;
      const typename S::F32 a = v[lo];
      const typename S::F32 b = v[lo + kHr];
      v[lo] = S::Add(a, b);
      v[lo + kHr] = S::Sub(a, b);
    }
    CrossRegisterStages<S, kRegs, 2 * kHr>(v);
  }
}

// All stages of a kRegs-register block, held in registers: reads in (times
// pre when given), writes out; scales (and applies post) when finish is set.
template <class S, int kRegs>
inline void SignedStages(const float* pre, typename S::F32* v);

template <class S, int kRegs>
inline void TransformBlock(const float* in, float* out, const float* pre, const float* post, bool finish,
                           typename S::F32 scale) {
  constexpr int kLanes = S::kLanes;
  typename S::F32 v[kRegs];
#pragma GCC unroll 16
  for (int r = 0; r < kRegs; ++r) v[r] = S::Load(in + r * kLanes);
  SignedStages<S, kRegs>(pre, v);
  if (finish) {
#pragma GCC unroll 16
    for (int r = 0; r < kRegs; ++r) v[r] = Finish<S>(v[r], scale, post, r * kLanes);
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRegs; ++r) S::Store(out + r * kLanes, v[r]);
}

// TransformBlock's work on registers: v times pre (when given), then every
// stage within and across the kRegs registers.
template <class S, int kRegs>
inline void SignedStages(const float* pre, typename S::F32* v) {
  if (pre != nullptr) {
#pragma GCC unroll 32
    for (int r = 0; r < kRegs; ++r) v[r] = S::Mul(v[r], S::Load(pre + r * S::kLanes));
  }
#pragma GCC unroll 32
  for (int r = 0; r < kRegs; ++r) v[r] = S::InRegisterButterflies(v[r]);
  CrossRegisterStages<S, kRegs>(v);
}

// The same on x * inv_norm, loaded into v[0, kRegs), before the final scale:
// the store kernels' rotation of y = x * (1 / norm) (ScaleAvx512 / ScaleAvx2,
// then SignedFwht), kept in registers. The caller multiplies by 1 / sqrt(n).
template <class S, int kRegs>
inline void ScaledTransformStages(const float* x, float inv_norm, const float* pre, typename S::F32* v) {
  const typename S::F32 s = S::Set1(inv_norm);
#pragma GCC unroll 32
  for (int r = 0; r < kRegs; ++r) v[r] = S::Mul(S::Load(x + r * S::kLanes), s);
  SignedStages<S, kRegs>(pre, v);
}

// One stage of stride h >= kLanes over all of x; the last stage finishes.
template <class S>
void StridePass(float* x, int n, int h, const float* post, bool finish, typename S::F32 scale) {
  for (int i = 0; i < n; i += 2 * h) {
    for (int j = i; j < i + h; j += S::kLanes) {
      const typename S::F32 a = S::Load(x + j);
      const typename S::F32 b = S::Load(x + j + h);
      typename S::F32 sum = S::Add(a, b);
      typename S::F32 diff = S::Sub(a, b);
      if (finish) {
        sum = Finish<S>(sum, scale, post, j);
        diff = Finish<S>(diff, scale, post, j + h);
      }
      S::Store(x + j, sum);
      S::Store(x + j + h, diff);
    }
  }
}

// Stages h and 2h (h >= kLanes) in one sweep: the same butterflies as two passes.
template <class S>
void StridePass2(float* x, int n, int h, const float* post, bool finish, typename S::F32 scale) {
  for (int i = 0; i < n; i += 4 * h) {
    for (int j = i; j < i + h; j += S::kLanes) {
      const typename S::F32 x0 = S::Load(x + j);
      const typename S::F32 x1 = S::Load(x + j + h);
      const typename S::F32 x2 = S::Load(x + j + 2 * h);
      const typename S::F32 x3 = S::Load(x + j + 3 * h);
      const typename S::F32 s01 = S::Add(x0, x1);
      const typename S::F32 d01 = S::Sub(x0, x1);
      const typename S::F32 s23 = S::Add(x2, x3);
      const typename S::F32 d23 = S::Sub(x2, x3);
      typename S::F32 y0 = S::Add(s01, s23);
      typename S::F32 y1 = S::Add(d01, d23);
      typename S::F32 y2 = S::Sub(s01, s23);
      typename S::F32 y3 = S::Sub(d01, d23);
      if (finish) {
        y0 = Finish<S>(y0, scale, post, j);
        y1 = Finish<S>(y1, scale, post, j + h);
        y2 = Finish<S>(y2, scale, post, j + 2 * h);
        y3 = Finish<S>(y3, scale, post, j + 3 * h);
      }
      S::Store(x + j, y0);
      S::Store(x + j + h, y1);
      S::Store(x + j + 2 * h, y2);
      S::Store(x + j + 3 * h, y3);
    }
  }
}

// The butterfly stages of stride h0, 2 h0, ... < n over all of y, two at a
// time where they fit; the last one finishes (scale, then post).
template <class S>
void StridePasses(float* y, int n, int h0, const float* post, typename S::F32 scale) {
  int h = h0;
  while (h < n) {
    if (4 * h <= n) {
      StridePass2<S>(y, n, h, post, 4 * h == n, scale);
      h *= 4;
    } else {
      StridePass<S>(y, n, h, post, 2 * h == n, scale);
      h *= 2;
    }
  }
}

// y = diag(post) H diag(pre) x / sqrt(n); pre and post may be null (identity).
// x == y allowed. REQUIRES: n a power of two.
template <class S>
void SignedFwht(const float* x, float* y, int n, const float* pre_signs, const float* post_signs) {
  if (n < S::kLanes) {
    for (int i = 0; i < n; ++i) y[i] = pre_signs != nullptr ? x[i] * pre_signs[i] : x[i];
    FastWalshHadamardScalar(y, n);
    if (post_signs != nullptr) {
      for (int i = 0; i < n; ++i) y[i] *= post_signs[i];
    }
    return;
  }
  const typename S::F32 scale = S::Set1(static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))));
  // Up to kBlockRegs registers: one block in registers.
  switch (n / S::kLanes) {
    case 1:
      return TransformBlock<S, 1>(x, y, pre_signs, post_signs, true, scale);
    case 2:
      return TransformBlock<S, 2>(x, y, pre_signs, post_signs, true, scale);
    case 4:
      return TransformBlock<S, 4>(x, y, pre_signs, post_signs, true, scale);
    case 8:
      return TransformBlock<S, 8>(x, y, pre_signs, post_signs, true, scale);
    default:
      break;
  }
  constexpr int kBlock = S::kLanes * kBlockRegs;
  for (int i = 0; i < n; i += kBlock) {
    TransformBlock<S, kBlockRegs>(x + i, y + i, pre_signs == nullptr ? nullptr : pre_signs + i, nullptr, false, scale);
  }
  StridePasses<S>(y, n, kBlock, post_signs, scale);
}

// y = M x, M row-major dim x dim: four rows at a time share each load of x.
// REQUIRES: y does not alias x.
template <class S>
void DenseForward(const float* m, const float* x, float* y, int dim) {
  using F32 = typename S::F32;
  constexpr int kLanes = S::kLanes;
  const int body = dim / kLanes * kLanes;
  const typename S::Mask tail = S::TailMask(dim - body);
  int i = 0;
  for (; i + 4 <= dim; i += 4) {
    const float* r0 = m + static_cast<size_t>(i) * dim;
    const float* r1 = r0 + dim;
    const float* r2 = r1 + dim;
    const float* r3 = r2 + dim;
    F32 a0 = S::Zero(), a1 = S::Zero(), a2 = S::Zero(), a3 = S::Zero();
    for (int j = 0; j < body; j += kLanes) {
      const F32 xv = S::Load(x + j);
      a0 = S::Fmadd(S::Load(r0 + j), xv, a0);
      a1 = S::Fmadd(S::Load(r1 + j), xv, a1);
      a2 = S::Fmadd(S::Load(r2 + j), xv, a2);
      a3 = S::Fmadd(S::Load(r3 + j), xv, a3);
    }
    if (body < dim) {
      const F32 xv = S::MaskLoad(x + body, tail);
      a0 = S::Fmadd(S::MaskLoad(r0 + body, tail), xv, a0);
      a1 = S::Fmadd(S::MaskLoad(r1 + body, tail), xv, a1);
      a2 = S::Fmadd(S::MaskLoad(r2 + body, tail), xv, a2);
      a3 = S::Fmadd(S::MaskLoad(r3 + body, tail), xv, a3);
    }
    S::StoreSums4(a0, a1, a2, a3, y + i);
  }
  for (; i < dim; ++i) {
    const float* r0 = m + static_cast<size_t>(i) * dim;
    F32 a0 = S::Zero();
    for (int j = 0; j < body; j += kLanes) a0 = S::Fmadd(S::Load(r0 + j), S::Load(x + j), a0);
    if (body < dim) a0 = S::Fmadd(S::MaskLoad(r0 + body, tail), S::MaskLoad(x + body, tail), a0);
    y[i] = S::HorizontalSum(a0);
  }
}

// x = M^T y as x += sum_i y_i * row_i, four rows per sweep over x.
// REQUIRES: x does not alias y.
template <class S>
void DenseInverse(const float* m, const float* y, float* x, int dim) {
  using F32 = typename S::F32;
  constexpr int kLanes = S::kLanes;
  const int body = dim / kLanes * kLanes;
  const typename S::Mask tail = S::TailMask(dim - body);
  for (int j = 0; j < dim; ++j) x[j] = 0.0f;
  int i = 0;
  for (; i + 4 <= dim; i += 4) {
    const float* r0 = m + static_cast<size_t>(i) * dim;
    const float* r1 = r0 + dim;
    const float* r2 = r1 + dim;
    const float* r3 = r2 + dim;
    const F32 y0 = S::Set1(y[i]), y1 = S::Set1(y[i + 1]), y2 = S::Set1(y[i + 2]), y3 = S::Set1(y[i + 3]);
    for (int j = 0; j < body; j += kLanes) {
      F32 acc = S::Load(x + j);
      acc = S::Fmadd(S::Load(r0 + j), y0, acc);
      acc = S::Fmadd(S::Load(r1 + j), y1, acc);
      acc = S::Fmadd(S::Load(r2 + j), y2, acc);
      acc = S::Fmadd(S::Load(r3 + j), y3, acc);
      S::Store(x + j, acc);
    }
    if (body < dim) {
      F32 acc = S::MaskLoad(x + body, tail);
      acc = S::Fmadd(S::MaskLoad(r0 + body, tail), y0, acc);
      acc = S::Fmadd(S::MaskLoad(r1 + body, tail), y1, acc);
      acc = S::Fmadd(S::MaskLoad(r2 + body, tail), y2, acc);
      acc = S::Fmadd(S::MaskLoad(r3 + body, tail), y3, acc);
      S::MaskStore(x + body, tail, acc);
    }
  }
  for (; i < dim; ++i) {
    const float* r0 = m + static_cast<size_t>(i) * dim;
    const F32 y0 = S::Set1(y[i]);
    for (int j = 0; j < body; j += kLanes) S::Store(x + j, S::Fmadd(S::Load(r0 + j), y0, S::Load(x + j)));
    if (body < dim) {
      S::MaskStore(x + body, tail, S::Fmadd(S::MaskLoad(r0 + body, tail), y0, S::MaskLoad(x + body, tail)));
    }
  }
}

// The Kronecker transform (H_rows kron F) diag(pre) for m = 12, 20, 28, in the
// operation order of KronHadamardScalar (rotation.cc). A row of m floats
// takes ceil(m / kLanes) registers, the last one masked; kRows rows at a time
// stay in registers through the product with F and the first log2(kRows)
// butterfly stages.

template <class S, int kM>
inline constexpr int kRowParts = (kM + S::kLanes - 1) / S::kLanes;

// Part v of a kM-float row: a full or, for the last part, masked load.
template <class S, int kM>
inline typename S::F32 LoadRowPart(const float* row, int v) {
  constexpr int kParts = kRowParts<S, kM>;
  return v + 1 < kParts ? S::Load(row + v * S::kLanes)
                        : S::MaskLoad(row + v * S::kLanes, S::TailMask(kM - (kParts - 1) * S::kLanes));
}

template <class S, int kM>
inline void StoreRowPart(float* row, int v, typename S::F32 value) {
  constexpr int kParts = kRowParts<S, kM>;
  if (v + 1 < kParts) {
    S::Store(row + v * S::kLanes, value);
  } else {
    S::MaskStore(row + v * S::kLanes, S::TailMask(kM - (kParts - 1) * S::kLanes), value);
  }
}

// kRows rows (kRows * kM floats at x and y): y = (H_kRows kron F) diag(pre) x,
// times (scale * post) when finish is set. x == y allowed.
template <class S, int kM, int kRows>
void KronRowGroup(const float* x, float* y, const float* columns, const float* pre, const float* post, bool finish,
                  float scale_value) {
  using F32 = typename S::F32;
  constexpr int kParts = kRowParts<S, kM>;
  const F32 scale = S::Set1(scale_value);
  // The whole input is read before any output is written (x == y).
  float t[kRows * kM];
  if (pre != nullptr) {
    for (int i = 0; i < kRows * kM; ++i) t[i] = x[i] * pre[i];
  } else {
    for (int i = 0; i < kRows * kM; ++i) t[i] = x[i];
  }
  F32 acc[kRows][kParts];
#pragma GCC unroll 4
  for (int v = 0; v < kParts; ++v) {
    const F32 column = LoadRowPart<S, kM>(columns, v);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) acc[r][v] = S::Mul(S::Set1(t[r * kM]), column);
  }
  for (int k = 1; k < kM; ++k) {
#pragma GCC unroll 4
    for (int v = 0; v < kParts; ++v) {
      const F32 column = LoadRowPart<S, kM>(columns + k * kM, v);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) acc[r][v] = S::Fmadd(S::Set1(t[r * kM + k]), column, acc[r][v]);
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
        const F32 a = acc[lo][v];
        const F32 b = acc[lo + h][v];
        acc[lo][v] = S::Add(a, b);
        acc[lo + h][v] = S::Sub(a, b);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kParts; ++v) {
      F32 out = acc[r][v];
      if (finish) {
        out = post == nullptr ? S::Mul(out, scale) : S::Mul(out, S::Mul(scale, LoadRowPart<S, kM>(post + r * kM, v)));
      }
      StoreRowPart<S, kM>(y + r * kM, v, out);
    }
  }
}

// Rows a group keeps in registers: a power of two up to 8 whose accumulators
// (rows x parts) leave room in the register file (12 of AVX2's 16, 16 of
// AVX-512's 32).
template <class S, int kM>
constexpr int KronGroupRows() {
  const int budget = S::kRegisters == 16 ? 12 : 16;
  int rows = 8;
  while (rows > 1 && rows * kRowParts < S, kM >> budget) rows /= 2;
  return rows;
}

// All rows: groups of kMaxRows in registers, then the remaining butterfly
// stages as whole-register passes (a group is a multiple of kLanes floats).
template <class S, int kM>
void KronHadamardRows(const float* x, float* y, int rows, const float* columns, const float* pre, const float* post,
                      float scale_value) {
  constexpr int kMaxRows = KronGroupRows<S, kM>();
  static_assert(kMaxRows * kM % S::kLanes == 0, "stride passes need whole registers");
  if (rows == 1) return KronRowGroup<S, kM, 1>(x, y, columns, pre, post, true, scale_value);
  if (rows == 2) return KronRowGroup<S, kM, 2>(x, y, columns, pre, post, true, scale_value);
  if constexpr (kMaxRows >= 4) {
    if (rows == 4) return KronRowGroup<S, kM, 4>(x, y, columns, pre, post, true, scale_value);
  }
  if constexpr (kMaxRows >= 8) {
    if (rows == 8) return KronRowGroup<S, kM, 8>(x, y, columns, pre, post, true, scale_value);
  }
  const int n = rows * kM;
  constexpr int kGroup = kMaxRows * kM;
  for (int i = 0; i < n; i += kGroup) {
    KronRowGroup<S, kM, kMaxRows>(x + i, y + i, columns, pre == nullptr ? nullptr : pre + i, nullptr, false,
                                  scale_value);
  }
  StridePasses<S>(y, n, kGroup, post, S::Set1(scale_value));
}

// KronHadamard* of rotation_kernels.h.
template <class S>
void KronHadamard(const float* x, float* y, int rows, int m, const float* columns, const float* pre_signs,
                  const float* post_signs, float scale) {
  switch (m) {
    case 12:
      return KronHadamardRows<S, 12>(x, y, rows, columns, pre_signs, post_signs, scale);
    case 20:
      return KronHadamardRows<S, 20>(x, y, rows, columns, pre_signs, post_signs, scale);
    case 28:
      return KronHadamardRows<S, 28>(x, y, rows, columns, pre_signs, post_signs, scale);
    default:
      return;  // unreachable: Rotation::Create admits no other m
  }
}

}  // namespace
}  // namespace hadamard
}  // namespace tqkv

#endif  // TQKV_KERNELS_SIMD_HADAMARD_BODY_H_
