// The summation order of the two sums that fix a TurboQuant vector's stored
// scale: its squared norm (in double) and, with norm correction, its
// codeword's squared norm (in float). The order is part of the store format's
// arithmetic: the portable code, the AVX2 and AVX-512 kernels and the CUDA
// store kernel all sum in this one order, so they write the same bytes.
//
// The order: kSumLanes partial sums, each starting at +0; partial j adds the
// terms of coordinates j, j + 16, j + 32, ... in increasing order; then the
// partials fold by halves, partial[j] = partial[j] + partial[j + w] for
// w = 8, 4, 2, 1 and every j < w; the sum is partial[0].
//
// Why this order: sixteen floats are one AVX-512 register (two of doubles), so
// a SIMD path keeps the partials in lanes and folds with three shuffles, and a
// warp keeps them in lanes 0-15 and folds with four xor shuffles; a sequential
// sum is a chain of n dependent adds that no vector unit can shorten.
#ifndef TQKV_KERNELS_BLOCKED_SUMS_H_
#define TQKV_KERNELS_BLOCKED_SUMS_H_

#include "kernels/host_device.h"

namespace tqkv {

inline constexpr int kSumLanes = 16;

// The fold of kSumLanes partial sums (overwrites them).
template <typename T>
TQKV_HOST_DEVICE T FoldSumLanes(T* partial) {
  for (int w = kSumLanes / 2; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) partial[j] = partial[j] + partial[j + w];
  }
  return partial[0];
}

// sum over i of term(i), i in [0, n), in the blocked order.
template <typename T, typename Term>
TQKV_HOST_DEVICE T BlockedSum(int n, Term term) {
  T partial[kSumLanes];
  for (int j = 0; j < kSumLanes; ++j) partial[j] = T(0);
  for (int i = 0; i < n; ++i) partial[i % kSumLanes] = partial[i % kSumLanes] + term(i);
  return FoldSumLanes(partial);
}

}  // namespace tqkv

#endif  // TQKV_KERNELS_BLOCKED_SUMS_H_
