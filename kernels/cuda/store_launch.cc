#include "kernels/cuda/store_launch.h"

#include <cstring>

namespace tqkv {
namespace cuda {

void StageStore(const StoreParams& p, int64_t t0, int64_t tokens, const StoreWorkspace& at, Workspace& w) {
  const KvLayout& layout = *p.layout;
  const size_t vector_floats = static_cast<size_t>(layout.num_kv_heads()) * layout.head_dim();
  const size_t layer_bytes = static_cast<size_t>(tokens) * vector_floats * sizeof(float);
  for (int l = 0; l < p.layer_end - p.layer_begin; ++l) {
    const size_t src = (static_cast<size_t>(l) * p.num_tokens + t0) * vector_floats;
    std::memcpy(w.host + at.keys + l * layer_bytes, p.keys + src, layer_bytes);
    std::memcpy(w.host + at.values + l * layer_bytes, p.values + src, layer_bytes);
  }
  std::memcpy(w.host + at.slots, p.slots + t0, sizeof(int32_t) * tokens);
  const unsigned long long no_error = ~0ull;
  std::memcpy(w.host + at.error, &no_error, sizeof(no_error));
}

StoreKernelParams StoreOf(const PoolTables& tables, const StoreParams& p, int64_t tokens, const StoreWorkspace& at,
                          const Workspace& w) {
  const KvLayout& layout = *p.layout;
  StoreKernelParams k;
  k.heads = p.layout == tables.exact_layout ? tables.exact.heads : tables.main.heads;
  k.pool = p.pool.base;
  k.page_bytes = p.pool.page_bytes;
  k.page_tokens = layout.page_tokens();
  k.num_kv_heads = layout.num_kv_heads();
  k.head_dim = layout.head_dim();
  k.layer_begin = p.layer_begin;
  k.num_layers = p.layer_end - p.layer_begin;
  k.num_tokens = static_cast<int32_t>(tokens);
  k.slots = reinterpret_cast<const int32_t*>(w.device + at.slots);
  k.keys = reinterpret_cast<const float*>(w.device + at.keys);
  k.values = reinterpret_cast<const float*>(w.device + at.values);
  k.error = reinterpret_cast<unsigned long long*>(w.device + at.error);
  return k;
}

}  // namespace cuda
}  // namespace tqkv
