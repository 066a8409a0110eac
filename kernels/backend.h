// The compute backend interface: store, score and attend over a page pool laid
// out by a KvLayout. One implementation per device (kernels/cpu/, kernels/cuda/),
// chosen at start-up; the cache and the service see only this interface.
//
// Kernels take plain Params structs: pointers, counts, block tables. Host
// pointers (keys, values, queries, outputs, block tables) are always host
// memory; the pool is the backend's own memory (host for the CPU backend,
// device for CUDA), which the backend allocates and frees.
//
// Concurrency: a backend is thread-safe. Callers guarantee that no two calls
// write the same page slots at once and that no call reads slots another call
// is writing; the cache's bookkeeping provides that (appends write only slots
// beyond every reader's visible prefix).
#ifndef TQKV_KERNELS_BACKEND_H_
#define TQKV_KERNELS_BACKEND_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kv_layout.h"

namespace tqkv {

// A pool of `num_pages` pages of `layout.page_bytes()` bytes in backend memory.
struct PagePool {
  uint8_t* base = nullptr;
  size_t page_bytes = 0;
  int32_t num_pages = 0;
};

// Quantize and pack tokens into their page slots, for a range of layers and
// all KV heads.
struct StoreParams {
  const KvLayout* layout = nullptr;
  PagePool pool;
  int layer_begin = 0;  // [layer_begin, layer_end)
  int layer_end = 0;
  int64_t num_tokens = 0;
  // Destination of token i: slots[i] = page * page_tokens + slot_in_page.
  const int32_t* slots = nullptr;
  // [layer_end - layer_begin, num_tokens, num_kv_heads, head_dim] row-major.
  const float* keys = nullptr;
  const float* values = nullptr;
  // Exact copies in the same call (kv_layout.h, "exact tokens"): with
  // exact_slots, token i is also stored, at fp16, in slot exact_slots[i]
  // (page * exact page_tokens + slot) of exact_layout's pages, or nowhere
  // where exact_slots[i] is -1. Null: no exact copies. REQUIRES: exact_layout
  // is layout->exact_layout() when exact_slots is set.
  const KvLayout* exact_layout = nullptr;
  const int32_t* exact_slots = nullptr;
};

// The exact copies a Store asks for (StoreParams::exact_slots) as a Store of
// their own into params.exact_layout: the tokens that have an exact slot,
// their rows gathered into `keys` and `values`, their slots into `slots`
// (which back the returned params). num_tokens 0 when none has one. For
// backends that store the exact copies in a second pass.
StoreParams ExactStorePart(const StoreParams& params, std::vector<float>* keys, std::vector<float>* values,
                           std::vector<int32_t>* slots);

// Centering and exact tokens (kv_layout.h). A sequence's reads carry, with
// its block table:
//   exact_block_table  its exact pages (layout->exact_layout()), in order; an
//                      entry may be -1 where no token of the page is read
//                      exact any more. Null when the layout has no exact
//                      tokens.
//   key_mean           the key means of the layer read, [num_kv_heads,
//                      head_dim], as the cache subtracted them before Store
//                      (key_centering.h), followed with sequence key scales
//                      by the sequence's scales, [num_kv_heads, head_dim]
//                      (layout->mean_floats() floats in all). Null without
//                      centering. Stored keys are read with the query times
//                      layout->key_scales(layer, head, key_mean).
// Token t of a layer holding `length` tokens is read from its exact copy
// when t < ranges.sink_end or t >= ranges.recent_begin
// (layout->exact_ranges(length)), else from its compressed copy; the logit
// adds back scale * q . R_t m.
//
// Chunks and sliding windows (kv_layout.h). Every block table a read carries
// is the table of the read layer's chunk (KvLayout::layer_chunk), and a Store
// writes layers of one chunk. In a sliding-window layer
// (layout->layer_window(layer) = W > 0), Attend's query token at position p
// sees tokens [max(0, p + 1 - W), p + 1) only; entries of pages all of whose
// tokens lie before that may be -1 and are never read. Score reads only
// [token_begin, token_end), which the cache keeps within what it holds.
//
// Exact pages are pages of the same pool (the exact layout's pages are no
// larger than pool.page_bytes, which stays the stride).

// Attention logits of one layer: logits[h][t] = scale * <q_h, k_{kv(h), t}>
// for tokens t in [token_begin, token_end) of one sequence, which holds
// `length` tokens in that layer. These are the true logits (the add-back
// whole), never soft-capped: since they are whole, a cap is the caller's
// elementwise post-pass (the service's, for ScoreQuery).
struct ScoreParams {
  const KvLayout* layout = nullptr;
  PagePool pool;
  int layer = 0;
  const int32_t* block_table = nullptr;  // pages of the sequence, in order
  int64_t token_begin = 0;
  int64_t token_end = 0;
  const float* queries = nullptr;  // [num_query_heads, head_dim]
  float scale = 0.0f;              // usually 1 / sqrt(head_dim)
  float* logits = nullptr;         // [num_query_heads, token_end - token_begin]
  // Centering and exact tokens: see above. `length` matters only with exact
  // tokens (it places the recent tokens).
  const int32_t* exact_block_table = nullptr;
  const float* key_mean = nullptr;
  int64_t length = 0;
};

// One (sequence, layer, query tokens) item of a decode batch.
struct AttendItem {
  const int32_t* block_table = nullptr;
  // Tokens of this layer in the cache, including the item's own query tokens
  // when they were appended first (decode appends, then attends). Query token
  // i of n sits at position QueryPosition(item, i) and sees tokens
  // [0, VisibleEnd(item, i)): causal among the query tokens, everything
  // before them; in a sliding-window layer only the last `window` of those
  // (see above).
  int64_t context_tokens = 0;
  int layer = 0;
  int num_query_tokens = 1;
  const float* queries = nullptr;  // [num_query_tokens, num_query_heads, head_dim]
  float* output = nullptr;         // same shape as queries
  float* lse = nullptr;            // optional [num_query_tokens, num_query_heads], natural log
  // Centering and exact tokens: see above.
  const int32_t* exact_block_table = nullptr;
  const float* key_mean = nullptr;
  // -1: the query tokens are the last n stored ones (positions
  // context_tokens - n + i). >= 0: query token i sits at this position + i,
  // anywhere (after the stored tokens: a prefill reading a stored prefix),
  // and sees the stored tokens up to it. REQUIRES (the cache checks): every
  // query token sees at least one token.
  int64_t first_query_position = -1;
};

// Position of query token i of `item` (see AttendItem).
inline int64_t QueryPosition(const AttendItem& item, int64_t i) {
  return (item.first_query_position >= 0 ? item.first_query_position : item.context_tokens - item.num_query_tokens) + i;
}

// End of the stored tokens query token i sees: min(context_tokens, its
// position + 1).
inline int64_t VisibleEnd(const AttendItem& item, int64_t i) {
  return std::min<int64_t>(item.context_tokens, QueryPosition(item, i) + 1);
}

struct AttendParams {
  const KvLayout* layout = nullptr;
  PagePool pool;
  absl::Span<const AttendItem> items;
  float scale = 0.0f;  // logit scale, usually 1 / sqrt(head_dim)
  // Logit soft-capping (Gemma 2), 0: none. When > 0 each true logit x
  // (scale * q . k plus the whole add-back, exact tokens alike) becomes
  // logit_softcap * tanh(x / logit_softcap) before the softmax, and lse is
  // the log-sum-exp of the capped logits. REQUIRES: finite and >= 0 (the
  // cache checks). A kernel that leaves the add-back's constant part c to
  // the lse applies x -> cap * tanh((x + c) / cap) - c to its logits.
  float logit_softcap = 0.0f;
};

// Where the calling thread's last call on a backend spent its time, beside
// the call's wall time (which the caller measures): the device time of its
// kernels (CUDA events around them; host staging and copies excluded), and
// the time it waited for a free workspace before it could start. Wall minus
// both is host work: planning, staging, copies, synchronisation.
struct CallTiming {
  double device_seconds = -1.0;  // < 0: not measured (the CPU backend)
  double wait_seconds = 0.0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda".
  virtual std::string name() const = 0;
  // Human-readable device ("2 x86-64 threads, AVX-512", "NVIDIA H200").
  virtual std::string device() const = 0;

  // Allocates a pool once, at start-up. RESOURCE_EXHAUSTED when the memory is
  // not there. The pool lives until FreePool.
  virtual absl::StatusOr<PagePool> AllocatePool(const KvLayout& layout, int32_t num_pages) = 0;

  // OK when the backend can serve caches of this layout; UNIMPLEMENTED,
  // saying what it lacks, otherwise. The cache asks before it allocates.
  virtual absl::Status SupportsLayout(const KvLayout& layout) const { return absl::OkStatus(); }
  virtual void FreePool(PagePool pool) = 0;

  // OK while the device can run calls. UNAVAILABLE, for good, once a call
  // found the device lost (a sticky CUDA error: illegal address, launch
  // failure, uncorrectable ECC); every compute and copy call then fails fast
  // with that status, without touching the device. Only a new process
  // recovers. The CPU backend is never lost. Thread-safe and cheap: the
  // server asks after each failed call (health turns NOT_SERVING).
  virtual absl::Status DeviceStatus() const { return absl::OkStatus(); }

  // The timing of the calling thread's last Store, Score, Attend or CopyPage
  // on this backend (after it returned OK; unspecified after a failure). The
  // default: nothing measured. Cheap (a thread-local read).
  virtual CallTiming LastCallTiming() const { return CallTiming(); }

  // Copies one whole page (copy-on-write of a shared partial page).
  virtual absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) = 0;

  // Copies whole pages out of the pool into host memory (pages[i] to
  // host + i * page_bytes), or back in: how sequences move between servers
  // and to disk at their compressed size. INVALID_ARGUMENT for a page outside
  // the pool (nothing copied).
  virtual absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> pages, uint8_t* host) = 0;
  virtual absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> pages, const uint8_t* host) = 0;

  // Fails with INVALID_ARGUMENT on non-finite input (nothing is guaranteed
  // about the destination slots then; the cache never publishes them).
  // Store writes the tokens into the pages of params.layout, which is the
  // cache's layout or its exact_layout() (the cache stores every token in the
  // first and the exact ones in the second too, with the pool's stride).
  virtual absl::Status Store(const StoreParams& params) = 0;
  virtual absl::Status Score(const ScoreParams& params) = 0;
  virtual absl::Status Attend(const AttendParams& params) = 0;

  // A decode layer: Store(store), then Attend(attend), as one call, so that
  // a device runs both on one stream with one synchronization (one copy in,
  // one copy out). The attend items may read the slots the store writes.
  // The first failure is returned; after a failed store nothing is
  // guaranteed about the attention outputs. The default runs the two calls.
  virtual absl::Status StoreAndAttend(const StoreParams& store, const AttendParams& attend) {
    absl::Status stored = Store(store);
    if (!stored.ok()) return stored;
    return Attend(attend);
  }
};

}  // namespace tqkv

#endif  // TQKV_KERNELS_BACKEND_H_
