// Bearer-token authentication for the KvCache service (tqkv-server
// --auth_token_file). When the server holds a token set, every KvCache rpc
// must carry the metadata `authorization: Bearer <token>` with one of the
// tokens; otherwise it fails with UNAUTHENTICATED "missing or invalid bearer
// token" before its request is looked at. The health and reflection services
// are not KvCache rpcs and stay open (load balancers probe them without a
// token).
//
// Tokens are compared in constant time (in the token's length), and every
// token of the set is compared, so timing says nothing about which prefix
// matched or which token was close.
//
// Thread safety: an Authenticator is immutable after construction.
#ifndef TQKV_SERVICE_AUTH_H_
#define TQKV_SERVICE_AUTH_H_

#include <string>
#include <vector>

#include <grpcpp/server_context.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tqkv {
namespace service {

// The tokens of a token file: one per line, surrounding whitespace trimmed,
// blank lines and lines starting with '#' ignored. INVALID_ARGUMENT when no
// token remains or a token holds whitespace or a control character.
absl::StatusOr<std::vector<std::string>> ParseAuthTokens(const std::string& text);

// Reads and parses `path`. NOT_FOUND when it cannot be read; INVALID_ARGUMENT
// (naming the file) when it holds no token.
absl::StatusOr<std::vector<std::string>> LoadAuthTokens(const std::string& path);

// True when a and b are equal; the time taken depends only on their lengths.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

class Authenticator {
 public:
  // No tokens: every call is accepted.
  explicit Authenticator(std::vector<std::string> tokens = {}) : tokens_(std::move(tokens)) {}

  bool enabled() const { return !tokens_.empty(); }

  // OK when auth is off or the context's `authorization` metadata is
  // "Bearer <one of the tokens>"; UNAUTHENTICATED otherwise.
  absl::Status Check(const grpc::CallbackServerContext& context) const;
  // The same on the header's value (tests, other transports).
  absl::Status CheckHeader(const std::string* authorization) const;

 private:
  std::vector<std::string> tokens_;
};

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_AUTH_H_
