#include "kernels/kv_layout.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/random.h"
#include "base/status_macros.h"

namespace tqkv {
namespace {

size_t AlignUp(size_t n) { return (n + kPlaneAlignment - 1) / kPlaneAlignment * kPlaneAlignment; }

// Value codecs draw their rotation from their own stream of the head's seed.
constexpr uint64_t kValueStream = 1;

constexpr int kMaxExactTokens = 4096;

// Per-layer RoPEs (one entry per layer, each a valid RoPE, only beside the
// cache's own) and key scales (one finite value > 0 per layer, KV head and
// channel).
absl::Status CheckLayerRopesAndKeyScales(const KvLayoutOptions& o) {
  if (!o.layer_ropes.empty() && static_cast<int>(o.layer_ropes.size()) != o.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat("layer_ropes has %d entries; want none or one per layer (%d)",
                                                      o.layer_ropes.size(), o.num_layers));
  }
  if (!o.key_scales.empty()) {
    const size_t want = static_cast<size_t>(o.num_layers) * o.num_kv_heads * o.head_dim;
    if (o.key_scales.size() != want) {
      return absl::InvalidArgumentError(
          absl::StrFormat("key_scales has %d values; want none or num_layers x num_kv_heads x head_dim = %d",
                          o.key_scales.size(), want));
    }
    for (size_t i = 0; i < want; ++i) {
      if (!(o.key_scales[i] > 0.0f) || !std::isfinite(o.key_scales[i])) {
        return absl::InvalidArgumentError(absl::StrFormat("key_scales of layer %d: %g; want finite values > 0",
                                                          i / (want / o.num_layers), o.key_scales[i]));
      }
    }
  }
  for (size_t layer = 0; layer < o.layer_ropes.size(); ++layer) {
    if (!o.layer_ropes[layer].known()) continue;
    if (!o.rope.known()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer_ropes gives layer ", layer,
                       " a rope but the cache has none; want `rope` (the other layers' RoPE) as well"));
    }
    absl::StatusOr<RopeTable> table = RopeTable::Create(o.layer_ropes[layer], o.head_dim);
    if (!table.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, "'s rope: ", table.status().message()));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckCenteringAndExactTokens(const KvLayoutOptions& o) {
  if (o.centering_tokens < 1 || o.centering_tokens > 65536) {
    return absl::InvalidArgumentError(
        absl::StrFormat("centering_tokens must be in [1, 65536], got %d", o.centering_tokens));
  }
  if (o.centering_pairs < 0 || o.centering_pairs > o.head_dim / 2) {
    return absl::InvalidArgumentError(
        absl::StrFormat("centering_pairs must be in [0, head_dim / 2 = %d] (0: every pair), got %d", o.head_dim / 2,
                        o.centering_pairs));
  }
  for (const auto& [name, value] : {std::pair<const char*, int>{"exact_sink_tokens", o.exact_sink_tokens},
                                    {"exact_recent_tokens", o.exact_recent_tokens}}) {
    if (value < 0 || value > kMaxExactTokens) {
      return absl::InvalidArgumentError(absl::StrFormat("%s must be in [0, %d], got %d", name, kMaxExactTokens, value));
    }
  }
  if (o.key_centering == KeyCentering::kPreRope && o.rope.known()) {
    RETURN_IF_ERROR(RopeTable::Create(o.rope, o.head_dim).status());
  }
  return CheckLayerRopesAndKeyScales(o);
}

constexpr int kMaxWindow = 1 << 30;

absl::Status CheckWindows(const KvLayoutOptions& o) {
  if (o.layer_windows.empty()) return absl::OkStatus();
  if (static_cast<int>(o.layer_windows.size()) != o.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat("layer_windows has %d entries; want none or one per layer (%d)",
                                                      o.layer_windows.size(), o.num_layers));
  }
  for (int layer = 0; layer < o.num_layers; ++layer) {
    const int w = o.layer_windows[layer];
    if (w < 0 || w > kMaxWindow) {
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %d: window %d; want 0 (full attention) or 1..%d tokens", layer, w, kMaxWindow));
    }
  }
  return absl::OkStatus();
}

// Groups layers by window (full attention first, then by window size) and
// splits each group into chunks of at most k consecutive members, k chosen to
// minimise the stride waste (ChunkWaste) of pages of `layer_bytes`, the
// largest k within 1% of the minimum (fewer tables, fewer Store calls).
std::vector<std::vector<int>> ChooseChunks(const KvLayoutOptions& o, const std::vector<size_t>& layer_bytes) {
  std::vector<std::pair<int, std::vector<int>>> groups;  // (window, layers)
  for (int layer = 0; layer < o.num_layers; ++layer) {
    const int w = o.layer_windows.empty() ? 0 : o.layer_windows[layer];
    auto it = std::find_if(groups.begin(), groups.end(), [w](const auto& g) { return g.first == w; });
    if (it == groups.end()) {
      groups.push_back({w, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(layer);
  }
  std::sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  if (groups.size() == 1) return {groups[0].second};
  size_t largest = 0;
  for (const auto& g : groups) largest = std::max(largest, g.second.size());
  const auto split = [&](size_t k) {
    std::vector<std::vector<int>> chunks;
    for (const auto& g : groups) {
      for (size_t i = 0; i < g.second.size(); i += k) {
        chunks.emplace_back(g.second.begin() + i, g.second.begin() + std::min(g.second.size(), i + k));
      }
    }
    return chunks;
  };
  std::vector<double> waste(largest + 1, 1.0);
  double best = 1.0;
  for (size_t k = 1; k <= largest; ++k) {
    std::vector<size_t> bytes;
    for (const std::vector<int>& chunk : split(k)) {
      size_t b = 0;
      for (int layer : chunk) b += layer_bytes[layer];
      bytes.push_back(b);
    }
    waste[k] = ChunkWaste(bytes);
    best = std::min(best, waste[k]);
  }
  for (size_t k = largest; k >= 1; --k) {
    if (waste[k] <= best + 0.01) return split(k);
  }
  return split(1);
}

// The all-fp16 layout of exact pages, with the chunks of `main`: as many
// tokens per page as fit in main's page_bytes, the stride of the pool both
// kinds of page share.
absl::StatusOr<std::shared_ptr<const KvLayout>> MakeExactLayout(
    const KvLayoutOptions& o, size_t page_bytes, const std::vector<std::vector<int>>& chunks,
    const std::function<absl::StatusOr<std::shared_ptr<const KvLayout>>(const KvLayoutOptions&)>& create) {
  // fp16 planes of whole tokens are multiples of 32 bytes when head_dim is a
  // multiple of 16; otherwise padding can cost a token, so search downwards.
  size_t widest = 0;
  for (const std::vector<int>& chunk : chunks) widest = std::max(widest, chunk.size());
  const size_t token_bytes = widest * o.num_kv_heads * 4 * o.head_dim;
  for (int64_t tokens = std::min<int64_t>(page_bytes / token_bytes, 1024); tokens >= 1; --tokens) {
    KvLayoutOptions e;
    e.num_layers = o.num_layers;
    e.num_kv_heads = o.num_kv_heads;
    e.num_query_heads = o.num_query_heads;
    e.head_dim = o.head_dim;
    e.page_tokens = static_cast<int>(tokens);
    e.preset = "fp16";
    e.boundary_layers = 0;
    e.rotation_seed = o.rotation_seed;
    e.layer_windows = o.layer_windows;
    ASSIGN_OR_RETURN(std::shared_ptr<const KvLayout> exact, create(e));
    if (exact->page_bytes() <= page_bytes) return exact;
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("a page of %d tokens (%d bytes) cannot hold one exact fp16 token of every layer of a chunk (%d "
                      "bytes); raise page_tokens for exact sink or recent tokens",
                      o.page_tokens, page_bytes, token_bytes));
}

// The shape's ranges: layers, heads, head dim, page tokens, boundary layers.
absl::Status CheckShape(const KvLayoutOptions& o) {
  if (o.num_layers < 1 || o.num_layers > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat("num_layers must be in [1, 1024], got %d", o.num_layers));
  }
  if (o.num_kv_heads < 1 || o.num_kv_heads > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat("num_kv_heads must be in [1, 1024], got %d", o.num_kv_heads));
  }
  if (o.num_query_heads < o.num_kv_heads || o.num_query_heads % o.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_query_heads (%d) must be a positive multiple of num_kv_heads (%d)", o.num_query_heads, o.num_kv_heads));
  }
  if (o.head_dim < 16 || o.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrFormat("head_dim must be in [16, %d], got %d", kMaxHeadDim, o.head_dim));
  }
  if (o.page_tokens < 1 || o.page_tokens > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat("page_tokens must be in [1, 1024], got %d", o.page_tokens));
  }
  if (o.boundary_layers < 0 || 2 * o.boundary_layers > o.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat("boundary_layers must be in [0, num_layers / 2 = %d], got %d",
                                                      o.num_layers / 2, o.boundary_layers));
  }
  return absl::OkStatus();
}

// Each layer's preset: the boundary preset in the boundary layers, the
// main one elsewhere, a layer_presets entry where one is given.
absl::StatusOr<std::vector<const Preset*>> LayerPresets(const KvLayoutOptions& o) {
  ASSIGN_OR_RETURN(const Preset* preset, FindPreset(o.preset));
  const Preset* boundary = preset;
  if (o.boundary_layers > 0) {
    ASSIGN_OR_RETURN(boundary, FindPreset(o.boundary_preset));
  }
  if (!o.layer_presets.empty() && static_cast<int>(o.layer_presets.size()) != o.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat("layer_presets has %d entries; want none or one per layer (%d)",
                                                      o.layer_presets.size(), o.num_layers));
  }
  std::vector<const Preset*> presets(o.num_layers);
  for (int layer = 0; layer < o.num_layers; ++layer) {
    const bool is_boundary = layer < o.boundary_layers || layer >= o.num_layers - o.boundary_layers;
    presets[layer] = is_boundary ? boundary : preset;
    if (!o.layer_presets.empty() && !o.layer_presets[layer].empty()) {
      absl::StatusOr<const Preset*> found = FindPreset(o.layer_presets[layer]);
      if (!found.ok()) {
        return absl::Status(found.status().code(), absl::StrFormat("layer %d: %s", layer, found.status().message()));
      }
      presets[layer] = *found;
    }
  }
  return presets;
}

}  // namespace

uint64_t KvLayout::HeadSeed(int layer, int head) const {
  return DeriveSeed(options_.rotation_seed, static_cast<uint64_t>(layer), static_cast<uint64_t>(head));
}

bool TiledCodes(CodecKind kind) {
  switch (kind) {
    case CodecKind::kFp16:
    case CodecKind::kBf16:
    case CodecKind::kFp8:
      return false;
    case CodecKind::kTurboQuant:
    case CodecKind::kUniform:
    case CodecKind::kQjl:
    case CodecKind::kOutlierSplit:
      return true;
  }
  return false;
}

double ChunkWaste(const std::vector<size_t>& chunk_bytes) {
  if (chunk_bytes.empty()) return 0.0;
  const size_t stride = *std::max_element(chunk_bytes.begin(), chunk_bytes.end());
  if (stride == 0) return 0.0;
  double unused = 0.0;
  for (size_t b : chunk_bytes) unused += static_cast<double>(stride - b);
  return unused / (static_cast<double>(stride) * chunk_bytes.size());
}

absl::StatusOr<std::shared_ptr<const KvLayout>> KvLayout::Create(const KvLayoutOptions& options) {
  return CreateWithChunks(options, nullptr);
}

absl::StatusOr<std::shared_ptr<const KvLayout>> KvLayout::CreateWithChunks(
    const KvLayoutOptions& options, const std::vector<std::vector<int>>* given_chunks) {
  KvLayoutOptions o = options;
  if (absl::StatusOr<const Preset*> main = FindPreset(o.preset); main.ok()) {
    const PresetRecipe& recipe = (*main)->recipe;
    if (!o.key_centering.has_value()) o.key_centering = recipe.key_centering;
    if (o.exact_sink_tokens == -1) o.exact_sink_tokens = recipe.exact_sink_tokens;
    if (o.exact_recent_tokens == -1) o.exact_recent_tokens = recipe.exact_recent_tokens;
    // The recipe's sequence key scales give way to calibrated key_scales and
    // leave with the centering.
    if (!o.sequence_key_scales.has_value()) {
      o.sequence_key_scales =
          recipe.sequence_key_scales && o.key_scales.empty() && *o.key_centering != KeyCentering::kNone;
    }
  }
  RETURN_IF_ERROR(CheckShape(o));
  ASSIGN_OR_RETURN(const std::vector<const Preset*> presets, LayerPresets(o));
  const bool needs_calibration =
      std::any_of(presets.begin(), presets.end(), [](const Preset* p) { return p->NeedsCalibration(); });
  const int heads = o.num_kv_heads;
  RETURN_IF_ERROR(CheckCenteringAndExactTokens(o));
  RETURN_IF_ERROR(CheckWindows(o));
  if (needs_calibration && o.hot_channels.size() != static_cast<size_t>(o.num_layers) * heads) {
    return absl::FailedPreconditionError(
        absl::StrFormat("a split preset needs hot channels for every (layer, KV head): want %d lists, got %d",
                        o.num_layers * heads, o.hot_channels.size()));
  }

  std::shared_ptr<KvLayout> layout(new KvLayout(o));
  // Codecs first (in (layer, head) order), then each chunk's plane offsets.
  std::vector<size_t> layer_bytes(o.num_layers, 0);
  const size_t tokens = static_cast<size_t>(o.page_tokens);
  const auto plane = [&](size_t bytes_per_token) { return AlignUp(tokens * bytes_per_token); };
  for (int layer = 0; layer < o.num_layers; ++layer) {
    const Preset* layer_preset = presets[layer];
    layout->layer_presets_.push_back(layer_preset);
    for (int head = 0; head < heads; ++head) {
      CodecOptions codec_options;
      codec_options.head_dim = o.head_dim;
      codec_options.seed = layout->HeadSeed(layer, head);
      if (layer_preset->NeedsCalibration()) {
        codec_options.hot_channels = o.hot_channels[layer * heads + head];
      }
      ASSIGN_OR_RETURN(std::unique_ptr<VectorCodec> key, MakeCodec(layer_preset->key, codec_options));
      codec_options.seed = DeriveSeed(codec_options.seed, kValueStream);
      ASSIGN_OR_RETURN(std::unique_ptr<VectorCodec> value, MakeCodec(layer_preset->value, codec_options));
      layer_bytes[layer] += plane(key->code_bytes()) + plane(2 * key->num_scalars()) + plane(value->code_bytes()) +
                            plane(2 * value->num_scalars());
      layout->key_codecs_.push_back(std::move(key));
      layout->value_codecs_.push_back(std::move(value));
    }
  }
  layout->has_windows_ = std::any_of(o.layer_windows.begin(), o.layer_windows.end(), [](int w) { return w > 0; });
  layout->chunks_ = given_chunks != nullptr ? *given_chunks : ChooseChunks(o, layer_bytes);
  layout->layer_chunks_.assign(o.num_layers, 0);
  layout->planes_.resize(static_cast<size_t>(o.num_layers) * heads);
  size_t stride = 0;
  for (size_t c = 0; c < layout->chunks_.size(); ++c) {
    size_t offset = 0;
    for (int layer : layout->chunks_[c]) {
      layout->layer_chunks_[layer] = static_cast<int>(c);
      for (int head = 0; head < heads; ++head) {
        const VectorCodec& key = *layout->key_codecs_[layout->Index(layer, head)];
        const VectorCodec& value = *layout->value_codecs_[layout->Index(layer, head)];
        HeadPlanes& planes = layout->planes_[layout->Index(layer, head)];
        planes.key_codes = offset;
        offset += plane(key.code_bytes());
        planes.key_scalars = offset;
        offset += plane(2 * key.num_scalars());
        planes.value_codes = offset;
        offset += plane(value.code_bytes());
        planes.value_scalars = offset;
        offset += plane(2 * value.num_scalars());
      }
    }
    layout->chunk_bytes_.push_back(offset);
    stride = std::max(stride, offset);
  }
  layout->page_bytes_ = stride;

  layout->key_centering_ = *o.key_centering;
  if (!o.key_scales.empty() && layout->key_centering_ == KeyCentering::kNone) {
    return absl::InvalidArgumentError("key_scales need key_centering (pre_rope or post_rope)");
  }
  if (o.sequence_key_scales.value_or(false)) {
    if (layout->key_centering_ == KeyCentering::kNone) {
      return absl::InvalidArgumentError("sequence_key_scales need key_centering (pre_rope or post_rope)");
    }
    if (!o.key_scales.empty()) {
      return absl::InvalidArgumentError("sequence_key_scales and key_scales both set; want one of them");
    }
    layout->sequence_key_scales_ = true;
  }
  if (o.key_centering == KeyCentering::kPreRope) {
    if (o.rope.known()) {
      ASSIGN_OR_RETURN(layout->rope_, RopeTable::Create(o.rope, o.head_dim));
      if (std::any_of(o.layer_ropes.begin(), o.layer_ropes.end(), [](const RopeOptions& r) { return r.known(); })) {
        layout->layer_rope_.assign(o.num_layers, layout->rope_);
        for (int layer = 0; layer < o.num_layers; ++layer) {
          if (!o.layer_ropes[layer].known()) continue;
          ASSIGN_OR_RETURN(layout->layer_rope_[layer], RopeTable::Create(o.layer_ropes[layer], o.head_dim));
        }
      }
    } else {
      layout->key_centering_ = KeyCentering::kPostRope;
    }
  }
  if (o.exact_sink_tokens > 0 || o.exact_recent_tokens > 0) {
    ASSIGN_OR_RETURN(layout->exact_layout_, MakeExactLayout(o, stride, layout->chunks_, [&](const KvLayoutOptions& e) {
                       return CreateWithChunks(e, &layout->chunks_);
                     }));
  }
  return std::shared_ptr<const KvLayout>(std::move(layout));
}

size_t KvLayout::token_bytes(int layer) const {
  const Preset& preset = *layer_presets_[layer];
  return static_cast<size_t>(options_.num_kv_heads) * preset.BytesPerTokenHead(options_.head_dim);
}

size_t KvLayout::token_bytes_bf16() const { return static_cast<size_t>(options_.num_kv_heads) * 4 * options_.head_dim; }

size_t KvLayout::layer_bytes(int layer, int64_t length, int64_t held_begin) const {
  if (length <= 0) return 0;
  held_begin = std::clamp<int64_t>(held_begin, 0, length);
  size_t bytes = static_cast<size_t>(length - held_begin) * token_bytes(layer);
  if (exact_layout_ != nullptr) {
    const ExactRanges r = exact_ranges(length);
    const int64_t sinks = std::max<int64_t>(0, r.sink_end - held_begin);
    const int64_t recent = length - std::max(r.recent_begin, held_begin);
    bytes += static_cast<size_t>(sinks + recent) * exact_layout_->token_bytes(layer);
  }
  return bytes + sizeof(float) * static_cast<size_t>(mean_floats());
}

}  // namespace tqkv
