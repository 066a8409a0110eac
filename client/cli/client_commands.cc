// The CLI subcommands that talk to a tqkv-server through tqkv::Client: info,
// sequence, append, attend, score, fork, drop, load. Every one takes
// --target (default localhost:50051; a host without a port means port 50051),
// --cache, --auth-token-file and --tls-ca-file, and --json; a failed rpc
// prints "tqkv: CODE: message" (or "cannot reach ...: is tqkv-server running
// at ...?" when nothing answered) and exits 1.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/cli/command_util.h"
#include "client/cli/commands.h"
#include "client/cli/decode_load.h"
#include "client/cli/flags.h"
#include "client/cli/load_generator.h"
#include "client/cli/npy.h"
#include "client/cpp/tqkv_client.h"

namespace tqkv {
namespace cli {
namespace {

struct Connection {
  std::string target = "localhost:50051";
  std::string cache;
  std::string auth_token_file;
  std::string tls_ca_file;
  std::string tls_server_name;
};

void AddConnectionFlags(FlagSet& flags, Connection* c) {
  flags.AddString("target", &c->target, "host[:port] of the tqkv-server (port 50051 when none)");
  flags.AddString("cache", &c->cache, "cache name (empty: the server's default)");
  flags.AddString("auth-token-file", &c->auth_token_file,
                  "file whose first token is sent as the bearer token");
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

// A 1-D int range check with a usage error.
bool InIntRange(int64_t v, int64_t lo, int64_t hi) { return v >= lo && v <= hi; }

int RunInfoImpl(int argc, const char* const* argv) {
  FlagSet flags("info", "Backend, device, caches (layout, pages, tokens, bytes) and presets.");
  Connection c;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddBool("json", &json, "print JSON instead of text");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  absl::StatusOr<v1::ServerInfo> info = Client(*options).GetServerInfo();
  if (!info.ok()) return FailRpc(info.status(), c.target);
  if (!c.cache.empty()) {  // only that cache; an unknown name is an error
    std::vector<std::string> names;
    v1::CacheInfo only;
    for (const v1::CacheInfo& ci : info->caches()) {
      names.push_back(absl::StrCat("'", ci.config().name(), "'"));
      if (ci.config().name() == c.cache) only = ci;
    }
    if (only.config().name() != c.cache) {
      return Fail(absl::NotFoundError(absl::StrCat("the server at ", c.target, " has no cache '", c.cache,
                                                   "'; its caches: ", absl::StrJoin(names, ", "))));
    }
    info->clear_caches();
    *info->add_caches() = std::move(only);
  }
  if (json) {
    Json caches = Json::array();
    for (const v1::CacheInfo& ci : info->caches()) {
      const v1::CacheConfig& k = ci.config();
      caches.push_back(Json{{"name", k.name()},
                            {"num_layers", k.num_layers()},
                            {"num_kv_heads", k.num_kv_heads()},
                            {"num_query_heads", k.num_query_heads()},
                            {"head_dim", k.head_dim()},
                            {"page_tokens", k.page_tokens()},
                            {"preset", k.preset()},
                            {"boundary_layers", k.boundary_layers()},
                            {"boundary_preset", k.boundary_preset()},
                            {"page_bytes", ci.page_bytes()},
                            {"pages_used", ci.pages_used()},
                            {"pages_total", ci.pages_total()},
                            {"sequences", ci.sequences()},
                            {"tokens", ci.tokens()},
                            {"stored_bytes", ci.stored_bytes()},
                            {"stored_bytes_bf16", ci.stored_bytes_bf16()},
                            {"pool_bytes_used", static_cast<int64_t>(ci.pages_used()) * ci.page_bytes()},
                            {"evictions", ci.evictions()},
                            {"bytes_per_token_head", ci.bytes_per_token_head()},
                            {"bytes_per_token", ci.bytes_per_token()}});
    }
    Json tenants = Json::array();
    std::vector<const v1::TenantInfo*> shown;
    if (info->has_tenant()) shown.push_back(&info->tenant());
    for (const v1::TenantInfo& t : info->tenants()) shown.push_back(&t);
    for (const v1::TenantInfo* t : shown) {
      tenants.push_back(Json{{"name", t->name()},
                             {"sequence_prefix", t->sequence_prefix()},
                             {"bytes", t->bytes()},
                             {"max_bytes", t->max_bytes()},
                             {"sequences", t->sequences()},
                             {"max_sequences", t->max_sequences()},
                             {"tokens", t->tokens()},
                             {"quota_refusals", t->quota_refusals()}});
    }
    Json presets = Json::array();
    for (const v1::PresetInfo& p : info->presets()) {
      presets.push_back(Json{{"name", p.name()},
                             {"keys", p.keys()},
                             {"values", p.values()},
                             {"bytes_per_token_head", p.bytes_per_token_head()}});
    }
    PrintJson(Json{{"version", info->version()},
                   {"backend", info->backend()},
                   {"device", info->device()},
                   {"caches", caches},
                   {"tenants", tenants},
                   {"presets", presets}});
    return 0;
  }
  printf("tqkv-server %s at %s\nbackend: %s (%s)\n", info->version().c_str(), WithDefaultPort(c.target).c_str(),
         info->backend().c_str(), info->device().c_str());
  for (const v1::CacheInfo& ci : info->caches()) {
    const v1::CacheConfig& k = ci.config();
    const double ratio = ci.stored_bytes() > 0
                             ? static_cast<double>(ci.stored_bytes_bf16()) / ci.stored_bytes()
                             : 0.0;
    const double pool = static_cast<double>(ci.pages_used()) * static_cast<double>(ci.page_bytes());
    const double pool_ratio = pool > 0 ? static_cast<double>(ci.stored_bytes_bf16()) / pool : 0.0;
    printf("cache '%s': %d layers, %d kv heads, %d query heads, head_dim %d, %d-token pages, "
           "preset %s (%d boundary layers %s)\n",
           k.name().c_str(), k.num_layers(), k.num_kv_heads(), k.num_query_heads(), k.head_dim(),
           k.page_tokens(), k.preset().c_str(), k.boundary_layers(), k.boundary_preset().c_str());
    printf("  %lld bytes per token (%d per token and KV head in a compressed layer)\n",
           static_cast<long long>(ci.bytes_per_token()), ci.bytes_per_token_head());
    printf("  pages %d / %d used (%lld bytes each), %lld sequences, %lld tokens\n",
           ci.pages_used(), ci.pages_total(), static_cast<long long>(ci.page_bytes()),
           static_cast<long long>(ci.sequences()), static_cast<long long>(ci.tokens()));
    printf("  stored %lld bytes (exact copies and key means included) vs %lld as bf16 (x%.2f; from the "
           "pool, whole pages: x%.2f), %lld evictions\n",
           static_cast<long long>(ci.stored_bytes()), static_cast<long long>(ci.stored_bytes_bf16()),
           ratio, pool_ratio, static_cast<long long>(ci.evictions()));
  }
  // A tenant's token sees itself; an admin's every tenant.
  const auto limit = [](int64_t max) { return max == 0 ? std::string("no limit") : absl::StrCat(max); };
  const auto print_tenant = [&limit](const char* what, const v1::TenantInfo& t) {
    printf("%s '%s' (ids '%s...'): %lld bytes of pages (max %s), %lld sequences (max %s), %lld tokens, "
           "%lld quota refusals\n",
           what, t.name().c_str(), t.sequence_prefix().c_str(), static_cast<long long>(t.bytes()),
           limit(t.max_bytes()).c_str(), static_cast<long long>(t.sequences()), limit(t.max_sequences()).c_str(),
           static_cast<long long>(t.tokens()), static_cast<long long>(t.quota_refusals()));
  };
  if (info->has_tenant()) print_tenant("you are tenant", info->tenant());
  for (const v1::TenantInfo& t : info->tenants()) print_tenant("tenant", t);
  std::vector<std::string> names;
  for (const v1::PresetInfo& p : info->presets()) names.push_back(p.name());
  printf("presets: %s\n", absl::StrJoin(names, ", ").c_str());
  return 0;
}

void PrintSequence(const SequenceState& s) {
  printf("sequence '%s' (cache '%s'): %d pages, layer tokens [%s]\n", s.sequence_id.c_str(),
         s.cache.c_str(), s.pages, absl::StrJoin(s.layer_tokens, ", ").c_str());
}

Json SequenceJson(const SequenceState& s) {
  return Json{{"sequence", s.sequence_id},
              {"cache", s.cache},
              {"pages", s.pages},
              {"layer_tokens", s.layer_tokens}};
}

// The sequence as text, or as one JSON object.
void PrintSequence(const SequenceState& s, bool json) {
  if (json) {
    PrintJson(SequenceJson(s));
  } else {
    PrintSequence(s);
  }
}

int RunSequenceImpl(int argc, const char* const* argv) {
  FlagSet flags("sequence", "Shows one sequence: tokens per layer and pages (GetSequence).");
  Connection c;
  std::string id;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("sequence", &id, "sequence id");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  absl::StatusOr<SequenceState> s = Client(*options).GetSequence(c.cache, id);
  if (!s.ok()) return FailRpc(s.status(), c.target);
  PrintSequence(*s, json);
  return 0;
}

int RunAppendImpl(int argc, const char* const* argv) {
  FlagSet flags("append",
                "Appends K/V .npy arrays [layers, tokens, kv_heads, head_dim] to a sequence\n"
                "(created if new) at --start (default: its current length, 0 when new).");
  Connection c;
  std::string id, keys_path, values_path;
  int64_t start = -1, layer_begin = 0, layer_end = 0;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("sequence", &id, "sequence id");
  flags.AddRequiredString("keys", &keys_path, "keys .npy [layers, tokens, kv_heads, head_dim]");
  flags.AddRequiredString("values", &values_path, "values .npy, same shape as keys");
  flags.AddInt("start", &start, "position of the first token (-1: the current length)");
  flags.AddInt("layer-begin", &layer_begin, "first layer of the range");
  flags.AddInt("layer-end", &layer_end, "end of the layer range (0: all layers)");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (!InIntRange(layer_begin, 0, 1 << 20) || !InIntRange(layer_end, 0, 1 << 20)) {
    return UsageError("--layer-begin and --layer-end must be in [0, 2^20]");
  }
  if (start < -1) return UsageError("--start must be >= 0 (or -1: the current length)");
  absl::StatusOr<NpyArray> keys = ReadNpy(keys_path);
  if (!keys.ok()) return Fail(keys.status());
  absl::StatusOr<NpyArray> values = ReadNpy(values_path);
  if (!values.ok()) return Fail(values.status());
  if (keys->shape.size() != 4) {
    return Fail(absl::InvalidArgumentError(absl::StrFormat(
        "%s has %d dims; want [layers, tokens, kv_heads, head_dim]", keys_path,
        keys->shape.size())));
  }
  if (values->shape != keys->shape) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat(values_path, " has shape [", absl::StrJoin(values->shape, ", "),
                     "]; want the keys' [", absl::StrJoin(keys->shape, ", "), "]")));
  }
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  Client client(*options);
  if (start < 0) {
    // The current length. A new sequence starts at 0: ask whether the id
    // exists (ListSequences by prefix, which never fails for a missing id)
    // rather than calling GetSequence and counting a NOT_FOUND on the server
    // for every new sequence.
    absl::StatusOr<std::vector<std::string>> ids = client.ListSequences(c.cache, id);
    if (!ids.ok()) return FailRpc(ids.status(), c.target);
    start = 0;
    if (std::find(ids->begin(), ids->end(), id) != ids->end()) {
      absl::StatusOr<SequenceState> s = client.GetSequence(c.cache, id);
      if (!s.ok()) return FailRpc(s.status(), c.target);
      if (!s->layer_tokens.empty()) {
        start = s->layer_tokens[layer_begin < static_cast<int64_t>(s->layer_tokens.size()) ? layer_begin : 0];
      }
    }
  }
  AppendArgs args;
  args.cache = c.cache;
  args.sequence_id = id;
  args.start_position = start;
  args.layer_begin = static_cast<int>(layer_begin);
  args.layer_end = static_cast<int>(layer_end);
  args.shape = {keys->shape[0], keys->shape[1], keys->shape[2], keys->shape[3]};
  args.keys = keys->data;
  args.values = values->data;
  absl::StatusOr<AppendResult> r = client.Append(args);
  if (!r.ok()) return FailRpc(r.status(), c.target);
  if (json) {
    PrintJson(Json{{"tokens", keys->shape[1]},
                   {"start", start},
                   {"stored_bytes", r->stored_bytes},
                   {"stored_bytes_bf16", r->stored_bytes_bf16},
                   {"sequence", SequenceJson(r->sequence)}});
    return 0;
  }
  printf("appended %lld tokens at %lld: stored %lld bytes (%lld as bf16)\n",
         static_cast<long long>(keys->shape[1]), static_cast<long long>(start),
         static_cast<long long>(r->stored_bytes), static_cast<long long>(r->stored_bytes_bf16));
  PrintSequence(r->sequence);
  return 0;
}

int RunAttendImpl(int argc, const char* const* argv) {
  FlagSet flags("attend",
                "Fused decode attention of queries .npy [query_tokens, query_heads, head_dim]\n"
                "or [query_heads, head_dim] over one layer of a sequence; writes the output.");
  Connection c;
  std::string id, queries_path, out_path, lse_path;
  int64_t layer = 0;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("sequence", &id, "sequence id");
  flags.AddRequiredInt("layer", &layer, "layer");
  flags.AddRequiredString("queries", &queries_path, "queries .npy");
  flags.AddRequiredString("out", &out_path, "output .npy, [query_tokens, query_heads, head_dim]");
  flags.AddString("lse-out", &lse_path, "also write log-sum-exp .npy [query_tokens, query_heads]");
  flags.AddBool("json", &json, "print JSON (the files written and the output's shape)");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (!InIntRange(layer, 0, 1 << 20)) return UsageError("--layer must be in [0, 2^20]");
  absl::StatusOr<NpyArray> q = ReadNpy(queries_path);
  if (!q.ok()) return Fail(q.status());
  if (q->shape.size() == 2) q->shape.insert(q->shape.begin(), 1);
  if (q->shape.size() != 3) {
    return Fail(absl::InvalidArgumentError(absl::StrFormat(
        "%s has %d dims; want [query_tokens, query_heads, head_dim] or [query_heads, head_dim]",
        queries_path, q->shape.size())));
  }
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  AttendArgs args;
  args.cache = c.cache;
  args.return_lse = !lse_path.empty();
  AttendItemArgs item;
  item.sequence_id = id;
  item.layer = static_cast<int>(layer);
  item.shape = {q->shape[0], q->shape[1], q->shape[2]};
  item.queries = q->data;
  args.items.push_back(item);
  absl::StatusOr<std::vector<AttendOutput>> out = Client(*options).Attend(args);
  if (!out.ok()) return FailRpc(out.status(), c.target);
  const AttendOutput& o = out->front();
  const std::vector<int64_t> shape(o.shape.begin(), o.shape.end());
  if (absl::Status s = WriteNpy(out_path, shape, o.output.data()); !s.ok()) return Fail(s);
  if (!lse_path.empty()) {
    if (absl::Status s = WriteNpy(lse_path, {shape[0], shape[1]}, o.lse.data()); !s.ok()) {
      return Fail(s);
    }
  }
  if (json) {
    PrintJson(Json{{"out", out_path},
                   {"shape", shape},
                   {"lse_out", lse_path.empty() ? Json() : Json(lse_path)}});
    return 0;
  }
  printf("wrote %s [%s]\n", out_path.c_str(), absl::StrJoin(shape, ", ").c_str());
  return 0;
}

int RunScoreImpl(int argc, const char* const* argv) {
  FlagSet flags("score",
                "Attention logits of queries .npy [query_heads, head_dim] against one layer's\n"
                "keys; all logits, or the top-k per head with their token positions.");
  Connection c;
  std::string id, queries_path, out_path;
  int64_t layer = 0, top_k = 0, token_begin = 0, token_end = 0;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("sequence", &id, "sequence id");
  flags.AddRequiredInt("layer", &layer, "layer");
  flags.AddRequiredString("queries", &queries_path, "queries .npy [query_heads, head_dim]");
  flags.AddInt("top-k", &top_k, "only the k largest logits per head (0: all)");
  flags.AddInt("token-begin", &token_begin, "first token of the range");
  flags.AddInt("token-end", &token_end, "end of the token range (0: the layer's length)");
  flags.AddString("out", &out_path, "write the logits .npy [query_heads, columns]");
  flags.AddBool("json", &json, "print JSON (logits and positions)");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (!InIntRange(layer, 0, 1 << 20)) return UsageError("--layer must be in [0, 2^20]");
  if (!InIntRange(top_k, 0, 1 << 30)) return UsageError("--top-k must be in [0, 2^30]");
  absl::StatusOr<NpyArray> q = ReadNpy(queries_path);
  if (!q.ok()) return Fail(q.status());
  if (q->shape.size() != 2) {
    return Fail(absl::InvalidArgumentError(absl::StrFormat(
        "%s has %d dims; want [query_heads, head_dim]", queries_path, q->shape.size())));
  }
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  ScoreArgs args;
  args.cache = c.cache;
  args.sequence_id = id;
  args.layer = static_cast<int>(layer);
  args.shape = {q->shape[0], q->shape[1]};
  args.queries = q->data;
  args.top_k = static_cast<int>(top_k);
  args.token_begin = token_begin;
  args.token_end = token_end;
  absl::StatusOr<ScoreResult> r = Client(*options).Score(args);
  if (!r.ok()) return FailRpc(r.status(), c.target);
  if (!out_path.empty()) {
    if (absl::Status s = WriteNpy(out_path, {r->query_heads, r->columns}, r->logits.data());
        !s.ok()) {
      return Fail(s);
    }
  }
  if (json) {
    Json heads = Json::array();
    for (int64_t h = 0; h < r->query_heads; ++h) {
      Json row = {{"head", h},
                  {"logits", FloatArray(r->logits.data() + h * r->columns, r->columns)}};
      if (!r->positions.empty()) {
        const auto first = r->positions.begin() + h * r->columns;
        row["positions"] = std::vector<int64_t>(first, first + r->columns);
      }
      heads.push_back(row);
    }
    PrintJson(Json{{"query_heads", r->query_heads}, {"columns", r->columns}, {"heads", heads}});
    return 0;
  }
  printf("logits [%lld, %lld]\n", static_cast<long long>(r->query_heads),
         static_cast<long long>(r->columns));
  for (int64_t h = 0; h < r->query_heads; ++h) {
    printf("head %lld:", static_cast<long long>(h));
    const int64_t shown = std::min<int64_t>(r->columns, 8);
    for (int64_t i = 0; i < shown; ++i) {
      if (!r->positions.empty()) {
        printf(" %lld:%.4f", static_cast<long long>(r->positions[h * r->columns + i]),
               r->logits[h * r->columns + i]);
      } else {
        printf(" %.4f", r->logits[h * r->columns + i]);
      }
    }
    printf("%s\n", r->columns > shown ? " ..." : "");
  }
  return 0;
}

int RunForkImpl(int argc, const char* const* argv) {
  FlagSet flags("fork", "Creates --child sharing --parent's tokens (copy-on-write pages).");
  Connection c;
  std::string parent, child;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("parent", &parent, "parent sequence id");
  flags.AddRequiredString("child", &child, "new sequence id");
  flags.AddBool("json", &json, "print JSON (the child)");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  absl::StatusOr<SequenceState> s = Client(*options).ForkSequence(c.cache, parent, child);
  if (!s.ok()) return FailRpc(s.status(), c.target);
  PrintSequence(*s, json);
  return 0;
}

int RunDropImpl(int argc, const char* const* argv) {
  FlagSet flags("drop", "Drops a sequence and frees its pages.");
  Connection c;
  std::string id;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("sequence", &id, "sequence id");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  if (absl::Status s = Client(*options).DropSequence(c.cache, id); !s.ok()) return FailRpc(s, c.target);
  if (json) {
    PrintJson(Json{{"dropped", id}});
    return 0;
  }
  printf("dropped '%s'\n", id.c_str());
  return 0;
}

// bf16 bytes of what a sequence holds: K and V of its held tokens per layer.
int64_t Bf16BytesOf(const SequenceState& s, const v1::CacheConfig& layout) {
  int64_t tokens = 0;
  for (size_t l = 0; l < s.layer_tokens.size(); ++l) {
    tokens += s.layer_tokens[l] - (l < s.layer_oldest_token.size() ? s.layer_oldest_token[l] : 0);
  }
  return tokens * layout.num_kv_heads() * layout.head_dim() * 2 * 2;
}

// What a destination needs to pull `request` from the source at `target`.
v1::PullSequencesRequest PullRequest(const std::string& target, const ClientOptions& source,
                                     const v1::ExportRequest& request, const std::string& target_cache) {
  v1::PullSequencesRequest pull;
  pull.set_source(WithDefaultPort(target));
  pull.set_source_auth_token(source.auth_token);
  pull.set_source_tls_root_certs(source.tls_root_certs_pem);
  *pull.mutable_export_request() = request;
  pull.set_target_cache(target_cache);
  return pull;
}

struct MoveFlags {
  Connection to;
  std::string to_cache;
};

void AddDestinationFlags(FlagSet& flags, MoveFlags* m) {
  flags.AddRequiredString("to", &m->to.target, "host:port of the destination tqkv-server");
  flags.AddString("to-cache", &m->to_cache, "destination cache (empty: the source cache's name)");
  flags.AddString("to-auth-token-file", &m->to.auth_token_file, "bearer token file for the destination");
  flags.AddString("to-tls-ca-file", &m->to.tls_ca_file, "PEM CA certificate of the destination: TLS");
}

absl::StatusOr<v1::CacheConfig> CacheLayout(Client& client, const std::string& cache) {
  absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  for (const v1::CacheInfo& c : info->caches()) {
    if (c.config().name() == cache || (cache.empty() && &c == &info->caches(0))) return c.config();
  }
  return absl::NotFoundError(absl::StrCat("cache '", cache, "' not found on the server"));
}

int RunMoveImpl(int argc, const char* const* argv) {
  FlagSet flags("move",
                "Moves sequences to another server at their compressed size (ExportSequences into\n"
                "ImportSequences, relayed message by message), then drops them from the source\n"
                "unless --keep-source. A moved sequence reads bit for bit as before.");
  Connection c;
  MoveFlags m;
  std::string sequences, prefix;
  bool all = false, keep_source = false, json = false;
  AddConnectionFlags(flags, &c);
  AddDestinationFlags(flags, &m);
  flags.AddString("sequences", &sequences, "comma-separated sequence ids");
  flags.AddString("prefix", &prefix, "also every sequence whose id starts with this");
  flags.AddBool("all", &all, "every sequence of the cache");
  flags.AddBool("keep-source", &keep_source, "copy: leave the sequences on the source");
  bool pull = false;
  flags.AddBool("pull", &pull, "the destination pulls from the source itself (PullSequences, admin): no relay here");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (sequences.empty() && prefix.empty() && !all) return UsageError("name --sequences, --prefix or --all");
  absl::StatusOr<ClientOptions> from_options = MakeClientOptions(c);
  if (!from_options.ok()) return Fail(from_options.status());
  absl::StatusOr<ClientOptions> to_options = MakeClientOptions(m.to);
  if (!to_options.ok()) return Fail(to_options.status());
  Client from(*from_options), to(*to_options);
  v1::ExportRequest request;
  request.set_cache(c.cache);
  for (absl::string_view id : absl::StrSplit(sequences, ',', absl::SkipEmpty())) request.add_sequence_ids(std::string(id));
  request.set_id_prefix(prefix);
  request.set_all(all);
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ImportResponse> moved =
      pull ? to.PullSequences(PullRequest(c.target, *from_options, request, m.to_cache))
           : CopySequences(from, to, request, m.to_cache);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!moved.ok()) return Fail(moved.status());
  int dropped = 0;
  if (!keep_source) {
    for (const std::string& id : moved->sequence_ids()) {
      if (absl::Status s = from.DropSequence(c.cache, id); !s.ok()) return Fail(s);
      ++dropped;
    }
  }
  const double gbps = seconds > 0 ? moved->bytes() / seconds / 1e9 : 0;
  if (json) {
    Json ids = Json::array();
    for (const std::string& id : moved->sequence_ids()) ids.push_back(id);
    PrintJson(Json{{"sequences", ids},
                   {"pages", moved->pages()},
                   {"bytes", moved->bytes()},
                   {"seconds", seconds},
                   {"gb_per_s", gbps},
                   {"dropped_from_source", dropped}});
  } else {
    printf("moved %d sequences (%lld pages, %lld bytes) in %.3f s (%.2f GB/s)%s\n", moved->sequence_ids_size(),
           static_cast<long long>(moved->pages()), static_cast<long long>(moved->bytes()), seconds, gbps,
           keep_source ? "; kept on the source" : "; dropped from the source");
  }
  return 0;
}

int RunRebalanceImpl(int argc, const char* const* argv) {
  FlagSet flags("rebalance",
                "After the router's shard set changed: moves every sequence to the server the router\n"
                "now sends its routing key to. The router itself says where a key goes (a\n"
                "GetServerInfo routed by the key names its server's instance_id), so any router\n"
                "with any hash works; --servers lists every server that may hold sequences (the\n"
                "old set and the new). To drain a server before removing it: take it out of the\n"
                "router, then rebalance with it still in --servers (--from limits the moves to it).\n"
                "The ids of one routing key (forks 'chat-7/...' of 'chat-7') move in one stream, so the\n"
                "pages they share travel once and stay shared.");
  Connection c;
  std::string router, servers, only_from;
  bool dry_run = false, json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("router", &router, "host:port of the router (haproxy)");
  flags.AddRequiredString("servers", &servers, "comma-separated host:port of every tqkv-server behind it");
  flags.AddString("from", &only_from, "only move sequences off this server (host:port, one of --servers)");
  flags.AddBool("dry-run", &dry_run, "say what would move, move nothing");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  const auto options_for = [&c](const std::string& target) {
    Connection to = c;
    to.target = target;
    return MakeClientOptions(to);
  };
  struct Shard {
    std::string target;
    std::unique_ptr<Client> client;
    std::string instance;
  };
  std::vector<Shard> shards;
  std::map<std::string, size_t> by_instance;
  for (absl::string_view t : absl::StrSplit(servers, ',', absl::SkipEmpty())) {
    absl::StatusOr<ClientOptions> o = options_for(std::string(t));
    if (!o.ok()) return Fail(o.status());
    Shard shard{std::string(t), std::make_unique<Client>(*o), ""};
    absl::StatusOr<v1::ServerInfo> info = shard.client->GetServerInfo();
    if (!info.ok()) return Fail(absl::Status(info.status().code(), absl::StrCat(t, ": ", info.status().message())));
    shard.instance = info->instance_id();
    by_instance[shard.instance] = shards.size();
    shards.push_back(std::move(shard));
  }
  if (!only_from.empty() &&
      std::none_of(shards.begin(), shards.end(), [&](const Shard& s) { return s.target == only_from; })) {
    return UsageError("--from must be one of --servers");
  }
  absl::StatusOr<ClientOptions> router_options = options_for(router);
  if (!router_options.ok()) return Fail(router_options.status());
  Client via(*router_options);
  std::map<std::string, size_t> owner_of_key;  // routing key -> shard
  int64_t moved = 0, kept = 0, bytes = 0;
  Json moves = Json::array();
  const absl::Time start = absl::Now();
  for (size_t from = 0; from < shards.size(); ++from) {
    if (!only_from.empty() && shards[from].target != only_from) continue;
    absl::StatusOr<std::vector<std::string>> ids = shards[from].client->ListSequences(c.cache);
    if (!ids.ok()) return Fail(ids.status());
    // The ids of each routing key move together, to one server.
    std::map<std::string, std::vector<std::string>> groups;
    for (const std::string& id : *ids) groups[RouteKey(id)].push_back(id);
    for (const auto& [key, group] : groups) {
      auto it = owner_of_key.find(key);
      if (it == owner_of_key.end()) {
        absl::StatusOr<std::string> instance = via.InstanceFor(group.front());
        if (!instance.ok()) return Fail(instance.status());
        auto shard = by_instance.find(*instance);
        if (shard == by_instance.end()) {
          return Fail(absl::FailedPreconditionError(absl::StrFormat(
              "the router sends key '%s' to a server not in --servers (instance %s)", key, *instance)));
        }
        it = owner_of_key.emplace(key, shard->second).first;
      }
      const size_t to = it->second;
      if (to == from) {
        kept += static_cast<int64_t>(group.size());
        continue;
      }
      for (const std::string& id : group) {
        moves.push_back(
            Json{{"sequence", id}, {"from", shards[from].target}, {"to", shards[to].target}});
        if (!json) printf("%s %s: %s -> %s\n", dry_run ? "would move" : "moving", id.c_str(), shards[from].target.c_str(),
                          shards[to].target.c_str());
      }
      if (dry_run) {
        moved += static_cast<int64_t>(group.size());
        continue;
      }
      v1::ExportRequest request;
      request.set_cache(c.cache);
      for (const std::string& id : group) request.add_sequence_ids(id);
      absl::StatusOr<v1::ImportResponse> copied = CopySequences(*shards[from].client, *shards[to].client, request);
      if (!copied.ok()) {
        return Fail(absl::Status(copied.status().code(), absl::StrCat("moving key '", key, "' from ", shards[from].target,
                                                                      " to ", shards[to].target, ": ",
                                                                      copied.status().message())));
      }
      // Dropped from the old home only once the new one holds them all.
      for (const std::string& id : group) {
        if (absl::Status s = shards[from].client->DropSequence(c.cache, id); !s.ok()) return Fail(s);
      }
      moved += static_cast<int64_t>(group.size());
      bytes += copied->bytes();
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (json) {
    PrintJson(Json{{"moved", moved},
                   {"kept", kept},
                   {"bytes", bytes},
                   {"seconds", seconds},
                   {"dry_run", dry_run},
                   {"moves", moves}});
  } else {
    printf("%s %lld sequences (%lld bytes), %lld already home, in %.2f s\n", dry_run ? "would move" : "moved",
           static_cast<long long>(moved), static_cast<long long>(bytes), static_cast<long long>(kept), seconds);
  }
  return 0;
}

int RunBenchMoveImpl(int argc, const char* const* argv) {
  FlagSet flags("bench move",
                "Prefills one sequence of --context tokens on the source server (random K/V, bf16 on\n"
                "the wire), then times moving it to the destination (export + import, relayed by this\n"
                "process) --rounds times, dropping the copy between rounds. Checks that the copy's\n"
                "Attend equals the source's bit for bit; prints the bytes moved next to the same\n"
                "tokens in bf16, and GB/s of compressed bytes (median round).");
  Connection c;
  MoveFlags m;
  int64_t context = 32768, rounds = 3;
  bool json = false;
  AddConnectionFlags(flags, &c);
  AddDestinationFlags(flags, &m);
  flags.AddInt("context", &context, "tokens of the sequence moved");
  flags.AddInt("rounds", &rounds, "timed moves");
  bool pull = false;
  flags.AddBool("pull", &pull, "the destination pulls from the source (PullSequences): no relay process");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (!InIntRange(context, 1, int64_t{1} << 22) || !InIntRange(rounds, 1, 100)) {
    return UsageError("--context wants 1..2^22 and --rounds 1..100");
  }
  absl::StatusOr<ClientOptions> from_options = MakeClientOptions(c);
  if (!from_options.ok()) return Fail(from_options.status());
  absl::StatusOr<ClientOptions> to_options = MakeClientOptions(m.to);
  if (!to_options.ok()) return Fail(to_options.status());
  Client from(*from_options), to(*to_options);
  absl::StatusOr<v1::CacheConfig> layout = CacheLayout(from, c.cache);
  if (!layout.ok()) return Fail(layout.status());
  const int64_t layers = layout->num_layers(), heads = layout->num_kv_heads(), dim = layout->head_dim();
  const std::string id = absl::StrCat("bench-move-", absl::ToUnixMicros(absl::Now()));

  // Prefill in chunks of at most ~32 MiB on the wire, the same random chunk
  // each time (what the bytes are does not change what moving them costs).
  const int64_t chunk_tokens = std::max<int64_t>(1, (int64_t{32} << 20) / (layers * heads * dim * 2 * 2));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> kv(static_cast<size_t>(layers * std::min(chunk_tokens, context) * heads * dim));
  for (float& x : kv) x = normal(rng);
  fprintf(stderr, "prefilling %lld tokens of '%s'...\n", static_cast<long long>(context), id.c_str());
  std::vector<AppendArgs> chunks;
  for (int64_t t = 0; t < context; t += chunk_tokens) {
    const int64_t n = std::min(chunk_tokens, context - t);
    AppendArgs a;
    a.cache = c.cache;
    a.sequence_id = id;
    a.start_position = t;
    a.shape = {layers, n, heads, dim};
    a.keys = absl::MakeConstSpan(kv.data(), static_cast<size_t>(layers * n * heads * dim));
    a.values = a.keys;
    a.wire_dtype = v1::DTYPE_BF16;
    chunks.push_back(a);
  }
  if (absl::StatusOr<AppendResult> r = from.AppendStream(chunks); !r.ok()) return Fail(r.status());
  absl::StatusOr<SequenceState> state = from.GetSequence(c.cache, id);
  if (!state.ok()) return Fail(state.status());
  const int64_t bf16_bytes = Bf16BytesOf(*state, *layout);

  v1::ExportRequest request;
  request.set_cache(c.cache);
  request.add_sequence_ids(id);
  std::vector<double> seconds;
  int64_t bytes = 0;
  bool identical = true;
  const std::string dest_cache = m.to_cache.empty() ? c.cache : m.to_cache;
  for (int64_t r = 0; r < rounds; ++r) {
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::ImportResponse> moved =
        pull ? to.PullSequences(PullRequest(c.target, *from_options, request, m.to_cache))
             : CopySequences(from, to, request, m.to_cache);
    seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    if (!moved.ok()) return Fail(moved.status());
    bytes = moved->bytes();
    if (r == 0) {
      // The copy answers exactly as the source: first and last layer.
      std::vector<float> q(static_cast<size_t>(layout->num_query_heads() * dim));
      for (float& x : q) x = normal(rng);
      for (int64_t layer : {int64_t{0}, layers - 1}) {
        AttendItemArgs item;
        item.sequence_id = id;
        item.layer = static_cast<int>(layer);
        item.shape = {1, layout->num_query_heads(), dim};
        item.queries = q;
        AttendArgs args;
        args.items = {item};
        args.cache = c.cache;
        absl::StatusOr<std::vector<AttendOutput>> a = from.Attend(args);
        args.cache = dest_cache;
        absl::StatusOr<std::vector<AttendOutput>> b = to.Attend(args);
        if (!a.ok()) return Fail(a.status());
        if (!b.ok()) return Fail(b.status());
        identical = identical && (*a)[0].output == (*b)[0].output;
      }
    }
    if (absl::Status s = to.DropSequence(dest_cache, id); !s.ok()) return Fail(s);
  }
  (void)from.DropSequence(c.cache, id);
  std::vector<double> sorted = seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const double gbps = bytes / median / 1e9;
  const double ratio = static_cast<double>(bytes) / bf16_bytes;
  if (json) {
    PrintJson(Json{{"context", context},
                   {"preset", layout->preset()},
                   {"bytes_moved", bytes},
                   {"bf16_bytes", bf16_bytes},
                   {"ratio_to_bf16", ratio},
                   {"seconds", seconds},
                   {"median_seconds", median},
                   {"gb_per_s", gbps},
                   {"identical_attend", identical}});
  } else {
    printf("moved %lld tokens (%lld layers, preset %s): %lld bytes = %.3fx their %lld bf16 bytes\n",
           static_cast<long long>(context), static_cast<long long>(layers), layout->preset().c_str(),
           static_cast<long long>(bytes), ratio, static_cast<long long>(bf16_bytes));
    printf("median of %zu rounds %.3f s (%s): %.2f GB/s of compressed bytes (bf16 at that rate: %.3f s); attend "
           "on the copy %s\n",
           seconds.size(), median, pull ? "pulled by the destination" : "relayed by this process", gbps,
           bf16_bytes / (gbps * 1e9), identical ? "identical" : "DIFFERS");
  }
  return identical ? 0 : kExitFailure;
}

int RunDecodeLoadTable(const DecodeLoadOptions& options, bool json, bool quiet, const std::string& target) {
  absl::StatusOr<DecodeLoadReport> report = RunDecodeLoad(options);
  if (!quiet) fprintf(stderr, "\n");
  if (!report.ok()) return FailRpc(report.status(), target);
  const DecodeLoadReport& r = *report;
  int64_t errors = 0;
  if (json) {
    Json variants = Json::array();
    for (const DecodeVariantReport& v : r.variants) {
      errors += v.errors;
      Json row = Json{{"variant", DecodeVariantName(v.variant)},
                      {"steps", v.steps},
                      {"errors", v.errors},
                      {"rpcs_per_step", v.rpcs_per_step},
                      {"messages_per_step", v.messages_per_step},
                      {"step_p50_ms", v.step_p50_ms},
                      {"step_p99_ms", v.step_p99_ms},
                      {"step_mean_ms", v.step_mean_ms},
                      {"tokens_per_second_per_sequence", v.tokens_per_second_per_sequence},
                      {"tokens_per_second", v.tokens_per_second}};
      row["kernel_ms_per_step"] = v.kernel_ms_per_step >= 0 ? Json(v.kernel_ms_per_step) : Json();
      row["kernel_share"] = v.kernel_share >= 0 ? Json(v.kernel_share) : Json();
      row["outside_us_per_layer"] =
          v.outside_us_per_layer >= 0 ? Json(v.outside_us_per_layer) : Json();
      row["server_us_per_layer"] =
          v.server_us_per_layer >= 0 ? Json(v.server_us_per_layer) : Json();
      row["transport_us_per_layer"] =
          v.transport_us_per_layer >= 0 ? Json(v.transport_us_per_layer) : Json();
      if (!v.first_error.empty()) row["first_error"] = v.first_error;
      variants.push_back(row);
    }
    PrintJson(Json{{"mode", "decode"},
                   {"layers", r.layers},
                   {"kv_heads", r.kv_heads},
                   {"query_heads", r.query_heads},
                   {"head_dim", r.head_dim},
                   {"engines", options.clients},
                   {"batch", options.batch},
                   {"context", options.context},
                   {"variants", variants}});
    return errors > 0 ? kExitFailure : 0;
  }
  printf("layer-by-layer decode: %d layers, %d KV heads, %d query heads, head_dim %d; %d "
         "engine(s) x batch %d, context %lld\n",
         r.layers, r.kv_heads, r.query_heads, r.head_dim, options.clients, options.batch,
         static_cast<long long>(options.context));
  printf("%-7s %6s %6s %9s %9s %9s %10s %8s %12s %10s %10s %10s %10s\n", "variant", "steps",
         "errors", "rpcs/step", "p50_ms", "p99_ms", "kernel_ms", "kernel%", "outside_us/l",
         "server_us", "grpc_us", "tok/s/seq", "tok/s");
  const DecodeVariantReport* unary = nullptr;
  for (const DecodeVariantReport& v : r.variants) {
    errors += v.errors;
    if (v.variant == DecodeVariant::kUnary) unary = &v;
    const double calls = v.variant == DecodeVariant::kStream ? v.messages_per_step : v.rpcs_per_step;
    printf("%-7s %6lld %6lld %8.0f%s %9.2f %9.2f %10.2f %7.1f%% %12.0f %10.0f %10.0f %10.1f %10.1f\n",
           DecodeVariantName(v.variant), static_cast<long long>(v.steps),
           static_cast<long long>(v.errors), calls,
           v.variant == DecodeVariant::kStream ? "m" : " ", v.step_p50_ms, v.step_p99_ms,
           v.kernel_ms_per_step, 100 * v.kernel_share, v.outside_us_per_layer,
           v.server_us_per_layer, v.transport_us_per_layer, v.tokens_per_second_per_sequence,
           v.tokens_per_second);
  }
  printf("(m: stream messages per step, on one stream; outside_us/l: mean step time minus the "
         "server's kernel time, per layer = server_us (handlers minus kernels) + grpc_us (beyond "
         "the handlers: gRPC, loopback, the client))\n");
  if (unary != nullptr && unary->outside_us_per_layer > 0) {
    for (const DecodeVariantReport& v : r.variants) {
      if (&v == unary || v.outside_us_per_layer < 0) continue;
      printf("%s: time outside the kernels per layer is %.2fx unary's (%.0f vs %.0f us)\n",
             DecodeVariantName(v.variant), v.outside_us_per_layer / unary->outside_us_per_layer,
             v.outside_us_per_layer, unary->outside_us_per_layer);
    }
  }
  for (const DecodeVariantReport& v : r.variants) {
    if (!v.first_error.empty()) {
      printf("%s first error: %s\n", DecodeVariantName(v.variant), v.first_error.c_str());
    }
  }
  return errors > 0 ? kExitFailure : 0;
}

int RunLoadImpl(int argc, const char* const* argv) {
  FlagSet flags("load",
                "Load generator. --mode decode (default): a decode node's loop, layer by layer:\n"
                "engines (--clients) of --batch sequences prefilled with --context tokens, then\n"
                "--decode-steps steps, each layer one round trip, as unary Append+Attend, a fused\n"
                "AppendAttend, or a DecodeStream message (--variants, run side by side); prints\n"
                "step p50/p99, rpcs per step, the kernels' share and the time outside them per\n"
                "layer, tokens/s. --mode mixed: N clients loop prefill, decode steps (Append 1\n"
                "token to all layers + one Attend over them, ScoreQuery now and then), Drop;\n"
                "calls/s and p50/p99 per method.");
  Connection c;
  std::string mode = "decode", variants = "unary,fused,stream", wire = "f32";
  int64_t clients = 0, requests = 0, prefill = 512, chunk = 0, steps = 0, per_client = 0,
          layers = 0, score_every = 16, top_k = 8, seed = 1, batch = 8, context = 1024;
  double duration = 10, max_seconds = 0, give_up = 10;
  bool json = false, quiet = false;
  AddConnectionFlags(flags, &c);
  flags.AddString("mode", &mode, "decode (layer by layer) or mixed");
  flags.AddInt("clients", &clients, "concurrent clients (decode: engines); 0: 1 (decode), 8 (mixed)");
  flags.AddString("variants", &variants, "decode: unary,fused,stream (any subset, run in order)");
  flags.AddInt("batch", &batch, "decode: sequences per engine, attended together per layer");
  flags.AddInt("context", &context, "decode: tokens prefilled per sequence before the steps");
  flags.AddDouble("max-seconds", &max_seconds, "decode: end a variant's steps after this long (0: off)");
  flags.AddString("wire-dtype", &wire, "decode: f32, f16 or bf16 for K, V, queries and outputs on the wire");
  flags.AddDouble("duration-seconds", &duration, "mixed: stop after this long (0: no time bound)");
  flags.AddInt("requests", &requests, "mixed: stop after this many calls (0: no count bound)");
  flags.AddInt("prefill-tokens", &prefill, "mixed: prefill tokens per sequence");
  flags.AddInt("prefill-chunk-tokens", &chunk,
               "prefills longer than this go as AppendStream chunks (0: 256 decode, 64 mixed)");
  flags.AddInt("decode-steps", &steps, "decode steps per sequence (0: 16 decode, 64 mixed)");
  flags.AddInt("sequences-per-client", &per_client, "mixed: sequences per client (0: until a bound)");
  flags.AddInt("layers", &layers, "layers appended and attended (0: the cache's)");
  flags.AddInt("score-every", &score_every, "mixed: a ScoreQuery every this many steps (0: never)");
  flags.AddInt("top-k", &top_k, "mixed: top_k of the ScoreQuery calls");
  flags.AddInt("seed", &seed, "data seed");
  flags.AddDouble("give-up-seconds", &give_up,
                  "mixed: stop when the server has answered nothing (every call UNAVAILABLE) this long; "
                  "meanwhile each client backs off, 50 ms doubling to 1 s");
  flags.AddBool("json", &json, "print JSON instead of a table");
  flags.AddBool("quiet", &quiet, "no live progress line");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (mode != "decode" && mode != "mixed") return UsageError("--mode must be decode or mixed");
  const bool decode = mode == "decode";
  if (clients == 0) clients = decode ? 1 : 8;
  if (chunk == 0) chunk = decode ? 256 : 64;
  if (steps == 0) steps = decode ? 16 : 64;
  if (!InIntRange(clients, 1, 1024)) return UsageError("--clients must be in [1, 1024]");
  if (!InIntRange(prefill, 0, 1 << 20) || !InIntRange(chunk, 1, 1 << 20) ||
      !InIntRange(steps, 1, 1 << 20) || per_client < 0 || !InIntRange(layers, 0, 1 << 20) ||
      !InIntRange(score_every, 0, 1 << 20) || !InIntRange(top_k, 1, 1 << 20) ||
      !InIntRange(batch, 1, 4096) || !InIntRange(context, 0, 1 << 24)) {
    return UsageError("token, step, batch, layer and top-k counts must be in range (see --help)");
  }
  absl::StatusOr<ClientOptions> client = MakeClientOptions(c);
  if (!client.ok()) return Fail(client.status());
  if (decode) {
    DecodeLoadOptions options;
    options.client = *client;
    options.cache = c.cache;
    absl::StatusOr<std::vector<DecodeVariant>> parsed = ParseDecodeVariants(variants);
    if (!parsed.ok()) return UsageError(std::string("--variants: ") + std::string(parsed.status().message()));
    options.variants = *parsed;
    options.clients = static_cast<int>(clients);
    options.batch = static_cast<int>(batch);
    options.context = context;
    options.steps = steps;
    if (!(max_seconds >= 0) || max_seconds > 86400) {
      return UsageError("--max-seconds must be in [0, 86400]");
    }
    options.max_seconds_per_variant = max_seconds;
    options.layers = static_cast<int>(layers);
    options.prefill_chunk_tokens = chunk;
    if (wire == "f32") {
      options.wire_dtype = v1::DTYPE_F32;
    } else if (wire == "f16") {
      options.wire_dtype = v1::DTYPE_F16;
    } else if (wire == "bf16") {
      options.wire_dtype = v1::DTYPE_BF16;
    } else {
      return UsageError("--wire-dtype must be f32, f16 or bf16");
    }
    options.seed = static_cast<uint64_t>(seed);
    if (!quiet) {
      options.progress = [](DecodeVariant v, const char* phase, int64_t done) {
        fprintf(stderr, "\r%-6s %-8s %6lld steps ", DecodeVariantName(v), phase,
                static_cast<long long>(done));
        fflush(stderr);
      };
    }
    return RunDecodeLoadTable(options, json, quiet, c.target);
  }
  if (!(duration >= 0) || duration > 86400) {
    return UsageError("--duration-seconds must be in [0, 86400]");
  }
  if (requests < 0) return UsageError("--requests must be >= 0");
  if (!(give_up > 0) || give_up > 86400) return UsageError("--give-up-seconds must be in (0, 86400]");
  if (duration == 0 && requests == 0) {
    return UsageError("give --duration-seconds or --requests: the run must end");
  }
  LoadOptions options;
  options.client = *client;
  options.cache = c.cache;
  options.clients = static_cast<int>(clients);
  options.duration_seconds = duration;
  options.requests = requests;
  options.prefill_tokens = prefill;
  options.prefill_chunk_tokens = chunk;
  options.decode_steps = steps;
  options.sequences_per_client = per_client;
  options.layers = static_cast<int>(layers);
  options.score_every = static_cast<int>(score_every);
  options.top_k = static_cast<int>(top_k);
  options.seed = static_cast<uint64_t>(seed);
  options.give_up_seconds = give_up;
  if (!quiet) {
    options.progress = [](double elapsed, int64_t calls, int64_t errors) {
      fprintf(stderr, "\r%6.1f s  %9lld calls  %9.1f calls/s  %lld errors ", elapsed,
              static_cast<long long>(calls), elapsed > 0 ? calls / elapsed : 0.0,
              static_cast<long long>(errors));
      fflush(stderr);
    };
  }
  absl::StatusOr<LoadReport> report = RunLoad(options);
  if (!quiet) fprintf(stderr, "\n");
  if (!report.ok()) return FailRpc(report.status(), c.target);
  const LoadReport& r = *report;
  if (json) {
    Json methods = Json::array();
    for (const MethodStats& m : r.methods) {
      methods.push_back(Json{{"method", m.method},
                             {"calls", m.calls},
                             {"errors", m.errors},
                             {"calls_per_second", m.calls_per_second},
                             {"p50_ms", m.p50_ms},
                             {"p99_ms", m.p99_ms}});
    }
    Json out =
        Json{{"clients", clients}, {"elapsed_seconds", r.elapsed_seconds}, {"calls", r.calls},
             {"errors", r.errors}, {"tokens_appended", r.tokens_appended}, {"methods", methods}};
    out["server_attend_seconds"] =
        r.server_attend_seconds >= 0 ? Json(r.server_attend_seconds) : Json();
    out["attend_kernel_share"] = r.attend_kernel_share >= 0 ? Json(r.attend_kernel_share) : Json();
    if (!r.first_error.empty()) out["first_error"] = r.first_error;
    if (!r.server_lost.ok()) out["server_lost"] = r.server_lost.ToString();
    PrintJson(out);
  } else {
    printf("%lld clients, %.2f s, %lld calls, %lld errors, %lld tokens appended\n",
           static_cast<long long>(clients), r.elapsed_seconds, static_cast<long long>(r.calls),
           static_cast<long long>(r.errors), static_cast<long long>(r.tokens_appended));
    printf("%-14s %9s %7s %10s %9s %9s\n", "method", "calls", "errors", "calls/s", "p50_ms",
           "p99_ms");
    for (const MethodStats& m : r.methods) {
      printf("%-14s %9lld %7lld %10.1f %9.3f %9.3f\n", m.method.c_str(),
             static_cast<long long>(m.calls), static_cast<long long>(m.errors),
             m.calls_per_second, m.p50_ms, m.p99_ms);
    }
    if (r.attend_kernel_share >= 0) {
      printf("attend kernel share: %.1f%% of server-side Attend time (%.3f s); %.1f%% outside "
             "the kernel\n",
             100 * r.attend_kernel_share, r.server_attend_seconds,
             100 * (1 - r.attend_kernel_share));
    }
    if (!r.first_error.empty()) printf("first error: %s\n", r.first_error.c_str());
  }
  if (!r.server_lost.ok()) {
    std::string why = UnreachableMessage(r.server_lost, WithDefaultPort(c.target));
    if (why.empty()) why = r.server_lost.ToString();
    fprintf(stderr, "tqkv load: stopped after %.1f s of failed calls: %s\n", give_up, why.c_str());
  }
  return r.errors > 0 ? kExitFailure : 0;
}

}  // namespace

int RunInfo(int argc, const char* const* argv) { return RunInfoImpl(argc, argv); }
int RunSequence(int argc, const char* const* argv) { return RunSequenceImpl(argc, argv); }
int RunAppend(int argc, const char* const* argv) { return RunAppendImpl(argc, argv); }
int RunAttend(int argc, const char* const* argv) { return RunAttendImpl(argc, argv); }
int RunScore(int argc, const char* const* argv) { return RunScoreImpl(argc, argv); }
int RunFork(int argc, const char* const* argv) { return RunForkImpl(argc, argv); }
int RunDrop(int argc, const char* const* argv) { return RunDropImpl(argc, argv); }
int RunMove(int argc, const char* const* argv) { return RunMoveImpl(argc, argv); }
int RunRebalance(int argc, const char* const* argv) { return RunRebalanceImpl(argc, argv); }
int RunBenchMove(int argc, const char* const* argv) { return RunBenchMoveImpl(argc, argv); }
int RunLoad(int argc, const char* const* argv) { return RunLoadImpl(argc, argv); }

}  // namespace cli
}  // namespace tqkv
