#include "kernels/kv_layout.h"

#include "absl/strings/str_format.h"
#include "kernels/random.h"
#include "kernels/status_macros.h"

namespace tqkv {
namespace {

size_t AlignUp(size_t n) { return (n + kPlaneAlignment - 1) / kPlaneAlignment * kPlaneAlignment; }

// Value codecs draw their rotation from their own stream of the head's seed.
constexpr uint64_t kValueStream = 1;

}  // namespace

uint64_t KvLayout::HeadSeed(int layer, int head) const {
  return DeriveSeed(options_.rotation_seed, static_cast<uint64_t>(layer), static_cast<uint64_t>(head));
}

absl::StatusOr<std::shared_ptr<const KvLayout>> KvLayout::Create(const KvLayoutOptions& options) {
  const KvLayoutOptions& o = options;
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
  if ((preset->NeedsCalibration() || boundary->NeedsCalibration()) &&
      o.hot_channels.size() != static_cast<size_t>(o.num_layers) * heads) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "a split preset needs hot channels for every (layer, KV head): want %d lists, got %d",
        o.num_layers * heads, o.hot_channels.size()));
  }

  std::shared_ptr<KvLayout> layout(new KvLayout(options));
  size_t offset = 0;
  for (int layer = 0; layer < o.num_layers; ++layer) {
    const bool is_boundary = layer < o.boundary_layers || layer >= o.num_layers - o.boundary_layers;
    const Preset* layer_preset = is_boundary ? boundary : preset;
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
  return std::shared_ptr<const KvLayout>(std::move(layout));
}

size_t KvLayout::token_bytes(int layer) const {
  const Preset& preset = *layer_presets_[layer];
  return static_cast<size_t>(options_.num_kv_heads) * preset.BytesPerTokenHead(options_.head_dim);
}

size_t KvLayout::token_bytes_bf16() const {
  return static_cast<size_t>(options_.num_kv_heads) * 4 * options_.head_dim;
}

}  // namespace tqkv
