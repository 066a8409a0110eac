#include "kernels/cuda/call_workspace.h"

#include <cstring>

namespace tqkv {
namespace cuda {

bool Centered(const KvLayout& layout, const float* key_mean) {
  return key_mean != nullptr && layout.key_centering() != KeyCentering::kNone;
}

int64_t ActivePairs(const KvLayout& layout, int layer, const float* key_mean) {
  const RopeTable& rope = layout.rope(layer);
  int64_t pairs = 0;
  for (int kv = 0; kv < layout.num_kv_heads(); ++kv) {
    const float* mean = key_mean + static_cast<size_t>(kv) * layout.head_dim();
    for (int i = 0; i < rope.num_pairs(); ++i) {
      if (mean[rope.first(i)] != 0.0f || mean[rope.second(i)] != 0.0f) ++pairs;
    }
  }
  return pairs;
}

void CopyAddBack(const AddBackAt& at, Workspace& w) {
  if (!at.any) return;
  std::memcpy(w.host + at.heads, w.addback.data(), sizeof(cuda::AddBackDesc) * w.addback.size());
  std::memcpy(w.host + at.theta, w.theta.data(), sizeof(double) * w.theta.size());
  std::memcpy(w.host + at.coef, w.coef.data(), sizeof(float) * w.coef.size());
  std::memcpy(w.host + at.constants, w.constants.data(), sizeof(float) * w.constants.size());
}

void ClearAddBack(Workspace& w) {
  w.addback.clear();
  w.theta.clear();
  w.coef.clear();
  w.constants.clear();
}

void StageQueries(const KvLayout& layout, int layer, const float* key_mean, const float* queries, int64_t tokens,
                  uint8_t* to) {
  const int qh = layout.num_query_heads(), d = layout.head_dim();
  const size_t floats = static_cast<size_t>(tokens) * qh * d;
  if (layout.key_scales(layer, 0, key_mean) == nullptr) {
    std::memcpy(to, queries, sizeof(float) * floats);
    return;
  }
  float* out = reinterpret_cast<float*>(to);
  for (size_t row = 0; row < floats / d; ++row) {
    const float* s = layout.key_scales(layer, static_cast<int>(row % qh) / layout.query_heads_per_kv_head(), key_mean);
    for (int j = 0; j < d; ++j) out[row * d + j] = queries[row * d + j] * s[j];
  }
}

void PlanScoreAddBack(const KvLayout& layout, const ScoreParams& p, Workspace& w) {
  ClearAddBack(w);
  if (!Centered(layout, p.key_mean)) return;
  const int d = layout.head_dim();
  const int group = layout.query_heads_per_kv_head();
  w.constants.assign(layout.num_query_heads(), 0.0f);
  for (int kv = 0; kv < layout.num_kv_heads(); ++kv) {
    const float* queries = p.queries + static_cast<size_t>(kv) * group * d;
    float* constants = w.constants.data() + kv * group;
    w.addback.push_back(PlanAddBack(
        layout, p.layer, p.key_mean + static_cast<size_t>(kv) * d, group, p.scale,
        [&](int r) { return queries + static_cast<size_t>(r) * d; }, [&](int r, float c) { constants[r] = c; }, w));
  }
}

}  // namespace cuda
}  // namespace tqkv
