#include "service/auth.h"

#include <grpcpp/server_context.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tqkv {
namespace service {

absl::StatusOr<std::vector<std::string>> ParseAuthTokens(const std::string& text) {
  std::vector<std::string> tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    for (char c : line) {
      if (absl::ascii_isspace(static_cast<unsigned char>(c)) ||
          absl::ascii_iscntrl(static_cast<unsigned char>(c))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "line ", line_number, ": a token holds whitespace or a control character; want one "
            "token per line"));
      }
    }
    tokens.emplace_back(line);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        "no token found; want one token per line (blank lines and '#' comments are ignored)");
  }
  return tokens;
}

absl::StatusOr<std::vector<std::string>> LoadAuthTokens(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read auth token file '", path, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  absl::StatusOr<std::vector<std::string>> tokens = ParseAuthTokens(text.str());
  if (!tokens.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("auth token file '", path, "': ", tokens.status().message()));
  }
  return tokens;
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // Compare over the longer length so a short guess costs the same as a
  // long one; the length difference itself is folded into the result.
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

absl::Status Authenticator::CheckHeader(const std::string* authorization) const {
  if (tokens_.empty()) return absl::OkStatus();
  // The scheme is case-insensitive (RFC 7235 section 2.1); the token is not.
  constexpr absl::string_view kPrefix = "Bearer ";
  bool match = false;
  if (authorization != nullptr && authorization->size() > kPrefix.size() &&
      absl::EqualsIgnoreCase(absl::string_view(*authorization).substr(0, kPrefix.size()),
                             kPrefix)) {
    const std::string presented = authorization->substr(kPrefix.size());
    // Every token is compared: no early exit on the first match.
    for (const std::string& token : tokens_) match |= ConstantTimeEquals(presented, token);
  }
  if (!match) return absl::UnauthenticatedError("missing or invalid bearer token");
  return absl::OkStatus();
}

absl::Status Authenticator::Check(const grpc::CallbackServerContext& context) const {
  if (tokens_.empty()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return CheckHeader(nullptr);
  const std::string value(it->second.data(), it->second.size());
  return CheckHeader(&value);
}

}  // namespace service
}  // namespace tqkv
