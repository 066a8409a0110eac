// Vector math written once on a float-vector mapping S (simd_mappings.h):
// exp for softmax arguments and the logit soft cap, for the fused attention
// kernels of kernels/cpu/ (attend_body.h on Avx2 and Avx512, the integer
// kernel's softmax on Avx512). Same anonymous-namespace rule as the mappings:
// include only from files compiled for one ISA.
#ifndef TQKV_KERNELS_SIMD_SIMD_MATH_H_
#define TQKV_KERNELS_SIMD_SIMD_MATH_H_

#include "kernels/simd/simd_mappings.h"

namespace tqkv {
namespace simd {
namespace {

// exp(x) for x <= 0 (softmax arguments), relative error < 2e-7: Cody-Waite
// range reduction to |r| <= ln2/2, a degree-6 Taylor polynomial, and 2^n
// (n >= -126 after the clamp) applied exactly (S::Pow2Scale).
template <class S>
inline typename S::F32 Exp(typename S::F32 x) {
  using F32 = typename S::F32;
  x = S::Max(x, S::Set1(-87.0f));
  const F32 n = S::RoundNearest(S::Mul(x, S::Set1(1.44269504088896341f)));
  F32 r = S::Fnmadd(n, S::Set1(0.693359375f), x);
  r = S::Fnmadd(n, S::Set1(-2.12194440e-4f), r);
  F32 p = S::Set1(1.0f / 720);
  p = S::Fmadd(p, r, S::Set1(1.0f / 120));
  p = S::Fmadd(p, r, S::Set1(1.0f / 24));
  p = S::Fmadd(p, r, S::Set1(1.0f / 6));
  p = S::Fmadd(p, r, S::Set1(0.5f));
  p = S::Fmadd(p, r, S::Set1(1.0f));
  p = S::Fmadd(p, r, S::Set1(1.0f));
  return S::Pow2Scale(p, n);
}

// The soft cap of logits whose constant part `shift` is added later:
// cap * tanh((x + shift) / cap) - shift. tanh(|y|) = (1 - e) / (1 + e) with
// e = exp(-2 |y|) (Exp's domain), its sign restored: absolute error about
// 3e-7 cap. -inf gives -cap - shift (callers mask after).
template <class S>
inline typename S::F32 SoftCap(typename S::F32 x, typename S::F32 cap, typename S::F32 inv_cap, typename S::F32 shift) {
  using F32 = typename S::F32;
  const F32 one = S::Set1(1.0f);
  const F32 y = S::Mul(S::Add(x, shift), inv_cap);
  const F32 e = Exp<S>(S::Mul(S::Set1(-2.0f), S::Abs(y)));
  const F32 t = S::Div(S::Sub(one, e), S::Add(one, e));
  return S::Fmsub(cap, S::WithSignOf(t, y), shift);
}

}  // namespace
}  // namespace simd
}  // namespace tqkv

#endif  // TQKV_KERNELS_SIMD_SIMD_MATH_H_
