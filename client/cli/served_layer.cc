#include "client/cli/served_layer.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cache/kv_cache.h"
#include "kernels/key_centering.h"

namespace tqkv {
namespace cli {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr char kSequence[] = "served";

// The state of the cache's sequence now, its pages read out.
absl::StatusOr<ServedState> Export(KvCache& cache, int64_t context) {
  absl::StatusOr<SequenceImage> image = cache.ExportSequence(kSequence);
  if (!image.ok()) return image.status();
  if (image->layer_tokens.size() != 1 || image->layer_tokens[0] != context || image->tables.size() != 1) {
    return absl::InternalError(absl::StrFormat("the served sequence does not hold one layer of %d tokens", context));
  }
  ServedState state;
  state.context_tokens = context;
  state.num_pages = static_cast<int32_t>(image->num_pages);
  state.block_table = std::move(image->tables[0]);
  if (!image->exact_tables.empty()) state.exact_block_table = std::move(image->exact_tables[0]);
  state.key_mean = std::move(image->key_means[0]);
  state.pages = std::move(image->pages);
  return state;
}

}  // namespace

RopeOptions ServedRope() {
  RopeOptions rope;
  rope.pair_layout = RopePairLayout::kHalfSplit;
  rope.base = 500000.0;
  rope.scaling = RopeScaling::kLlama3;
  rope.scaling_factor = 8.0;
  rope.low_freq_factor = 1.0;
  rope.high_freq_factor = 4.0;
  rope.original_max_position = 8192;
  return rope;
}

KvLayoutOptions ServedLayoutOptions(std::string_view preset, const ModelShape& shape, int page_tokens) {
  KvLayoutOptions options;
  options.num_layers = 1;
  options.num_kv_heads = shape.num_kv_heads;
  options.num_query_heads = shape.num_query_heads;
  options.head_dim = shape.head_dim;
  options.page_tokens = page_tokens;
  options.preset = std::string(preset);
  options.boundary_layers = 0;
  options.rope = ServedRope();
  return options;
}

int64_t ServedPagesBound(const KvLayout& layout, int64_t context) {
  int64_t pages = CeilDiv(context, layout.page_tokens());
  if (layout.has_exact_tokens()) {
    const int64_t per_page = layout.exact_page_tokens();
    const ExactRanges r = layout.exact_ranges(context);
    pages += CeilDiv(r.sink_end, per_page) + CeilDiv(context, per_page) - r.recent_begin / per_page;
  }
  return pages;
}

absl::StatusOr<ServedLayer> BuildServedLayer(const KvLayoutOptions& options, Backend& backend,
                                             absl::Span<const int64_t> contexts, const TokenSource& tokens,
                                             int64_t append_tokens) {
  if (contexts.empty() || *std::min_element(contexts.begin(), contexts.end()) < 1 || append_tokens < 1) {
    return absl::InvalidArgumentError("a served layer needs contexts of at least one token");
  }
  if (options.num_layers != 1 || !options.layer_windows.empty()) {
    return absl::InvalidArgumentError("a served layer is one full-attention layer");
  }
  ServedLayer served;
  absl::StatusOr<std::shared_ptr<const KvLayout>> layout = KvLayout::Create(options);
  if (!layout.ok()) return layout.status();
  served.layout = *layout;
  const int64_t longest = *std::max_element(contexts.begin(), contexts.end());
  // Room for the sequence at its longest, twice its exact pages (an append
  // stores the new recent tokens' before it releases the old ones'), and spare.
  const int64_t pages = ServedPagesBound(**layout, longest);
  const int64_t exact_pages = pages - CeilDiv(longest, (*layout)->page_tokens());
  CacheOptions cache_options;
  cache_options.name = "served";
  cache_options.layout = options;
  cache_options.memory_budget_bytes = (pages + exact_pages + 8) * (*layout)->page_bytes();
  absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(cache_options, &backend);
  if (!cache.ok()) return cache.status();

  // Contexts in increasing order; states back in the order asked.
  std::vector<size_t> order(contexts.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return contexts[a] < contexts[b]; });
  served.states.resize(contexts.size());
  int64_t length = 0;
  std::vector<float> keys, values;
  for (size_t i : order) {
    while (length < contexts[i]) {
      AppendRequest append;
      append.sequence_id = kSequence;
      append.start_position = length;
      append.layer_begin = 0;
      append.layer_end = 1;
      append.num_tokens = std::min(append_tokens, contexts[i] - length);
      tokens(length, append.num_tokens, &keys, &values);
      append.keys = keys.data();
      append.values = values.data();
      if (absl::Status s = (*cache)->Append(append); !s.ok()) return s;
      length += append.num_tokens;
    }
    absl::StatusOr<ServedState> state = Export(**cache, length);
    if (!state.ok()) return state.status();
    if (state->num_pages > ServedPagesBound(**layout, length)) {
      return absl::InternalError(
          absl::StrFormat("the served sequence of %d tokens holds %d pages; ServedPagesBound "
                          "says at most %d",
                          length, state->num_pages, ServedPagesBound(**layout, length)));
    }
    served.states[i] = *std::move(state);
  }
  return served;
}

PlacedTables RenumberServedState(const ServedState& state, int32_t first_page) {
  const auto renumber = [first_page](std::vector<int32_t> table) {
    for (int32_t& page : table) page = page < 0 ? page : page + first_page;
    return table;
  };
  return PlacedTables{renumber(state.block_table), renumber(state.exact_block_table)};
}

absl::StatusOr<PlacedTables> PlaceServedState(Backend& backend, const PagePool& pool, const ServedState& state,
                                              int32_t first_page) {
  if (first_page < 0 || static_cast<int64_t>(first_page) + state.num_pages > pool.num_pages) {
    return absl::InvalidArgumentError(absl::StrFormat("%d pages from page %d do not fit a pool of %d pages",
                                                      state.num_pages, first_page, pool.num_pages));
  }
  std::vector<int32_t> pages(state.num_pages);
  std::iota(pages.begin(), pages.end(), first_page);
  if (absl::Status s = backend.WritePages(pool, pages, state.pages.data()); !s.ok()) return s;
  return RenumberServedState(state, first_page);
}

ServedRecipe DescribeServedState(const KvLayout& layout, const ServedState& state) {
  ServedRecipe recipe;
  recipe.centering = state.key_mean.empty() ? KeyCentering::kNone : layout.key_centering();
  recipe.rope_pairs = layout.rope(0).num_pairs();
  for (size_t head = 0; !state.key_mean.empty() && head < static_cast<size_t>(layout.num_kv_heads()); ++head) {
    const int pairs =
        static_cast<int>(ActivePairs(layout.rope(0), state.key_mean.data() + head * layout.head_dim()).size());
    recipe.mean_pairs = std::max(recipe.mean_pairs, pairs);
  }
  if (layout.has_exact_tokens()) {
    const ExactRanges r = layout.exact_ranges(state.context_tokens);
    recipe.sinks = r.sink_end;
    recipe.recent = state.context_tokens - r.recent_begin;
  }
  return recipe;
}

std::string ServedRecipe::Describe() const {
  std::string out;
  if (centering == KeyCentering::kPreRope) {
    out = absl::StrFormat("pre-RoPE centering (%d of %d pairs)", mean_pairs, rope_pairs);
  } else if (centering == KeyCentering::kPostRope) {
    out = "post-RoPE centering";
  }
  if (sinks + recent > 0) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", absl::StrFormat("%d sinks + %d recent exact", sinks, recent));
  }
  return out.empty() ? "plain" : out;
}

}  // namespace cli
}  // namespace tqkv
