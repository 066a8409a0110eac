// What `tqkv load`'s two modes (load_generator.h, decode_load.h) share.
#ifndef TQKV_CLIENT_CLI_LOAD_COMMON_H_
#define TQKV_CLIENT_CLI_LOAD_COMMON_H_

#include <algorithm>
#include <string>
#include <vector>

#include "tqkv/v1/kvcache.pb.h"

namespace tqkv {
namespace cli {

// The p-quantile (0..1) of ascending `sorted`, nearest rank; 0 when empty.
inline double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t i = std::min(sorted.size() - 1, static_cast<size_t>(p * (sorted.size() - 1) + 0.5));
  return sorted[i];
}

// The cache named `name` in `info`; "" means "default", else the first.
// Null when there is none.
inline const v1::CacheInfo* FindCache(const v1::ServerInfo& info, const std::string& name) {
  const v1::CacheInfo* cache = nullptr;
  for (const v1::CacheInfo& c : info.caches()) {
    if (c.config().name() == name || (name.empty() && (cache == nullptr || c.config().name() == "default"))) {
      cache = &c;
    }
  }
  return cache;
}

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_LOAD_COMMON_H_
