#include "kernels/backend.h"

#include <algorithm>
#include <cstddef>
#include <vector>

namespace tqkv {

StoreParams ExactStorePart(const StoreParams& params, std::vector<float>* keys, std::vector<float>* values,
                           std::vector<int32_t>* slots) {
  StoreParams part = params;
  part.layout = params.exact_layout;
  part.exact_layout = nullptr;
  part.exact_slots = nullptr;
  slots->clear();
  if (params.exact_slots == nullptr || params.exact_layout == nullptr) {
    part.num_tokens = 0;
    return part;
  }
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < params.num_tokens; ++i) {
    if (params.exact_slots[i] < 0) continue;
    rows.push_back(i);
    slots->push_back(params.exact_slots[i]);
  }
  const int layers = params.layer_end - params.layer_begin;
  const size_t row = static_cast<size_t>(params.layout->num_kv_heads()) * params.layout->head_dim();
  const int64_t m = static_cast<int64_t>(rows.size());
  keys->resize(static_cast<size_t>(layers) * m * row);
  values->resize(keys->size());
  for (int l = 0; l < layers; ++l) {
    for (int64_t j = 0; j < m; ++j) {
      const size_t from = (static_cast<size_t>(l) * params.num_tokens + rows[j]) * row;
      const size_t to = (static_cast<size_t>(l) * m + j) * row;
      std::copy(params.keys + from, params.keys + from + row, keys->begin() + to);
      std::copy(params.values + from, params.values + from + row, values->begin() + to);
    }
  }
  part.num_tokens = m;
  part.slots = slots->data();
  part.keys = keys->data();
  part.values = values->data();
  return part;
}

}  // namespace tqkv
