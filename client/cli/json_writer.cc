#include "client/cli/json_writer.h"

#include <cmath>
#include <cstdio>

namespace tqkv {
namespace {

void AppendEscaped(std::string& out, const std::string& text) {
  out += '"';
  for (unsigned char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          char buffer[8];
          snprintf(buffer, sizeof(buffer), "\\u%04x", c);
          out += buffer;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void Newline(std::string& out, int indent, int depth) {
  if (indent < 0) return;
  out += '\n';
  out.append(static_cast<size_t>(indent) * depth, ' ');
}

}  // namespace

JsonValue JsonValue::NumberArray(const std::vector<double>& numbers) {
  JsonValue array = Array();
  for (double n : numbers) array.Append(n);
  return array;
}

JsonValue& JsonValue::Set(const std::string& key, JsonValue value) {
  members_.emplace_back(key, std::move(value));
  return *this;
}

JsonValue& JsonValue::Append(JsonValue value) {
  elements_.push_back(std::move(value));
  return *this;
}

std::string JsonValue::Serialize(int indent) const {
  std::string out;
  SerializeTo(out, indent, 0);
  return out;
}

void JsonValue::SerializeTo(std::string& out, int indent, int depth) const {
  switch (kind_) {
    case Kind::kNull:
      out += "null";
      return;
    case Kind::kNumber: {
      if (!std::isfinite(number_)) {
        out += "null";
        return;
      }
      char buffer[32];
      snprintf(buffer, sizeof(buffer), "%.9g", number_);
      out += buffer;
      return;
    }
    case Kind::kInteger:
      out += std::to_string(integer_);
      return;
    case Kind::kBool:
      out += bool_ ? "true" : "false";
      return;
    case Kind::kString:
      AppendEscaped(out, text_);
      return;
    case Kind::kObject: {
      out += '{';
      bool first = true;
      for (const auto& [key, value] : members_) {
        if (!first) out += ',';
        first = false;
        Newline(out, indent, depth + 1);
        AppendEscaped(out, key);
        out += indent < 0 ? ":" : ": ";
        value.SerializeTo(out, indent, depth + 1);
      }
      if (!members_.empty()) Newline(out, indent, depth);
      out += '}';
      return;
    }
    case Kind::kArray: {
      out += '[';
      // Arrays of scalars stay on one line: easier to read, still valid.
      bool scalars = true;
      for (const JsonValue& e : elements_) scalars &= e.kind_ != Kind::kObject && e.kind_ != Kind::kArray;
      bool first = true;
      for (const JsonValue& e : elements_) {
        if (!first) out += scalars && indent >= 0 ? ", " : ",";
        first = false;
        if (!scalars) Newline(out, indent, depth + 1);
        e.SerializeTo(out, indent, depth + 1);
      }
      if (!scalars && !elements_.empty()) Newline(out, indent, depth);
      out += ']';
      return;
    }
  }
}

}  // namespace tqkv
