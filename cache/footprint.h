// What one sequence holds, computed from the layout alone: the pages the
// cache keeps for a sequence of a given length, in the state a decode loop
// leaves it in (the last append one token long), with the byte counts the
// cache reports for it. Capacity planning (`tqkv capacity`) reads it; the
// footprint test pins it to what a real KvCache holds after the same
// appends, so the two cannot drift apart.
#ifndef TQKV_CACHE_FOOTPRINT_H_
#define TQKV_CACHE_FOOTPRINT_H_

#include <cstdint>

#include "kernels/kv_layout.h"

namespace tqkv {

struct SequenceFootprint {
  int64_t pages = 0;        // pool pages of the compressed tokens, every chunk
  int64_t exact_pages = 0;  // pool pages of exact copies (sinks, recent tokens), every chunk
  // (pages + exact_pages) * page_bytes: what the sequence takes from the
  // pool, page padding and unfilled slots included.
  uint64_t pool_bytes = 0;
  // Key means (fp32, one per layer and KV head), held beside the pool.
  uint64_t mean_bytes = 0;
  // SequenceInfo::stored_bytes for the same sequence (KvLayout::layer_bytes
  // summed: compressed tokens, exact copies, key means; no padding), and the
  // bf16 bytes of the tokens held.
  uint64_t stored_bytes = 0;
  uint64_t stored_bytes_bf16 = 0;
  int64_t total_pages() const { return pages + exact_pages; }
};

// The footprint of a sequence holding `length` tokens in every layer whose
// last append was one token (a decode step): sliding-window layers hold
// their window's pages only, exact pages outside the sinks and the recent
// tokens are given back. A longer last append (a prefill chunk) can hold more pages
// of a windowed layer until the next step. length <= 0: all zero.
SequenceFootprint FootprintOf(const KvLayout& layout, int64_t length);

}  // namespace tqkv

#endif  // TQKV_CACHE_FOOTPRINT_H_
