// The layout of a paged, compressed KV cache: which codec each (layer, KV
// head) uses, and where its bytes sit inside a page.
//
// A page holds `page_tokens` consecutive tokens of one sequence for every
// layer and every KV head (one block table per sequence serves all layers, as
// in vLLM). Inside a page, for each layer in order and each KV head in order,
// four planes follow each other, each starting on a kPlaneAlignment (32-byte)
// boundary:
//
//   key codes      page_tokens x key_codec.code_bytes()      token-major
//   key scalars    page_tokens x key_codec.num_scalars() fp16
//   value codes    page_tokens x value_codec.code_bytes()
//   value scalars  page_tokens x value_codec.num_scalars() fp16
//
// so token t of a page has its key codes at key_codes + t * code_bytes, etc.
// docs/format.md documents this byte by byte. Planes of width zero (fp16 has
// no scalars) take no bytes.
//
// Boundary layers (the first and last `boundary_layers`) use the protected
// preset; the others the cache's preset. Each (layer, head) has its own
// rotation seed, derived from the cache's seed, so that the format depends on
// (seed, layer, head) only.
//
// A KvLayout is immutable after Create and safe to share between threads and
// backends.
#ifndef TQKV_KERNELS_KV_LAYOUT_H_
#define TQKV_KERNELS_KV_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codec.h"
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
  // boundary layers), NOT_FOUND for an unknown preset, and FAILED_PRECONDITION
  // when a split preset has no hot channels.
  static absl::StatusOr<std::shared_ptr<const KvLayout>> Create(const KvLayoutOptions& options);

  const KvLayoutOptions& options() const { return options_; }
  int num_layers() const { return options_.num_layers; }
  int num_kv_heads() const { return options_.num_kv_heads; }
  int num_query_heads() const { return options_.num_query_heads; }
  int query_heads_per_kv_head() const { return options_.num_query_heads / options_.num_kv_heads; }
  int head_dim() const { return options_.head_dim; }
  int page_tokens() const { return options_.page_tokens; }
  // Bytes of one page, a multiple of kPlaneAlignment.
  size_t page_bytes() const { return page_bytes_; }

  const Preset& layer_preset(int layer) const { return *layer_presets_[layer]; }
  const VectorCodec& key_codec(int layer, int head) const { return *key_codecs_[Index(layer, head)]; }
  const VectorCodec& value_codec(int layer, int head) const {
    return *value_codecs_[Index(layer, head)];
  }
  const HeadPlanes& planes(int layer, int head) const { return planes_[Index(layer, head)]; }

  // Compressed bytes one token takes in one layer (all KV heads), excluding
  // plane padding; and the same in bf16 (2 bytes x 2 x kv_heads x head_dim).
  size_t token_bytes(int layer) const;
  size_t token_bytes_bf16() const;

  // Seed of the codecs of (layer, head).
  uint64_t HeadSeed(int layer, int head) const;

 private:
  explicit KvLayout(const KvLayoutOptions& options) : options_(options) {}
  int Index(int layer, int head) const { return layer * options_.num_kv_heads + head; }

  KvLayoutOptions options_;
  size_t page_bytes_ = 0;
  std::vector<const Preset*> layer_presets_;
  std::vector<std::unique_ptr<VectorCodec>> key_codecs_;
  std::vector<std::unique_ptr<VectorCodec>> value_codecs_;
  std::vector<HeadPlanes> planes_;
};

}  // namespace tqkv

#endif  // TQKV_KERNELS_KV_LAYOUT_H_
