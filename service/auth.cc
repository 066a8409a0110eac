#include "service/auth.h"

#include <grpcpp/server_context.h>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace tqkv {
namespace service {
namespace {

bool ValidTenantName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxTenantNameBytes) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') return false;
  }
  return true;
}

}  // namespace

AuthConfig AuthConfig::AdminTokens(const std::vector<std::string>& tokens) {
  AuthConfig config;
  for (const std::string& token : tokens) config.tokens.push_back({token, ""});
  return config;
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  struct Unit {
    absl::string_view suffix;
    double scale;
  };
  static constexpr Unit kUnits[] = {
      {"TiB", 1099511627776.0}, {"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0}, {"B", 1.0}};
  double scale = 1.0;
  absl::string_view number = text;
  for (const Unit& unit : kUnits) {
    if (absl::EndsWith(text, unit.suffix)) {
      number = text.substr(0, text.size() - unit.suffix.size());
      scale = unit.scale;
      break;
    }
  }
  double value = 0;
  if (number.empty() || !absl::SimpleAtod(number, &value) || !std::isfinite(value) || value < 0 ||
      value * scale > 9.0e18) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "'%s' is not a size; want bytes, optionally with a KiB, MiB, GiB or TiB suffix (e.g. 8GiB)", text));
  }
  return static_cast<uint64_t>(std::llround(value * scale));
}

absl::StatusOr<AuthConfig> ParseAuthConfig(const std::string& text) {
  AuthConfig config;
  std::map<std::string, std::pair<TenantSpec, int>> tenants;  // name -> (spec, line that set its quotas)
  std::set<std::string> seen_tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const auto fail = [line_number](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_number, ": ", why));
    };
    std::vector<absl::string_view> fields = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string token(fields[0]);
    for (char c : token) {
      if (absl::ascii_iscntrl(static_cast<unsigned char>(c))) {
        return fail("the token holds a control character");
      }
    }
    if (absl::StrContains(token, '=')) {
      return fail("the line starts with a field; want the token first, then key=value fields");
    }
    if (!seen_tokens.insert(token).second) return fail("this token is listed twice");
    TokenGrant grant{token, ""};
    TenantSpec quotas;
    bool has_max_bytes = false, has_max_sequences = false;
    for (size_t i = 1; i < fields.size(); ++i) {
      const std::vector<absl::string_view> kv = absl::StrSplit(fields[i], absl::MaxSplits('=', 1));
      if (kv.size() != 2 || kv[1].empty()) {
        return fail(absl::StrCat("'", fields[i], "' is not key=value; want tenant=, max_bytes= or max_sequences="));
      }
      if (kv[0] == "tenant") {
        if (!ValidTenantName(kv[1])) {
          return fail(absl::StrCat("tenant '", kv[1], "': want 1..", kMaxTenantNameBytes,
                                   " of letters, digits, '.', '_' and '-'"));
        }
        grant.tenant = std::string(kv[1]);
      } else if (kv[0] == "max_bytes") {
        absl::StatusOr<uint64_t> bytes = ParseByteSize(kv[1]);
        if (!bytes.ok()) return fail(absl::StrCat("max_bytes: ", bytes.status().message()));
        quotas.max_bytes = *bytes;
        has_max_bytes = true;
      } else if (kv[0] == "max_sequences") {
        int64_t n = 0;
        if (!absl::SimpleAtoi(kv[1], &n) || n < 0) {
          return fail(absl::StrCat("max_sequences '", kv[1], "': want a count >= 0 (0: no limit)"));
        }
        quotas.max_sequences = n;
        has_max_sequences = true;
      } else {
        return fail(absl::StrCat("unknown field '", kv[0], "'; want tenant=, max_bytes= or max_sequences="));
      }
    }
    if (grant.tenant.empty() && (has_max_bytes || has_max_sequences)) {
      return fail("quotas need a tenant=: an admin token has none");
    }
    if (!grant.tenant.empty()) {
      auto [it, inserted] = tenants.try_emplace(grant.tenant);
      TenantSpec& spec = it->second.first;
      if (inserted) {
        spec.name = grant.tenant;
        config.tenants.push_back(spec);  // order; the quotas are filled in below
      }
      if (has_max_bytes || has_max_sequences) {
        const bool set_before = it->second.second != 0;
        if (set_before && (spec.max_bytes != quotas.max_bytes || spec.max_sequences != quotas.max_sequences)) {
          return fail(absl::StrFormat("tenant '%s' gets other quotas than on line %d; give them once, or the same",
                                      grant.tenant, it->second.second));
        }
        spec.max_bytes = quotas.max_bytes;
        spec.max_sequences = quotas.max_sequences;
        it->second.second = line_number;
      }
    }
    config.tokens.push_back(std::move(grant));
  }
  if (config.tokens.empty()) {
    return absl::InvalidArgumentError(
        "no token found; want one token per line (blank lines and '#' comments are ignored)");
  }
  for (TenantSpec& spec : config.tenants) spec = tenants[spec.name].first;
  return config;
}

absl::StatusOr<AuthConfig> LoadAuthConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read auth token file '", path, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  absl::StatusOr<AuthConfig> config = ParseAuthConfig(text.str());
  if (!config.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("auth token file '", path, "': ", config.status().message()));
  }
  return config;
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

Tenant::Tenant(const TenantSpec& spec)
    : name_(spec.name), prefix_(spec.name + ":"),
      account_(std::make_shared<UsageAccount>(absl::StrCat("tenant '", spec.name, "'"), spec.max_bytes,
                                              spec.max_sequences)) {}

void Tenant::CountCall(grpc::StatusCode code) const {
  const int index = static_cast<int>(code);
  calls_[index >= 0 && index < kNumGrpcCodes ? index : static_cast<int>(grpc::StatusCode::UNKNOWN)].fetch_add(
      1, std::memory_order_relaxed);
}

std::array<uint64_t, kNumGrpcCodes> Tenant::Calls() const {
  std::array<uint64_t, kNumGrpcCodes> calls;
  for (int i = 0; i < kNumGrpcCodes; ++i) calls[i] = calls_[i].load(std::memory_order_relaxed);
  return calls;
}

Authenticator::Authenticator(const AuthConfig& config) {
  for (const TenantSpec& spec : config.tenants) tenants_.emplace(spec.name, std::make_unique<Tenant>(spec));
  for (const TokenGrant& grant : config.tokens) {
    const Tenant* tenant = nullptr;
    if (!grant.tenant.empty()) {
      auto it = tenants_.find(grant.tenant);
      if (it == tenants_.end())
        it = tenants_.emplace(grant.tenant, std::make_unique<Tenant>(TenantSpec{grant.tenant})).first;
      tenant = it->second.get();
    }
    grants_.push_back({grant.token, tenant});
  }
}

absl::StatusOr<Caller> Authenticator::AuthenticateHeader(const std::string* authorization) const {
  if (grants_.empty()) return Caller::Admin();
  // The scheme is case-insensitive (RFC 7235 section 2.1); the token is not.
  constexpr absl::string_view kPrefix = "Bearer ";
  if (authorization == nullptr || authorization->size() <= kPrefix.size() ||
      !absl::EqualsIgnoreCase(absl::string_view(*authorization).substr(0, kPrefix.size()), kPrefix)) {
    return absl::UnauthenticatedError("missing or invalid bearer token");
  }
  const std::string presented = authorization->substr(kPrefix.size());
  // Every token is compared: no early exit on the first match (tokens are
  // unique, so at most one matches).
  const Grant* match = nullptr;
  for (const Grant& grant : grants_) {
    if (ConstantTimeEquals(presented, grant.token)) match = &grant;
  }
  if (match == nullptr) return absl::UnauthenticatedError("missing or invalid bearer token");
  return Caller{match->tenant};
}

absl::StatusOr<Caller> Authenticator::Authenticate(const grpc::CallbackServerContext& context) const {
  if (grants_.empty()) return Caller::Admin();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return AuthenticateHeader(nullptr);
  const std::string value(it->second.data(), it->second.size());
  return AuthenticateHeader(&value);
}

absl::Status Authenticator::Authorize(const Caller& caller, const std::string& id, const char* field) {
  if (caller.admin() || absl::StartsWith(id, caller.tenant->prefix())) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrFormat("%s '%s' is outside tenant '%s': its token reaches only sequence ids starting with '%s'", field,
                      id, caller.tenant->name(), caller.tenant->prefix()));
}

const Tenant* Authenticator::TenantOfId(absl::string_view id) const {
  const size_t colon = id.find(':');
  if (colon == absl::string_view::npos) return nullptr;
  auto it = tenants_.find(id.substr(0, colon));
  return it == tenants_.end() ? nullptr : it->second.get();
}

std::shared_ptr<UsageAccount> Authenticator::AccountOf(absl::string_view id) const {
  const Tenant* tenant = TenantOfId(id);
  return tenant == nullptr ? nullptr : tenant->account();
}

std::vector<const Tenant*> Authenticator::tenants() const {
  std::vector<const Tenant*> out;
  for (const auto& [name, tenant] : tenants_) out.push_back(tenant.get());
  return out;
}

}  // namespace service
}  // namespace tqkv
