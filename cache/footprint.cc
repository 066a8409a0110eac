#include "cache/footprint.h"

#include <algorithm>
#include <cstdint>

namespace tqkv {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Pages of `page_tokens` covering [0, length) that hold a token at or after
// `held` (the cache gives back the pages wholly below it).
int64_t PagesFrom(int64_t length, int64_t page_tokens, int64_t held) {
  return CeilDiv(length, page_tokens) - held / page_tokens;
}

// Exact pages of one chunk: those at or after `held` with a sink token or a
// recent token [length - recent, length). The cache allocates an
// exact page when a token of it first gets an exact copy and gives it back
// once no token of it is a sink or recent (ReleaseLeftExactPages).
int64_t ExactPages(const KvLayout& layout, int64_t length, int64_t held) {
  const int64_t page_tokens = layout.exact_page_tokens();
  const int64_t sinks = layout.options().exact_sink_tokens;
  const int64_t recent = layout.options().exact_recent_tokens;
  const int64_t recent_begin = length - recent;
  int64_t pages = 0;
  for (int64_t k = held / page_tokens; k < CeilDiv(length, page_tokens); ++k) {
    const int64_t begin = k * page_tokens;
    if (begin < sinks || (recent > 0 && begin + page_tokens > recent_begin)) ++pages;
  }
  return pages;
}

}  // namespace

SequenceFootprint FootprintOf(const KvLayout& layout, int64_t length) {
  SequenceFootprint f;
  if (length <= 0) return f;
  for (int chunk = 0; chunk < layout.num_chunks(); ++chunk) {
    // A one-token append at length - 1 moved a windowed layer's oldest held
    // token to WindowBegin(length - 1); the chunk's layers share the window.
    const int64_t held = layout.WindowBegin(layout.chunk_layers(chunk)[0], length - 1);
    f.pages += PagesFrom(length, layout.page_tokens(), held);
    if (layout.has_exact_tokens()) f.exact_pages += ExactPages(layout, length, held);
  }
  f.pool_bytes = static_cast<uint64_t>(f.total_pages()) * layout.page_bytes();
  for (int layer = 0; layer < layout.num_layers(); ++layer) {
    const int64_t held = layout.WindowBegin(layer, length - 1);
    f.stored_bytes += layout.layer_bytes(layer, length, held);
    f.stored_bytes_bf16 += static_cast<uint64_t>(length - held) * layout.token_bytes_bf16();
    f.mean_bytes += sizeof(float) * static_cast<uint64_t>(layout.mean_floats());
  }
  return f;
}

}  // namespace tqkv
