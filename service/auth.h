// Bearer tokens, tenants and their quotas (tqkv-server --auth_token_file).
//
// When the server holds tokens, every KvCache rpc must carry the metadata
// `authorization: Bearer <token>` with one of them; otherwise it fails with
// UNAUTHENTICATED "missing or invalid bearer token" before its request is
// read. The health and reflection services are not KvCache rpcs and stay
// open (load balancers probe them without a token).
//
// The token file. One token per line, then optional key=value fields:
//
//   # token                  fields
//   ops-7f3a...                                    an admin token
//   team-a-91c2...           tenant=team-a max_bytes=8GiB max_sequences=10000
//   team-a-rotated-04d1...   tenant=team-a         a second token, same tenant
//   team-b-5be0...           tenant=team-b max_bytes=512MiB
//
// A token without tenant= is an admin token: it reaches every sequence of
// every cache (the operator's scope, and what every token meant before
// tenants). A tenant token reaches only the tenant's sequences: those whose
// id starts with "<tenant>:" (team-a's are "team-a:chat-7", "team-a:chat-7/
// beam-0", ...). Naming any other id is PERMISSION_DENIED, decided from the
// id alone, so a tenant learns nothing about other tenants' sequences (not
// even whether one exists). Tenant names are 1..64 of [A-Za-z0-9._-].
//
// Quotas, per tenant, over every cache of the server (cache/usage_account.h):
// max_bytes bounds the pool pages its sequences hold (a size with an
// optional KiB/MiB/GiB/TiB suffix), max_sequences their number; 0 or absent
// means no limit. A call past a quota is RESOURCE_EXHAUSTED naming the
// tenant and changes nothing. Whoever creates a sequence in a tenant's
// namespace (the tenant or an admin), the tenant is charged for it. Several
// lines may name one tenant (token rotation); the quotas given on them must
// agree.
//
// Blank lines and lines starting with '#' are ignored; a line's fields are
// separated by spaces or tabs. Anything else (an unknown field, a bad size,
// a token holding a control character, the same token twice) is
// INVALID_ARGUMENT naming the line.
//
// Tokens are compared in constant time (in the token's length), and every
// token of the set is compared, so timing says nothing about which prefix
// matched or which token was close.
//
// Thread safety: an Authenticator is immutable after construction; the
// tenants' counters are atomics.
#ifndef TQKV_SERVICE_AUTH_H_
#define TQKV_SERVICE_AUTH_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "service/status_util.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/usage_account.h"

namespace tqkv {
namespace service {

// Longest tenant name, in bytes.
inline constexpr size_t kMaxTenantNameBytes = 64;

struct TenantSpec {
  std::string name;
  uint64_t max_bytes = 0;     // 0: no limit
  int64_t max_sequences = 0;  // 0: no limit
};

struct TokenGrant {
  std::string token;
  std::string tenant;  // "": admin
};

// What a token file says.
struct AuthConfig {
  std::vector<TokenGrant> tokens;
  std::vector<TenantSpec> tenants;  // each named tenant once, in file order

  bool enabled() const { return !tokens.empty(); }
  // Each token an admin token (tests, and the server's own default).
  static AuthConfig AdminTokens(const std::vector<std::string>& tokens);
};

// Parses a token file (syntax above). INVALID_ARGUMENT naming the line for
// anything malformed, or when no token remains.
absl::StatusOr<AuthConfig> ParseAuthConfig(const std::string& text);
// Reads and parses `path`. NOT_FOUND when it cannot be read; INVALID_ARGUMENT
// (naming the file) otherwise.
absl::StatusOr<AuthConfig> LoadAuthConfig(const std::string& path);

// "8GiB", "512MiB", "1048576", "1.5GiB" -> bytes; INVALID_ARGUMENT otherwise.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// True when a and b are equal; the time taken depends only on their lengths.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

// One tenant of the server: its namespace, its usage account and the calls
// its tokens made.
class Tenant {
 public:
  explicit Tenant(const TenantSpec& spec);

  const std::string& name() const { return name_; }
  // "<name>:": every id of the tenant starts with it.
  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<UsageAccount>& account() const { return account_; }

  // A finished call made with one of the tenant's tokens.
  void CountCall(grpc::StatusCode code) const;
  // Calls so far by status code (index = code, 0..16).
  std::array<uint64_t, kNumGrpcCodes> Calls() const;

 private:
  std::string name_;
  std::string prefix_;
  std::shared_ptr<UsageAccount> account_;
  mutable std::array<std::atomic<uint64_t>, kNumGrpcCodes> calls_{};
};

// Who is calling: an admin (or anyone, with auth off) or one tenant.
struct Caller {
  const Tenant* tenant = nullptr;  // null: admin

  bool admin() const { return tenant == nullptr; }
  static Caller Admin() { return Caller(); }
};

class Authenticator {
 public:
  // No tokens: every call is accepted as an admin's.
  explicit Authenticator(const AuthConfig& config = AuthConfig());

  bool enabled() const { return !grants_.empty(); }

  // The caller whose token the context's `authorization` metadata carries
  // ("Bearer <token>", the scheme case-insensitive); UNAUTHENTICATED when it
  // carries none of the tokens. Auth off: an admin.
  absl::StatusOr<Caller> Authenticate(const grpc::CallbackServerContext& context) const;
  // The same on the header's value (tests, other transports).
  absl::StatusOr<Caller> AuthenticateHeader(const std::string* authorization) const;

  // OK when `caller` may name sequence `id`; PERMISSION_DENIED (naming
  // `field` and the prefix wanted) otherwise.
  static absl::Status Authorize(const Caller& caller, const std::string& id, const char* field);

  // The tenant whose namespace `id` is in (the text before its first ':'
  // names a tenant), or null.
  const Tenant* TenantOfId(absl::string_view id) const;
  // The account a new sequence `id` is charged to: its tenant's, or null.
  std::shared_ptr<UsageAccount> AccountOf(absl::string_view id) const;

  // Every tenant, by name.
  std::vector<const Tenant*> tenants() const;

 private:
  struct Grant {
    std::string token;
    const Tenant* tenant;  // null: admin
  };
  std::vector<Grant> grants_;
  std::map<std::string, std::unique_ptr<Tenant>, std::less<>> tenants_;
};

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_AUTH_H_
