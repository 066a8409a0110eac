// The server's cache configuration: a text-format tqkv.v1.ServerConfig
// (--config FILE), or the embedded default when no file is given, validated
// into one CacheOptions per cache.
//
// Defaults applied to fields left at zero / empty: page_tokens 16, preset
// "turboquant_k3v4_nc", boundary_preset "fp16", rotation_seed the layout's
// default seed (so 0 cannot be chosen as a seed), memory_budget_bytes an
// equal share of the process budget among the caches that give 0, idle TTL
// never. The first cache may leave its name empty: it is then "default".
#ifndef TQKV_SERVICE_CONFIG_H_
#define TQKV_SERVICE_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cache/kv_cache.h"
#include "tqkv/v1/kvcache.pb.h"

namespace tqkv {
namespace service {

// One cache "default" with the Llama-3.1-8B layout (32 layers, 8 KV heads, 32
// query heads, head_dim 128, 16-token pages), preset turboquant_k3v4_nc, the
// first and last 2 layers at fp16.
const char* DefaultServerConfigText();

// Parses text format. INVALID_ARGUMENT with the parser's line and column.
// Deprecated field names are read as their new ones, each with a line in
// `warnings` (when not null): exact_window_tokens is exact_recent_tokens
// (the field number is the same; "window" is sliding-window attention's).
absl::StatusOr<v1::ServerConfig> ParseServerConfig(const std::string& text,
                                                   std::vector<std::string>* warnings = nullptr);

// Reads and parses `path`; the embedded default when `path` is empty.
// NOT_FOUND when the file cannot be read.
absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path,
                                                  std::vector<std::string>* warnings = nullptr);

// Validates `config` and turns it into CacheOptions, in config order.
// `process_budget_bytes` is split equally among caches whose
// memory_budget_bytes is 0. INVALID_ARGUMENT for no caches, duplicate or empty
// names, non-positive shapes, a negative TTL, a layout KvLayout::Create
// rejects (its message, prefixed with the cache name), or a budget below one
// page; NOT_FOUND for an unknown preset.
absl::StatusOr<std::vector<CacheOptions>> ToCacheOptions(const v1::ServerConfig& config, uint64_t process_budget_bytes);

// The effective configuration of a cache, as GetServerInfo reports it.
v1::CacheConfig ToCacheConfig(const CacheOptions& options);

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_CONFIG_H_
