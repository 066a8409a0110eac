#include "kernels/kv_layout.h"

#include "absl/strings/str_format.h"
#include "kernels/random.h"
#include "kernels/status_macros.h"

namespace tqkv {
namespace {

size_t AlignUp(size_t n) { return (n + kPlaneAlignment - 1) / kPlaneAlignment * kPlaneAlignment; }

// Value codecs draw their rotation from their own stream of the head's seed.
constexpr uint64_t kValueStream = 1;

constexpr int kMaxExactTokens = 4096;

absl::Status CheckCenteringAndExactTokens(const KvLayoutOptions& o) {
  if (o.centering_tokens < 1 || o.centering_tokens > 65536) {
    return absl::InvalidArgumentError(
        absl::StrFormat("centering_tokens must be in [1, 65536], got %d", o.centering_tokens));
  }
  if (o.centering_pairs < 0 || o.centering_pairs > o.head_dim / 2) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "centering_pairs must be in [0, head_dim / 2 = %d] (0: every pair), got %d",
        o.head_dim / 2, o.centering_pairs));
  }
  for (const auto& [name, value] : {std::pair<const char*, int>{"exact_sink_tokens", o.exact_sink_tokens},
                                    {"exact_window_tokens", o.exact_window_tokens}}) {
    if (value < 0 || value > kMaxExactTokens) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s must be in [0, %d], got %d", name, kMaxExactTokens, value));
    }
  }
  if (o.key_centering == KeyCentering::kPreRope && o.rope.known()) {
    RETURN_IF_ERROR(RopeTable::Create(o.rope, o.head_dim).status());
  }
  return absl::OkStatus();
}

// The all-fp16 layout of exact pages: as many tokens per page as fit in
// `page_bytes`, the stride of the pool both kinds of page share.
absl::StatusOr<std::shared_ptr<const KvLayout>> MakeExactLayout(const KvLayoutOptions& o,
                                                                size_t page_bytes) {
  // fp16 planes of whole tokens are multiples of 32 bytes when head_dim is a
  // multiple of 16; otherwise padding can cost a token, so search downwards.
  const size_t token_bytes = static_cast<size_t>(o.num_layers) * o.num_kv_heads * 4 * o.head_dim;
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
    ASSIGN_OR_RETURN(std::shared_ptr<const KvLayout> exact, KvLayout::Create(e));
    if (exact->page_bytes() <= page_bytes) return exact;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "a page of %d tokens (%d bytes) cannot hold one exact fp16 token of every layer (%d "
      "bytes); raise page_tokens for exact sink or window tokens",
      o.page_tokens, page_bytes, token_bytes));
}

}  // namespace

uint64_t KvLayout::HeadSeed(int layer, int head) const {
  return DeriveSeed(options_.rotation_seed, static_cast<uint64_t>(layer), static_cast<uint64_t>(head));
}

absl::StatusOr<std::shared_ptr<const KvLayout>> KvLayout::Create(const KvLayoutOptions& options) {
  KvLayoutOptions o = options;
  if (absl::StatusOr<const Preset*> main = FindPreset(o.preset); main.ok()) {
    const PresetRecipe& recipe = (*main)->recipe;
    if (!o.key_centering.has_value()) o.key_centering = recipe.key_centering;
    if (o.exact_sink_tokens == -1) o.exact_sink_tokens = recipe.exact_sink_tokens;
    if (o.exact_window_tokens == -1) o.exact_window_tokens = recipe.exact_window_tokens;
  }
  if (o.num_layers < 1 || o.num_layers > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat("num_layers must be in [1, 1024], got %d", o.num_layers));
  }
  if (o.num_kv_heads < 1 || o.num_kv_heads > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat("num_kv_heads must be in [1, 1024], got %d", o.num_kv_heads));
  }
  if (o.num_query_heads < o.num_kv_heads || o.num_query_heads % o.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_query_heads (%d) must be a positive multiple of num_kv_heads (%d)", o.num_query_heads,
        o.num_kv_heads));
  }
  if (o.head_dim < 16 || o.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("head_dim must be in [16, %d], got %d", kMaxHeadDim, o.head_dim));
  }
  if (o.page_tokens < 1 || o.page_tokens > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat("page_tokens must be in [1, 1024], got %d", o.page_tokens));
  }
  if (o.boundary_layers < 0 || 2 * o.boundary_layers > o.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "boundary_layers must be in [0, num_layers / 2 = %d], got %d", o.num_layers / 2, o.boundary_layers));
  }
  ASSIGN_OR_RETURN(const Preset* preset, FindPreset(o.preset));
  const Preset* boundary = preset;
  if (o.boundary_layers > 0) {
    ASSIGN_OR_RETURN(boundary, FindPreset(o.boundary_preset));
  }
  const int heads = o.num_kv_heads;
  if (!o.layer_presets.empty() && static_cast<int>(o.layer_presets.size()) != o.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layer_presets has %d entries; want none or one per layer (%d)", o.layer_presets.size(),
        o.num_layers));
  }
  std::vector<const Preset*> presets(o.num_layers);
  bool needs_calibration = false;
  for (int layer = 0; layer < o.num_layers; ++layer) {
    const bool is_boundary = layer < o.boundary_layers || layer >= o.num_layers - o.boundary_layers;
    presets[layer] = is_boundary ? boundary : preset;
    if (!o.layer_presets.empty() && !o.layer_presets[layer].empty()) {
      absl::StatusOr<const Preset*> found = FindPreset(o.layer_presets[layer]);
      if (!found.ok()) {
        return absl::Status(found.status().code(),
                            absl::StrFormat("layer %d: %s", layer, found.status().message()));
      }
      presets[layer] = *found;
    }
    needs_calibration = needs_calibration || presets[layer]->NeedsCalibration();
  }
  RETURN_IF_ERROR(CheckCenteringAndExactTokens(o));
  if (needs_calibration && o.hot_channels.size() != static_cast<size_t>(o.num_layers) * heads) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "a split preset needs hot channels for every (layer, KV head): want %d lists, got %d",
        o.num_layers * heads, o.hot_channels.size()));
  }

  std::shared_ptr<KvLayout> layout(new KvLayout(o));
  size_t offset = 0;
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
      ASSIGN_OR_RETURN(std::unique_ptr<VectorCodec> value,
                       MakeCodec(layer_preset->value, codec_options));
      HeadPlanes planes;
      const size_t tokens = static_cast<size_t>(o.page_tokens);
      planes.key_codes = offset;
      offset = AlignUp(offset + tokens * key->code_bytes());
      planes.key_scalars = offset;
      offset = AlignUp(offset + tokens * 2 * key->num_scalars());
      planes.value_codes = offset;
      offset = AlignUp(offset + tokens * value->code_bytes());
      planes.value_scalars = offset;
      offset = AlignUp(offset + tokens * 2 * value->num_scalars());
      layout->planes_.push_back(planes);
      layout->key_codecs_.push_back(std::move(key));
      layout->value_codecs_.push_back(std::move(value));
    }
  }
  layout->page_bytes_ = offset;

  layout->key_centering_ = *o.key_centering;
  if (o.key_centering == KeyCentering::kPreRope) {
    if (o.rope.known()) {
      ASSIGN_OR_RETURN(layout->rope_, RopeTable::Create(o.rope, o.head_dim));
    } else {
      layout->key_centering_ = KeyCentering::kPostRope;
    }
  }
  if (o.exact_sink_tokens > 0 || o.exact_window_tokens > 0) {
    ASSIGN_OR_RETURN(layout->exact_layout_, MakeExactLayout(o, offset));
  }
  return std::shared_ptr<const KvLayout>(std::move(layout));
}

size_t KvLayout::token_bytes(int layer) const {
  const Preset& preset = *layer_presets_[layer];
  return static_cast<size_t>(options_.num_kv_heads) * preset.BytesPerTokenHead(options_.head_dim);
}

size_t KvLayout::token_bytes_bf16() const {
  return static_cast<size_t>(options_.num_kv_heads) * 4 * options_.head_dim;
}

size_t KvLayout::layer_bytes(int layer, int64_t length) const {
  if (length <= 0) return 0;
  size_t bytes = static_cast<size_t>(length) * token_bytes(layer);
  if (exact_layout_ != nullptr) {
    const ExactRanges r = exact_ranges(length);
    bytes += static_cast<size_t>(r.sink_end + (length - r.window_begin)) * exact_layout_->token_bytes(layer);
  }
  return bytes + sizeof(float) * static_cast<size_t>(mean_floats());
}

}  // namespace tqkv
