// Named model shapes for the CLI's benchmarks and capacity planning.
#ifndef TQKV_CLIENT_CLI_MODEL_LAYOUTS_H_
#define TQKV_CLIENT_CLI_MODEL_LAYOUTS_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tqkv {
namespace cli {

struct ModelShape {
  std::string_view name;
  int num_layers;
  int num_kv_heads;
  int num_query_heads;
  int head_dim;
};

const std::vector<ModelShape>& ModelShapes();
// NOT_FOUND listing the known names.
absl::StatusOr<ModelShape> FindModelShape(std::string_view name);

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_MODEL_LAYOUTS_H_
