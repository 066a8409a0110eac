// Internal to the CPU backend: the one place where the runtime key and value
// formats of a head become the compile-time parameters of a fused attention
// kernel. Each ISA file instantiates it with its own kernel template:
//
//   struct Avx512Kernels {
//     static constexpr bool kReadsFp8 = false;    // whether Run takes kFp8 fields
//     static constexpr bool kReadsSplit = false;  // and kSplitCentroids keys
//     template <FieldFormat kKey, int kKeyBits, FieldFormat kValue, int kValueBits>
//     static void Run(const HeadAttendParams& params);
//   };
//   ... PickAttendKernel<Avx512Kernels>(key, value) ...
//
// Only the including file's instantiation exists, so the per-ISA compile flags
// of that file apply to it.
#ifndef TQKV_KERNELS_CPU_ATTEND_DISPATCH_H_
#define TQKV_KERNELS_CPU_ATTEND_DISPATCH_H_

#include "kernels/cpu/attend_kernels.h"

namespace tqkv {
namespace cpu_internal {

using AttendKernel = void (*)(const HeadAttendParams&);

template <typename Kernels, FieldFormat kKey, int kKeyBits>
AttendKernel PickAttendKernelForValue(const FieldReader& value) {
  switch (value.format) {
    case FieldFormat::kCentroids:
      switch (value.bits) {
        case 2: return &Kernels::template Run<kKey, kKeyBits, FieldFormat::kCentroids, 2>;
        case 3: return &Kernels::template Run<kKey, kKeyBits, FieldFormat::kCentroids, 3>;
        case 4: return &Kernels::template Run<kKey, kKeyBits, FieldFormat::kCentroids, 4>;
      }
      return nullptr;
    case FieldFormat::kUniform:
      switch (value.bits) {
        case 2: return &Kernels::template Run<kKey, kKeyBits, FieldFormat::kUniform, 2>;
        case 3: return &Kernels::template Run<kKey, kKeyBits, FieldFormat::kUniform, 3>;
        case 4: return &Kernels::template Run<kKey, kKeyBits, FieldFormat::kUniform, 4>;
        case 8: return &Kernels::template Run<kKey, kKeyBits, FieldFormat::kUniform, 8>;
      }
      return nullptr;
    case FieldFormat::kFp16:
      return &Kernels::template Run<kKey, kKeyBits, FieldFormat::kFp16, 16>;
    case FieldFormat::kBf16:
      return &Kernels::template Run<kKey, kKeyBits, FieldFormat::kBf16, 16>;
    case FieldFormat::kFp8:
      if constexpr (Kernels::kReadsFp8) return &Kernels::template Run<kKey, kKeyBits, FieldFormat::kFp8, 8>;
      return nullptr;
    default:
      return nullptr;
  }
}

// nullptr when the pair of formats has no fused kernel (reference path).
template <typename Kernels>
AttendKernel PickAttendKernel(const FieldReader& key, const FieldReader& value) {
  switch (key.format) {
    case FieldFormat::kCentroids:
      switch (key.bits) {
        case 2: return PickAttendKernelForValue<Kernels, FieldFormat::kCentroids, 2>(value);
        case 3: return PickAttendKernelForValue<Kernels, FieldFormat::kCentroids, 3>(value);
        case 4: return PickAttendKernelForValue<Kernels, FieldFormat::kCentroids, 4>(value);
      }
      return nullptr;
    case FieldFormat::kFp16:
      return PickAttendKernelForValue<Kernels, FieldFormat::kFp16, 16>(value);
    case FieldFormat::kBf16:
      return PickAttendKernelForValue<Kernels, FieldFormat::kBf16, 16>(value);
    case FieldFormat::kFp8:
      if constexpr (Kernels::kReadsFp8) return PickAttendKernelForValue<Kernels, FieldFormat::kFp8, 8>(value);
      return nullptr;
    case FieldFormat::kSplitCentroids:
      // kKeyBits packs both parts: 10 * hot bits + cold bits.
      if constexpr (Kernels::kReadsSplit) {
        switch (10 * key.bits + key.cold_bits) {
          case 43: return PickAttendKernelForValue<Kernels, FieldFormat::kSplitCentroids, 43>(value);
          case 42: return PickAttendKernelForValue<Kernels, FieldFormat::kSplitCentroids, 42>(value);
          case 32: return PickAttendKernelForValue<Kernels, FieldFormat::kSplitCentroids, 32>(value);
        }
      }
      return nullptr;
    default:
      return nullptr;
  }
}

}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_ATTEND_DISPATCH_H_
