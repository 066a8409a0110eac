// The layout of a paged, compressed KV cache: which codec each (layer, KV
// head) uses, and where its bytes sit inside a page.
//
// Layers fall into chunks (see "Sliding-window layers" below); without
// windowed layers there is one chunk of every layer. A page holds
// `page_tokens` consecutive tokens of one sequence for every layer of one
// chunk and every KV head (one block table per sequence and chunk, as in
// vLLM's hybrid KV cache manager). Inside a page, for each layer of the chunk
// in order and each KV head in order, four planes follow each other, each
// starting on a kPlaneAlignment (32-byte) boundary:
//
//   key codes      page_tokens x key_codec.code_bytes()      tiled or token-major
//   key scalars    page_tokens x key_codec.num_scalars() fp16
//   value codes    page_tokens x value_codec.code_bytes()
//   value scalars  page_tokens x value_codec.num_scalars() fp16
//
// so token t of a page has its key scalars at key_scalars + t * num_scalars,
// etc.; packed codes are tiled (16 tokens interleaved by 4-byte words) and
// raw fp16 / bf16 / fp8 codes token-major, as kernels/code_tiles.h says
// (code_plane() gives the CodePlane). docs/format.md documents this byte by
// byte. Planes of width zero (fp16 has no scalars) take no bytes.
//
// Boundary layers (the first and last `boundary_layers`) use the protected
// preset, layers named in `layer_presets` theirs, the others the cache's
// preset. Each (layer, head) has its own
// rotation seed, derived from the cache's seed, so that the format depends on
// (seed, layer, head) only.
//
// Key centering and exact tokens (docs/format.md, "Centering and exact
// tokens"). With key centering, keys are stored as residuals k_t - R_t m
// (kernels/key_centering.h) and attention adds q . R_t m back exactly. With
// exact sink or recent tokens, the first `exact_sink_tokens` tokens and the
// last `exact_recent_tokens` tokens of each layer are also kept at fp16 in
// exact pages, laid out by exact_layout(): an all-fp16 layout whose pages
// hold exact_page_tokens() tokens and fit in one page of this layout, so both
// kinds of page come from one pool. Attention reads a token from its exact
// copy while the token is a sink or among the recent tokens, and from its
// compressed copy once later tokens push it out of them. Exact copies hold the same
// centered residuals, so the add-back is the same for every token.
//
// Sliding-window layers. layer_windows gives a layer a window W: a query at
// position p sees tokens [p + 1 - W, p + 1) only, and the cache gives older
// tokens' pages back. For that a windowed layer cannot share pages with
// layers that keep everything, so layers are grouped by window (all
// full-attention layers in one group, windowed layers by window size) and
// each group is split into chunks of at most k layers (consecutive members of
// the group). Every chunk has its own block table per sequence; its pages
// hold only its layers, and plane offsets (planes()) start at 0 in each
// chunk's page. All chunks share one pool and one page stride, page_bytes()
// = the largest chunk's page; a smaller chunk leaves the rest of its pages
// unused. k is chosen (ChunkWaste) to minimise that waste, preferring fewer
// chunks within 1% of the minimum: with equal bytes per layer, groups whose
// sizes share a divisor split with none (Gemma 3's 15 + 3 layers: chunks of
// 3). Chunks are cut by layer count, not bytes: with layers of different
// presets in a group (fp16 boundary layers) the waste can be large (28.9%
// for that shape with 2 boundary layers per end). The exact layout uses the
// same chunks.
//
// A KvLayout is immutable after Create and safe to share between threads and
// backends.
#ifndef TQKV_KERNELS_KV_LAYOUT_H_
#define TQKV_KERNELS_KV_LAYOUT_H_

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/code_tiles.h"
#include "kernels/codec.h"
#include "kernels/key_centering.h"
#include "kernels/preset.h"

namespace tqkv {

// Planes start on 32-byte boundaries: aligned for 256-bit loads, and a
// 16-token page of fp16 scalars (32 bytes) needs no padding.
inline constexpr int kPlaneAlignment = 32;

struct KvLayoutOptions {
  int num_layers = 32;
  int num_kv_heads = 8;
  // Query heads (GQA): a multiple of num_kv_heads; query head q reads KV head
  // q / (num_query_heads / num_kv_heads).
  int num_query_heads = 32;
  int head_dim = 128;
  // Tokens per page: 1..1024. Larger pages waste more on partial tails, smaller
  // ones cost more block-table entries.
  int page_tokens = 16;
  // The preset of every layer except the boundary ones.
  std::string preset = "turboquant_k3v4_nc";
  // The first and last `boundary_layers` layers use `boundary_preset`
  // (compressing them hurts most). At most num_layers / 2. 0 disables.
  int boundary_layers = 2;
  std::string boundary_preset = "fp16";
  // Seeds every rotation; part of the stored format.
  uint64_t rotation_seed = 0x7f4a7c15;
  // Presets with outlier-split keys need each (layer, KV head)'s hot channels:
  // hot_channels[layer * num_kv_heads + head], each a list as CodecOptions
  // wants. Empty for presets without a split.
  std::vector<std::vector<int>> hot_channels;
  // Per-layer presets: layer_presets[l], when not empty, is layer l's preset,
  // over `preset` and the boundary rule. Empty, or num_layers entries.
  std::vector<std::string> layer_presets;

  // Key centering (kernels/key_centering.h). kPreRope needs the model's rotary
  // embedding in `rope`; without it (rope.known() false) the cache centers
  // after RoPE instead.
  // Unset: the preset's recipe (PresetRecipe; none for plain presets).
  std::optional<KeyCentering> key_centering;
  RopeOptions rope;
  // Per-layer RoPE: layer_ropes[l], when known(), is layer l's rotary
  // embedding over `rope` (Gemma 3 rotates its sliding-window layers with base
  // 1e4, its global ones with 1e6). Empty, or num_layers entries. Used only
  // where `rope` is known (pre-RoPE centering).
  std::vector<RopeOptions> layer_ropes;
  // Per-channel key scales (CacheConfig.key_scales): empty, or num_layers *
  // num_kv_heads * head_dim finite values > 0, [layer][KV head][channel]. The
  // cache stores the centered residual / s; reads take the query * s for the
  // stored keys (compressed and exact) and the query as given for the mean's
  // add-back. Needs centering.
  std::vector<float> key_scales;
  // Per-sequence key scales (CacheConfig.sequence_key_scales): each
  // sequence measures its own at a layer's first append, over that append's
  // tokens from its mean's first on (EstimateKeyScales), and keeps them after
  // its mean (mean_floats doubles).
  // Unset: the preset's recipe; in effect only with centering and without
  // key_scales (true with key_scales is INVALID_ARGUMENT).
  std::optional<bool> sequence_key_scales;
  // The mean m comes from this many tokens of the first append to a layer,
  // starting after the sink tokens unless centering_includes_sinks (all of the
  // first append's tokens when it has too few). 1..65536.
  int centering_tokens = 64;
  bool centering_includes_sinks = false;
  // Pre-RoPE: keep the mean's `centering_pairs` strongest frequency pairs
  // (their add-back costs 2 multiply-adds per pair, query and token); the
  // other pairs stay in the residual. 0 keeps every pair.
  int centering_pairs = 8;
  // Tokens kept exact (fp16) besides their compressed copy: the first
  // exact_sink_tokens of each layer, and its last exact_recent_tokens. 0..4096;
  // -1: the preset's recipe.
  int exact_sink_tokens = -1;
  int exact_recent_tokens = -1;
  // Sliding-window layers: layer_windows[l] > 0 is layer l's window in tokens
  // (its own token included), 0 full attention. Empty (every layer full), or
  // num_layers entries in [0, 2^30].
  std::vector<int> layer_windows;
};

// Whether a codec's codes plane is tiled (kernels/code_tiles.h): packed
// codes are, raw fp16 / bf16 / fp8 numbers are not.
bool TiledCodes(CodecKind kind);

// The tokens of a layer holding `length` tokens that attention reads exact:
// [0, sink_end) and [recent_begin, length); the rest, [sink_end,
// recent_begin), compressed. sink_end <= recent_begin.
struct ExactRanges {
  int64_t sink_end = 0;
  int64_t recent_begin = 0;
};

class KvLayout {
 public:
  struct HeadPlanes {
    size_t key_codes = 0;  // byte offsets from the start of a page
    size_t key_scalars = 0;
    size_t value_codes = 0;
    size_t value_scalars = 0;
  };

  // Fails with INVALID_ARGUMENT for inconsistent shapes (query heads not a
  // multiple of KV heads, head_dim or page_tokens out of range, too many
  // boundary layers, a bad layer_presets list, centering or exact-token
  // settings out of range, a bad rope, pages too small to hold one exact
  // token), NOT_FOUND for an unknown preset, and FAILED_PRECONDITION when a
  // split preset has no hot channels.
  static absl::StatusOr<std::shared_ptr<const KvLayout>> Create(const KvLayoutOptions& options);

  // The options with the preset's recipe filled in (key_centering, exact
  // token counts as asked; key_centering() says what is in effect).
  const KvLayoutOptions& options() const { return options_; }
  int num_layers() const { return options_.num_layers; }
  int num_kv_heads() const { return options_.num_kv_heads; }
  int num_query_heads() const { return options_.num_query_heads; }
  int query_heads_per_kv_head() const { return options_.num_query_heads / options_.num_kv_heads; }
  int head_dim() const { return options_.head_dim; }
  int page_tokens() const { return options_.page_tokens; }
  // Bytes of one page (the pool's stride: the largest chunk's page), a
  // multiple of kPlaneAlignment.
  size_t page_bytes() const { return page_bytes_; }

  // Sliding windows: 0 for a full-attention layer.
  int layer_window(int layer) const { return options_.layer_windows.empty() ? 0 : options_.layer_windows[layer]; }
  bool has_windows() const { return has_windows_; }
  // The first token a query at `position` sees in `layer`.
  int64_t WindowBegin(int layer, int64_t position) const {
    const int window = layer_window(layer);
    return window == 0 ? 0 : std::max<int64_t>(0, position + 1 - window);
  }
  // Chunks: the layers that share a block table (see above), in order.
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  int layer_chunk(int layer) const { return layer_chunks_[layer]; }
  const std::vector<int>& chunk_layers(int chunk) const { return chunks_[chunk]; }
  int chunk_window(int chunk) const { return layer_window(chunks_[chunk][0]); }
  // Bytes of a page this chunk uses (<= page_bytes()).
  size_t chunk_bytes(int chunk) const { return chunk_bytes_[chunk]; }

  const Preset& layer_preset(int layer) const { return *layer_presets_[layer]; }

  // The centering in effect: kPreRope only with a known RoPE.
  KeyCentering key_centering() const { return key_centering_; }
  // The rotary pairs pre-RoPE centering uses (empty otherwise): the cache's
  // `rope`, and each layer's (its layer_ropes entry, else the cache's).
  const RopeTable& rope() const { return rope_; }
  const RopeTable& rope(int layer) const { return layer_rope_.empty() ? rope_ : layer_rope_[layer]; }
  // The key scales of (layer, KV head): head_dim floats, or null without
  // key_scales.
  const float* key_scales(int layer, int head) const {
    return options_.key_scales.empty()
               ? nullptr
               : options_.key_scales.data() + static_cast<size_t>(Index(layer, head)) * head_dim();
  }
  // The key scales a sequence's keys of (layer, KV head) are stored with:
  // the cache's key_scales, else with sequence key scales the ones after the
  // sequence's mean (`key_mean`: its layer's mean_floats() floats, or null
  // before its first append), else null.
  const float* key_scales(int layer, int head, const float* key_mean) const {
    if (!options_.key_scales.empty()) return key_scales(layer, head);
    if (!sequence_key_scales_ || key_mean == nullptr) return nullptr;
    return key_mean + static_cast<size_t>(options_.num_kv_heads + head) * head_dim();
  }
  // Whether each sequence measures its own key scales (kv_layout options).
  bool sequence_key_scales() const { return sequence_key_scales_; }
  // Floats of one layer's per-sequence key state: its means, num_kv_heads *
  // head_dim, then as many sequence key scales when in effect (0 without
  // centering).
  int mean_floats() const {
    if (key_centering_ == KeyCentering::kNone) return 0;
    return options_.num_kv_heads * options_.head_dim * (sequence_key_scales_ ? 2 : 1);
  }

  bool has_exact_tokens() const { return exact_layout_ != nullptr; }
  // The all-fp16 layout of exact pages, or null without exact tokens.
  const KvLayout* exact_layout() const { return exact_layout_.get(); }
  int exact_page_tokens() const { return exact_layout_ ? exact_layout_->page_tokens() : 0; }
  ExactRanges exact_ranges(int64_t length) const {
    ExactRanges r;
    r.sink_end = std::min<int64_t>(length, options_.exact_sink_tokens);
    r.recent_begin = std::max<int64_t>(r.sink_end, length - options_.exact_recent_tokens);
    return r;
  }
  const VectorCodec& key_codec(int layer, int head) const { return *key_codecs_[Index(layer, head)]; }
  const VectorCodec& value_codec(int layer, int head) const { return *value_codecs_[Index(layer, head)]; }
  const HeadPlanes& planes(int layer, int head) const { return planes_[Index(layer, head)]; }
  // How the key or value codes plane of (layer, head) is laid out.
  CodePlane key_code_plane(int layer, int head) const { return CodePlaneOf(key_codec(layer, head)); }
  CodePlane value_code_plane(int layer, int head) const { return CodePlaneOf(value_codec(layer, head)); }
  CodePlane CodePlaneOf(const VectorCodec& codec) const {
    return {options_.page_tokens, codec.code_bytes(), TiledCodes(codec.spec().kind)};
  }

  // Compressed bytes one token takes in one layer (all KV heads), excluding
  // plane padding; and the same in bf16 (2 bytes x 2 x kv_heads x head_dim).
  size_t token_bytes(int layer) const;
  size_t token_bytes_bf16() const;
  // Bytes one layer of a sequence holding tokens [held_begin, length) takes
  // (held_begin > 0 only in windowed layers, whose older tokens were given
  // back): compressed tokens, exact copies (fp16) and the key mean (fp32),
  // without padding.
  size_t layer_bytes(int layer, int64_t length, int64_t held_begin = 0) const;

  // Seed of the codecs of (layer, head).
  uint64_t HeadSeed(int layer, int head) const;

 private:
  explicit KvLayout(const KvLayoutOptions& options) : options_(options) {}
  // Create with the chunks given (the exact layout takes its main layout's)
  // or, when null, chosen.
  static absl::StatusOr<std::shared_ptr<const KvLayout>> CreateWithChunks(const KvLayoutOptions& options,
                                                                          const std::vector<std::vector<int>>* chunks);
  int Index(int layer, int head) const { return layer * options_.num_kv_heads + head; }

  KvLayoutOptions options_;
  size_t page_bytes_ = 0;
  std::vector<const Preset*> layer_presets_;
  std::vector<std::unique_ptr<VectorCodec>> key_codecs_;
  std::vector<std::unique_ptr<VectorCodec>> value_codecs_;
  std::vector<HeadPlanes> planes_;
  KeyCentering key_centering_ = KeyCentering::kNone;
  bool sequence_key_scales_ = false;
  RopeTable rope_;
  std::vector<RopeTable> layer_rope_;  // empty: every layer rotates with rope_
  std::shared_ptr<const KvLayout> exact_layout_;
  bool has_windows_ = false;
  std::vector<std::vector<int>> chunks_;
  std::vector<int> layer_chunks_;
  std::vector<size_t> chunk_bytes_;
};

// The share of a pool's bytes that chunks of these page sizes leave unused
// when every chunk holds as many pages: sum(max - bytes) / (count * max).
double ChunkWaste(const std::vector<size_t>& chunk_bytes);

}  // namespace tqkv

#endif  // TQKV_KERNELS_KV_LAYOUT_H_
