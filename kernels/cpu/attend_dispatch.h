// Internal to the CPU backend: the one place where the runtime key and value
// formats of a head become the compile-time parameters of a fused attention
// kernel, generated from the shared format table (kernels/format_table.h):
// every pair whose fused_on column has kFusedCpu, every code width its
// families list (FamilyHasBits; two-part TurboQuant keys: KeyFamilyHasBits
// over TQKV_SPLIT_KEY_BITS). Each ISA file instantiates it with its own
// kernel set:
//
//   struct Avx512Kernels {
//     // Which (family, width) instances this instruction set has.
//     static constexpr bool Reads(FormatFamily key, int key_bits, FormatFamily value, int value_bits);
//     template <FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
//     static void Run(const HeadAttendParams& params);
//   };
//   ... PickAttendKernel<Avx512Kernels>(key, value) ...
//
// Only the including file's instantiation exists, so the per-ISA compile flags
// of that file apply to it. A pair the table lists for the CPU that no
// instruction set reads is caught by tests/kernels/format_conformance_test.cc.
#ifndef TQKV_KERNELS_CPU_ATTEND_DISPATCH_H_
#define TQKV_KERNELS_CPU_ATTEND_DISPATCH_H_

#include <utility>

#include "kernels/cpu/attend_kernels.h"
#include "kernels/format_table.h"

namespace tqkv {
namespace cpu_internal {

// Every width a field may be dispatched at: the families' code widths and
// the two-part key widths (SplitKeyBits).
using KeyWidths =
    std::integer_sequence<int, 2, 3, 4, 8, 16, SplitKeyBits(3, 2), SplitKeyBits(4, 2), SplitKeyBits(4, 3)>;
using ValueWidths = std::integer_sequence<int, 2, 3, 4, 8, 16>;

// The kernel for one (pair, widths), or null where the table has no such
// width or this instruction set does not read it (never instantiated then).
template <typename Kernels, FormatFamily kKey, int kKeyBits, FormatFamily kValue, int kValueBits>
constexpr AttendKernel KernelInstance() {
  if constexpr (KeyFamilyHasBits(kKey, kKeyBits) && FamilyHasBits(kValue, kValueBits) &&
                Kernels::Reads(kKey, kKeyBits, kValue, kValueBits)) {
    return &Kernels::template Run<kKey, kKeyBits, kValue, kValueBits>;
  } else {
    return nullptr;
  }
}

template <typename Kernels, FormatFamily kKey, int kKeyBits, FormatFamily kValue, int... kValueBits>
AttendKernel PickValueWidth(int value_bits, std::integer_sequence<int, kValueBits...>) {
  AttendKernel kernel = nullptr;
  ((value_bits == kValueBits ? (kernel = KernelInstance<Kernels, kKey, kKeyBits, kValue, kValueBits>(), 0) : 0), ...);
  return kernel;
}

template <typename Kernels, FormatFamily kKey, FormatFamily kValue, int... kKeyBits>
AttendKernel PickKeyWidth(int key_bits, int value_bits, std::integer_sequence<int, kKeyBits...>) {
  AttendKernel kernel = nullptr;
  ((key_bits == kKeyBits ? (kernel = PickValueWidth<Kernels, kKey, kKeyBits, kValue>(value_bits, ValueWidths{}), 0)
                         : 0),
   ...);
  return kernel;
}

// nullptr when the pair of fields has no fused kernel on this instruction
// set (the backend then tries the next one, down to the reference path).
template <typename Kernels>
AttendKernel PickAttendKernel(const FieldReader& key, const FieldReader& value) {
  FormatPair pair;
  if (!key.readable || !value.readable || value.split() || !FindFormatPair(key.format, value.format, &pair)) {
    return nullptr;
  }
  return VisitFormatPair(pair, AttendKernel{nullptr}, [&](auto tag) -> AttendKernel {
    using Tag = decltype(tag);
    if constexpr ((Tag::kFusedOn & kFusedCpu) == 0) {
      return nullptr;
    } else {
      return PickKeyWidth<Kernels, Tag::kKey, Tag::kValue>(key.dispatch_bits(), value.bits, KeyWidths{});
    }
  });
}

}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_ATTEND_DISPATCH_H_
