// A minimal JSON writer for the CLI's --json output: objects, arrays, numbers
// (non-finite numbers become null), strings with escaping. Build a value tree,
// then Serialize. Not for parsing.
#ifndef TQKV_CLIENT_CLI_JSON_WRITER_H_
#define TQKV_CLIENT_CLI_JSON_WRITER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tqkv {

class JsonValue {
 public:
  JsonValue() : kind_(Kind::kNull) {}
  JsonValue(double number) : kind_(Kind::kNumber), number_(number) {}  // NOLINT
  JsonValue(int number) : JsonValue(static_cast<int64_t>(number)) {}  // NOLINT
  JsonValue(int64_t number) : kind_(Kind::kInteger), integer_(number) {}  // NOLINT
  JsonValue(bool value) : kind_(Kind::kBool), bool_(value) {}  // NOLINT
  JsonValue(std::string text) : kind_(Kind::kString), text_(std::move(text)) {}  // NOLINT
  JsonValue(const char* text) : JsonValue(std::string(text)) {}  // NOLINT

  static JsonValue Object() { return JsonValue(Kind::kObject); }
  static JsonValue Array() { return JsonValue(Kind::kArray); }
  static JsonValue NumberArray(const std::vector<double>& numbers);

  // Object members keep insertion order. REQUIRES: this is an object.
  JsonValue& Set(const std::string& key, JsonValue value);
  // REQUIRES: this is an array.
  JsonValue& Append(JsonValue value);

  // Compact when indent < 0, else pretty-printed with `indent` spaces.
  std::string Serialize(int indent = 2) const;

 private:
  enum class Kind { kNull, kNumber, kInteger, kBool, kString, kObject, kArray };
  explicit JsonValue(Kind kind) : kind_(kind) {}
  void SerializeTo(std::string& out, int indent, int depth) const;

  Kind kind_;
  double number_ = 0.0;
  int64_t integer_ = 0;
  bool bool_ = false;
  std::string text_;
  std::vector<std::pair<std::string, JsonValue>> members_;
  std::vector<JsonValue> elements_;
};

}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_JSON_WRITER_H_
