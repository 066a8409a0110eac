// Internal to the CPU backend: the fused attention kernel for one (item, KV
// head), specialised per key and value format and compiled per ISA. The
// backend prepares the queries (rotated into the key codec's basis, logit
// scale folded in), calls the kernel, and maps the value accumulator back.
#ifndef TQKV_KERNELS_CPU_ATTEND_KERNELS_H_
#define TQKV_KERNELS_CPU_ATTEND_KERNELS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/codec.h"

namespace tqkv {
namespace cpu_internal {

// How the kernel reads one field of a vector.
enum class FieldFormat {
  kUnsupported,  // take the reference path
  kCentroids,    // TurboQuant: packed b-bit codebook indices, 1 fp16 scale
  kUniform,      // packed b-bit uniform codes, fp16 [scale, zero]
  kFp16,         // raw fp16
  kBf16,         // raw bf16
  kFp8,          // raw fp8 E4M3, no scalars
  kSplitCentroids,  // split TurboQuant: hot part, then cold part, each with its
                    // own codebook and fp16 scale [hot, cold] (AVX2 kernel only)
};

struct FieldReader {
  FieldFormat format = FieldFormat::kUnsupported;
  int bits = 0;
  const float* centroids = nullptr;  // kCentroids: 2^bits
  size_t codes_offset = 0;           // plane offsets inside a page
  size_t scalars_offset = 0;
  int code_bytes = 0;                // per token
  int num_scalars = 0;               // per token
  // kSplitCentroids: `bits` and `centroids` are the hot part's; the hot part
  // covers the first hot_dims coordinates of the (rotated) query.
  int hot_dims = 0;
  int cold_bits = 0;
  const float* cold_centroids = nullptr;
  int cold_code_offset = 0;          // bytes from a token's codes to its cold codes
};

// The format a codec's field has for the fast kernels (kUnsupported for QJL,
// which uses the reference path).
FieldReader DescribeField(const VectorCodec& codec);

// Rows are the query vectors that share this KV head: (query token, query
// head) pairs. Row r sees tokens [token_begin, visible[r]) of the block table
// (none when visible[r] <= token_begin: its out is zero and its lse -inf).
inline constexpr int kMaxRows = 64;

struct HeadAttendParams {
  int head_dim = 0;
  int page_tokens = 0;
  const uint8_t* pool_base = nullptr;
  size_t page_bytes = 0;
  const int32_t* block_table = nullptr;
  FieldReader key;
  FieldReader value;
  int rows = 0;                      // 1..kMaxRows
  const float* queries = nullptr;    // [rows][head_dim], in the key basis, logit scale folded in
  const int64_t* visible = nullptr;  // [rows]
  int64_t token_begin = 0;
  // Pre-RoPE add-back (kernels/key_centering.h): the logit of row r at token t
  // gains sum_i coef[r][i] cos(t theta_i) + coef[r][pairs + i] sin(t theta_i),
  // logit scale folded in. The constant part is the caller's.
  int addback_pairs = 0;
  const double* addback_inv_freq = nullptr;  // [addback_pairs]
  const float* addback_coef = nullptr;       // [rows][2 * addback_pairs]
  // Outputs: the value accumulator (in the value codec's basis) normalised by
  // the softmax denominator, and the log-sum-exp of each row.
  float* out = nullptr;  // [rows][head_dim]
  float* lse = nullptr;  // [rows]
};

// Where a kernel's blocks of `block` tokens start: on a page boundary at or
// below token_begin, within one block (a run starting inside a page cost up
// to 12% at long context). Tokens before token_begin are masked and read as
// copies of the first one (an exact page may hold garbage there).
inline int64_t RunBlockStart(const HeadAttendParams& p, int block) {
  const int64_t step = p.page_tokens < block ? p.page_tokens : block;
  return p.token_begin - p.token_begin % step;
}

// Asks the memory system for the four planes of tokens [begin, end) ahead of
// their use (through BlockPrefetch, below), into L2 (prefetcht2: on
// this project's AMD machines it measured steadier than prefetcht0, bf16's
// 32k layer 7.1-7.4 ms against 8.4-10.5). Each page's planes start cold,
// and the hardware prefetchers do not follow a block table into the next
// page: without it a 32k 3-bit layer took 3-4x longer. The prefetch is an
// asm statement: from __builtin_prefetch, GCC 12 left no prefetch
// instruction in the kernels (objdump finds none in any build before
// 2026-12-02), and an asm volatile cannot be dropped.
inline void PrefetchLine(const void* at) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(at)));
#else
  __builtin_prefetch(at, 0, 1);
#endif
}

inline void PrefetchTokens(const HeadAttendParams& p, int64_t begin, int64_t end) {
  const auto lines = [](const uint8_t* from, size_t bytes) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(from) & ~uintptr_t{63};
    for (uintptr_t at = first; at < reinterpret_cast<uintptr_t>(from) + bytes; at += 64) {
      PrefetchLine(reinterpret_cast<const void*>(at));
    }
  };
  for (int64_t t = begin; t < end;) {
    const int64_t slot = t % p.page_tokens;
    const int64_t n = std::min<int64_t>(end - t, p.page_tokens - slot);
    const uint8_t* page = p.pool_base + static_cast<size_t>(p.block_table[t / p.page_tokens]) * p.page_bytes;
    for (const FieldReader* f : {&p.key, &p.value}) {
      lines(page + f->codes_offset + slot * f->code_bytes, n * f->code_bytes);
      lines(page + f->scalars_offset + slot * 2 * f->num_scalars, n * 2 * f->num_scalars);
    }
    t += n;
  }
}

// The prefetch of a kernel's blocks: block t0's work asks for the block
// kAhead blocks on, in kPieces pieces spread over that work (Piece(t0, 0)
// at its start, the others between its steps: after the scores, the
// softmax, the values). A whole block's lines asked at once (about a hundred
// for 3-bit codes) queue behind the core's few outstanding misses and stall
// the loads behind them; spread, they can overlap the arithmetic. Measured
// on the Xeon (one 32k layer, 2 threads, alternating with the one-block
// prefetch): 4-8% faster in a first set of three rounds (turboquant_3bit_nc
// 2.19-2.28 against 2.27-2.48 ms), 1-3% (medians 2.38 against 2.41 ms,
// within the noise) in a later set of six; never slower.
class BlockPrefetch {
 public:
  static constexpr int kAhead = 2;
  static constexpr int kPieces = 4;

  // Blocks of `block` tokens (a multiple of kPieces) from `first`, tokens
  // below `end`. Asks for the blocks before the first that Piece reaches.
  BlockPrefetch(const HeadAttendParams& p, int block, int64_t first, int64_t end)
      : p_(p), block_(block), end_(end) {
    PrefetchTokens(p_, std::min(first + block_, end_), std::min(first + kAhead * block_, end_));
  }

  void Piece(int64_t t0, int piece) const {
    const int64_t begin = t0 + kAhead * block_ + piece * (block_ / kPieces);
    PrefetchTokens(p_, std::min(begin, end_), std::min(begin + block_ / kPieces, end_));
  }

 private:
  const HeadAttendParams& p_;
  const int block_;
  const int64_t end_;
};

// Walks a kernel's blocks of tokens page by page, from RunBlockStart.
class BlockWalk {
 public:
  BlockWalk(const HeadAttendParams& p, int64_t first)
      : p_(p), page_index_(first / p.page_tokens), slot_(static_cast<int>(first % p.page_tokens)) {}

  // The next block: `count` tokens from t0, padded to `padded`. Fills
  // key_codes[0, padded) and value_codes[0, padded) with where each token's
  // codes live; calls scalars(key_scalars, value_scalars, i, n) for each run
  // of n tokens from i in one page, with the run's scalars; then zero(i) for
  // each padding slot, whose scalars the kernel sets to zero: the tokens
  // before token_begin (copies of the first one the run reads: an exact
  // page may hold garbage there) and those from count on (copies of the
  // block's first). Padding scores are masked and its weights are zero.
  template <typename Scalars, typename Zero>
  void Next(int64_t t0, int count, int padded, const uint8_t** key_codes, const uint8_t** value_codes,
            Scalars&& scalars, Zero&& zero) {
    for (int i = 0; i < count;) {
      const uint8_t* page = p_.pool_base + static_cast<size_t>(p_.block_table[page_index_]) * p_.page_bytes;
      const int n = std::min(count - i, p_.page_tokens - slot_);
      const uint8_t* keys = page + p_.key.codes_offset + static_cast<size_t>(slot_) * p_.key.code_bytes;
      const uint8_t* values = page + p_.value.codes_offset + static_cast<size_t>(slot_) * p_.value.code_bytes;
      for (int k = 0; k < n; ++k) {
        key_codes[i + k] = keys + k * p_.key.code_bytes;
        value_codes[i + k] = values + k * p_.value.code_bytes;
      }
      scalars(page + p_.key.scalars_offset + 2 * slot_ * p_.key.num_scalars,
              page + p_.value.scalars_offset + 2 * slot_ * p_.value.num_scalars, i, n);
      i += n;
      slot_ += n;
      if (slot_ == p_.page_tokens) {
        slot_ = 0;
        ++page_index_;
      }
    }
    for (int i = 0; i < p_.token_begin - t0; ++i) {
      key_codes[i] = key_codes[p_.token_begin - t0];
      value_codes[i] = value_codes[p_.token_begin - t0];
      zero(i);
    }
    for (int i = count; i < padded; ++i) {
      key_codes[i] = key_codes[0];
      value_codes[i] = value_codes[0];
      zero(i);
    }
  }

 private:
  const HeadAttendParams& p_;
  int64_t page_index_;
  int slot_;
};

// Row tiles of 4, then 2, then 1: tile(std::integral_constant<int, R>, r0)
// for each, so that a tile's accumulators are sized at compile time.
template <typename F>
inline void ForRowTiles(int rows, F&& tile) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) tile(std::integral_constant<int, 4>{}, r);
  if (rows - r >= 2) {
    tile(std::integral_constant<int, 2>{}, r);
    r += 2;
  }
  if (r < rows) tile(std::integral_constant<int, 1>{}, r);
}

// A fused kernel: fills params.out and params.lse.
using AttendKernel = void (*)(const HeadAttendParams& params);

// Whether AttendHeadAvx512 / AttendHeadAvx2 handle this pair of formats at
// this head dim (both: a multiple of 16).
bool AttendHeadAvx512Supported(const FieldReader& key, const FieldReader& value, int head_dim);
bool AttendHeadAvx2Supported(const FieldReader& key, const FieldReader& value, int head_dim);
// AttendHeadAvx512Vnni: centroid keys (or split keys whose two parts are each
// 64 coordinates or a multiple of 128), centroid or uniform values, 2-4 bits
// each, head_dim 64 or a multiple of 128.
bool AttendHeadAvx512VnniSupported(const FieldReader& key, const FieldReader& value, int head_dim);

// REQUIRES: the matching Supported(...); rows in [1, kMaxRows]; any
// page_tokens; pages laid out as KvLayout lays them out: the AVX-512 kernel
// reads 3-bit value codes with 8-byte loads that start a byte before a token's
// codes and end a byte after them, in the key planes before the value codes
// plane and the value scalars plane after it.
// AttendHeadAvx512: a CPU with AVX-512 F, BW, VL and DQ.
// AttendHeadAvx2: a CPU with AVX2, FMA and F16C.
void AttendHeadAvx512(const HeadAttendParams& params);
void AttendHeadAvx2(const HeadAttendParams& params);

// The integer kernel (SimdLevel::kAvx512Vnni: AVX-512 with VNNI and VBMI):
// scores and values with int8 dot products. It reads no byte outside a
// token's codes and scalars. Against exact attention over the same bytes it
// differs by these roundings:
// - the query, per row (and per part of split keys), to int8 (step
//   max |q| / 127);
// - the key codebook (each part's) and the value codebook to int8
//   (IntegerKeyUnit, ValueUnit: a step of max |centroid| / 127 to / 96,
//   whichever rounds the centroids least);
// - each weight (softmax weight x the token's value scale) to unsigned 8-bit
//   fixed point per row and block of 64 tokens (a step u of the block's
//   largest weight / 255), rounded so that the weight of every run of the
//   block's tokens, in the kernel's order, stays within 0.625 u of exact.
//   By summation by parts a row's value sum then moves by at most
//   1.25 u x (the sum of |value / scale| over the block's tokens) per
//   block; the softmax denominator and the uniform codes' zero terms are
//   exact.
// A 3-bit codebook's own error is about 18% of a coordinate (4 bits: 10%),
// and these roundings raise the output error against exact attention by
// under 2% of itself (BackendQuality.IntegerKernelStaysInsideTheCodecsErrorBudget).
// AttendKernels in cpu_backend_test.cc holds the kernel to the codebook and
// query roundings exactly, and to the weights' within the bound above.
void AttendHeadAvx512Vnni(const HeadAttendParams& params);

// The integer kernel's key unit for a codebook: centroid i is read as
// unit * lrint(centroids[i] / unit), |that| <= 127 units.
float IntegerKeyUnit(const float* centroids, int count);
// Its value unit, chosen the same way: |lrint(centroids[i] / unit)| <= 127.
float ValueUnit(const float* centroids, int count);

}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_ATTEND_KERNELS_H_
