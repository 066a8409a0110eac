#include "client/cli/command_util.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <string>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tqkv {
namespace cli {

int ParseOrExit(FlagSet& flags, int argc, const char* const* argv) {
  absl::Status status = flags.Parse(argc, argv);
  for (const std::string& warning : flags.Warnings()) fprintf(stderr, "tqkv: %s\n", warning.c_str());
  if (status.ok()) return -1;
  if (IsHelpRequest(status)) {
    printf("%s", flags.Usage().c_str());
    return 0;
  }
  fprintf(stderr, "tqkv: %s\n\n%s", std::string(status.message()).c_str(), flags.Usage().c_str());
  return kExitUsage;
}

void PrintJson(const Json& value) {
  const std::string text = value.dump(2, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
  fwrite(text.data(), 1, text.size(), stdout);
  fputc('\n', stdout);
}

Json FloatArray(const float* values, size_t count) {
  Json array = Json::array();
  for (size_t i = 0; i < count; ++i) {
    // Shortest round-trip text of the float, read back as a double: the
    // double nlohmann prints with that same text.
    char text[32];
    const std::to_chars_result written = std::to_chars(text, text + sizeof(text), values[i]);
    double value = values[i];
    if (written.ec == std::errc()) std::from_chars(text, written.ptr, value);
    array.push_back(value);
  }
  return array;
}

int Fail(const absl::Status& status) {
  fprintf(stderr, "tqkv: %s\n", status.ToString().c_str());
  return kExitFailure;
}

int UsageError(const std::string& message) {
  fprintf(stderr, "tqkv: %s\n", message.c_str());
  return kExitUsage;
}

std::string WithDefaultPort(const std::string& target) {
  if (target.empty() || absl::StrContains(target, "://") || absl::StartsWith(target, "unix:") ||
      absl::StartsWith(target, "unix-abstract:") || absl::StartsWith(target, "ipv4:") ||
      absl::StartsWith(target, "ipv6:") || absl::StartsWith(target, "vsock:")) {
    return target;
  }
  if (target.front() == '[') {  // [v6] or [v6]:port
    return target.back() == ']' ? absl::StrCat(target, ":", kDefaultServerPort) : target;
  }
  const size_t colons = static_cast<size_t>(std::count(target.begin(), target.end(), ':'));
  if (colons == 0) return absl::StrCat(target, ":", kDefaultServerPort);
  return target;  // host:port, or a bare IPv6 address
}

std::string UnreachableMessage(const absl::Status& status, const std::string& target) {
  if (status.code() != absl::StatusCode::kUnavailable) return "";
  // gRPC's own channel errors, which start the message; an UNAVAILABLE the
  // server sent (a lost device, "the export from <source> failed: failed to
  // connect ..." from a pull) starts otherwise and is shown as it is.
  const absl::string_view m = status.message();
  const bool channel = absl::StartsWith(m, "failed to connect to all addresses") ||
                       absl::StartsWith(m, "DNS resolution failed") || absl::StartsWith(m, "Socket closed") ||
                       absl::StartsWith(m, "Connection reset") || absl::StartsWith(m, "Broken pipe") ||
                       absl::StartsWith(m, "empty address list") ||
                       absl::StartsWith(m, "connections to all backends failing");
  if (!channel) return "";
  std::string why = "no connection";
  if (absl::StrContains(m, "Connection refused")) {
    why = "connection refused";
  } else if (absl::StartsWith(m, "DNS resolution failed")) {
    why = "the host name does not resolve";
  } else if (absl::StartsWith(m, "Socket closed") || absl::StartsWith(m, "Connection reset") ||
             absl::StartsWith(m, "Broken pipe")) {
    why = "the connection was closed";
  }
  return absl::StrCat("cannot reach ", target, " (", why, "): is tqkv-server running at ", target, "?");
}

int FailRpc(const absl::Status& status, const std::string& target) {
  const std::string unreachable = UnreachableMessage(status, WithDefaultPort(target));
  if (unreachable.empty()) return Fail(status);
  fprintf(stderr, "tqkv: %s\n", unreachable.c_str());
  return kExitFailure;
}

}  // namespace cli
}  // namespace tqkv
