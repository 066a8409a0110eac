// For kernel tests that store n keys of one head: the layout options of one
// layer with one KV head of `preset`, 16-token pages and no boundary layers.
// Presets that need calibration (split keys) take their hot channels from
// those keys.
#ifndef TQKV_TESTS_KERNELS_ONE_HEAD_LAYOUT_H_
#define TQKV_TESTS_KERNELS_ONE_HEAD_LAYOUT_H_

#include <string>

#include "kernels/codec.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"

namespace tqkv {

inline KvLayoutOptions OneHeadLayoutOptions(const Preset& preset, int query_heads, int head_dim, const float* keys,
                                            int n) {
  KvLayoutOptions options;
  options.num_layers = 1;
  options.num_kv_heads = 1;
  options.num_query_heads = query_heads;
  options.head_dim = head_dim;
  options.page_tokens = 16;
  options.preset = std::string(preset.name);
  options.boundary_layers = 0;
  if (preset.NeedsCalibration()) {
    options.hot_channels = {ChooseHotChannels(keys, n, head_dim, preset.key.HotChannels(head_dim))};
  }
  return options;
}

}  // namespace tqkv

#endif  // TQKV_TESTS_KERNELS_ONE_HEAD_LAYOUT_H_
