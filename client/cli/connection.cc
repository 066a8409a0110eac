#include "client/cli/connection.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/cli/command_util.h"

namespace tqkv {
namespace cli {

void AddConnectionFlags(FlagSet& flags, Connection* c) {
  flags.AddString("target", &c->target, "host[:port] of the tqkv-server (port 50051 when none)");
  flags.AddString("cache", &c->cache, "cache name (empty: the server's default)");
  flags.AddString("auth-token-file", &c->auth_token_file, "file whose first token is sent as the bearer token");
  flags.AddString("tls-ca-file", &c->tls_ca_file, "PEM CA certificate: connect with TLS");
  flags.AddString("tls-server-name", &c->tls_server_name,
                  "name the server certificate must carry, if not the target host");
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The first token of a token file in the server's format: one per line,
// blank lines and '#' comments ignored.
absl::StatusOr<std::string> ReadFirstToken(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (!line.empty() && line[0] != '#') return std::string(line);
  }
  return absl::InvalidArgumentError(absl::StrCat("auth token file '", path, "' holds no token"));
}

absl::StatusOr<ClientOptions> MakeClientOptions(const Connection& c) {
  ClientOptions options;
  options.target = WithDefaultPort(c.target);
  options.max_attempts = 2;
  options.timeout = absl::Seconds(60);
  if (!c.auth_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadFirstToken(c.auth_token_file);
    if (!token.ok()) return token.status();
    options.auth_token = *std::move(token);
  }
  if (!c.tls_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadFile(c.tls_ca_file);
    if (!ca.ok()) return ca.status();
    options.tls_root_certs_pem = *std::move(ca);
  }
  options.tls_server_name_override = c.tls_server_name;
  return options;
}

}  // namespace cli
}  // namespace tqkv
