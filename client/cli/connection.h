// What every CLI command that talks to a tqkv-server shares: the
// connection flags (--target, --cache, --auth-token-file, --tls-ca-file,
// --tls-server-name) and the ClientOptions they make.
#ifndef TQKV_CLIENT_CLI_CONNECTION_H_
#define TQKV_CLIENT_CLI_CONNECTION_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "client/cli/flags.h"
#include "client/cpp/tqkv_client.h"

namespace tqkv {
namespace cli {

struct Connection {
  std::string target = "localhost:50051";
  std::string cache;
  std::string auth_token_file;
  std::string tls_ca_file;
  std::string tls_server_name;
};

// Adds the connection flags, writing into `c`.
void AddConnectionFlags(FlagSet& flags, Connection* c);

// The file's bytes; NOT_FOUND when it cannot be read.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// The first token of a token file in the server's format: one per line,
// blank lines and '#' comments ignored. INVALID_ARGUMENT when it holds none.
absl::StatusOr<std::string> ReadFirstToken(const std::string& path);

// Client options for `c` (the default port added, 2 attempts, a 60 s
// timeout, the token and CA read from their files).
absl::StatusOr<ClientOptions> MakeClientOptions(const Connection& c);

// lo <= v <= hi.
inline bool InIntRange(int64_t v, int64_t lo, int64_t hi) { return v >= lo && v <= hi; }

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_CONNECTION_H_
