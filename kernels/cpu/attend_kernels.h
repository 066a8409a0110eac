// Internal to the CPU backend: the fused attention kernel for one (item, KV
// head), specialised per key and value format and compiled per ISA. The
// backend prepares the queries (rotated into the key codec's basis, logit
// scale folded in), calls the kernel, and maps the value accumulator back.
#ifndef TQKV_KERNELS_CPU_ATTEND_KERNELS_H_
#define TQKV_KERNELS_CPU_ATTEND_KERNELS_H_

#if defined(__AVX2__) && defined(__FMA__)
#include "kernels/simd/simd_mappings.h"
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/code_tiles.h"
#include "kernels/codec.h"
#include "kernels/format_table.h"

namespace tqkv {
namespace cpu_internal {

// How the kernel reads one field of a vector: its family in the shared
// format table (kernels/format_table.h) and its code width. TurboQuant comes
// in one part (packed b-bit codebook indices, 1 fp16 scale) or two (the
// outlier split: hot part, then cold part, each with its own codebook and
// fp16 scale [hot, cold]; keys only).
struct FieldReader {
  bool readable = false;  // false: no family (QJL): the reference path
  FormatFamily format = FormatFamily::kFp16;
  int bits = 0;                      // code width (the hot part's when split)
  const float* centroids = nullptr;  // TurboQuant: 2^bits
  size_t codes_offset = 0;           // plane offsets inside a page
  size_t scalars_offset = 0;
  int code_bytes = 0;   // per token
  int num_scalars = 0;  // per token
  bool tiled = false;   // the codes plane is tiled (kernels/code_tiles.h)
  // Two-part TurboQuant: `bits` and `centroids` are the hot part's; the hot
  // part covers the first hot_dims coordinates of the (rotated) query.
  int parts = 1;
  int hot_dims = 0;
  int cold_bits = 0;
  const float* cold_centroids = nullptr;
  int cold_code_offset = 0;  // bytes from a token's codes to its cold codes

  bool split() const { return parts == 2; }
  // The width the kernels are instantiated for: bits, or SplitKeyBits(hot,
  // cold) for two parts.
  int dispatch_bits() const { return split() ? SplitKeyBits(bits, cold_bits) : bits; }
};

// The format a codec's field has for the fast kernels (not readable for QJL,
// which uses the reference path), its sizes and whether its codes plane is
// tiled (KvLayout's rule); the plane offsets are left to the caller.
FieldReader DescribeField(const VectorCodec& codec);

// Rows are the query vectors that share this KV head: (query token, query
// head) pairs. Row r sees tokens [token_begin, visible[r]) of the block table
// (none when visible[r] <= token_begin: its out is zero and its lse -inf).
inline constexpr int kMaxRows = 64;

// Tokens per online-softmax block in every fused kernel; the add-back and the
// exact tokens are worked out block by block.
inline constexpr int kAttendBlock = 64;

// One rotary frequency theta of the pre-RoPE add-back, tabulated once per
// RopeTable (the backend caches them): the rotations by j theta for the
// tokens of a block, and the step from one block to the next.
struct AddBackFrequency {
  alignas(64) float cos[kAttendBlock];  // cos(j theta), j < kAttendBlock
  alignas(64) float sin[kAttendBlock];  // sin(j theta)
  // The integer kernel's: cos(j theta) in the low and sin(j theta) in the
  // high int16 of each word, in units of 2^-kRotationBits (IntegerAddBack).
  alignas(64) int32_t rotation[kAttendBlock];
  double step[2];  // cos, sin of kAttendBlock theta, in double: blocks chain it
  double theta;

  static constexpr int kRotationBits = 14;
};
AddBackFrequency TabulateAddBackFrequency(double theta);

// Exact tokens (kv_layout.h, "Centering and exact tokens"): token t is read
// from its fp16 copy in an exact page when t < sink_end or t >= recent_begin,
// else from the compressed codes; both kinds in the same walk over the
// tokens and one online softmax. The defaults read nothing exact.
struct ExactTokens {
  int64_t sink_end = 0;
  int64_t recent_begin = INT64_MAX;
  int page_tokens = 0;                   // of an exact page
  const int32_t* block_table = nullptr;  // exact pages, in order (-1 where none is read)
  size_t key_offset = 0;                 // the head's fp16 key and value planes inside an exact page
  size_t value_offset = 0;               // (token-major, 2 * head_dim bytes a token)
  // Row r's query in the original basis (the exact keys are not rotated),
  // head_dim floats at query_rows[r], and the logit scale.
  const float* const* query_rows = nullptr;
  float query_scale = 0.0f;
  // [rows][head_dim]: the exact tokens' share of each row's output, in the
  // original basis, normalised by the same softmax denominator as out (the
  // caller adds it to out mapped back from the value codec's basis).
  float* out = nullptr;

  bool any() const { return sink_end > 0 || recent_begin != INT64_MAX; }
  bool IsExact(int64_t t) const { return t < sink_end || t >= recent_begin; }
};

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
  // logit scale folded in, exact and compressed tokens alike. The constant
  // part is the caller's.
  int addback_pairs = 0;
  const AddBackFrequency* const* addback_freq = nullptr;  // [addback_pairs]
  const float* addback_coef = nullptr;                    // [rows][2 * addback_pairs]
  ExactTokens exact;
  // Logit soft-capping (AttendParams::logit_softcap), 0: none. The kernel's
  // logits lack the add-back's constant part c_r, which the caller adds to
  // the lse, so with a cap row r's logit x becomes
  // cap * tanh((x + c_r) / cap) - c_r (softcap_shift[r] = c_r; null: all 0),
  // after the add-back and the exact tokens joined it, and the lse plus c_r
  // is that of the capped true logits.
  float softcap = 0.0f;
  const float* softcap_shift = nullptr;  // [rows]
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

// Where a run's compressed reads end, for blocks from `first` to `end`: at
// the exact recent tokens; at `first` (none) when the rows see no compressed
// token (a sliding window that lies inside the recent tokens), since a block's tokens
// before token_begin take the codes of its first token seen.
inline int64_t CompressedEnd(const HeadAttendParams& p, int64_t first, int64_t end) {
  const int64_t compressed_end = end < p.exact.recent_begin ? end : p.exact.recent_begin;
  return compressed_end > p.token_begin ? compressed_end : first;
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

// Asks for the lines of tokens [slot, slot + n) of one page: each field's
// codes (a tiled plane's whole tiles) and scalars.
inline void PrefetchPageTokens(const HeadAttendParams& p, const uint8_t* page, int slot, int n) {
  const auto lines = [](const uint8_t* from, size_t bytes) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(from) & ~uintptr_t{63};
    for (uintptr_t at = first; at < reinterpret_cast<uintptr_t>(from) + bytes; at += 64) {
      PrefetchLine(reinterpret_cast<const void*>(at));
    }
  };
  for (const FieldReader* f : {&p.key, &p.value}) {
    // A tiled plane's tokens [slot, slot + n) lie inside their tiles' span.
    const int from = f->tiled ? slot - slot % kTileTokens : slot;
    const int to =
        f->tiled ? std::min(p.page_tokens, (slot + n + kTileTokens - 1) / kTileTokens * kTileTokens) : slot + n;
    lines(page + f->codes_offset + static_cast<size_t>(from) * f->code_bytes,
          static_cast<size_t>(to - from) * f->code_bytes);
    lines(page + f->scalars_offset + static_cast<size_t>(slot) * 2 * f->num_scalars,
          static_cast<size_t>(n) * 2 * f->num_scalars);
  }
}

// The prefetch of a kernel's blocks: block t0's work asks for the block
// kAhead blocks on, in kPieces pieces spread over that work (Next() at its
// start, the others between its steps: after the scores, the softmax, the
// values). A whole block's lines asked at once (about a hundred for 3-bit
// codes) queue behind the core's few outstanding misses and stall the loads
// behind them; spread, they can overlap the arithmetic. Measured on the Xeon
// (one 32k layer, 2 threads, alternating with the one-block prefetch): 4-8%
// faster in a first set of three rounds (turboquant_3bit_nc 2.19-2.28
// against 2.27-2.48 ms), 1-3% (medians 2.38 against 2.41 ms, within the
// noise) in a later set of six; never slower. It walks the block table with
// its own cursor (no divisions per page).
class BlockPrefetch {
 public:
  static constexpr int kAhead = 2;
  static constexpr int kPieces = 4;

  // Blocks of `block` tokens (a multiple of kPieces) from `first`, tokens
  // below `end`. Asks for the blocks before the first that Next reaches.
  BlockPrefetch(const HeadAttendParams& p, int block, int64_t first, int64_t end)
      : p_(p), piece_(block / kPieces), end_(end) {
    next_ = std::min(first + block, end_);
    page_index_ = next_ / p.page_tokens;
    slot_ = static_cast<int>(next_ % p.page_tokens);
    Advance(std::min(first + kAhead * block, end_) - next_);
  }

  // The next piece: kPieces calls per block, in order.
  void Next() { Advance(std::min<int64_t>(piece_, end_ - next_)); }

 private:
  void Advance(int64_t n) {
    while (n > 0) {
      const int count = static_cast<int>(std::min<int64_t>(n, p_.page_tokens - slot_));
      PrefetchPageTokens(p_, p_.pool_base + static_cast<size_t>(p_.block_table[page_index_]) * p_.page_bytes, slot_,
                         count);
      next_ += count;
      n -= count;
      slot_ += count;
      if (slot_ == p_.page_tokens) {
        slot_ = 0;
        ++page_index_;
      }
    }
  }

  const HeadAttendParams& p_;
  const int piece_;
  const int64_t end_;
  int64_t next_;  // the first token not yet asked for
  int64_t page_index_;
  int slot_;
};

#if defined(__AVX2__) && defined(__FMA__)
// The whole words of a full tile of 16 tokens (kernels/code_tiles.h) as
// token-major rows of code_bytes: token t's word w, at tile + 64 w + 4 t,
// to out + t * code_bytes + 4 w. By kLanes x kLanes dword transposes
// (simd_mappings.h: 8 x 8 on AVX2, 16 x 16 on AVX-512): about 4 shuffles a
// token per kLanes words instead of a load and a store per word. In the
// anonymous namespace and under the ISA macros, as the mappings: each
// kernel's file compiles its own copy for its own ISA.
namespace {  // NOLINT(build/namespaces)
template <typename V>
void DetileWordsWith(const uint8_t* tile, int code_bytes, uint8_t* out) {
  constexpr int kLanes = V::kLanes;
  const int words = code_bytes / kTileWordBytes;
  for (int t0 = 0; t0 < kTileTokens; t0 += kLanes) {
    // Word blocks last first: a short last block's stores reach into the
    // next token's first words, which a later (whole) block's stores then
    // write.
    for (int w0 = (words - 1) / kLanes * kLanes; w0 >= 0; w0 -= kLanes) {
      const int n = std::min(kLanes, words - w0);
      typename V::I32 v[kLanes], a[kLanes], b[kLanes], rows[kLanes];
      for (int k = 0; k < kLanes; ++k) v[k] = k < n ? V::LoadI32(tile + 64 * (w0 + k) + 4 * t0) : V::ZeroI32();
      for (int k = 0; k < kLanes; k += 2) {
        a[k] = V::UnpackLo32(v[k], v[k + 1]);
        a[k + 1] = V::UnpackHi32(v[k], v[k + 1]);
      }
      for (int k = 0; k < kLanes; k += 4) {
        b[k] = V::UnpackLo64(a[k], a[k + 2]);
        b[k + 1] = V::UnpackHi64(a[k], a[k + 2]);
        b[k + 2] = V::UnpackLo64(a[k + 1], a[k + 3]);
        b[k + 3] = V::UnpackHi64(a[k + 1], a[k + 3]);
      }
      // 128-bit lane l of b[4 m + r]: token t0 + 4 l + r, words w0 + 4 m
      // ... + 3; the lanes of b[r], b[4 + r], ... transposed are the rows
      // of tokens r, 4 + r, ...
      for (int r = 0; r < 4; ++r) {
        typename V::I32 in[kLanes / 4], lanes[kLanes / 4];
        for (int m = 0; m < kLanes / 4; ++m) in[m] = b[4 * m + r];
        V::TransposeLanes(in, lanes);
        for (int l = 0; l < kLanes / 4; ++l) rows[4 * l + r] = lanes[l];
      }
      // Whole stores in token order: what one writes past its token's words
      // the next token's stores overwrite, and past the last token it lands
      // in the staging slack (BlockWalk::kStageSlack). (Masked stores, which
      // the kernel's loads soon after cannot forward from, were slower.)
      for (int t = 0; t < kLanes; ++t) V::StoreI32(out + static_cast<size_t>(t0 + t) * code_bytes + 4 * w0, rows[t]);
    }
  }
}

void DetileWords(const uint8_t* tile, int code_bytes, uint8_t* out) {
#if defined(__AVX512F__)
  DetileWordsWith<simd::Avx512>(tile, code_bytes, out);
#else
  DetileWordsWith<simd::Avx2>(tile, code_bytes, out);
#endif
}
}  // namespace
#endif

// This thread's staging room for BlockWalk, at least `bytes` (defined in
// cpu_backend.cc, compiled for the baseline ISA: inline code here is
// compiled into every kernel's file, each with its own ISA flags).
uint8_t* BlockWalkStage(size_t bytes);

// Walks a kernel's blocks of tokens page by page, from RunBlockStart. The
// codes of a tiled plane are copied out of their tiles, token-major, into a
// per-thread block of kStagedTokens tokens (with kStageSlack bytes on each
// side for kernels' reads past a token's codes), and the kernel reads them
// there.
class BlockWalk {
 public:
  static constexpr int kStagedTokens = 64;
  static constexpr int kStageSlack = 64;

  BlockWalk(const HeadAttendParams& p, int64_t first)
      : p_(p), page_index_(first / p.page_tokens), slot_(static_cast<int>(first % p.page_tokens)) {
    const size_t field = kStagedTokens * static_cast<size_t>(std::max(p.key.code_bytes, p.value.code_bytes));
    // Token-major copies of both fields, then (NextTiles) tiled copies.
    staged_keys_ = BlockWalkStage(4 * (field + 2 * kStageSlack)) + kStageSlack;
    staged_values_ = staged_keys_ + field + 2 * kStageSlack;
  }

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
    ForPageRuns(count, scalars, [&](const uint8_t* page, int i, int n) {
      // Where tokens [slot_, slot_ + n) of the page, block tokens [i, i +
      // n), have their codes of field f: in the page, or copied out of
      // their tiles into staged (four bytes at a time, a tile's words). A
      // lambda, not a member: each kernel's file is compiled for its own
      // ISA, and a shared inline function could be linked from another's.
      const auto locate = [&](const FieldReader& f, uint8_t* staged, const uint8_t** codes) {
        const uint8_t* plane = page + f.codes_offset;
        if (!f.tiled) {
          for (int k = 0; k < n; ++k) codes[i + k] = plane + static_cast<size_t>(slot_ + k) * f.code_bytes;
          return;
        }
        const int whole = f.code_bytes - f.code_bytes % kTileWordBytes;
        int k = 0;
#if defined(__AVX2__) && defined(__FMA__)
        // Whole tiles by transposes (DetileWords), the rest word by word.
        while (k + kTileTokens <= n && (slot_ + k) % kTileTokens == 0 && slot_ + k + kTileTokens <= p_.page_tokens) {
          const uint8_t* tile = plane + static_cast<size_t>(slot_ + k) * f.code_bytes;
          uint8_t* to = staged + static_cast<size_t>(i + k) * f.code_bytes;
          DetileWords(tile, f.code_bytes, to);
          for (int t = 0; t < kTileTokens; ++t) {
            for (int b = whole; b < f.code_bytes; ++b) {
              to[static_cast<size_t>(t) * f.code_bytes + b] =
                  tile[static_cast<size_t>(whole) * kTileTokens + static_cast<size_t>(f.code_bytes - whole) * t + b -
                       whole];
            }
            codes[i + k + t] = to + static_cast<size_t>(t) * f.code_bytes;
          }
          k += kTileTokens;
        }
#endif
        for (; k < n; ++k) {
          const int slot = slot_ + k, t = slot % kTileTokens;
          const int tile_tokens = std::min(kTileTokens, p_.page_tokens - (slot - t));
          const uint8_t* tile = plane + static_cast<size_t>(slot - t) * f.code_bytes;
          uint8_t* to = staged + static_cast<size_t>(i + k) * f.code_bytes;
          for (int b = 0; b < whole; b += kTileWordBytes) {
            memcpy(to + b, tile + static_cast<size_t>(b) * tile_tokens + kTileWordBytes * t, kTileWordBytes);
          }
          for (int b = whole; b < f.code_bytes; ++b) {
            to[b] = tile[static_cast<size_t>(whole) * tile_tokens + static_cast<size_t>(f.code_bytes - whole) * t + b -
                         whole];
          }
          codes[i + k] = to;
        }
      };
      locate(p_.key, staged_keys_, key_codes);
      locate(p_.value, staged_values_, value_codes);
    });
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

  // The next block as tiles of 16 tokens (kernels/code_tiles.h): key_tiles[g]
  // and value_tiles[g] point at word 0 of group g's tile, word w at + 64 w.
  // That is the page's own tile where the plane is tiled and page_tokens is
  // a multiple of 16 (t0 is then too: RunBlockStart); otherwise a copy made
  // from the tokens' codes (the padding tokens' as Next says). Scalars and
  // padding as Next. REQUIRES: both fields' code_bytes multiples of 4.
  template <typename Scalars, typename Zero>
  void NextTiles(int64_t t0, int count, int padded, const uint8_t** key_tiles, const uint8_t** value_tiles,
                 Scalars&& scalars, Zero&& zero) {
    const int groups = padded / kTileTokens;
    if (p_.key.tiled && p_.value.tiled && p_.page_tokens % kTileTokens == 0) {
      ForPageRuns(count, scalars, [&](const uint8_t* page, int i, int n) {
        for (int g = i / kTileTokens; g * kTileTokens < i + n; ++g) {
          const size_t slot = static_cast<size_t>(slot_ + g * kTileTokens - i);
          key_tiles[g] = page + p_.key.codes_offset + slot * p_.key.code_bytes;
          value_tiles[g] = page + p_.value.codes_offset + slot * p_.value.code_bytes;
        }
      });
      for (int i = 0; i < p_.token_begin - t0; ++i) zero(i);
      for (int i = count; i < padded; ++i) zero(i);
      return;
    }
    const uint8_t* key_codes[kStagedTokens];
    const uint8_t* value_codes[kStagedTokens];
    Next(t0, count, padded, key_codes, value_codes, scalars, zero);
    // Copies into tiles, after the token-major copies Next may have made.
    uint8_t* tiles = staged_values_ +
                     kStagedTokens * static_cast<size_t>(std::max(p_.key.code_bytes, p_.value.code_bytes)) +
                     kStageSlack;
    const auto retile = [&](const FieldReader& f, const uint8_t* const* codes, const uint8_t** out) {
      for (int g = 0; g < groups; ++g) {
        uint8_t* tile = tiles;
        tiles += static_cast<size_t>(kTileTokens) * f.code_bytes;
        for (int w = 0; w < f.code_bytes / kTileWordBytes; ++w) {
          for (int i = 0; i < kTileTokens; ++i) {
            memcpy(tile + kTileWordBytes * (kTileTokens * w + i), codes[g * kTileTokens + i] + kTileWordBytes * w,
                   kTileWordBytes);
          }
        }
        out[g] = tile;
      }
    };
    retile(p_.key, key_codes, key_tiles);
    retile(p_.value, value_codes, value_tiles);
  }

 private:
  // The block's tokens [0, count) run by run inside pages: run(page, i, n)
  // for block tokens [i, i + n) at slots [slot_, slot_ + n) of `page`, then
  // scalars(key_scalars, value_scalars, i, n) with the run's scalars.
  template <typename Scalars, typename Run>
  void ForPageRuns(int count, Scalars& scalars, Run&& run) {
    for (int i = 0; i < count;) {
      const uint8_t* page = p_.pool_base + static_cast<size_t>(p_.block_table[page_index_]) * p_.page_bytes;
      const int n = std::min(count - i, p_.page_tokens - slot_);
      run(page, i, n);
      scalars(page + p_.key.scalars_offset + 2 * slot_ * p_.key.num_scalars,
              page + p_.value.scalars_offset + 2 * slot_ * p_.value.num_scalars, i, n);
      i += n;
      slot_ += n;
      if (slot_ == p_.page_tokens) {
        slot_ = 0;
        ++page_index_;
      }
    }
  }

  const HeadAttendParams& p_;
  int64_t page_index_;
  int slot_;
  uint8_t* staged_keys_ = nullptr;
  uint8_t* staged_values_ = nullptr;
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
// page_tokens; pages laid out as KvLayout lays them out. Both are the one
// float kernel of attend_body.h, instantiated per ISA; neither reads outside
// a token's codes and scalars (the integer kernel reads whole tiles, below).
// AttendHeadAvx512: a CPU with AVX-512 F, BW, VL and DQ.
// AttendHeadAvx2: a CPU with AVX2, FMA and F16C.
void AttendHeadAvx512(const HeadAttendParams& params);
void AttendHeadAvx2(const HeadAttendParams& params);

// The integer kernel (SimdLevel::kAvx512Vnni: AVX-512 with VNNI, VBMI and VBMI2):
// scores and values with int8 dot products, on the pages' codes tiles. It
// reads whole tiles (a partial group's other slots too, whose scores it
// masks and whose weights are zero) and the tokens' scalars, nothing else.
// Against exact attention over the same bytes it differs by these
// roundings:
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
