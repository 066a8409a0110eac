// The stored formats the fused attention kernels read, and the (key, value)
// pairs they read together: one table for every backend.
//
// A field (the keys or the values of one head) is stored in one
// FormatFamily; the codecs map onto families (codec.h's CodecKind: kFp16,
// kBf16, kFp8 raw; kUniform; kTurboQuant and kOutlierSplit are TurboQuant
// with one or two parts; kQjl has none, it is evaluation only).
//
//   TQKV_FORMAT_FAMILIES(X)  X(Name, reads_keys, code_bits)
//     reads_keys: the family can hold keys (scores are read from it);
//     code_bits:  FormatBits() mask of the code widths a field may have.
//   TQKV_FORMAT_PAIRS(X)     X(Name, KeyFamily, ValueFamily, tensor_cores, fused_on)
//     every pair with a fused attention kernel; tensor_cores: the CUDA
//     tensor-core kernels have an instance for it (their own limits on head
//     dim, bits and page size still apply: cuda::AttendHmmaShape,
//     cuda::AttendMmaSupported); fused_on: the backends
//     with a fused kernel for it (kFusedCpu, kFusedCuda). A pair a backend
//     lacks still attends there when the backend has a general path (the
//     CPU's reference loop) or is refused at layout time (CUDA: UNIMPLEMENTED).
//   TQKV_SPLIT_KEY_BITS(X)   X(hot_bits, cold_bits)
//     TurboQuant keys in two parts (the outlier split): the widths the CPU
//     kernels are compiled for (the CUDA kernels read parts at run time).
//
// From the tables: FormatFamily and FormatPair (one enumerator per entry, in
// table order), kFormatPairs (each pair's parameters), FindFormatPair
// (runtime families -> pair), and VisitFormatPair / VisitKeyFamily, which turn
// a runtime value into compile-time constants for a generic lambda. Each
// backend wraps those in its own dispatch macro (FlashInfer's DISPATCH_*
// style; CUDA: kernels/cuda/format_dispatch.cuh), so that
//   - adding a pair is one TQKV_FORMAT_PAIRS entry: every backend dispatch
//     instantiates its kernels for it, and a kernel that cannot read one of
//     its families fails to compile (the kernels' format branches end in
//     static_asserts), instead of a switch somewhere silently missing it;
//   - a switch over FormatFamily or FormatPair written by hand has no default,
//     so -Wswitch names a missing case.
//
// The CPU backend (kernels/cpu/attend_dispatch.h) generates its kernel
// choice from the same rows: every pair with kFusedCpu, every width in its
// families' code_bits (and TQKV_SPLIT_KEY_BITS for TurboQuant keys), each
// instruction set's kernels saying which of those they read. The
// conformance test (tests/kernels/format_conformance_test.cc) walks the
// table x backend x instruction set against float64 attention.
//
// Plain constexpr C++ with no includes beyond <cstdint>: nvcc, the host
// emulation and the CPU build all read it.
#ifndef TQKV_KERNELS_FORMAT_TABLE_H_
#define TQKV_KERNELS_FORMAT_TABLE_H_

#include <cstdint>

namespace tqkv {

// Code widths as a bit mask: bit b set = b-bit codes.
constexpr uint32_t FormatBits(int bits) { return uint32_t{1} << bits; }

// The fused_on column: backends with a fused attention kernel for a pair.
constexpr uint32_t kFusedCpu = 1;
constexpr uint32_t kFusedCuda = 2;

// Fp16 / Bf16: raw half or bfloat16 coordinates; Fp8: raw E4M3, no scale;
// Uniform: b-bit codes with an fp16 scale and zero; TurboQuant: one or two
// parts of rotated, codebook-quantized coordinates with fp16 norms.
// clang-format off
#define TQKV_FORMAT_FAMILIES(X)                                                                      \
  /* Name        reads_keys  code_bits */                                                            \
  X(Fp16,        true,       ::tqkv::FormatBits(16))                                                 \
  X(Bf16,        true,       ::tqkv::FormatBits(16))                                                 \
  X(Fp8,         true,       ::tqkv::FormatBits(8))                                                  \
  X(Uniform,     false,      ::tqkv::FormatBits(2) | ::tqkv::FormatBits(3) | ::tqkv::FormatBits(4) | \
                             ::tqkv::FormatBits(8))                                                  \
  X(TurboQuant,  true,       ::tqkv::FormatBits(2) | ::tqkv::FormatBits(3) | ::tqkv::FormatBits(4))

#define TQKV_FORMAT_PAIRS(X)                                                                                 \
  /* Name                 Key          Value        tensor_cores  fused_on */                                \
  X(Fp16Fp16,              Fp16,        Fp16,        true,          ::tqkv::kFusedCpu | ::tqkv::kFusedCuda)  \
  X(Bf16Bf16,              Bf16,        Bf16,        true,          ::tqkv::kFusedCpu | ::tqkv::kFusedCuda)  \
  X(Fp8Fp8,                Fp8,         Fp8,         true,          ::tqkv::kFusedCpu | ::tqkv::kFusedCuda)  \
  X(Fp8Uniform,            Fp8,         Uniform,     true,          ::tqkv::kFusedCpu | ::tqkv::kFusedCuda)  \
  X(TurboQuantUniform,     TurboQuant,  Uniform,     true,          ::tqkv::kFusedCpu | ::tqkv::kFusedCuda)  \
  X(TurboQuantTurboQuant,  TurboQuant,  TurboQuant,  true,          ::tqkv::kFusedCpu | ::tqkv::kFusedCuda)  \
  X(Fp16Bf16,              Fp16,        Bf16,        false,         ::tqkv::kFusedCpu)                       \
  X(Fp16Fp8,               Fp16,        Fp8,         false,         ::tqkv::kFusedCpu)                       \
  X(Fp16Uniform,           Fp16,        Uniform,     false,         ::tqkv::kFusedCpu)                       \
  X(Fp16TurboQuant,        Fp16,        TurboQuant,  false,         ::tqkv::kFusedCpu)                       \
  X(Bf16Fp16,              Bf16,        Fp16,        false,         ::tqkv::kFusedCpu)                       \
  X(Bf16Fp8,               Bf16,        Fp8,         false,         ::tqkv::kFusedCpu)                       \
  X(Bf16Uniform,           Bf16,        Uniform,     false,         ::tqkv::kFusedCpu)                       \
  X(Bf16TurboQuant,        Bf16,        TurboQuant,  false,         ::tqkv::kFusedCpu)                       \
  X(Fp8Fp16,               Fp8,         Fp16,        false,         ::tqkv::kFusedCpu)                       \
  X(Fp8Bf16,               Fp8,         Bf16,        false,         ::tqkv::kFusedCpu)                       \
  X(Fp8TurboQuant,         Fp8,         TurboQuant,  false,         ::tqkv::kFusedCpu)                       \
  X(TurboQuantFp16,        TurboQuant,  Fp16,        false,         ::tqkv::kFusedCpu)                       \
  X(TurboQuantBf16,        TurboQuant,  Bf16,        false,         ::tqkv::kFusedCpu)                       \
  X(TurboQuantFp8,         TurboQuant,  Fp8,         false,         ::tqkv::kFusedCpu)

#define TQKV_SPLIT_KEY_BITS(X) \
  X(4, 3)                      \
  X(4, 2)                      \
  X(3, 2)
// clang-format on

enum class FormatFamily : int32_t {
#define TQKV_FAMILY_ENUM_(name, reads_keys, bits) k##name,
  TQKV_FORMAT_FAMILIES(TQKV_FAMILY_ENUM_)
#undef TQKV_FAMILY_ENUM_
};

enum class FormatPair : int32_t {
#define TQKV_PAIR_ENUM_(name, key, value, tensor_cores, fused_on) k##name,
  TQKV_FORMAT_PAIRS(TQKV_PAIR_ENUM_)
#undef TQKV_PAIR_ENUM_
};

struct FormatFamilyInfo {
  FormatFamily family;
  const char* name;
  bool reads_keys;
  uint32_t code_bits;
};

struct FormatPairInfo {
  FormatPair pair;
  const char* name;
  FormatFamily key;
  FormatFamily value;
  bool tensor_cores;
  uint32_t fused_on;  // kFusedCpu | kFusedCuda
};

inline constexpr FormatFamilyInfo kFormatFamilies[] = {
#define TQKV_FAMILY_INFO_(name, reads_keys, bits) {FormatFamily::k##name, #name, reads_keys, bits},
    TQKV_FORMAT_FAMILIES(TQKV_FAMILY_INFO_)
#undef TQKV_FAMILY_INFO_
};
inline constexpr int kNumFormatFamilies = sizeof(kFormatFamilies) / sizeof(kFormatFamilies[0]);

inline constexpr FormatPairInfo kFormatPairs[] = {
#define TQKV_PAIR_INFO_(name, key, value, tensor_cores, fused_on) \
  {FormatPair::k##name, #name, FormatFamily::k##key, FormatFamily::k##value, tensor_cores, fused_on},
    TQKV_FORMAT_PAIRS(TQKV_PAIR_INFO_)
#undef TQKV_PAIR_INFO_
};
inline constexpr int kNumFormatPairs = sizeof(kFormatPairs) / sizeof(kFormatPairs[0]);

// REQUIRES: the value is an enumerator (the tables are indexed by it).
constexpr const FormatFamilyInfo& FamilyInfo(FormatFamily family) { return kFormatFamilies[static_cast<int>(family)]; }
constexpr const FormatPairInfo& PairInfo(FormatPair pair) { return kFormatPairs[static_cast<int>(pair)]; }

// Each (key family, value family)'s row in kFormatPairs, or -1: the
// backends look pairs up per (item, KV head), so the lookup is one load.
struct FormatPairIndex {
  int8_t row[kNumFormatFamilies][kNumFormatFamilies];
};
constexpr FormatPairIndex MakeFormatPairIndex() {
  FormatPairIndex index{};
  for (auto& key : index.row) {
    for (int8_t& row : key) row = -1;
  }
  for (const FormatPairInfo& info : kFormatPairs) {
    index.row[static_cast<int>(info.key)][static_cast<int>(info.value)] = static_cast<int8_t>(info.pair);
  }
  return index;
}
inline constexpr FormatPairIndex kFormatPairIndex = MakeFormatPairIndex();

// The pair of these families, if the table has it.
constexpr bool FindFormatPair(FormatFamily key, FormatFamily value, FormatPair* pair) {
  const int k = static_cast<int>(key), v = static_cast<int>(value);
  if (k < 0 || k >= kNumFormatFamilies || v < 0 || v >= kNumFormatFamilies) return false;
  const int row = kFormatPairIndex.row[k][v];
  if (row < 0) return false;
  *pair = static_cast<FormatPair>(row);
  return true;
}

// Whether a family stores `bits`-bit codes (FormatBits of its code_bits).
constexpr bool FamilyHasBits(FormatFamily family, int bits) {
  return bits > 0 && bits < 32 && (FamilyInfo(family).code_bits & FormatBits(bits)) != 0;
}

// Two-part TurboQuant keys dispatch as one width: 10 * hot + cold (43, 42,
// 32; hot and cold of 2-8 bits), above every single-part width (at most 16).
constexpr int SplitKeyBits(int hot_bits, int cold_bits) { return 10 * hot_bits + cold_bits; }
constexpr bool IsSplitKeyBits(int bits) { return bits >= 22 && bits <= 88 && bits % 10 >= 2 && bits % 10 <= 8; }
constexpr bool SplitKeyBitsListed(int bits) {
#define TQKV_SPLIT_LISTED_(hot, cold) \
  if (bits == SplitKeyBits(hot, cold)) return true;
  TQKV_SPLIT_KEY_BITS(TQKV_SPLIT_LISTED_)
#undef TQKV_SPLIT_LISTED_
  return false;
}
// Whether keys of `family` come in width `bits` (a split width for
// TurboQuant included).
constexpr bool KeyFamilyHasBits(FormatFamily family, int bits) {
  if (IsSplitKeyBits(bits)) return family == FormatFamily::kTurboQuant && SplitKeyBitsListed(bits);
  return FamilyInfo(family).reads_keys && FamilyHasBits(family, bits);
}

// A pair or a family as compile-time constants.
template <FormatFamily kKeyFamily, FormatFamily kValueFamily, bool kHasTensorCores, uint32_t kFusedOnBackends>
struct FormatPairTag {
  static constexpr FormatFamily kKey = kKeyFamily;
  static constexpr FormatFamily kValue = kValueFamily;
  static constexpr bool kTensorCores = kHasTensorCores;
  static constexpr uint32_t kFusedOn = kFusedOnBackends;
};
template <FormatFamily kFamily>
struct FormatFamilyTag {
  static constexpr FormatFamily kFormat = kFamily;
};

// f(FormatPairTag<...>{}) for `pair`; `fallback` for a value that is no
// enumerator.
template <typename R, typename F>
constexpr R VisitFormatPair(FormatPair pair, R fallback, F&& f) {
  switch (pair) {
#define TQKV_PAIR_CASE_(name, key, value, tensor_cores, fused_on) \
  case FormatPair::k##name:                                       \
    return f(FormatPairTag<FormatFamily::k##key, FormatFamily::k##value, tensor_cores, fused_on>{});
    TQKV_FORMAT_PAIRS(TQKV_PAIR_CASE_)
#undef TQKV_PAIR_CASE_
  }
  return fallback;
}

// f(FormatFamilyTag<family>{}) for a family that reads keys; `fallback` for
// the others.
template <typename R, typename F>
constexpr R VisitKeyFamily(FormatFamily family, R fallback, F&& f) {
  switch (family) {
#define TQKV_KEY_CASE_(name, reads_keys, bits)            \
  case FormatFamily::k##name:                             \
    if constexpr (reads_keys) {                           \
      return f(FormatFamilyTag<FormatFamily::k##name>{}); \
    } else {                                              \
      return fallback;                                    \
    }
    TQKV_FORMAT_FAMILIES(TQKV_KEY_CASE_)
#undef TQKV_KEY_CASE_
  }
  return fallback;
}

}  // namespace tqkv

#endif  // TQKV_KERNELS_FORMAT_TABLE_H_
