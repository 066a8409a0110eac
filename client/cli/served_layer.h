// What a server holds for one layer of a sequence, built for the benchmarks
// (`tqkv bench attend`, tqkv_gpu_bench) by the server's own code.
//
// A benchmark of a recipe preset (key centering, exact sink and recent
// tokens) measures what is served only if it reads the state a server would
// hold: the key mean the cache estimates from a layer's first append and
// trims to the layout's centering_pairs, keys stored as residuals, exact
// copies of that context's sinks and recent tokens, the exact pages of
// tokens no longer recent released. Re-deriving each of these by hand drifts (tqkv_gpu_bench
// once passed a dense mean of all 64 pairs and 128 exact recent tokens). So
// BuildServedLayer appends the tokens through a KvCache of the layout, as the
// server's Append does, and exports the sequence at each context
// (KvCache::ExportSequence: the tables and mean the cache's own Attend passes
// to Backend::Attend, which an import reads bit-identically). A benchmark
// places the pages in a pool of its own (PlaceServedState) and times
// Backend::Attend alone, without the cache's per-call bookkeeping (lock,
// table snapshots, page pins), which would otherwise be part of every row.
//
// tests/cli/served_layer_test.cc checks the layout (ServedLayoutOptions
// against the server's embedded configuration) and the reads (Backend::Attend
// of a placed state against KvCache::Attend of a server-configured cache).
//
// Thread safety: plain functions; results belong to the caller.
#ifndef TQKV_CLIENT_CLI_SERVED_LAYER_H_
#define TQKV_CLIENT_CLI_SERVED_LAYER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/cli/model_layouts.h"
#include "kernels/backend.h"
#include "kernels/kv_layout.h"

namespace tqkv {
namespace cli {

// Llama-3.1's rotary embedding (half-split pairs, base 500000, llama3
// scaling by 8), as the server's embedded configuration declares it
// (service/config.cc): pre-RoPE centering rotates the mean with it.
RopeOptions ServedRope();

// The layout of one layer of `shape` with `preset` in a server configured
// like the embedded default: `page_tokens`-token pages, no boundary layers,
// ServedRope(), and KvLayoutOptions' defaults for every field such a
// configuration leaves unset (the preset's recipe of centering, sinks and
// recent tokens; the mean's tokens and pairs). Hot channels (split presets) are
// the caller's to add.
KvLayoutOptions ServedLayoutOptions(std::string_view preset, const ModelShape& shape, int page_tokens);

// Fills keys and values, [n, num_kv_heads, head_dim] each, with tokens
// [t0, t0 + n) of the layer.
using TokenSource = std::function<void(int64_t t0, int64_t n, std::vector<float>* keys, std::vector<float>* values)>;

// One context's state as KvCache::ExportSequence gives it, its pages
// numbered 0 .. num_pages - 1.
struct ServedState {
  int64_t context_tokens = 0;
  int32_t num_pages = 0;
  std::vector<int32_t> block_table;        // ceil(context / page_tokens) page numbers
  std::vector<int32_t> exact_block_table;  // -1: released; empty without exact tokens
  std::vector<float> key_mean;             // [num_kv_heads, head_dim]; empty without centering
  std::vector<uint8_t> pages;              // num_pages x layout page_bytes()
};

struct ServedLayer {
  std::shared_ptr<const KvLayout> layout;  // KvLayout::Create(options), as the cache's
  std::vector<ServedState> states;         // one per context, in the order asked
};

// Appends tokens [0, largest context) of `tokens` to one sequence of a
// KvCache of `options` on `backend` (a pool of its own, freed on return), in
// appends of at most `append_tokens` that end at every context, and exports
// the sequence at each. The first append holds the mean's tokens when the
// smallest context does (at least sinks + centering_tokens).
// Errors: INVALID_ARGUMENT for no context, a context < 1, or options that are
// not one full-attention layer; otherwise what KvLayout::Create,
// KvCache::Create, Append and ExportSequence return.
absl::StatusOr<ServedLayer> BuildServedLayer(const KvLayoutOptions& options, Backend& backend,
                                             absl::Span<const int64_t> contexts, const TokenSource& tokens,
                                             int64_t append_tokens = 2048);

// The most pages a state of `context` tokens holds: its compressed pages and
// the exact pages of its sinks and recent tokens. Pools sized from it hold the state
// (BuildServedLayer fails otherwise), so they can be allocated first.
int64_t ServedPagesBound(const KvLayout& layout, int64_t context);

// `state`'s block tables renumbered to pool pages [first_page, first_page +
// num_pages); -1 entries stay.
struct PlacedTables {
  std::vector<int32_t> block_table;
  std::vector<int32_t> exact_block_table;  // empty without exact tokens
};
PlacedTables RenumberServedState(const ServedState& state, int32_t first_page);

// Writes `state`'s pages to pool pages [first_page, first_page + num_pages)
// (Backend::WritePages) and returns its renumbered tables. INVALID_ARGUMENT
// when they do not fit the pool.
absl::StatusOr<PlacedTables> PlaceServedState(Backend& backend, const PagePool& pool, const ServedState& state,
                                              int32_t first_page);

// What a state's reads cost beyond plain compressed tokens, read from the
// state itself (for the benchmarks' headers, and the tests).
struct ServedRecipe {
  KeyCentering centering = KeyCentering::kNone;
  int mean_pairs = 0;  // active RoPE pairs of the mean, the most over KV heads
  int rope_pairs = 0;  // RoPE pairs of the head dim (pre-RoPE centering)
  int64_t sinks = 0;   // tokens read exact from the start (ExactRanges::sink_end)
  int64_t recent = 0;  // tokens read exact at the end (context - recent_begin)
  // "pre-RoPE centering (8 of 64 pairs), 4 sinks + 64 recent exact", or "plain".
  std::string Describe() const;
};
ServedRecipe DescribeServedState(const KvLayout& layout, const ServedState& state);

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_SERVED_LAYER_H_
