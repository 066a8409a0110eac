#include "client/cli/model_layouts.h"

#include "absl/strings/str_cat.h"

namespace tqkv {
namespace cli {

const std::vector<ModelShape>& ModelShapes() {
  // Published configurations (config.json of each model).
  static const std::vector<ModelShape> shapes = {
      {"llama3-8b", 32, 8, 32, 128},  {"llama3-70b", 80, 8, 64, 128}, {"llama3-405b", 126, 8, 128, 128},
      {"mistral-7b", 32, 8, 32, 128}, {"qwen2.5-7b", 28, 4, 28, 128}, {"qwen2.5-72b", 80, 8, 64, 128},
      {"phi3-mini", 32, 32, 32, 96},  {"smollm2-135m", 30, 3, 9, 64},
  };
  return shapes;
}

absl::StatusOr<ModelShape> FindModelShape(std::string_view name) {
  std::string known;
  for (const ModelShape& shape : ModelShapes()) {
    if (shape.name == name) return shape;
    absl::StrAppend(&known, known.empty() ? "" : ", ", std::string(shape.name));
  }
  return absl::NotFoundError(absl::StrCat("unknown layout '", std::string(name), "'; known: ", known));
}

}  // namespace cli
}  // namespace tqkv
